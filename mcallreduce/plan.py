"""One kind of allreduce, resolved once: the algorithm and parameters the policy picks, the
schedule lowered for the compiled executor, and the metadata vector of its check."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from . import _executor
from .algorithms import build_schedule
from .check import DTYPE_CODE, FIELDS, OP_CODE, REJECT_BUFFER, REJECT_CONFIG, vector
from .config import MPI_ALGORITHMS, Config, ConfigError
from .engine import MAX_SCHEDULE_TAGS
from .lowering import EARLY_MAX_BYTES, early_steps, lower
from .policy import ALGORITHMS, ROUTES, fused_with_check, measured_nonblocking, resolve
from .schedule import Schedule

if TYPE_CHECKING:
    from .context import Context

_ALGO_CODE = {name: i + 1 for i, name in enumerate(ALGORITHMS)}
_ROUTE_CODE = {name: i + 1 for i, name in enumerate(ROUTES)}
_FUSED_KINDS = (_executor.KIND_FUSED_DOUBLING, _executor.KIND_FUSED_HALVING)
#: the metadata check's stage field, by the plan's kind (0: no one-host stage)
_STAGE_CODE = {_executor.KIND_SHARED: 1, _executor.KIND_SINGLE_COPY: 2, _executor.KIND_SHARED_ONE_SYNC: 3}
_MAX_MESSAGE_BYTES = (1 << 31) - 1   # the executor posts byte counts as C ints
_MAX_MPI_COUNT = (1 << 31) - 1       # and MPI's own allreduce element counts
_MPI_DTYPES = tuple(np.dtype(t) for t in ("float32", "float64", "int32", "int64"))   # where MPI's results are numpy's


class Plan:
    """One kind of allreduce, resolved: algorithm, parameters, the lowered schedule, and
    the executor's arguments that do not change from call to call."""

    def __init__(self, ctx: "Context", config: Config, nelem: int, dtype: np.dtype, op: str,
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
                                              nonblocking=nonblocking, fast_links=ctx.fast_links)
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
                self._lower(ctx, *resolve(config, nelem * dtype.itemsize, dtype.itemsize, ctx.hosts, mpi_type=False,
                                          fast_links=ctx.fast_links), nelem, dtype)
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

    def _lower(self, ctx: "Context", algorithm: str, params, nelem: int, dtype: np.dtype) -> None:
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


def rejected(ctx: "Context", exc: BaseException):
    """The executor's template of a call this rank rejected: it still takes part in the
    check, so every other rank raises too."""
    reject = REJECT_CONFIG if isinstance(exc, ConfigError) else REJECT_BUFFER
    meta = vector(ctx.rank, reject, (0,) * (len(FIELDS)))
    return _executor.Template(_executor.KIND_CHECK_ONLY, None, DTYPE_CODE[np.dtype(np.float32)], OP_CODE["sum"],
                              1.0, meta, _executor.CHECK_ON)
