"""Measurements on the emulated cluster: is the shaping right, and what does MPI get?

``check``: raw TCP throughput from host 0 to host 1 on every rail (a plain Python socket
sender/receiver, bounded in bytes and in time) against the configured rate.
``duplex``: MPI streams between two hosts, one way and both ways at once, per message size
(a message above the TCP eager limit waits for a clear-to-send that queues behind the
other direction's data). ``pingpong``: the latency of a message between host 0 and host 1
while the other ranks wait in MPI (whose progress loop polls) and while they sleep, which
is what a hop costs when ranks outnumber cores. ``allreduce``: MPI_Allreduce bus bandwidth
(busbw = size/time * 2(n-1)/n, the figure that a bandwidth-optimal allreduce drives to the
link rate) with Open MPI's default algorithm or its ring.

The rank-side and socket-side halves run as ``python -m mcallreduce.bench.cluster_measure ...``
inside the namespaces; the drivers (``check_main``, ``allreduce_main``) are called by the CLI of
mcallreduce.bench.cluster.
"""
from __future__ import annotations

import argparse
import json
import math
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence

from ..mpit import forced_env
from ..units import parse_size
from .netns import require_root, say
from .output import command, write_json
from .provenance import provenance, utc_now

CHUNK = 1 << 20
PORT = 5201


# ---------------------------------------------------------------- raw TCP (inside namespaces)
def tcp_receive(port: int, timeout: float) -> dict:
    """Accept one connection, read to EOF; time from the first byte to the last."""
    with socket.create_server(("0.0.0.0", port), reuse_port=False) as server:
        server.settimeout(timeout)
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout)
            buf = bytearray(CHUNK)
            received, first, last = 0, None, None
            while True:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                last = time.perf_counter()
                first = first or last
                received += n
    seconds = (last - first) if received else 0.0
    return {"bytes": received, "seconds": seconds}


def tcp_send(host: str, port: int, nbytes: int, seconds: float) -> None:
    """Send up to ``nbytes`` zero bytes, stopping early after ``seconds``."""
    deadline = time.monotonic() + seconds
    chunk = bytes(CHUNK)
    with socket.create_connection((host, port), timeout=seconds + 5) as conn:
        sent = 0
        while sent < nbytes and time.monotonic() < deadline:
            conn.sendall(chunk[: min(CHUNK, nbytes - sent)])
            sent += min(CHUNK, nbytes - sent)


def measure_tcp(cluster, src: int, dst: int, rail: int, seconds: float) -> float:
    """MB/s of one TCP stream from host ``src`` to host ``dst`` over ``rail``."""
    cfg = cluster.config()
    nbytes = int(min(cfg.rate_bytes_per_s * seconds, 1 << 30))
    me = [sys.executable, "-m", __name__]
    receiver = subprocess.Popen(
        cluster.host_command(dst, me + ["tcp-recv", "--port", str(PORT), "--timeout", str(seconds + 10)]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if receiver.stdout.readline().strip() != "ready":
            raise RuntimeError(f"TCP receiver on host {dst} did not start: {receiver.stderr.read()}")
        subprocess.run(cluster.host_command(src, me + [
            "tcp-send", "--host", cfg.host_address(dst, rail), "--port", str(PORT),
            "--bytes", str(nbytes), "--seconds", str(seconds * 2)]),
            check=True, timeout=seconds * 2 + 10)
        out, err = receiver.communicate(timeout=seconds + 10)
    finally:
        receiver.kill()
        receiver.wait()
    result = json.loads(out.strip().splitlines()[-1])
    return result["bytes"] / result["seconds"] / 1e6 if result["seconds"] else 0.0


def check_main(cluster, seconds: float = 3.0) -> int:
    require_root()
    cfg = cluster.config()
    if cfg is None or cfg.hosts < 2:
        print("check needs a cluster of at least 2 hosts that is up", file=sys.stderr)
        return 2
    configured = cfg.rate_bytes_per_s / 1e6
    for rail in range(cfg.rails):
        say(f"check: TCP host0 -> host1 on eth{rail} for up to {seconds:g}s")
        mbs = measure_tcp(cluster, 0, 1, rail, seconds)
        print(f"eth{rail} host0 -> host1: {mbs:.1f} MB/s raw TCP; configured {cfg.rate} = "
              f"{configured:.1f} MB/s ({100 * mbs / configured:.0f}%)")
    return 0


# ---------------------------------------------------------------- allreduce busbw
def allreduce_rank(sizes: Sequence[int], iters: Sequence[int]) -> None:
    """Rank side: time ``iters`` in-place float32 MPI_Allreduce calls per size; rank 0 prints JSON."""
    import numpy as np
    from mpi4py import MPI

    from ..sim.predict import busbw
    comm = MPI.COMM_WORLD
    n = comm.size
    for size, count in zip(sizes, iters):
        buf = np.ones(size // 4, dtype=np.float32)
        comm.Allreduce(MPI.IN_PLACE, buf)  # warm-up: connections, buffers
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(count):
            comm.Allreduce(MPI.IN_PLACE, buf)
        per_op = comm.allreduce((time.perf_counter() - start) / count, op=MPI.MAX)
        if comm.rank == 0:
            algbw = size / per_op / 1e6
            bus = busbw(size, per_op, n) / 1e6
            print(json.dumps({"bytes": size, "ranks": n, "iters": count, "seconds": per_op,
                              "algbw_MBps": algbw, "busbw_MBps": bus}), flush=True)


def measure_allreduce(cluster, sizes: Sequence[int], algorithm: str = "default",
                      target_seconds: float = 5.0, timeout: float = 600.0) -> list[dict]:
    """busbw of MPI_Allreduce on every rank of the cluster, one dict per size."""
    cfg = cluster.config()
    n = cfg.hosts * cfg.ranks_per_host
    # Enough iterations for ~target_seconds at the configured rate (3..50), so the
    # measurement is long against start-up noise yet bounded at slow rates.
    iters = [min(50, max(3, math.ceil(target_seconds * cfg.rate_bytes_per_s / (2 * s * max(n - 1, 1) / n))))
             for s in sizes]
    env = forced_env("ring") if algorithm == "ring" else {}
    argv = [sys.executable, "-m", __name__, "allreduce-rank",
            "--sizes", ",".join(map(str, sizes)), "--iters", ",".join(map(str, iters))]
    proc = cluster.run(argv, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"allreduce job failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for row in results:
        row["algorithm"] = algorithm
    return results


def _sizes(text: str, what: str, multiple: int = 1) -> List[int]:
    """Comma-separated sizes, each at least ``multiple`` bytes and a multiple of it."""
    sizes = [parse_size(s, what) for s in text.split(",")]
    for size in sizes:
        if size < multiple or size % multiple:
            raise ValueError(f"{what}: {size} bytes is not a positive multiple of {multiple}")
    return sizes


def allreduce_main(cluster, sizes: str, algorithm: str) -> int:
    byte_sizes = _sizes(sizes, "--sizes", 4)   # float32 elements
    require_root()
    cfg = cluster.config()
    if cfg is None:
        print("the cluster is not up", file=sys.stderr)
        return 2
    say(f"allreduce: {algorithm} algorithm, {cfg.hosts} hosts x {cfg.ranks_per_host} ranks at {cfg.rate}")
    for row in measure_allreduce(cluster, byte_sizes, algorithm):
        print(f"{algorithm:8} {row['bytes'] / (1 << 20):6.1f} MiB on {row['ranks']} ranks: "
              f"{row['seconds'] * 1e3:8.1f} ms  algbw {row['algbw_MBps']:6.1f} MB/s  "
              f"busbw {row['busbw_MBps']:6.1f} MB/s  (link {cfg.rate_bytes_per_s / 1e6:.1f} MB/s)")
    return 0


# ---------------------------------------------------------------- one connection, both ways
def duplex_rank(segments: Sequence[int], total: int, window: int) -> None:
    """Rank side, 2 ranks on 2 hosts: stream ``total`` bytes as messages of each segment size,
    ``window`` in flight (sliding), one way and then both ways at once; rank 0 prints JSON.

    This is what a tree or a star asks of a connection (both ends send bulk data) and
    what a ring does not (data one way, only protocol messages back).
    """
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    peer = 1 - comm.rank
    for seg in segments:
        count = max(1, total // seg)
        out, into = np.ones(seg * window, np.uint8), np.empty(seg * window, np.uint8)
        for both in (False, True):
            sending, receiving = both or comm.rank == 0, both or comm.rank == 1
            comm.Barrier()
            start = time.perf_counter()
            sent = received = 0
            reqs, kinds = [], []
            while True:
                while sending and sent < count and kinds.count("s") < window:
                    k = sent % window
                    reqs.append(comm.Isend([out[k * seg:(k + 1) * seg], MPI.BYTE], peer, 5))
                    kinds.append("s")
                    sent += 1
                while receiving and received < count and kinds.count("r") < window:
                    k = received % window
                    reqs.append(comm.Irecv([into[k * seg:(k + 1) * seg], MPI.BYTE], peer, 5))
                    kinds.append("r")
                    received += 1
                if not reqs:
                    break
                done = set(MPI.Request.Waitsome(reqs))   # blocks in MPI: no Python spinning
                reqs = [r for i, r in enumerate(reqs) if i not in done]
                kinds = [x for i, x in enumerate(kinds) if i not in done]
            comm.Barrier()
            seconds = time.perf_counter() - start
            if comm.rank == 0:
                print(json.dumps({"segment": seg, "both": both, "bytes": count * seg, "seconds": seconds,
                                  "MBps_per_direction": count * seg / seconds / 1e6}), flush=True)


def pingpong_rank(nbytes: int, count: int) -> None:
    """Rank side: ranks 0 and 1 (hosts 0 and 1 with --map-by node) ping-pong ``count``
    messages of ``nbytes``, first while every other rank waits in a blocking MPI receive,
    then while they sleep (a nonblocking receive tested every millisecond); rank 0 prints JSON."""
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    buf = np.ones(max(1, nbytes), np.uint8)
    for others in ("wait in MPI", "sleep"):
        comm.Barrier()
        if rank >= 2:
            if others == "wait in MPI":
                comm.recv(source=0, tag=8)
            else:
                req = comm.irecv(source=0, tag=8)
                while not req.Test():
                    time.sleep(1e-3)
            continue
        peer = 1 - rank
        for timed in (False, True):
            start = time.perf_counter()
            for _ in range(count if timed else 10):
                if rank == 0:
                    comm.Send(buf, peer, tag=7)
                    comm.Recv(buf, peer, tag=7)
                else:
                    comm.Recv(buf, peer, tag=7)
                    comm.Send(buf, peer, tag=7)
        seconds = time.perf_counter() - start
        if rank == 0:
            for q in range(2, comm.Get_size()):
                comm.send(None, q, tag=8)
            print(json.dumps({"others": others, "ranks": comm.Get_size(), "bytes": nbytes,
                              "us_per_message": seconds / count / 2 * 1e6}), flush=True)


def _two_hosts(cluster):
    """The config of a cluster that is up with at least 2 hosts (as root), or None, said why."""
    require_root()
    cfg = cluster.config()
    if cfg is None or cfg.hosts < 2:
        print("the cluster is not up with at least 2 hosts", file=sys.stderr)
        return None
    return cfg


def _rank_job(cluster, action: str, args: List[str], np: int) -> Optional[List[dict]]:
    """Run ``<action>-rank`` of this module on ``np`` ranks placed by node (rank 0 on host 0,
    rank 1 on host 1); the JSON lines rank 0 printed, or None (said why)."""
    argv = [sys.executable, "-m", __name__, f"{action}-rank", *args]
    proc = cluster.run(argv, np=np, extra=["--map-by", "node"], timeout=600)
    if proc.returncode != 0:
        print(f"{action} job failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}", file=sys.stderr)
        return None
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def pingpong_main(cluster, size: str, count: int, np: Optional[int]) -> int:
    """``cluster pingpong``: host 0 <-> host 1 latency with the other ranks waiting vs sleeping."""
    cfg = _two_hosts(cluster)
    if cfg is None:
        return 2
    ranks = cfg.hosts * cfg.ranks_per_host if np is None else np
    say(f"pingpong: host 0 <-> host 1 at {cfg.rate}, {parse_size(size)} B, {count} round trips, {ranks} ranks")
    rows = _rank_job(cluster, "pingpong", ["--bytes", str(parse_size(size)), "--count", str(count)], ranks)
    if rows is None:
        return 1
    print(f"{'other ranks':<14} {'us per message':>15}")
    for row in rows:
        print(f"{row['others']:<14} {row['us_per_message']:>15.1f}")
    return 0


def duplex_main(cluster, segments: str, total: str, window: int, json_path: Optional[str] = None) -> int:
    """``cluster duplex``: one-way vs two-way MPI streams between host 0 and host 1; with
    ``json_path``, the rows are also written there."""
    segment_sizes, (total_bytes,) = _sizes(segments, "--segments"), _sizes(total, "--bytes")
    cfg = _two_hosts(cluster)
    if cfg is None:
        return 2
    started = utc_now()
    say(f"duplex: host 0 <-> host 1 at {cfg.rate}, {window} messages in flight per direction")
    rows = _rank_job(cluster, "duplex", ["--segments", ",".join(map(str, segment_sizes)),
                                         "--bytes", str(total_bytes), "--window", str(window)], 2)
    if rows is None:
        return 1
    print(f"{'segment':>9} {'one way MB/s':>13} {'both ways MB/s':>15} {'ratio':>6}")
    for seg in dict.fromkeys(r["segment"] for r in rows):
        one = next(r["MBps_per_direction"] for r in rows if r["segment"] == seg and not r["both"])
        two = next(r["MBps_per_direction"] for r in rows if r["segment"] == seg and r["both"])
        print(f"{seg:>9} {one:>13.1f} {two:>15.1f} {two / one:>6.2f}")
    if json_path:
        write_json(json_path, {"argv": command(), **provenance(started, cfg), "rate": cfg.rate, "window": window,
                               "bytes_per_direction": total_bytes, "rows": rows})
    return 0


def main(args: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcallreduce.bench.cluster_measure")
    sub = parser.add_subparsers(dest="action", required=True)
    p_recv = sub.add_parser("tcp-recv")
    p_recv.add_argument("--port", type=int, default=PORT)
    p_recv.add_argument("--timeout", type=float, default=30.0)
    p_send = sub.add_parser("tcp-send")
    p_send.add_argument("--host", required=True)
    p_send.add_argument("--port", type=int, default=PORT)
    p_send.add_argument("--bytes", type=int, required=True)
    p_send.add_argument("--seconds", type=float, default=10.0)
    p_rank = sub.add_parser("allreduce-rank")
    p_rank.add_argument("--sizes", required=True, help="bytes, comma-separated")
    p_rank.add_argument("--iters", required=True, help="iterations per size, comma-separated")
    p_duplex = sub.add_parser("duplex-rank")
    p_duplex.add_argument("--segments", required=True, help="bytes, comma-separated")
    p_duplex.add_argument("--bytes", type=int, required=True)
    p_duplex.add_argument("--window", type=int, default=8)
    p_pp = sub.add_parser("pingpong-rank")
    p_pp.add_argument("--bytes", type=int, required=True)
    p_pp.add_argument("--count", type=int, required=True)
    ns = parser.parse_args(args)
    if ns.action == "pingpong-rank":
        pingpong_rank(ns.bytes, ns.count)
    elif ns.action == "duplex-rank":
        duplex_rank([int(s) for s in ns.segments.split(",")], ns.bytes, ns.window)
    elif ns.action == "tcp-recv":
        print(json.dumps(tcp_receive(ns.port, ns.timeout)), flush=True)
    elif ns.action == "tcp-send":
        tcp_send(ns.host, ns.port, ns.bytes, ns.seconds)
    else:
        allreduce_rank([int(s) for s in ns.sizes.split(",")], [int(i) for i in ns.iters.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
