"""Open MPI's own allreduce algorithms on demand, through the MPI tool interface.

Open MPI's "tuned" collective component reads ``coll_tuned_allreduce_algorithm``
when a communicator is created, but only honours it when
``coll_tuned_use_dynamic_rules`` was set before ``MPI_Init`` (that variable
cannot be changed at run time). So :func:`prepare` sets the environment
variable before mpi4py initialises MPI: with no rules file and algorithm 0,
Open MPI's tuned component takes its fixed decisions, as without it (its
order: a rules file, else a forced algorithm, else the fixed rules).
:func:`forced_comm` then writes the algorithm control variable through MPI_T,
duplicates the communicator (which keeps that algorithm), and restores the
variable. mpi4py has no MPI_T binding; ctypes does.

A user who sets ``OMPI_MCA_coll_tuned_use_dynamic_rules=0`` keeps Open MPI
exactly as it was, and ``mpi-ring`` then runs as ``mpi``.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

__all__ = ["OMPI_ALLREDUCE", "DYNAMIC_RULES", "DYNAMIC_RULES_ENV", "prepare", "forced_env", "forced_comm"]

#: Open MPI 4.1 coll_tuned_allreduce_algorithm values
OMPI_ALLREDUCE = {"basic_linear": 1, "nonoverlapping": 2, "recursive_doubling": 3, "ring": 4,
                  "segmented_ring": 5, "rabenseifner": 6}
#: the MCA variable that lets a forced algorithm count, and its environment form
DYNAMIC_RULES = "coll_tuned_use_dynamic_rules"
DYNAMIC_RULES_ENV = "OMPI_MCA_" + DYNAMIC_RULES
_ALGORITHM = "coll_tuned_allreduce_algorithm"


def forced_env(algorithm: str) -> dict:
    """The environment that forces one of ``OMPI_ALLREDUCE`` for a whole job, from its start."""
    return {DYNAMIC_RULES_ENV: "1", "OMPI_MCA_" + _ALGORITHM: str(OMPI_ALLREDUCE[algorithm])}


def prepare() -> None:
    """Call before mpi4py initialises MPI; a no-op once it has."""
    if "mpi4py.MPI" not in sys.modules:
        os.environ.setdefault(DYNAMIC_RULES_ENV, "1")


class _Cvar:
    """One integer MPI_T control variable, open for reading and writing."""

    def __init__(self, lib: ctypes.CDLL, name: str):
        index, count = ctypes.c_int(), ctypes.c_int()
        self.lib, self.name, self.handle = lib, name, ctypes.c_void_p()
        if lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(index)) != 0:
            raise RuntimeError(f"MPI_T: no control variable {name}")
        if lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(self.handle), ctypes.byref(count)) != 0:
            raise RuntimeError(f"MPI_T: cannot open {name}")

    def read(self) -> int:
        value = ctypes.c_int()
        if self.lib.MPI_T_cvar_read(self.handle, ctypes.byref(value)) != 0:
            raise RuntimeError(f"MPI_T: cannot read {self.name}")
        return value.value

    def write(self, value: int) -> None:
        if self.lib.MPI_T_cvar_write(self.handle, ctypes.byref(ctypes.c_int(value))) != 0:
            raise RuntimeError(f"MPI_T: cannot write {self.name}")

    def close(self) -> None:
        self.lib.MPI_T_cvar_handle_free(ctypes.byref(self.handle))


def _algorithm_cvar() -> Optional[_Cvar]:
    """The allreduce algorithm variable, open, where forcing it takes effect; else None."""
    from mpi4py import MPI

    if "Open MPI" not in MPI.Get_library_version():
        return None
    try:
        lib = ctypes.CDLL("libmpi.so.40", mode=ctypes.RTLD_GLOBAL)
        provided = ctypes.c_int()
        if lib.MPI_T_init_thread(MPI.THREAD_MULTIPLE, ctypes.byref(provided)) != 0:
            return None
        dynamic = _Cvar(lib, DYNAMIC_RULES)
        try:
            if not dynamic.read():   # set too late, or turned off by the user: a forced value is ignored
                return None
        finally:
            dynamic.close()
        return _Cvar(lib, _ALGORITHM)
    except (OSError, RuntimeError, AttributeError):
        return None


def forced_comm(comm, algorithm: str = "ring") -> Optional[object]:
    """A duplicate of ``comm`` whose MPI_Allreduce is Open MPI's ``algorithm``, or None on
    every rank. Collective: the ranks agree (MIN) that each of them can force it before any
    duplicates, so a rank that cannot never leaves the others in ``Dup``.

    None when the MPI is not Open MPI, MPI_T is unavailable, or :func:`prepare` ran too
    late (then Open MPI would silently ignore the forced algorithm).
    """
    from mpi4py import MPI

    cvar = _algorithm_cvar()
    if not comm.allreduce(int(cvar is not None), op=MPI.MIN):
        if cvar is not None:
            cvar.close()
        return None
    old = cvar.read()
    try:
        cvar.write(OMPI_ALLREDUCE[algorithm])
        ok = cvar.read() == OMPI_ALLREDUCE[algorithm]
    except RuntimeError:
        ok = False
    try:
        forced = comm.Dup()   # every rank duplicates (collective), then keeps it only if all wrote it
    finally:
        try:
            cvar.write(old)
        finally:
            cvar.close()
    if not comm.allreduce(int(ok), op=MPI.MIN):
        forced.Free()
        return None
    return forced
