/* The one-host shared-memory stage: every rank's data in its slot of one MPI window, each
 * rank reducing its own color into the result area, then copying the whole result out.
 *
 *   publish -> copy this rank's data (all but its own color) into its slot; the metadata
 *              check is the stage's first synchronisation (sync 1);
 *   reduce  -> fold color `rank` of every slot into the result area (sync 2 follows: a
 *              zero-byte message to and from every other rank);
 *   collect -> copy the result area into the buffer.
 *
 * Runs queue: one stage at a time uses the window, in call order on every rank.
 */
#include "executor.h"

#include <string.h>

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
        POST(e, r, OWNER_SYNC, MPI_Irecv(&e->sync_recv, 0, MPI_BYTE, q, r->tag0 + e->sync_tag, e->comm, &req_));
        POST(e, r, OWNER_SYNC, MPI_Isend(&e->sync_send, 0, MPI_BYTE, q, r->tag0 + e->sync_tag, e->comm, &req_));
    }
}

/* Shared memory, step 1: publish this rank's data into its slot, then the check (sync 1). */
void shm_publish(EngineObject *e, run_t *r) {
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

/* Rank q's copy of the data at byte `off`: this rank's own color is read from its buffer. */
static const char *shm_source(EngineObject *e, run_t *r, int q, size_t off) {
    return (q == e->rank && r->pre == 1.0) ? r->buf + off : area(e, q) + off;
}

/* Step 2: fold color `rank` of every rank's data, in rank order, into the result area. */
void shm_reduce(EngineObject *e, run_t *r) {
    MPI_Win_sync(e->win);
    int64_t lo, count;
    color_range(r->nelem, e->size, e->rank, &lo, &count);
    size_t off = (size_t)(lo * r->isz), bytes = (size_t)(count * r->isz);
    char *out = area(e, e->size) + off;
    if (e->size == 1) memcpy(out, shm_source(e, r, 0, off), bytes);
    else combine_into(r->dtype, r->op, out, shm_source(e, r, 0, off), shm_source(e, r, 1, off), count);
    for (int q = 2; q < e->size; q++) reduce_into(r->dtype, r->op, out, shm_source(e, r, q, off), count, 0);
    MPI_Win_sync(e->win);
    r->color_t = calloc(2, sizeof(double));   /* this rank's color: reduced now, broadcast by the collect */
    if (r->color_t) { r->ncolors = 1; r->first_color = e->rank; r->color_t[0] = r->color_t[1] = now_s(); }
    post_sync(e, r);
}

/* Step 3, once every peer's sync 2 arrived: copy the result area into the buffer. */
void shm_collect(EngineObject *e, run_t *r) {
    MPI_Win_sync(e->win);
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
