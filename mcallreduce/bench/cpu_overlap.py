"""``python -m mcallreduce.bench.cpu_overlap``: how often two busy processes in one CPU-capped
cgroup run at the same instant.

An emulated host's CPU budget (``cluster up --cpus-per-host``) is a CFS quota per period. Whether
a host under it still runs on two cores at once decides whether its progress thread and decode
workers run beside its training loop (docs/e2e-2ranks.md, "With a CPU budget per emulated host"). Two
processes spin in a fresh cgroup with the given cap, each noting the clock; a gap over 50 us
means it was off the CPU. Printed: the share of the wall time each was on a CPU, and the share
both were. ``--slice-us`` sets the kernel's ``sched_cfs_bandwidth_slice_us`` for the run and
restores it after. Root only.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

from ..cgroups import cap_cpu, cpu_hierarchy, write

SLICE_FILE = "/proc/sys/kernel/sched_cfs_bandwidth_slice_us"
GAP_NS = 50_000   # a pause this long between two clock reads: the process was descheduled

Runs = List[Tuple[int, int]]


def _spin(queue, procs_file: str, seconds: float) -> None:
    write(procs_file, str(os.getpid()))
    runs: Runs = []
    begin = last = time.monotonic_ns()
    end = begin + int(seconds * 1e9)
    while last < end:
        now = time.monotonic_ns()
        if now - last > GAP_NS:
            runs.append((begin, last))
            begin = now
        last = now
    runs.append((begin, last))
    queue.put(runs)


def both_running(a: Runs, b: Runs) -> int:
    """Nanoseconds during which both sorted lists of (start, end) intervals are running."""
    i = j = both = 0
    while i < len(a) and j < len(b):
        both += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both


def measure(cpus: float, period_ms: float, seconds: float) -> Tuple[float, float, float]:
    """(share on a CPU of process 1, of process 2, of both at once) under the cap."""
    hierarchy = cpu_hierarchy()
    if hierarchy is None:
        raise RuntimeError("no cpu cgroup hierarchy on this machine")
    path = hierarchy.ensure(f"mcallreduce-overlap-{os.getpid()}")
    try:
        cap_cpu(hierarchy, path, cpus, period_ms)
        queue = mp.get_context("fork").Queue()
        procs = [mp.get_context("fork").Process(target=_spin, args=(queue, os.path.join(path, "cgroup.procs"), seconds))
                 for _ in range(2)]
        for p in procs:
            p.start()
        a, b = queue.get(timeout=seconds + 30), queue.get(timeout=seconds + 30)
        for p in procs:
            p.join()
    finally:
        os.rmdir(path)
    wall = seconds * 1e9
    return (sum(e - s for s, e in a) / wall, sum(e - s for s, e in b) / wall, both_running(a, b) / wall)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mcallreduce.bench.cpu_overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpus", type=float, default=0.5, help="the cap, in cores (default %(default)s)")
    ap.add_argument("--period-ms", type=float, default=10.0, help="CFS period (default %(default)s)")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--slice-us", type=int, help="sched_cfs_bandwidth_slice_us for the run (default: as it is)")
    ns = ap.parse_args(argv)
    with open(SLICE_FILE) as f:
        saved = f.read().strip()
    try:
        if ns.slice_us is not None:
            write(SLICE_FILE, str(ns.slice_us))
        one, two, both = measure(ns.cpus, ns.period_ms, ns.seconds)
    finally:
        write(SLICE_FILE, saved)
    print(f"{ns.cpus:g} cores per {ns.period_ms:g} ms, slice {ns.slice_us or saved} us: each process on a CPU "
          f"{one:.2f}, {two:.2f} of the time; both at once {both:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
