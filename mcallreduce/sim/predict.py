"""Predicted allreduce time per algorithm and size, for what the runtime would actually run.

``predict(algorithm, model, nbytes)``: "multicolor" and "ring" resolve their parameters
with :func:`mcallreduce.policy.resolve` (as the runtime does for an environment without
``MCALLREDUCE_*`` overrides) unless ``params`` is given, build the runtime's schedule
and play it; with ``check`` (the runtime's default) the metadata check, a
recursive doubling of :data:`mcallreduce.check.VECTOR_BYTES`, gates every step but the schedule's
early ones, which travel with it (native/early.c); a doubling or halving call small enough to be
reduced along its own check (:func:`mcallreduce.policy.fused_with_check`) has no check of its own,
and MPI's own allreduce runs after it. "mpi" is Open MPI 4.1's default
decision (see :mod:`.mpi_models`), "mpi-ring" its ring (algorithm 4); "horovod" is
stock Horovod's CPU path, which is MPI_Allreduce on the fused buffer: "mpi".
"""
from __future__ import annotations

import numbers
from functools import lru_cache
from typing import Optional, Tuple

from ..algorithms import SCHEDULED, Params, build_schedule
from ..config import ALGORITHMS as RUNTIME_ALGORITHMS
from ..lowering import EARLY_MAX_BYTES, early_steps
from ..check import VECTOR_BYTES
from ..policy import fused_with_check
from ..schedule import Schedule
from .model import ClusterModel
from .mpi_models import ompi_schedule
from .simulate import simulate

__all__ = ["ALGORITHMS", "predict", "schedule_for", "runtime_choice", "CHECK_BYTES"]

ALGORITHMS = RUNTIME_ALGORITHMS + ("horovod",)
CHECK_BYTES = VECTOR_BYTES


def runtime_choice(algorithm: str, model: ClusterModel, nbytes: int, itemsize: int = 4) -> Tuple[str, Params]:
    """What the runtime runs when asked for ``algorithm`` at this size, without ``MCALLREDUCE_*``
    overrides: multicolor may pick doubling or MPI's own allreduce (:func:`mcallreduce.policy.resolve`),
    MPI being the Open MPI the model plays, whose ring exists and serves 4- and 8-byte types."""
    from ..config import Config
    from ..policy import FAST_LINK_BYTES_PER_S, resolve
    return resolve(Config(algorithm=algorithm), nbytes, itemsize, model.layout(), mpi_ring=True,
                   mpi_type=itemsize >= 4, fast_links=model.nic_Bps >= FAST_LINK_BYTES_PER_S)


def schedule_for(algorithm: str, model: ClusterModel, nbytes: int, itemsize: int = 4,
                 params: Optional[Params] = None) -> Schedule:
    nelem = max(1, nbytes // itemsize)
    if algorithm in SCHEDULED and params is None:
        algorithm, params = runtime_choice(algorithm, model, nbytes, itemsize)
    if algorithm in SCHEDULED:
        return build_schedule(algorithm, model.layout(), nelem, params)
    if algorithm in ("mpi", "horovod"):
        return ompi_schedule(model.nranks, nelem, itemsize, 0)
    if algorithm == "mpi-ring":
        return ompi_schedule(model.nranks, nelem, itemsize, 4)
    raise ValueError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")


@lru_cache(maxsize=4096)
def _time(algorithm: str, model: ClusterModel, nbytes: int, itemsize: int, params: Optional[Params],
          gate: float = 0.0) -> float:
    """Seconds per call, no step but the early ones before ``gate`` (the check's time)."""
    if algorithm not in SCHEDULED:     # MPI's collectives run in C, not in our engine
        model = model.with_(overhead=model.mpi_overhead)
    schedule = schedule_for(algorithm, model, nbytes, itemsize, params)
    early = None
    if gate and algorithm in SCHEDULED:
        early = [early_steps(schedule, r, EARLY_MAX_BYTES // itemsize) for r in range(schedule.nranks)]
    # back to back, as benchmarks and training steps call it: a shaped NIC's bucket does not refill
    return simulate(schedule, model, itemsize, gate=gate, early=early).steady_time


def predict(algorithm: str, model: ClusterModel, nbytes: int, itemsize: int = 4,
            params: Optional[Params] = None, check: bool = True) -> float:
    """Seconds per allreduce of ``nbytes`` on ``model``, in a sequence of back-to-back calls."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 1 or itemsize < 1:
        raise ValueError(f"predict: nbytes must be a whole number of 1 or more, and itemsize too "
                         f"(got {nbytes!r}, {itemsize!r})")   # once priced as one element
    asked = algorithm
    if algorithm in SCHEDULED and params is None:
        algorithm, params = runtime_choice(algorithm, model, int(nbytes), itemsize)
    # a fused call's data rides the check's messages; the runtime checks MPI's allreduce too
    if not (check and asked in SCHEDULED and model.nranks > 1) or fused_with_check(algorithm, nbytes):
        return _time(algorithm, model, int(nbytes), itemsize, params)
    gate = _time("mpi", model, CHECK_BYTES, 8, None)
    if algorithm in SCHEDULED:
        return _time(algorithm, model, int(nbytes), itemsize, params, gate)
    return gate + _time(algorithm, model, int(nbytes), itemsize, params)


def busbw(nbytes: int, seconds: float, nranks: int) -> float:
    """nccl-tests' bus bandwidth of an allreduce (bytes/s): algbw x 2(n-1)/n, so 0 at one rank."""
    return 0.0 if nranks == 1 else nbytes / seconds * 2 * (nranks - 1) / nranks


def best_of(model: ClusterModel, nbytes: int, algorithms=("multicolor", "ring")) -> Tuple[str, float]:
    times = {a: predict(a, model, nbytes) for a in algorithms}
    name = min(times, key=times.get)
    return name, times[name]
