/* The cross-rank metadata check, and the small allreduces that travel with it.
 *
 * Every call of every rank runs the same recursive doubling over all ranks (for a count that is
 * not a power of two, each odd rank of the first 2r first hands its part to the even one below
 * and gets the result back at the end, as the schedules fold). Each message is [the MAX of the
 * metadata vectors seen so far | data]: the data only in a fused call, a small allreduce
 * reduced along the way (so it costs the check's latency and nothing more). A message travels
 * in pieces of at most `piece_bytes` (across hosts: under the TCP eager limit, so no piece
 * waits for a clear-to-send round trip); its first piece starts with [total bytes | piece
 * bytes], from which the receiver posts the rest. The first receive is always posted for the
 * largest message any call sends, so ranks that disagree about a call still exchange the same
 * messages, see the difference and raise instead of hanging; a fused call's data is reduced
 * only while both sides agree, into a copy, and reaches the user's buffer only once every rank
 * agreed. The MAX over [x, -x] equals this rank's vector exactly when every rank sent the same
 * (mcallreduce/check.py). Both partners of an exchange combine the lower rank's data as the
 * left operand, so every rank computes bitwise the same result.
 *
 * A fused halving call (Rabenseifner's, for messages where doubling's whole-buffer exchanges
 * cost more than its extra latencies) sends in each exchange only the half of its range that
 * the peer keeps, so the check's exchanges are its reduce-scatter. After the last one every
 * rank holds the same MAX: if it agrees, every rank retraces the exchanges with its reduced
 * part (the allgather, data only), and if not, none does. Each exchange reduces the part the
 * next one gives straight into that one's message. In both kinds of fused call the last
 * exchange, once every rank agreed, reduces straight into the user's buffer.
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

static int log2_of(int p2) {
    int bits = 0;
    while ((1 << bits) < p2) bits++;
    return bits;
}

enum { FOLD_IN = 1, EXCHANGE, GATHER, FOLD_OUT, HAND_OVER };
typedef struct { int phase, peer, send_tag, recv_tag, bit; } cstep_t;   /* tags -1: no send / no receive */

/* The fold of a rank count that is not a power of two, as in algorithms/doubling.py (and
   MPICH's and Open MPI's): of the first 2r ranks (r = p - p2) each odd one hands its data to the
   even one below and gets the result back; the others take part as virtual ranks 0..p2-1, in
   rank order, so ranks numbered host by host fold on their host. */
static int virtual_of(int rank, int extra) { return rank < 2 * extra ? rank / 2 : rank - extra; }
static int real_of(int v, int extra) { return v < extra ? 2 * v : v + extra; }

/* Step k of this rank (0 when done), `gather` the allgather's exchanges it takes (a fused
   halving call once every rank agreed). Tags: 0 the fold-in, 1 + i the exchange across bit i,
   1 + log2(p2) the fold-out, 2 + log2(p2) + i the allgather's across bit i. */
static int step_of(int rank, int p, int k, int gather, cstep_t *s) {
    int p2 = largest_power_of_two(p), extra = p - p2, bits = log2_of(p2);
    s->bit = -1;
    if (rank < 2 * extra && rank % 2) {   /* hand over, get the result back */
        *s = (cstep_t){k > 0 ? 0 : HAND_OVER, rank - 1, 0, 1 + bits, -1};
        return s->phase;
    }
    int first = rank < 2 * extra ? 1 : 0;   /* folds its odd neighbour in first */
    int v = virtual_of(rank, extra), i = k - first;
    if (first && k == 0) *s = (cstep_t){FOLD_IN, rank + 1, -1, 0, -1};
    else if (i < bits) *s = (cstep_t){EXCHANGE, real_of(v ^ (1 << i), extra), 1 + i, 1 + i, i};
    else if (i < bits + gather) {
        int bit = bits - 1 - (i - bits);
        *s = (cstep_t){GATHER, real_of(v ^ (1 << bit), extra), 2 + bits + bit, 2 + bits + bit, bit};
    } else if (first && i == bits + gather) *s = (cstep_t){FOLD_OUT, rank + 1, 1 + bits, -1, -1};
    else s->phase = 0;
    return s->phase;
}

/* This rank's virtual rank: its place among the ranks that take part after the fold. */
static int virtual_rank(EngineObject *e, int rank) {
    return virtual_of(rank, e->size - largest_power_of_two(e->size));
}

/* A fused halving call: the range [*off, *off + *cnt) of the data that virtual rank `v` holds
   after its exchanges across bits 0..i-1 (the rank with the bit set keeps the upper part). */
static void held(int v, int i, int64_t nelem, int64_t *off, int64_t *cnt) {
    *off = 0; *cnt = nelem;
    for (int b = 0; b < i; b++) {
        int64_t half = *cnt / 2;
        if (v >> b & 1) { *off += half; *cnt -= half; } else *cnt = half;
    }
}

/* Where a fused halving call builds each exchange's message: behind its own (start_check). */
static char *exchange_buffer(run_t *r) { return r->cmine + r->cmine_bytes; }

/* What this rank sends in an exchange: its whole message, or in a fused halving call its
   vector and the part of its range the peer keeps, behind its own message: copied there in its
   first exchange (from the user's buffer, in a rank that folds nothing in), and reduced there by
   the exchange before it in the others. */
static char *exchange_message(EngineObject *e, run_t *r, const cstep_t *s, size_t *total) {
    *total = r->cmine_bytes;
    if (s->phase == FOLD_OUT && r->in_buf)   /* the result was gathered into the user's buffer */
        memcpy(check_data(r), r->buf, (size_t)r->nelem * r->isz);
    if (r->kind != KIND_FUSED_HALVING || s->phase != EXCHANGE) return r->cmine;
    size_t body = HEADER_BYTES + sizeof(int64_t) * (size_t)r->nmeta;
    int64_t off, cnt, half;
    int v = virtual_rank(e, e->rank), upper = v >> s->bit & 1;
    held(v, s->bit, r->nelem, &off, &cnt);
    half = cnt / 2;
    int64_t give_off = upper ? off : off + half, give = upper ? half : cnt - half;
    const char *data = r->from_buf && s->bit == 0 ? r->buf : check_data(r);
    char *msg = exchange_buffer(r);
    *total = body + (size_t)give * r->isz;
    memcpy(msg, r->cmine, body);
    ((int64_t *)msg)[0] = (int64_t)*total;
    if (s->bit == 0 || r->data_bad)   /* later, merge() reduced it there, unless it skipped the data */
        memcpy(msg + body, data + give_off * (int64_t)r->isz, (size_t)give * r->isz);
    return msg;
}

/* Send `bytes` from `at` in pieces of at most piece_bytes (with `recv` set: receive them). */
static void post_pieces(EngineObject *e, run_t *r, char *at, size_t bytes, int peer, int tag, int recv) {
    size_t piece = e->piece_bytes;
    for (size_t done = 0; done < bytes; done += piece) {
        int n = (int)(bytes - done < piece ? bytes - done : piece);
        r->pending++;
        if (recv) POST(e, r, OWNER_CHECK_PIECE, MPI_Irecv(at + done, n, MPI_BYTE, peer, r->tag0 + e->check_tag - tag, e->ctl, &req_));
        else POST(e, r, OWNER_CHECK_SEND, MPI_Isend(at + done, n, MPI_BYTE, peer, r->tag0 + e->check_tag - tag, e->ctl, &req_));
    }
}

static void post_step(EngineObject *e, run_t *r);

/* The allgather's exchange across s->bit: data only, and only once every rank agreed, so it
   works in the user's buffer, and both sides know both ranges. */
static void post_gather(EngineObject *e, run_t *r, const cstep_t *s) {
    int64_t off, cnt, peer_off, peer_cnt;
    held(virtual_rank(e, e->rank), s->bit + 1, r->nelem, &off, &cnt);
    held(virtual_rank(e, s->peer), s->bit + 1, r->nelem, &peer_off, &peer_cnt);
    if (!r->in_buf) {   /* the first: this rank's reduced part */
        memcpy(r->buf + off * (int64_t)r->isz, check_data(r) + off * (int64_t)r->isz, (size_t)cnt * r->isz);
        r->in_buf = 1;
    }
    r->pending = 0;
    r->received = 0;
    post_pieces(e, r, r->buf + peer_off * (int64_t)r->isz, (size_t)peer_cnt * r->isz, s->peer, s->recv_tag, 1);
    if (r->done) return;
    post_pieces(e, r, r->buf + off * (int64_t)r->isz, (size_t)cnt * r->isz, s->peer, s->send_tag, 0);
    if (!r->done && r->pending == 0) { r->cstep++; post_step(e, r); }   /* both ranges empty */
}

/* Post the current step's messages, or, after the last step, the check is done. Never a
   blocking MPI call: a wait in Waitsome also sees a peer's goodbye and the stall limit. */
static void post_step(EngineObject *e, run_t *r) {
    cstep_t s;
    if (!step_of(e->rank, e->size, r->cstep, r->gather, &s)) {
        memcpy(r->meta_out, r->cmine + HEADER_BYTES, sizeof(int64_t) * (size_t)r->nmeta);
        checked(e, r);
        return;
    }
    if (s.phase == GATHER) { post_gather(e, r, &s); return; }
    size_t total;
    char *msg = exchange_message(e, r, &s, &total);
    r->pending = s.recv_tag >= 0;
    r->received = -1;
    if (s.recv_tag >= 0)
        POST(e, r, OWNER_CHECK_RECV, MPI_Irecv(r->crecv, (int)check_capacity(e, r), MPI_BYTE, s.peer,
                                               r->tag0 + e->check_tag - s.recv_tag, e->ctl, &req_));
    if (s.send_tag >= 0) post_pieces(e, r, msg, total, s.peer, s.send_tag, 0);
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

static int last_bit(EngineObject *e) { return log2_of(largest_power_of_two(e->size)) - 1; }

/* out = op(own, theirs) over n elements, the lower rank's data the left operand; out may be own. */
static void fold(run_t *r, int theirs_left, char *out, const char *own, const char *theirs, int64_t n) {
    if (out == own) reduce_into(r->dtype, r->op, out, theirs, n, theirs_left);
    else combine_into(r->dtype, r->op, out, theirs_left ? theirs : own, theirs_left ? own : theirs, n);
}

/* Fold the received message into this rank's: the MAX of the vectors, and a fused call's data
   (all of it, or in a fused halving exchange the part of its range this rank keeps). */
static void merge(EngineObject *e, run_t *r, const cstep_t *s) {
    size_t meta_bytes = sizeof(int64_t) * (size_t)r->nmeta, body = HEADER_BYTES + meta_bytes;
    int64_t *mine = (int64_t *)(r->cmine + HEADER_BYTES), *theirs = (int64_t *)(r->crecv + HEADER_BYTES);
    if (r->received < (int)body) {   /* not a check message of this protocol */
        r->data_bad = 1;
        for (int k = 0; k < r->nmeta; k++) mine[k] = INT64_MAX;
        return;
    }
    if (s->phase == HAND_OVER) {           /* the partner's final state is the result */
        memcpy(mine, theirs, meta_bytes);
        if ((size_t)r->received == r->cmine_bytes)
            memcpy(r->cmine + body, r->crecv + body, r->cmine_bytes - body);
        else
            r->data_bad = 1;
        return;
    }
    int64_t off = 0, cnt = r->nelem;
    if (r->kind == KIND_FUSED_HALVING && s->phase == EXCHANGE) held(virtual_rank(e, e->rank), s->bit + 1, r->nelem, &off, &cnt);
    size_t expected = r->kind == KIND_FUSED_HALVING && s->phase == EXCHANGE ? body + (size_t)cnt * r->isz : r->cmine_bytes;
    int agree = (size_t)r->received == expected && memcmp(mine, theirs, meta_bytes) == 0;
    for (int k = 0; k < r->nmeta; k++) if (theirs[k] > mine[k]) mine[k] = theirs[k];
    int all_agreed = 0;
    if (FUSED(r->kind) && s->phase == EXCHANGE && s->bit == last_bit(e)) {
        /* every rank that takes part now holds the same MAX: all of them agreed, or none did */
        memcpy(r->meta_out, mine, meta_bytes);
        all_agreed = agreed(r);
        if (r->kind == KIND_FUSED_HALVING) r->gather = all_agreed ? s->bit + 1 : 0;
    }
    if (!FUSED(r->kind) || r->data_bad) return;
    if (!agree) { r->data_bad = 1; return; }
    const char *own = (r->from_buf && s->bit == 0 ? r->buf : check_data(r)) + off * (int64_t)r->isz;
    const char *theirs_data = r->crecv + body;
    int left = s->peer < e->rank;
    if (all_agreed) {   /* the last exchange: this rank's part of the result goes to the user's buffer */
        fold(r, left, r->buf + off * (int64_t)r->isz, own, theirs_data, cnt);
        r->in_buf = 1;
    } else if (r->kind != KIND_FUSED_HALVING || s->phase != EXCHANGE) {
        fold(r, left, check_data(r) + off * (int64_t)r->isz, own, theirs_data, cnt);
    } else if (s->bit < last_bit(e)) {   /* the part the next exchange gives goes straight into its message */
        int upper = virtual_rank(e, e->rank) >> (s->bit + 1) & 1;   /* keeps the upper part, gives the lower */
        int64_t half = cnt / 2, give_at = upper ? 0 : half, give = upper ? half : cnt - half;
        int64_t keep_at = upper ? half : 0, keep = cnt - give;
        char *msg_data = exchange_buffer(r) + body;
        fold(r, left, msg_data, own + give_at * (int64_t)r->isz, theirs_data + give_at * (int64_t)r->isz, give);
        fold(r, left, check_data(r) + (off + keep_at) * (int64_t)r->isz, own + keep_at * (int64_t)r->isz,
             theirs_data + keep_at * (int64_t)r->isz, keep);
    } else {
        fold(r, left, check_data(r) + off * (int64_t)r->isz, own, theirs_data, cnt);
    }
}

void check_completed(EngineObject *e, run_t *r, int32_t owner, int received_bytes) {
    cstep_t s;
    step_of(e->rank, e->size, r->cstep, r->gather, &s);
    if (owner == OWNER_CHECK_RECV) {
        r->received = received_bytes;
        post_rest(e, r, received_bytes, s.peer, s.recv_tag);
        if (r->done) return;
    } else if (owner == OWNER_CHECK_PIECE) {
        r->received += received_bytes;
    }
    if (--r->pending > 0) return;
    if (s.phase == GATHER) {
        int64_t peer_off, peer_cnt;
        held(virtual_rank(e, s.peer), s.bit + 1, r->nelem, &peer_off, &peer_cnt);
        if ((int64_t)r->received != peer_cnt * (int64_t)r->isz) r->data_bad = 1;
    } else if (s.recv_tag >= 0) {
        merge(e, r, &s);
    }
    r->cstep++;
    post_step(e, r);
}

int check_peer(EngineObject *e, run_t *r) {
    cstep_t s;
    return step_of(e->rank, e->size, r->cstep, r->gather, &s) ? s.peer : -1;
}

void start_check(EngineObject *e, run_t *r) {
    if (r->check == CHECK_OFF) { checked(e, r); return; }
    size_t meta_bytes = sizeof(int64_t) * (size_t)r->nmeta;
    size_t data_bytes = FUSED(r->kind) ? (size_t)r->nelem * r->isz : 0;
    if (data_bytes > e->fused_max) { fail_run(e, r, "internal error: a fused call above the limit", MPI_SUCCESS); return; }
    r->cmine_bytes = HEADER_BYTES + meta_bytes + data_bytes;
    /* a fused halving call's exchanges send from a message built behind this one */
    size_t send_bytes = r->kind == KIND_FUSED_HALVING ? HEADER_BYTES + meta_bytes + (data_bytes / r->isz + 1) / 2 * r->isz : 0;
    r->cmine = malloc(r->cmine_bytes + send_bytes);
    r->crecv = pool_take(e, check_capacity(e, r));
    if (!r->cmine || !r->crecv) { fail_run(e, r, "out of memory", MPI_SUCCESS); return; }
    int64_t *header = (int64_t *)r->cmine;
    header[0] = (int64_t)r->cmine_bytes;
    header[1] = (int64_t)e->piece_bytes;
    memcpy(r->cmine + HEADER_BYTES, r->meta, meta_bytes);
    int p2 = largest_power_of_two(e->size);
    /* a fused halving rank that folds nothing in reads its first exchange from the user's buffer */
    r->from_buf = r->kind == KIND_FUSED_HALVING && r->pre == 1.0 && e->rank >= 2 * (e->size - p2) && p2 > 1;
    r->in_buf = 0;
    if (data_bytes && !r->from_buf) {   /* a copy: the user's buffer changes only once every rank agreed */
        memcpy(check_data(r), r->buf, data_bytes);
        scale_buffer(r->dtype, check_data(r), r->nelem, r->pre);
    }
    r->cstep = 0;
    r->gather = 0;
    post_step(e, r);
}
