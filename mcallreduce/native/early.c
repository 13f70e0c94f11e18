/* Data before the check: a schedule's first messages travel while its metadata check is out.
 *
 * The check makes every rank wait for the last one to arrive before any byte moves; without
 * it the ranks that arrive first start their first round, and the arrival skew overlaps the
 * data (docs/defaults.md, "Data before the check"). So a run posts its early steps
 * (lowering.py: sends from the buffer and receives into scratch of at most early_max bytes
 * that wait for nothing, whose partner steps on the peers are early too) before its check;
 * every reduction and every write to the user's buffer waits until every rank agreed.
 *
 * Early messages use one tag per call (the window's early tag) instead of their steps' tags,
 * posted in step order, so that MPI matches the k-th early message from a peer with the k-th
 * early receive from it (messages from one sender on one communicator and tag match in the
 * order sent). Every early receive can hold early_max bytes, the most any rank sends early,
 * so a disagreeing peer's message never overruns it. Ranks that disagree may have sent
 * messages the receiver does not expect, or expect some that never come: after a mismatch
 * every rank cancels its early receives, sends every other rank an empty fence on the early
 * tag, and receives from each peer until that peer's fence. Then nothing of the call is left
 * for a later call of the same window to match, and only then does the mismatch reach Python.
 */
#include "executor.h"

#include <stdlib.h>

int early_eligible(EngineObject *e, run_t *r) {
    /* a prescaled buffer changes before its first send: such a call waits for its check */
    return e->size > 1 && r->kind == KIND_SCHEDULE && r->check != CHECK_OFF && r->pre == 1.0 && r->program != NULL
           && ((ProgramObject *)r->program)->has_early;
}

void post_early(EngineObject *e, run_t *r, int64_t i) {
    step_t *s = &((ProgramObject *)r->program)->steps[i];
    if (s->op == STEP_SEND)
        POST(e, r, (int32_t)i, MPI_Isend(r->buf + s->offset * (int64_t)r->isz, (int)(s->count * (int64_t)r->isz),
                                         MPI_BYTE, s->peer, r->tag0 + e->early_tag, e->comm, &req_));
    else   /* the scratch area has early_max bytes to spare past its last slot */
        POST(e, r, (int32_t)i, MPI_Irecv(r->scratch + s->scratch * (int64_t)r->isz, (int)e->early_max, MPI_BYTE,
                                         s->peer, r->tag0 + e->early_tag, e->comm, &req_));
}

int early_recv(const run_t *r, int32_t owner) {
    if (owner <= OWNER_DRAIN) return 1;   /* a drain receive: OWNER_DRAIN - its peer */
    if (!r->early || owner < 0) return 0;
    const step_t *s = &((ProgramObject *)r->program)->steps[owner];
    return s->early && s->op == STEP_RECV_SCRATCH;
}

static int *fences(EngineObject *e, run_t *r) {
    if (!r->drain) r->drain = calloc((size_t)e->size, sizeof(int));
    return r->drain;
}

void early_received(EngineObject *e, run_t *r, int32_t owner, int count) {
    step_t *s = &((ProgramObject *)r->program)->steps[owner];
    if (count == s->count * (int64_t)r->isz) return;
    r->early_bad = 1;   /* another size: the ranks disagree about this call */
    /* an empty message is a peer's fence, sent once its check failed (so will this rank's) */
    if (count == 0) {
        if (!fences(e, r)) { fail_run(e, r, "out of memory", MPI_SUCCESS); return; }
        r->drain[s->peer] = 1;
    }
}

static int peer_of(const run_t *r, int32_t owner) {
    return owner <= OWNER_DRAIN ? OWNER_DRAIN - owner : ((ProgramObject *)r->program)->steps[owner].peer;
}

/* How many of r's receives on the early tag from `peer` are posted; with `cancel`, cancel them. */
static int posted_from(EngineObject *e, run_t *r, int peer, int cancel) {
    int n = 0;
    for (int k = 0; k < e->nreqs; k++) {
        if (e->owner_run[k] != r || !early_recv(r, e->owner_step[k]) || peer_of(r, e->owner_step[k]) != peer) continue;
        n++;
        if (cancel) MPI_Cancel(&e->reqs[k]);
    }
    return n;
}

/* Keep a receive posted from every peer whose fence has not arrived: the fence, or a message to drop. */
static void keep_draining(EngineObject *e, run_t *r, int peer) {
    if (r->drain[peer] || posted_from(e, r, peer, 0)) return;
    POST(e, r, OWNER_DRAIN - peer, MPI_Irecv(e->discard, (int)e->early_max, MPI_BYTE, peer, r->tag0 + e->early_tag,
                                             e->comm, &req_));
}

static void drained_yet(EngineObject *e, run_t *r) {
    if (r->inflight) return;
    for (int q = 0; q < e->size; q++)
        if (q != e->rank && !r->drain[q]) return;
    r->draining = 0;
    finish(e, r, STATUS_MISMATCH);
}

void start_drain(EngineObject *e, run_t *r) {
    if (!fences(e, r) || (!e->discard && !(e->discard = malloc(e->early_max ? e->early_max : 1)))) {
        fail_run(e, r, "out of memory", MPI_SUCCESS);
        return;
    }
    r->draining = 1;
    for (int q = 0; q < e->size && !r->done; q++) {   /* posted after the early sends: matched after them */
        if (q == e->rank) continue;
        POST(e, r, OWNER_FENCE, MPI_Isend(NULL, 0, MPI_BYTE, q, r->tag0 + e->early_tag, e->comm, &req_));
        if (r->drain[q]) posted_from(e, r, q, 1);   /* its fence came: nothing more will */
        else keep_draining(e, r, q);
    }
    if (!r->done) drained_yet(e, r);
}

void drain_completed(EngineObject *e, run_t *r, int32_t owner, int count, int cancelled, int error) {
    if (error != MPI_SUCCESS) {   /* a receive that failed may leave its peer's fence unread: give up */
        r->draining = 0;
        fail_run(e, r, "a receive of a mismatched call's messages", error);
        return;
    }
    if (early_recv(r, owner)) {
        int peer = peer_of(r, owner);
        if (!cancelled && count == 0 && !r->drain[peer]) {   /* its fence: the rest from it are cancelled */
            r->drain[peer] = 1;
            posted_from(e, r, peer, 1);
        }
        keep_draining(e, r, peer);
        if (r->done) return;
    }
    drained_yet(e, r);
}
