"""``python -m mcallreduce.bench e2e``: the paper's ablation, end to end, on the emulated cluster.

Runs examples/pytorch_imagenet_resnet50.py (bench/example.py) once per arm per round, the arms alternated
within each round, on the emulated cluster (``cluster up`` first), and prints each arm's
img/s, epoch time and the share of each part of a step (data wait, forward/backward,
allreduce wait, optimizer, metrics), measured by the script on every rank, for the last
epoch and for that epoch after its first step (which also waits for the DataLoader's workers
to start, a wait that a real epoch of thousands of steps hides and a short one here does not):

- ``stock``: ``--data folder`` (ImageFolder from disk, DistributedSampler), stock Horovod;
- ``memory``: ``--data memory`` (the in-memory store and its sampler), stock Horovod;
- ``multicolor``: ``memory`` + ``MCALLREDUCE_ALGORITHM=multicolor``, no progress thread;
- ``thread``: ``multicolor`` with the progress thread on;
- ``local`` (not run unless named): ``memory`` without the gradient allreduce (``--local-gradients``),
  the ceiling that no allreduce can pass: the arms' ratios to it bound what a faster one could give.

An arm named ``ARM:NAME=VALUE[:NAME=VALUE...]`` is ARM with those variables added to its own, so
settings are compared in one run, alternated like the arms (``thread:MCALLREDUCE_BUCKET_BYTES=2M``);
a part that starts with ``--`` is a switch of the example's added to the arm's (``memory:--persistent-workers``).

With ``--read-limit``, the tree is copied onto a loop disk of its own, read through the
kernel's block throttle (data/throttle.py) at that many bytes/s per host (the whole job
gets hosts x that), and its pages are dropped from the page cache every ``--evict-every``
seconds, so every epoch of ``stock`` reads from storage, as on a cluster whose data set
exceeds its RAM. The memory arms open the tree packed once (``TREE.train.mcstore``,
``TREE.val.mcstore``, on the system disk): their one-time load is not in the epochs. With
``--stores-on-disk`` the stores sit on the throttled disk too, so that load reads through the
same limit; every run reports its slowest rank's seconds to open its data. With
``--cpu-by-thread`` every run also reports the cores each kind of thread used (bench/thread_cpu.py).

    python -m mcallreduce.bench.cluster up --hosts 4 --rate 200mbit [--cpus-per-host 0.5]
    python -m mcallreduce.bench e2e --tree /var/tmp/imagenet-like --read-limit 2M --runs 2 \\
        --json docs/data/e2e-4h200m.json --plot docs/img/e2e-4h200m.png -- --arch resnet18 --image-size 64
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import threading
from typing import Dict, List, Optional, Sequence

from .. import launch
from ..units import parse_size
from . import example, output
from .output import subcommand_command, write_json
from .provenance import provenance, utc_now
from .thread_cpu import KINDS, ThreadCpu
from .timing import alternated, split_arm

STOCK = {"MCALLREDUCE_HOROVOD": "0"}
MULTICOLOR = {"MCALLREDUCE_ALGORITHM": "multicolor"}
ARMS = {   # name: (--data, environment, more of the example's arguments)
    "stock": ("folder", STOCK, ()),
    "memory": ("memory", STOCK, ()),
    "multicolor": ("memory", {**MULTICOLOR, "MCALLREDUCE_PROGRESS_THREAD": "0"}, ()),
    "thread": ("memory", {**MULTICOLOR, "MCALLREDUCE_PROGRESS_THREAD": "1"}, ()),
    "local": ("memory", STOCK, ("--local-gradients",)),
}
DEFAULT_ARMS = ("stock", "memory", "multicolor", "thread")
PARTS = ("data", "forward_backward", "allreduce", "optimizer", "metrics")


def arm_settings(spec: str):
    """(--data, environment, more arguments) of an arm: a name of ARMS, or ``ARM:NAME=VALUE...``,
    where parts that start with ``--`` are the example's own switches."""
    base, *parts = spec.split(":")
    switches = tuple(p for p in parts if p.startswith("--"))
    base, added = split_arm(":".join([base, *(p for p in parts if not p.startswith("--"))]), tuple(ARMS))
    data, env, more = ARMS[base]
    return data, {**env, **added}, (*more, *switches)


class Evictor(threading.Thread):
    """Drops the tree's files from the page cache every ``interval`` seconds (they are clean)."""

    def __init__(self, roots: Sequence[str], interval: float):
        super().__init__(daemon=True, name="mcallreduce-evict")
        self.paths = [os.path.join(d, f) for root in roots for d, _, files in os.walk(root) for f in files]
        self.interval, self.stopped = interval, threading.Event()

    def run(self) -> None:
        from ..data.throttle import drop_page_cache
        while not self.stopped.wait(self.interval):
            drop_page_cache(self.paths)


def _shares(ranks: List[dict]) -> Dict[str, float]:
    return {part: statistics.mean(r[part] / sum(r.values()) for r in ranks) for part in PARTS}


def summarise(arm: str, metrics: dict, round_: int) -> dict:
    """The last epoch of a run (the first one carries start-up): img/s, epoch seconds, step shares;
    and the same after the epoch's first step (``steady``), which also waits for the DataLoader's
    workers to start: a real epoch of thousands of steps hides that wait, a short one here does not."""
    epoch = metrics["epochs"][-1]
    ranks = epoch["ranks"]
    row = {"arm": arm, "round": round_, "epoch": epoch["epoch"] + 1, "images": epoch["images"],
           "epoch_s": epoch["epoch_s"], "images_per_s": epoch["images_per_s"], "shares": _shares(ranks),
           "val_accuracy": epoch["val_accuracy"], "ranks": ranks, "data_open_s": max(metrics["data_open_s"])}
    if epoch.get("first_step_s") is not None and epoch["images"] > epoch["first_step_images"]:
        rest = [{p: r[p] - f[p] for p in PARTS} for r, f in zip(ranks, epoch["ranks_first_step"])]
        row["steady"] = {"seconds": epoch["epoch_s"] - epoch["first_step_s"],
                         "images": epoch["images"] - epoch["first_step_images"], "shares": _shares(rest),
                         "ranks": rest}
        row["steady"]["images_per_s"] = row["steady"]["images"] / row["steady"]["seconds"]
    return row


def _arm_table(by_arm: Dict[str, List[dict]], first_column: str, seconds_column: str) -> str:
    """One line per arm of its runs' ``images_per_s``, ``seconds`` and ``shares``, ratios to stock and
    memory, and to local (the ceiling) when it ran."""
    mean = {arm: statistics.mean(r["images_per_s"] for r in runs) for arm, runs in by_arm.items()}
    bases = ("stock", "memory") + (("local",) if "local" in mean else ())
    lines = [f"| {first_column} | img/s per run | img/s mean | {seconds_column} | "
             + "".join(f"vs {base} | " for base in bases) + " | ".join(PARTS) + " |",
             "|---|---|---:|---:|" + "---:|" * (len(bases) + len(PARTS))]
    for arm, runs in by_arm.items():
        ratios = [f"{mean[arm] / mean[base]:.2f}x" if base in mean else "-" for base in bases]
        shares = [statistics.mean(r["shares"][p] for r in runs) for p in PARTS]
        lines.append(f"| {arm} | " + ", ".join(f"{r['images_per_s']:.2f}" for r in runs)
                     + f" | {mean[arm]:.2f} | {statistics.mean(r['seconds'] for r in runs):.1f} | "
                     + " | ".join(ratios + [f"{100 * x:.0f}%" for x in shares]) + " |")
    return "\n".join(lines)


def table(rows: List[dict]) -> str:
    """The measured epoch of every run, by arm."""
    by_arm: Dict[str, List[dict]] = {}
    for row in rows:
        by_arm.setdefault(row["arm"], []).append({**row, "seconds": row["epoch_s"]})
    return _arm_table(by_arm, "arm", "epoch s")


def steady_table(rows: List[dict]) -> str:
    """The same runs after each epoch's first step (the DataLoader's workers started); empty when not recorded."""
    by_arm: Dict[str, List[dict]] = {}
    for row in rows:
        if "steady" in row:
            by_arm.setdefault(row["arm"], []).append(row["steady"])
    return _arm_table(by_arm, "arm, after the first step", "s") if by_arm else ""


def open_table(rows: List[dict]) -> str:
    """Per arm: the seconds its slowest rank took to open its data once (list the tree, or load
    the store), and that as epochs of the arm's own training."""
    lines = ["| arm | opening the data, s per run | in epochs of its training |", "|---|---|---:|"]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        runs = [r for r in rows if r["arm"] == arm]
        lines.append(f"| {arm} | " + ", ".join(f"{r['data_open_s']:.1f}" for r in runs)
                     + f" | {statistics.mean(r['data_open_s'] / r['epoch_s'] for r in runs):.2f} |")
    return "\n".join(lines)


def cpu_table(rows: List[dict]) -> str:
    """Per arm: the cores each kind of thread kept busy over a whole run (CPU s / wall s), system time apart."""
    def cores(runs: List[dict], seconds) -> float:
        return statistics.mean(seconds(c) / c["wall_s"] for c in runs)

    lines = ["| arm | run s | " + " | ".join(f"{k} cores (system)" for k in KINDS) + " | machine busy | machine idle |",
             "|---|---:|" + "---:|" * (len(KINDS) + 2)]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        runs = [r["cpu"] for r in rows if r["arm"] == arm]
        cells = [f"{cores(runs, lambda c: c['threads'][k]['user_s'] + c['threads'][k]['system_s']):.2f} "
                 f"({cores(runs, lambda c: c['threads'][k]['system_s']):.2f})" for k in KINDS]
        cells += [f"{cores(runs, lambda c: c['machine'][m]):.2f}" for m in ("busy_s", "idle_s")]
        lines.append(f"| {arm} | {statistics.mean(c['wall_s'] for c in runs):.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: List[dict], path: str) -> None:
    """Per arm: mean seconds per step of each part (stacked), img/s on top."""
    plt = output.pyplot()
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(arms)
    for part in PARTS:
        # a rank's seconds in the part, averaged over ranks and runs, as a fraction of the epoch
        heights = [statistics.mean(statistics.mean(rank[part] for rank in r["ranks"]) for r in rows if r["arm"] == a)
                   for a in arms]
        ax.bar(arms, heights, bottom=bottom, label=part.replace("_", "/"))
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, arm in enumerate(arms):
        ips = statistics.mean(r["images_per_s"] for r in rows if r["arm"] == arm)
        ax.text(i, bottom[i], f"{ips:.1f} img/s", ha="center", va="bottom")
    ax.set_ylabel("seconds per epoch and rank")
    ax.set_title("Where a training step's time goes (last epoch of each run)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))     # beside the bars, never over one
    output.save_png(fig, path)


def record(argv, config, per_host: int, rows: List[dict], started: str) -> dict:
    """The run's record; ``cluster`` holds the cluster's layout, rate and CPU budget."""
    return {"argv": subcommand_command("e2e", argv), "read_limit_per_host": per_host,
            **provenance(started, config), "runs": rows}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcallreduce.bench e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", required=True, help="holds train/ and val/ (made by make-imagenet-like if absent)")
    parser.add_argument("--train-per-class", type=int, default=64, help="when the tree is made here")
    parser.add_argument("--val-per-class", type=int, default=4, help="when the tree is made here")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma-separated, of {', '.join(ARMS)}; ARM:NAME=VALUE adds a variable to ARM's, "
                             "ARM:--SWITCH a switch of the example's")
    parser.add_argument("--runs", type=int, default=2, help="rounds; each runs every arm once, alternated")
    parser.add_argument("--read-limit", default="0", help="disk reads per host, bytes/s (suffixes K, M); 0: none")
    parser.add_argument("--evict-every", type=float, default=1.0,
                        help="with --read-limit: seconds between page-cache drops of the tree")
    parser.add_argument("--stores-on-disk", action="store_true",
                        help="with --read-limit: the memory arms load their packed stores through the throttle too")
    parser.add_argument("--epochs", type=int, default=2, help="per run; the last one is reported")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("-x", dest="env", action="append", default=[], metavar="NAME=VALUE",
                        help="exported to every arm's ranks, as mpirun -x (an arm's own variables win); repeatable")
    parser.add_argument("--cpu-by-thread", action="store_true",
                        help="sample every thread's CPU from /proc during each run (bench/thread_cpu.py)")
    parser.add_argument("--json", help="write the runs and the table here")
    parser.add_argument("--plot", help="write a PNG of the step split here")
    parser.add_argument("example_args", nargs=argparse.REMAINDER, help="-- then the example's arguments")
    ns = parser.parse_args(argv)
    ns.example_args = [a for a in ns.example_args if a != "--"]
    arms = [a for a in ns.arms.split(",") if a]
    try:
        settings = {arm: arm_settings(arm) for arm in arms}
    except ValueError as exc:
        parser.error(str(exc))
    extra_env = launch.exported_env(ns.env)
    from ..data.format import pack
    from ..data.photos import make_imagenet_like
    from ..data.throttle import LoopDisk, ReadLimit, ReadThrottle
    from .cluster import Cluster
    tree = os.path.abspath(ns.tree)
    if not os.path.isdir(os.path.join(tree, "train")):
        print(make_imagenet_like(tree, ns.train_per_class, ns.val_per_class), flush=True)
    # packed beside the tree, on the system disk; moved onto the throttled one with --stores-on-disk
    stores = {split: f"{tree}.{split}.mcstore" for split in ("train", "val")}
    for split, store in stores.items():
        if not os.path.exists(store):
            pack(os.path.join(tree, split), store, progress=False)
    cluster = Cluster()
    config = cluster.config()
    started = utc_now()
    if config is None:
        parser.error("no emulated cluster is up: python -m mcallreduce.bench.cluster up --hosts 4 --rate 200mbit")
    per_host = parse_size(ns.read_limit, "--read-limit")
    if ns.stores_on_disk and not per_host:
        parser.error("--stores-on-disk needs --read-limit: without a throttle the stores' disk is the system's")
    rows: List[dict] = []
    with contextlib.ExitStack() as stack:
        if per_host:     # the tree on a disk of its own, so the limit touches its reads only
            disk_tree = stack.enter_context(LoopDisk(tree, beside=list(stores.values()) if ns.stores_on_disk else ()))
            if ns.stores_on_disk:
                stores = {split: os.path.join(os.path.dirname(disk_tree), os.path.basename(store))
                          for split, store in stores.items()}
            throttle = ReadThrottle(disk_tree)
            budget = cluster.cpu_budget.hierarchy if config.cpus_per_host is not None else None
            if throttle.hierarchy.version == 2 and budget is not None and budget.version == 2:
                parser.error("--read-limit needs the ranks in the bench's io cgroup, and on cgroup v2 the hosts' "
                             "CPU budget (cluster up --cpus-per-host) moves them out of it: use one of the two")
            stack.enter_context(throttle).set(ReadLimit(bps=per_host * config.hosts))
        else:
            disk_tree = tree
        folders = {split: os.path.join(disk_tree, split) for split in ("train", "val")}
        if per_host:
            evictor = Evictor([os.path.dirname(disk_tree)], ns.evict_every)    # the tree, and the stores if there
            evictor.start()
            stack.callback(evictor.join)            # before the disk is unmounted (callbacks run last first)
            stack.callback(evictor.stopped.set)
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        for round_, arm in alternated(arms, ns.runs):
            data, env, more = settings[arm]
            dirs = folders if data == "folder" else stores
            sampler = ThreadCpu(str(example.EXAMPLE)) if ns.cpu_by_thread else None
            if sampler:
                sampler.start()
            run_started = utc_now()
            metrics = example.train(["--data", data, "--train-dir", dirs["train"], "--val-dir", dirs["val"],
                                     "--epochs", ns.epochs, *more, *ns.example_args],
                                    os.path.join(tmp, f"{arm}-{round_}"), {**extra_env, **env}, cluster=cluster,
                                    timeout=ns.timeout)
            row = {**summarise(arm, metrics, round_ + 1), "started": run_started}
            if sampler:
                row["cpu"] = sampler.stop()
            rows.append(row)
            if ns.json:     # after every run: a failure later keeps what was measured
                write_json(ns.json, record(argv, config, per_host, rows, started))
            steady = (f" ({row['steady']['images_per_s']:.2f} img/s after the first step)"
                      if "steady" in row else "")
            print(f"round {round_ + 1} {arm}: {row['images_per_s']:.2f} img/s{steady}, epoch {row['epoch_s']:.1f} s, "
                  + ", ".join(f"{p} {100 * s:.0f}%" for p, s in row["shares"].items()), flush=True)
    text = "\n\n".join(t for t in (table(rows), steady_table(rows), open_table(rows)) if t)
    if ns.cpu_by_thread:
        text += "\n\n" + cpu_table(rows)
    print(text)
    if ns.json:
        write_json(ns.json, {**record(argv, config, per_host, rows, started), "table": text})
    if ns.plot:
        plot(rows, ns.plot)
    return 0
