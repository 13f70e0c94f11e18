"""``python -m mcallreduce.bench loader-start``: how long a DataLoader takes to its first batch at
each epoch's start, with workers that import everything again, a preloaded forkserver, and
persistent workers (``bench/loader_start_rank.py`` times one rank).

Each arm is one job on the emulated cluster (``--cluster``) or on ``-np`` ranks of this host, the
arms alternated within each round; every rank reads the whole packed store.

    python -m mcallreduce.bench loader-start --store /var/tmp/imagenet-like.train.mcstore \\
        --cluster --runs 2 --json loader-start.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

from . import example
from .loader_start_rank import ARMS
from .output import subcommand_command, write_json
from .provenance import provenance, utc_now
from .timing import alternated, named


def _span(values: Sequence[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def table(rows: List[dict]) -> str:
    """Per arm: seconds to the first batch in the first epoch and in the later ones, over every rank
    and round (range and median)."""
    lines = ["| workers | first epoch, s | median | later epochs, s | median |", "|---|---:|---:|---:|---:|"]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        first = [r["seconds"][0] for r in rows if r["arm"] == arm]
        later = [s for r in rows if r["arm"] == arm for s in r["seconds"][1:]]
        cells = [_span(first), f"{statistics.median(first):.2f}"]
        cells += [_span(later), f"{statistics.median(later):.2f}"] if later else ["-", "-"]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_arm(arm: str, ns: argparse.Namespace, tmp: str, round_: int, cluster) -> List[dict]:
    """One job of ``arm``: every rank's record, in rank order."""
    out = os.path.join(tmp, f"{arm}-{round_}-RANK.json")
    argv = [sys.executable, "-m", "mcallreduce.bench.loader_start_rank", arm, ns.store, out,
            "--epochs", str(ns.epochs), "--workers", str(ns.workers), "--batch-size", str(ns.batch_size),
            "--image-size", str(ns.image_size)]
    example.run(argv, {"MCALLREDUCE_DATA_PROGRESS": "0"}, np=ns.np, cluster=cluster, timeout=ns.timeout)
    paths = sorted(glob.glob(out.replace("RANK", "*")), key=lambda p: int(p.rsplit("-", 1)[1][:-5]))
    rows = []
    for rank, path in enumerate(paths):
        with open(path) as f:
            rows.append({**json.load(f), "round": round_ + 1, "rank": rank})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcallreduce.bench loader-start", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True, help="a packed training store (python -m mcallreduce.data pack)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--runs", type=int, default=2, help="rounds; each runs every arm once, alternated")
    parser.add_argument("--epochs", type=int, default=3, help="per job; each read to its end")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--cluster", action="store_true", help="on the emulated cluster (cluster up first)")
    parser.add_argument("-np", "--np", type=int, default=2, help="ranks on this host (without --cluster)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.add_argument("--json", help="write the runs and the table here")
    ns = parser.parse_args(argv)
    try:
        arms = named(ns.arms, ARMS, "arm")
    except ValueError as exc:
        parser.error(str(exc))
    if not os.path.isfile(ns.store):
        parser.error(f"no store at {ns.store}: python -m mcallreduce.data pack TREE/train {ns.store}")
    ns.store = os.path.abspath(ns.store)
    config = cluster = None
    if ns.cluster:
        from .cluster import Cluster
        cluster = Cluster()
        config = cluster.config()
        if config is None:
            parser.error("no emulated cluster is up: python -m mcallreduce.bench.cluster up --hosts 4 --rate 200mbit")
    started = utc_now()
    rows: List[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_, arm in alternated(arms, ns.runs):
            job = run_arm(arm, ns, tmp, round_, cluster)
            rows += job
            print(f"round {round_ + 1} {arm}: " + "; ".join(
                " ".join(f"{s:.2f}" for s in r["seconds"]) for r in job), flush=True)
            if ns.json:     # after every job: a failure later keeps what was measured
                write_json(ns.json, record(argv, config, rows, started))
    text = table(rows)
    print(text)
    if ns.json:
        write_json(ns.json, {**record(argv, config, rows, started), "table": text})
    return 0


def record(argv, config, rows: List[dict], started: str) -> Dict:
    return {"what": "seconds from iter(DataLoader) to its first batch, per epoch, each epoch read to its end",
            "argv": subcommand_command("loader-start", argv), **provenance(started, config), "runs": rows}


if __name__ == "__main__":
    sys.exit(main())
