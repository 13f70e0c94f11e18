"""The one timing loop of the benchmarks: arms alternated call by call, each call timed
from a barrier, an iteration over when its slowest rank is done (as nccl-tests and the OSU
benchmarks time a collective); and the order of benchmarks that run a whole job per arm."""
from __future__ import annotations

import resource
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["alternated", "carryover_balanced", "cpu_seconds", "iterations", "interleaved", "named", "split_arm",
           "whole_rounds"]


def cpu_seconds() -> float:
    """User + system CPU time of every thread of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def iterations(comm, arms: Sequence[Callable[[], None]], seconds: float, min_iters: int, cap: int) -> int:
    """How many iterations of every arm fit in about ``seconds``, from one timed call of each:
    the same count on every rank (the slowest rank's estimate)."""
    from mpi4py import MPI
    t0 = time.perf_counter()
    for arm in arms:
        arm()
    one = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    return whole_rounds(int(min(cap, max(min_iters, seconds / max(one, 1e-6)))), len(arms))


def whole_rounds(iters: int, narms: int) -> int:
    """``iters`` rounded up to whole rounds of :func:`carryover_balanced`'s orders, so that each arm
    follows every other equally often."""
    orders = len(carryover_balanced(narms))
    return -(-iters // orders) * orders


def carryover_balanced(n: int) -> List[List[int]]:
    """Orders of ``n`` arms in which every arm directly follows every other arm equally often: a
    Williams design, ``n`` orders for an even ``n`` and ``2n`` for an odd one."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:   # 0, 1, n-1, 2, n-2, ...
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(arm + shift) % n for arm in first] for shift in range(n)]
    return orders + [order[::-1] for order in orders] if n % 2 else orders


def interleaved(comm, arms: Sequence[Callable[[], None]], iters: int,
                reset: Optional[Callable[[], None]] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Run ``arms`` alternated call by call so that all of them meet the same background load,
    in the orders of :func:`carryover_balanced`, one an iteration: an arm's time depends on the
    one before it (what that call left in the caches, MPI's progress state and a shaped link's
    token bucket), so each arm follows every other equally often. (A seeded random order gives
    every job the same predecessors, and so the same bias.)

    Returns (the slowest rank's seconds, this rank's CPU seconds), each ``iters x len(arms)``.
    ``reset`` runs before each call, outside the timed span (refilling the buffer, say)."""
    from mpi4py import MPI
    times = np.empty((iters, len(arms)))
    cpu = np.empty_like(times)
    orders = carryover_balanced(len(arms))
    for i in range(iters):
        for j in orders[i % len(orders)]:
            arm = arms[j]
            if reset is not None:
                reset()
            comm.Barrier()
            c0 = cpu_seconds()
            t0 = time.perf_counter()
            arm()
            times[i, j] = time.perf_counter() - t0
            cpu[i, j] = cpu_seconds() - c0
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return slowest, cpu


def alternated(arms: Sequence[str], rounds: int) -> Iterator[Tuple[int, str]]:
    """(round, arm) for benchmarks that run a whole job per arm: every arm once a round, in the
    reverse order every other round, so that no arm always runs first (or just after another)."""
    for round_ in range(rounds):
        for arm in (arms if round_ % 2 == 0 else arms[::-1]):
            yield round_, arm


def named(text: str, known: Sequence[str], what: str) -> List[str]:
    """The names of a comma-separated option (``--arms a,b``), each one of ``known``, else ValueError."""
    names = [n for n in text.split(",") if n]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"unknown {what}(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def split_arm(spec: str, known: Sequence[str]) -> Tuple[str, Dict[str, str]]:
    """An arm of a whole-job benchmark, ``ARM`` or ``ARM:NAME=VALUE[:NAME=VALUE...]``: the arm's name
    and the variables added to its own, so that settings are compared in one run, alternated like arms."""
    base, *assignments = spec.split(":")
    if base not in known:
        raise ValueError(f"unknown arm {base!r} in {spec!r}; choose from {', '.join(known)}")
    bad = [a for a in assignments if "=" not in a or not a.split("=", 1)[0]]
    if bad:
        raise ValueError(f"arm {spec!r}: expected ARM:NAME=VALUE, got {':'.join(bad)!r}")
    return base, dict(a.split("=", 1) for a in assignments)
