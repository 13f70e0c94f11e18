"""Cost model of allreduce schedules.

* :mod:`.model`     -- :class:`ClusterModel` (hosts, NICs, links, alpha/beta/gamma, CPU), presets
* :mod:`.simulate`  -- discrete-event player of the runtime's :class:`~mcallreduce.schedule.Schedule`
* :mod:`.mpi_models`-- Open MPI 4.1's allreduce algorithms as schedules ("mpi" has none of its own)
* :mod:`.predict`   -- predicted time per algorithm and size, as the runtime would run it
* :mod:`.calibrate` -- measure alpha, beta, gamma and the engine's per-step overhead on the cluster
* :mod:`.tuner`     -- model-based choice of colors, segment and hierarchy per size

Pure Python + numpy; importing it never initialises MPI.
"""
from .model import ClusterModel, emulated, paper
from .simulate import SimResult, simulate

__all__ = ["ClusterModel", "emulated", "paper", "SimResult", "simulate"]
