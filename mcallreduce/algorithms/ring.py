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

__all__ = ["build_ring", "ring_steps"]


def build_ring(hosts: Sequence[Sequence[int]], nelem: int, segment: int = 0, depth: int = 4) -> Schedule:
    b = Builder(sum(len(h) for h in hosts), nelem, depth=depth)
    ring_steps(b, [r for host in hosts for r in host], 0, nelem, segment)
    return b.build("ring", segment=segment)


def ring_steps(b: Builder, ring: Sequence[int], offset: int, count: int, segment: int, color: int = -1) -> None:
    """Allreduce of buf[offset:+count] around ``ring`` (ranks in ring order) into ``b``.

    ``color`` -1 gives every chunk its own color (the flat ring: chunk i's report line);
    otherwise every step has that color (one color of a multicolor). Either way every
    chunk has scratch slots of its own (a color per chunk, or a lane per chunk in one
    color), so a ring route pipelines exactly as deep as the flat ring.
    """
    p = len(ring)
    chunks = [(offset + off, cnt) for off, cnt in split_even(count, p)]
    for phase, reduce in (("reduce-scatter", True), ("allgather", False)):
        for step in range(p - 1):
            for pos in range(p):
                # reduce-scatter: position pos forwards chunk (pos - step); allgather: (pos + 1 - step)
                chunk = (pos - step + (0 if reduce else 1)) % p
                off, cnt = chunks[chunk]
                for seg_off, seg_cnt in segments(off, cnt, segment):
                    b.transfer(ring[pos], ring[(pos + 1) % p], seg_off, seg_cnt, reduce=reduce,
                               color=chunk if color < 0 else color, lane=0 if color < 0 else chunk)
