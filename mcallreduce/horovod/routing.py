"""Routes Horovod's allreduces to mcallreduce: a stand-in for ``horovod.torch.mpi_ops.mpi_lib``.

Why this interception point: every allreduce entry point of ``horovod.torch`` (allreduce,
allreduce_, the async and grouped forms, the autograd function, SyncBatchNorm) ends in
``getattr(mpi_lib, 'horovod_torch_allreduce_async_<type>')(...)``, and ``poll`` /
``synchronize`` call ``mpi_lib.horovod_torch_poll`` / ``horovod_torch_wait_and_clear``, all
looked up on the module at call time. Replacing that one module attribute therefore routes
them all while Horovod's Python layer keeps doing what it does (argument handling, default
op, compression, the handle map, HorovodInternalError). Routed handles are negative ints,
Horovod's own are positive, so poll/synchronize know where each handle belongs; ``join``
is wrapped (below); everything else (broadcast, allgather, ...) goes to the real ``mpi_lib``.

Ordering. Horovod matches tensors across ranks by name through its coordinator; our engine,
like MPI, matches collectives by the order in which they are started. The plugin therefore
requires every rank to *start* its routed allreduces in the same order (they may be
synchronized in any order). That holds for the usual script (metrics, SyncBatchNorm,
DistributedOptimizer, which launches its buckets in a fixed order). It is checked, not
assumed: each routed allreduce carries a tiny companion allreduce of its metadata (name,
shape and op fingerprints, scale factors, element count and dtype of each engine call)
started just before it, and the engine checks element count, dtype and scaling before
any data moves; any difference raises HorovodInternalError naming the tensor, on every rank, instead of hanging
or mixing up tensors. Matching by name instead (Horovod's coordinator) is not attempted:
the error message tells users of rank-dependent orders to set MCALLREDUCE_HOROVOD=0.
In-place allreduces reduce into a scratch copy that is copied back only
once the check passed, so a mismatch leaves the user's tensor as it was.

hvd.join() (uneven inputs). A rank that joins keeps serving the others' routed allreduces
until every rank has joined: it first starts stock Horovod's join (so Horovod's own
collectives, fallbacks included, get its zeros as usual), then loops on the companion
allreduce with a "joined" marker and neutral metadata. Each round either shows that every
rank joined (all leave the loop at the same point of the sequence, then stock join returns
the last rank to join) or gives the metadata of the next routed allreduce of the ranks still
working, to which the joined rank contributes zeros, as Horovod's joined ranks do (Average
still divides by the full size, as in Horovod). This is why every routed allreduce, the
optimizer's gradient buckets included, carries its companion metadata on every call: a
joined rank cannot know the sizes in advance.
"""
from __future__ import annotations

import functools
import hashlib
import struct
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from . import state

_SUPPORTED = {torch.float16, torch.float32, torch.float64, torch.int32, torch.int64}
_MAX56 = (1 << 56) - 1

# The companion metadata allreduce: MAX over [fields, -fields] gives every field's maximum and
# minimum in one call. Every field is in [0, 2**56); a joined rank sends _NEUTRAL (below any
# real value) for all but the first, so the others' fields come through unchanged.
_DTYPE_CODE = {torch.float16: 1, torch.float32: 2, torch.float64: 3, torch.int32: 4, torch.int64: 5}
_DTYPE_OF = {code: dtype for dtype, code in _DTYPE_CODE.items()}
_OP_CODE = {"sum": 1, "average": 2}
_OP_OF = {code: op for op, code in _OP_CODE.items()}
_MAX_PARTS = len(_DTYPE_CODE)     # engine calls per routed allreduce: one per dtype at most
_HEAD = ("joined", "name", "shape", "op", "number of dtypes",
         "prescale_factor", "prescale_factor", "postscale_factor", "postscale_factor")
_FIELDS = _HEAD + ("element count", "dtype") * _MAX_PARTS
_NEUTRAL = -(1 << 62)
_ADVICE = ("The mcallreduce plugin matches allreduces by the order in which ranks start them (as "
           "MPI does), not by name as stock Horovod does: every rank must start its allreduces in the "
           "same order with the same names, shapes, dtypes and ops. A script that starts them in a "
           "rank-dependent order must run stock Horovod: set MCALLREDUCE_HOROVOD=0.")


@functools.lru_cache(maxsize=4096)
def fingerprint(text: str) -> int:
    """Stable 56-bit hash (Python's hash() is salted per process, useless across ranks)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little") & _MAX56


def supported(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _SUPPORTED and not t.is_sparse and t.is_contiguous()


def _float_fields(x: float) -> List[int]:
    bits = struct.unpack("<Q", struct.pack("<d", float(x)))[0]
    return [bits >> 32, bits & 0xFFFFFFFF]


def _float_of(high: int, low: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", (int(high) << 32) | int(low)))[0]


def metadata_vector(name: str, shapes: str, op: str, prescale: float, postscale: float,
                    buffers: Sequence[torch.Tensor]) -> np.ndarray:
    """What a working rank sends in the companion allreduce (see the module docstring)."""
    if len(buffers) > _MAX_PARTS:
        raise ValueError(f"mcallreduce: {len(buffers)} engine calls for one allreduce (at most {_MAX_PARTS})")
    fields = [0, fingerprint(name), fingerprint(shapes), _OP_CODE[op], len(buffers),
              *_float_fields(prescale), *_float_fields(postscale)]
    for i in range(_MAX_PARTS):
        fields += [buffers[i].numel(), _DTYPE_CODE[buffers[i].dtype]] if i < len(buffers) else [0, 0]
    return np.array(fields + [-f for f in fields], dtype=np.int64)


def joined_vector() -> np.ndarray:
    """What a rank inside hvd.join() sends: the joined marker, neutral everywhere else."""
    vec = np.full(2 * len(_FIELDS), _NEUTRAL, dtype=np.int64)
    vec[0], vec[len(_FIELDS)] = 1, -1
    return vec


def _split(result: np.ndarray):
    n = len(_FIELDS)
    return result[:n], -result[n:]


def _mismatch(result: np.ndarray) -> Optional[str]:
    """The first field on which the ranks that have not joined disagree, or None."""
    high, low = _split(result)
    for i in range(1, len(_FIELDS)):
        if high[i] != low[i]:
            return _FIELDS[i]
    return None


class Routed:
    """One routed Horovod handle: a metadata check plus one or more engine allreduces."""

    def __init__(self, name: str, check, parts: Sequence, unpack=None):
        self.name, self.check, self.parts, self.unpack = name, check, list(parts), unpack

    def test(self) -> bool:
        try:
            return all(h.test() for h in [self.check] + self.parts)
        except Exception:
            return True      # finished with an error: synchronize() raises it

    def wait(self) -> None:
        """Wait for every part (so the ranks stay in step), then raise the first error.

        Results reach the user's tensors (``unpack``) only when everything passed."""
        error: Optional[BaseException] = None
        for h in [self.check] + self.parts:
            try:
                h.wait()
            except Exception as exc:   # MismatchError, TypeError, ... from the engine
                error = error or exc
        mismatch = _mismatch(self.check.result) if self.check.error is None else None
        if mismatch:
            raise RuntimeError(
                f"mcallreduce: allreduce of tensor '{self.name}' does not match the other ranks' "
                f"allreduce at the same position ({mismatch} differs); the tensor was left unchanged. "
                + _ADVICE)
        if error is not None:
            from mcallreduce.errors import MismatchError
            advice = f" The tensor was left unchanged. {_ADVICE}" if isinstance(error, MismatchError) else ""
            raise RuntimeError(f"mcallreduce: allreduce of tensor '{self.name}' failed: {error}.{advice}") \
                from error
        if self.unpack is not None:
            self.unpack()


class Router:
    """The engine side shared by the mpi_lib proxy and the optimizer's buckets."""

    def __init__(self):
        self.active = False
        self.route_all = False     # False: only op=MultiColor calls (op-only mode)
        self.comm = None           # the mpi4py communicator of Horovod's global process set
        self.lock = threading.RLock()   # a metadata check and its data start back to back
        self.inflight: Dict[int, Routed] = {}
        self.timeline = None       # a horovod.timeline.Timeline when one is asked for
        self.names: set = set()
        self._next = 0

    def new_handle(self) -> int:
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
        for handle in [check] + parts:
            handle.name = name       # for the stall inspector's report
        if self.timeline is not None:
            kind = "gradient bucket" if name.startswith("gradient bucket") else "allreduce"
            self.timeline.record(name, kind, check, parts, sum(b.numel() * b.element_size() for b in buffers))
        return Routed(name, check, parts, unpack)

    def last_to_join(self, served: int) -> Optional[int]:
        """The rank that joined last: the one that served the fewest routed allreduces while
        joined (it joined after all of them), or None when several share that count (they
        joined between the same two allreduces). Called by every rank, in step."""
        from mcallreduce import runtime
        ctx = runtime.Context.get(self.comm)
        counts = np.full(ctx.size, -1, dtype=np.int64)   # every rank's count, in its own slot
        counts[ctx.rank] = served
        with self.lock:
            every = runtime.allreduce_async(counts, op="max", comm=self.comm)
        _wait_idle(every)
        fewest = np.flatnonzero(every.result == every.result.min())
        return int(fewest[0]) if len(fewest) == 1 else None

    def serve_joined(self) -> int:
        """The routed side of hvd.join(): contribute zeros to the other ranks' routed allreduces
        until every rank has joined. Returns the number of allreduces served."""
        from mcallreduce import runtime
        served = 0
        while True:
            with self.lock:
                check = runtime.allreduce_async(joined_vector(), op="max", comm=self.comm)
            _wait_idle(check)
            high, low = _split(check.result)
            if low[0] == 1:      # every rank sent the joined marker: all leave here, in step
                return served
            op = _OP_OF.get(int(high[3]), "sum")
            pre, post = _float_of(high[5], high[6]), _float_of(high[7], high[8])
            with self.lock:
                parts = []
                for i in range(min(int(high[4]), _MAX_PARTS)):
                    count, code = int(high[len(_HEAD) + 2 * i]), int(high[len(_HEAD) + 2 * i + 1])
                    zeros = torch.zeros(count, dtype=_DTYPE_OF.get(code, torch.float32))
                    parts.append(runtime.allreduce_async(zeros, op=op, prescale=pre, postscale=post,
                                                         comm=self.comm))
            for part in parts:
                try:
                    part.wait()
                except Exception:
                    pass         # a mismatch among the working ranks: they raise it
            served += 1
            state.counters["served_joined"] += 1


class Finished:
    """A handle that is done already (hvd.join's, once the join has completed)."""
    name = "join"

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        pass


def _copy_raw(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src as Horovod's C++ writes it: no autograd, no version bump (``.data``)."""
    dst.data.copy_(src)


def _wait_idle(handle) -> None:
    """Wait without keeping a core busy: a joined rank may wait a whole training step for the
    next allreduce, and its core is better left to the ranks still computing."""
    pause = 2e-5
    while not handle.test():
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


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

    def _enter(self, name, handle: int) -> str:
        """The tensor's name (Horovod's way of making one up when the user gave none)."""
        name = name.decode() if isinstance(name, bytes) else name
        if not name:
            # Horovod numbers unnamed tensors per rank; the numbers differ between ranks after
            # uneven work (hvd.join), so the metadata check leaves these names out: unnamed
            # tensors are matched by position only.
            name = f"allreduce.noname.{-handle}"
        if name in ROUTER.names:
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
            ROUTER.inflight[handle] = routed
            ROUTER.names.add(name)
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
            ROUTER.inflight[handle] = routed
            ROUTER.names.add(name)
        state.counters["routed"] += 1
        return handle

    def _join(self, stock_fn, output, device):
        """hvd.join(): stock Horovod's join, plus serving the routed allreduces of the ranks that
        have not joined yet (see the module docstring). Ignores stock_horovod(): the other
        ranks' routed allreduces need this rank either way."""
        if not ROUTER.active:
            return stock_fn(output, device)
        # Stock join first: Horovod's own collectives (fallbacks) then get this rank's zeros.
        handle = stock_fn(output, device)
        try:
            served = ROUTER.serve_joined()
            last = ROUTER.last_to_join(served)
        except Exception as exc:
            raise RuntimeError(
                f"mcallreduce: hvd.join() could not follow the other ranks' allreduces ({exc}). "
                + _ADVICE) from exc
        # Every rank started stock join before leaving the loop, so it completes now. Its
        # answer (the last join request Horovod saw) cannot tell apart joins that reach it in one
        # cycle, which routed allreduces in between make common; ours can, where it is unique.
        self._stock.horovod_torch_wait_and_clear(handle)
        if last is not None:
            output.fill_(last)
        mine = ROUTER.new_handle()
        ROUTER.inflight[mine] = Finished()
        return mine
