"""The report's sweep: every setup brought up on the emulated cluster, calibrated once, benchmarked."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List

from ...sim.model import CALIBRATION_FILE, link_bytes_per_s
from ..autogroups import state_word
from ..output import write_json
from ..provenance import machine, provenance, utc_now

REPO = Path(__file__).resolve().parents[3]
ALGOS = ("multicolor", "ring", "mpi", "mpi-ring")


def setup_name(hosts: int, rph: int) -> str:
    return f"{hosts}h{rph}r"


def measure(ns: argparse.Namespace, data: Path) -> None:
    from ..cluster import Cluster
    from ...sim.calibrate import fit, run_barrier, run_calibration

    py = sys.executable
    env = {"PYTHONPATH": str(REPO)}
    cluster = Cluster(ns.prefix)
    log = []
    autogroups = set()   # the kernel's setting while each setup was up (docs/cluster.md, "Autogroups")
    try:
        calibrated = False
        big_done = False
        for hosts, rph in ns.setups:
            t0, started = time.time(), utc_now()
            cluster.up(hosts, rate=ns.rate, ranks_per_host=rph)
            autogroups.add(state_word(cluster.autogroups.enabled()))
            if not calibrated:
                raw = run_calibration(cluster, python=py, env=env)
                cal = fit(raw, link_bytes_per_s(ns.rate))
                write_json(CALIBRATION_FILE, {"setup": setup_name(hosts, rph), "rate": ns.rate,
                                                       "raw": raw, "fit": cal})
                calibrated = True
            barrier = run_barrier(cluster, python=py, env=env)
            if ns.latency_only:
                f = data / f"bench-{setup_name(hosts, rph)}.json"
                doc = json.loads(f.read_text())
                doc["barrier"] = barrier
                write_json(f, doc)
                continue
            runs = [ns.sizes]
            if ns.big and rph == 1 and hosts == 4 and not big_done:
                runs.append(ns.big)
                big_done = True
            records: List[Dict] = []
            for k, sizes in enumerate(runs):
                out = data / f"bench-{setup_name(hosts, rph)}{'-big' if k else ''}.json"
                argv = [py, "-m", "mcallreduce.bench", "--sizes", sizes, "--algorithms", ",".join(ALGOS),
                        "--warmup", str(0 if k else ns.warmup), "--iters", str(2 if k else ns.iters),
                        "--seconds", str(ns.seconds), "--min-iters", str(ns.min_iters),
                        "--json", str(out), "--quiet",
                        "--label", f"emulated {hosts} hosts x {rph} ranks at {ns.rate}"]
                proc = cluster.run(argv, env=env, timeout=1200)
                if proc.returncode != 0:
                    raise RuntimeError(f"bench failed on {setup_name(hosts, rph)}:\n{proc.stdout[-3000:]}\n"
                                       f"{proc.stderr[-3000:]}")
                records += json.loads(out.read_text())["records"]
                out.unlink()
            if importlib.util.find_spec("horovod") is not None:
                records += measure_horovod(cluster, ns, env, data)
            write_json(data / f"bench-{setup_name(hosts, rph)}.json",
                       {"setup": setup_name(hosts, rph), "hosts": hosts, "ranks_per_host": rph,
                        "rate": ns.rate, "cpus": os.cpu_count(), "barrier": barrier,
                        **provenance(started, cluster.config()), "records": records})
            log.append(f"{setup_name(hosts, rph)}: {time.time() - t0:.0f} s")
            print(f"[report] {log[-1]}", file=sys.stderr, flush=True)
    finally:
        cluster.down()
    if not ns.latency_only:
        write_json(data / "sweep-log.json", {"log": log, "date": time.strftime("%Y-%m-%d %H:%M"),
                                             "autogroups": autogroups_word(autogroups), "machine": machine()})


def autogroups_word(words: set) -> str:
    """The kernel's autogroups over the sweep's setups: their one :func:`state_word`, or "mixed"."""
    return next(iter(words)) if len(words) == 1 else "mixed"


def measure_horovod(cluster, ns, env, data: Path) -> List[Dict]:
    """Stock Horovod's allreduce at the sweep's sizes (:mod:`.horovod_rank` on every rank)."""
    from ...units import parse_size
    sizes = ",".join(str(parse_size(s)) for s in ns.sizes.split(","))
    argv = [sys.executable, "-m", "mcallreduce.bench.report.horovod_rank", sizes, str(ns.iters), str(ns.seconds),
            str(ns.min_iters)]
    proc = cluster.run(argv, env=env, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("HOROVOD "):
            return json.loads(line[8:])
    print(f"[report] horovod run failed ({proc.returncode}): {proc.stderr[-500:]}", file=sys.stderr)
    return []
