"""Ring allreduce: reduce-scatter then allgather around one ring (the baseline).

Rank order on the ring keeps the ranks of a host adjacent, so each host's NIC
carries one ring edge in each direction. Chunk i (of p near-equal chunks) is
reduced while travelling p-1 hops, then circulated p-1 more hops. Chunks are cut
into segments so that reducing one segment overlaps receiving the next.

Cost (p ranks, n bytes): 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma.
"""
from __future__ import annotations

from typing import Sequence

from ..schedule import Builder, Schedule, segments, split_even

__all__ = ["build_ring"]


def build_ring(hosts: Sequence[Sequence[int]], nelem: int, segment: int = 0, depth: int = 4) -> Schedule:
    ring = [r for host in hosts for r in host]
    p = len(ring)
    b = Builder(p, nelem, depth=depth)
    chunks = split_even(nelem, p)
    for phase, reduce in (("reduce-scatter", True), ("allgather", False)):
        for step in range(p - 1):
            for pos in range(p):
                # reduce-scatter: position pos forwards chunk (pos - step); allgather: (pos + 1 - step)
                chunk = (pos - step + (0 if reduce else 1)) % p
                off, cnt = chunks[chunk]
                for seg_off, seg_cnt in segments(off, cnt, segment):
                    b.transfer(ring[pos], ring[(pos + 1) % p], seg_off, seg_cnt, reduce=reduce, color=chunk)
    return b.build("ring", segment=segment)
