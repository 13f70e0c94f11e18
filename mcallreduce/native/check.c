/* The cross-rank metadata check, and the small allreduces that travel with it.
 *
 * Every call of every rank runs the same recursive doubling over all ranks (a rank past the
 * largest power of two first hands its part to a partner and gets the result back at the
 * end). Each message is [the MAX of the metadata vectors seen so far | data]: the data only
 * in a fused call, a small allreduce reduced along the way (so it costs the check's
 * latency and nothing more). A message travels in pieces of at most `piece_bytes` (across
 * hosts: under the TCP eager limit, so no piece waits for a clear-to-send round trip); its
 * first piece starts with [total bytes | piece bytes], from which the receiver posts the
 * rest. The first receive is always posted for the largest message any call sends, so
 * ranks that disagree about a call still exchange the same messages, see the difference
 * and raise instead of hanging; a fused call's data is reduced only while both
 * sides agree, into a copy, and reaches the user's buffer only once every rank agreed.
 * The MAX over [x, -x] equals this rank's vector exactly when every rank sent the same
 * (mcallreduce/metadata.py). Both partners of an exchange combine the lower rank's data as
 * the left operand, so every rank computes bitwise the same result.
 *
 * On one host the completed check is also the shared-memory stage's first sync: every
 * rank's first message, sent after it published, reaches every other rank along the way.
 */
#include "executor.h"

#include <stdlib.h>

#define HEADER_BYTES (2 * sizeof(int64_t))   /* a message's total bytes, its piece bytes */

size_t check_capacity(EngineObject *e, run_t *r) {
    return HEADER_BYTES + sizeof(int64_t) * (size_t)r->nmeta + e->fused_max;
}

char *check_data(run_t *r) { return r->cmine + HEADER_BYTES + sizeof(int64_t) * (size_t)r->nmeta; }

static int largest_power_of_two(int p) {
    int q = 1;
    while (q * 2 <= p) q *= 2;
    return q;
}

/* Step k of this rank: its peer and message tags (-1: no send / no receive); 0 when done.
   Tags: 0 the fold-in, 1 + i the exchange across bit i, 1 + log2(p2) the fold-out. */
static int step_of(int rank, int p, int k, int *peer, int *send_tag, int *recv_tag) {
    int p2 = largest_power_of_two(p), extra = p - p2, bits = 0;
    while ((1 << bits) < p2) bits++;
    if (rank >= p2) {                     /* hand over, get the result back */
        if (k > 0) return 0;
        *peer = rank - p2; *send_tag = 0; *recv_tag = 1 + bits;
        return 1;
    }
    int first = rank < extra ? 1 : 0;     /* ranks with a partner past p2 fold it in first */
    if (first && k == 0) { *peer = rank + p2; *send_tag = -1; *recv_tag = 0; return 1; }
    int i = k - first;
    if (i < bits) { *peer = rank ^ (1 << i); *send_tag = 1 + i; *recv_tag = 1 + i; return 1; }
    if (first && i == bits) { *peer = rank + p2; *send_tag = 1 + bits; *recv_tag = -1; return 1; }
    return 0;
}

/* Post the current step's messages, or, after the last step, the check is done. Never a
   blocking MPI call: a wait in Waitsome also sees a peer's goodbye and the stall limit. */
static void post_step(EngineObject *e, run_t *r) {
    int peer, send_tag, recv_tag;
    if (!step_of(e->rank, e->size, r->cstep, &peer, &send_tag, &recv_tag)) {
        memcpy(r->meta_out, r->cmine + HEADER_BYTES, sizeof(int64_t) * (size_t)r->nmeta);
        checked(e, r);
        return;
    }
    size_t piece = e->piece_bytes, total = r->cmine_bytes;
    int pieces = (int)((total + piece - 1) / piece);
    r->pending = (send_tag >= 0 ? pieces : 0) + (recv_tag >= 0);
    r->received = -1;
    if (recv_tag >= 0)
        POST(e, r, OWNER_CHECK_RECV, MPI_Irecv(r->crecv, (int)check_capacity(e, r), MPI_BYTE, peer,
                                               r->tag0 + e->check_tag - recv_tag, e->ctl, &req_));
    for (int k = 0; send_tag >= 0 && k < pieces; k++) {
        size_t at = (size_t)k * piece, bytes = total - at < piece ? total - at : piece;
        POST(e, r, OWNER_CHECK_SEND, MPI_Isend(r->cmine + at, (int)bytes, MPI_BYTE, peer,
                                               r->tag0 + e->check_tag - send_tag, e->ctl, &req_));
    }
}

/* The first piece arrived: post the receives of the rest, as its header announces (pieces
   of one source and tag match in the order they were sent). */
static void post_rest(EngineObject *e, run_t *r, int first_bytes, int peer, int recv_tag) {
    const int64_t *header = (const int64_t *)r->crecv;
    size_t capacity = check_capacity(e, r);
    if (first_bytes < (int)HEADER_BYTES) return;   /* not this protocol: merge() says so */
    int64_t total = header[0], piece = header[1];
    if (piece <= 0 || total < first_bytes || (size_t)total > capacity || first_bytes != (total < piece ? total : piece)) {
        r->received = 0;   /* a malformed header: merge() treats it as a mismatch; its rest stays unread */
        return;
    }
    for (int64_t at = piece; at < total; at += piece) {
        r->pending++;
        POST(e, r, OWNER_CHECK_PIECE, MPI_Irecv(r->crecv + at, (int)(capacity - (size_t)at), MPI_BYTE, peer,
                                                r->tag0 + e->check_tag - recv_tag, e->ctl, &req_));
    }
}

/* Fold the received message into this rank's: the MAX of the vectors, and a fused call's data. */
static void merge(EngineObject *e, run_t *r, int peer, int fold_out) {
    size_t meta_bytes = sizeof(int64_t) * (size_t)r->nmeta, body = HEADER_BYTES + meta_bytes;
    int64_t *mine = (int64_t *)(r->cmine + HEADER_BYTES), *theirs = (int64_t *)(r->crecv + HEADER_BYTES);
    if (r->received < (int)body) {   /* not a check message of this protocol */
        r->data_bad = 1;
        for (int k = 0; k < r->nmeta; k++) mine[k] = INT64_MAX;
        return;
    }
    if (fold_out) {                        /* the partner's final state is the result */
        memcpy(mine, theirs, meta_bytes);
        if ((size_t)r->received == r->cmine_bytes)
            memcpy(r->cmine + body, r->crecv + body, r->cmine_bytes - body);
        else
            r->data_bad = 1;
        return;
    }
    int agree = (size_t)r->received == r->cmine_bytes && memcmp(mine, theirs, meta_bytes) == 0;
    for (int k = 0; k < r->nmeta; k++) if (theirs[k] > mine[k]) mine[k] = theirs[k];
    if (r->kind != KIND_FUSED || r->data_bad) return;
    if (!agree) { r->data_bad = 1; return; }
    reduce_into(r->dtype, r->op, r->cmine + body, r->crecv + body, r->nelem, peer < e->rank);
}

void check_completed(EngineObject *e, run_t *r, int32_t owner, int received_bytes) {
    int peer, send_tag, recv_tag;
    step_of(e->rank, e->size, r->cstep, &peer, &send_tag, &recv_tag);
    if (owner == OWNER_CHECK_RECV) {
        r->received = received_bytes;
        post_rest(e, r, received_bytes, peer, recv_tag);
        if (r->done) return;
    } else if (owner == OWNER_CHECK_PIECE) {
        r->received += received_bytes;
    }
    if (--r->pending > 0) return;
    if (recv_tag >= 0) merge(e, r, peer, e->rank >= largest_power_of_two(e->size));
    r->cstep++;
    post_step(e, r);
}

int check_peer(EngineObject *e, run_t *r) {
    int peer, send_tag, recv_tag;
    return step_of(e->rank, e->size, r->cstep, &peer, &send_tag, &recv_tag) ? peer : -1;
}

void start_check(EngineObject *e, run_t *r) {
    if (r->check == CHECK_OFF) { checked(e, r); return; }
    size_t meta_bytes = sizeof(int64_t) * (size_t)r->nmeta;
    size_t data_bytes = r->kind == KIND_FUSED ? (size_t)r->nelem * r->isz : 0;
    if (data_bytes > e->fused_max) { fail_run(e, r, "internal error: a fused call above the limit", MPI_SUCCESS); return; }
    r->cmine_bytes = HEADER_BYTES + meta_bytes + data_bytes;
    r->cmine = malloc(r->cmine_bytes);
    r->crecv = pool_take(e, check_capacity(e, r));
    if (!r->cmine || !r->crecv) { fail_run(e, r, "out of memory", MPI_SUCCESS); return; }
    int64_t *header = (int64_t *)r->cmine;
    header[0] = (int64_t)r->cmine_bytes;
    header[1] = (int64_t)e->piece_bytes;
    memcpy(r->cmine + HEADER_BYTES, r->meta, meta_bytes);
    if (data_bytes) {   /* a copy: the user's buffer changes only once every rank agreed */
        memcpy(check_data(r), r->buf, data_bytes);
        scale_buffer(r->dtype, check_data(r), r->nelem, r->pre);
    }
    r->cstep = 0;
    post_step(e, r);
}
