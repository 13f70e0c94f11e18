/* MPI's own allreduce as a run's body: started in call order on every rank (a queue on
 * the engine), blocking where every rank waits for the run alone (its check says so), else
 * MPI_Iallreduce.
 * KIND_MPI_RING runs on a communicator made with Open MPI's ring forced (mcallreduce/mpit.py);
 * the forced choice binds the blocking call only: MPI_Iallreduce is libnbc's own choice. */
#include <string.h>

#include "executor.h"

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
void pump_collectives(EngineObject *e) {
    while (e->coll_head && (e->coll_head->done || e->coll_head->coll_ready)) {
        run_t *r = e->coll_head;
        e->coll_head = r->next;
        if (!e->coll_head) e->coll_tail = NULL;
        r->next = NULL;
        if (r->done || r->on_schedule) continue;
        if (r->nelem == 0) { finish(e, r, STATUS_OK); continue; }
        MPI_Comm comm = r->kind == KIND_MPI_RING ? e->coll_ring : e->coll;
        if (r->blocking) {   /* MPI's blocking allreduce: no libnbc progress rounds */
            e->in_mpi = "MPI_Allreduce";
            int rc = MPI_Allreduce(MPI_IN_PLACE, r->buf, (int)r->nelem, mpi_type(r->dtype), mpi_op(r->op), comm);
            e->in_mpi = NULL;
            if (rc != MPI_SUCCESS) fail_run(e, r, "MPI_Allreduce", rc);
            else finish(e, r, STATUS_OK);
            continue;
        }
        /* from a copy at 4 ranks and more: Open MPI's libnbc runs an in-place MPI_Iallreduce as a
           binomial reduce and broadcast of the whole buffer, a separate send buffer as a
           reduce-scatter and allgather (docs/algorithms.md, "mpi") */
        const void *send = MPI_IN_PLACE;
        if (e->size >= MPI_SEND_COPY_RANKS) {
            r->scratch_bytes = (size_t)r->nelem * r->isz;
            r->scratch = r->scratch_area = pool_take(e, r->scratch_bytes);
            if (!r->scratch) { fail_run(e, r, "out of memory", MPI_SUCCESS); continue; }
            memcpy(r->scratch, r->buf, r->scratch_bytes);
            send = r->scratch;
        }
        MPI_Request req;
        e->in_mpi = "MPI_Iallreduce";
        int rc = MPI_Iallreduce(send, r->buf, (int)r->nelem, mpi_type(r->dtype), mpi_op(r->op), comm, &req);
        e->in_mpi = NULL;
        if (rc != MPI_SUCCESS) { fail_run(e, r, "MPI_Iallreduce", rc); continue; }
        if (add_request(e, req, r, OWNER_COLLECTIVE) < 0) fail_run(e, r, "out of memory", MPI_SUCCESS);
    }
}
