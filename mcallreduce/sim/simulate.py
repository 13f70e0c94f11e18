"""Discrete-event player of :class:`~mcallreduce.schedule.Schedule` objects on a :class:`ClusterModel`.

It walks the very schedules the MPI runtime executes, step by step, with the
runtime's semantics:

* a step becomes *ready* when the steps in its ``deps`` have completed; the rank's
  CPU (one thread, FIFO, optionally competing for ``model.cores`` shared cores)
  then spends ``overhead`` to post it, plus ``gamma`` per byte for a REDUCE. Shared
  cores are either FIFO servers that a rank holds only while it works, or, with
  ``model.polling`` (ranks that wait by polling, as MPI's progress loop does),
  processor-shared by all ranks at once: each rank's CPU work then takes
  max(1, ranks / cores) times as long;
* a message is matched by (src, dst, tag). Up to ``eager_bytes`` it leaves as soon as
  the SEND is posted and waits at the receiver if the RECV is not posted yet; larger
  messages are rendezvous: the data starts one round trip after both sides posted
  (``max(t_send + a, t_recv) + a``);
* the bytes cross a path of ports (sender NIC or memory port, leaf uplink and
  downlink when the hosts sit on different leaves with an oversubscribed switch,
  receiver NIC or memory port). Every port is a FIFO server at its bandwidth and the
  stages are cut-through: a message starts on a port when it has started on the
  previous one and the port is free, and finishes no earlier than on the previous
  port. The SEND completes when the first port has pushed the last byte; the RECV when
  the data arrived (``+ alpha``) and the RECV is posted.

Per-port FIFO serialization is the "simpler serialization per port" contention
model: it gets aggregate throughput and incast right and costs O(events log events),
so a 256-rank ring over a 25 MB bucket (130k messages) plays in seconds.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Collection, Dict, List, Optional, Sequence, Tuple

from ..errors import DeadlockError
from ..schedule import Op, Schedule
from .model import ClusterModel

__all__ = ["SimResult", "simulate", "DeadlockError"]

_CPU_DONE, _SEND_DONE, _ARRIVE = 0, 1, 2


@dataclass
class SimResult:
    time: float                       # when the last rank finished its last step
    finish: List[float]               # per rank
    messages: int
    bytes_on_nics: float              # inter-host bytes (payload)
    port_busy: Dict[tuple, float] = field(default_factory=dict)
    # The busiest shaped port's bytes at the sustained rate. Calls run back to back (a benchmark
    # loop, a training step's buckets) find the token bucket as the last call left it, not
    # full: over many calls none can average faster than this (:attr:`steady_time`).
    shaped_time: float = 0.0

    @property
    def steady_time(self) -> float:
        """Per-call time of this schedule repeated back to back."""
        return max(self.time, self.shaped_time)

    def busiest(self, n: int = 3) -> List[Tuple[tuple, float]]:
        return sorted(self.port_busy.items(), key=lambda kv: -kv[1])[:n]


def simulate(schedule: Schedule, model: ClusterModel, itemsize: int = 4,
             trace_ports: bool = False, gate: float = 0.0,
             early: Optional[Sequence[Collection[int]]] = None) -> SimResult:
    """Predicted completion time (seconds) of ``schedule`` on ``model``.

    ``gate``: no step starts before this time (the metadata check's), except each rank's steps in
    ``early`` (:func:`mcallreduce.lowering.early_steps`), which travel with the check (native/early.c).
    """
    m = model
    p = schedule.nranks
    if p != m.nranks:
        raise ValueError(f"schedule has {p} ranks, the model {m.nranks}")
    rph = m.ranks_per_host
    progs = [prog.steps for prog in schedule.programs]
    deps_left = [[len(s.deps) for s in steps] for steps in progs]
    dependents = [prog.dependents for prog in schedule.programs]
    remaining = sum(len(s) for s in progs)

    free: Dict[tuple, float] = {}
    busy: Dict[tuple, float] = {}
    rank_free = [0.0] * p
    cores = [0.0] * m.cores if m.cores else None
    # Polling ranks never leave the run queue: a rank that has work gets cores / p of a
    # core however little the others have to do (their waiting is spinning), so the
    # shared cores are modelled as processor sharing instead of a queue of work items.
    # The calibration's 2-rank ring ran on 2 cores (share 1): ``overhead`` stays a
    # per-step cost on a core of its own, and p <= cores changes nothing.
    share = 1.0
    if cores is not None and m.polling:
        share, cores = max(1.0, p / m.cores), None
    finish = [0.0] * p
    events: list = []
    seq = 0
    overhead, gamma = m.overhead, m.gamma
    nic_bw = m.nic_Bps * (m.nics if m.nic_policy == "stripe" else 1)
    leaf_bw = (m.hosts_per_switch * m.nics * m.nic_Bps / m.oversubscription) if m.hosts_per_switch else 0.0
    eager = m.eager_bytes
    burst, peak, duplex = float(m.burst_bytes), m.peak_Bps or float("inf"), m.duplex
    duplex_min, duplex_small, duplex_eager = m.duplex_min_bytes, m.duplex_small, m.duplex_eager
    tokens: Dict[tuple, float] = {}
    last_fin: Dict[tuple, float] = {}
    send_post: Dict[tuple, Tuple[float, int, int]] = {}
    recv_post: Dict[tuple, Tuple[float, int, int]] = {}
    arrived: Dict[tuple, float] = {}
    stats = {"messages": 0, "nic_bytes": 0.0}
    shaped: Dict[tuple, float] = {}   # per shaped port: its bytes' time at the sustained rate

    def push(t: float, kind: int, r: int, i, ) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, r, i))

    def cpu(r: int, t: float, dur: float) -> float:
        s = t if t > rank_free[r] else rank_free[r]
        dur *= share
        if cores is not None:
            c = heapq.heappop(cores)
            if c > s:
                s = c
            heapq.heappush(cores, s + dur)
        e = s + dur
        rank_free[r] = e
        return e

    early_sets = [frozenset(e) for e in early] if early is not None else [frozenset()] * p

    def ready(r: int, j: int, t: float) -> None:
        if t < gate and j not in early_sets[r]:
            t = gate
        s = progs[r][j]
        dur = overhead + (gamma * s.count * itemsize if s.op == Op.REDUCE else 0.0)
        push(cpu(r, t, dur), _CPU_DONE, r, j)

    def complete(r: int, i: int, t: float) -> None:
        nonlocal remaining
        remaining -= 1
        if t > finish[r]:
            finish[r] = t
        left = deps_left[r]
        for j in dependents[r][i]:
            left[j] -= 1
            if left[j] == 0:
                ready(r, j, t)

    def path(src: int, dst: int, color: int):
        hs, hd = src // rph, dst // rph
        if hs == hd:
            return ((("m>", src), m.intra_Bps), (("m<", dst), m.intra_Bps)), m.intra_alpha, False
        if m.nic_policy == "stripe":
            ns = nd = 0
        elif m.nic_policy == "rank":
            ns, nd = (src % rph) % m.nics, (dst % rph) % m.nics
        else:
            ns = nd = color % m.nics
        hops = [(("tx", hs, ns), nic_bw)]
        if leaf_bw:
            ls, ld = hs // m.hosts_per_switch, hd // m.hosts_per_switch
            if ls != ld:
                hops += [(("up", ls), leaf_bw), (("down", ld), leaf_bw)]
        hops.append((("rx", hd, nd), nic_bw))
        return hops, m.alpha, True

    def transfer(key: tuple, si: int, t0: float) -> None:
        src, dst, _ = key
        s = progs[src][si]
        nbytes = s.count * itemsize
        hops, lat, inter = path(src, dst, s.color)
        start = fin = t0
        first = None
        slow = 1.0
        if inter and last_fin.get((dst, src), 0.0) > t0:
            # the reverse direction is busy: a rendezvous message's clear-to-send queues behind its data
            slow = duplex_eager if nbytes <= eager else duplex if nbytes >= duplex_min else duplex_small
        for port, bw in hops:
            f0 = free.get(port, 0.0)
            st = start if start > f0 else f0
            rate, bw = bw, bw * slow
            if inter and burst and port[0] in ("tx", "rx"):
                tok = tokens.get(port, burst)
                if st > f0:
                    tok = min(burst, tok + (st - f0) * bw)
                d = max(nbytes / peak, (nbytes - tok) / bw)
                tokens[port] = min(burst, max(0.0, tok + d * bw - nbytes))
                shaped[port] = shaped.get(port, 0.0) + nbytes / rate   # seconds at the sustained rate
            else:
                d = nbytes / bw
            fi = st + d
            if fin > fi:
                fi = fin
            free[port] = fi
            if trace_ports:
                busy[port] = busy.get(port, 0.0) + d
            start, fin = st, fi
            if first is None:
                first = fi
        stats["messages"] += 1
        if inter:
            stats["nic_bytes"] += nbytes
            if fin > last_fin.get((src, dst), 0.0):
                last_fin[(src, dst)] = fin
        push(first, _SEND_DONE, src, si)
        push(fin + lat, _ARRIVE, dst, key)

    def latency(src: int, dst: int) -> float:
        return m.alpha if src // rph != dst // rph else m.intra_alpha

    for r in range(p):
        for j, s in enumerate(progs[r]):
            if not s.deps:
                ready(r, j, 0.0)

    while events:
        t, _, kind, r, i = heapq.heappop(events)
        if kind == _CPU_DONE:
            s = progs[r][i]
            op = s.op
            if op == Op.REDUCE:
                complete(r, i, t)
            elif op == Op.SEND:
                key = (r, s.peer, s.tag)
                if s.count * itemsize <= eager:
                    transfer(key, i, t)
                elif key in recv_post:
                    a = latency(r, s.peer)
                    tr = recv_post[key][0]
                    transfer(key, i, max(t + a, tr) + a)
                else:
                    send_post[key] = (t, r, i)
            else:
                key = (s.peer, r, s.tag)
                if key in arrived:
                    complete(r, i, max(t, arrived.pop(key)))
                    continue
                recv_post[key] = (t, r, i)
                sent = send_post.pop(key, None)
                if sent is not None:
                    a = latency(s.peer, r)
                    transfer(key, sent[2], max(sent[0] + a, t) + a)
        elif kind == _SEND_DONE:
            complete(r, i, t)
        else:  # _ARRIVE: r is the receiver, i the message key
            got = recv_post.pop(i, None)
            if got is None:
                arrived[i] = t
            else:
                complete(got[1], got[2], t)
    if remaining or arrived:
        raise DeadlockError(f"{schedule.describe()}: {remaining} steps never ran "
                            f"({len(send_post) + len(arrived)} sends, {len(recv_post)} receives unmatched)")
    return SimResult(max(finish) if finish else 0.0, finish, stats["messages"], stats["nic_bytes"], busy,
                     max(shaped.values(), default=0.0))
