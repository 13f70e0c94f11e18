"""``python -m mcallreduce.bench report``: measure on the emulated cluster, model, write docs.

    sudo .venv/bin/python -m mcallreduce.bench report            # measure + model + docs (~15 min)
    .venv/bin/python -m mcallreduce.bench report --skip-measure  # re-model and re-write from docs/data

Steps: for every setup (hosts x ranks per host, default 4x2, 4x1, 8x1, 8x2) bring the
emulated cluster up (prefix ``mcrep``), calibrate the model on the first setup
(:mod:`mcallreduce.sim.calibrate`), run ``python -m mcallreduce.bench`` over all ranks
with multicolor, ring, mpi and mpi-ring (and stock Horovod through horovod.torch when
it is installed), then take the cluster down. Then predict every measured point with
the model, check the goals, predict the paper's scale, and write PNG plots
(docs/img/), raw JSON (docs/data/; the calibration is the package's built-in one,
mcallreduce/sim/calibration.json) and the section of docs/report.md between
``<!-- report:begin -->`` and ``<!-- report:end -->`` (the rest of the file is kept).

The steps are modules of their own: :mod:`.measure` (the sweep), :mod:`.model` (predictions
and goals), :mod:`.render` (plots and markdown).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from ...sim.model import CALIBRATION_FILE, link_bytes_per_s
from ..output import write_json
from .measure import ALGOS, measure, setup_name
from .model import goals, model_points, paper_scale, setup_model
from .render import BEGIN, END, markdown, plots, splice

__all__ = ["ALGOS", "BEGIN", "END", "goals", "main", "splice"]

REPO = Path(__file__).resolve().parents[3]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m mcallreduce.bench report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default="4x2,4x1,8x1,8x2", help="HOSTSxRANKS_PER_HOST, comma-separated")
    ap.add_argument("--sizes", default="4K,64K,1M,8M,32M")
    ap.add_argument("--big", default="128M", help="extra sizes for the first 1-rank-per-host 4-host setup ('' = none)")
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--prefix", default="mcrep", help="cluster name prefix (default %(default)s)")
    ap.add_argument("--iters", type=int, default=0,
                    help="timed iterations per size; 0 (default): about --seconds per (size, algorithm), "
                         "at least --min-iters (small sizes get up to 200: their medians need them)")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--min-iters", type=int, default=5,
                    help="with --iters 0, at least this many per size (default 5: the 32 MiB goals "
                         "are ratios of medians, and 3 calls of ~2 s moved them by 5-10 %%)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--skip-measure", action="store_true", help="only model and write, from the saved JSON")
    ap.add_argument("--latency-only", action="store_true",
                    help="re-run only the calibration and the per-setup barrier, keep the sweep's JSON")
    ap.add_argument("--skip-paper", action="store_true", help="no paper-scale predictions (slow: ~2 min)")
    ap.add_argument("--docs", default=str(REPO / "docs"))
    ns = ap.parse_args(argv)
    ns.setups = [tuple(int(x) for x in s.split("x")) for s in ns.setups.split(",") if s]
    return ns


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = parse_args(argv)
    docs = Path(ns.docs)
    data, img = docs / "data", docs / "img"
    if not ns.skip_measure:
        measure(ns, data)
    setups = []
    for hosts, rph in ns.setups:
        f = data / f"bench-{setup_name(hosts, rph)}.json"
        if f.exists():
            setups.append(json.loads(f.read_text()))
    if not setups:
        print("report: no measurements in docs/data (run without --skip-measure, as root)", file=sys.stderr)
        return 2
    cal_doc = json.loads(CALIBRATION_FILE.read_text())   # the built-in calibration: measure() refreshes it
    pts = model_points(setups, cal_doc.get("fit"))
    write_json(data / "model-vs-measured.json", pts)
    from ...sim.tuner import table
    tuning = {}
    for s in setups:
        tuning[s["setup"]] = table(setup_model(s, cal_doc.get("fit")), [4 << 10, 64 << 10, 1 << 20, 8 << 20])
    write_json(data / "tuning.json", {"calibration": cal_doc.get("fit"), "tables": tuning})
    paper_rows = []
    if not ns.skip_paper:
        paper_rows = paper_scale()
        write_json(data / "paper-scale.json", paper_rows)
    elif (data / "paper-scale.json").exists():
        paper_rows = json.loads((data / "paper-scale.json").read_text())
    made = plots(setups, pts, paper_rows, img)
    goal_rows = goals(setups, link_bytes_per_s(setups[0]["rate"]))
    splice(docs / "report.md", markdown(ns, setups, pts, cal_doc, paper_rows, made, goal_rows, tuning))
    print(f"report: wrote {docs / 'report.md'} and {', '.join(made)}", file=sys.stderr)
    for name, target, got, ok in goal_rows:
        print(f"  {name}: {got} (target {target}) {'ok' if ok else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
