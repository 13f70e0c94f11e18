"""Model-based tuning tables: colors, segment size and hierarchy per message size.

A search, beside the runtime's size rules (:mod:`mcallreduce.policy`) and the tables that
``tune --measure`` times on a cluster: for a message of n bytes on a given host layout, every candidate ``Params``
(colors in {1, 2, 3, 4, L, N, ...}, segment in {0, 60K, 256K, 1M}, hierarchical or
flat) is played on the cluster model and the fastest wins, like Blue Gene/Q's
colors-by-size table (which was measured) and NCCL's tuner (which is a cost model).

* :func:`best_params` -- the search for one size, ``(algorithm, Params)``; sizes are
  binned to powers of two and memoised (the runtime never searches: it reads a table);
* :func:`table` -- the table for a layout and a list of sizes (``python -m mcallreduce.bench tune``),
  in the format :mod:`mcallreduce.tuning` reads back for the policy;
* :func:`default_model` -- the model for a layout: the emulated cluster with the calibration
  given, else the built-in one (mcallreduce/sim/calibration.json).

No ``MCALLREDUCE_*`` variable is read here (config.py reads them all): callers pass paths.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..algorithms import Params
from ..config import inter_host_segment_bytes
from .model import ClusterModel, emulated, load_calibration
from .predict import predict

__all__ = ["SEGMENTS", "candidates", "best_params", "table", "default_model"]

SEGMENTS = (0, inter_host_segment_bytes(), 256 << 10, 1 << 20)   # 60 KiB: eager across hosts
TUNING_FILE = Path(__file__).resolve().parents[2] / "docs" / "data" / "tuning.json"


def default_model(hosts: Sequence[Sequence[int]], calibration: Optional[Dict] = None,
                  rate: str = "200mbit", rails: int = 1) -> ClusterModel:
    """The emulated cluster with the calibrated constants; small messages see the latency the
    calibration measured on the busy machine (``alpha_loaded``), not the quiet ping-pong."""
    cal = calibration if calibration is not None else load_calibration()
    m = emulated(len(hosts), max(len(h) for h in hosts), rate=rate, rails=rails, calibration=cal, cores=None)
    if cal and "alpha_loaded" in cal:     # the latency small messages see on the busy machine
        m = m.with_(alpha=cal["alpha_loaded"], intra_alpha=max(m.intra_alpha, cal["alpha_loaded"]))
    return m


def candidates(model: ClusterModel, nbytes: int, itemsize: int = 4,
               algorithms: Sequence[str] = ("multicolor",)) -> List[Tuple[str, Params]]:
    L, N = model.ranks_per_host, model.hosts
    out: List[Tuple[str, Params]] = []
    nelem = max(1, nbytes // itemsize)
    for seg_bytes in SEGMENTS:
        seg = seg_bytes // itemsize
        if seg and seg * 2 > nelem:
            continue
        if "multicolor" in algorithms:
            for hier in ((True, False) if L > 1 else (True,)):
                nodes = N if hier else N * L
                colors = sorted({k for k in (1, 2, 3, 4, L, 2 * L, nodes) if 1 <= k <= nodes})
                for k in colors:
                    if k > 1 and nelem < 64 * k:
                        continue
                    if seg and seg * k * 2 > nelem:
                        continue
                    out.append(("multicolor", Params(colors=k, segment=seg, hierarchical=hier)))
                k = L if hier else 1                           # the colors on rings across hosts
                if N > 1 and not (seg and seg * k * 2 > nelem):
                    out.append(("multicolor", Params(colors=k, segment=seg, hierarchical=hier, route="ring")))
        if "multicolor" in algorithms and seg_bytes == 0:
            out.append(("doubling", Params(segment=0)))   # the family's latency regime
        if "ring" in algorithms and seg_bytes in (0, 256 << 10):
            out.append(("ring", Params(segment=seg)))
    return out


def _bin(nbytes: int) -> int:
    b = 1
    while b < nbytes:
        b <<= 1
    return b


@lru_cache(maxsize=1024)
def _best(model: ClusterModel, nbytes: int, itemsize: int, algorithms: Tuple[str, ...]):
    scored = [(predict(a, model, nbytes, itemsize, p, check=False), a, p)
              for a, p in candidates(model, nbytes, itemsize, algorithms)]
    scored.sort(key=lambda x: x[0])
    return scored


def best_params(hosts: Sequence[Sequence[int]], nbytes: int, itemsize: int = 4,
                model: Optional[ClusterModel] = None,
                algorithms: Sequence[str] = ("multicolor",)) -> Tuple[str, Params]:
    """The fastest (algorithm, Params) for ``nbytes`` on ``hosts`` according to ``model``.

    ``nbytes`` is rounded up to a power of two (the table's bins); segments are in
    elements of ``itemsize``, as the runtime expects.
    """
    model = model or default_model(hosts)
    if len(hosts) != model.hosts or max(len(h) for h in hosts) != model.ranks_per_host:
        model = model.with_(hosts=len(hosts), ranks_per_host=max(len(h) for h in hosts))
    if model.nranks == 1:
        return algorithms[0], Params(colors=1)
    scored = _best(model, _bin(max(int(nbytes), itemsize)), itemsize, tuple(algorithms))
    _, algorithm, params = scored[0]
    return algorithm, params


def table(model: ClusterModel, sizes: Sequence[int], itemsize: int = 4) -> List[Dict]:
    """One row per size: the best multicolor Params, its predicted time, and ring's for comparison."""
    rows = []
    for n in sizes:
        scored = _best(model, n, itemsize, ("multicolor", "ring"))
        best_mc = next((t, a, p) for t, a, p in scored if a in ("multicolor", "doubling"))
        best_ring = next((t, p) for t, a, p in scored if a == "ring")
        t, a, p = best_mc
        rows.append({"size_bytes": n, "algorithm": a, "colors": p.colors, "segment_bytes": p.segment * itemsize,
                     "hierarchical": p.hierarchical, "route": p.route, "predicted_s": t,
                     "ring_predicted_s": best_ring[0], "ring_segment_bytes": best_ring[1].segment * itemsize,
                     "speedup_vs_ring": best_ring[0] / t if t > 0 else 1.0})   # one rank: no time at all
    return rows
