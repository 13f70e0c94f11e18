"""Buffers and the shared-memory window: what the runtime hands the executor.

``as_array`` turns a numpy array or CPU torch tensor into a zero-copy 1-D view and rejects
what the executor cannot reduce; :class:`SharedWindow` is the MPI shared-memory window of a
single-host communicator that the one-host stage (native/shared_stage.c) runs in.
"""
from __future__ import annotations

import atexit
import sys
from typing import Any, List, Optional

import numpy as np
from mpi4py import MPI

from . import shared_stage as _stage
from .hostlayout import all_on_one_host
from .check import DTYPE_CODE, DTYPES

__all__ = ["as_array", "SharedWindow"]


# ---------------------------------------------------------------------------- buffers

def as_array(buf: Any) -> np.ndarray:
    """Zero-copy 1-D numpy view of a contiguous numpy array or CPU torch tensor."""
    if isinstance(buf, np.ndarray):
        arr = buf
    elif type(buf).__module__.startswith("torch"):
        if buf.device.type != "cpu":
            raise TypeError(f"mcallreduce: {buf.device.type} tensors are not supported; "
                            "pass a CPU or CUDA tensor")
        if buf.layout != sys.modules["torch"].strided:   # sparse: torch is imported, buf is its tensor
            raise TypeError(f"mcallreduce: a {buf.layout} tensor; pass a dense one (tensor.to_dense())")
        if not buf.is_contiguous():
            raise ValueError("mcallreduce: tensor is not contiguous; call .contiguous() first")
        if buf.is_neg() or buf.is_conj():   # lazy views numpy cannot share (torch raises RuntimeError, not TypeError)
            raise TypeError("mcallreduce: a negated or conjugated tensor view; pass tensor.resolve_neg() "
                            "or tensor.resolve_conj()")
        try:
            arr = buf.detach().numpy()
        except TypeError as exc:  # e.g. bfloat16 has no numpy equivalent
            raise TypeError(f"mcallreduce: unsupported dtype {buf.dtype}; "
                            f"supported: {', '.join(DTYPES)}") from exc
    else:
        raise TypeError(f"mcallreduce: expected a numpy array, a torch tensor or a CuPy array, "
                        f"got {type(buf).__name__}")
    if arr.dtype not in DTYPE_CODE:
        what = arr.dtype.name if arr.dtype.isnative else f"{arr.dtype.str} (not in this machine's byte order)"
        raise TypeError(f"mcallreduce: unsupported dtype {what}; supported: {', '.join(DTYPES)}")
    if not arr.flags.c_contiguous:
        raise ValueError("mcallreduce: buffer is not contiguous; pass np.ascontiguousarray(buf)")
    if not arr.flags.writeable:
        raise ValueError("mcallreduce: buffer is read-only")
    return arr.reshape(-1)


# ---------------------------------------------------------------------------- shared memory

class SharedWindow:
    """The MPI shared-memory window of a single-host communicator: p slots and a result area,
    then 2p small slots for the stage's one-sync calls (native/shared_stage.c).

    Created collectively with the library's duplicate of the communicator, freed when its
    context is released (collective) or at exit (before mpi4py finalizes MPI). The window is
    locked once for passive-target access, so the executor's MPI_Win_sync can order this
    rank's loads and stores against the messages that tell peers a slot is ready.
    """

    def __init__(self, comm: MPI.Comm, slot_bytes: int, small_bytes: int = 0):
        self.nranks, self.rank = comm.Get_size(), comm.Get_rank()
        self.slot_bytes = -(-slot_bytes // _stage.ALIGN) * _stage.ALIGN
        self.small_bytes = -(-min(small_bytes, slot_bytes) // _stage.ALIGN) * _stage.ALIGN
        total = _stage.areas(self.nranks) * self.slot_bytes + _stage.small_areas(self.nranks) * self.small_bytes
        # rank 0 allocates the whole window, so the slots are one contiguous mapping
        self.win = MPI.Win.Allocate_shared(total if self.rank == 0 else 0, 1, comm=comm)
        base, _ = self.win.Shared_query(0)
        self.mem = np.frombuffer(base, dtype=np.uint8, count=total)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        atexit.register(self.free)

    @classmethod
    def create(cls, comm: MPI.Comm, slot_bytes: int, small_bytes: int = 0) -> Optional["SharedWindow"]:
        """A window when every rank of ``comm`` shares this host's memory, else None (collective)."""
        if slot_bytes <= 0 or comm.Get_size() < 2 or not all_on_one_host(comm):
            return None
        return cls(comm, slot_bytes, small_bytes)

    @property
    def address(self) -> int:
        return self.mem.ctypes.data

    def leave_to_finalize(self) -> None:
        """Not freed at exit (collective) but by MPI_Finalize, for a rank that may leave alone:
        its peers meet it there, whatever they are doing until they exit."""
        atexit.unregister(self.free)
        _LEFT_TO_FINALIZE.append(self)   # its context may be collected before then

    def free(self) -> None:
        """Free the window now (collective); a window left to MPI_Finalize stays."""
        if self in _LEFT_TO_FINALIZE:
            return
        atexit.unregister(self.free)
        if self.win is not None and not MPI.Is_finalized():
            self.win.Unlock_all()
            self.win.Free()
        self.win = None


_LEFT_TO_FINALIZE: List[SharedWindow] = []
