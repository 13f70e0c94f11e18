"""The MPI runtime: executes schedules with nonblocking mpi4py point-to-point calls.

One :class:`Context` per user communicator owns two duplicates of it (data and
control traffic never mix with the user's messages), the host layout, and one
progress :class:`Engine` that drives *all* allreduces in flight together. Waiting
on one handle therefore progresses the others too, so ranks that wait on their
handles in different orders cannot deadlock each other.

A step is posted as soon as the steps it depends on have completed: sends and
receives as ``Isend``/``Irecv`` on preallocated buffers, reductions as numpy
in-place ufuncs on the progress thread. The loop blocks in ``Waitsome`` (which
releases the GIL) and never spins in Python.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .algorithms import Params, build_schedule
from . import config as _config
from .config import ALGORITHMS, Config, ConfigError, resolve
from .errors import MismatchError
from .schedule import Op, Schedule

__all__ = ["Context", "Handle", "allreduce", "allreduce_async", "OPS", "DTYPES"]

#: reduction operators: name -> (numpy ufunc, MPI op); "average" is "sum" then a scale
OPS: Dict[str, Tuple[Callable, Any]] = {
    "sum": (np.add, MPI.SUM), "average": (np.add, MPI.SUM),
    "min": (np.minimum, MPI.MIN), "max": (np.maximum, MPI.MAX), "product": (np.multiply, MPI.PROD),
}
#: supported element types (numpy names)
DTYPES = ("float16", "float32", "float64", "int32", "int64")
_DTYPE_CODE = {np.dtype(name): i + 1 for i, name in enumerate(DTYPES)}
_ALGO_CODE = {name: i + 1 for i, name in enumerate(ALGORITHMS)}
_OP_CODE = {name: i + 1 for i, name in enumerate(OPS)}
_TAG_SPAN = 1 << 20          # tags per allreduce; the schedule's per-pair message count must fit
_CHECK_FIELDS = ("element count", "dtype", "algorithm", "op", "colors", "segment", "fanout",
                 "hierarchy", "pipeline depth", "scale factors")
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


def scale_(arr: np.ndarray, factor: float) -> None:
    """arr *= factor in place; integers are scaled in float64 and truncated, as Horovod does."""
    if factor == 1.0:
        return
    if arr.dtype.kind == "f":
        np.multiply(arr, arr.dtype.type(factor) if arr.dtype == np.float16 else factor, out=arr,
                    casting="unsafe")
    else:
        arr[...] = (arr.astype(np.float64) * factor).astype(arr.dtype)


# ---------------------------------------------------------------------------- context

class Context:
    """Library state for one communicator: duplicated comms, host layout, engine."""

    _cache: Dict[int, "Context"] = {}
    _lock = threading.Lock()

    def __init__(self, comm: MPI.Comm, config: Config):
        self.comm = comm.Dup()   # data messages of the schedules
        self.ctl = comm.Dup()    # metadata checks and "mpi" collectives
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.hosts = self._hosts(comm, config.ranks_per_host)
        self.engine = Engine(self)
        self._resolved: Dict[tuple, Tuple[str, Params]] = {}
        self._seq = 0
        tag_ub = self.comm.Get_attr(MPI.TAG_UB)
        self.windows = max(1, (tag_ub + 1) // _TAG_SPAN)

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

    def resolve(self, config: Config, nbytes: int, itemsize: int) -> Tuple[str, Params]:
        """resolve() memoised per (config, size): a training loop repeats a few sizes."""
        key = (config, nbytes, itemsize)
        hit = self._resolved.get(key)
        if hit is None:
            if len(self._resolved) > 4096:
                self._resolved.clear()
            hit = self._resolved[key] = resolve(config, nbytes, itemsize, self.hosts)
        return hit

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

    def next_seq(self) -> int:
        seq, self._seq = self._seq, self._seq + 1
        return seq


# ---------------------------------------------------------------------------- one allreduce

class Handle:
    """An allreduce in flight. ``test()`` progresses without blocking; ``wait()`` finishes it."""

    def __init__(self, ctx: Context, result: Any, arr: np.ndarray, algorithm: str,
                 schedule: Optional[Schedule], op: str, meta: np.ndarray, post: float,
                 local_error: Optional[BaseException]):
        self.ctx, self.result, self.arr, self.algorithm = ctx, result, arr, algorithm
        self.schedule, self.op, self.post = schedule, op, post
        self.error: Optional[BaseException] = None
        self._local_error = local_error
        self._done = False
        self._meta = meta
        self._meta_out = np.empty_like(meta)
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
        n = len(self._meta) // 2
        high, low = self._meta_out[:n], -self._meta_out[n:]
        reject_rank, reason = int(-self._meta_out[n]), int(high[0])
        if reason:  # some rank rejected its own arguments before the exchange
            self.error = self._local_error or MismatchError(
                f"mcallreduce: rank {reject_rank} rejected the allreduce "
                f"({_REJECT_REASONS.get(reason, 'error')}); see that rank's error")
            return
        for i, name in enumerate(_CHECK_FIELDS):
            if high[i + 1] != low[i + 1]:
                self.error = MismatchError(
                    f"mcallreduce: {name} differs across ranks (from {low[i + 1]} to {high[i + 1]}); "
                    "every rank must pass the same element count and dtype and use the same MCALLREDUCE_* settings")
                return

    def _finish(self) -> None:
        if self.error is None:
            scale_(self.arr, self.post)
        self._done = True


def _meta_vector(rank: int, nelem: int, dtype: np.dtype, algorithm: str, op: str, params: Params,
                 scale_key: int, reject: int) -> np.ndarray:
    fields = [reject, nelem, _DTYPE_CODE.get(dtype, 0), _ALGO_CODE.get(algorithm, 0), _OP_CODE.get(op, 0),
              params.colors, params.segment, params.fanout or 0, int(params.hierarchical), params.depth, scale_key]
    vec = np.array(fields, dtype=np.int64)
    # MAX over [x, -x] yields max and min of every field in one allreduce; slot n carries
    # the lowest rejecting rank (as -rank) so every rank can name it.
    neg = -vec
    neg[0] = -rank if reject else -(1 << 62)
    return np.concatenate([vec, neg])


# ---------------------------------------------------------------------------- engine

class Engine:
    """Progresses every allreduce of one context; all MPI calls happen under its lock."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.lock = threading.RLock()
        self.reqs: List[MPI.Request] = []
        self.owners: List[Tuple[Handle, int]] = []   # (handle, step index or -1 for the check)
        self.active: Dict[int, Handle] = {}          # seq % windows -> handle
        self._state: Dict[int, "_RunState"] = {}
        self._pool: Dict[Tuple[str, int], List[np.ndarray]] = {}  # reusable scratch areas

    def scratch(self, nelem: int, dtype: np.dtype) -> np.ndarray:
        """A scratch area from the pool: allreduces of recurring sizes allocate nothing."""
        free = self._pool.get((np.dtype(dtype).str, nelem))
        return free.pop() if free else np.empty(nelem, dtype=dtype)

    def _release(self, arr: np.ndarray) -> None:
        free = self._pool.setdefault((arr.dtype.str, arr.size), [])
        if len(free) < 4:
            free.append(arr)

    def submit(self, h: Handle) -> None:
        with self.lock:
            window = h.seq % self.ctx.windows
            if window in self.active:
                raise RuntimeError("mcallreduce: too many allreduces in flight "
                                   f"(at most {self.ctx.windows}); wait on older handles first")
            self.active[window] = h
            if h._meta is None:
                self._start(h)
            else:
                req = self.ctx.ctl.Iallreduce(h._meta, h._meta_out, op=MPI.MAX)
                self.reqs.append(req)
                self.owners.append((h, -1))

    def _start(self, h: Handle) -> None:
        if h.algorithm == "mpi":
            mpi_type = MPI._typedict.get(h.arr.dtype.char)
            if mpi_type is None:
                h.error = TypeError(f"mcallreduce: algorithm 'mpi' cannot reduce {h.arr.dtype.name} "
                                    "with this MPI library; use multicolor or ring")
                return self._retire(h)
            self.reqs.append(self.ctx.ctl.Iallreduce(MPI.IN_PLACE, [h.arr, mpi_type], op=OPS[h.op][1]))
            self.owners.append((h, -2))
            return
        state = _RunState(h, (h.seq % self.ctx.windows) * _TAG_SPAN)
        self._state[h.seq] = state
        self._post_ready(state)

    def _post_ready(self, st: "_RunState") -> None:
        comm, h = self.ctx.comm, st.handle
        steps, mem, scr = st.steps, st.mem, st.scr_mem
        isz = h.arr.itemsize
        while st.ready:
            i = st.ready.pop()
            s = steps[i]
            if s.op == Op.REDUCE:
                view = h.arr[s.offset:s.offset + s.count]
                st.ufunc(view, st.scratch[s.scratch:s.scratch + s.count], out=view)
                st.complete(i)
                continue
            if s.op == Op.SEND:
                req = comm.Isend([mem[s.offset * isz:(s.offset + s.count) * isz], MPI.BYTE], s.peer, st.tag0 + s.tag)
            elif s.op == Op.RECV:
                req = comm.Irecv([mem[s.offset * isz:(s.offset + s.count) * isz], MPI.BYTE], s.peer, st.tag0 + s.tag)
            else:
                req = comm.Irecv([scr[s.scratch * isz:(s.scratch + s.count) * isz], MPI.BYTE], s.peer,
                                 st.tag0 + s.tag)
            self.reqs.append(req)
            self.owners.append((h, i))
        if st.remaining == 0:
            del self._state[h.seq]
            self._release(st.scratch)
            self._retire(h)

    def _retire(self, h: Handle) -> None:
        self.active.pop(h.seq % self.ctx.windows, None)
        h._finish()

    def progress(self, block: bool, until: Optional[Handle] = None) -> None:
        """Post what is ready, then wait for (block) or test for (not block) completions."""
        with self.lock:
            if until is not None and until.done:
                return
            if not self.reqs:
                if self.active:
                    raise RuntimeError("mcallreduce: internal error, allreduce in flight with nothing posted")
                return
            if block:
                indices = MPI.Request.Waitsome(self.reqs)
            else:
                indices = MPI.Request.Testsome(self.reqs)
            if not indices:
                return
            finished = [self.owners[i] for i in indices]
            keep = set(range(len(self.reqs))) - set(indices)
            self.reqs = [self.reqs[i] for i in sorted(keep)]
            self.owners = [self.owners[i] for i in sorted(keep)]
            touched = {}
            for h, i in finished:
                if i == -2:          # an "mpi" collective finished
                    self._retire(h)
                elif i == -1:        # the metadata check finished
                    h._check_meta()
                    if h.error is not None:
                        self._retire(h)
                    else:
                        self._start(h)
                else:
                    st = self._state[h.seq]
                    st.complete(i)
                    touched[h.seq] = st
            for st in touched.values():
                self._post_ready(st)


class _RunState:
    """Dependency counters of one schedule execution on this rank."""

    def __init__(self, h: Handle, tag0: int):
        prog = h.schedule.programs[h.ctx.rank]
        self.handle, self.tag0, self.steps = h, tag0, prog.steps
        self.ufunc = OPS[h.op][0]
        self.mem = h.arr.view(np.uint8)
        self.scratch = h.ctx.engine.scratch(prog.scratch_elems, h.arr.dtype)
        self.scr_mem = self.scratch.view(np.uint8)
        self.waiting = [len(s.deps) for s in self.steps]
        self.dependents = prog.dependents
        self.ready = [i for i in range(len(self.steps) - 1, -1, -1) if self.waiting[i] == 0]
        self.remaining = len(self.steps)

    def complete(self, i: int) -> None:
        self.remaining -= 1
        for j in self.dependents[i]:
            self.waiting[j] -= 1
            if self.waiting[j] == 0:
                self.ready.append(j)


# ---------------------------------------------------------------------------- public API

def allreduce_async(buf: Any, op: str = "sum", prescale: float = 1.0, postscale: float = 1.0,
                    comm: Optional[MPI.Comm] = None, algorithm: Optional[str] = None, out: Any = None,
                    check: Optional[bool] = None, **overrides) -> Handle:
    """Start an allreduce of ``buf`` over ``comm``; returns a :class:`Handle`.

    In place unless ``out`` is given. ``op`` is sum, average, min, max or product;
    average is ``sum(prescale * x) * postscale / size`` (Horovod's definition).
    Every rank must call with the same element count and dtype, in the same order
    relative to its other allreduces on ``comm`` (as for any MPI collective).
    ``overrides`` (colors=, segment_bytes=, fanout=, hierarchy=, depth=) take
    precedence over the ``MCALLREDUCE_*`` environment.
    """
    ctx = Context.get(comm)
    config = _config.current().with_overrides(algorithm=algorithm, check=check, **overrides)
    reject, local_error = 0, None
    arr = np.zeros(0, np.float32)
    result = out if out is not None else buf
    algorithm_name, params = config.algorithm, Params()
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
        algorithm_name, params = ctx.resolve(config, arr.nbytes, arr.itemsize)
    except (TypeError, ValueError) as exc:
        reject = 2 if isinstance(exc, ConfigError) else 1
        local_error = exc
        if not config.check:
            raise
    post = postscale / ctx.size if op == "average" else postscale
    if local_error is None:
        scale_(arr, prescale)
    schedule = None
    if local_error is None and algorithm_name != "mpi":
        schedule = build_schedule(algorithm_name, ctx.hosts, arr.size, params)
        if schedule.max_tag >= _TAG_SPAN:
            raise ValueError(f"mcallreduce: {schedule.max_tag + 1} messages per rank pair exceed "
                             f"{_TAG_SPAN}; use a larger MCALLREDUCE_SEGMENT_BYTES")
    meta = None
    if config.check:
        scale_key = hash((float(prescale), float(postscale))) & ((1 << 40) - 1)
        meta = _meta_vector(ctx.rank, arr.size, arr.dtype, algorithm_name, op, params, scale_key, reject)
    with ctx.engine.lock:
        return Handle(ctx, result, arr, algorithm_name, schedule, op, meta, post, local_error)


def allreduce(buf: Any, op: str = "sum", prescale: float = 1.0, postscale: float = 1.0,
              comm: Optional[MPI.Comm] = None, algorithm: Optional[str] = None, out: Any = None,
              check: Optional[bool] = None, **overrides) -> Any:
    """Allreduce ``buf`` over ``comm`` (default COMM_WORLD); returns the result buffer.

    See :func:`allreduce_async` for the arguments. Raises on every rank if the
    ranks disagree on the element count, dtype or configuration.
    """
    return allreduce_async(buf, op, prescale, postscale, comm, algorithm, out, check, **overrides).wait()
