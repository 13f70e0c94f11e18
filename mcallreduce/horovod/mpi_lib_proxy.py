"""Routes Horovod's allreduces to mcallreduce: a stand-in for ``horovod.torch.mpi_ops.mpi_lib``.

Why this interception point: every allreduce entry point of ``horovod.torch`` (allreduce,
allreduce_, the async and grouped forms, the autograd function, SyncBatchNorm) ends in
``getattr(mpi_lib, 'horovod_torch_allreduce_async_<type>')(...)``, and ``poll`` /
``synchronize`` call ``mpi_lib.horovod_torch_poll`` / ``horovod_torch_wait_and_clear``, all
looked up on the module at call time. Replacing that one module attribute therefore routes
them all while Horovod's Python layer keeps doing what it does (argument handling, default
op, compression, the handle map, HorovodInternalError). Routed handles are negative ints,
Horovod's own are positive, so poll/synchronize know where each handle belongs; ``join``
is wrapped (:mod:`.join`); everything else (broadcast, allgather, ...) goes to the real ``mpi_lib``.

Each routed call is matched across ranks by its position, checked by a companion metadata
allreduce (:mod:`.companion`); the engine side, handles and bookkeeping, is :mod:`.router`.
In-place allreduces reduce into a scratch copy that is copied back only once the check
passed, so a mismatch leaves the user's tensor as it was.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence

import torch

from . import state
from .join import join
from .router import ROUTER

__all__ = ["MpiLibProxy"]


def _copy_raw(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src as Horovod's C++ writes it: no autograd, no version bump (``.data``)."""
    dst.data.copy_(src)


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
                hit = functools.partial(join, self._stock, attr)
            else:
                hit = attr
            self._cache[name] = hit
        return hit

    # -- poll / synchronize: negative handles are ours
    def horovod_torch_poll(self, handle: int) -> int:
        if handle >= 0:
            return self._stock.horovod_torch_poll(handle)
        return 1 if _routed(handle).test() else 0

    def horovod_torch_wait_and_clear(self, handle: int) -> None:
        if handle >= 0:
            return self._stock.horovod_torch_wait_and_clear(handle)
        routed = _routed(handle)
        try:
            routed.wait()
        finally:
            ROUTER.clear(handle, routed)

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
            if t.dtype not in ROUTER.dtypes:
                return f"dtype {t.dtype}"
        return None

    def _enter(self, name, handle: int) -> str:
        """The tensor's name (Horovod's way of making one up when the user gave none)."""
        name = name.decode() if isinstance(name, bytes) else name
        if not name:
            # Horovod numbers unnamed tensors per rank; the numbers differ between ranks after
            # uneven work (hvd.join), so the metadata check leaves these names out: unnamed
            # tensors are matched by position only.
            name = f"allreduce.noname.{-handle}"
        if ROUTER.in_progress(name):
            raise ValueError("Requested to allreduce a tensor with the same name as another tensor that "
                             f"is currently being processed ({name!r}). If you want to request another "
                             "tensor, use a different tensor name.")
        return name

    def _routes(self, op: int) -> tuple:
        """(route?, op): MultiColor is Average, routed even when the environment routes nothing."""
        if op == state.MULTICOLOR_OP:
            if not ROUTER.active:
                state.warn_once("op=MultiColor before hvd.init() or with the plugin inactive")
            return ROUTER.active and not state.bypassed(), self._ops["Average"]
        return ROUTER.active and ROUTER.route_all and not state.bypassed(), op

    def _allreduce(self, stock_fn, tensor, output, divisor, name, op, prescale, postscale, process_set_id):
        route, op = self._routes(op)
        if not route:
            return stock_fn(tensor, output, divisor, name, op, prescale, postscale, process_set_id)
        why = self._why_not([tensor], op, process_set_id, divisor)
        if why:
            state.warn_once(why)
            return stock_fn(tensor, output, divisor, name, op, prescale, postscale, process_set_id)
        with ROUTER.lock:
            handle = ROUTER.new_handle()
            named = bool(name)
            name = self._enter(name, handle)
            kind = "average" if op == self._ops["Average"] else "sum"
            if output is tensor:
                # In place: reduce into a scratch copy (the engine copies the tensor into it at
                # the start) and copy back only once the metadata check passed, so a mismatch
                # across ranks leaves the user's tensor unchanged. Out of place, ``output`` is
                # Horovod's own new tensor, which the user only sees after success.
                scratch = torch.empty_like(tensor)
                outs, unpack = [scratch], functools.partial(_copy_raw, tensor, scratch)
            else:
                outs, unpack = [output], None
            routed = ROUTER.start(name, [tensor], kind, prescale, postscale, shapes=str(tuple(tensor.shape)),
                                  outs=outs, unpack=unpack, named=named)
            ROUTER.track(handle, routed)
        state.counters["routed"] += 1
        return handle

    def _grouped_allreduce(self, stock_fn, tensors, outputs, divisor, name, op, prescale, postscale,
                           process_set_id):
        route, op = self._routes(op)
        if not route:
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
                    _copy_raw(outputs[i], flat[offset:offset + n].view_as(outputs[i]))
                    offset += n

        with ROUTER.lock:
            handle = ROUTER.new_handle()
            named = bool(name)
            name = self._enter(name, handle)
            kind = "average" if op == self._ops["Average"] else "sum"
            shapes = ";".join(f"{t.dtype}{tuple(t.shape)}" for t in tensors)
            routed = ROUTER.start(name, flats, kind, prescale, postscale, shapes=shapes, unpack=unpack,
                                  named=named)
            ROUTER.track(handle, routed)
        state.counters["routed"] += 1
        return handle


def _routed(handle: int):
    """The routed call under ``handle``, or stock's error for a handle that is not (or no longer) one."""
    routed = ROUTER.inflight.get(handle)
    if routed is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    return routed
