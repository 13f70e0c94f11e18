"""The in-process executor: plays a schedule over p virtual ranks with numpy buffers.

It exists for fast, exhaustive tests of the very schedules the MPI runtime runs.
Sends are synchronous (a send completes only when its receive is posted), the
strictest MPI semantics, so a schedule that cannot deadlock here cannot deadlock
under MPI either; a stuck schedule raises :class:`DeadlockError`.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from .errors import DeadlockError
from .schedule import Op, Schedule, apply_reduce

__all__ = ["DeadlockError", "execute"]


def execute(schedule: Schedule, buffers: Sequence[np.ndarray],
            reduce: Callable = np.add) -> List[int]:
    """Run ``schedule`` in place on ``buffers`` (one per rank). Returns steps run per rank."""
    p = schedule.nranks
    if len(buffers) != p:
        raise ValueError(f"schedule is for {p} ranks, got {len(buffers)} buffers")
    progs = [prog.steps for prog in schedule.programs]
    scratch = [np.empty(prog.scratch_elems, dtype=buffers[0].dtype) for prog in schedule.programs]
    waiting = [[len(s.deps) for s in steps] for steps in progs]
    dependents = [prog.dependents for prog in schedule.programs]
    ready = [[i for i, n in enumerate(w) if n == 0] for w in waiting]
    posted_sends: Dict[Tuple[int, int, int], int] = {}   # (src, dst, tag) -> step index at src
    posted_recvs: Dict[Tuple[int, int, int], int] = {}   # (src, dst, tag) -> step index at dst
    done = [0] * p

    def complete(r: int, i: int) -> None:
        done[r] += 1
        for j in dependents[r][i]:
            waiting[r][j] -= 1
            if waiting[r][j] == 0:
                ready[r].append(j)

    def deliver(src: int, si: int, dst: int, ri: int) -> None:
        s, t = progs[src][si], progs[dst][ri]
        if s.count != t.count:
            raise RuntimeError(f"message {src}->{dst} tag {s.tag}: {s.count} sent, {t.count} expected")
        data = buffers[src][s.offset:s.offset + s.count]
        if t.op == Op.RECV:
            buffers[dst][t.offset:t.offset + t.count] = data
        else:
            scratch[dst][t.scratch:t.scratch + t.count] = data
        complete(src, si)
        complete(dst, ri)

    while any(ready):
        for r in range(p):
            batch, ready[r] = ready[r], []
            for i in batch:
                s = progs[r][i]
                if s.op == Op.REDUCE:
                    view = buffers[r][s.offset:s.offset + s.count]
                    apply_reduce(reduce, view, scratch[r][s.scratch:s.scratch + s.count], s)
                    complete(r, i)
                elif s.op == Op.SEND:
                    key = (r, s.peer, s.tag)
                    if key in posted_recvs:
                        deliver(r, i, s.peer, posted_recvs.pop(key))
                    else:
                        posted_sends[key] = i
                else:
                    key = (s.peer, r, s.tag)
                    if key in posted_sends:
                        deliver(s.peer, posted_sends.pop(key), r, i)
                    else:
                        posted_recvs[key] = i
    total = [len(s) for s in progs]
    if done != total:
        stuck = [r for r in range(p) if done[r] != total[r]]
        raise DeadlockError(f"{schedule.describe()} stuck on ranks {stuck}: "
                            f"{len(posted_sends)} sends and {len(posted_recvs)} receives unmatched")
    return done
