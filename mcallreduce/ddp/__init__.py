"""PyTorch DDP over the multi-color allreduce, two ways in (docs/ddp.md):

* a communication hook on a gloo-backed DDP model::

      mcallreduce.ddp.init_process_group("gloo")          # under mpirun: no MASTER_ADDR needed
      model = DistributedDataParallel(net)
      model.register_comm_hook(None, mcallreduce.ddp.multicolor_hook)

* the ``mcallreduce`` torch.distributed backend, registered on import::

      mcallreduce.ddp.init_process_group("mcallreduce")
      model = DistributedDataParallel(net)

Importing this package does not initialise MPI.
"""
from .backend import BACKEND, ProcessGroupMulticolor, register
from .hook import MulticolorHookState, multicolor_hook
from .rendezvous import check_matches_mpi, init_process_group, store_from_mpi

__all__ = ["multicolor_hook", "MulticolorHookState", "init_process_group", "store_from_mpi", "check_matches_mpi",
           "ProcessGroupMulticolor", "BACKEND"]

register()
