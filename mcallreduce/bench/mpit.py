"""Open MPI's own allreduce algorithms on demand, through the MPI tool interface.

Open MPI's "tuned" collective component reads ``coll_tuned_allreduce_algorithm``
when a communicator is created, but only honours it when
``coll_tuned_use_dynamic_rules`` was set before ``MPI_Init`` (that variable
cannot be changed at run time). So: :func:`prepare` sets the environment
variable before mpi4py initialises MPI (with algorithm 0, Open MPI's default
decision is unchanged), and :func:`forced_comm` writes the algorithm control
variable through MPI_T, duplicates the communicator (which then keeps that
algorithm), and restores the variable. mpi4py has no MPI_T binding; ctypes does.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

__all__ = ["OMPI_ALLREDUCE", "prepare", "forced_comm"]

#: Open MPI 4.1 coll_tuned_allreduce_algorithm values
OMPI_ALLREDUCE = {"basic_linear": 1, "nonoverlapping": 2, "recursive_doubling": 3, "ring": 4,
                  "segmented_ring": 5, "rabenseifner": 6}
_ENV = "OMPI_MCA_coll_tuned_use_dynamic_rules"


def prepare() -> None:
    """Call before mpi4py initialises MPI; a no-op once it has."""
    if "mpi4py.MPI" not in sys.modules:
        os.environ.setdefault(_ENV, "1")


def _cvar_write(lib: ctypes.CDLL, name: str, value: int) -> int:
    """Write an integer MPI_T control variable; returns its previous value."""
    index, count = ctypes.c_int(), ctypes.c_int()
    handle = ctypes.c_void_p()
    if lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(index)) != 0:
        raise RuntimeError(f"MPI_T: no control variable {name}")
    if lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) != 0:
        raise RuntimeError(f"MPI_T: cannot open {name}")
    old = ctypes.c_int()
    lib.MPI_T_cvar_read(handle, ctypes.byref(old))
    rc = lib.MPI_T_cvar_write(handle, ctypes.byref(ctypes.c_int(value)))
    lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
    if rc != 0:
        raise RuntimeError(f"MPI_T: cannot write {name} (error {rc})")
    return old.value


def forced_comm(comm, algorithm: str = "ring") -> Optional[object]:
    """A duplicate of ``comm`` whose MPI_Allreduce is Open MPI's ``algorithm``, or None.

    None when the MPI is not Open MPI, MPI_T is unavailable, or :func:`prepare`
    ran too late (then Open MPI would silently ignore the forced algorithm).
    """
    from mpi4py import MPI

    if "Open MPI" not in MPI.Get_library_version() or os.environ.get(_ENV) != "1":
        return None
    try:
        lib = ctypes.CDLL("libmpi.so.40", mode=ctypes.RTLD_GLOBAL)
        provided = ctypes.c_int()
        if lib.MPI_T_init_thread(MPI.THREAD_MULTIPLE, ctypes.byref(provided)) != 0:
            return None
        old = _cvar_write(lib, "coll_tuned_allreduce_algorithm", OMPI_ALLREDUCE[algorithm])
        try:
            return comm.Dup()
        finally:
            _cvar_write(lib, "coll_tuned_allreduce_algorithm", old)
    except (OSError, RuntimeError, AttributeError):
        return None
