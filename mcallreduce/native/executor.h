/* Types shared by the executor's files: lowered programs, runs, the engine. */
#ifndef MCALLREDUCE_EXECUTOR_H
#define MCALLREDUCE_EXECUTOR_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>
#include <pthread.h>
#include <time.h>

#include "kernels.h"

enum { STEP_SEND = 0, STEP_RECV = 1, STEP_RECV_SCRATCH = 2, STEP_REDUCE = 3 };
enum { KIND_CHECK_ONLY = 0, KIND_SCHEDULE = 1, KIND_MPI = 2, KIND_SHARED = 3, KIND_FUSED_DOUBLING = 4, KIND_SINGLE_COPY = 5,
       KIND_MPI_RING = 6, KIND_SHARED_ONE_SYNC = 7,
       KIND_FUSED_HALVING = 8 };
/* reduced along the check's own messages (check.c): recursive doubling, or halving then an allgather */
#define FUSED(kind) ((kind) == KIND_FUSED_DOUBLING || (kind) == KIND_FUSED_HALVING)
/* the one-host stages: through the window's slots (two syncs, or one for small calls), or
   reading and writing the peers' buffers */
#define ONE_HOST_STAGE(kind) ((kind) == KIND_SHARED || (kind) == KIND_SINGLE_COPY || (kind) == KIND_SHARED_ONE_SYNC)
/* MPI's own allreduce: its default decision (coll), or Open MPI's ring (coll_ring) */
#define MPI_COLLECTIVE(kind) ((kind) == KIND_MPI || (kind) == KIND_MPI_RING)
/* from this many ranks MPI_Iallreduce sends from a copy (collective.c): libnbc's reduce-scatter */
#define MPI_SEND_COPY_RANKS 4
/* The metadata vector's last slot of each half (mcallreduce/check.py): MAX-reduced by the
 * check, never compared. An MPI collective's first is 1 where this rank cannot wait for it
 * alone; the second is 1 where this rank sent data before the check (early.c). */
#define AGREED_SLOT(r) ((r)->nmeta / 2 - 1)
#define EARLY_SLOT(r) ((r)->nmeta - 1)
enum { CHECK_OFF = 0, CHECK_ON = 1 };
enum { STATUS_OK = 0, STATUS_MISMATCH = 1, STATUS_ERROR = 2 };
enum { OWNER_CHECK_SEND = -1, OWNER_COLLECTIVE = -2, OWNER_SYNC = -3, OWNER_WAKE = -4, OWNER_CHECK_RECV = -5,
       OWNER_GOODBYE = -6, OWNER_CHECK_PIECE = -7, OWNER_FENCE = -8,
       OWNER_DRAIN = -16 /* minus the peer: a drain receive (early.c) */ };
#define LOWERED_COLUMNS 11  /* op, peer, offset, count, scratch, tag, ndeps, incoming_left, color, phase, early */
#define POOL_SLOTS 8

typedef struct {
    int32_t op, peer, tag, ndeps, left;
    int32_t color, phase;   /* color -1: a done message; phase 0 reduces, 1 broadcasts (lowering.py) */
    int32_t early;          /* posted before the check (early.c) */
    int64_t offset, count, scratch;
} step_t;

typedef struct {
    PyObject_HEAD
    int64_t nsteps, scratch_elems;
    int ncolors, has_early;
    step_t *steps;
    int64_t *dep_ptr;      /* dependents of step i: dependents[dep_ptr[i]:dep_ptr[i + 1]] */
    int32_t *dependents;
} ProgramObject;

typedef struct {
    PyObject_HEAD
    int kind, dtype, op, check, nmeta;
    double post;
    PyObject *program;     /* ProgramObject or NULL */
    int64_t *meta;         /* nmeta entries, or NULL */
} TemplateObject;

extern PyTypeObject ProgramType, TemplateType;  /* program.c */

/* Every type of the executor: built by its init, freed by its dealloc, no attributes but METHODS. */
#define EXECUTOR_TYPE(NAME, OBJECT, DOC, INIT, DEALLOC, METHODS)                                   \
    {PyVarObject_HEAD_INIT(NULL, 0) .tp_name = "mcallreduce._executor." NAME, .tp_doc = DOC,        \
     .tp_basicsize = sizeof(OBJECT), .tp_flags = Py_TPFLAGS_DEFAULT, .tp_new = PyType_GenericNew,  \
     .tp_init = (initproc)(INIT), .tp_dealloc = (destructor)(DEALLOC), .tp_methods = (METHODS)}

typedef struct run {
    long long seq;
    int kind, check, status, done, pending, tag0, dtype, op, coll_ready;
    int inflight;               /* its requests still posted: a run is drained only at 0 */
    int blocking;               /* MPI's blocking allreduce: every rank waits for this run alone */
    int on_schedule;            /* an MPI collective that runs its plan's schedule instead */
    int abandoned;              /* failed while its requests were posted: reported, never freed */
    struct run *grave;          /* the abandoned runs, kept while MPI may still write to them */
    PyObject *program;          /* ProgramObject or NULL */
    Py_buffer view;             /* the user's buffer, held until the run is drained */
    char *buf;
    int64_t nelem;
    size_t isz;
    double pre, post;
    int32_t *waiting, *ready;
    int64_t nready, remaining;
    char *scratch_area;         /* what was allocated (scratch_bytes), and where scratch starts in it */
    char *scratch;
    size_t scratch_bytes;
    int nmeta;
    int64_t *meta, *meta_out;   /* this rank's vector; the MAX over every rank's, once checked */
    /* the check (check.c): its step, what this rank sends (the MAX so far, then a fused call's
       data), what it receives, and whether the data still holds a valid partial result */
    int cstep, data_bad, received, meta_checked;
    int gather;                 /* a fused halving call: the allgather's exchanges, once agreed */
    int from_buf, in_buf;       /* its first exchange reads the user's buffer; its result is there */
    char *cmine, *crecv;
    /* data before the check (early.c): posted, a message that did not fit, and after a mismatch
       the drain, and per peer whether its fence arrived */
    int early, early_bad, draining;
    int *drain;
    size_t cmine_bytes;
    struct run *next;           /* in the collective or shared-memory queue */
    double t_start, t_checked, t_done;   /* CLOCK_MONOTONIC seconds (Python's time.monotonic) */
    /* per color c: [the last reducing step's end, the last step's end] (0: none yet) of color
       first_color + c; a schedule has all its colors, the shared-memory stage this rank's one */
    double *color_t;
    int ncolors, first_color;
    char *sync_in;              /* the shared stage's sync 2: one byte from each peer, 1 if it failed */
    int parity;                 /* the one-sync stage: which of its two slots per rank this call uses */
    char error[200];
} run_t;

typedef struct {
    PyObject_HEAD
    MPI_Comm comm, ctl, coll, coll_ring;
    int rank, size, check_tag, sync_tag, early_tag, woken;
    /* the wake-up: a generalized request in every wait, which any thread completes (under
       wake_lock, while armed) to make a blocked progress() return */
    MPI_Request wake_req;
    int wake_on, wake_armed;
    pthread_mutex_t wake_lock;
    /* a peer's goodbye (its lowest unfinished call) and the calls it will never make */
    MPI_Comm bye;
    int bye_on, gone_rank;
    long long abort_before;   /* abort(): the runs submitted before it fail (0: none asked); atomic */
    long long bye_seq, gone_seq, next_seq;
    run_t *graveyard;
    char abort_reason[200];
    size_t fused_max;           /* the largest fused call's data: every check receive holds this much */
    size_t early_max;           /* the largest early message (early.c): every early receive holds this much */
    char *discard;              /* early_max bytes the drain receives into, never read */
    size_t piece_bytes;         /* the check's messages travel in pieces of at most this much */
    double poll_s;              /* a blocking wait polls this long after a completion, then naps */
    MPI_Status *statuses;
    MPI_Request *reqs;
    run_t **owner_run;
    int32_t *owner_step;
    int *index;
    int nreqs, cap;
    run_t **runs;               /* every run not yet drained */
    run_t *waited;              /* the run submit(wait=True) is blocked on (read with the GIL) */
    int nruns, runs_cap, nfinished;
    run_t *coll_head, *coll_tail, *shm_head, *shm_tail;
    MPI_Win win;
    char *win_base;
    int64_t slot_bytes, small_bytes;   /* the window: p + 1 slots, then 2p small ones (one sync) */
    long long stage_calls;      /* one-host stage calls every rank agreed on: the same on every rank */
    void *pool[POOL_SLOTS];
    size_t pool_bytes[POOL_SLOTS];
    char sync_ok, sync_failed;   /* what the shared stage's sync 2 sends: 0, or 1 after a failure */
    /* for the stall report, read from other threads: the MPI call the executor is inside
       (NULL: none), and the wake-ups other threads have in progress */
    const char *volatile in_mpi;
    volatile int wakes_sending;
} EngineObject;

/* executor.c */
double now_s(void);   /* CLOCK_MONOTONIC, in seconds */
void *pool_take(EngineObject *e, size_t bytes);   /* buffers that recur (scratch, check) */
void pool_give(EngineObject *e, void *p, size_t bytes);
int add_request(EngineObject *e, MPI_Request req, run_t *r, int32_t step);
void fail_run(EngineObject *e, run_t *r, const char *what, int rc);
void finish(EngineObject *e, run_t *r, int status);
void checked(EngineObject *e, run_t *r);   /* the check is done: meta_out holds every rank's MAX */
int agreed(const run_t *r);                /* whether meta_out says every rank sent this rank's vector */

void start_run(EngineObject *e, run_t *r);            /* a submitted run, from its check on */
void progress(EngineObject *e, int block, run_t *until);   /* without the GIL */
void free_run(run_t *r);

/* naps.c: after `idle` seconds without a completion, whether a blocking wait sleeps, and for how long */
int nap_after(const EngineObject *e, double idle, struct timespec *ts);

/* standing.c: the wake-up and goodbye requests every wait includes */
void post_wake(EngineObject *e);
int wake(EngineObject *e);            /* from any thread: MPI_SUCCESS or the MPI error */
void post_goodbye(EngineObject *e);
void cancel_standing(EngineObject *e, int32_t owner);

/* early.c: a schedule's first messages, posted before the check; the drain after a mismatch */
int early_eligible(EngineObject *e, run_t *r);   /* whether this run posts data before its check */
void post_early(EngineObject *e, run_t *r, int64_t i);   /* one early step, on the early tag */
void start_drain(EngineObject *e, run_t *r);     /* a mismatch after early data: fence and drain */
void drain_completed(EngineObject *e, run_t *r, int32_t owner, int count, int cancelled, int error);
int early_recv(const run_t *r, int32_t owner);   /* whether `owner` is one of r's receives on the early tag */
void early_received(EngineObject *e, run_t *r, int32_t owner, int count);   /* before any drain */

/* collective.c: MPI's own allreduce, started in call order */
void pump_collectives(EngineObject *e);

/* shared_stage.c: the one-host shared-memory stage */
void shm_publish(EngineObject *e, run_t *r);   /* step 1, then the check */
void shm_reduce(EngineObject *e, run_t *r);    /* step 2, once checked: this rank's color, then sync 2 */
void shm_collect(EngineObject *e, run_t *r);   /* step 3, once sync 2 is done */
int probe_peer_copy(pid_t pid, intptr_t address, int64_t *value);   /* single copy works: 0, or an errno */
void shm_next(EngineObject *e);                /* the queue's head finished: publish the next */

/* check.c: the cross-rank metadata check */
void start_check(EngineObject *e, run_t *r);
void check_completed(EngineObject *e, run_t *r, int32_t owner, int received_bytes);
int check_peer(EngineObject *e, run_t *r);   /* the rank the check's current step waits for */
size_t check_capacity(EngineObject *e, run_t *r);   /* bytes of a check receive buffer */
char *check_data(run_t *r);                  /* a fused call's data in this rank's check message */

/* Post a request and record its owner; a failed post fails the run. */
#define POST(e, r, step, call)                                          \
    do {                                                                \
        MPI_Request req_;                                               \
        (e)->in_mpi = "posting a send or receive";                      \
        int rc_ = (call);                                               \
        (e)->in_mpi = NULL;                                             \
        if (rc_ != MPI_SUCCESS) { fail_run(e, r, #call, rc_); return; } \
        if (add_request(e, req_, r, step) < 0) { fail_run(e, r, "out of memory", MPI_SUCCESS); return; } \
    } while (0)

#endif
