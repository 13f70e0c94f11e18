/* The executor's standing requests: the wake-up that other threads complete, and the
 * receive of a peer's goodbye. */
#include "executor.h"

/* The wake-up is a generalized request rather than a message to self: completing it touches
   only the request and its waiter, never the matching engine or a transport, so the thread
   that wakes the executor does no point-to-point MPI next to the one that progresses it. */
static int wake_query(void *extra, MPI_Status *status) {
    (void)extra;
    MPI_Status_set_elements(status, MPI_BYTE, 0);
    MPI_Status_set_cancelled(status, 0);
    status->MPI_SOURCE = MPI_UNDEFINED;
    status->MPI_TAG = MPI_UNDEFINED;
    return MPI_SUCCESS;
}

static int wake_free(void *extra) { (void)extra; return MPI_SUCCESS; }

static int wake_cancel(void *extra, int complete) { (void)extra; (void)complete; return MPI_SUCCESS; }

void post_wake(EngineObject *e) {
    MPI_Request req;
    if (MPI_Grequest_start(wake_query, wake_free, wake_cancel, NULL, &req) != MPI_SUCCESS) return;
    pthread_mutex_lock(&e->wake_lock);
    e->wake_req = req;
    e->wake_armed = 1;
    pthread_mutex_unlock(&e->wake_lock);
    add_request(e, req, NULL, OWNER_WAKE);
}

int wake(EngineObject *e) {
    int rc = MPI_SUCCESS;
    __atomic_add_fetch(&e->wakes_sending, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&e->wake_lock);
    if (e->wake_armed) {   /* disarmed: a wake-up is on its way already, and covers this one */
        e->wake_armed = 0;
        rc = MPI_Grequest_complete(e->wake_req);
    }
    pthread_mutex_unlock(&e->wake_lock);
    __atomic_sub_fetch(&e->wakes_sending, 1, __ATOMIC_SEQ_CST);
    return rc;
}

void post_goodbye(EngineObject *e) {
    MPI_Request req;
    if (MPI_Irecv(&e->bye_seq, 1, MPI_LONG_LONG, MPI_ANY_SOURCE, 0, e->bye, &req) == MPI_SUCCESS)
        add_request(e, req, NULL, OWNER_GOODBYE);
}

/* Cancel the engine's own standing receive (the wake or the goodbye one) and forget it. */
void cancel_standing(EngineObject *e, int32_t owner) {
    for (int i = 0; i < e->nreqs; i++) {
        if (e->owner_step[i] != owner) continue;
        MPI_Cancel(&e->reqs[i]);
        MPI_Wait(&e->reqs[i], MPI_STATUS_IGNORE);
        int last = --e->nreqs;
        e->reqs[i] = e->reqs[last]; e->owner_run[i] = e->owner_run[last]; e->owner_step[i] = e->owner_step[last];
        return;
    }
}
