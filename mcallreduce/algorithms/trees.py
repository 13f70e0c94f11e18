"""Spanning trees for the multi-color allreduce (pure combinatorics, no MPI).

``color_trees(n, k)`` builds k spanning trees over nodes 0..n-1 such that every
node is an *interior* node (one that has children) in at most one tree. That is
the property that makes k colors cost no more bandwidth than one ring: a node
forwards (and reduces) data only for its own color and is a leaf, sending its
slice once and receiving it once, in all the others. It generalises

* k = 2: the two-tree / NCCL double binary tree (interior nodes of one tree
  are leaves of the other; roots 0 and 1);
* k = n: n stars, color c rooted at node c, i.e. a direct reduce-scatter +
  allgather (bandwidth-optimal, two hops);
* k = 1: a single f-ary tree (f = 2 by default), for small messages.

Construction (per color c): the interior candidates are I_c = {v : v mod k == c},
disjoint across colors. The tree is a heap-ordered f-ary tree (position i has
children f*i+1 .. f*i+f) whose first m = ceil((n-1)/f) positions, the interior
ones, hold members of I_c, and whose remaining positions hold every other node.
The fan-out f starts at max(2, k) and grows only when I_c is too small to fill
m positions (n mod k >= 2 leaves the last colors one candidate short), so
every tree has depth about log_f(n).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

__all__ = ["Tree", "color_trees", "tree_from_parents"]


@dataclass(frozen=True)
class Tree:
    root: int
    parent: tuple    # parent[v], -1 for the root
    children: tuple  # children[v]: tuple of nodes, in reduction order

    @property
    def interior(self) -> List[int]:
        return [v for v, ch in enumerate(self.children) if ch]

    def depth(self) -> int:
        best = 0
        for v in range(len(self.parent)):
            d, u = 0, v
            while self.parent[u] >= 0:
                u, d = self.parent[u], d + 1
            best = max(best, d)
        return best

    def postorder(self) -> List[int]:
        """Nodes with every child before its parent (the order reductions flow in)."""
        out: List[int] = []
        stack = [(self.root, False)]
        while stack:
            v, seen = stack.pop()
            if seen:
                out.append(v)
                continue
            stack.append((v, True))
            for c in reversed(self.children[v]):
                stack.append((c, False))
        return out


def tree_from_parents(parent: Sequence[int]) -> Tree:
    children: List[List[int]] = [[] for _ in parent]
    root = -1
    for v, p in enumerate(parent):
        if p < 0:
            root = v
        else:
            children[p].append(v)
    return Tree(root, tuple(parent), tuple(tuple(c) for c in children))


def _heap_tree(order: Sequence[int], fanout: int) -> Tree:
    """Heap-shaped f-ary tree: order[i] is the node at position i."""
    parent = [-1] * len(order)
    for pos in range(1, len(order)):
        parent[order[pos]] = order[(pos - 1) // fanout]
    return tree_from_parents(parent)


def color_trees(n: int, k: int, fanout: Optional[int] = None) -> List[Tree]:
    """k spanning trees over n nodes, each node interior in at most one of them.

    ``fanout`` (default max(2, k)) is the minimum number of children of an
    interior node; it is raised per color only where needed (see module doc).
    k is clamped to n: more trees than nodes cannot have distinct roots.
    """
    if n < 1:
        raise ValueError("a tree needs at least one node")
    k = max(1, min(k, n))
    base_f = max(2, k if fanout is None else fanout)
    trees = []
    for c in range(k):
        candidates = list(range(c, n, k))
        f = base_f
        while -(-(n - 1) // f) > len(candidates):
            f += 1
        m = -(-(n - 1) // f)  # interior positions of a heap of n nodes with fan-out f
        interior = candidates[:max(m, 1)]
        rest = set(interior)
        # Leaves in rotated order starting after the root, so the colors spread their
        # leaves over different parents instead of all hanging off the same nodes.
        leaves = [(c + j) % n for j in range(1, n) if (c + j) % n not in rest]
        trees.append(_heap_tree(interior + leaves, f))
    return trees
