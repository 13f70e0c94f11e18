"""Recursive doubling: log2(p) pairwise exchanges of the whole buffer (the latency regime).

In round j every rank swaps its partial result with the rank whose index differs
in bit j and reduces; after log2(p) rounds every rank holds the full reduction.
Every message carries the whole buffer, so this is the algorithm of small
messages (MPICH's and Open MPI's default below a few KiB, the shape of Blue
Gene/Q's software allreduce for short messages): it needs log2(p) message
latencies where a tree needs 2 log2(p) and a ring 2(p-1). With p = 2 it is one
exchange carrying n bytes each way, which is as little traffic as a ring sends
and half the rounds, so for two ranks it wins up to medium sizes too.

A rank count that is not a power of two is folded first (as in MPICH): of the
first 2r ranks (r = p - 2^floor(log2 p)) each odd rank hands its data to the
even rank below it and waits; the rest run the exchange; the even ranks then
return the result. Partners always combine op(lower ranks' data, higher ranks'
data), so every rank computes the same expression tree and the results are
bitwise identical on all ranks, with a fixed order across runs.

Cost (p = 2^m ranks, n bytes): log2(p) alpha + log2(p) n beta + log2(p) n gamma;
two extra alpha + n beta for the fold when p is not a power of two.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from ..schedule import Builder, Schedule, segments

__all__ = ["build_doubling", "fold", "fold_in", "fold_out"]


def fold(hosts: Sequence[Sequence[int]]) -> Tuple[List[int], int, int, List[int]]:
    """(ranks, 2^floor(log2 p), r, the participants after the fold): of the first 2r ranks
    the even ones take part, then every rank from 2r on, rank order kept."""
    ranks = sorted(r for host in hosts for r in host)
    pof2 = 1
    while pof2 * 2 <= len(ranks):
        pof2 *= 2
    rem = len(ranks) - pof2
    return ranks, pof2, rem, [ranks[2 * i] for i in range(rem)] + ranks[2 * rem:]


def fold_in(b: Builder, ranks: List[int], rem: int, pieces) -> None:
    """Each odd rank of the first 2r hands its whole buffer to the even rank before it."""
    for i in range(rem):
        for off, cnt in pieces:
            b.transfer(ranks[2 * i + 1], ranks[2 * i], off, cnt, reduce=True)


def fold_out(b: Builder, ranks: List[int], rem: int, pieces) -> None:
    """... and gets the result back at the end."""
    for i in range(rem):
        for off, cnt in pieces:
            b.transfer(ranks[2 * i], ranks[2 * i + 1], off, cnt, reduce=False)


def build_doubling(hosts: Sequence[Sequence[int]], nelem: int, segment: int = 0, depth: int = 4) -> Schedule:
    ranks, pof2, rem, active = fold(hosts)
    b = Builder(len(ranks), nelem, depth=depth)
    pieces = segments(0, nelem, segment)
    fold_in(b, ranks, rem, pieces)
    mask = 1
    while mask < pof2:
        for v in range(pof2):
            if v < v ^ mask:
                for off, cnt in pieces:
                    b.exchange(active[v], active[v ^ mask], off, cnt, color=mask.bit_length() - 1)
        mask <<= 1
    fold_out(b, ranks, rem, pieces)
    return b.build("doubling", segment=segment)
