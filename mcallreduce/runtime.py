"""The MPI runtime: the public allreduce API over mpi4py.

One :class:`Context` per user communicator owns three duplicates of it (data, checks
and MPI's own collectives never mix with the user's messages), the host layout, the
one-host shared-memory window and one :class:`~mcallreduce.engine.Engine`. A call
becomes a :class:`Plan` (memoised per kind of call: algorithm, schedule lowered for the
compiled executor, metadata vector) plus the buffer, and the engine runs it.
"""
from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
from typing import Any, Dict, List, Optional

import numpy as np
from mpi4py import MPI

from . import _executor, hostlayout, mpit
from . import config as _config
from .algorithms import build_schedule
from .config import MPI_ALGORITHMS, Config, ConfigError
from .engine import MAX_SCHEDULE_TAGS, TAG_SPAN, Engine, Handle
from .gpu import Staging, StagingError, is_gpu_buffer
from .lowering import EARLY_MAX_BYTES, early_steps, lower
from .memory import SharedWindow, as_array
from .check import DTYPE_CODE, DTYPES, FIELDS, OP_CODE, REJECT_BUFFER, REJECT_CONFIG, mismatch, vector
from .policy import ALGORITHMS, ROUTES, fused_with_check, measured_nonblocking, resolve, table_problem
from .schedule import Schedule

__all__ = ["Context", "Handle", "allreduce", "allreduce_async", "start_progress_thread", "OPS", "DTYPES"]

OPS = tuple(OP_CODE)   # sum, average, min, max, product
_ALGO_CODE = {name: i + 1 for i, name in enumerate(ALGORITHMS)}
_ROUTE_CODE = {name: i + 1 for i, name in enumerate(ROUTES)}
#: the metadata check's stage field, by the plan's kind (0: no one-host stage)
_FUSED_KINDS = (_executor.KIND_FUSED_DOUBLING, _executor.KIND_FUSED_HALVING)
_STAGE_CODE = {_executor.KIND_SHARED: 1, _executor.KIND_SINGLE_COPY: 2, _executor.KIND_SHARED_ONE_SYNC: 3}
_MAX_MESSAGE_BYTES = (1 << 31) - 1   # the executor posts byte counts as C ints
_MAX_MPI_COUNT = (1 << 31) - 1       # and MPI's own allreduce element counts
_MPI_DTYPES = tuple(np.dtype(t) for t in ("float32", "float64", "int32", "int64"))   # where MPI's results are numpy's


class Context:
    """Library state for one communicator: duplicated comms, host layout, window, engine."""

    _cache: Dict[int, "Context"] = {}   # by the communicator's handle, which MPI reuses once it is freed
    _lock = threading.Lock()
    _keyval: Optional[int] = None       # an attribute whose deletion (MPI_Comm_free) forgets the handle

    def __init__(self, comm: MPI.Comm, config: Config):
        if comm == MPI.COMM_NULL:
            raise ValueError("mcallreduce: comm is MPI.COMM_NULL (a rank outside a Split's or Create's group)")
        if comm.Is_inter():   # the schedules and MPI_Comm_split_type need one group (an intercomm crashed there)
            raise TypeError("mcallreduce: an intercommunicator has no allreduce here; Merge() it first")
        # a table that one rank cannot follow fails every rank now, not the first call on that rank alone
        problems = [(r, p) for r, p in enumerate(comm.allgather(table_problem(config))) if p]
        if problems:
            raise ConfigError("; ".join(f"rank {r}: {p}" for r, p in problems[:4]))
        self.comm = comm.Dup()   # data messages of the schedules
        self.ctl = comm.Dup()    # metadata checks, posted in call order on every rank
        self.coll = comm.Dup()   # "mpi" collectives, started in call order once checked
        # "mpi-ring": Open MPI's ring allreduce on a communicator of its own (None: unavailable
        # on some rank, and "mpi-ring" runs as "mpi" on every rank)
        self.coll_ring = mpit.forced_comm(comm, "ring")
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.config = config     # the environment when the context was made
        self.hosts = hostlayout.hosts(comm, config.ranks_per_host)
        # one host: multicolor's local stages through shared memory (native/shared_stage.c)
        self.shared = (SharedWindow.create(self.comm, config.shm_bytes, config.one_sync_bytes)
                       if len(self.hosts) == 1 else None)
        # TAG_UB is an attribute of COMM_WORLD only (MPI-3.1 §8.1.2); Split comms lack it.
        tag_ub = self.comm.Get_attr(MPI.TAG_UB) or MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self.windows = max(1, (tag_ub + 1) // TAG_SPAN)   # allreduces in flight at most
        self.engine = Engine(self)
        self.closed = False
        atexit.register(self.close)   # before the window is freed and MPI finalized
        if self.shared is not None:
            self.engine.set_window(self.shared.win, self.shared.address, self.shared.slot_bytes,
                                   self.shared.small_bytes)
        self.single_copy = self.shared is not None and self._peers_readable()
        self._plans: Dict[tuple, Plan] = {}
        self.calls: Dict[tuple, Plan] = {}    # the fast path's plans, by call arguments
        self._bases: List[Config] = []        # the configs behind its keys' ids, kept alive
        self.submit_lock = threading.Lock()   # allreduces get their sequence number in call order
        self.next_seq = itertools.count().__next__   # atomic under the GIL, whichever lock is held

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
                    if comm is not None and comm != MPI.COMM_WORLD and comm != MPI.COMM_SELF:   # never freed
                        cls._forget_when_freed(comm, key, ctx)
                    if comm is None:
                        cls._cache[MPI.COMM_WORLD.py2f()] = ctx
        return ctx

    @classmethod
    def _forget_when_freed(cls, comm: MPI.Comm, key: int, ctx: "Context") -> None:
        """Drop the cache entry when ``comm`` is freed: a communicator made later may get the same
        handle, and must not find this context (whose communicators span the freed one's group).
        The attribute names its context: replacing it (a new context after a close) drops only the old."""
        if cls._keyval is None:
            cls._keyval = MPI.Comm.Create_keyval(delete_fn=lambda _comm, _keyval, value: cls._forget(*value))
        comm.Set_attr(cls._keyval, (key, ctx))

    @classmethod
    def _forget(cls, key: int, ctx: "Context") -> None:
        if cls._cache.get(key) is ctx:
            del cls._cache[key]

    def plan(self, config: Config, nelem: int, dtype: np.dtype, op: str, pre: float, post: float,
             nonblocking: bool = False) -> "Plan":
        """Everything about an allreduce that depends only on its arguments, memoised:
        a training loop repeats a few bucket sizes, and this keeps their calls cheap.
        ``nonblocking``: ``allreduce_async``'s call, which a table may decide otherwise."""
        key = (config, nelem, dtype, op, pre, post, nonblocking)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 4096:
                self._plans.clear()
            plan = self._plans[key] = Plan(self, config, nelem, dtype, op, pre, post, nonblocking)
            if config.verbose and self.rank == 0:   # once per new kind of call, not per call
                what = plan.schedule.describe() if plan.schedule is not None else plan.algorithm
                if plan.algorithm in MPI_ALGORITHMS and plan.schedule is not None:
                    what = f"{plan.algorithm} (where a rank cannot block: {what})"
                if plan.params.shared:
                    copy = ", single copy" if plan.params.single_copy else ", one sync" if plan.params.one_sync else ""
                    what = f"{plan.algorithm}(colors={plan.params.colors}, shared memory{copy})"
                print(f"mcallreduce: {nelem} x {dtype} {op} on {self.size} ranks / {len(self.hosts)} hosts "
                      f"-> {what}", file=sys.stderr, flush=True)
        return plan

    def _peers_readable(self) -> bool:
        """Whether every rank can read every peer's memory (Linux CMA: process_vm_readv, which
        ptrace rules and containers may forbid), as the single-copy stage does; collective."""
        probe = np.array([(self.rank + 1) * 7919], np.int64)
        peers = self.comm.allgather((os.getpid(), probe.ctypes.data))
        ok = all(self.engine.native.probe_copy(pid, address) == (0, (q + 1) * 7919)
                 for q, (pid, address) in enumerate(peers) if q != self.rank)
        return bool(self.comm.allreduce(int(ok), op=MPI.MIN))   # probe stays alive until every rank read it

    def close(self) -> None:
        """Leave (every rank, at exit or hvd.shutdown()): the engine says goodbye to the peers,
        so their calls that this rank never started fail instead of waiting; the next
        ``Context.get`` for this communicator builds a new context (collectively)."""
        if self.closed:
            return
        self.closed = True
        for key in [k for k, ctx in Context._cache.items() if ctx is self]:
            del Context._cache[key]
        self.engine.close()

    def release_shared(self) -> None:
        """Free the shared-memory window now (collective; after :meth:`close`)."""
        if self.shared is not None:
            self.engine.set_window(None, 0, 0, 0)
            self.shared.free()
            self.shared = None
            self.single_copy = False   # its stage publishes through the window too
            self._plans.clear()   # plans made for the window's slots
            self.calls.clear()

    def remember(self, key: tuple, base: Config, plan: "Plan") -> None:
        """Keep ``plan`` for the fast path; ``key`` names ``base`` by id, so base stays alive."""
        if len(self.calls) > 4096:
            self.calls.clear()
            self._bases.clear()
        if not any(b is base for b in self._bases):
            self._bases.append(base)
        self.calls[key] = plan


class Plan:
    """One kind of allreduce, resolved: algorithm, parameters, the lowered schedule, and
    the executor's arguments that do not change from call to call."""

    def __init__(self, ctx: Context, config: Config, nelem: int, dtype: np.dtype, op: str,
                 pre: float, post: float, nonblocking: bool = False):
        slot, small = (ctx.shared.slot_bytes, ctx.shared.small_bytes) if ctx.shared is not None else (0, 0)
        op = _logical(op, pre, post) if dtype == np.bool_ else op
        # MPI has no float16, takes element counts as C ints (Open MPI 4.1 has no large-count calls), and
        # its vector sums of 8- and 16-bit integers saturate where numpy's wrap (docs/algorithms.md, "mpi")
        mpi_type = dtype in _MPI_DTYPES and nelem <= _MAX_MPI_COUNT
        direct = ctx.single_copy and pre == 1.0   # a prescaled copy needs the window's slots
        self.algorithm, self.params = resolve(config, nelem * dtype.itemsize, dtype.itemsize, ctx.hosts, slot,
                                              mpi_type=mpi_type, single_copy_ok=direct,
                                              mpi_ring=ctx.coll_ring is not None, small_slot=small,
                                              nonblocking=nonblocking)
        self.schedule: Optional[Schedule] = None
        self.program = None
        if self.params.one_sync:
            self.kind = _executor.KIND_SHARED_ONE_SYNC
        elif self.params.single_copy:
            self.kind = _executor.KIND_SINGLE_COPY
        elif self.params.shared:
            self.kind = _executor.KIND_SHARED
        elif fused_with_check(self.algorithm, nelem * dtype.itemsize):
            # reduced along its own metadata check, which then costs nothing: check or not, the fastest path
            self.kind = _executor.KIND_FUSED_DOUBLING if self.algorithm == "doubling" else _executor.KIND_FUSED_HALVING
        elif self.algorithm in MPI_ALGORITHMS:
            if dtype not in _MPI_DTYPES:
                raise TypeError(f"mcallreduce: algorithm {self.algorithm!r} reduces only "
                                f"{', '.join(t.name for t in _MPI_DTYPES)}, not {dtype.name}; use multicolor or ring")
            if not mpi_type:
                raise ValueError(f"mcallreduce: algorithm {self.algorithm!r} takes at most {_MAX_MPI_COUNT} elements "
                                 f"(MPI's counts are C ints), not {nelem}; use multicolor or ring")
            self.kind = _executor.KIND_MPI_RING if self.algorithm == "mpi-ring" else _executor.KIND_MPI
            if config.algorithm not in MPI_ALGORITHMS and not (nonblocking and measured_nonblocking(config, ctx.hosts)):
                # a blocking table's pick, run where every rank can wait for it alone; elsewhere the row's
                # "instead" (or the rules') runs: the table did not time MPI_Iallreduce (docs/algorithms.md, "mpi")
                self._lower(ctx, *resolve(config, nelem * dtype.itemsize, dtype.itemsize, ctx.hosts, mpi_type=False),
                            nelem, dtype)
        else:
            self.kind = _executor.KIND_SCHEDULE
            self._lower(ctx, self.algorithm, self.params, nelem, dtype)
        self.meta: Optional[np.ndarray] = None
        self.check = _executor.CHECK_OFF
        if config.check or self.params.shared or self.kind in _FUSED_KINDS:   # these carry it anyway
            self.check = _executor.CHECK_ON
            scale_key = hash((float(pre), float(post))) & ((1 << 40) - 1)
            p = self.params
            self.meta = vector(ctx.rank, 0, (
                nelem, DTYPE_CODE[dtype], _ALGO_CODE[self.algorithm], OP_CODE[op], p.colors, p.segment,
                p.fanout or 0, int(p.hierarchical), p.depth, _STAGE_CODE.get(self.kind, 0), scale_key,
                _ROUTE_CODE.get(p.route, 0)))
        post = post / ctx.size if op == "average" else post
        self.template = _executor.Template(self.kind, self.program, DTYPE_CODE[dtype], OP_CODE[op], post,
                                           self.meta, self.check)

    def _lower(self, ctx: Context, algorithm: str, params, nelem: int, dtype: np.dtype) -> None:
        """This rank's part of the schedule, lowered for the executor."""
        self.schedule = build_schedule(algorithm, ctx.hosts, nelem, params)
        done_tag = self.schedule.max_tag + 1
        if done_tag >= MAX_SCHEDULE_TAGS:
            raise ValueError(f"mcallreduce: {done_tag + 1} messages per rank pair exceed "
                             f"{MAX_SCHEDULE_TAGS}; use a larger MCALLREDUCE_SEGMENT_BYTES")
        mine = self.schedule.programs[ctx.rank]
        if max((s.count for s in mine.steps), default=0) * dtype.itemsize > _MAX_MESSAGE_BYTES:
            raise ValueError("mcallreduce: a message of over 2 GiB; set MCALLREDUCE_SEGMENT_BYTES")
        low = lower(mine, done_tag, early_steps(self.schedule, ctx.rank, EARLY_MAX_BYTES // dtype.itemsize))
        self.program = _executor.Program(low.steps, low.dep_ptr, low.dependents, low.scratch_elems)



def _logical(op: str, pre: float, post: float) -> str:
    """A bool's op as the executor runs it on bytes of 0 and 1: sum is or (max), product is and
    (min), as numpy's and gloo's are; an average or a scale factor has no bool result."""
    if op == "average" or pre != 1.0 or post != 1.0:
        raise TypeError(f"mcallreduce: a bool allreduce takes sum, product, min or max and no scale factors, "
                        f"not {op!r} with prescale {pre} and postscale {post}")
    return {"sum": "max", "product": "min"}.get(op, op)


def _rejected(ctx: Context, exc: BaseException):
    """The executor's template of a call this rank rejected: it still takes part in the
    check, so every other rank raises too."""
    reject = REJECT_CONFIG if isinstance(exc, ConfigError) else REJECT_BUFFER
    meta = vector(ctx.rank, reject, (0,) * (len(FIELDS)))
    return _executor.Template(_executor.KIND_CHECK_ONLY, None, DTYPE_CODE[np.dtype(np.float32)], OP_CODE["sum"],
                              1.0, meta, _executor.CHECK_ON)


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
    base = _config.current()
    arr = buf
    # The common call (a contiguous 1-D numpy array, in place, no overrides) finds its plan in
    # one lookup: a 4 KiB allreduce is a few microseconds, and Python is most of them.
    if type(buf) is np.ndarray and out is None and not overrides and buf.flags.carray:   # as allreduce()'s check
        key = _call_key(base, algorithm, check, buf, op, prescale, postscale, blocking)
        plan = ctx.calls.get(key)
    else:
        plan = key = None
    result = out if out is not None else buf
    staging = None
    if plan is None:
        config = None
        try:
            config = base.with_overrides(algorithm=algorithm, check=check, **overrides)
            if config.algorithm not in ALGORITHMS:
                raise ConfigError(f"mcallreduce: unknown algorithm {config.algorithm!r}; "
                                  f"allowed values are {', '.join(ALGORITHMS)}")
            if op not in OP_CODE:
                raise ConfigError(f"mcallreduce: unknown op {op!r}; allowed values are {', '.join(OPS)}")
            if is_gpu_buffer(buf) or is_gpu_buffer(out):
                staging = Staging(buf, out)
                arr = staging.host
            else:
                arr = _host_array(buf, out)
            plan = ctx.plan(config, arr.size, arr.dtype, op, prescale, postscale, nonblocking=not blocking)
        except (TypeError, ValueError, StagingError) as exc:
            if staging is not None:    # staged, then the plan failed: nothing was sent
                staging.abandon()
            checked = config.check if config is not None else (base.check if check is None else check)
            if not checked:
                raise
            with ctx.submit_lock:
                return ctx.engine.submit(ctx.next_seq(), result, _rejected(ctx, exc), np.zeros(0, np.float32), 1.0,
                                         mismatch, exc)
        if key is not None:
            ctx.remember(key, base, plan)
    engine = ctx.engine
    with ctx.submit_lock:
        if blocking:
            try:
                ran = engine.run_if_idle(ctx.next_seq, plan.template, arr, prescale, mismatch)
            except BaseException as exc:
                if staging is not None:
                    staging.finish(exc)
                raise
            if ran:
                error = staging.finish(None, on_callers_stream=True) if staging is not None else None
                if error is not None:
                    raise error
                return result
        return engine.submit(ctx.next_seq(), result, plan.template, arr, prescale, mismatch,
                             finisher=staging.finish if staging is not None else None)


def _call_key(base: Config, algorithm: Optional[str], check: Optional[bool], buf: np.ndarray, op: str,
              prescale: float, postscale: float, blocking: bool) -> tuple:
    """A repeated call's plan key, for a contiguous numpy array reduced in place with no overrides;
    ``base`` is named by id (Context.remember keeps it alive)."""
    # the dtype itself, not its char: a big-endian float32 has the same char as a native one
    return id(base), algorithm, check, buf.size, buf.dtype, op, prescale, postscale, blocking


def _host_array(buf: Any, out: Any) -> np.ndarray:
    """The array the executor reduces in place: ``buf``'s, or ``out``'s holding a copy of it."""
    src = as_array(buf)
    if out is None:
        return src
    arr = as_array(out)
    if arr.size != src.size or arr.dtype != src.dtype:
        raise ValueError(f"mcallreduce: out has {arr.size} x {arr.dtype}, buf has {src.size} x {src.dtype}")
    arr[...] = src
    return arr


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
    # The common call, a numpy array reduced in place while nothing else is in flight, in as
    # few Python steps as possible: at 4 KiB they are most of the call's time.
    if type(buf) is np.ndarray and out is None and not overrides:
        ctx = Context._cache.get(0 if comm is None else comm.py2f()) or Context.get(comm)
        plan = ctx.calls.get(_call_key(_config.current(), algorithm, check, buf, op, prescale, postscale, True))
        if plan is not None and buf.flags.carray and \
                ctx.engine.run_if_idle(ctx.next_seq, plan.template, buf, prescale, mismatch):
            return buf
    started = _submit(buf, op, prescale, postscale, comm, algorithm, out, check, overrides, True)
    return started.wait() if isinstance(started, Handle) else started
