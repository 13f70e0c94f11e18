"""Allreduce algorithms as pure schedules (no MPI import).

``build_schedule(name, hosts, nelem, params)`` returns the :class:`Schedule` for
one allreduce; ``hosts`` lists the ranks of every host (``[[0, 1], [2, 3]]``).
Schedules are cached: a training loop that reduces the same bucket sizes every
step builds each schedule once.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Dict, Optional, Sequence, Tuple

from ..schedule import Schedule
from .doubling import build_doubling
from .halving import build_halving
from .multicolor import build_multicolor
from .ring import build_ring

__all__ = ["Params", "BUILDERS", "SCHEDULED", "build_schedule", "build_doubling", "build_halving",
           "build_multicolor", "build_ring"]


@dataclass(frozen=True)
class Params:
    """Resolved (no "auto") tuning knobs of a schedule."""

    colors: int = 1              # multicolor: number of colors (trees)
    segment: int = 0             # pipeline segment in elements; 0 = one message per slice
    fanout: Optional[int] = None  # multicolor: minimum children per interior node (None: max(2, colors))
    hierarchical: bool = True    # multicolor: reduce inside hosts first
    depth: int = 4               # scratch slots per (peer, color, lane): segments in flight
    shared: bool = False         # multicolor on one host through a shared-memory window
                                 # (native/shared_stage.c): no schedule, no messages but syncs
    single_copy: bool = False    # that stage reading and writing the peers' buffers directly
    one_sync: bool = False       # that stage synchronising once: every rank reduces the whole buffer
    route: str = "tree"          # multicolor: how a color crosses hosts, "tree" or "ring"


Hosts = Tuple[Tuple[int, ...], ...]

#: the registry: algorithm name -> its schedule from (hosts, element count, parameters)
BUILDERS: Dict[str, Callable[[Hosts, int, Params], Schedule]] = {
    "multicolor": lambda hosts, n, prm: build_multicolor(hosts, n, colors=prm.colors, segment=prm.segment,
                                                         fanout=prm.fanout, hierarchical=prm.hierarchical,
                                                         depth=prm.depth, route=prm.route),
    "ring": lambda hosts, n, prm: build_ring(hosts, n, segment=prm.segment, depth=prm.depth),
    "doubling": lambda hosts, n, prm: build_doubling(hosts, n, segment=prm.segment, depth=prm.depth),
    "halving": lambda hosts, n, prm: build_halving(hosts, n, segment=prm.segment, depth=prm.depth),
}
#: algorithms that exist as schedules (the runtime adds "mpi": MPI_Allreduce itself)
SCHEDULED = tuple(BUILDERS)


def build_schedule(name: str, hosts: Sequence[Sequence[int]], nelem: int, params: Params) -> Schedule:
    key: Hosts = tuple(tuple(h) for h in hosts)
    return _cached(name, key, int(nelem), params)


@lru_cache(maxsize=256)
def _cached(name: str, hosts: Hosts, nelem: int, params: Params) -> Schedule:
    builder = BUILDERS.get(name)
    if builder is None:
        raise ValueError(f"unknown scheduled algorithm {name!r}; known: {', '.join(SCHEDULED)}")
    # a rank listed twice or left out once gave a wrong sum without a word
    ranks = sorted(r for host in hosts for r in host)
    if not hosts or not all(hosts) or ranks != list(range(len(ranks))):
        raise ValueError(f"hosts must be non-empty lists of the ranks 0..p-1, each rank once: {hosts!r}")
    if params.colors < 1 or params.segment < 0 or params.depth < 1 or (params.fanout or 2) < 2 or nelem < 0:
        raise ValueError(f"no schedule for {nelem} elements with {params!r}: colors and depth >= 1, "
                         f"segment and elements >= 0, fanout >= 2")
    return builder(hosts, nelem, params)
