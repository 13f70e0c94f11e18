"""Routes Horovod's allreduces to mcallreduce: a stand-in for ``horovod.torch.mpi_ops.mpi_lib``.

Why this interception point: every allreduce entry point of ``horovod.torch`` (allreduce,
allreduce_, the async and grouped forms, the autograd function, SyncBatchNorm) ends in
``getattr(mpi_lib, 'horovod_torch_allreduce_async_<type>')(...)``, and ``poll`` /
``synchronize`` call ``mpi_lib.horovod_torch_poll`` / ``horovod_torch_wait_and_clear``, all
looked up on the module at call time. Replacing that one module attribute therefore routes
them all while Horovod's Python layer keeps doing what it does (argument handling, default
op, compression, the handle map, HorovodInternalError). Routed handles are negative ints,
Horovod's own are positive, so poll/synchronize know where each handle belongs; everything
that is not an allreduce (broadcast, allgather, join, ...) goes to the real ``mpi_lib``.

Ordering. Horovod matches tensors across ranks by name through its coordinator; our engine,
like MPI, matches collectives by the order in which they are started. The plugin therefore
requires every rank to *start* its routed allreduces in the same order (they may be
synchronized in any order). That holds for the usual script (metrics, SyncBatchNorm,
DistributedOptimizer, which launches its buckets in a fixed order). It is checked, not
assumed: each routed allreduce carries a tiny companion allreduce of (name, shape, op)
fingerprints started just before it, and the engine checks element count, dtype and
scaling; any difference raises HorovodInternalError naming the tensor, on every rank,
instead of hanging or mixing up tensors.
"""
from __future__ import annotations

import functools
import hashlib
import threading
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from . import state

_SUPPORTED = {torch.float16, torch.float32, torch.float64, torch.int32, torch.int64}
_MAX56 = (1 << 56) - 1
_FIELDS = ("name", "shape", "op", "group size")


def fingerprint(text: str) -> int:
    """Stable 56-bit hash (Python's hash() is salted per process, useless across ranks)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little") & _MAX56


def supported(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _SUPPORTED and not t.is_sparse and t.is_contiguous()


class Routed:
    """One routed Horovod handle: a fingerprint check plus one or more engine allreduces."""

    def __init__(self, name: str, check, parts: Sequence, unpack=None):
        self.name, self.check, self.parts, self.unpack = name, check, list(parts), unpack
        self.fields = None   # the fingerprint vector this rank sent

    def test(self) -> bool:
        try:
            return all(h.test() for h in ([self.check] if self.check else []) + self.parts)
        except Exception:
            return True      # finished with an error: synchronize() raises it

    def wait(self) -> None:
        """Wait for every part (so the ranks stay in step), then raise the first error."""
        error: Optional[BaseException] = None
        for h in ([self.check] if self.check else []) + self.parts:
            try:
                h.wait()
            except Exception as exc:   # MismatchError, TypeError, ... from the engine
                error = error or exc
        if self.check is not None:
            mismatch = _mismatch(self.check.result, self.fields)
            if mismatch:
                raise RuntimeError(
                    f"mcallreduce: allreduce of tensor '{self.name}' does not match the other ranks' "
                    f"allreduce at the same position ({mismatch} differs). With the mcallreduce plugin, "
                    "every rank must start its allreduces in the same order with the same names, "
                    "shapes and ops.")
        if error is not None:
            raise RuntimeError(f"mcallreduce: allreduce of tensor '{self.name}' failed: {error}") from error
        if self.unpack is not None:
            self.unpack()


def _mismatch(result: np.ndarray, fields: List[int]) -> Optional[str]:
    n = len(fields)
    high, low = result[:n], -result[n:]
    for i in range(n):
        if high[i] != low[i]:
            return _FIELDS[i]
    return None


class Router:
    """The engine side shared by the mpi_lib proxy and the optimizer's buckets."""

    def __init__(self):
        self.active = False
        self.comm = None           # the mpi4py communicator of Horovod's global process set
        self.exit_comm = None      # for the barrier before Horovod shuts down (patch._stop_progress)
        self.lock = threading.RLock()   # a fingerprint and its data start back to back
        self.inflight: Dict[int, Routed] = {}
        self.names: set = set()
        self._next = 0

    def new_handle(self) -> int:
        self._next -= 1
        return self._next

    def start(self, name: str, buffers: Sequence, op: str, prescale: float, postscale: float,
              shapes: str, checked: bool = True, outs: Optional[Sequence] = None, unpack=None) -> Routed:
        """Start the allreduce of ``buffers`` (one engine call each) with a fingerprint check."""
        from mcallreduce import runtime
        with self.lock:
            check, fields = None, None
            if checked:
                fields = [fingerprint(name), fingerprint(shapes), fingerprint(op), len(buffers)]
                vec = np.array(fields + [-f for f in fields], dtype=np.int64)
                check = runtime.allreduce_async(vec, op="max", comm=self.comm)
            parts = [runtime.allreduce_async(buf, op=op, prescale=prescale, postscale=postscale,
                                             comm=self.comm, out=None if outs is None else outs[i])
                     for i, buf in enumerate(buffers)]
        routed = Routed(name, check, parts, unpack)
        routed.fields = fields
        return routed


ROUTER = Router()


class MpiLibProxy:
    """Stands in for Horovod's compiled ``mpi_lib``; see the module docstring."""

    def __init__(self, stock, ops: Dict[str, int]):
        self._stock = stock
        self._ops = ops          # Horovod's op constants: Average, Sum, Adasum, Min, Max, Product
        self._op_names = {v: k for k, v in ops.items()}
        self._cache: Dict[str, Any] = {}

    def __getattr__(self, name: str):
        hit = self._cache.get(name)
        if hit is None:
            attr = getattr(self._stock, name)   # AttributeError for unknown types, as stock
            if name.startswith("horovod_torch_allreduce_async_"):
                hit = functools.partial(self._allreduce, attr)
            elif name.startswith("horovod_torch_grouped_allreduce_async_"):
                hit = functools.partial(self._grouped_allreduce, attr)
            elif name == "horovod_torch_join":
                hit = functools.partial(self._join, attr)
            else:
                hit = attr
            self._cache[name] = hit
        return hit

    # -- poll / synchronize: negative handles are ours
    def horovod_torch_poll(self, handle: int) -> int:
        if handle >= 0:
            return self._stock.horovod_torch_poll(handle)
        routed = ROUTER.inflight.get(handle)
        return 1 if routed is None or routed.test() else 0

    def horovod_torch_wait_and_clear(self, handle: int) -> None:
        if handle >= 0:
            return self._stock.horovod_torch_wait_and_clear(handle)
        routed = ROUTER.inflight.get(handle)
        if routed is None:
            raise RuntimeError(f"mcallreduce: unknown handle {handle}")
        try:
            routed.wait()
        finally:
            with ROUTER.lock:
                ROUTER.inflight.pop(handle, None)
                ROUTER.names.discard(routed.name)

    # -- the routed calls
    def _why_not(self, tensors: Sequence[torch.Tensor], op: int, process_set_id: int,
                 divisor: int) -> Optional[str]:
        """None when the call can take the fast path, else the feature that prevents it."""
        if process_set_id != 0:
            return "a process set other than the global one"
        if op not in (self._ops["Sum"], self._ops["Average"]):
            return f"op {self._op_names.get(op, op)}"
        if divisor != 1:
            return "framework-level averaging (ROCm)"
        for t in tensors:
            if t.device.type != "cpu":
                return f"{t.device.type} tensors"
            if t.dtype not in _SUPPORTED:
                return f"dtype {t.dtype}"
        return None

    def _enter(self, name: str, handle: int) -> str:
        if not name:
            name = f"allreduce.noname.{-handle}"
        if name in ROUTER.names:
            raise ValueError("Requested to allreduce a tensor with the same name as another tensor that "
                             f"is currently being processed ({name!r}). If you want to request another "
                             "tensor, use a different tensor name.")
        return name

    def _allreduce(self, stock_fn, tensor, output, divisor, name, op, prescale, postscale, process_set_id):
        if not ROUTER.active or state.bypassed():
            return stock_fn(tensor, output, divisor, name, op, prescale, postscale, process_set_id)
        why = self._why_not([tensor], op, process_set_id, divisor)
        if why:
            state.warn_once(why)
            return stock_fn(tensor, output, divisor, name, op, prescale, postscale, process_set_id)
        with ROUTER.lock:
            handle = ROUTER.new_handle()
            name = self._enter(name.decode() if isinstance(name, bytes) else name, handle)
            kind = "average" if op == self._ops["Average"] else "sum"
            routed = ROUTER.start(name, [tensor], kind, prescale, postscale, shapes=str(tuple(tensor.shape)),
                                  outs=None if output is tensor else [output])
            ROUTER.inflight[handle] = routed
            ROUTER.names.add(name)
        state.counters["routed"] += 1
        return handle

    def _grouped_allreduce(self, stock_fn, tensors, outputs, divisor, name, op, prescale, postscale,
                           process_set_id):
        if not ROUTER.active or state.bypassed():
            return stock_fn(tensors, outputs, divisor, name, op, prescale, postscale, process_set_id)
        why = self._why_not(tensors, op, process_set_id, divisor)
        if why:
            state.warn_once(why)
            return stock_fn(tensors, outputs, divisor, name, op, prescale, postscale, process_set_id)
        # One fused buffer per dtype (in order of first appearance): one engine call each.
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        flats = [torch.cat([tensors[i].reshape(-1) for i in idx]) for idx in by_dtype.values()]

        def unpack():
            for flat, idx in zip(flats, by_dtype.values()):
                offset = 0
                for i in idx:
                    n = outputs[i].numel()
                    outputs[i].copy_(flat[offset:offset + n].view_as(outputs[i]))
                    offset += n

        with ROUTER.lock:
            handle = ROUTER.new_handle()
            name = self._enter(name.decode() if isinstance(name, bytes) else name, handle)
            kind = "average" if op == self._ops["Average"] else "sum"
            shapes = ";".join(f"{t.dtype}{tuple(t.shape)}" for t in tensors)
            routed = ROUTER.start(name, flats, kind, prescale, postscale, shapes=shapes, unpack=unpack)
            ROUTER.inflight[handle] = routed
            ROUTER.names.add(name)
        state.counters["routed"] += 1
        return handle

    def _join(self, stock_fn, *args):
        if ROUTER.active:
            state.warn_once("hvd.join() (uneven inputs: every rank must have synchronized all its "
                            "allreduces before joining)")
        return stock_fn(*args)
