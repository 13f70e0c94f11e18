"""``python -m mcallreduce.bench tune --measure``: the tuning table, measured on your cluster.

    mpirun -np 8 python -m mcallreduce.bench tune --measure --out tuning.json
    MCALLREDUCE_TUNING_FILE=tuning.json mpirun -np 8 python train.py

For every size, ``multicolor`` (its built-in choice of schedule, the shared-memory stage
on one host included; and with 256 KiB and 1 MiB segments), ``ring``, ``doubling``,
``halving`` (also with 256 KiB segments and unsegmented), ``mpi`` (MPI's own allreduce,
through the same executor) and ``mpi-ring`` (Open MPI's ring, where it can be forced:
:mod:`mcallreduce.mpit`) are timed through the public API, interleaved call by call, in a
few passes, and the fastest by the median of all its calls is the table's row for that size
(the built-in choice stays where it is within ``--margin`` of the fastest); multicolor's
``auto`` then runs it, as NCCL's tuner or Open MPI's dynamic rules pick an algorithm by size.
Rows are per layout (hosts x ranks per host): rerun it after changing either, or the network.

Each kind of call gets rows of its own (``--calls``): ``allreduce`` timed as itself, and
``allreduce_async`` waited for at once, which is what the Horovod plugin and the DDP hook
start. The two differ where MPI is a candidate: Open MPI runs a blocking ``MPI_Allreduce``
with its tuned component's algorithms and an ``MPI_Iallreduce`` with libnbc's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..config import MPI_ALGORITHMS
from ..tuning import NONBLOCKING_SECTION, layout_name
from ..units import format_size, parse_sizes
from .output import command, write_table_json
from .provenance import provenance, utc_now
from .timing import interleaved, iterations

#: (name, algorithm, overrides): the built-in choice, larger segments (which fast links may
#: prefer to the eager-sized ones the built-in rules use across hosts), and the others
CANDIDATES = (("multicolor", "multicolor", {}), ("multicolor-256K", "multicolor", {"segment_bytes": 256 << 10}),
              ("multicolor-1M", "multicolor", {"segment_bytes": 1 << 20}), ("ring", "ring", {}),
              ("doubling", "doubling", {}), ("halving", "halving", {}),
              ("halving-256K", "halving", {"segment_bytes": 256 << 10}),
              ("halving-unsegmented", "halving", {"segment_bytes": 0}), ("mpi", "mpi", {}),
              ("mpi-ring", "mpi-ring", {}))
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,8M,16M,64M"
DEFAULT_MARGIN = 0.03   # near ties trade places from run to run (docs/benchmarks.md, "The built-in table")
#: each kind of call's rows, under its own key of the table
SECTIONS = {"blocking": "tables", "nonblocking": NONBLOCKING_SECTION}


def candidates(ring_available: bool) -> List[tuple]:
    """The candidates that run as themselves here: ``mpi-ring`` only where Open MPI's ring could
    be forced (elsewhere it is ``mpi`` again)."""
    return [c for c in CANDIDATES if c[0] != "mpi-ring" or ring_available]


def _caller(nonblocking: bool):
    """One call as the table's rows will be used: ``allreduce``, or ``allreduce_async`` waited for
    at once (as the Horovod plugin and the DDP hook start theirs)."""
    from .. import allreduce, allreduce_async
    if nonblocking:
        return lambda buf, **kw: allreduce_async(buf, **kw).wait()
    return allreduce


def _time_size(comm, size: int, seconds: float, min_iters: int, passes: int,
               arms_spec: Sequence[tuple], nonblocking: bool) -> Dict[str, float]:
    """Each candidate's time at ``size`` bytes of float32: the median slowest-rank time of all
    its calls, in ``passes`` passes. The median of every call, not the quickest pass, because
    that is what a training loop and the benchmark see: a candidate whose times scatter (many
    small messages on a busy machine) must not win on one lucky pass (docs/defaults-hosts.md,
    "How the tuner ranks candidates")."""
    call = _caller(nonblocking)
    buf = np.ones(max(1, size // 4), np.float32)
    for _, algorithm, overrides in arms_spec:     # warm-up: plans, schedules, scratch
        call(buf, algorithm=algorithm, **overrides)
    arms = [lambda a=algorithm, o=overrides: call(buf, algorithm=a, **o) for _, algorithm, overrides in arms_spec]
    iters = iterations(comm, arms, seconds * len(arms) / passes, min_iters, cap=100)
    data = buf.copy()

    def reset() -> None:   # fresh data before every call, as the benchmark and a training step have
        buf[...] = data

    return typical_times([interleaved(comm, arms, iters, reset)[0] for _ in range(passes)],
                         [name for name, _, _ in arms_spec])


def typical_times(passes: Sequence[np.ndarray], names: Sequence[str]) -> Dict[str, float]:
    """Each candidate's median over every call of every pass (``passes``: one iterations x
    candidates array of slowest-rank seconds per pass)."""
    calls = np.concatenate(passes)
    return {name: float(np.median(calls[:, j])) for j, name in enumerate(names)}


def choose(times: Dict[str, float], margin: float) -> str:
    """The fastest candidate, unless the built-in choice is within ``margin`` of it: candidates
    that close trade places from run to run, and a table should not follow the noise."""
    best = min(times, key=times.get)
    return "multicolor" if "multicolor" in times and times["multicolor"] <= (1 + margin) * times[best] else best


def choose_ours(times: Dict[str, float], margin: float, ran: Optional[Dict[str, str]] = None) -> str:
    """:func:`choose` among our own candidates: a row's ``instead``, for calls that MPI's
    allreduce cannot serve (float16; nonblocking calls on blocking rows). ``ran``: the algorithm
    each candidate ran as, where the built-in choice was MPI's own call (fast links)."""
    ran = ran or {}
    return choose({name: t for name, t in times.items() if ran.get(name, name) not in MPI_ALGORITHMS}, margin)


def _planned(ctx, base, name: str, size: int, nonblocking: bool) -> Dict:
    """Candidate ``name`` at ``size`` bytes as a table row names it: the plan's algorithm and parameters."""
    _, algorithm, overrides = next(c for c in CANDIDATES if c[0] == name)
    plan = ctx.plan(base.with_overrides(algorithm=algorithm, **overrides), max(1, size // 4),
                    np.dtype(np.float32), "sum", 1.0, 1.0, nonblocking=nonblocking)
    p = plan.params
    return {"algorithm": plan.algorithm, "colors": p.colors, "segment_bytes": p.segment * 4,
            "hierarchical": p.hierarchical, "route": p.route, "shared": p.shared}


def measure(sizes: Sequence[int], seconds: float, min_iters: int, passes: int = 3,
            margin: float = DEFAULT_MARGIN, nonblocking: bool = False) -> List[Dict]:
    from mpi4py import MPI
    from ..context import Context
    from .. import config
    comm = MPI.COMM_WORLD
    ctx = Context.get(comm)
    base = config.current()
    rows = []
    for size in sizes:
        times = _time_size(comm, size, seconds, min_iters, passes, candidates(ctx.coll_ring is not None),
                           nonblocking)
        best = choose(times, margin)
        planned = {name: _planned(ctx, base, name, size, nonblocking) for name in times}
        row = {"size_bytes": size, **planned[best], "measured_s": times}
        if row["algorithm"] in MPI_ALGORITHMS:
            ran = {name: p["algorithm"] for name, p in planned.items()}
            row["instead"] = planned[choose_ours(times, margin, ran)]
        rows.append(row)
        if comm.Get_rank() == 0:
            cells = "  ".join(f"{n} {t * 1e6:9.1f}" for n, t in times.items())
            print(f"{'nonblocking' if nonblocking else 'blocking':>11} {format_size(size):>6}  {cells}  -> {best}",
                  flush=True)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mcallreduce.bench tune --measure", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=DEFAULT_SIZES)
    ap.add_argument("--seconds", type=float, default=0.5, help="time budget per size and candidate")
    ap.add_argument("--min-iters", type=int, default=5, help="timed calls per candidate and pass, at least")
    ap.add_argument("--passes", type=int, default=3, help="interleaved passes per size; a candidate's time is the median of all its calls")
    ap.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                    help="keep the built-in choice where it is within this fraction of the fastest")
    ap.add_argument("--calls", default="blocking,nonblocking",
                    help="which calls to time: blocking (allreduce), nonblocking (allreduce_async, as the Horovod "
                         "plugin and the DDP hook call), or both, each into rows of their own")
    ap.add_argument("--out", required=True, help="JSON table to write (the MCALLREDUCE_TUNING_FILE format)")
    ns = ap.parse_args(argv)
    started = utc_now()
    os.environ["MCALLREDUCE_TUNING_FILE"] = "none"   # measure the built-in rules, not a table's
    from .. import config
    config.reload()
    from mpi4py import MPI
    from ..context import Context
    hosts = Context.get(MPI.COMM_WORLD).hosts
    kinds = [k for k in ns.calls.split(",") if k]
    if not kinds or set(kinds) - set(SECTIONS):
        ap.error(f"--calls {ns.calls!r}: blocking, nonblocking or both")
    sizes = sorted(set(parse_sizes(ns.sizes, "--sizes")))   # a table holds one row per size
    layout = layout_name(hosts)
    sections = {SECTIONS[kind]: {layout: measure(sizes, ns.seconds, ns.min_iters, ns.passes, ns.margin,
                                                 nonblocking=kind == "nonblocking")} for kind in kinds}
    if MPI.COMM_WORLD.Get_rank() == 0:
        table = {"measured": True, "measured_at_unix": int(time.time()),
                 "mpi": MPI.Get_library_version().split("\n")[0].strip("\0 "), "argv": command(),
                 **provenance(started), **sections}
        write_table_json(ns.out, table)
        print(f"# wrote {ns.out} ({layout})", file=sys.stderr)
        if "nonblocking" not in kinds:    # what the Horovod plugin and DDP then get (docs/ddp.md)
            print("# note: no nonblocking rows: allreduce_async (the Horovod plugin, DDP's hook and backend) "
                  "follows the blocking rows, and where they pick MPI's own allreduce it runs the row's "
                  "fastest own candidate, timed blocking; measure with --calls blocking,nonblocking for those",
                  file=sys.stderr)
    return 0
