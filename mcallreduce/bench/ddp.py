"""``python -m mcallreduce.bench ddp``: DDP on gloo against the multicolor hook and backend.

Runs examples/ddp_synthetic_benchmark.py once per arm per round, the arms alternated within
each round, on this host (``-np N``) or on the emulated cluster (``--cluster``), and prints
the table of total img/s with each arm's ratio to gloo's mean. An arm named
``ARM:NAME=VALUE[:NAME=VALUE...]`` is ARM with those variables added (``hook:MCALLREDUCE_PROGRESS_THREAD=0``).

    python -m mcallreduce.bench ddp --cluster --runs 2 -- --image-size 32 --batch-size 8 --num-iters 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from . import example
from .output import subcommand_command, write_json
from .provenance import provenance, utc_now
from .timing import alternated, split_arm

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_synthetic_benchmark.py"
ARMS = ("gloo", "hook", "backend")


def run_arm(spec: str, ns: argparse.Namespace, out: str, env: Dict[str, str]) -> None:
    from .cluster import Cluster
    arm, added = split_arm(spec, ARMS)
    example.run([sys.executable, str(EXAMPLE), "--comm", arm, "--json", out, *ns.example_args], {**env, **added},
                np=ns.np, cluster=Cluster() if ns.cluster else None, timeout=ns.timeout)


def table(rows: List[Dict]) -> str:
    by_arm: Dict[str, List[float]] = {}
    for row in rows:
        by_arm.setdefault(row["arm"], []).append(row["total_img_sec"])
    runs = max(len(v) for v in by_arm.values())
    base = statistics.mean(by_arm["gloo"]) if "gloo" in by_arm else None
    lines = ["| arm | " + " | ".join(f"run {i + 1}" for i in range(runs)) + " | mean | vs gloo |",
             "|---|" + "---:|" * (runs + 2)]
    for arm, values in by_arm.items():
        mean = statistics.mean(values)
        ratio = f"{mean / base:.2f}x" if base else "-"
        lines.append(f"| {arm} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {mean:.2f} | {ratio} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcallreduce.bench ddp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default="gloo,hook",
                        help=f"comma-separated, of {', '.join(ARMS)}; ARM:NAME=VALUE adds a variable to ARM's")
    parser.add_argument("--runs", type=int, default=2, help="rounds; each runs every arm once, alternated")
    parser.add_argument("--cluster", action="store_true", help="on the emulated cluster (cluster up first)")
    parser.add_argument("-np", "--np", type=int, default=2, help="ranks on this host (without --cluster)")
    parser.add_argument("-x", dest="env", action="append", default=[], metavar="NAME=VALUE",
                        help="exported to every rank of every arm")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--json", help="write the runs and the table here")
    parser.add_argument("example_args", nargs=argparse.REMAINDER, help="-- then the example's arguments")
    ns = parser.parse_args(argv)
    ns.example_args = [a for a in ns.example_args if a != "--"]
    arms = [a for a in ns.arms.split(",") if a]
    for arm in arms:
        try:
            split_arm(arm, ARMS)
        except ValueError as exc:
            parser.error(str(exc))
    env = dict(item.split("=", 1) for item in ns.env)
    started = utc_now()
    rows: List[Dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "runs.jsonl")
        for round_, arm in alternated(arms, ns.runs):
            run_started = utc_now()
            run_arm(arm, ns, out, env)
            with open(out) as f:
                row = json.loads(f.readlines()[-1])
            row.update(arm=arm, round=round_ + 1, started=run_started)
            rows.append(row)
            print(f"round {round_ + 1} {arm}: {row['total_img_sec']:.2f} img/s", flush=True)
    text = table(rows)
    print(text)
    if ns.json:
        from .cluster import Cluster
        write_json(ns.json, {"argv": subcommand_command("ddp", argv), "env": env,
                             **provenance(started, Cluster().config() if ns.cluster else None),
                             "runs": rows, "table": text})
    return 0
