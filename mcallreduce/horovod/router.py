"""The plugin's routed allreduces: their handles, and the one Router that starts them and
keeps those in flight under their handle numbers until Horovod's synchronize() clears them.

Routed handles are negative ints, Horovod's own are positive, so poll/synchronize know where
each handle belongs. The mpi_lib proxy (:mod:`.mpi_lib_proxy`), the optimizer's buckets
(:mod:`.bucketing`) and hvd.join() (:mod:`.join`) all start their allreduces here.
"""
from __future__ import annotations

import threading
from typing import Dict, Optional, Sequence

import torch

from .companion import DTYPE_CODE, ORDER_ADVICE, metadata_vector, mismatch

#: the dtypes the engine reduces (the companion vector encodes each)
SUPPORTED_DTYPES = frozenset(DTYPE_CODE)


def supported(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in ROUTER.dtypes and not t.is_sparse and t.is_contiguous()


class Routed:
    """One routed Horovod handle: a metadata check plus one or more engine allreduces."""

    def __init__(self, name: str, check, parts: Sequence, unpack=None):
        self.name, self.check, self.parts, self.unpack = name, check, list(parts), unpack
        self._settled, self._error = False, None
        self._settling = threading.Lock()   # poll and synchronize may settle it from two threads

    def test(self) -> bool:
        """Whether every part is done. Once they are, the result is in the user's tensors, as
        stock's poll promises, or the error is kept for :meth:`wait`."""
        if not self._settled:
            if not all(_finished(h) for h in [self.check] + self.parts):
                return False
            self._settle()   # waits for nothing: every part has finished
        return True

    def wait(self) -> None:
        """Wait for every part (so the ranks stay in step), then raise the first error.

        Results reach the user's tensors (``unpack``) only when everything passed."""
        if not self._settled:
            self._settle()
        if self._error is not None:
            raise self._error

    def _settle(self) -> None:
        try:
            self._outcome()
            error = None
        except Exception as exc:   # noqa: BLE001  (raised by wait(), as Horovod's synchronize does)
            error = exc
        with self._settling:   # the result reaches the user's tensors once
            if self._settled:
                return
            if error is None and self.unpack is not None:
                self.unpack()
            self._error, self._settled = error, True

    def _outcome(self) -> None:
        """Wait for every part, then raise the first error (the tensors still untouched)."""
        error: Optional[BaseException] = None
        for h in [self.check] + self.parts:
            try:
                h.wait()
            except Exception as exc:   # MismatchError, TypeError, ... from the engine
                error = error or exc
        differs = mismatch(self.check.result) if self.check.error is None else None
        if differs:
            raise RuntimeError(
                f"mcallreduce: allreduce of tensor '{self.name}' does not match the other ranks' "
                f"allreduce at the same position ({differs} differs); the tensor was left unchanged. "
                + ORDER_ADVICE)
        if error is not None:
            from mcallreduce.errors import MismatchError
            advice = f" The tensor was left unchanged. {ORDER_ADVICE}" if isinstance(error, MismatchError) else ""
            raise RuntimeError(f"mcallreduce: allreduce of tensor '{self.name}' failed: {error}.{advice}") \
                from error


def _finished(handle) -> bool:
    try:
        return handle.test()
    except Exception:   # noqa: BLE001  (finished with an error: wait() raises it)
        return True


class Finished:
    """A handle that is done already (hvd.join's, once the join has completed)."""
    name = "join"

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class Router:
    """The engine side shared by the mpi_lib proxy and the optimizer's buckets."""

    def __init__(self):
        self.active = False
        self.route_all = False     # False: only op=MultiColor calls (op-only mode)
        self.comm = None           # the mpi4py communicator of Horovod's global process set
        self.lock = threading.RLock()   # a metadata check and its data start back to back
        self.inflight: Dict[int, Routed] = {}
        self.timeline = None       # a horovod.timeline.Timeline when one is asked for
        self.names: Dict[str, int] = {}   # name -> its latest handle: Horovod refuses a second one in flight
        self.dtypes = SUPPORTED_DTYPES    # what is routed: under MPI's own allreduce, not float16 (hvd.init())
        self._next = 0

    def new_handle(self) -> int:
        with self.lock:   # hvd.join() takes one from the main thread beside other threads' calls
            self._next -= 1
            return self._next

    def start(self, name: str, buffers: Sequence, op: str, prescale: float, postscale: float,
              shapes: str, outs: Optional[Sequence] = None, unpack=None, named: bool = True) -> Routed:
        """Start the allreduce of ``buffers`` (one engine call each) behind its metadata check.

        Every call carries the check, also a gradient bucket whose layout never changes: a
        rank inside hvd.join() learns from it what to contribute zeros to. ``named=False``: the
        user gave no name (``name`` is made up per rank), so the check does not compare it."""
        from mcallreduce import runtime
        vec = metadata_vector(name if named else "", shapes, op, prescale, postscale, buffers)
        with self.lock:
            check = runtime.allreduce_async(vec, op="max", comm=self.comm)
            parts = [runtime.allreduce_async(buf, op=op, prescale=prescale, postscale=postscale,
                                             comm=self.comm, out=None if outs is None else outs[i])
                     for i, buf in enumerate(buffers)]
        check.name = f"metadata check of tensor '{name}'"     # for the stall inspector's report
        for part in parts:
            part.name = f"tensor '{name}'"
        if self.timeline is not None:
            kind = "gradient bucket" if name.startswith("gradient bucket") else "allreduce"
            self.timeline.record(name, kind, check, parts, sum(b.numel() * b.element_size() for b in buffers))
        return Routed(name, check, parts, unpack)

    def track(self, handle: int, routed: Routed) -> None:
        """Keep ``routed`` under ``handle`` (its name taken while it runs) until :meth:`clear`."""
        self.inflight[handle] = routed
        self.names[routed.name] = handle

    def clear(self, handle: int, routed) -> None:
        with self.lock:
            self.inflight.pop(handle, None)
            if self.names.get(routed.name) == handle:
                del self.names[routed.name]

    def forget_handles(self) -> None:
        with self.lock:
            self.inflight.clear()
            self.names.clear()

    def in_progress(self, name: str) -> bool:
        """Whether a call of this name is still running (one that finished frees its name, as in Horovod,
        synchronized or not)."""
        handle = self.names.get(name)
        return handle is not None and handle in self.inflight and not self.inflight[handle].test()


ROUTER = Router()
