/* The cross-rank metadata check, and the small allreduces that travel with it.
 *
 * Every call of every rank runs the same recursive doubling over all ranks (a rank past the
 * largest power of two first hands its part to a partner and gets the result back at the
 * end). Each message is [the MAX of the metadata vectors seen so far | data]: the data only
 * in a fused call, a small allreduce reduced along the way (so it costs the check's
 * latency and nothing more). Receives are always posted for the largest message any call
 * sends, so ranks that disagree about a call still exchange the same messages, see the
 * difference and raise instead of hanging; a fused call's data is reduced only while both
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
    int peer, send_tag, recv_tag, capacity = (int)(sizeof(int64_t) * (size_t)r->nmeta + e->fused_max);
    if (!step_of(e->rank, e->size, r->cstep, &peer, &send_tag, &recv_tag)) {
        memcpy(r->meta_out, r->cmine, sizeof(int64_t) * (size_t)r->nmeta);
        checked(e, r);
        return;
    }
    r->pending = (send_tag >= 0) + (recv_tag >= 0);
    r->received = -1;
    if (recv_tag >= 0)
        POST(e, r, OWNER_CHECK_RECV, MPI_Irecv(r->crecv, capacity, MPI_BYTE, peer, r->tag0 + e->check_tag - recv_tag,
                                               e->ctl, &req_));
    if (send_tag >= 0)
        POST(e, r, OWNER_CHECK_SEND, MPI_Isend(r->cmine, (int)r->cmine_bytes, MPI_BYTE, peer,
                                               r->tag0 + e->check_tag - send_tag, e->ctl, &req_));
}

/* Fold the received message into this rank's: the MAX of the vectors, and a fused call's data. */
static void merge(EngineObject *e, run_t *r, int peer, int fold_out) {
    size_t meta_bytes = sizeof(int64_t) * (size_t)r->nmeta;
    int64_t *mine = (int64_t *)r->cmine, *theirs = (int64_t *)r->crecv;
    if (r->received < (int)meta_bytes) {   /* not a check message of this protocol */
        r->data_bad = 1;
        for (int k = 0; k < r->nmeta; k++) mine[k] = INT64_MAX;
        return;
    }
    if (fold_out) {                        /* the partner's final state is the result */
        memcpy(mine, theirs, meta_bytes);
        if ((size_t)r->received == r->cmine_bytes)
            memcpy(r->cmine + meta_bytes, r->crecv + meta_bytes, r->cmine_bytes - meta_bytes);
        else
            r->data_bad = 1;
        return;
    }
    int agree = (size_t)r->received == r->cmine_bytes && memcmp(mine, theirs, meta_bytes) == 0;
    for (int k = 0; k < r->nmeta; k++) if (theirs[k] > mine[k]) mine[k] = theirs[k];
    if (r->kind != KIND_FUSED || r->data_bad) return;
    if (!agree) { r->data_bad = 1; return; }
    reduce_into(r->dtype, r->op, r->cmine + meta_bytes, r->crecv + meta_bytes, r->nelem, peer < e->rank);
}

void check_completed(EngineObject *e, run_t *r, int32_t owner, int received_bytes) {
    if (owner == OWNER_CHECK_RECV) r->received = received_bytes;
    if (--r->pending > 0) return;
    int peer, send_tag, recv_tag;
    step_of(e->rank, e->size, r->cstep, &peer, &send_tag, &recv_tag);
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
    r->cmine_bytes = meta_bytes + data_bytes;
    r->cmine = malloc(r->cmine_bytes);
    r->crecv = pool_take(e, meta_bytes + e->fused_max);
    if (!r->cmine || !r->crecv) { fail_run(e, r, "out of memory", MPI_SUCCESS); return; }
    memcpy(r->cmine, r->meta, meta_bytes);
    if (data_bytes) {   /* a copy: the user's buffer changes only once every rank agreed */
        memcpy(r->cmine + meta_bytes, r->buf, data_bytes);
        scale_buffer(r->dtype, r->cmine + meta_bytes, r->nelem, r->pre);
    }
    r->cstep = 0;
    post_step(e, r);
}
