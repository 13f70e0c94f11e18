"""Calibrate the cost model's constants on the emulated cluster.

One MPI job (:func:`rank_main`, run with ``python -m mcallreduce.sim.calibrate rank``
on every host) measures, between ranks 0 and 1 on two different hosts (and ranks 0 and
1 on the same host when there are two ranks per host, ``--pairs``):

* ping-pong half round trips for 8 B .. 32 KiB -> ``alpha`` (the intercept of a
  least-squares line through time vs bytes);
* a one-way stream of 8 MiB messages -> ``nic_efficiency`` = achieved / configured rate;
* a simultaneous two-way exchange (Sendrecv) of the same size -> ``duplex`` (1.0: full duplex),
  a two-way exchange of 256 KiB segments, 4 in flight -> ``duplex_small`` (the factor for
  rendezvous messages below ``duplex_min_bytes``), and of 60 KiB segments, 8 in flight (sent
  eagerly: no clear-to-send to wait for) -> ``duplex_eager``;
* numpy's in-place add on 4 MiB float32 -> ``gamma`` (seconds per byte);
* mcallreduce's own engine: a 1-element ring allreduce on the two ranks (metadata check off),
  from which :func:`fit` solves ``overhead`` (CPU seconds per posted step) by bisection so
  that the simulator reproduces it: the executor's cost is measured, not assumed.

Ranks not taking part wait in ``Ibarrier`` + sleep, so they do not spin on the shared cores.
:func:`fit` turns the raw JSON into the dict :func:`mcallreduce.sim.model.emulated` takes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..config import inter_host_segment_bytes

__all__ = ["fit", "fit_line", "fit_overhead", "rank_main", "run_calibration"]

PING_SIZES = (8, 256, 1024, 2048, 4096, 16384, 32768)
FIT_SIZES = (256, 4096)   # alpha and the burst speed come from sizes the shaper's bucket passes
STREAM_BYTES = 8 << 20
SEGMENT_BYTES = 256 << 10


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple:
    """Least-squares (intercept, slope) of ys = a + b xs."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def fit_overhead(measured: float, model, itemsize: int = 4, nelem: int = 1,
                 lo: float = 0.0, hi: float = 2e-3) -> float:
    """The per-step overhead for which the model's 2-rank ring of ``nelem`` takes ``measured``."""
    from ..algorithms import Params, build_schedule
    from .simulate import simulate

    sched = build_schedule("ring", model.layout(), nelem, Params())

    def t(o: float) -> float:
        return simulate(sched, model.with_(overhead=o), itemsize).time

    if t(lo) >= measured:
        return lo
    for _ in range(50):
        mid = (lo + hi) / 2
        if t(mid) < measured:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def fit(raw: Dict, rate_Bps: float) -> Dict[str, float]:
    """Model constants from the raw measurements of :func:`rank_main`."""
    from .model import ClusterModel

    inter = raw["inter"]
    lo, hi = FIT_SIZES
    pts = [(s, t) for s, t in inter["pingpong"] if lo <= s <= hi]
    alpha, slope = fit_line([s for s, _ in pts], [t for _, t in pts])
    eff = inter["stream_Bps"] / rate_Bps
    out = {"alpha": max(alpha, 1e-6), "nic_efficiency": min(eff, 1.0),
           "peak_Bps": float(min(max(1.0 / max(slope, 1e-12), 50e6), 5e9)),
           "duplex": min(1.0, inter["exchange_Bps"] / inter["stream_Bps"]),
           "duplex_small": min(1.0, inter.get("seg_exchange_Bps", inter["exchange_Bps"]) / inter["stream_Bps"]),
           "duplex_eager": min(1.0, inter.get("eager_exchange_Bps", inter["stream_Bps"]) / inter["stream_Bps"]),
           "gamma": raw["gamma"]}
    intra = raw.get("intra")
    if intra:
        a, b = fit_line([s for s, _ in intra["pingpong"]], [t for _, t in intra["pingpong"]])
        out["intra_alpha"] = max(a, 1e-6)
        out["intra_Bps"] = intra["stream_Bps"]
    # the engine test ran while the machine was busy: its messages see the loaded latency
    # (a 2-rank barrier is one round), the rest of its time is the engine's per-step cost
    out["alpha_loaded"] = max(out["alpha"], inter.get("barrier_s", 0.0))
    two = ClusterModel(hosts=2, nic_Bps=rate_Bps * min(eff, 1.0), alpha=out["alpha_loaded"], gamma=out["gamma"],
                       burst_bytes=max(int(rate_Bps * 0.005), 128 * 1024), peak_Bps=out["peak_Bps"],
                       duplex=out["duplex"], duplex_small=out["duplex_small"],
                       duplex_eager=out["duplex_eager"], cores=raw.get("cores"))
    out["overhead"] = fit_overhead(raw["engine_ring_1elem_s"], two)
    return out


# ---------------------------------------------------------------- the MPI job
def _idle_wait(comm) -> None:
    """Wait for the others without spinning on the shared cores."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def _pingpong(comm, me: int, peer: int, size: int, reps: int) -> float:
    """Median half round trip of ``size`` bytes (after 5 untimed ones)."""
    buf = np.zeros(max(size, 1), np.uint8)
    times = []
    for i in range(reps + 5):
        t0 = time.perf_counter()
        if me < peer:
            comm.Send([buf, size, MPI_BYTE()], dest=peer, tag=7)
            comm.Recv([buf, size, MPI_BYTE()], source=peer, tag=7)
        else:
            comm.Recv([buf, size, MPI_BYTE()], source=peer, tag=7)
            comm.Send([buf, size, MPI_BYTE()], dest=peer, tag=7)
        if i >= 5:
            times.append((time.perf_counter() - t0) / 2)
    return float(np.median(times))


def MPI_BYTE():
    from mpi4py import MPI
    return MPI.BYTE


def _stream(comm, me: int, peer: int, nbytes: int, reps: int, both: bool) -> float:
    from mpi4py import MPI
    out, inn = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    comm.Sendrecv([out, 1], peer, 9, [inn, 1], peer, 9)
    t0 = time.perf_counter()
    for _ in range(reps):
        if both:
            comm.Sendrecv([out, MPI.BYTE], peer, 8, [inn, MPI.BYTE], peer, 8)
        elif me < peer:
            comm.Send([out, MPI.BYTE], dest=peer, tag=8)
        else:
            comm.Recv([inn, MPI.BYTE], source=peer, tag=8)
    comm.Sendrecv([out, 1], peer, 10, [inn, 1], peer, 10)   # the receiver has everything
    return nbytes * reps / (time.perf_counter() - t0)


def rank_main(argv: Optional[List[str]] = None) -> int:
    """Two ranks: ping-pong, one-way stream, two-way exchange, numpy add, engine ring; JSON on rank 0."""
    ap = argparse.ArgumentParser(prog="python -m mcallreduce.sim.calibrate rank")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--stream-reps", type=int, default=3)
    ns = ap.parse_args(argv)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        print("calibrate rank: run on exactly 2 ranks", file=sys.stderr)
        return 2
    me = comm.Get_rank()
    names = comm.allgather(MPI.Get_processor_name())
    raw: Dict = {"same_host": names[0] == names[1], "hosts": names}
    raw["pingpong"] = [(s, _pingpong(comm, me, 1 - me, s, ns.reps)) for s in PING_SIZES]
    raw["stream_Bps"] = _stream(comm, me, 1 - me, STREAM_BYTES, ns.stream_reps, both=False)
    raw["exchange_Bps"] = _stream(comm, me, 1 - me, STREAM_BYTES, ns.stream_reps, both=True)
    raw["seg_exchange_Bps"] = _seg_exchange(comm, 1 - me, SEGMENT_BYTES, 48, 4)
    # the runtime's inter-host segment (under the TCP eager limit: no rendezvous handshake)
    raw["eager_exchange_Bps"] = _seg_exchange(comm, 1 - me, inter_host_segment_bytes(), 192, 8)
    if me == 0:   # gamma: numpy in-place add while the peer sleeps
        a, b = np.ones(1 << 20, np.float32), np.ones(1 << 20, np.float32)
        np.add(a, b, out=a)
        t0 = time.perf_counter()
        for _ in range(20):
            np.add(a, b, out=a)
        raw["gamma"] = (time.perf_counter() - t0) / 20 / a.nbytes
    _idle_wait(comm)
    raw["barrier_s"] = _barrier(comm, ns.reps)
    from ..runtime import allreduce   # the engine: a 1-element ring allreduce, check off
    x = np.ones(1, np.float32)
    for _ in range(5):
        allreduce(x, algorithm="ring", check=False)
    times = []
    for _ in range(ns.reps):
        comm.Barrier()
        t0 = time.perf_counter()
        allreduce(x, algorithm="ring", check=False)
        times.append(time.perf_counter() - t0)
    worst = np.empty(len(times))
    comm.Allreduce(np.array(times), worst, op=MPI.MAX)
    raw["engine_ring_1elem_s"] = float(np.median(worst))
    if me == 0:
        print("CALIBRATION " + json.dumps(raw), flush=True)
    return 0


def _seg_exchange(comm, peer: int, seg: int, count: int, window: int) -> float:
    """Both ranks send ``count`` segments to each other, ``window`` in flight (the runtime's
    pipelined pattern): bytes per second and direction."""
    from mpi4py import MPI
    out = np.ones(seg * window, np.uint8)
    inn = np.zeros(seg * window, np.uint8)
    comm.Barrier()
    t0 = time.perf_counter()
    for base in range(0, count, window):
        reqs = []
        for k in range(min(window, count - base)):
            reqs.append(comm.Irecv([inn[k * seg:(k + 1) * seg], MPI.BYTE], peer, 11))
            reqs.append(comm.Isend([out[k * seg:(k + 1) * seg], MPI.BYTE], peer, 11))
        MPI.Request.Waitall(reqs)
    comm.Sendrecv([out, 1, MPI.BYTE], peer, 12, [inn, 1, MPI.BYTE], peer, 12)
    return seg * count / (time.perf_counter() - t0)


def _barrier(comm, reps: int) -> float:
    """Median MPI_Barrier time (slowest rank): one exchange round per log2(p) under this load."""
    from mpi4py import MPI
    for _ in range(5):
        comm.Barrier()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        comm.Barrier()
        times.append(time.perf_counter() - t0)
    worst = np.empty(len(times))
    comm.Allreduce(np.array(times), worst, op=MPI.MAX)
    return float(np.median(worst))


def barrier_main(argv: Optional[List[str]] = None) -> int:
    """All ranks of a setup: the per-round latency of small messages while every rank is in MPI."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    t = _barrier(comm, 40)
    if comm.Get_rank() == 0:
        print("BARRIER " + json.dumps({"ranks": comm.Get_size(), "barrier_s": t}), flush=True)
    return 0


def run_barrier(cluster, python: str = sys.executable, env: Optional[Dict[str, str]] = None,
                timeout: float = 120.0) -> Dict:
    proc = cluster.run([python, "-m", "mcallreduce.sim.calibrate", "barrier"], env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("BARRIER "):
            return json.loads(line[len("BARRIER "):])
    raise RuntimeError(f"barrier job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def loaded_alpha(barrier_s: float, ranks: int) -> float:
    """Per-round latency from a barrier time (Open MPI: recursive doubling / Bruck, ceil(log2 p) rounds)."""
    return barrier_s / max(1, int(np.ceil(np.log2(max(ranks, 2)))))


def _job(cluster, argv, extra, env, timeout) -> Dict:
    proc = cluster.run(argv, np=2, env=env, timeout=timeout, extra=extra)
    for line in proc.stdout.splitlines():
        if line.startswith("CALIBRATION "):
            return json.loads(line[len("CALIBRATION "):])
    raise RuntimeError(f"calibration job failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def run_calibration(cluster, python: str = sys.executable, timeout: float = 300.0,
                    env: Optional[Dict[str, str]] = None) -> Dict:
    """Two 2-rank jobs on ``cluster`` (a Cluster that is up): host 0 <-> host 1 and, with two
    ranks per host, the two ranks of host 0. Returns the raw dict :func:`fit` takes."""
    cfg = cluster.config()
    argv = [python, "-m", "mcallreduce.sim.calibrate", "rank"]
    inter = _job(cluster, argv, ["--map-by", "node"], env, timeout)
    raw = {"inter": inter, "gamma": inter["gamma"], "engine_ring_1elem_s": inter["engine_ring_1elem_s"],
           "rate": cfg.rate, "cores": None}
    if cfg.ranks_per_host > 1:
        raw["intra"] = _job(cluster, argv, [], env, timeout)
    return raw


if __name__ == "__main__":
    if sys.argv[1:2] == ["rank"]:
        sys.exit(rank_main(sys.argv[2:]))
    if sys.argv[1:2] == ["barrier"]:
        sys.exit(barrier_main(sys.argv[2:]))
    print("usage: python -m mcallreduce.sim.calibrate rank   (on 2 ranks)", file=sys.stderr)
    sys.exit(2)
