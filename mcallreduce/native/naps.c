/* How a blocking wait naps between polls (progress() in executor.c polls; this decides when it sleeps). */
#include "executor.h"

#include <time.h>

/* A blocking wait polls while messages keep completing and sleeps once they stop: MPI's own
   wait would spin (with mpi_yield_when_idle, yield and spin) on a core that the peers, the
   backward pass or the decoder need. After poll_s without a completion it sleeps between
   polls, each nap at most an eighth of the time waited so far (so sleeping adds at most that
   share to a wait) and at most SLEEP_MAX_NS (well under a pipeline segment's time on a slow
   link, so a forwarding rank keeps its links busy); any completion polls again
   (docs/benchmarks-limits.md, "How long a wait polls"). */
#define SLEEP_MAX_NS 200000L
/* MPI_Iallreduce advances a round only inside a poll and reports nothing until its last round,
   so while one is posted the wait polls COLL_POLL_FACTOR times as long, then naps as briefly as
   the kernel's timer slack allows until COLL_SHORT_NAP_FACTOR times poll_s, when a round lasts
   long enough for the usual naps (docs/benchmarks-limits.md, "How long a wait polls"). */
#define COLL_POLL_FACTOR 10
#define COLL_SHORT_NAP_FACTOR 100
#define COLL_SLEEP_MAX_NS 50000L

/* Whether schedule step `i` of run `r` moves more than a check piece (across hosts, under the TCP eager
   limit; on one host, never): such a message travels by rendezvous, whose fragments move only inside a
   poll on both sides. */
static int rendezvous_step(const EngineObject *e, const run_t *r, int32_t i) {
    const ProgramObject *prog = (const ProgramObject *)r->program;
    return prog && prog->steps[i].op != STEP_REDUCE && prog->steps[i].count * (int64_t)r->isz > (int64_t)e->piece_bytes;
}

/* MPI's nonblocking allreduce, a schedule's message above the eager limit, or a call fused with its
   check: rounds of one message each, or one message's fragments, that naps would delay round by round
   (docs/benchmarks-limits.md, "How long a wait polls"); a fused call only while no schedule's segments
   are posted (they keep naps short), so the plugin's metadata allreduce beside a bucket does not keep
   it polling. */
static int chain_posted(const EngineObject *e) {
    int fused = 0, steps = 0;
    for (int i = 0; i < e->nreqs; i++) {
        int32_t owner = e->owner_step[i];
        const run_t *r = e->owner_run[i];
        if (r == NULL || r->abandoned) continue;   /* a standing request, or a run no wait is for */
        if (owner == OWNER_COLLECTIVE) return 1;
        if (owner >= 0) {   /* a schedule's step */
            if (rendezvous_step(e, r, owner)) return 1;
            steps = 1;
        } else if ((owner == OWNER_CHECK_RECV || owner == OWNER_CHECK_PIECE) && FUSED(r->kind)) {
            fused = 1;
        }
    }
    return fused && !steps;
}

int nap_after(const EngineObject *e, double idle, struct timespec *ts) {
    int chain = idle >= e->poll_s && chain_posted(e);
    if (idle < (chain ? COLL_POLL_FACTOR * e->poll_s : e->poll_s)) return 0;
    long nap = (long)(idle * 1e9 / 8);
    long nap_max = chain && idle < COLL_SHORT_NAP_FACTOR * e->poll_s ? COLL_SLEEP_MAX_NS : SLEEP_MAX_NS;
    *ts = (struct timespec){0, nap < nap_max ? nap : nap_max};
    return 1;
}
