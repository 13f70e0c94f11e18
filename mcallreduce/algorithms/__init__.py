"""Allreduce algorithms as pure schedules (no MPI import).

``build_schedule(name, hosts, nelem, params)`` returns the :class:`Schedule` for
one allreduce; ``hosts`` lists the ranks of every host (``[[0, 1], [2, 3]]``).
Schedules are cached: a training loop that reduces the same bucket sizes every
step builds each schedule once.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Tuple

from ..schedule import Schedule
from .doubling import build_doubling
from .multicolor import build_multicolor
from .ring import build_ring

__all__ = ["Params", "SCHEDULED", "build_schedule", "build_doubling", "build_multicolor", "build_ring"]

#: algorithms that exist as schedules (the runtime adds "mpi": MPI_Allreduce itself)
SCHEDULED = ("multicolor", "ring", "doubling")


@dataclass(frozen=True)
class Params:
    """Resolved (no "auto") tuning knobs of a schedule."""

    colors: int = 1              # multicolor: number of colors (trees)
    segment: int = 0             # pipeline segment in elements; 0 = one message per slice
    fanout: Optional[int] = None  # multicolor: minimum children per interior node (None: max(2, colors))
    hierarchical: bool = True    # multicolor: reduce inside hosts first
    depth: int = 4               # scratch slots per (peer, color, lane): segments in flight
    shared: bool = False         # multicolor on one host through a shared-memory window
                                 # (mcallreduce/shared.py): no schedule, no messages but syncs
    route: str = "tree"          # multicolor: how a color crosses hosts, "tree" or "ring"


def build_schedule(name: str, hosts: Sequence[Sequence[int]], nelem: int, params: Params) -> Schedule:
    key: Tuple[Tuple[int, ...], ...] = tuple(tuple(h) for h in hosts)
    return _cached(name, key, int(nelem), params)


@lru_cache(maxsize=256)
def _cached(name: str, hosts: Tuple[Tuple[int, ...], ...], nelem: int, params: Params) -> Schedule:
    if name == "ring":
        return build_ring(hosts, nelem, segment=params.segment, depth=params.depth)
    if name == "doubling":
        return build_doubling(hosts, nelem, segment=params.segment, depth=params.depth)
    if name == "multicolor":
        return build_multicolor(hosts, nelem, colors=params.colors, segment=params.segment,
                                fanout=params.fanout, hierarchical=params.hierarchical, depth=params.depth,
                                route=params.route)
    raise ValueError(f"unknown scheduled algorithm {name!r}; known: {', '.join(SCHEDULED)}")
