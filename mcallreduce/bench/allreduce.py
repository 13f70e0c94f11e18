"""Allreduce benchmark in the nccl-tests style: one table, every algorithm, every size.

    python -m mcallreduce.launch -np 2 -- python -m mcallreduce.bench --sizes 4K,1M,64M

Per size: each algorithm is checked and warmed up, then timed iterations run
the algorithms in turn, each iteration in one of a balanced set of orders in which every
algorithm follows every other equally often, so background load on a shared machine
affects them alike. An iteration's time is the slowest rank's (a
collective is done when its last rank is); the table shows the median. algbw = size / time, busbw = algbw * 2(p-1)/p (nccl-tests), so busbw
can be compared with a link's bandwidth whatever the number of ranks. Every
size is verified against the exact sum of integer-valued data. ``cpu_s`` is the CPU
time one call costs a rank (user + system, every thread of the process, from
getrusage; median over the timed calls, mean over the ranks): a faster allreduce that
burns a core the backward pass or the JPEG decoder needed shows it there.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional

import numpy as np

from .. import mpit
from .._executor import MPI_SEND_COPY_RANKS
from ..config import ALGORITHMS
from ..sim.predict import busbw
from ..units import format_size, parse_sizes
from .output import command, pyplot, save_png, write_json
from .provenance import provenance, utc_now
from .timing import interleaved, iterations, whole_rounds

DEFAULT_ALGORITHMS = "multicolor,ring,mpi,mpi-ring"
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    from . import __main__ as entry   # its COMMANDS table dispatches (and lists) the subcommands
    ap = argparse.ArgumentParser(prog="python -m mcallreduce.bench", description=__doc__,
                                 epilog="subcommands (each has its own --help):\n" + entry.SUBCOMMANDS,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma-separated byte sizes (default {DEFAULT_SIZES})")
    ap.add_argument("--algorithms", default=DEFAULT_ALGORITHMS,
                    help=f"comma-separated subset of {', '.join(ALGORITHMS)} (default {DEFAULT_ALGORITHMS})")
    ap.add_argument("--dtype", default="float32", choices=["float16", "float32", "float64", "int32", "int64"])
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations per size (default 2)")
    ap.add_argument("--iters", type=int, default=0,
                    help="timed iterations per size; 0 = about --seconds worth, between --min-iters and 200 "
                         "(either rounded up to whole rounds of the arms' orders)")
    ap.add_argument("--min-iters", type=int, default=3,
                    help="with --iters 0: at least this many timed iterations per size (default 3)")
    ap.add_argument("--seconds", type=float, default=0.5, help="time budget per (size, algorithm) when --iters is 0")
    ap.add_argument("--buffers", default="cpu",
                    help="comma-separated: cpu (numpy arrays), cuda (torch CUDA tensors; every algorithm, the mpi "
                         "arms too, stages them through pinned host memory) (default cpu)")
    ap.add_argument("--no-check", action="store_true", help="skip mcallreduce's cross-rank metadata check")
    ap.add_argument("--nonblocking", action="store_true",
                    help="start each call nonblocking and wait for it, as the Horovod plugin and the DDP hook "
                         "call: allreduce_async for mcallreduce's algorithms, MPI_Iallreduce for the mpi arms (from a "
                         "copy of the buffer at 4 ranks and more, as the executor sends it); cpu buffers")
    ap.add_argument("--json", metavar="FILE", help="write one record per (algorithm, size)")
    ap.add_argument("--plot", metavar="FILE.png", help="plot busbw vs size")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--label", default="", help="free text stored in the JSON (e.g. the machine)")
    ns = ap.parse_args(argv)
    try:
        ns.sizes = parse_sizes(ns.sizes, "--sizes")
    except ValueError as exc:
        ap.error(str(exc))
    ns.algorithms = [a.strip() for a in ns.algorithms.split(",") if a.strip()]
    if not ns.sizes or not ns.algorithms:
        ap.error("--sizes and --algorithms each need at least one value")
    if ns.warmup < 0 or ns.iters < 0 or ns.min_iters < 1 or ns.seconds <= 0:
        ap.error("--warmup and --iters take 0 or more, --min-iters 1 or more, --seconds more than 0")
    ns.buffers = [b.strip() for b in ns.buffers.split(",") if b.strip()]
    if not ns.buffers or set(ns.buffers) - {"cpu", "cuda"}:
        ap.error(f"--buffers takes cpu and/or cuda, got {','.join(ns.buffers)!r}")
    if ns.nonblocking and ns.buffers != ["cpu"]:
        ap.error("--nonblocking times cpu buffers only")
    bad = [a for a in ns.algorithms if a not in ALGORITHMS]
    if bad:
        ap.error(f"unknown algorithm(s) {', '.join(bad)}; choose from {', '.join(ALGORITHMS)}")
    return ns


class Runner:
    """Runs one algorithm on one buffer; the "mpi" arms call MPI_Allreduce directly (on a GPU
    buffer, between a blocking copy to a pinned host mirror and one back, as a user would)."""

    def __init__(self, comm, ns: argparse.Namespace):
        from mpi4py import MPI

        from ..runtime import allreduce, allreduce_async

        self.MPI, self.comm, self.ns = MPI, comm, ns
        # imported once: an import statement per call costs microseconds
        self.allreduce, self.allreduce_async = allreduce, allreduce_async
        self.sends = {}
        self.mpi_comm = comm.Dup()
        self.ring_comm = mpit.forced_comm(comm, "ring") if "mpi-ring" in ns.algorithms else None

    def send_buffer(self, buf: np.ndarray):
        """What the mpi arms' MPI_Iallreduce sends from: as the executor, a copy from 4 ranks on
        (libnbc's reduce-scatter and allgather need one), else in place; one kept per size."""
        if self.comm.Get_size() < MPI_SEND_COPY_RANKS:
            return self.MPI.IN_PLACE
        send = self.sends.get((buf.size, buf.dtype))
        if send is None:
            send = self.sends[buf.size, buf.dtype] = np.empty_like(buf)
        np.copyto(send, buf)
        return send

    def available(self, algorithm: str, dtype: np.dtype) -> Optional[str]:
        """None, or why the algorithm cannot run here."""
        if algorithm.startswith("mpi") and self.MPI._typedict.get(dtype.char) is None:
            return f"MPI has no {dtype.name} type"
        if algorithm == "mpi-ring" and self.ns.nonblocking:
            return "MPI_Iallreduce is libnbc's own choice: the same call as mpi (docs/algorithms.md, \"mpi-ring\")"
        if algorithm == "mpi-ring" and self.ring_comm is None:
            return "needs Open MPI with MPI_T (and OMPI_MCA_coll_tuned_use_dynamic_rules=1 before MPI_Init)"
        return None

    def __call__(self, algorithm: str, buf, mirror=None) -> None:
        if algorithm in ("mpi", "mpi-ring"):
            comm = self.mpi_comm if algorithm == "mpi" else self.ring_comm
            if self.ns.nonblocking:
                comm.Iallreduce(self.send_buffer(buf), buf, op=self.MPI.SUM).Wait()
            elif mirror is None:
                comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
            else:
                mirror.copy_(buf)
                comm.Allreduce(self.MPI.IN_PLACE, mirror.numpy(), op=self.MPI.SUM)
                buf.copy_(mirror)
        elif self.ns.nonblocking:
            self.allreduce_async(buf, algorithm=algorithm, comm=self.comm, check=not self.ns.no_check).wait()
        else:
            self.allreduce(buf, algorithm=algorithm, comm=self.comm, check=not self.ns.no_check)


def measure_size(run: Runner, algorithms: List[str], size: int, ns: argparse.Namespace) -> List[Dict]:
    """Time every algorithm at one size, interleaved iteration by iteration.

    Interleaving (a, b, c, a, b, c, ...) exposes all algorithms to the same
    background load, so their ratios stay meaningful on a shared machine.
    """
    comm, MPI = run.comm, run.MPI
    p, rank = comm.Get_size(), comm.Get_rank()
    dtype = np.dtype(ns.dtype)
    count = max(1, size // dtype.itemsize)
    # Small integers: every sum is exact in every dtype, so correctness is bitwise.
    base = (np.arange(count, dtype=np.int64) % 13)
    data = (base + rank).astype(dtype)
    expected = (base * p + p * (p - 1) // 2).astype(dtype)
    bufs = {kind: buffer_of(kind, data, ns.local_rank) for kind in ns.buffers}
    mirrors = {kind: mirror_of(buf) for kind, buf in bufs.items()}
    names = [(a, kind) for kind in ns.buffers for a in algorithms]
    arms = [lambda a=a, kind=kind: run(a, bufs[kind], mirrors[kind] if a.startswith("mpi") else None)
            for a, kind in names]

    def reset() -> None:
        for buf in bufs.values():
            buf[...] = data if isinstance(buf, np.ndarray) else buf.new_tensor(data)

    correct = {}
    for name, arm in zip(names, arms):
        reset()
        arm()
        result = bufs[name[1]]
        result = result if isinstance(result, np.ndarray) else result.cpu().numpy()
        correct[name] = bool(comm.allreduce(int(np.array_equal(result, expected)), op=MPI.MIN))
        for _ in range(ns.warmup):
            reset()
            arm()
    iters = ns.iters
    if iters <= 0:   # ns.seconds per algorithm
        iters = iterations(comm, arms, ns.seconds * len(arms), ns.min_iters, cap=max(200, ns.min_iters))
    iters = whole_rounds(iters, len(arms))
    slowest, cpu = interleaved(comm, arms, iters, reset)
    cpu_mean = np.empty(len(names))
    comm.Allreduce(np.median(cpu, axis=0), cpu_mean, op=MPI.SUM)
    cpu_mean /= p
    records = []
    for j, (algorithm, kind) in enumerate(names):
        t = float(np.median(slowest[:, j]))
        algbw = count * dtype.itemsize / t
        records.append({"algorithm": algorithm, "size_bytes": int(count * dtype.itemsize), "count": int(count),
                        "dtype": dtype.name, "ranks": p, "iters": iters, "time_s": t,
                        "time_min_s": float(slowest[:, j].min()), "algbw_Bps": algbw,
                        "busbw_Bps": busbw(count * dtype.itemsize, t, p), "cpu_s": float(cpu_mean[j]),
                        "buffer": kind, "calls": "nonblocking" if ns.nonblocking else "blocking",
                        "correct": correct[algorithm, kind]})
    return records


def buffer_of(kind: str, data: np.ndarray, local_rank: int):
    """The benchmark's buffer: a numpy array, or a torch tensor on this rank's GPU (the host's
    GPUs dealt round-robin to its ranks)."""
    if kind == "cpu":
        return np.empty_like(data)
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("--buffers cuda: torch sees no CUDA device")
    return torch.from_numpy(data).to(torch.device("cuda", local_rank % torch.cuda.device_count()))


def mirror_of(buf):
    """The pinned host copy the mpi arms reduce a GPU buffer in (None for a host buffer)."""
    if isinstance(buf, np.ndarray):
        return None
    import torch
    return torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)


def table(records: List[Dict]) -> str:
    ring = {(r["size_bytes"], r.get("buffer")): r["time_s"] for r in records if r["algorithm"] == "ring"}
    lines = [f"{'size':>8} {'count':>11} {'algorithm':>11} {'buffer':>6} {'time(us)':>11} {'cpu(us)':>9} "
             f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'vs ring':>8} {'correct':>8}"]
    for r in records:
        if "skipped" in r:
            lines.append(f"{format_size(r['size_bytes']):>8} {'':>11} {r['algorithm']:>11}   skipped: {r['skipped']}")
            continue
        speed = ring.get((r["size_bytes"], r.get("buffer")))
        vs = f"{speed / r['time_s']:.2f}x" if speed else "-"
        lines.append(f"{format_size(r['size_bytes']):>8} {r['count']:>11} {r['algorithm']:>11} "
                     f"{r.get('buffer', 'cpu'):>6} {r['time_s'] * 1e6:>11.1f} "
                     f"{r['cpu_s'] * 1e6:>9.1f} "
                     f"{r['algbw_Bps'] / 1e9:>12.3f} {r['busbw_Bps'] / 1e9:>12.3f} {vs:>8} "
                     f"{'yes' if r['correct'] else 'FAIL':>8}")
    return "\n".join(lines)


def plot(records: List[Dict], path: str, title: str) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    buffers = set(r.get("buffer", "cpu") for r in records if "skipped" not in r)
    colors = {a: f"C{i}" for i, a in enumerate(dict.fromkeys(r["algorithm"] for r in records))}
    for algorithm, buffer in dict.fromkeys((r["algorithm"], r.get("buffer", "cpu")) for r in records):
        pts = sorted((r["size_bytes"], r["busbw_Bps"] / 1e9) for r in records
                     if (r["algorithm"], r.get("buffer", "cpu")) == (algorithm, buffer) and "skipped" not in r)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=colors[algorithm],
                    linestyle="--" if buffer == "cuda" else "-",
                    label=f"{algorithm} ({buffer})" if len(buffers) > 1 else algorithm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save_png(fig, path)


def main(argv: Optional[List[str]] = None) -> int:
    ns = parse_args(argv)
    started = utc_now()
    mpit.prepare()  # before MPI_Init: the mpi-ring arm, and multicolor's own choice of Open MPI's ring
    from mpi4py import MPI

    from ..context import Context

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    run = Runner(comm, ns)
    hosts = Context.get(comm).hosts
    ns.local_rank = next(host.index(rank) for host in hosts if rank in host)
    records: List[Dict] = []
    for i, size in enumerate(ns.sizes):
        if rank == 0 and not ns.quiet:  # progress (stderr keeps stdout a clean table)
            print(f"[{i + 1}/{len(ns.sizes)}] {format_size(size)}: {', '.join(ns.algorithms)}", file=sys.stderr, flush=True)
        runnable = []
        for algorithm in ns.algorithms:
            why = run.available(algorithm, np.dtype(ns.dtype))
            if why:
                records.append({"algorithm": algorithm, "size_bytes": size, "skipped": why})
            else:
                runnable.append(algorithm)
        for rec in measure_size(run, runnable, size, ns) if runnable else ():
            rec["hosts"] = len(hosts)
            records.append(rec)
    if rank == 0:
        title = (f"allreduce {ns.dtype}, {comm.Get_size()} ranks on {len(hosts)} host(s)"
                 + (", nonblocking calls" if ns.nonblocking else ""))
        print(f"# {title}; {MPI.Get_library_version().replace(chr(0), '').splitlines()[0].strip()}")
        print(table(records))
        failed = [r for r in records if r.get("correct") is False]
        if ns.json:
            write_json(ns.json, {"title": title, "label": ns.label, "argv": command(), "hosts": hosts,
                                 "mpi": MPI.Get_library_version().replace(chr(0), "").splitlines()[0].strip(),
                                 "environment": {k: v for k, v in sorted(os.environ.items())
                                                 if k.startswith(("MCALLREDUCE_", "OMPI_MCA_"))},
                                 **provenance(started), "records": records})
        if ns.plot:
            os.makedirs(os.path.dirname(os.path.abspath(ns.plot)), exist_ok=True)
            plot(records, ns.plot, title)
        if failed:
            print(f"# {len(failed)} result(s) FAILED verification", file=sys.stderr)
            return 1
    return 0
