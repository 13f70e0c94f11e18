/* The compiled executor: runs lowered allreduce schedules over MPI with the GIL released.
 *
 * One Engine per communicator context owns every MPI request of every allreduce in
 * flight ("runs"), so waiting on one run progresses all the others: ranks that wait in
 * different orders cannot deadlock each other. A run goes through
 *
 *   check  -> the cross-rank metadata check (check.c), which a small doubling or halving call rides;
 *   body   -> a schedule (steps posted as Isend/Irecv as their dependencies complete, the
 *             reductions done inline), MPI's own allreduce (posted in call order), or the
 *             one-host shared-memory stage (publish, check, reduce a color, sync, collect);
 *   done   -> postscale, then reported to Python by the next drain.
 *
 * A peer's goodbye fails the runs it will never take part in. The bodies other than a
 * schedule live in collective.c and shared_stage.c, the wake-up and goodbye requests in
 * standing.c, when a blocking wait sleeps in naps.c; module.c is the Python interface.
 * Python (mcallreduce/engine.py) serialises calls into an Engine: it is not thread-safe on
 * its own, but any one call may block in MPI with the GIL released.
 */
#include "executor.h"   /* Python.h first: it sets the POSIX feature macros */

#include <limits.h>
#include <stdlib.h>
#include <time.h>

double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int add_request(EngineObject *e, MPI_Request req, run_t *r, int32_t step) {
    if (e->nreqs == e->cap) {
        int cap = e->cap ? 2 * e->cap : 256;
        MPI_Request *reqs = realloc(e->reqs, sizeof(MPI_Request) * cap);
        if (reqs) e->reqs = reqs;
        run_t **own = realloc(e->owner_run, sizeof(run_t *) * cap);
        if (own) e->owner_run = own;
        int32_t *steps = realloc(e->owner_step, sizeof(int32_t) * cap);
        if (steps) e->owner_step = steps;
        int *index = realloc(e->index, sizeof(int) * cap);
        if (index) e->index = index;
        MPI_Status *statuses = realloc(e->statuses, sizeof(MPI_Status) * cap);
        if (statuses) e->statuses = statuses;
        if (!reqs || !own || !steps || !index || !statuses) return -1;
        e->cap = cap;
    }
    e->reqs[e->nreqs] = req;
    e->owner_run[e->nreqs] = r;
    e->owner_step[e->nreqs] = step;
    e->nreqs++;
    if (r) r->inflight++;
    return 0;
}

void *pool_take(EngineObject *e, size_t bytes) {
    for (int i = 0; i < POOL_SLOTS; i++)
        if (e->pool[i] && e->pool_bytes[i] == bytes) { void *p = e->pool[i]; e->pool[i] = NULL; return p; }
    return malloc(bytes ? bytes : 1);
}

void pool_give(EngineObject *e, void *p, size_t bytes) {
    if (!p) return;
    for (int i = 0; i < POOL_SLOTS; i++)
        if (!e->pool[i]) { e->pool[i] = p; e->pool_bytes[i] = bytes; return; }
    free(p);
}

/* ---- bodies */

/* an early message of another size, where the check agreed: the ranks differ in what it omits */
static const char MISFIT[] = "a message did not fit this rank's schedule: do all ranks see the same hosts "
                             "(MCALLREDUCE_RANKS_PER_HOST)?";

static void complete_step(run_t *r, int64_t i) {
    ProgramObject *p = (ProgramObject *)r->program;
    r->remaining--;
    int color = p->steps[i].color;
    if (color >= 0 && color < r->ncolors) {
        double *row = r->color_t + 2 * color, t = now_s();
        if (p->steps[i].phase == 0) row[0] = t;
        row[1] = t;
    }
    for (int64_t k = p->dep_ptr[i]; k < p->dep_ptr[i + 1]; k++) {
        int32_t j = p->dependents[k];
        if (--r->waiting[j] == 0) r->ready[r->nready++] = j;
    }
}

static void post_ready(EngineObject *e, run_t *r) {
    ProgramObject *p = (ProgramObject *)r->program;
    if (r->early && !r->meta_checked) return;   /* the rest waits for every rank to agree (early.c) */
    while (r->nready && !r->done) {
        int32_t i = r->ready[--r->nready];
        step_t *s = &p->steps[i];
        char *at = r->buf + s->offset * (int64_t)r->isz;
        int bytes = (int)(s->count * (int64_t)r->isz);
        switch (s->op) {
        case STEP_REDUCE:
            reduce_into(r->dtype, r->op, at, r->scratch + s->scratch * (int64_t)r->isz, s->count, s->left);
            complete_step(r, i);
            continue;
        case STEP_SEND:
            POST(e, r, i, MPI_Isend(at, bytes, MPI_BYTE, s->peer, r->tag0 + s->tag, e->comm, &req_));
            break;
        case STEP_RECV:
            POST(e, r, i, MPI_Irecv(at, bytes, MPI_BYTE, s->peer, r->tag0 + s->tag, e->comm, &req_));
            break;
        default:
            POST(e, r, i, MPI_Irecv(r->scratch + s->scratch * (int64_t)r->isz, bytes, MPI_BYTE, s->peer,
                                    r->tag0 + s->tag, e->comm, &req_));
        }
    }
    if (!r->done && r->remaining == 0) finish(e, r, STATUS_OK);
}

/* Where the scratch area starts in its allocation: half a page from the user's buffer, so that a
   reduction's loads from scratch never share their low twelve address bits with its stores into the
   buffer close behind them, which stalls each such load (4K aliasing; both are often a few bytes
   into a page: docs/defaults.md, "Scratch half a page from the buffer"). */
#define PAGE_BYTES 4096
static char *scratch_in(char *area, const char *buf) {
    uintptr_t want = ((uintptr_t)buf + PAGE_BYTES / 2) % PAGE_BYTES, have = (uintptr_t)area % PAGE_BYTES;
    return area + (want + PAGE_BYTES - have) % PAGE_BYTES;
}

static void start_schedule(EngineObject *e, run_t *r) {
    ProgramObject *p = (ProgramObject *)r->program;
    /* an early receive may take early_max bytes wherever it lands (early.c) */
    r->scratch_bytes = (size_t)p->scratch_elems * r->isz + (r->early ? e->early_max : 0) + PAGE_BYTES;
    r->scratch_area = pool_take(e, r->scratch_bytes);
    r->scratch = r->scratch_area ? scratch_in(r->scratch_area, r->buf) : NULL;
    r->waiting = malloc(sizeof(int32_t) * (size_t)(p->nsteps + 1));
    r->ready = malloc(sizeof(int32_t) * (size_t)(p->nsteps + 1));
    r->ncolors = p->ncolors;
    r->color_t = calloc((size_t)(2 * p->ncolors + 1), sizeof(double));
    if (!r->scratch || !r->waiting || !r->ready || !r->color_t) { fail_run(e, r, "out of memory", MPI_SUCCESS); return; }
    r->remaining = p->nsteps;
    r->nready = 0;
    for (int64_t i = p->nsteps - 1; i >= 0; i--) {   /* popped in step order */
        r->waiting[i] = p->steps[i].ndeps;
        if (r->waiting[i] == 0 && !(r->early && p->steps[i].early)) r->ready[r->nready++] = (int32_t)i;
    }
    for (int64_t i = 0; r->early && i < p->nsteps && !r->done; i++)   /* in step order: early.c */
        if (p->steps[i].early) post_early(e, r, i);
    post_ready(e, r);
}

/* Whether every rank sent this rank's vector: both halves equal but for their agreed slot. */
int agreed(const run_t *r) {
    size_t half = (size_t)r->nmeta / 2, compared = sizeof(int64_t) * (half - 1);
    return memcmp(r->meta, r->meta_out, compared) == 0 && memcmp(r->meta + half, r->meta_out + half, compared) == 0;
}

void checked(EngineObject *e, run_t *r) {
    r->meta_checked = 1;
    r->t_checked = now_s();
    if (r->kind == KIND_CHECK_ONLY || (r->check != CHECK_OFF && !agreed(r))) {
        if (r->meta_out[EARLY_SLOT(r)] > 0) start_drain(e, r);   /* some rank sent data before it */
        else finish(e, r, STATUS_MISMATCH);
        return;
    }
    if (r->early_bad) {
        fail_run(e, r, MISFIT, MPI_SUCCESS);
        return;
    }
    /* counted only once agreed, so every rank counts the same calls (shared_stage.c) */
    if (ONE_HOST_STAGE(r->kind)) e->stage_calls++;
    switch (r->kind) {
    case KIND_FUSED_DOUBLING: case KIND_FUSED_HALVING:   /* the data was reduced along the check: every rank agreed, so it is the result */
        if (r->data_bad) { fail_run(e, r, "internal error: a fused call's data was not reduced", MPI_SUCCESS); return; }
        if (!r->in_buf) memcpy(r->buf, check_data(r), (size_t)(r->nelem * r->isz));
        finish(e, r, STATUS_OK);
        return;
    case KIND_SHARED: case KIND_SINGLE_COPY: case KIND_SHARED_ONE_SYNC:
        shm_reduce(e, r);
        if (!r->done && r->pending == 0) shm_collect(e, r);   /* a single rank */
        return;
    case KIND_MPI: case KIND_MPI_RING:
        /* MPI never matches a blocking collective with a nonblocking one: the blocking call only
           where the check says every rank waits for this run alone (unchecked: never) */
        r->blocking = r->check != CHECK_OFF && r->meta_out[AGREED_SLOT(r)] == 0;
        scale_buffer(r->dtype, r->buf, r->nelem, r->pre);
        r->coll_ready = 1;
        /* a blocking table row's MPI pick that cannot block: the plan's schedule rather than
           MPI_Iallreduce, which that row never timed (docs/defaults.md, "Nonblocking calls") */
        r->on_schedule = !r->blocking && r->program != NULL;
        pump_collectives(e);
        if (r->on_schedule) start_schedule(e, r);
        return;
    default:
        if (r->early) { post_ready(e, r); return; }   /* started before the check, unscaled */
        scale_buffer(r->dtype, r->buf, r->nelem, r->pre);
        start_schedule(e, r);
    }
}

void finish(EngineObject *e, run_t *r, int status) {
    if (r->done) return;
    r->done = 1;
    r->status = status;
    r->t_done = now_s();
    /* nothing will test a failed run's requests for it: it is reported now and kept while they are posted */
    if (status != STATUS_OK) r->abandoned = r->inflight > 0;
    if (status == STATUS_OK) scale_buffer(r->dtype, r->buf, r->nelem, r->post);
    /* a failed run's requests may still be posted: the buffers under them stay with the run */
    if (r->scratch_area && (status == STATUS_OK || !r->inflight)) {
        pool_give(e, r->scratch_area, r->scratch_bytes);
        r->scratch_area = r->scratch = NULL;
    }
    if (r->crecv && !r->inflight) {
        pool_give(e, r->crecv, check_capacity(e, r));
        r->crecv = NULL;
    }
    e->nfinished++;
    if (ONE_HOST_STAGE(r->kind) && r == e->shm_head) shm_next(e);
    if (MPI_COLLECTIVE(r->kind) && r == e->coll_head) pump_collectives(e);
}

void fail_run(EngineObject *e, run_t *r, const char *what, int rc) {
    if (rc != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING];
        int len = 0;
        MPI_Error_string(rc, msg, &len);
        snprintf(r->error, sizeof r->error, "%s failed: %.*s", what, len, msg);
    } else {
        snprintf(r->error, sizeof r->error, "%s", what);
    }
    finish(e, r, STATUS_ERROR);
}

/* ------------------------------------------------------------------ progress */

/* Fail every run in [from, to) that has not finished: from a call on (a peer left before
   starting it), those submitted before the stall limit's abort, or all (MPI cannot wait any
   more). Their requests stay posted, so the runs are kept, not freed. */
static void abandon(EngineObject *e, long long from, long long to, const char *why) {
    for (int i = 0; i < e->nruns; i++) {
        run_t *r = e->runs[i];
        if (r->done || r->seq < from || r->seq >= to) continue;
        snprintf(r->error, sizeof r->error, "%s", why);
        finish(e, r, STATUS_ERROR);
    }
}

static void left_before(char *why, size_t size, int rank) {
    snprintf(why, size, "rank %d shut down (hvd.shutdown(), or its process exited) before finishing this "
             "allreduce (or without starting it), which every rank must take part in", rank);
}

static void peer_left(EngineObject *e, int rank, long long seq) {
    if (e->gone_rank < 0 || seq < e->gone_seq) { e->gone_rank = rank; e->gone_seq = seq; }
    char why[200];
    left_before(why, sizeof why, rank);
    abandon(e, seq, LLONG_MAX, why);
}

static void completed(EngineObject *e, int n, int in_status) {
    /* Detach the completed requests first (moving the tail into their places, highest index
       first): handling them posts new requests at the tail. */
    run_t *runs[n > 0 ? n : 1];
    int32_t steps[n > 0 ? n : 1];
    int received[n > 0 ? n : 1], cancelled[n > 0 ? n : 1], error[n > 0 ? n : 1];
    for (int k = 0; k < n; k++) {
        runs[k] = e->owner_run[e->index[k]];
        steps[k] = e->owner_step[e->index[k]];
        received[k] = cancelled[k] = 0;
        error[k] = in_status ? e->statuses[k].MPI_ERROR : MPI_SUCCESS;
        if (steps[k] == OWNER_CHECK_RECV || steps[k] == OWNER_CHECK_PIECE)
            MPI_Get_count(&e->statuses[k], MPI_BYTE, &received[k]);
        if (steps[k] == OWNER_GOODBYE) received[k] = e->statuses[k].MPI_SOURCE;
        if (runs[k] && early_recv(runs[k], steps[k])) {
            MPI_Test_cancelled(&e->statuses[k], &cancelled[k]);
            if (!cancelled[k] && error[k] == MPI_SUCCESS) MPI_Get_count(&e->statuses[k], MPI_BYTE, &received[k]);
        }
    }
    for (int a = 1; a < n; a++) {   /* insertion sort, descending */
        int v = e->index[a], b = a - 1;
        while (b >= 0 && e->index[b] < v) { e->index[b + 1] = e->index[b]; b--; }
        e->index[b + 1] = v;
    }
    for (int k = 0; k < n; k++) {
        int i = e->index[k], last = --e->nreqs;
        if (i != last) {
            e->reqs[i] = e->reqs[last]; e->owner_run[i] = e->owner_run[last]; e->owner_step[i] = e->owner_step[last];
        }
    }
    for (int k = 0; k < n; k++) {
        run_t *r = runs[k];
        int32_t step = steps[k];
        if (step == OWNER_WAKE) { e->woken = 1; post_wake(e); continue; }
        if (step == OWNER_GOODBYE) { long long seq = e->bye_seq; post_goodbye(e); peer_left(e, received[k], seq); continue; }
        r->inflight--;
        if (r->draining) { drain_completed(e, r, step, received[k], cancelled[k], error[k]); continue; }
        if (r->done) continue;                         /* failed earlier: its other requests drain */
        if (error[k] != MPI_SUCCESS) { fail_run(e, r, "a send or receive", error[k]); continue; }
        if (early_recv(r, step)) {
            early_received(e, r, step, received[k]);
            if (r->early_bad && r->meta_checked && !r->done)
                fail_run(e, r, MISFIT, MPI_SUCCESS);
            if (r->done) continue;
        }
        switch (step) {
        case OWNER_COLLECTIVE: finish(e, r, STATUS_OK); break;
        case OWNER_CHECK_SEND: case OWNER_CHECK_RECV: case OWNER_CHECK_PIECE:
            check_completed(e, r, step, received[k]);
            break;
        case OWNER_SYNC: if (--r->pending == 0) shm_collect(e, r); break;
        default:
            complete_step(r, step);
            post_ready(e, r);
        }
    }
}

/* Block (or test once) until `until` is done, or with until NULL until any run finishes or
   the wake-up completes. Runs without the GIL. */
void progress(EngineObject *e, int block, run_t *until) {
    double last = block ? now_s() : 0;
    while (!(until && until->done)) {
        e->in_mpi = "MPI_Testsome";   /* for the stall report: polling, or asleep between polls */
        if (__atomic_load_n(&e->abort_before, __ATOMIC_ACQUIRE)) {   /* set by abort() from another thread */
            long long before = __atomic_exchange_n(&e->abort_before, 0, __ATOMIC_ACQ_REL);
            abandon(e, 0, before, e->abort_reason);
            if (until && until->done) break;
        }
        if (!until && e->nfinished) break;
        if (e->nreqs == 0) {   /* nothing can complete: the runs fail rather than wait forever */
            if (until) abandon(e, 0, LLONG_MAX, "internal error: an allreduce was in flight with nothing posted");
            break;
        }
        int n = 0, rc = MPI_Testsome(e->nreqs, e->reqs, &n, e->index, e->statuses);
        int in_status = rc == MPI_ERR_IN_STATUS;   /* a request failed: its run, not the engine */
        if (rc != MPI_SUCCESS && !in_status) {
            char msg[MPI_MAX_ERROR_STRING], why[200];
            int len = 0;
            MPI_Error_string(rc, msg, &len);
            snprintf(why, sizeof why, "MPI_Testsome failed: %.*s", len, msg);
            abandon(e, 0, LLONG_MAX, why);   /* no request of this engine can be waited for any more */
            break;
        }
        if (n != MPI_UNDEFINED && n > 0) completed(e, n, in_status);
        if (e->woken) { e->woken = 0; if (!until) break; }
        if (!block) break;
        if (n != MPI_UNDEFINED && n > 0) {
            last = now_s();
        } else {
            struct timespec ts;
            if (nap_after(e, now_s() - last, &ts)) nanosleep(&ts, NULL);
        }
    }
    e->in_mpi = NULL;
}

void free_run(run_t *r) {
    PyBuffer_Release(&r->view);
    Py_XDECREF(r->program);
    free(r->waiting); free(r->ready); free(r->meta); free(r->cmine); free(r->crecv); free(r->scratch_area); free(r->color_t); free(r->sync_in); free(r->drain); free(r);
}

/* Start a submitted run: its check (which leads to its body), in call order where it queues. */
void start_run(EngineObject *e, run_t *r) {
    r->t_start = now_s();
    if (e->gone_rank >= 0 && r->seq >= e->gone_seq) {
        left_before(r->error, sizeof r->error, e->gone_rank);
        finish(e, r, STATUS_ERROR);
    } else if (MPI_COLLECTIVE(r->kind)) {
        if (e->coll_tail) e->coll_tail->next = r; else e->coll_head = r;
        e->coll_tail = r;
        start_check(e, r);
    } else if (ONE_HOST_STAGE(r->kind)) {
        int first = e->shm_head == NULL;
        if (e->shm_tail) e->shm_tail->next = r; else e->shm_head = r;
        e->shm_tail = r;
        if (first) shm_publish(e, r);
    } else {
        r->early = early_eligible(e, r);
        if (r->early) {   /* its first messages travel while the check is out (early.c) */
            r->meta[EARLY_SLOT(r)] = 1;
            start_schedule(e, r);
            if (r->done) return;
        }
        start_check(e, r);
    }
}
