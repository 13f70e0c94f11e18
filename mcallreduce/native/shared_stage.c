/* The one-host stages: every rank reduces its own color of every rank's data, then every
 * rank ends with every color. Two variants share the sequence and its two synchronisations:
 *
 * through the window (KIND_SHARED): every rank's data in its slot of one MPI window,
 *   publish -> copy this rank's data (all but its own color) into its slot; the metadata
 *              check is the stage's first synchronisation (sync 1);
 *   reduce  -> fold color `rank` of every slot into the result area (sync 2 follows: a
 *              one-byte message to and from every other rank);
 *   collect -> copy the result area into the buffer.
 *
 * single copy (KIND_SINGLE_COPY), where the kernel lets a rank read and write its peers'
 * memory (Linux CMA, which Open MPI's shared-memory transport uses too):
 *   publish -> write this rank's pid and buffer address into its slot; sync 1 (the check);
 *   reduce  -> fold color `rank` of every rank's buffer, read straight from it, in rank
 *              order into this rank's buffer, and write the result into every peer's
 *              buffer; sync 2;
 *   collect -> nothing: the peers wrote the other colors into this buffer.
 * Each byte crosses between processes once, as in MPI's single-copy path, where the window
 * variant copies it in, reduces it across cores and copies it out. While rank c reads color
 * c of a peer's buffer, that peer writes only its own color (there and into rank c's
 * buffer), so nobody reads a range another rank writes.
 *
 * one sync (KIND_SHARED_ONE_SYNC), for small calls: every rank reduces the whole buffer,
 *   publish -> copy this rank's data into its small slot of this call's parity; sync 1 (the check);
 *   reduce  -> fold every rank's small slot, in rank order, into the buffer. Done: no sync 2.
 *   A rank reuses a slot two stage calls later. It publishes that call once its own previous
 *   stage call is checked, which needs every peer to have published it, and a peer publishes
 *   a stage call only after finishing the one before: nobody still reads the slot. Parity is
 *   the count of stage calls every rank agreed on (a mismatched call counts on no rank), so a
 *   call that is a stage call on one rank only cannot shift one rank's parity.
 *
 * All fold in rank order, so they give bitwise the same result. A rank that fails (a peer
 * that died mid-copy) still sends its sync 2, saying so, and every rank raises.
 * Runs queue: one stage at a time uses the window, in call order on every rank.
 */
#include "executor.h"

#include <errno.h>
#include <string.h>
#include <sys/uio.h>   /* process_vm_readv, process_vm_writev (Python.h defines _GNU_SOURCE) */
#include <unistd.h>

static void color_range(int64_t nelem, int nranks, int color, int64_t *lo, int64_t *count) {
    int64_t base = nelem / nranks, extra = nelem % nranks;
    *lo = color * base + (color < extra ? color : extra);
    *count = base + (color < extra ? 1 : 0);
}

static char *area(EngineObject *e, int i) { return e->win_base + (int64_t)i * e->slot_bytes; }

/* Rank q's small slot of one parity, after the p + 1 areas. */
static char *small_area(EngineObject *e, int q, int parity) {
    return area(e, e->size + 1) + (int64_t)(2 * q + parity) * e->small_bytes;
}

/* ---- sync 2: a byte to and from every other rank, 1 from a rank whose reduction failed */

static void post_sync(EngineObject *e, run_t *r, int failed) {
    r->sync_in = calloc((size_t)e->size, 1);
    if (!r->sync_in) { fail_run(e, r, "out of memory", MPI_SUCCESS); return; }
    r->pending = 2 * (e->size - 1);
    for (int q = 0; q < e->size; q++) {
        if (q == e->rank) continue;
        POST(e, r, OWNER_SYNC, MPI_Irecv(r->sync_in + q, 1, MPI_BYTE, q, r->tag0 + e->sync_tag, e->comm, &req_));
        POST(e, r, OWNER_SYNC, MPI_Isend(failed ? &e->sync_failed : &e->sync_ok, 1, MPI_BYTE, q,
                                         r->tag0 + e->sync_tag, e->comm, &req_));
    }
}

/* ---- single copy: the peers' buffers, read and written through the kernel */

#define HEADER_PID 0    /* this rank's slot, during a single-copy call: its pid, its buffer */
#define HEADER_ADDRESS 1
#define COPY_CHUNK (256 << 10)   /* bytes folded at a time: the two chunks stay in cache */

/* Move `bytes` between this process's `local` and `remote` in process `pid`, in full. */
static int peer_copy(pid_t pid, char *local, char *remote, size_t bytes, int write) {
    while (bytes) {
        struct iovec l = {local, bytes}, r = {remote, bytes};
        ssize_t n = write ? process_vm_writev(pid, &l, 1, &r, 1, 0) : process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return n < 0 ? errno : EIO;
        local += n; remote += n; bytes -= (size_t)n;
    }
    return 0;
}

/* Fold this rank's color of every rank's buffer, in rank order, into its own buffer, a chunk
   at a time, and write each chunk into every peer's buffer. Returns 0 or an errno. */
static int single_copy_reduce(EngineObject *e, run_t *r, int64_t lo, int64_t count) {
    const int64_t *header[e->size];
    for (int q = 0; q < e->size; q++) header[q] = (const int64_t *)area(e, q);
    int64_t step = COPY_CHUNK / (int64_t)r->isz;
    char *prefix = pool_take(e, COPY_CHUNK), *theirs = pool_take(e, COPY_CHUNK);
    int err = prefix && theirs ? 0 : ENOMEM;
    for (int64_t at = lo; !err && at < lo + count; at += step) {
        int64_t n = lo + count - at < step ? lo + count - at : step;
        size_t off = (size_t)(at * (int64_t)r->isz), bytes = (size_t)(n * (int64_t)r->isz);
        char *mine = r->buf + off;
        for (int q = 0; !err && q < e->size; q++) {   /* rank 0's data first, then each in turn */
            if (q == e->rank) {
                if (q > 0) reduce_into(r->dtype, r->op, mine, prefix, n, 1);   /* op(ranks below, mine) */
                continue;
            }
            char *into = q == 0 ? prefix : theirs;
            err = peer_copy((pid_t)header[q][HEADER_PID], into, (char *)(intptr_t)header[q][HEADER_ADDRESS] + off,
                            bytes, 0);
            if (err || q == 0) continue;
            reduce_into(r->dtype, r->op, q < e->rank ? prefix : mine, theirs, n, 0);
        }
        for (int q = 0; !err && q < e->size; q++)
            if (q != e->rank)
                err = peer_copy((pid_t)header[q][HEADER_PID], mine, (char *)(intptr_t)header[q][HEADER_ADDRESS] + off,
                                bytes, 1);
    }
    pool_give(e, prefix, COPY_CHUNK);
    pool_give(e, theirs, COPY_CHUNK);
    return err;
}

/* probe_copy(pid, address) for Python: whether this process can read 8 bytes at `address`
   in process `pid`; 0 or the errno. */
int probe_peer_copy(pid_t pid, intptr_t address, int64_t *value) {
    return peer_copy(pid, (char *)value, (char *)address, sizeof *value, 0);
}

/* Step 1: publish this rank's data (or, single copy, where it is) into its slot, then the
   check (sync 1). */
void shm_publish(EngineObject *e, run_t *r) {
    char *slot = area(e, e->rank);
    if (r->kind == KIND_SHARED_ONE_SYNC) {
        r->parity = (int)(e->stage_calls & 1);
        slot = small_area(e, e->rank, r->parity);
        memcpy(slot, r->buf, (size_t)(r->nelem * r->isz));
        if (r->pre != 1.0) scale_buffer(r->dtype, slot, r->nelem, r->pre);
    } else if (r->kind == KIND_SINGLE_COPY) {   /* the prescale is 1: the runtime chose the window otherwise */
        int64_t *header = (int64_t *)slot;
        header[HEADER_PID] = (int64_t)getpid();
        header[HEADER_ADDRESS] = (int64_t)(intptr_t)r->buf;
    } else if (r->pre != 1.0) {
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

/* Rank q's copy of the data at byte `off`: this rank's own color is read from its buffer. */
static const char *shm_source(EngineObject *e, run_t *r, int q, size_t off) {
    return (q == e->rank && r->pre == 1.0) ? r->buf + off : area(e, q) + off;
}

/* The timeline's one color of this rank: reduced now. */
static void record_own_color(EngineObject *e, run_t *r) {
    r->color_t = calloc(2, sizeof(double));
    if (r->color_t) { r->ncolors = 1; r->first_color = e->rank; r->color_t[0] = r->color_t[1] = now_s(); }
}

/* Step 2: fold color `rank` of every rank's data, in rank order, into the result area (or,
   single copy, into this rank's buffer and every peer's). */
void shm_reduce(EngineObject *e, run_t *r) {
    MPI_Win_sync(e->win);
    if (r->kind == KIND_SHARED_ONE_SYNC) {   /* the whole buffer, from the slots alone */
        combine_into(r->dtype, r->op, r->buf, small_area(e, 0, r->parity), small_area(e, 1, r->parity), r->nelem);
        for (int q = 2; q < e->size; q++) reduce_into(r->dtype, r->op, r->buf, small_area(e, q, r->parity), r->nelem, 0);
        record_own_color(e, r);
        finish(e, r, STATUS_OK);
        return;
    }
    int64_t lo, count;
    color_range(r->nelem, e->size, e->rank, &lo, &count);
    if (r->kind == KIND_SINGLE_COPY) {
        int err = single_copy_reduce(e, r, lo, count);
        if (err) snprintf(r->error, sizeof r->error, "the shared-memory stage could not %s a peer's buffer: %s",
                          err == ENOMEM ? "allocate scratch for" : "read or write", strerror(err));
        post_sync(e, r, err != 0);
        return;
    }
    size_t off = (size_t)(lo * r->isz), bytes = (size_t)(count * r->isz);
    char *out = area(e, e->size) + off;
    if (e->size == 1) memcpy(out, shm_source(e, r, 0, off), bytes);
    else combine_into(r->dtype, r->op, out, shm_source(e, r, 0, off), shm_source(e, r, 1, off), count);
    for (int q = 2; q < e->size; q++) reduce_into(r->dtype, r->op, out, shm_source(e, r, q, off), count, 0);
    MPI_Win_sync(e->win);
    record_own_color(e, r);   /* broadcast by the collect, which updates its end */
    post_sync(e, r, 0);
}

/* Step 3, once every peer's sync 2 arrived: copy the result area into the buffer (single
   copy: the peers have written it). */
void shm_collect(EngineObject *e, run_t *r) {
    for (int q = 0; r->sync_in && q < e->size; q++)
        if (r->sync_in[q] && !r->error[0])
            snprintf(r->error, sizeof r->error, "rank %d failed in the shared-memory stage", q);
    if (r->error[0]) { finish(e, r, STATUS_ERROR); return; }
    MPI_Win_sync(e->win);
    if (r->kind == KIND_SINGLE_COPY) { finish(e, r, STATUS_OK); return; }
    memcpy(r->buf, area(e, e->size), (size_t)(r->nelem * r->isz));
    if (r->ncolors) r->color_t[1] = now_s();
    finish(e, r, STATUS_OK);
}

void shm_next(EngineObject *e) {
    while (e->shm_head && e->shm_head->done) {
        run_t *r = e->shm_head;
        e->shm_head = r->next;
        if (!e->shm_head) e->shm_tail = NULL;
        r->next = NULL;
        if (e->shm_head) shm_publish(e, e->shm_head);
    }
}
