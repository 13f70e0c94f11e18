/*
 * _jpegroi: decode one box of a JPEG, and little else, with the system libjpeg-turbo.
 *
 * A random-resized crop keeps 8-100% of a photograph's area (about half on average),
 * and the power-of-two DCT scaling rarely applies to ImageNet-sized images, so a
 * full decode spends much of its time on pixels the crop throws away. libjpeg-turbo's
 * partial decode (the one DALI uses) avoids most of that work:
 *   - rows below the box are never read nor entropy-decoded (destroyed after the box);
 *   - rows above it are entropy-decoded (Huffman data has no index to seek in) but skip
 *     the IDCT, upsampling and colour conversion (jpeg_skip_scanlines);
 *   - in the box's rows, only the iMCU columns overlapping the box get IDCT,
 *     upsampling and colour conversion (jpeg_crop_scanline).
 * Progressive files are entropy-decoded whole by jpeg_start_decompress (every
 * scan refines every block), so for them only the IDCT/colour savings remain.
 *
 * Python side: mcallreduce/data/jpeg.py. The GIL is released for the whole decode
 * (the loader decodes in a thread pool), so the libjpeg work below touches no
 * Python object: errors come back as a message and are raised afterwards.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h> /* jpeglib.h uses FILE without including stdio.h */
#include <string.h>
#include <jpeglib.h>

static PyObject *UnsupportedError;

struct job {
    const unsigned char *data; /* the encoded file */
    unsigned long size;
    unsigned char *out;        /* height rows of width RGB pixels; NULL: header only */
    int denom;                 /* decode at 1/denom scale (1, 2, 4, 8) */
    JDIMENSION left, top, width, height; /* the box, in pixels of the scaled image */
    JDIMENSION image_width, image_height; /* filled in: the (scaled) image size */
    int unsupported;           /* set when the file is valid but not for this path */
    char message[JMSG_LENGTH_MAX];
};

/* libjpeg's default error handler prints and calls exit(): jump back to run() instead. */
struct error_mgr {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
};

static void on_error(j_common_ptr cinfo)
{
    longjmp(((struct error_mgr *)cinfo->err)->jump, 1);
}

/* Warnings (corrupt entropy data, premature end of file, ...) are errors here, as in
 * simplejpeg's strict mode: the Python side then falls back to the full decode path,
 * so damage that the decode reaches is treated as with the other decoders (damage
 * below the box is never seen). Trace messages (level >= 0) are dropped: nothing is
 * ever printed. */
static void on_message(j_common_ptr cinfo, int level)
{
    if (level < 0)
        on_error(cinfo);
}

/* Decode job->box; called from run() under its setjmp (libjpeg errors jump out of here).
 * Returns 0, or -1 with job->message set. */
static int read_box(j_decompress_ptr cinfo, struct job *job)
{
    JDIMENSION xoffset, width, right, least, skip, y;
    JSAMPROW row;
    JSAMPARRAY scratch = NULL;
    JSAMPROW saved = NULL;
    size_t stride, lead, span, total, at;
    int in_place;

    /* libjpeg converts greyscale, YCbCr and RGB files to RGB; CMYK/YCCK need the
     * inversion and colour handling of the Pillow path. */
    if (cinfo->jpeg_color_space != JCS_GRAYSCALE && cinfo->jpeg_color_space != JCS_YCbCr &&
        cinfo->jpeg_color_space != JCS_RGB) {
        job->unsupported = 1;
        snprintf(job->message, sizeof job->message,
                 "JPEG colour space %d with %d components: not decoded by this path",
                 (int)cinfo->jpeg_color_space, cinfo->num_components);
        return -1;
    }
    cinfo->scale_num = 1;
    cinfo->scale_denom = (unsigned int)job->denom;
    cinfo->out_color_space = JCS_RGB;
    jpeg_calc_output_dimensions(cinfo); /* the box is checked before any pixel work */
    job->image_width = cinfo->output_width;
    job->image_height = cinfo->output_height;
    if (job->left + job->width > cinfo->output_width ||
        job->top + job->height > cinfo->output_height) {
        snprintf(job->message, sizeof job->message,
                 "box %ux%u at (%u, %u) does not fit the %ux%u image (1/%d scale)",
                 job->width, job->height, job->left, job->top, cinfo->output_width,
                 cinfo->output_height, job->denom);
        return -1;
    }
    jpeg_start_decompress(cinfo);

    /* Fancy upsampling (the default, as in a full decode) takes the first and last
     * columns of a cropped row as the image's edges, where chroma is replicated, not
     * interpolated, and a crop less than two chroma samples wide is not upsampled the
     * fancy way at all. Cropping one pixel more on the left and two more on the right,
     * where the image has them, and at least two chroma samples, gives every pixel of
     * the box the neighbours it has in a full decode: the box is then bit-exact (tested).
     * crop_scanline then moves the left edge down to an iMCU boundary (8 or 16 pixels at
     * full scale) and keeps the right one: `skip` columns of each row lie left of the box. */
    right = job->left + job->width + 2;
    if (right > cinfo->output_width)
        right = cinfo->output_width;
    xoffset = job->left > 0 ? job->left - 1 : 0;
    least = 2 * (JDIMENSION)cinfo->max_h_samp_factor;
    if (right - xoffset < least)
        xoffset = right > least ? right - least : 0;
    width = right - xoffset;
    jpeg_crop_scanline(cinfo, &xoffset, &width);
    skip = job->left - xoffset;
    if (job->top > 0 && jpeg_skip_scanlines(cinfo, job->top) != job->top) {
        snprintf(job->message, sizeof job->message, "could not skip to row %u", job->top);
        return -1;
    }
    /* Each decoded row is `skip` pixels wider on the left and up to two on the right.
     * Copying the box's part out of a scratch row costs a visible part of the decode
     * (docs/data.md), so rows are decoded in place: row y lands `lead` bytes before its place in `out`,
     * over the end of row y-1, whose bytes are saved and put back; its right margin
     * spills into row y+1, which is written afterwards. Only rows whose margins would
     * fall outside `out` (the first and last few) go through the scratch row. */
    stride = (size_t)job->width * 3;
    lead = (size_t)skip * 3;
    span = (size_t)width * 3;
    total = stride * job->height;
    if (span > stride) {
        scratch = (*cinfo->mem->alloc_sarray)((j_common_ptr)cinfo, JPOOL_IMAGE, width * 3, 1);
        saved = (*cinfo->mem->alloc_small)((j_common_ptr)cinfo, JPOOL_IMAGE, lead + 1);
    }
    for (y = 0; y < job->height; y++) {
        at = y * stride;
        in_place = scratch == NULL || (at >= lead && at - lead + span <= total);
        row = in_place ? job->out + at - lead : scratch[0];
        if (in_place && lead > 0)
            memcpy(saved, row, lead);
        if (jpeg_read_scanlines(cinfo, &row, 1) != 1) {
            snprintf(job->message, sizeof job->message, "no data for row %u", job->top + y);
            return -1;
        }
        if (!in_place)
            memcpy(job->out + at, scratch[0] + lead, stride);
        else if (lead > 0)
            memcpy(row, saved, lead);
    }
    /* Rows below the box are never decoded: the caller aborts instead of finishing. */
    return 0;
}

/* The libjpeg work, without the GIL. Returns 0, or -1 with job->message set. */
static int run(struct job *job)
{
    struct jpeg_decompress_struct cinfo;
    struct error_mgr err;

    memset(&cinfo, 0, sizeof cinfo); /* jpeg_destroy is safe even if create failed */
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    if (setjmp(err.jump)) {
        /* Only memory libjpeg owns was allocated after setjmp: destroy frees all of it. */
        (*cinfo.err->format_message)((j_common_ptr)&cinfo, job->message);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, job->data, job->size);
    jpeg_read_header(&cinfo, TRUE);
    job->image_width = cinfo.image_width;
    job->image_height = cinfo.image_height;
    if (job->out != NULL && read_box(&cinfo, job) != 0) {
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_destroy_decompress(&cinfo); /* also aborts: the rest of the file is never read */
    return 0;
}

/* Run a job, without the GIL if `release`; raise from its message. Reading a header
 * takes microseconds, less than handing the GIL to another thread and back. */
static int run_job(struct job *job, int release)
{
    int status;

    if (release) {
        Py_BEGIN_ALLOW_THREADS
        status = run(job);
        Py_END_ALLOW_THREADS
    } else {
        status = run(job);
    }
    if (status != 0)
        PyErr_SetString(job->unsupported ? UnsupportedError : PyExc_ValueError, job->message);
    return status;
}

static PyObject *header(PyObject *self, PyObject *args)
{
    Py_buffer data;
    struct job job = {0};
    int status;

    if (!PyArg_ParseTuple(args, "y*:header", &data))
        return NULL;
    job.data = data.buf;
    job.size = (unsigned long)data.len;
    status = run_job(&job, 0);
    PyBuffer_Release(&data);
    if (status != 0)
        return NULL;
    return Py_BuildValue("II", job.image_width, job.image_height);
}

static PyObject *decode(PyObject *self, PyObject *args)
{
    Py_buffer data, out;
    Py_ssize_t denom, left, top, width, height;
    struct job job = {0};
    int status;

    if (!PyArg_ParseTuple(args, "y*w*nnnnn:decode", &data, &out, &denom, &left, &top, &width,
                          &height))
        return NULL;
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyErr_Format(PyExc_ValueError, "scale 1/%zd: must be 1/1, 1/2, 1/4 or 1/8", denom);
    } else if (left < 0 || top < 0 || width <= 0 || height <= 0 || left > JPEG_MAX_DIMENSION ||
               top > JPEG_MAX_DIMENSION || width > JPEG_MAX_DIMENSION ||
               height > JPEG_MAX_DIMENSION) {
        PyErr_Format(PyExc_ValueError, "bad box: %zdx%zd at (%zd, %zd)", width, height, left, top);
    } else if (out.len < width * height * 3) {
        PyErr_Format(PyExc_ValueError, "output buffer of %zd bytes; the box needs %zd", out.len,
                     width * height * 3);
    } else {
        job.data = data.buf;
        job.size = (unsigned long)data.len;
        job.out = out.buf;
        job.denom = (int)denom;
        job.left = (JDIMENSION)left;
        job.top = (JDIMENSION)top;
        job.width = (JDIMENSION)width;
        job.height = (JDIMENSION)height;
    }
    status = PyErr_Occurred() ? -1 : run_job(&job, 1);
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (status != 0)
        return NULL;
    return Py_BuildValue("II", job.image_width, job.image_height);
}

static PyMethodDef methods[] = {
    {"header", header, METH_VARARGS,
     "header(data) -> (width, height): the image size, from the header alone."},
    {"decode", decode, METH_VARARGS,
     "decode(data, out, denom, left, top, width, height) -> (image width, image height)\n\n"
     "Decode the box (left, top, width, height), in pixels of the image scaled by 1/denom,\n"
     "into the writable C-contiguous buffer out (height * width * 3 bytes, RGB). Returns the\n"
     "size of the scaled image. ValueError for corrupt data or a box outside the image;\n"
     "UnsupportedError (a ValueError) for CMYK/YCCK and other colour spaces."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegroi",
                                    "Partial JPEG decode with libjpeg-turbo (the crop box only).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__jpegroi(void)
{
    PyObject *m = PyModule_Create(&module);

    if (m == NULL)
        return NULL;
    UnsupportedError = PyErr_NewExceptionWithDoc(
        "mcallreduce.data._jpegroi.UnsupportedError",
        "A valid JPEG this decoder does not handle (CMYK, YCCK, ...): decode it another way.",
        PyExc_ValueError, NULL);
    if (UnsupportedError == NULL || PyModule_AddObject(m, "UnsupportedError", UnsupportedError) < 0) {
        Py_XDECREF(UnsupportedError);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(UnsupportedError); /* the module's reference was stolen; keep ours */
#ifdef LIBJPEG_TURBO_VERSION
#define STR_(x) #x
#define STR(x) STR_(x)
    PyModule_AddStringConstant(m, "libjpeg_turbo_version", STR(LIBJPEG_TURBO_VERSION));
#endif
    return m;
}
