/* The executor's Python interface: Engine (submit, progress, wake, goodbye), over executor.c,
 * and the finished runs reported to Python; Program and Template are in program.c. */
#include <stdlib.h>

#include "executor.h"

/* ------------------------------------------------------------------ Python interface */

/* What Python needs to raise: the MAX vector of a mismatch, an error's text, else None. */
static PyObject *outcome_payload(run_t *r) {
    if (r->status == STATUS_MISMATCH)
        return PyBytes_FromStringAndSize((const char *)r->meta_out, sizeof(int64_t) * r->nmeta);
    if (r->status == STATUS_ERROR) return PyUnicode_FromString(r->error);
    return Py_NewRef(Py_None);
}

/* Each color's (color, reduced, done), the colors that ran a step. */
static PyObject *color_times(run_t *r) {
    PyObject *out = PyList_New(0);
    for (int c = 0; out && c < r->ncolors; c++) {
        double *row = r->color_t + 2 * c;
        if (row[1] == 0) continue;
        PyObject *item = Py_BuildValue("(idd)", r->first_color + c, row[0], row[1]);
        if (!item || PyList_Append(out, item) < 0) { Py_XDECREF(item); Py_CLEAR(out); break; }
        Py_DECREF(item);
    }
    return out;
}

/* The finished runs as [(seq, status, payload, (started, checked, done), color_times)],
   removed from the engine (needs the GIL). */
static PyObject *drain(EngineObject *e) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int i = 0; i < e->nruns;) {
        run_t *r = e->runs[i];
        if (!r->done || (r->inflight && !r->abandoned)) { i++; continue; }
        PyObject *payload = outcome_payload(r), *colors = payload ? color_times(r) : NULL;
        if (payload && !colors) Py_CLEAR(payload);
        PyObject *item = payload ? Py_BuildValue("(LiN(ddd)N)", r->seq, r->status, payload, r->t_start,
                                                 r->meta_checked ? r->t_checked : r->t_done, r->t_done, colors) : NULL;
        if (!item || PyList_Append(out, item) < 0) { Py_XDECREF(item); Py_DECREF(out); return NULL; }
        Py_DECREF(item);
        e->nfinished--;
        e->runs[i] = e->runs[--e->nruns];
        if (r->abandoned) { r->grave = e->graveyard; e->graveyard = r; }   /* MPI may still write to it */
        else free_run(r);
    }
    return out;
}


static MPI_Comm comm_of(long long handle) { return MPI_Comm_f2c((MPI_Fint)handle); }

static int Engine_init(EngineObject *self, PyObject *args, PyObject *kw) {
    long long comm, ctl, coll, coll_ring = -1;
    long long fused_max, piece, early_max;
    double poll_s;
    static char *names[] = {"comm", "ctl", "coll", "check_tag", "sync_tag", "early_tag", "early_max", "fused_max",
                            "piece_bytes", "poll_s", "coll_ring", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLLiiiLLLd|L", names, &comm, &ctl, &coll, &self->check_tag,
                                     &self->sync_tag, &self->early_tag, &early_max, &fused_max, &piece, &poll_s,
                                     &coll_ring))
        return -1;
    if (early_max < 0 || early_max > (1 << 30)) { PyErr_SetString(PyExc_ValueError, "early_max out of range"); return -1; }
    self->early_max = (size_t)early_max;
    if (poll_s < 0) { PyErr_SetString(PyExc_ValueError, "poll_s must be >= 0"); return -1; }
    self->poll_s = poll_s;
    if (piece < 64) { PyErr_SetString(PyExc_ValueError, "piece_bytes must be at least 64"); return -1; }
    self->fused_max = (size_t)fused_max;
    self->piece_bytes = (size_t)piece;
    self->comm = comm_of(comm); self->ctl = comm_of(ctl); self->coll = comm_of(coll);
    self->coll_ring = coll_ring < 0 ? self->coll : comm_of(coll_ring);   /* none: the default decision */
    /* a failed send or receive fails its call, not the job */
    MPI_Comm_set_errhandler(self->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(self->comm, &self->rank);
    MPI_Comm_size(self->comm, &self->size);
    self->win = MPI_WIN_NULL;
    self->gone_rank = -1;
    self->sync_failed = 1;
    pthread_mutex_init(&self->wake_lock, NULL);
    return 0;
}

static void Engine_dealloc(EngineObject *self) {
    int finalized = 1, level = MPI_THREAD_SINGLE;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Query_thread(&level);
    if (self->bye_on || self->wake_on) {   /* a context whose start failed: receives into this object */
        if (finalized || level < MPI_THREAD_MULTIPLE) return;   /* not cancellable from this thread: kept */
        if (self->bye_on) cancel_standing(self, OWNER_GOODBYE);
        if (self->wake_on) { wake(self); cancel_standing(self, OWNER_WAKE); }
    }
    /* a run with requests still posted keeps its buffers (the caller's too, and the shared discard
       area its drained messages land in) for the process's life: MPI may still write to them */
    int kept = 0;
    for (int i = 0; i < self->nruns; i++) {
        if (self->runs[i]->inflight) kept = 1; else free_run(self->runs[i]);
    }
    while (self->graveyard) {
        run_t *r = self->graveyard;
        self->graveyard = r->grave;
        if (r->inflight) kept = 1; else free_run(r);
    }
    for (int i = 0; i < POOL_SLOTS; i++) free(self->pool[i]);
    free(self->reqs); free(self->owner_run); free(self->owner_step); free(self->index); free(self->statuses);
    free(self->runs);
    if (!kept) free(self->discard);
    pthread_mutex_destroy(&self->wake_lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Engine_set_window(EngineObject *self, PyObject *args) {
    long long win, base, slot, small;
    if (!PyArg_ParseTuple(args, "LLLL", &win, &base, &slot, &small)) return NULL;
    if (self->shm_head) { PyErr_SetString(PyExc_RuntimeError, "shared-memory allreduces in flight"); return NULL; }
    self->win = win < 0 ? MPI_WIN_NULL : MPI_Win_f2c((MPI_Fint)win);
    self->win_base = (char *)(intptr_t)base;
    self->slot_bytes = slot;
    self->small_bytes = small;
    self->stage_calls = 0;   /* collective, with no stage call in flight: every rank restarts the count */
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
    if (ONE_HOST_STAGE(t->kind) && self->win == MPI_WIN_NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no shared-memory window"); return NULL;
    }
    if (wait && self->nruns) { PyErr_SetString(PyExc_RuntimeError, "a waited call needs an idle engine"); return NULL; }
    int finalized = 0;
    MPI_Finalized(&finalized);   /* a flag read: the window and communicators are gone */
    if (finalized) { PyErr_SetString(PyExc_RuntimeError, "mcallreduce: allreduce after MPI_Finalize"); return NULL; }
    run_t *r = calloc(1, sizeof(run_t));
    if (!r) return PyErr_NoMemory();
    if (PyObject_GetBuffer(args[4], &r->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) { free(r); return NULL; }
    if (seq >= self->next_seq) self->next_seq = seq + 1;
    r->seq = seq; r->kind = t->kind; r->dtype = t->dtype; r->op = t->op; r->pre = pre; r->post = t->post;
    r->tag0 = tag0; r->check = t->check;
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
        if (MPI_COLLECTIVE(t->kind)) {   /* blocking only where every rank waits for it alone */
            r->meta[AGREED_SLOT(r)] = !wait;
        }
    }
    if (self->nruns == self->runs_cap) {
        int cap = self->runs_cap ? 2 * self->runs_cap : 64;
        run_t **runs = realloc(self->runs, sizeof(run_t *) * cap);
        if (!runs) { free_run(r); return PyErr_NoMemory(); }
        self->runs = runs; self->runs_cap = cap;
    }
    self->runs[self->nruns++] = r;
    /* the stall inspector may read a waited run as soon as the GIL is released below, before
       start_run: its start time must be set by then, or the run looks as old as the clock */
    r->t_start = now_s();
    if (wait) self->waited = r;   /* set and cleared while holding the GIL, as its readers do */
    Py_BEGIN_ALLOW_THREADS
    start_run(self, r);
    if (wait) progress(self, 1, r);
    Py_END_ALLOW_THREADS
    self->waited = NULL;
    if (!wait) Py_RETURN_NONE;
    if (r->done && !r->inflight && self->nruns == 1) {
        /* the waited call was alone: report it without building the drain's list */
        PyObject *payload = outcome_payload(r);
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

static PyObject *Engine_enable_wake(EngineObject *self, PyObject *noargs) {
    if (self->wake_on) Py_RETURN_NONE;
    self->wake_on = 1;
    post_wake(self);
    Py_RETURN_NONE;
}

static PyObject *Engine_disable_wake(EngineObject *self, PyObject *noargs) {
    if (!self->wake_on) Py_RETURN_NONE;
    wake(self);   /* a generalized request is cancelled only once it is complete */
    cancel_standing(self, OWNER_WAKE);
    self->wake_on = 0;
    Py_RETURN_NONE;
}

/* probe_copy(pid, address) -> (errno, value): read the int64 at `address` in process `pid`
   as the single-copy stage reads a peer's buffer (errno 0: it can). */
static PyObject *Engine_probe_copy(EngineObject *self, PyObject *args) {
    long long pid, address;
    if (!PyArg_ParseTuple(args, "LL", &pid, &address)) return NULL;
    int64_t value = 0;
    int err = probe_peer_copy((pid_t)pid, (intptr_t)address, &value);
    return Py_BuildValue("(iL)", err, (long long)value);
}

/* Make a blocked progress() return (any thread). */
static PyObject *Engine_wake(EngineObject *self, PyObject *noargs) {
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = wake(self);
    Py_END_ALLOW_THREADS
    if (rc != MPI_SUCCESS) { PyErr_SetString(PyExc_RuntimeError, "mcallreduce: the wake-up failed"); return NULL; }
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
    cancel_standing(self, OWNER_GOODBYE);
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
        if (r->draining) return Py_BuildValue("(si)", "the other ranks' messages of a mismatched call (early.c)", -1);
        if (r->cmine && r->cstep >= 0 && !r->meta_checked) {
            int peer = check_peer(self, r);
            return Py_BuildValue("(si)", "the metadata check", peer);
        }
        if (ONE_HOST_STAGE(r->kind)) return Py_BuildValue("(si)", "the shared-memory stage", -1);
        if (MPI_COLLECTIVE(r->kind) && !r->on_schedule) return Py_BuildValue("(si)", r->coll_ready ? "MPI's allreduce" : "an earlier MPI allreduce", -1);
        if (r->kind == KIND_SCHEDULE || r->on_schedule) return Py_BuildValue("(si)", "the schedule's messages", -1);
        return Py_BuildValue("(si)", "the metadata check", -1);
    }
    return Py_BuildValue("(si)", "queued", -1);
}

/* activity() -> (mpi_call, wakes_sending, requests): for the stall report, from any thread
   (a snapshot): the MPI call the executor is inside or None, the wake-ups in progress, the
   requests it has posted. */
static PyObject *Engine_activity(EngineObject *self, PyObject *noargs) {
    const char *in_mpi = self->in_mpi;
    return Py_BuildValue("(zii)", in_mpi, self->wakes_sending, self->nreqs);
}

/* waited() -> (seq, started, bytes) of the call a submit(wait=True) is blocked on, or None. */
static PyObject *Engine_waited(EngineObject *self, PyObject *noargs) {
    run_t *r = self->waited;
    if (!r) Py_RETURN_NONE;
    return Py_BuildValue("(Ldn)", r->seq, r->t_start, r->view.len);
}

/* abort(reason) -> the first seq it spares: from any thread, fail every call submitted so far that has
   not finished (the stall limit), not a later one; a blocked progress() is woken to do it. */
static PyObject *Engine_abort(EngineObject *self, PyObject *args) {
    const char *reason;
    if (!PyArg_ParseTuple(args, "s", &reason)) return NULL;
    snprintf(self->abort_reason, sizeof self->abort_reason, "%s", reason);
    long long before = self->next_seq;   /* calls are submitted with the GIL held, which this holds */
    /* after the reason (which the executor reads once it sees this) */
    __atomic_store_n(&self->abort_before, before, __ATOMIC_RELEASE);
    return PyLong_FromLongLong(before);
}

static PyMethodDef Engine_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))Engine_submit, METH_FASTCALL,
     "submit(seq, tag0, wait, template, buffer, prescale) -> None, or with wait (status, payload)"},
    {"progress", (PyCFunction)Engine_progress, METH_VARARGS,
     "progress(block, until=-1) -> finished runs; blocks until `until` is done, or any run finishes"},
    {"set_window", (PyCFunction)Engine_set_window, METH_VARARGS,
     "set_window(win_f, base_address, slot_bytes, small_slot_bytes)"},
    {"enable_wake", (PyCFunction)Engine_enable_wake, METH_NOARGS, "enable_wake(): post the wake-up request"},
    {"disable_wake", (PyCFunction)Engine_disable_wake, METH_NOARGS, "complete and forget the wake-up request"},
    {"probe_copy", (PyCFunction)Engine_probe_copy, METH_VARARGS,
     "probe_copy(pid, address) -> (errno, value): whether the single-copy stage can read a peer"},
    {"wake", (PyCFunction)Engine_wake, METH_NOARGS, "make a blocked progress() return"},
    {"enable_goodbye", (PyCFunction)Engine_enable_goodbye, METH_VARARGS, "enable_goodbye(comm_f)"},
    {"goodbye", (PyCFunction)Engine_goodbye, METH_NOARGS, "goodbye(): tell the peers this rank leaves"},
    {"waiting_on", (PyCFunction)Engine_waiting_on, METH_VARARGS, "waiting_on(seq) -> (what, peer)"},
    {"activity", (PyCFunction)Engine_activity, METH_NOARGS, "activity() -> (mpi_call or None, wakes_sending, requests)"},
    {"waited", (PyCFunction)Engine_waited, METH_NOARGS, "waited() -> (seq, started, bytes) or None"},
    {"abort", (PyCFunction)Engine_abort, METH_VARARGS, "abort(reason) -> the first seq it spares: fail every call in flight (then wake())"},
    {NULL}
};

static PyTypeObject EngineType = EXECUTOR_TYPE(
    "Engine", EngineObject, "Every allreduce in flight on one communicator context.",
    Engine_init, Engine_dealloc, Engine_methods);

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
    CONST("MPI_SEND_COPY_RANKS", MPI_SEND_COPY_RANKS);
    CONST("KIND_MPI", KIND_MPI); CONST("KIND_MPI_RING", KIND_MPI_RING); CONST("KIND_SHARED", KIND_SHARED);
    CONST("KIND_SINGLE_COPY", KIND_SINGLE_COPY); CONST("KIND_SHARED_ONE_SYNC", KIND_SHARED_ONE_SYNC);
    CONST("KIND_FUSED_DOUBLING", KIND_FUSED_DOUBLING); CONST("KIND_FUSED_HALVING", KIND_FUSED_HALVING); CONST("CHECK_OFF", CHECK_OFF); CONST("CHECK_ON", CHECK_ON);
    CONST("STATUS_OK", STATUS_OK); CONST("STATUS_MISMATCH", STATUS_MISMATCH); CONST("STATUS_ERROR", STATUS_ERROR);
    CONST("LOWERED_COLUMNS", LOWERED_COLUMNS);
    return m;
}
