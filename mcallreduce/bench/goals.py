"""``python -m mcallreduce.bench goals``: the allreduce's stated goals (docs/benchmarks.md, "Where the
goals stand"), measured again with the documented commands, layout by layout.

Each layout is one host (2 ranks under mpirun) or an emulated cluster that this command brings up
(root). Where the goals ask for the cluster's own table it is measured first (``tune --measure``),
and the jobs follow it. Every job is ``python -m mcallreduce.bench`` with the arms interleaved call
by call; each goal's figure is computed per job from that job's records, so every figure is a ratio
measured in one run.

    python -m mcallreduce.bench goals --layouts 1h2r,2h10g,4h10g,4h200m,4x2h200m --jobs 3 \\
        --json docs/data/goals.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .. import launch
from ..config import MPI_ALGORITHMS
from ..units import parse_size
from .output import subcommand_command, write_json
from .provenance import provenance, utc_now
from .timing import named

BENCH = (sys.executable, "-m", "mcallreduce.bench")


@dataclass(frozen=True)
class Goal:
    """``numerator``'s ``field`` over ``denominator``'s at ``size`` in job ``job``, against ``target``.
    An operand is an arm, ``best-mpi`` (the faster of ``mpi`` and ``mpi-ring``), ``link`` (the
    cluster's rate) or ``stream`` (the one-way MPI stream that ``cluster duplex`` measures)."""
    text: str
    job: str
    size: str
    numerator: str
    denominator: str
    field: str
    target: float
    at_most: bool = False

    def met(self, value: float) -> bool:
        return value <= self.target if self.at_most else value >= self.target


@dataclass(frozen=True)
class GoalSetup:
    """A layout of the goal runs: its cluster, its benchmark jobs and the goals they measure."""
    cluster: Optional[Tuple[int, str, int]]      # (hosts, rate, ranks per host); None: this host, 2 ranks
    jobs: Dict[str, Tuple[str, ...]]              # job name -> the benchmark's arguments
    goals: Tuple[Goal, ...]
    table_sizes: Optional[str] = None             # measure the cluster's table at these sizes first
    duplex: bool = False                          # measure the one-way MPI stream after the jobs


def _each(text: str, sizes: str, **goal) -> Tuple[Goal, ...]:
    return tuple(Goal(f"{text}, {size}", size=size, **goal) for size in sizes.split(","))


OVER_MPI = dict(job="main", numerator="multicolor", denominator="mpi", field="time_s", target=1.0, at_most=True)
BEST_MPI = dict(job="main", numerator="best-mpi", denominator="multicolor", field="time_s", target=1.0)
BENCH_10G = ("--algorithms", "multicolor,mpi,mpi-ring", "--seconds", "0.5", "--min-iters", "5")
LAYOUTS: Dict[str, GoalSetup] = {
    "1h2r": GoalSetup(None, {
        "main": ("--sizes", "4K,64K,256K,1M,4M,8M,16M,64M,256M", *BENCH_10G),
        "no-check": ("--sizes", "4K", "--algorithms", "multicolor,mpi,mpi-ring", "--no-check", "--seconds", "1")},
        _each("multicolor time / MPI_Allreduce's", "64K,256K,1M,4M,8M,16M,64M,256M", **OVER_MPI)
        + (Goal("the same, 4K, check on", size="4K", **{**OVER_MPI, "target": 2.0}),
           Goal("the same, 4K, MCALLREDUCE_CHECK=0", size="4K", **{**OVER_MPI, "job": "no-check", "target": 1.2}))),
    "2h10g": GoalSetup((2, "10gbit", 1), {"main": ("--sizes", "4K,64K,256K,1M,4M,8M,32M", *BENCH_10G)},
                    _each("best MPI / multicolor", "64K,256K,1M,4M,8M,32M", **BEST_MPI)
                    + (Goal("busbw / one-way MPI stream, 32M", "main", "32M", "multicolor", "stream", "busbw_Bps", 0.9),
                       Goal("cpu_s / Open MPI ring's, 32M", "main", "32M", "multicolor", "mpi-ring", "cpu_s", 1.2,
                            at_most=True)),
                    table_sizes="4K,16K,64K,256K,1M,4M,8M,32M", duplex=True),
    "4h10g": GoalSetup((4, "10gbit", 1), {"main": ("--sizes", "64K,256K,1M,4M,8M,32M", *BENCH_10G)},
                    _each("best MPI / multicolor", "64K,256K,1M,4M,8M,32M", **BEST_MPI),
                    table_sizes="4K,64K,256K,1M,4M,8M,32M"),
    "4h200m": GoalSetup((4, "200mbit", 1), {"main": ("--sizes", "64K,1M,32M", "--algorithms", "multicolor,ring,mpi,mpi-ring",
                                                  "--seconds", "1", "--min-iters", "8")},
                     (Goal("busbw / link, 32M", "main", "32M", "multicolor", "link", "busbw_Bps", 0.95),
                      Goal("MPI's default / multicolor, 32M", "main", "32M", "mpi", "multicolor", "time_s", 1.3),
                      Goal("Open MPI's ring / multicolor, 32M", "main", "32M", "mpi-ring", "multicolor", "time_s", 1.0))),
    "4x2h200m": GoalSetup((4, "200mbit", 2), {"main": ("--sizes", "32M", "--algorithms", "multicolor,ring",
                                                    "--seconds", "1", "--min-iters", "6")},
                       (Goal("our flat ring / hierarchical multicolor, 32M", "main", "32M", "ring", "multicolor",
                             "time_s", 1.1),)),
}


def figure(goal: Goal, records: List[dict], link_Bps: Optional[float], stream_Bps: Optional[float]) -> float:
    """The goal's ratio in one job (``records``: that job's bench records)."""
    at = {r["algorithm"]: r for r in records if r["size_bytes"] == parse_size(goal.size)}

    def value(operand: str) -> float:
        if operand == "best-mpi":
            return min(at[arm][goal.field] for arm in MPI_ALGORITHMS)
        if operand in ("link", "stream"):
            rate = link_Bps if operand == "link" else stream_Bps
            if rate is None:
                raise ValueError(f"{goal.text}: no {operand} rate was measured")
            return rate
        return at[operand][goal.field]
    return value(goal.numerator) / value(goal.denominator)


def verdict(goal: Goal, figures: Sequence[float]) -> str:
    """yes (every job meets it), no (its median misses), or in how many jobs it was met."""
    if not figures:
        return "not measured"
    if all(goal.met(f) for f in figures):
        return "yes"
    if not goal.met(statistics.median(figures)):
        return "no"
    return f"in {sum(goal.met(f) for f in figures)} of {len(figures)} jobs"


def table(rows: List[dict]) -> str:
    lines = ["| layout | goal | target | figures, one per job | met |", "|---|---|---|---|---|"]
    for row in rows:
        sign = "<=" if row["at_most"] else ">="
        lines.append(f"| {row['layout']} | {row['goal']} | {sign} {row['target']:g} | "
                     + ", ".join(f"{f:.3f}" for f in row["figures"]) + f" | {row['met']} |")
    return "\n".join(lines)


def _job(argv: Sequence[str], env: Dict[str, str], cluster, timeout: float):
    result = (cluster.run(list(argv), env=env, timeout=timeout) if cluster is not None
              else launch.run(2, list(argv), env=env, timeout=timeout))
    if result.returncode != 0:
        raise SystemExit(f"failed ({result.returncode}): {' '.join(argv)}\n{result.stdout[-2000:]}\n"
                         f"{result.stderr[-3000:]}")
    return result


def _read(path: str):
    with open(path) as f:
        return json.load(f)


def run_layout(name: str, jobs: int, tmp: str, timeout: float) -> dict:
    """Bring the layout up, measure its table if it has one, run its jobs ``jobs`` times (the job
    kinds alternated), and compute every goal's figure per job."""
    layout = LAYOUTS[name]
    cluster = config = None
    if layout.cluster is not None:
        from .cluster import Cluster
        hosts, rate, per_host = layout.cluster
        cluster = Cluster()
        config = cluster.up(hosts, rate=rate, ranks_per_host=per_host)
    started, env, out = utc_now(), {}, {}
    if layout.table_sizes:
        path = os.path.join(tmp, f"{name}-table.json")
        _job([*BENCH, "tune", "--measure", "--calls", "blocking", "--sizes", layout.table_sizes, "--out", path],
             {}, cluster, timeout)
        env, out["table"] = {"MCALLREDUCE_TUNING_FILE": path}, _read(path)
    runs: Dict[str, List[List[dict]]] = {kind: [] for kind in layout.jobs}
    for i in range(jobs):
        for kind, args in layout.jobs.items():
            path = os.path.join(tmp, f"{name}-{kind}-{i}.json")
            _job([*BENCH, *args, "--quiet", "--json", path], env, cluster, timeout)
            runs[kind].append(_read(path)["records"])
            print(f"{name}: {kind} job {i + 1} of {jobs} done", flush=True)
    stream = None
    if layout.duplex:
        from .cluster_measure import duplex_main
        path = os.path.join(tmp, f"{name}-duplex.json")
        if duplex_main(cluster, "60K,256K,1M", "32M", 8, path) != 0:
            raise SystemExit(f"{name}: cluster duplex failed")
        out["duplex"] = _read(path)
        stream = 1e6 * max(r["MBps_per_direction"] for r in out["duplex"]["rows"] if not r["both"])
    link = config.rate_bytes_per_s if config is not None else None
    rows = [{"layout": name, "goal": g.text, "target": g.target, "at_most": g.at_most,
             "figures": [figure(g, records, link, stream) for records in runs[g.job]]} for g in layout.goals]
    for row, goal in zip(rows, layout.goals):
        row["met"] = verdict(goal, row["figures"])
    return {**provenance(started, config), "jobs": dict(layout.jobs), "runs": runs,
            "goals": rows, **out}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcallreduce.bench goals", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--jobs", type=int, default=3, help="jobs of each kind per layout")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    parser.add_argument("--json", help="write every layout's records, tables and goal figures here")
    ns = parser.parse_args(argv)
    try:
        names = named(ns.layouts, tuple(LAYOUTS), "layout")
    except ValueError as exc:
        parser.error(str(exc))
    if not names or ns.jobs < 1:
        parser.error("--layouts needs at least one layout, and --jobs 1 or more")
    if any(LAYOUTS[n].cluster for n in names) and os.geteuid() != 0:
        parser.error("the emulated cluster's layouts need root (network namespaces)")
    record = {"argv": subcommand_command("goals", argv), "started": utc_now(), "layouts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            record["layouts"][name] = run_layout(name, ns.jobs, tmp, ns.timeout)
            if ns.json:             # after every layout: a failure later keeps what was measured
                write_json(ns.json, record)
    text = table([row for layout in record["layouts"].values() for row in layout["goals"]])
    print(text)
    if ns.json:
        write_json(ns.json, {**record, "finished": utc_now(), "table": text})
    return 0
