"""The MPI runtime: the public allreduce API over mpi4py.

One :class:`~mcallreduce.context.Context` per user communicator owns duplicates of it
(data, checks and MPI's own collectives never mix with the user's messages), the host
layout, the one-host shared-memory window and one :class:`~mcallreduce.engine.Engine`.
A call becomes a :class:`~mcallreduce.plan.Plan` (memoised per kind of call: algorithm,
schedule lowered for the compiled executor, metadata vector) plus the buffer, and the
engine runs it.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np
from mpi4py import MPI

from . import config as _config
from .check import DTYPES, OP_CODE, mismatch
from .config import Config, ConfigError
from .context import Context
from .engine import Handle
from .gpu import Staging, StagingError, is_gpu_buffer
from .memory import as_array
from .plan import rejected
from .policy import ALGORITHMS

__all__ = ["Context", "Handle", "allreduce", "allreduce_async", "start_progress_thread", "OPS", "DTYPES"]

OPS = tuple(OP_CODE)   # sum, average, min, max, product


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
                return ctx.engine.submit(ctx.next_seq(), result, rejected(ctx, exc), np.zeros(0, np.float32), 1.0,
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
