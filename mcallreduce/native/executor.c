/* The compiled executor: runs lowered allreduce schedules over MPI with the GIL released.
 *
 * One Engine per communicator context owns every MPI request of every allreduce in
 * flight ("runs"), so waiting on one run progresses all the others: ranks that wait in
 * different orders cannot deadlock each other. A run goes through
 *
 *   check  -> the cross-rank metadata check: an Iallreduce(MAX) of the metadata vector on
 *             the control communicator, or on one host a point-to-point exchange of it;
 *   body   -> a schedule (steps posted as Isend/Irecv as their dependencies complete, the
 *             reductions done inline), MPI's own Iallreduce (posted in call order), or the
 *             one-host shared-memory stage (publish, check, reduce a color, sync, collect);
 *   done   -> postscale, then reported to Python by the next drain.
 *
 * Python (mcallreduce/engine.py) serialises calls into an Engine: it is not thread-safe
 * on its own, but any one call may block in MPI with the GIL released.
 */
#include <stdlib.h>

#include "executor.h"

/* ------------------------------------------------------------------ lowered program */

static int read_int64(PyObject *obj, int64_t **out, Py_ssize_t *n) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view.itemsize != 8) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "lowered arrays must be int64");
        return -1;
    }
    *n = view.len / 8;
    *out = malloc((size_t)(*n ? *n : 1) * 8);
    if (!*out) { PyBuffer_Release(&view); PyErr_NoMemory(); return -1; }
    memcpy(*out, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return 0;
}

static int Program_init(ProgramObject *self, PyObject *args, PyObject *kw) {
    PyObject *steps_obj, *ptr_obj, *deps_obj;
    long long scratch;
    static char *names[] = {"steps", "dep_ptr", "dependents", "scratch_elems", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOL", names, &steps_obj, &ptr_obj, &deps_obj, &scratch))
        return -1;
    int64_t *raw = NULL, *deps = NULL;
    Py_ssize_t nraw, nptr, ndeps;
    if (read_int64(steps_obj, &raw, &nraw) < 0) return -1;
    if (read_int64(ptr_obj, &self->dep_ptr, &nptr) < 0) { free(raw); return -1; }
    if (read_int64(deps_obj, &deps, &ndeps) < 0) { free(raw); return -1; }
    self->nsteps = nraw / LOWERED_COLUMNS;
    if (nraw % LOWERED_COLUMNS || nptr != self->nsteps + 1 || self->dep_ptr[self->nsteps] != ndeps) {
        free(raw); free(deps);
        PyErr_SetString(PyExc_ValueError, "inconsistent lowered program");
        return -1;
    }
    self->steps = malloc(sizeof(step_t) * (size_t)(self->nsteps ? self->nsteps : 1));
    self->dependents = malloc(sizeof(int32_t) * (size_t)(ndeps ? ndeps : 1));
    for (int64_t i = 0; i < self->nsteps; i++) {
        int64_t *r = raw + i * LOWERED_COLUMNS;
        step_t *s = &self->steps[i];
        s->op = (int32_t)r[0]; s->peer = (int32_t)r[1]; s->offset = r[2]; s->count = r[3];
        s->scratch = r[4]; s->tag = (int32_t)r[5]; s->ndeps = (int32_t)r[6]; s->left = (int32_t)r[7];
    }
    for (Py_ssize_t i = 0; i < ndeps; i++) self->dependents[i] = (int32_t)deps[i];
    free(raw); free(deps);
    self->scratch_elems = scratch;
    return 0;
}

static void Program_dealloc(ProgramObject *self) {
    free(self->steps); free(self->dep_ptr); free(self->dependents);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Program_len(ProgramObject *self, void *closure) { return PyLong_FromLongLong(self->nsteps); }

static PyGetSetDef Program_getset[] = {
    {"nsteps", (getter)Program_len, NULL, "number of steps", NULL},
    {NULL}
};

static PyTypeObject ProgramType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mcallreduce._executor.Program",
    .tp_doc = "One rank's lowered schedule: flat step arrays and the dependents' CSR lists.",
    .tp_basicsize = sizeof(ProgramObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Program_init,
    .tp_dealloc = (destructor)Program_dealloc,
    .tp_getset = Program_getset,
};


/* ------------------------------------------------------------------ call template */

/* What does not change from one call of a plan to the next: parsed once per plan. */
static int Template_init(TemplateObject *self, PyObject *args, PyObject *kw) {
    PyObject *program, *meta;
    static char *names[] = {"kind", "program", "dtype", "op", "postscale", "meta", "check", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOiidOi", names, &self->kind, &program, &self->dtype, &self->op,
                                     &self->post, &meta, &self->check))
        return -1;
    if (self->kind == KIND_SCHEDULE && !PyObject_TypeCheck(program, &ProgramType)) {
        PyErr_SetString(PyExc_TypeError, "a schedule needs a Program");
        return -1;
    }
    if (dtype_size(self->dtype) == 0) { PyErr_SetString(PyExc_ValueError, "unknown dtype code"); return -1; }
    if (program != Py_None) { Py_INCREF(program); Py_XSETREF(self->program, program); }
    if (meta != Py_None) {
        Py_ssize_t n;
        free(self->meta);
        self->meta = NULL;
        if (read_int64(meta, &self->meta, &n) < 0) return -1;
        self->nmeta = (int)n;
    } else if (self->check != CHECK_OFF || self->kind == KIND_CHECK_ONLY) {
        PyErr_SetString(PyExc_ValueError, "a checked call needs its metadata vector");
        return -1;
    }
    return 0;
}

static void Template_dealloc(TemplateObject *self) {
    Py_XDECREF(self->program);
    free(self->meta);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject TemplateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mcallreduce._executor.Template",
    .tp_doc = "Template(kind, program, dtype, op, postscale, meta, check): one plan's fixed call arguments.",
    .tp_basicsize = sizeof(TemplateObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Template_init,
    .tp_dealloc = (destructor)Template_dealloc,
};

/* ------------------------------------------------------------------ runs */


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

static void color_range(int64_t nelem, int nranks, int color, int64_t *lo, int64_t *count) {
    int64_t base = nelem / nranks, extra = nelem % nranks;
    *lo = color * base + (color < extra ? color : extra);
    *count = base + (color < extra ? 1 : 0);
}

static char *area(EngineObject *e, int i) { return e->win_base + (int64_t)i * e->slot_bytes; }

/* ---- the shared stage's sync 2: a zero-byte message to and from every other rank */

static void post_sync(EngineObject *e, run_t *r) {
    r->pending = 2 * (e->size - 1);
    for (int q = 0; q < e->size; q++) {
        if (q == e->rank) continue;
        POST(e, r, OWNER_SYNC, MPI_Irecv(&e->wake_byte, 0, MPI_BYTE, q, r->tag0 + e->sync_tag, e->comm, &req_));
        POST(e, r, OWNER_SYNC, MPI_Isend(&e->wake_send, 0, MPI_BYTE, q, r->tag0 + e->sync_tag, e->comm, &req_));
    }
}

/* ---- bodies */

static void complete_step(run_t *r, int64_t i) {
    ProgramObject *p = (ProgramObject *)r->program;
    r->remaining--;
    for (int64_t k = p->dep_ptr[i]; k < p->dep_ptr[i + 1]; k++) {
        int32_t j = p->dependents[k];
        if (--r->waiting[j] == 0) r->ready[r->nready++] = j;
    }
}

static void post_ready(EngineObject *e, run_t *r) {
    ProgramObject *p = (ProgramObject *)r->program;
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

static void start_schedule(EngineObject *e, run_t *r) {
    ProgramObject *p = (ProgramObject *)r->program;
    r->scratch_bytes = (size_t)p->scratch_elems * r->isz;
    r->scratch = pool_take(e, r->scratch_bytes);
    r->waiting = malloc(sizeof(int32_t) * (size_t)(p->nsteps + 1));
    r->ready = malloc(sizeof(int32_t) * (size_t)(p->nsteps + 1));
    if (!r->scratch || !r->waiting || !r->ready) { fail_run(e, r, "out of memory", MPI_SUCCESS); return; }
    r->remaining = p->nsteps;
    r->nready = 0;
    for (int64_t i = p->nsteps - 1; i >= 0; i--) {   /* popped in step order */
        r->waiting[i] = p->steps[i].ndeps;
        if (r->waiting[i] == 0) r->ready[r->nready++] = (int32_t)i;
    }
    post_ready(e, r);
}

static MPI_Datatype mpi_type(int dtype) {
    switch (dtype) {
    case DT_F32: return MPI_FLOAT;
    case DT_F64: return MPI_DOUBLE;
    case DT_I32: return MPI_INT32_T;
    case DT_I64: return MPI_INT64_T;
    default: return MPI_DATATYPE_NULL;
    }
}

static MPI_Op mpi_op(int op) {
    switch (op) {
    case OP_MIN: return MPI_MIN;
    case OP_MAX: return MPI_MAX;
    case OP_PRODUCT: return MPI_PROD;
    default: return MPI_SUM;
    }
}

/* MPI collectives start in call order on every rank: the queue's head goes first. */
static void pump_collectives(EngineObject *e) {
    while (e->coll_head && (e->coll_head->done || e->coll_head->coll_ready)) {
        run_t *r = e->coll_head;
        e->coll_head = r->next;
        if (!e->coll_head) e->coll_tail = NULL;
        r->next = NULL;
        if (r->done) continue;
        if (r->nelem == 0) { finish(e, r, STATUS_OK); continue; }
        if (r->blocking) {   /* MPI's blocking allreduce: no libnbc progress rounds */
            int rc = MPI_Allreduce(MPI_IN_PLACE, r->buf, (int)r->nelem, mpi_type(r->dtype), mpi_op(r->op), e->coll);
            if (rc != MPI_SUCCESS) fail_run(e, r, "MPI_Allreduce", rc);
            else finish(e, r, STATUS_OK);
            continue;
        }
        MPI_Request req;
        int rc = MPI_Iallreduce(MPI_IN_PLACE, r->buf, (int)r->nelem, mpi_type(r->dtype), mpi_op(r->op), e->coll, &req);
        if (rc != MPI_SUCCESS) { fail_run(e, r, "MPI_Iallreduce", rc); continue; }
        if (add_request(e, req, r, OWNER_COLLECTIVE) < 0) fail_run(e, r, "out of memory", MPI_SUCCESS);
    }
}

/* Shared memory, step 1: publish this rank's data into its slot, then the check (sync 1). */
static void shm_publish(EngineObject *e, run_t *r) {
    char *slot = area(e, e->rank);
    if (r->pre != 1.0) {
        memcpy(slot, r->buf, (size_t)(r->nelem * r->isz));
        scale_buffer(r->dtype, slot, r->nelem, r->pre);
    } else {   /* all but this rank's own color, which it reduces from its buffer */
        int64_t lo, count;
        color_range(r->nelem, e->size, e->rank, &lo, &count);
        memcpy(slot, r->buf, (size_t)(lo * r->isz));
        memcpy(slot + (lo + count) * r->isz, r->buf + (lo + count) * r->isz,
               (size_t)((r->nelem - lo - count) * r->isz));
    }
    MPI_Win_sync(e->win);
    start_check(e, r);
}

/* Step 2: fold color `rank` of every rank's data, in rank order, into the result area. */
static void shm_reduce(EngineObject *e, run_t *r) {
    MPI_Win_sync(e->win);
    int64_t lo, count;
    color_range(r->nelem, e->size, e->rank, &lo, &count);
    size_t off = (size_t)(lo * r->isz), bytes = (size_t)(count * r->isz);
    char *out = area(e, e->size) + off;
    for (int q = 0; q < e->size; q++) {
        const char *src = (q == e->rank && r->pre == 1.0) ? r->buf + off : area(e, q) + off;
        if (q == 0) memcpy(out, src, bytes);
        else reduce_into(r->dtype, r->op, out, src, count, 0);
    }
    MPI_Win_sync(e->win);
    post_sync(e, r);
}

/* Step 3, once every peer's sync 2 arrived: copy the result area into the buffer. */
static void shm_collect(EngineObject *e, run_t *r) {
    MPI_Win_sync(e->win);
    memcpy(r->buf, area(e, e->size), (size_t)(r->nelem * r->isz));
    finish(e, r, STATUS_OK);
}

static void shm_next(EngineObject *e) {
    while (e->shm_head && e->shm_head->done) {
        run_t *r = e->shm_head;
        e->shm_head = r->next;
        if (!e->shm_head) e->shm_tail = NULL;
        r->next = NULL;
        if (e->shm_head) shm_publish(e, e->shm_head);
    }
}

void checked(EngineObject *e, run_t *r) {
    r->meta_checked = 1;
    if (r->kind == KIND_CHECK_ONLY ||
        (r->check != CHECK_OFF && memcmp(r->meta, r->meta_out, sizeof(int64_t) * r->nmeta) != 0)) {
        finish(e, r, STATUS_MISMATCH);
        return;
    }
    switch (r->kind) {
    case KIND_FUSED:   /* the data was reduced along the check: every rank agreed, so it is the result */
        if (r->data_bad) { fail_run(e, r, "internal error: a fused call's data was not reduced", MPI_SUCCESS); return; }
        memcpy(r->buf, r->cmine + sizeof(int64_t) * (size_t)r->nmeta, (size_t)(r->nelem * r->isz));
        finish(e, r, STATUS_OK);
        return;
    case KIND_SHARED:
        shm_reduce(e, r);
        if (!r->done && r->pending == 0) shm_collect(e, r);   /* a single rank */
        return;
    case KIND_MPI:
        scale_buffer(r->dtype, r->buf, r->nelem, r->pre);
        r->coll_ready = 1;
        pump_collectives(e);
        return;
    default:
        scale_buffer(r->dtype, r->buf, r->nelem, r->pre);
        start_schedule(e, r);
    }
}

void finish(EngineObject *e, run_t *r, int status) {
    if (r->done) return;
    r->done = 1;
    r->status = status;
    if (status == STATUS_OK) scale_buffer(r->dtype, r->buf, r->nelem, r->post);
    if (r->scratch) { pool_give(e, r->scratch, r->scratch_bytes); r->scratch = NULL; }
    if (r->crecv && !r->inflight) {   /* a receive still posted (a failed run) keeps its buffer */
        pool_give(e, r->crecv, sizeof(int64_t) * (size_t)r->nmeta + e->fused_max);
        r->crecv = NULL;
    }
    e->nfinished++;
    if (r->kind == KIND_SHARED && r == e->shm_head) shm_next(e);
    if (r->kind == KIND_MPI && r == e->coll_head) pump_collectives(e);
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

static void post_wake(EngineObject *e) {
    MPI_Request req;
    if (MPI_Irecv(&e->wake_byte, 1, MPI_BYTE, e->rank, 0, e->wake, &req) == MPI_SUCCESS)
        add_request(e, req, NULL, OWNER_WAKE);
}

static void post_goodbye(EngineObject *e) {
    MPI_Request req;
    if (MPI_Irecv(&e->bye_seq, 1, MPI_LONG_LONG, MPI_ANY_SOURCE, 0, e->bye, &req) == MPI_SUCCESS)
        add_request(e, req, NULL, OWNER_GOODBYE);
}

/* Fail every run that cannot finish: from `seq` on (a peer left before starting it), or all
   (seq < 0: the stall limit). Their requests stay posted, so the runs are kept, not freed. */
static void abandon(EngineObject *e, long long seq, const char *why) {
    for (int i = 0; i < e->nruns; i++) {
        run_t *r = e->runs[i];
        if (r->done || (seq >= 0 && r->seq < seq)) continue;
        snprintf(r->error, sizeof r->error, "%s", why);
        r->abandoned = r->inflight > 0;
        finish(e, r, STATUS_ERROR);
    }
}

static void peer_left(EngineObject *e, int rank, long long seq) {
    if (e->gone_rank < 0 || seq < e->gone_seq) { e->gone_rank = rank; e->gone_seq = seq; }
    char why[200];
    snprintf(why, sizeof why, "rank %d shut down (hvd.shutdown(), or its process exited) before starting this "
             "allreduce, which every rank must take part in", rank);
    abandon(e, seq, why);
}

static void completed(EngineObject *e, int n) {
    /* Detach the completed requests first (moving the tail into their places, highest index
       first): handling them posts new requests at the tail. */
    run_t *runs[n > 0 ? n : 1];
    int32_t steps[n > 0 ? n : 1];
    int received[n > 0 ? n : 1];
    for (int k = 0; k < n; k++) {
        runs[k] = e->owner_run[e->index[k]];
        steps[k] = e->owner_step[e->index[k]];
        received[k] = 0;
        if (steps[k] == OWNER_CHECK_RECV) MPI_Get_count(&e->statuses[k], MPI_BYTE, &received[k]);
        if (steps[k] == OWNER_GOODBYE) received[k] = e->statuses[k].MPI_SOURCE;
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
        if (r->done) continue;                         /* failed earlier: its other requests drain */
        switch (step) {
        case OWNER_COLLECTIVE: finish(e, r, STATUS_OK); break;
        case OWNER_CHECK_SEND: case OWNER_CHECK_RECV: check_completed(e, r, step, received[k]); break;
        case OWNER_SYNC: if (--r->pending == 0) shm_collect(e, r); break;
        default:
            complete_step(r, step);
            post_ready(e, r);
        }
    }
}

/* Block (or test once) until `until` is done, or with until NULL until any run finishes or
   the wake message arrives. Runs without the GIL. */
static void progress(EngineObject *e, int block, run_t *until) {
    while (!(until && until->done)) {
        if (!until && e->nfinished) break;
        if (e->nreqs == 0) {
            if (until) snprintf(e->fatal, sizeof e->fatal, "internal error: an allreduce is in flight with nothing posted");
            break;
        }
        int n = 0, rc = block ? MPI_Waitsome(e->nreqs, e->reqs, &n, e->index, e->statuses)
                              : MPI_Testsome(e->nreqs, e->reqs, &n, e->index, e->statuses);
        if (rc != MPI_SUCCESS) {
            char msg[MPI_MAX_ERROR_STRING];
            int len = 0;
            MPI_Error_string(rc, msg, &len);
            snprintf(e->fatal, sizeof e->fatal, "MPI_Waitsome failed: %.*s", len, msg);
            break;
        }
        if (n != MPI_UNDEFINED && n > 0) completed(e, n);
        if (e->abort_requested) { e->abort_requested = 0; abandon(e, -1, e->abort_reason); }
        if (e->woken) { e->woken = 0; if (!until) break; }
        if (!block) break;
    }
}

static void free_run(run_t *r) {
    PyBuffer_Release(&r->view);
    Py_XDECREF(r->program);
    free(r->waiting); free(r->ready); free(r->meta); free(r->cmine); free(r->crecv); free(r);
}

/* The finished runs as [(seq, status, payload)], removed from the engine (needs the GIL). */
static PyObject *drain(EngineObject *e) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int i = 0; i < e->nruns;) {
        run_t *r = e->runs[i];
        if (!r->done || (r->inflight && !r->abandoned)) { i++; continue; }
        PyObject *payload;
        if (r->status == STATUS_MISMATCH)
            payload = PyBytes_FromStringAndSize((const char *)r->meta_out, sizeof(int64_t) * r->nmeta);
        else if (r->status == STATUS_ERROR)
            payload = PyUnicode_FromString(r->error);
        else
            payload = Py_NewRef(Py_None);
        PyObject *item = Py_BuildValue("(LiN)", r->seq, r->status, payload);
        if (!item || PyList_Append(out, item) < 0) { Py_XDECREF(item); Py_DECREF(out); return NULL; }
        Py_DECREF(item);
        e->nfinished--;
        e->runs[i] = e->runs[--e->nruns];
        if (r->abandoned) { r->grave = e->graveyard; e->graveyard = r; }   /* MPI may still write to it */
        else free_run(r);
    }
    if (e->fatal[0]) {
        PyErr_Format(PyExc_RuntimeError, "mcallreduce: %s", e->fatal);
        e->fatal[0] = 0;
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* ------------------------------------------------------------------ Python interface */

static MPI_Comm comm_of(long long handle) { return MPI_Comm_f2c((MPI_Fint)handle); }

static int Engine_init(EngineObject *self, PyObject *args, PyObject *kw) {
    long long comm, ctl, coll;
    long long fused_max;
    static char *names[] = {"comm", "ctl", "coll", "check_tag", "sync_tag", "fused_max", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLLiiL", names, &comm, &ctl, &coll, &self->check_tag,
                                     &self->sync_tag, &fused_max))
        return -1;
    self->fused_max = (size_t)fused_max;
    self->comm = comm_of(comm); self->ctl = comm_of(ctl); self->coll = comm_of(coll);
    MPI_Comm_rank(self->comm, &self->rank);
    MPI_Comm_size(self->comm, &self->size);
    self->win = MPI_WIN_NULL;
    self->gone_rank = -1;
    return 0;
}

static void Engine_dealloc(EngineObject *self) {
    for (int i = 0; i < self->nruns; i++) free_run(self->runs[i]);
    while (self->graveyard) { run_t *r = self->graveyard; self->graveyard = r->grave; free_run(r); }
    for (int i = 0; i < POOL_SLOTS; i++) free(self->pool[i]);
    free(self->reqs); free(self->owner_run); free(self->owner_step); free(self->index); free(self->statuses);
    free(self->runs);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Engine_set_window(EngineObject *self, PyObject *args) {
    long long win, base, slot;
    if (!PyArg_ParseTuple(args, "LLL", &win, &base, &slot)) return NULL;
    if (self->shm_head) { PyErr_SetString(PyExc_RuntimeError, "shared-memory allreduces in flight"); return NULL; }
    self->win = win < 0 ? MPI_WIN_NULL : MPI_Win_f2c((MPI_Fint)win);
    self->win_base = (char *)(intptr_t)base;
    self->slot_bytes = slot;
    Py_RETURN_NONE;
}

/* submit(seq, tag0, wait, template, buffer, prescale): start one call. With wait (only
   when nothing else is in flight) it runs to completion and returns (status, payload);
   else None, and progress() reports it. */
static PyObject *Engine_submit(EngineObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyObject_TypeCheck(args[3], &TemplateType)) {
        PyErr_SetString(PyExc_TypeError, "submit(seq, tag0, wait, template, buffer, prescale)");
        return NULL;
    }
    long long seq = PyLong_AsLongLong(args[0]);
    int tag0 = (int)PyLong_AsLong(args[1]), wait = PyObject_IsTrue(args[2]);
    TemplateObject *t = (TemplateObject *)args[3];
    double pre = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (t->kind == KIND_SHARED && self->win == MPI_WIN_NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no shared-memory window"); return NULL;
    }
    if (wait && self->nruns) { PyErr_SetString(PyExc_RuntimeError, "a waited call needs an idle engine"); return NULL; }
    run_t *r = calloc(1, sizeof(run_t));
    if (!r) return PyErr_NoMemory();
    if (PyObject_GetBuffer(args[4], &r->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) { free(r); return NULL; }
    if (seq >= self->next_seq) self->next_seq = seq + 1;
    r->seq = seq; r->kind = t->kind; r->dtype = t->dtype; r->op = t->op; r->pre = pre; r->post = t->post;
    r->tag0 = tag0; r->check = t->check; r->blocking = wait;
    r->isz = dtype_size(t->dtype);
    r->buf = r->view.buf;
    r->nelem = (int64_t)(r->view.len / (Py_ssize_t)r->isz);
    if (t->program) { Py_INCREF(t->program); r->program = t->program; }
    if (t->meta) {
        r->nmeta = t->nmeta;
        r->meta = malloc(sizeof(int64_t) * (size_t)r->nmeta * 2);
        if (!r->meta) { free_run(r); return PyErr_NoMemory(); }
        memcpy(r->meta, t->meta, sizeof(int64_t) * (size_t)r->nmeta);
        r->meta_out = r->meta + r->nmeta;
    }
    if (self->nruns == self->runs_cap) {
        int cap = self->runs_cap ? 2 * self->runs_cap : 64;
        run_t **runs = realloc(self->runs, sizeof(run_t *) * cap);
        if (!runs) { free_run(r); return PyErr_NoMemory(); }
        self->runs = runs; self->runs_cap = cap;
    }
    self->runs[self->nruns++] = r;
    Py_BEGIN_ALLOW_THREADS
    if (self->gone_rank >= 0 && seq >= self->gone_seq) {
        snprintf(r->error, sizeof r->error, "rank %d shut down (hvd.shutdown(), or its process exited) before "
                 "starting this allreduce, which every rank must take part in", self->gone_rank);
        finish(self, r, STATUS_ERROR);
    } else if (r->kind == KIND_MPI) {
        if (self->coll_tail) self->coll_tail->next = r; else self->coll_head = r;
        self->coll_tail = r;
        start_check(self, r);
    } else if (r->kind == KIND_SHARED) {
        int first = self->shm_head == NULL;
        if (self->shm_tail) self->shm_tail->next = r; else self->shm_head = r;
        self->shm_tail = r;
        if (first) shm_publish(self, r);
    } else {
        start_check(self, r);
    }
    if (wait) progress(self, 1, r);
    Py_END_ALLOW_THREADS
    if (!wait) Py_RETURN_NONE;
    if (r->done && !r->inflight && self->nruns == 1 && !self->fatal[0]) {
        /* the waited call was alone: report it without building the drain's list */
        PyObject *payload = r->status == STATUS_MISMATCH
            ? PyBytes_FromStringAndSize((const char *)r->meta_out, sizeof(int64_t) * r->nmeta)
            : r->status == STATUS_ERROR ? PyUnicode_FromString(r->error) : Py_NewRef(Py_None);
        int status = r->status;
        self->nruns = 0;
        self->nfinished = 0;
        free_run(r);
        if (!payload) return NULL;
        return Py_BuildValue("(iN)", status, payload);
    }
    PyObject *finished = drain(self);   /* failed with requests still posted, say */
    if (!finished) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(finished); i++) {
        PyObject *item = PyList_GET_ITEM(finished, i);
        if (PyLong_AsLongLong(PyTuple_GET_ITEM(item, 0)) == seq) {
            PyObject *outcome = PyTuple_GetSlice(item, 1, 3);
            Py_DECREF(finished);
            return outcome;
        }
    }
    Py_DECREF(finished);
    PyErr_SetString(PyExc_RuntimeError, "mcallreduce: internal error, a waited call did not finish");
    return NULL;
}

static PyObject *Engine_progress(EngineObject *self, PyObject *args) {
    int block;
    long long until = -1;
    if (!PyArg_ParseTuple(args, "p|L", &block, &until)) return NULL;
    run_t *target = NULL;
    if (until >= 0) {
        for (int i = 0; i < self->nruns; i++) if (self->runs[i]->seq == until) { target = self->runs[i]; break; }
        if (!target) return PyList_New(0);   /* drained already */
    }
    Py_BEGIN_ALLOW_THREADS
    progress(self, block, target);
    Py_END_ALLOW_THREADS
    return drain(self);
}

static PyObject *Engine_enable_wake(EngineObject *self, PyObject *args) {
    long long wake;
    if (!PyArg_ParseTuple(args, "L", &wake)) return NULL;
    if (self->wake_on) Py_RETURN_NONE;
    self->wake = comm_of(wake);
    self->wake_on = 1;
    post_wake(self);
    Py_RETURN_NONE;
}

static PyObject *Engine_disable_wake(EngineObject *self, PyObject *noargs) {
    for (int i = 0; i < self->nreqs; i++) {
        if (self->owner_step[i] != OWNER_WAKE) continue;
        MPI_Cancel(&self->reqs[i]);
        MPI_Wait(&self->reqs[i], MPI_STATUS_IGNORE);
        int last = --self->nreqs;
        self->reqs[i] = self->reqs[last]; self->owner_run[i] = self->owner_run[last];
        self->owner_step[i] = self->owner_step[last];
        break;
    }
    self->wake_on = 0;
    Py_RETURN_NONE;
}

/* Make a blocked progress() return: a one-byte eager send to ourselves (any thread). */
static PyObject *Engine_wake(EngineObject *self, PyObject *noargs) {
    if (self->wake_on) {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = MPI_Send(&self->wake_send, 1, MPI_BYTE, self->rank, 0, self->wake);
        Py_END_ALLOW_THREADS
        if (rc != MPI_SUCCESS) { PyErr_SetString(PyExc_RuntimeError, "mcallreduce: wake-up send failed"); return NULL; }
    }
    Py_RETURN_NONE;
}

/* enable_goodbye(comm_f): listen for the goodbyes of peers that shut down. */
static PyObject *Engine_enable_goodbye(EngineObject *self, PyObject *args) {
    long long bye;
    if (!PyArg_ParseTuple(args, "L", &bye)) return NULL;
    if (self->bye_on) Py_RETURN_NONE;
    self->bye = comm_of(bye);
    self->bye_on = 1;
    post_goodbye(self);
    Py_RETURN_NONE;
}

/* goodbye(): tell every peer that this rank leaves, having finished every call before the
   first one still in flight (or every call it started); then stop listening for theirs. */
static PyObject *Engine_goodbye(EngineObject *self, PyObject *noargs) {
    if (!self->bye_on) Py_RETURN_NONE;
    long long seq = self->next_seq;
    for (int i = 0; i < self->nruns; i++)
        if (!self->runs[i]->done && self->runs[i]->seq < seq) seq = self->runs[i]->seq;
    for (int q = 0; q < self->size; q++)
        if (q != self->rank) MPI_Send(&seq, 1, MPI_LONG_LONG, q, 0, self->bye);   /* eager: returns at once */
    for (int i = 0; i < self->nreqs; i++) {
        if (self->owner_step[i] != OWNER_GOODBYE) continue;
        MPI_Cancel(&self->reqs[i]);
        MPI_Wait(&self->reqs[i], MPI_STATUS_IGNORE);
        int last = --self->nreqs;
        self->reqs[i] = self->reqs[last]; self->owner_run[i] = self->owner_run[last];
        self->owner_step[i] = self->owner_step[last];
        break;
    }
    self->bye_on = 0;
    Py_RETURN_NONE;
}

/* waiting_on(seq) -> (what, peer): what a call in flight waits for, for the stall warning
   (read while another thread may progress it: a snapshot, not a promise). */
static PyObject *Engine_waiting_on(EngineObject *self, PyObject *args) {
    long long seq;
    if (!PyArg_ParseTuple(args, "L", &seq)) return NULL;
    for (int i = 0; i < self->nruns; i++) {
        run_t *r = self->runs[i];
        if (r->seq != seq) continue;
        if (r->done) return Py_BuildValue("(si)", "done", -1);
        if (r->cmine && r->cstep >= 0 && !r->meta_checked) {
            int peer = check_peer(self, r);
            return Py_BuildValue("(si)", "the metadata check", peer);
        }
        if (r->kind == KIND_SHARED) return Py_BuildValue("(si)", "the shared-memory stage", -1);
        if (r->kind == KIND_MPI) return Py_BuildValue("(si)", r->coll_ready ? "MPI's allreduce" : "an earlier MPI allreduce", -1);
        if (r->kind == KIND_SCHEDULE) return Py_BuildValue("(si)", "the schedule's messages", -1);
        return Py_BuildValue("(si)", "the metadata check", -1);
    }
    return Py_BuildValue("(si)", "queued", -1);
}

/* abort(reason): from any thread, fail every call in flight (the stall limit); a blocked
   progress() is woken to do it. */
static PyObject *Engine_abort(EngineObject *self, PyObject *args) {
    const char *reason;
    if (!PyArg_ParseTuple(args, "s", &reason)) return NULL;
    snprintf(self->abort_reason, sizeof self->abort_reason, "%s", reason);
    self->abort_requested = 1;
    Py_RETURN_NONE;
}

static PyObject *Engine_outstanding(EngineObject *self, void *closure) {
    return PyLong_FromLong(self->nreqs - self->wake_on - self->bye_on);
}

static PyObject *Engine_active(EngineObject *self, void *closure) { return PyLong_FromLong(self->nruns); }

static PyMethodDef Engine_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))Engine_submit, METH_FASTCALL,
     "submit(seq, tag0, wait, template, buffer, prescale) -> None, or with wait (status, payload)"},
    {"progress", (PyCFunction)Engine_progress, METH_VARARGS,
     "progress(block, until=-1) -> finished runs; blocks until `until` is done, or any run finishes"},
    {"set_window", (PyCFunction)Engine_set_window, METH_VARARGS, "set_window(win_f, base_address, slot_bytes)"},
    {"enable_wake", (PyCFunction)Engine_enable_wake, METH_VARARGS, "enable_wake(comm_f): post the wake receive"},
    {"disable_wake", (PyCFunction)Engine_disable_wake, METH_NOARGS, "cancel the wake receive"},
    {"wake", (PyCFunction)Engine_wake, METH_NOARGS, "make a blocked progress() return"},
    {"enable_goodbye", (PyCFunction)Engine_enable_goodbye, METH_VARARGS, "enable_goodbye(comm_f)"},
    {"goodbye", (PyCFunction)Engine_goodbye, METH_NOARGS, "goodbye(): tell the peers this rank leaves"},
    {"waiting_on", (PyCFunction)Engine_waiting_on, METH_VARARGS, "waiting_on(seq) -> (what, peer)"},
    {"abort", (PyCFunction)Engine_abort, METH_VARARGS, "abort(reason): fail every call in flight (then wake())"},
    {NULL}
};

static PyGetSetDef Engine_getset[] = {
    {"outstanding", (getter)Engine_outstanding, NULL, "MPI requests in flight (the wake receive aside)", NULL},
    {"active", (getter)Engine_active, NULL, "runs not yet drained", NULL},
    {NULL}
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mcallreduce._executor.Engine",
    .tp_doc = "Every allreduce in flight on one communicator context.",
    .tp_basicsize = sizeof(EngineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_getset = Engine_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_executor",
                                    "The compiled executor of mcallreduce's schedules (see executor.c).", -1, NULL};

PyMODINIT_FUNC PyInit__executor(void) {
    if (PyType_Ready(&ProgramType) < 0 || PyType_Ready(&TemplateType) < 0 || PyType_Ready(&EngineType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyModule_AddObjectRef(m, "Program", (PyObject *)&ProgramType);
    PyModule_AddObjectRef(m, "Template", (PyObject *)&TemplateType);
    PyModule_AddObjectRef(m, "Engine", (PyObject *)&EngineType);
#define CONST(name, value) PyModule_AddIntConstant(m, name, value)
    CONST("KIND_CHECK_ONLY", KIND_CHECK_ONLY); CONST("KIND_SCHEDULE", KIND_SCHEDULE);
    CONST("KIND_MPI", KIND_MPI); CONST("KIND_SHARED", KIND_SHARED);
    CONST("KIND_FUSED", KIND_FUSED); CONST("CHECK_OFF", CHECK_OFF); CONST("CHECK_ON", CHECK_ON);
    CONST("STATUS_OK", STATUS_OK); CONST("STATUS_MISMATCH", STATUS_MISMATCH); CONST("STATUS_ERROR", STATUS_ERROR);
    CONST("LOWERED_COLUMNS", LOWERED_COLUMNS);
    return m;
}
