"""``python -m mcallreduce.bench tune``: a tuning table from the cost model, or measured (``--measure``).

    .venv/bin/python -m mcallreduce.bench tune                       # emulated cluster, 4 and 8 hosts x 1, 2
    .venv/bin/python -m mcallreduce.bench tune --model paper --hosts 32 --ranks-per-host 4 --nics 2
    mpirun -np 4 .venv/bin/python -m mcallreduce.bench tune --measure --out tuning.json   # measured instead

For every layout and size, every candidate (colors, segment, hierarchy, route) of the
multicolor schedule is played on the cost model (:mod:`mcallreduce.sim`) and the
fastest is kept; the best ring is shown for comparison. The model is the emulated
cluster with the constants of the last calibration (docs/data/calibration.json, or
``--calibration FILE``), or the paper-scale model (``--model paper``). The table is
written as JSON (``--out``, default docs/data/tuning.json): the format that
``MCALLREDUCE_TUNING_FILE`` names and :mod:`mcallreduce.tuning` reads at run time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..sim.model import paper
from ..sim.tuner import TUNING_FILE, default_model, load_calibration, table
from ..units import format_size, parse_size
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
    ap.add_argument("--calibration", help="calibration JSON (default: docs/data/calibration.json)")
    ap.add_argument("--out", default=str(TUNING_FILE), help="JSON table to write ('-': none)")
    ns = ap.parse_args(argv)
    sizes = [parse_size(s) for s in ns.sizes.split(",") if s]
    cal = load_calibration(ns.calibration) or {}
    tables, models = {}, {}
    for h in (int(x) for x in ns.hosts.split(",")):
        for r in (int(x) for x in ns.ranks_per_host.split(",")):
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


if __name__ == "__main__":
    sys.exit(main())
