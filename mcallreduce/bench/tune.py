"""``python -m mcallreduce.bench tune``: a tuning table from the cost model, or measured (``--measure``).

    .venv/bin/python -m mcallreduce.bench tune                       # emulated cluster, 4 and 8 hosts x 1, 2
    .venv/bin/python -m mcallreduce.bench tune --model paper --hosts 32 --ranks-per-host 4 --nics 2
    mpirun -np 4 .venv/bin/python -m mcallreduce.bench tune --measure --out tuning.json   # measured instead

For every layout and size, every candidate (colors, segment, hierarchy, route) of the
multicolor schedule is played on the cost model (:mod:`mcallreduce.sim`) and the
fastest is kept; the best ring is shown for comparison. The model is the emulated
cluster with the constants of the last calibration (mcallreduce/sim/calibration.json, or
``--calibration FILE``), or the paper-scale model (``--model paper``). The table is
written as JSON (``--out``, default docs/data/tuning.json): the format that
``MCALLREDUCE_TUNING_FILE`` names and :mod:`mcallreduce.tuning` reads at run time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from ..sim.model import load_calibration, paper
from ..sim.tuner import TUNING_FILE, default_model, table
from ..units import format_size, parse_rate, parse_sizes
from .output import write_json

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--measure" in argv:        # the measured table, under mpirun (tune_measure.py)
        from .tune_measure import main as measure_main
        argv.remove("--measure")
        return measure_main(argv)
    ap = argparse.ArgumentParser(prog="python -m mcallreduce.bench tune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("emulated", "paper"), default="emulated")
    ap.add_argument("--hosts", default="4,8")
    ap.add_argument("--ranks-per-host", default="1,2")
    ap.add_argument("--nics", type=int, default=1)
    ap.add_argument("--rate", default="200mbit", help="emulated model: NIC rate")
    ap.add_argument("--sizes", default=DEFAULT_SIZES)
    ap.add_argument("--calibration", help="calibration JSON (default: the built-in mcallreduce/sim/calibration.json)")
    ap.add_argument("--out", default=str(TUNING_FILE), help="JSON table to write ('-': none)")
    ns = ap.parse_args(argv)
    try:
        sizes = sorted(set(parse_sizes(ns.sizes, "--sizes")))   # a table holds one row per size
        hosts, ranks = (_counts(ns.hosts, "--hosts"), _counts(ns.ranks_per_host, "--ranks-per-host"))
        parse_rate(ns.rate, "--rate")
    except ValueError as exc:
        ap.error(str(exc))
    if not sizes or min(sizes) < 1 or ns.nics < 1:
        ap.error("--sizes needs at least one size, each of 1 byte or more; --nics 1 or more")
    try:
        cal = load_calibration(ns.calibration)
    except ValueError as exc:
        ap.error(str(exc))
    tables, models = {}, {}
    for h in hosts:
        for r in ranks:
            layout = [list(range(i * r, (i + 1) * r)) for i in range(h)]
            m = (paper(h, ns.nics, ranks_per_host=r) if ns.model == "paper"
                 else default_model(layout, cal, rate=ns.rate, rails=ns.nics))
            name = f"{h}h{r}r"
            rows = table(m, sizes)
            tables[name], models[name] = rows, m.to_dict()
            print(f"# {m.describe()}")
            print(f"{'size':>6} {'algorithm':>10} {'colors':>6} {'segment':>8} {'hier':>5} {'route':>5} {'pred ms':>9} {'ring ms':>9} {'vs ring':>8}")
            for row in rows:
                print(f"{format_size(row['size_bytes']):>6} {row['algorithm']:>10} {row['colors']:>6} {format_size(row['segment_bytes']):>8} "
                      f"{str(row['hierarchical'])[0]:>5} {row['route']:>5} {row['predicted_s'] * 1e3:>9.3f} "
                      f"{row['ring_predicted_s'] * 1e3:>9.3f} {row['speedup_vs_ring']:>7.2f}x")
            sys.stdout.flush()
    if ns.out != "-":
        out = Path(ns.out)
        write_json(out, {"model": ns.model, "calibration": cal, "models": models, "tables": tables})
        print(f"# wrote {out}", file=sys.stderr)
    return 0


def _counts(text: str, option: str) -> List[int]:
    """'4,8' -> [4, 8]: whole numbers of at least 1."""
    try:
        counts = [int(x) for x in text.split(",") if x]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"{option}: {text!r} is not a comma-separated list of whole numbers of 1 or more")
    return counts


if __name__ == "__main__":
    sys.exit(main())
