"""Lowering: one rank's schedule as the flat arrays the compiled executor runs (no MPI here).

A :class:`~mcallreduce.schedule.RankProgram` is a list of :class:`~mcallreduce.schedule.Step`
objects; the executor (mcallreduce/native/executor.c) wants plain integers. ``lower``
turns a program into

* ``steps``: an ``(n, 11)`` int64 array, one row per step, in the columns of :data:`COLUMNS`
  (``ndeps`` is the number of steps it waits for, ``incoming_left`` 0 or 1, ``color`` the
  step's color, -1 for a done message, ``phase`` that of :func:`phases`, and ``early`` 1
  for a step of :func:`early_steps`);
* ``dep_ptr``, ``dependents``: the dependents of every step in CSR form, so step ``i``'s
  dependents are ``dependents[dep_ptr[i]:dep_ptr[i + 1]]``, in the order
  :attr:`RankProgram.dependents` lists them.

Lowering also appends the *done* messages (zero bytes, tag ``done_tag``): to each peer this
rank sent data to, once those sends completed, and from each peer it received from. A rank
whose receives completed may still owe its senders protocol messages (the FIN of a
rendezvous get, queued when the shared-memory FIFO is full) that MPI sends only while the
rank is inside an MPI call; without the done messages it could return and leave a peer
waiting until it next calls MPI (with DDP on gloo in between: never).

The executor timestamps each color's phases with the color and phase columns, for the timeline.

Plans lower once and keep the result (mcallreduce/plan.py), as they keep the schedule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Dict, FrozenSet

import numpy as np

from .schedule import Op, RankProgram, Schedule, Step

#: an early message is at most this big on every rank, so an early receive of this capacity takes
#: any, a disagreeing peer's too (Open MPI 4.1 writes a too-long message past a receive's end)
EARLY_MAX_BYTES = 64 << 10

__all__ = ["COLUMNS", "EARLY_MAX_BYTES", "Lowered", "early_steps", "lower", "phases", "with_done_messages"]

COLUMNS = ("op", "peer", "offset", "count", "scratch", "tag", "ndeps", "incoming_left", "color", "phase", "early")
REDUCING, BROADCASTING = 0, 1


@dataclass(frozen=True)
class Lowered:
    steps: np.ndarray        # (n, len(COLUMNS)) int64
    dep_ptr: np.ndarray      # (n + 1,) int64
    dependents: np.ndarray   # (dep_ptr[-1],) int64
    scratch_elems: int


def with_done_messages(program: RankProgram, done_tag: int) -> RankProgram:
    """``program`` plus the done messages of the module docstring."""
    sends: dict = {}
    senders = []
    for i, s in enumerate(program.steps):
        if s.op == Op.SEND:
            sends.setdefault(s.peer, []).append(i)
        elif s.op in (Op.RECV, Op.RECV_SCRATCH) and s.peer not in senders:
            senders.append(s.peer)
    done = [Step(Op.SEND, peer, 0, 0, -1, done_tag, tuple(ids)) for peer, ids in sends.items()]
    done += [Step(Op.RECV, peer, 0, 0, -1, done_tag) for peer in senders]
    return RankProgram(program.rank, list(program.steps) + done, program.scratch_elems)


def phases(program: RankProgram) -> list:
    """Per step, whether it takes part in its color's reduction (REDUCING) or in handing out
    the result (BROADCASTING), on this rank.

    A receive into the buffer brings final values, so it and every step after it (by its
    dependencies) broadcast; on a rank that receives no final values of a color (the color's
    root), the sends after its last reduction of that color do. Everything else reduces.
    """
    steps = program.steps
    final = [False] * len(steps)
    receives, last_reduce = set(), {}
    for i, s in enumerate(steps):   # deps name earlier steps only
        final[i] = s.op == Op.RECV or any(final[d] for d in s.deps)
        if s.op == Op.RECV:
            receives.add(s.color)
        elif s.op == Op.REDUCE:
            last_reduce[s.color] = i
    return [BROADCASTING if final[i] or (s.op == Op.SEND and s.color not in receives
                                         and i > last_reduce.get(s.color, len(steps))) else REDUCING
            for i, s in enumerate(steps)]


def early_steps(schedule: Schedule, rank: int, max_count: int) -> FrozenSet[int]:
    """The steps of ``rank`` that may run before the metadata check (native/early.c): sends
    from the buffer and receives into scratch of at most ``max_count`` elements that wait for
    nothing, whose partner step on the peer (the same tag) is one too. Neither reads a value
    another rank has not agreed on, and neither writes the user's buffer; per peer both sides
    list them in the same tag order."""
    def free(program: RankProgram, op: Op, peer: int) -> Dict[int, int]:
        """tag -> step index of ``program``'s ``op`` steps with ``peer`` that wait for nothing."""
        return {s.tag: i for i, s in enumerate(program.steps) if s.op == op and s.peer == peer and not s.deps
                and 0 < s.count <= max_count}
    mine = schedule.programs[rank]
    peers = {s.peer for s in mine.steps if s.op in (Op.SEND, Op.RECV_SCRATCH)}
    early = set()
    for q in peers:
        other = schedule.programs[q]
        for own_op, peer_op in ((Op.SEND, Op.RECV_SCRATCH), (Op.RECV_SCRATCH, Op.SEND)):
            theirs = free(other, peer_op, rank)
            early.update(i for tag, i in free(mine, own_op, q).items() if tag in theirs)
    return frozenset(early)


def lower(program: RankProgram, done_tag: int, early: Collection[int] = ()) -> Lowered:
    """The flat arrays of ``program`` and its done messages (see the module docstring);
    ``early``: the steps of :func:`early_steps`."""
    own = len(program.steps)
    phase = phases(program)
    program = with_done_messages(program, done_tag)
    rows = [(int(s.op), s.peer, s.offset, s.count, s.scratch, s.tag, len(s.deps), int(s.incoming_left),
             s.color if i < own else -1, phase[i] if i < own else REDUCING, int(i in early))
            for i, s in enumerate(program.steps)]
    steps = np.array(rows, dtype=np.int64).reshape(len(rows), len(COLUMNS))
    dependents = program.dependents
    dep_ptr = np.zeros(len(dependents) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in dependents], out=dep_ptr[1:])
    flat = np.fromiter((j for d in dependents for j in d), dtype=np.int64, count=int(dep_ptr[-1]))
    return Lowered(steps, dep_ptr, flat, program.scratch_elems)
