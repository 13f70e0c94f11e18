"""Multi-color allreduce: k colors, each reduced up and broadcast down its own tree.

The buffer is split into k contiguous color slices. Color c is reduced to a root
over tree T_c and broadcast back down T_c, pipelined in segments so that all
levels of a tree, and all trees, work at once. The trees come from
:func:`trees.color_trees`: every node is interior in at most one tree, so a node
forwards data for one color only and the k trees together load every link about
as evenly as a ring, with depth log_f(p) instead of p hops.

With several ranks per host (``hierarchical``), each color first reduces inside
every host onto that host's local root for the color (local rank c mod L, so
every local rank carries some colors across the network, as the paper used every
GPU of a Minsky node), then runs the inter-host tree among the local roots, then
broadcasts inside the host. Without hierarchy every rank is its own "host".

``route`` is how a color crosses the hosts: ``tree`` (the above), or ``ring``: the
color's local roots run a ring allreduce of its slice (reduce-scatter then allgather,
one hop to the next host each step). A ring moves the same bytes per NIC as the k
trees but sends each host's data to one neighbour only, one way; on few hosts and
large messages that keeps a shaped link busier than the trees' two-way, many-peer
traffic (docs/defaults-hosts.md, "Trees or rings across hosts"), at the price of 2(N-1) hops instead of
2 log(N). With L ranks per host and L colors, every local rank carries one ring.

Cost: see docs/algorithms.md.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from ..schedule import Builder, Schedule, segments, split_even
from .ring import ring_steps
from .trees import color_trees

__all__ = ["build_multicolor"]


def build_multicolor(
    hosts: Sequence[Sequence[int]],
    nelem: int,
    colors: int,
    segment: int = 0,
    fanout: Optional[int] = None,
    hierarchical: bool = True,
    depth: int = 4,
    route: str = "tree",
) -> Schedule:
    if route not in ("tree", "ring"):
        raise ValueError(f"route must be 'tree' or 'ring', not {route!r}")
    nranks = sum(len(h) for h in hosts)
    if not hierarchical:
        hosts = [[r] for h in hosts for r in h]
    colors = max(1, min(colors, max(nelem, 1)))
    trees = color_trees(len(hosts), colors, fanout)
    b = Builder(nranks, nelem, depth=depth)

    def local_root(h: int, c: int) -> int:
        return hosts[h][c % len(hosts[h])]

    for c, (c_off, c_cnt) in enumerate(split_even(nelem, colors)):
        roots: List[int] = [local_root(h, c) for h in range(len(hosts))]
        if route == "ring":
            _ring_color(b, hosts, roots, c, c_off, c_cnt, segment)
            continue
        tree = trees[c % len(trees)]
        order = tree.postorder()                    # children before parents
        for off, cnt in segments(c_off, c_cnt, segment):
            def move(src: int, dst: int, reduce: bool) -> None:
                b.transfer(src, dst, off, cnt, reduce=reduce, color=c)

            for h, members in enumerate(hosts):     # 1. reduce inside each host
                for u in members:
                    move(u, roots[h], True)
            for v in order:                          # 2. reduce up the host tree
                for child in tree.children[v]:
                    move(roots[child], roots[v], True)
            for v in reversed(order):                # 3. broadcast down the host tree
                for child in tree.children[v]:
                    move(roots[v], roots[child], False)
            for h, members in enumerate(hosts):     # 4. broadcast inside each host
                for u in members:
                    move(roots[h], u, False)
    return b.build("multicolor", colors=colors, segment=segment, fanout=fanout, hierarchical=hierarchical,
                   route=route)


def _ring_color(b: Builder, hosts, roots: List[int], c: int, c_off: int, c_cnt: int, segment: int) -> None:
    """Color c over a ring of its local roots: reduce inside each host, ring allreduce, broadcast back.

    The host stages move the ring's chunks in the order the ring needs them: host h first
    forwards chunk h and first holds the final chunk h + 1 (then h, h - 1, ...).
    """
    n = len(roots)
    chunks = [(c_off + off, cnt) for off, cnt in split_even(c_cnt, n)]

    def pieces(first: int):
        return [seg for k in range(n) for seg in segments(*chunks[(first - k) % n], segment)]

    for h, members in enumerate(hosts):
        for off, cnt in pieces(h):
            for u in members:
                b.transfer(u, roots[h], off, cnt, reduce=True, color=c)
    ring_steps(b, roots, c_off, c_cnt, segment, color=c)
    for h, members in enumerate(hosts):
        for off, cnt in pieces(h + 1):
            for u in members:
                b.transfer(roots[h], u, off, cnt, reduce=False, color=c)
