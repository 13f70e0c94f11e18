"""The MPI runtime: the public allreduce API over mpi4py.

One :class:`Context` per user communicator owns two duplicates of it (data and
control traffic never mix with the user's messages), the host layout, and one
progress :class:`~mcallreduce.engine.Engine` that executes the schedules.
This module turns a call into a :class:`Handle`: it validates the buffer,
resolves the configuration for the message size, picks the (cached) schedule,
and prepares the cross-rank metadata check that turns mismatched calls into an
error on every rank instead of a hang.
"""
from __future__ import annotations

import atexit
import sys
import threading
from typing import Any, Dict, List, Optional

import numpy as np
from mpi4py import MPI

from .algorithms import Params, build_schedule
from . import config as _config
from .config import ALGORITHMS, ROUTES, Config, ConfigError, resolve
from .engine import MAX_SCHEDULE_TAGS, META_TAG, OPS, SYNC_PAYLOAD, SYNC_TAG, TAG_SPAN, Engine
from .errors import MismatchError
from .schedule import Schedule
from . import shared as _shared
from .shared import scale_

__all__ = ["Context", "Handle", "allreduce", "allreduce_async", "start_progress_thread", "OPS", "DTYPES"]

#: supported element types (numpy names)
DTYPES = ("float16", "float32", "float64", "int32", "int64")
_DTYPE_CODE = {np.dtype(name): i + 1 for i, name in enumerate(DTYPES)}
_ALGO_CODE = {name: i + 1 for i, name in enumerate(ALGORITHMS)}
_ROUTE_CODE = {name: i + 1 for i, name in enumerate(ROUTES)}
_OP_CODE = {name: i + 1 for i, name in enumerate(OPS)}
_CHECK_FIELDS = ("element count", "dtype", "algorithm", "op", "colors", "segment", "fanout",
                 "hierarchy", "pipeline depth", "shared-memory stage", "scale factors", "route")
_REJECT_REASONS = {1: "unsupported buffer", 2: "invalid configuration"}


# ---------------------------------------------------------------------------- buffers

def as_array(buf: Any) -> np.ndarray:
    """Zero-copy 1-D numpy view of a contiguous numpy array or CPU torch tensor."""
    if isinstance(buf, np.ndarray):
        arr = buf
    elif type(buf).__module__.startswith("torch"):
        if buf.device.type != "cpu":
            raise TypeError(f"mcallreduce: {buf.device.type} tensors are not supported yet; "
                            "pass a CPU tensor (GPU buffers need a CUDA-aware MPI)")
        if not buf.is_contiguous():
            raise ValueError("mcallreduce: tensor is not contiguous; call .contiguous() first")
        try:
            arr = buf.detach().numpy()
        except TypeError as exc:  # e.g. bfloat16 has no numpy equivalent
            raise TypeError(f"mcallreduce: unsupported dtype {buf.dtype}; "
                            f"supported: {', '.join(DTYPES)}") from exc
    else:
        raise TypeError(f"mcallreduce: expected a numpy array or a CPU torch tensor, got {type(buf).__name__}")
    if arr.dtype not in _DTYPE_CODE:
        raise TypeError(f"mcallreduce: unsupported dtype {arr.dtype.name}; supported: {', '.join(DTYPES)}")
    if not arr.flags.c_contiguous:
        raise ValueError("mcallreduce: buffer is not contiguous; pass np.ascontiguousarray(buf)")
    if not arr.flags.writeable:
        raise ValueError("mcallreduce: buffer is read-only")
    return arr.reshape(-1)


# ---------------------------------------------------------------------------- shared memory

class SharedWindow:
    """The MPI shared-memory window of a single-host communicator: p slots and a result area.

    Created collectively with the library's duplicate of the communicator, kept for the
    life of the process, freed at exit (before mpi4py finalizes MPI). The window is
    locked once for passive-target access; ``sync`` (MPI_Win_sync) orders this rank's
    loads and stores against the messages that tell peers a slot is ready.
    """

    def __init__(self, comm: MPI.Comm, slot_bytes: int):
        self.nranks, self.rank = comm.Get_size(), comm.Get_rank()
        self.slot_bytes = -(-slot_bytes // _shared.ALIGN) * _shared.ALIGN
        total = _shared.areas(self.nranks) * self.slot_bytes
        # rank 0 allocates the whole window, so the slots are one contiguous mapping
        self.win = MPI.Win.Allocate_shared(total if self.rank == 0 else 0, 1, comm=comm)
        base, _ = self.win.Shared_query(0)
        self.mem = np.frombuffer(base, dtype=np.uint8, count=total)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        atexit.register(self.free)

    @classmethod
    def create(cls, comm: MPI.Comm, slot_bytes: int) -> Optional["SharedWindow"]:
        """A window when every rank of ``comm`` shares this host's memory, else None (collective)."""
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        together = node.Get_size() == comm.Get_size()
        node.Free()
        if not together or slot_bytes <= 0 or comm.Get_size() < 2:
            return None
        return cls(comm, slot_bytes)

    def areas(self, dtype: np.dtype, nelem: int) -> List[np.ndarray]:
        """Every rank's slot, then the result area, as ``nelem`` elements of ``dtype``."""
        return [np.frombuffer(self.mem, dtype=dtype, count=nelem, offset=i * self.slot_bytes)
                for i in range(_shared.areas(self.nranks))]

    def sync(self) -> None:
        self.win.Sync()

    def free(self) -> None:
        if self.win is not None and not MPI.Is_finalized():
            self.win.Unlock_all()
            self.win.Free()
        self.win = None


# ---------------------------------------------------------------------------- context

class Context:
    """Library state for one communicator: duplicated comms, host layout, engine."""

    _cache: Dict[int, "Context"] = {}
    _lock = threading.Lock()

    def __init__(self, comm: MPI.Comm, config: Config):
        self.comm = comm.Dup()   # data messages of the schedules
        self.ctl = comm.Dup()    # metadata checks, posted in call order on every rank
        self.coll = comm.Dup()   # "mpi" collectives, started when their check completes
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.hosts = self._hosts(comm, config.ranks_per_host)
        # one host: multicolor's local stages through shared memory (mcallreduce/shared.py),
        # and every call's metadata check is a point-to-point exchange (engine.py says why)
        self.shared = SharedWindow.create(self.comm, config.shm_bytes) if len(self.hosts) == 1 else None
        self.engine = Engine(self)
        self._plans: Dict[tuple, Plan] = {}
        self.submit_lock = threading.Lock()   # allreduces get their sequence number in call order
        self._seq = 0
        # TAG_UB is an attribute of COMM_WORLD only (MPI-3.1 §8.1.2); Split comms lack it.
        tag_ub = self.comm.Get_attr(MPI.TAG_UB) or MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self.windows = max(1, (tag_ub + 1) // TAG_SPAN)

    @classmethod
    def get(cls, comm: Optional[MPI.Comm] = None) -> "Context":
        key = 0 if comm is None else comm.py2f()   # 0: COMM_WORLD, the common case
        ctx = cls._cache.get(key)
        if ctx is None:
            with cls._lock:
                ctx = cls._cache.get(key)
                if ctx is None:
                    ctx = Context(MPI.COMM_WORLD if comm is None else comm, _config.current())
                    cls._cache[key] = ctx
                    if comm is None:
                        cls._cache[MPI.COMM_WORLD.py2f()] = ctx
        return ctx

    def plan(self, config: Config, nelem: int, dtype: np.dtype, op: str, pre: float, post: float) -> "Plan":
        """Everything about an allreduce that depends only on its arguments, memoised:
        a training loop repeats a few bucket sizes, and this keeps their calls cheap."""
        key = (config, nelem, dtype, op, pre, post)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 4096:
                self._plans.clear()
            plan = self._plans[key] = Plan(self, config, nelem, dtype, op, pre, post)
            if config.verbose and self.rank == 0:   # once per new kind of call, not per call
                what = plan.schedule.describe() if plan.schedule is not None else plan.algorithm
                if plan.params.shared:
                    what = f"{plan.algorithm}(colors={plan.params.colors}, shared memory)"
                print(f"mcallreduce: {nelem} x {dtype} {op} on {self.size} ranks / {len(self.hosts)} hosts "
                      f"-> {what}", file=sys.stderr, flush=True)
        return plan

    @staticmethod
    def _hosts(comm: MPI.Comm, ranks_per_host: Optional[int]) -> List[List[int]]:
        size = comm.Get_size()
        if ranks_per_host:
            return [list(range(s, min(s + ranks_per_host, size))) for s in range(0, size, ranks_per_host)]
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        leader = node.bcast(comm.Get_rank(), root=0)
        node.Free()
        leaders = comm.allgather(leader)
        hosts: Dict[int, List[int]] = {}
        for rank, lead in enumerate(leaders):
            hosts.setdefault(lead, []).append(rank)
        return [hosts[k] for k in sorted(hosts)]

    def release_shared(self) -> None:
        """Free the shared-memory window now (collective); later calls run without it."""
        if self.shared is not None:
            self.shared.free()
            self.shared = None
            self._plans.clear()   # plans made for the window's slots

    def next_seq(self) -> int:
        seq, self._seq = self._seq, self._seq + 1
        return seq


class Plan:
    """Algorithm, parameters, schedule and metadata vector of one kind of allreduce."""

    def __init__(self, ctx: Context, config: Config, nelem: int, dtype: np.dtype, op: str,
                 pre: float, post: float):
        slot = ctx.shared.slot_bytes if ctx.shared is not None else 0
        self.algorithm, self.params = resolve(config, nelem * dtype.itemsize, dtype.itemsize, ctx.hosts, slot)
        self.post = post / ctx.size if op == "average" else post
        self.schedule: Optional[Schedule] = None
        if self.algorithm != "mpi" and not self.params.shared:
            self.schedule = build_schedule(self.algorithm, ctx.hosts, nelem, self.params)
            if self.schedule.max_tag >= MAX_SCHEDULE_TAGS:
                raise ValueError(f"mcallreduce: {self.schedule.max_tag + 1} messages per rank pair exceed "
                                 f"{MAX_SCHEDULE_TAGS}; use a larger MCALLREDUCE_SEGMENT_BYTES")
        self.meta: Optional[np.ndarray] = None
        if config.check or self.params.shared:   # the shared stage's first sync carries it anyway
            scale_key = hash((float(pre), float(post))) & ((1 << 40) - 1)
            self.meta = _meta_vector(ctx.rank, nelem, dtype, self.algorithm, op, self.params, scale_key, 0)
        # _shared_now's window views, meta buffers and peers, made on its first use
        self.areas: Optional[List[np.ndarray]] = None
        self.metas: Optional[np.ndarray] = None
        self.metas_ok, self.peers = b"", []


# ---------------------------------------------------------------------------- one allreduce

class Handle:
    """An allreduce in flight. ``test()`` progresses without blocking; ``wait()`` finishes it."""

    def __init__(self, ctx: Context, result: Any, arr: np.ndarray, algorithm: str,
                 schedule: Optional[Schedule], op: str, meta: Optional[np.ndarray], pre: float, post: float,
                 local_error: Optional[BaseException], shared: bool = False):
        self.ctx, self.result, self.arr, self.algorithm = ctx, result, arr, algorithm
        self.shared = shared   # multicolor's single-host stages through the shared window
        self.schedule, self.op, self.pre, self.post = schedule, op, pre, post
        self.error: Optional[BaseException] = None
        self._local_error = local_error
        self._done = False
        # Only a progress thread signals completion; caller-driven handles need no event.
        self._event = threading.Event() if ctx.engine.threaded else None
        self._meta = meta
        self._meta_out = None if meta is None else np.empty_like(meta)
        self._pending = 0       # requests of the current check or sync still outstanding
        self._metas: Optional[np.ndarray] = None   # every rank's meta (point-to-point check)
        self._areas: Optional[List[np.ndarray]] = None   # the shared window's slots and result
        self.seq = ctx.next_seq()
        ctx.engine.submit(self)

    # -- user API
    def test(self) -> bool:
        """True when finished (raises the allreduce's error, if any)."""
        if not self._done:
            self.ctx.engine.progress(block=False)
        if self._done and self.error is not None:
            raise self.error
        return self._done

    def wait(self) -> Any:
        """Finish the allreduce and return the result buffer (raises its error, if any)."""
        while not self._done:
            self.ctx.engine.progress(block=True, until=self)
        if self.error is not None:
            raise self.error
        return self.result

    @property
    def done(self) -> bool:
        return self._done

    # -- engine side
    def _check_meta(self) -> None:
        """Turn the allreduced metadata into an error raised on every rank, or None."""
        if self._local_error is None and self._meta_out.tobytes() == self._meta.tobytes():
            self.error = None   # MAX of every rank's [x, -x] is ours: all ranks sent the same
            return
        self.error = _mismatch(self._meta_out, self._local_error)

    def _begin(self) -> None:
        """Called once the metadata check passed: only now may the buffer change."""
        scale_(self.arr, self.pre)

    def _prescale(self, copy: np.ndarray) -> None:
        """The shared stage prescales its copy in the window instead (before the check)."""
        scale_(copy, self.pre)

    def _finish(self) -> None:
        if self.error is None:
            scale_(self.arr, self.post)
        self._done = True
        if self._event is not None:
            self._event.set()


def _mismatch(meta_out: np.ndarray, local_error: Optional[BaseException]) -> Optional[BaseException]:
    """The error every rank raises for the MAX-reduced metadata ``meta_out``, or None."""
    n = len(meta_out) // 2
    high, low = meta_out[:n], -meta_out[n:]
    reject_rank, reason = int(-meta_out[n]), int(high[0])
    if reason:  # some rank rejected its own arguments before the exchange
        return local_error or MismatchError(
            f"mcallreduce: rank {reject_rank} rejected the allreduce "
            f"({_REJECT_REASONS.get(reason, 'error')}); see that rank's error")
    for i, name in enumerate(_CHECK_FIELDS):
        if high[i + 1] != low[i + 1]:
            return MismatchError(
                f"mcallreduce: {name} differs across ranks (from {low[i + 1]} to {high[i + 1]}); "
                "every rank must pass the same element count and dtype and use the same MCALLREDUCE_* settings")
    return None


def _shared_now(ctx: Context, arr: np.ndarray, plan: Plan, op: str, pre: float, seq: int) -> None:
    """A blocking shared-memory allreduce while the engine is idle: the engine's shared path
    (publish, sync 1 = the check, reduce, sync 2, collect) without a handle or request
    bookkeeping. At 4 KiB the Python around the copies is most of a call's time."""
    win, rank, comm = ctx.shared, ctx.rank, ctx.comm
    if plan.areas is None:
        plan.areas = win.areas(arr.dtype, arr.size)
        plan.metas = np.empty((ctx.size, plan.meta.size), np.int64)
        plan.metas[rank] = plan.meta
        plan.metas_ok = np.tile(plan.meta, ctx.size).tobytes()
        plan.peers = [q for q in range(ctx.size) if q != rank]
    areas, metas, peers = plan.areas, plan.metas, plan.peers
    scale = None if pre == 1.0 else (lambda copy: scale_(copy, pre))
    _shared.publish(arr, areas[rank], rank, ctx.size, scale)
    win.sync()
    tag = (seq % ctx.windows) * TAG_SPAN
    reqs = [comm.Irecv(metas[q], q, tag + META_TAG) for q in peers]
    reqs += [comm.Isend(plan.meta, q, tag + META_TAG) for q in peers]
    MPI.Request.Waitall(reqs)
    if metas.tobytes() != plan.metas_ok:
        error = _mismatch(metas.max(axis=0), None)
        if error is not None:
            raise error
    win.sync()
    _shared.reduce_color(_shared.sources(areas[:-1], arr, rank, scale is not None), areas[-1], rank, OPS[op][0])
    win.sync()
    reqs = [comm.Irecv(SYNC_PAYLOAD, q, tag + SYNC_TAG) for q in peers]
    reqs += [comm.Isend(SYNC_PAYLOAD, q, tag + SYNC_TAG) for q in peers]
    MPI.Request.Waitall(reqs)
    win.sync()
    _shared.collect(arr, areas[-1])
    scale_(arr, plan.post)


def _meta_vector(rank: int, nelem: int, dtype: np.dtype, algorithm: str, op: str, params: Params,
                 scale_key: int, reject: int) -> np.ndarray:
    fields = [reject, nelem, _DTYPE_CODE.get(dtype, 0), _ALGO_CODE.get(algorithm, 0), _OP_CODE.get(op, 0),
              params.colors, params.segment, params.fanout or 0, int(params.hierarchical), params.depth,
              int(params.shared), scale_key, _ROUTE_CODE.get(params.route, 0)]
    vec = np.array(fields, dtype=np.int64)
    # MAX over [x, -x] yields max and min of every field in one allreduce; slot n carries
    # the lowest rejecting rank (as -rank) so every rank can name it.
    neg = -vec
    neg[0] = -rank if reject else -(1 << 62)
    return np.concatenate([vec, neg])


# ---------------------------------------------------------------------------- public API

def allreduce_async(buf: Any, op: str = "sum", prescale: float = 1.0, postscale: float = 1.0,
                    comm: Optional[MPI.Comm] = None, algorithm: Optional[str] = None, out: Any = None,
                    check: Optional[bool] = None, **overrides) -> Handle:
    """Start an allreduce of ``buf`` over ``comm``; returns a :class:`Handle`.

    In place unless ``out`` is given. ``op`` is sum, average, min, max or product;
    average is ``sum(prescale * x) * postscale / size`` (Horovod's definition).
    Every rank must call with the same element count and dtype, in the same order
    relative to its other allreduces on ``comm`` (as for any MPI collective).
    ``overrides`` (colors=, segment_bytes=, fanout=, hierarchy=, route=, depth=) take
    precedence over the ``MCALLREDUCE_*`` environment.
    """
    return _submit(buf, op, prescale, postscale, comm, algorithm, out, check, overrides, False)


def _submit(buf: Any, op: str, prescale: float, postscale: float, comm: Optional[MPI.Comm],
            algorithm: Optional[str], out: Any, check: Optional[bool], overrides: Dict[str, Any],
            blocking: bool) -> Any:
    """A Handle, or, for ``blocking`` calls that run at once, the result."""
    ctx = Context.get(comm)
    config = _config.current().with_overrides(algorithm=algorithm, check=check, **overrides)
    result = out if out is not None else buf
    try:
        if config.algorithm not in ALGORITHMS:
            raise ConfigError(f"mcallreduce: unknown algorithm {config.algorithm!r}; "
                              f"allowed values are {', '.join(ALGORITHMS)}")
        if op not in OPS:
            raise ConfigError(f"mcallreduce: unknown op {op!r}; allowed values are {', '.join(OPS)}")
        src = as_array(buf)
        if out is not None:
            arr = as_array(out)
            if arr.size != src.size or arr.dtype != src.dtype:
                raise ValueError(f"mcallreduce: out has {arr.size} x {arr.dtype}, buf has {src.size} x {src.dtype}")
            arr[...] = src
        else:
            arr = src
        plan = ctx.plan(config, arr.size, arr.dtype, op, prescale, postscale)
    except (TypeError, ValueError) as exc:
        if not config.check:
            raise
        # Still take part in the metadata exchange, so every other rank raises too.
        reject = 2 if isinstance(exc, ConfigError) else 1
        meta = _meta_vector(ctx.rank, 0, None, config.algorithm, op, Params(), 0, reject)
        with ctx.submit_lock:
            return Handle(ctx, result, np.zeros(0, np.float32), config.algorithm, None, op, meta, 1.0, 1.0, exc)
    if blocking and plan.params.shared:
        # Same lock order as a Handle's submission; not blocking on the engine's lock,
        # which a progress thread holds for its whole life.
        with ctx.submit_lock:
            if ctx.engine.lock.acquire(blocking=False):
                try:
                    if ctx.engine.idle:
                        _shared_now(ctx, arr, plan, op, prescale, ctx.next_seq())
                        return result
                finally:
                    ctx.engine.lock.release()
    with ctx.submit_lock:
        return Handle(ctx, result, arr, plan.algorithm, plan.schedule, op, plan.meta, prescale, plan.post, None,
                      plan.params.shared)


def start_progress_thread(comm: Optional[MPI.Comm] = None) -> None:
    """Progress allreduces on ``comm`` in a background thread from now on.

    Communication then overlaps whatever the caller does between starting an
    allreduce and waiting for it (e.g. the rest of the backward pass). Needs
    MPI_THREAD_MULTIPLE; collective (call it on every rank of ``comm``); idempotent.
    """
    Context.get(comm).engine.start_thread()


def allreduce(buf: Any, op: str = "sum", prescale: float = 1.0, postscale: float = 1.0,
              comm: Optional[MPI.Comm] = None, algorithm: Optional[str] = None, out: Any = None,
              check: Optional[bool] = None, **overrides) -> Any:
    """Allreduce ``buf`` over ``comm`` (default COMM_WORLD); returns the result buffer.

    See :func:`allreduce_async` for the arguments. Raises on every rank if the
    ranks disagree on the element count, dtype or configuration.
    """
    started = _submit(buf, op, prescale, postscale, comm, algorithm, out, check, overrides, True)
    return started.wait() if isinstance(started, Handle) else started
