"""Recursive halving then doubling (Rabenseifner): a reduce-scatter and an allgather in log2(p) rounds each.

In round j of the reduce-scatter every rank pairs with the rank whose index differs in
bit j (p = 2^m), sends it the half of its current range that the partner keeps (the rank
with the bit set keeps the upper half) and reduces the half it keeps itself; after m rounds
each rank holds 1/p of the result. The allgather retraces the rounds backwards, each pair
swapping the ranges it holds. Lowest bit first, as Open MPI's and the executor's fused call
(native/check.c): with ranks numbered host by host, the first and largest exchange stays on the host. That
is a ring's traffic (2 (p-1)/p n bytes per rank) in 2 log2(p) message latencies instead of
the ring's 2 (p-1): MPICH's and Open MPI's choice for medium messages, where a ring has too
many hops and recursive doubling sends the whole buffer every round.

A rank count that is not a power of two is folded as in ``doubling``: each odd rank of the
first 2r (r = p - 2^floor(log2 p)) hands its data to the even rank below it first and
gets the result back at the end. Every part of the result is reduced by one rank and
copied to the others, operands in rank order, so every rank holds bitwise the same result.

Cost (p = 2^m ranks, n bytes): 2 log2(p) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma;
two extra alpha + n beta (+ n gamma) for the fold when p is not a power of two.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from ..schedule import Builder, Schedule, segments
from .doubling import fold, fold_in, fold_out

__all__ = ["build_halving"]


def build_halving(hosts: Sequence[Sequence[int]], nelem: int, segment: int = 0, depth: int = 4) -> Schedule:
    ranks, pof2, rem, active = fold(hosts)
    b = Builder(len(ranks), nelem, depth=depth)

    def move(src: int, dst: int, off: int, cnt: int, reduce: bool, incoming_left: bool = False) -> None:
        for o, c in segments(off, cnt, segment):
            b.transfer(src, dst, o, c, reduce=reduce, incoming_left=incoming_left)

    fold_in(b, ranks, rem, segments(0, nelem, segment))
    held: List[Tuple[int, int]] = [(0, nelem)] * pof2     # each virtual rank's range
    history: List[List[Tuple[int, int]]] = []
    dist = 1
    while dist < pof2:
        history.append(list(held))
        for v in range(pof2):
            w = v ^ dist
            if v > w:
                continue
            off, cnt = held[v]
            half = cnt // 2
            # the lower rank keeps the lower half; both reduce op(lower rank's, higher rank's)
            move(active[v], active[w], off + half, cnt - half, reduce=True, incoming_left=True)
            move(active[w], active[v], off, half, reduce=True)
            held[v], held[w] = (off, half), (off + half, cnt - half)
        dist *= 2
    dist = pof2 // 2
    while dist >= 1:
        before = history.pop()
        for v in range(pof2):
            w = v ^ dist
            if v > w:
                continue
            move(active[v], active[w], *held[v], reduce=False)
            move(active[w], active[v], *held[w], reduce=False)
            held[v] = held[w] = before[v]
        dist //= 2
    fold_out(b, ranks, rem, segments(0, nelem, segment))
    return b.build("halving", segment=segment)
