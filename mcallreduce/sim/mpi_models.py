"""Open MPI 4.1's allreduce algorithms as schedules, so the cost model can time "mpi".

These are *models* of what ``MPI_Allreduce`` does (the runtime never runs them): the
message pattern of coll/tuned's algorithms, written with the same
:class:`~mcallreduce.schedule.Builder` as mcallreduce's own schedules, so that the
simulator plays them like any other. They are topology-unaware, like Open MPI's.

``ompi_default(p, nbytes)`` is the commutative branch of Open MPI 4.1's
``ompi_coll_tuned_allreduce_intra_dec_fixed`` (the rules generated from the
ompi-collectives-tuning measurements), e.g. 4..7 ranks: recursive doubling below
8 KiB, Rabenseifner (reduce-scatter by recursive halving + allgather by recursive
doubling) above; 8..15 ranks the same; 16..31 ranks: Rabenseifner from 4 KiB.
Segmented ring (5) is called with segsize 0 by the fixed rules, which is the ring.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

from ..algorithms import build_ring
from ..schedule import Builder, Schedule

__all__ = ["OMPI_NAMES", "ompi_default", "ompi_schedule", "recursive_doubling", "rabenseifner",
           "nonoverlapping"]

OMPI_NAMES = {1: "basic_linear", 2: "nonoverlapping", 3: "recursive_doubling", 4: "ring",
              5: "segmented_ring", 6: "rabenseifner"}


def ompi_default(p: int, nbytes: int) -> int:
    """Open MPI 4.1 coll/tuned fixed decision for a commutative allreduce (algorithm number)."""
    rules: List[Tuple[int, List[Tuple[int, int]]]] = [
        # (communicator size below, [(total bytes below, algorithm), ...]); last bound = inf
        (4, [(8, 4), (4096, 3), (8192, 4), (16384, 3), (65536, 4), (262144, 5), (1 << 62, 6)]),
        (8, [(16, 4), (8192, 3), (1 << 62, 6)]),
        (16, [(8192, 3), (1 << 62, 6)]),
        (32, [(64, 5), (4096, 3), (1 << 62, 6)]),
        (64, [(128, 5), (1 << 62, 6)]),
        (128, [(262144, 3), (1 << 62, 6)]),
        (256, [(131072, 2), (262144, 3), (1 << 62, 6)]),
        (512, [(4096, 2), (1 << 62, 6)]),
        (2048, [(2048, 2), (16384, 3), (1 << 62, 6)]),
        (4096, [(2048, 2), (4096, 5), (16384, 3), (1 << 62, 6)]),
        (1 << 62, [(2048, 2), (16384, 5), (32768, 3), (1 << 62, 6)]),
    ]
    for size_below, table in rules:
        if p < size_below:
            for bytes_below, alg in table:
                if nbytes < bytes_below:
                    return alg
    return 6


def _fold(p: int):
    """Non-power-of-two prologue of Open MPI's RD/Rabenseifner: (pof2, rem, vrank->rank)."""
    pof2 = 1
    while pof2 * 2 <= p:
        pof2 *= 2
    rem = p - pof2
    # ranks < 2*rem: odd ones stay (vrank = rank // 2), even ones hand their data over
    real = [2 * v + 1 if v < rem else v + rem for v in range(pof2)]
    return pof2, rem, real


def recursive_doubling(p: int, nelem: int) -> Schedule:
    b = Builder(p, nelem, depth=1)
    pof2, rem, real = _fold(p)
    for r in range(rem):
        b.transfer(2 * r, 2 * r + 1, 0, nelem, reduce=True)
    mask = 1
    while mask < pof2:
        # a pairwise exchange: both sides send their whole buffer, then add the other's
        for v in range(pof2):
            if v < v ^ mask:
                b.exchange(real[v], real[v ^ mask], 0, nelem)
        mask <<= 1
    for r in range(rem):
        b.transfer(2 * r + 1, 2 * r, 0, nelem, reduce=False)
    return b.build("mpi:recursive_doubling")


def rabenseifner(p: int, nelem: int) -> Schedule:
    """Reduce-scatter by recursive halving, then allgather by recursive doubling."""
    b = Builder(p, nelem, depth=1)
    pof2, rem, real = _fold(p)
    for r in range(rem):
        b.transfer(2 * r, 2 * r + 1, 0, nelem, reduce=True)
    window = [(0, nelem)] * pof2
    history: List[List[Tuple[int, int]]] = []
    mask = 1
    while mask < pof2:
        history.append(list(window))
        new = list(window)
        for v in range(pof2):
            w = v ^ mask
            off, cnt = window[v]
            low = cnt // 2
            keep, give = ((off, low), (off + low, cnt - low)) if v < w else ((off + low, cnt - low), (off, low))
            new[v] = keep
            b.transfer(real[v], real[w], give[0], give[1], reduce=True)
        window = new
        mask <<= 1
    while mask > 1:
        mask >>= 1
        for v in range(pof2):
            w = v ^ mask
            off, cnt = window[v]
            b.transfer(real[v], real[w], off, cnt, reduce=False)
        window = history.pop()
    for r in range(rem):
        b.transfer(2 * r + 1, 2 * r, 0, nelem, reduce=False)
    return b.build("mpi:rabenseifner")


def nonoverlapping(p: int, nelem: int) -> Schedule:
    """Reduce to rank 0 then broadcast (binomial trees, unsegmented)."""
    b = Builder(p, nelem, depth=1)
    mask = 1
    while mask < p:
        for r in range(0, p, 2 * mask):
            if r + mask < p:
                b.transfer(r + mask, r, 0, nelem, reduce=True)
        mask <<= 1
    while mask > 1:
        mask >>= 1
        for r in range(0, p, 2 * mask):
            if r + mask < p:
                b.transfer(r, r + mask, 0, nelem, reduce=False)
    return b.build("mpi:nonoverlapping")


def _ring(p: int, nelem: int) -> Schedule:
    return build_ring([[r] for r in range(p)], nelem, segment=0, depth=2)


_BUILDERS: Dict[int, Callable[[int, int], Schedule]] = {
    2: nonoverlapping, 3: recursive_doubling, 4: _ring, 5: _ring, 6: rabenseifner,
    1: nonoverlapping,   # basic linear: reduce to 0 + bcast, close enough for the model
}


def ompi_schedule(p: int, nelem: int, itemsize: int = 4, algorithm: int = 0) -> Schedule:
    """The schedule of Open MPI's allreduce ``algorithm`` (0: its default decision)."""
    alg = algorithm or ompi_default(p, nelem * itemsize)
    if p == 1:
        return Builder(1, nelem).build("mpi:none")
    return _BUILDERS[alg](p, nelem)
