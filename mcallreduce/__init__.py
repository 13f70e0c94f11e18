"""mcallreduce: the multi-color allreduce of Kumar et al. 2017 over MPI.

    import mcallreduce
    mcallreduce.allreduce(buf)                      # in place, sum over COMM_WORLD
    h = mcallreduce.allreduce_async(buf, op="average"); ...; h.wait()

Importing the package does not initialise MPI: the runtime (and mpi4py) load on
first use, so launchers, the data package and schedule tools stay MPI-free. It does
set ``OMPI_MCA_coll_tuned_use_dynamic_rules=1`` unless MPI is already initialised or
the variable is set (:mod:`mcallreduce.mpit`): Open MPI's decisions stay its own, and
the runtime can then run Open MPI's ring where the tuning table picks ``mpi-ring``.
"""
__version__ = "0.1.0"

from . import mpit as _mpit  # noqa: E402  (no MPI)
from .config import Config, ConfigError  # noqa: E402  (pure: no MPI)
from .errors import MismatchError  # noqa: E402

_mpit.prepare()

_RUNTIME = ("allreduce", "allreduce_async", "Handle", "DTYPES", "OPS")
__all__ = ["Config", "ConfigError", "MismatchError", "__version__", *_RUNTIME]


def __getattr__(name):
    if name in _RUNTIME:
        from . import runtime
        value = globals()[name] = getattr(runtime, name)   # later lookups skip this hook
        return value
    raise AttributeError(f"module 'mcallreduce' has no attribute {name!r}")
