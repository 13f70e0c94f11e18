/* The lowered program and the call template: the two objects a plan builds once and every
 * call of that plan reuses. */
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
    int bad_early = 0;
    for (int64_t i = 0; i < self->nsteps; i++) {
        int64_t *r = raw + i * LOWERED_COLUMNS;
        step_t *s = &self->steps[i];
        s->op = (int32_t)r[0]; s->peer = (int32_t)r[1]; s->offset = r[2]; s->count = r[3];
        s->scratch = r[4]; s->tag = (int32_t)r[5]; s->ndeps = (int32_t)r[6]; s->left = (int32_t)r[7];
        s->color = (int32_t)r[8]; s->phase = (int32_t)r[9]; s->early = (int32_t)r[10];
        if (s->color >= self->ncolors) self->ncolors = s->color + 1;
        if (s->early && (s->ndeps || (s->op != STEP_SEND && s->op != STEP_RECV_SCRATCH))) bad_early = 1;
        if (s->early) self->has_early = 1;
    }
    for (Py_ssize_t i = 0; i < ndeps; i++) self->dependents[i] = (int32_t)deps[i];
    free(raw); free(deps);
    if (bad_early) {   /* posted before the check, it must neither wait nor write the buffer */
        PyErr_SetString(PyExc_ValueError, "an early step must be a send or a receive into scratch with no dependencies");
        return -1;
    }
    self->scratch_elems = scratch;
    return 0;
}

static void Program_dealloc(ProgramObject *self) {
    free(self->steps); free(self->dep_ptr); free(self->dependents);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyTypeObject ProgramType = EXECUTOR_TYPE(
    "Program", ProgramObject, "One rank's lowered schedule: flat step arrays and the dependents' CSR lists.",
    Program_init, Program_dealloc, NULL);


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

PyTypeObject TemplateType = EXECUTOR_TYPE(
    "Template", TemplateObject, "Template(kind, program, dtype, op, postscale, meta, check): one plan's fixed call arguments.",
    Template_init, Template_dealloc, NULL);
