"""Allreduce schedules: what each rank sends, receives and reduces, and in what order.

A schedule is pure data (no MPI): for every rank, a list of :class:`Step` over
element ranges of the user's buffer and of a per-rank scratch area. Each step
names the earlier steps of the same rank it must wait for (``deps``), so one
schedule can be executed by three engines that agree by construction:

* ``mcallreduce.runtime``  posts the steps as nonblocking MPI point-to-point calls,
* ``mcallreduce.inprocess`` plays them in-process over p virtual ranks (tests),
* ``mcallreduce.sim``      times them on a modelled network (cost model).

Algorithms never write steps or dependencies by hand. They call
:meth:`Builder.transfer` ("send this range from a to b, and add it into b's copy"
or "overwrite b's copy"); the builder emits the matching SEND/RECV pair with a
shared tag, gives reductions a scratch slot, and :meth:`Builder.build` derives
every dependency from read/write hazards on buffer and scratch ranges. That is
what keeps pipelining and concurrent colors correct without any algorithm
reasoning about them: two steps wait for each other only if they touch the
same elements and at least one of them writes.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import cached_property
from enum import IntEnum
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Op", "Step", "RankProgram", "Schedule", "Builder", "split_even", "segments", "apply_reduce"]


class Op(IntEnum):
    SEND = 0          # send buf[offset:offset+count] to peer
    RECV = 1          # receive from peer into buf[offset:offset+count] (overwrite)
    RECV_SCRATCH = 2  # receive from peer into scratch[scratch:scratch+count]
    REDUCE = 3        # buf[offset:+count] = op(buf[offset:+count], scratch[scratch:+count])
                      # (operands swapped when the step's ``incoming_left`` is set)


@dataclass(frozen=True)
class Step:
    op: Op
    peer: int      # the other rank (-1 for REDUCE)
    offset: int    # element offset in the user buffer (-1 for RECV_SCRATCH)
    count: int     # number of elements
    scratch: int   # element offset in the rank's scratch area (-1 if unused)
    tag: int       # message tag, unique per ordered (src, dst) pair within the schedule
    deps: Tuple[int, ...] = ()  # indices of earlier steps of this rank to complete first
    color: int = 0  # which color/channel the step belongs to (reports and the cost model)
    # REDUCE only: the received data is the left operand, op(scratch, buf). Algorithms in
    # which two ranks compute the same value (recursive doubling) order the operands by
    # rank on both sides, so min/max of signed zeros and NaN payloads agree bitwise too.
    incoming_left: bool = False


def apply_reduce(ufunc, view, incoming, step: Step) -> None:
    """Execute a REDUCE step in place: view = op(view, incoming), or op(incoming, view)
    when the step is ``incoming_left`` (every engine that runs schedules calls this)."""
    if step.incoming_left:
        ufunc(incoming, view, out=view)
    else:
        ufunc(view, incoming, out=view)


@dataclass
class RankProgram:
    rank: int
    steps: List[Step]
    scratch_elems: int  # size of the scratch area this rank needs, in elements

    @cached_property
    def dependents(self) -> List[List[int]]:
        """dependents[i]: the steps that list step i in their deps (executors walk this)."""
        out: List[List[int]] = [[] for _ in self.steps]
        for i, s in enumerate(self.steps):
            for d in s.deps:
                out[d].append(i)
        return out


@dataclass
class Schedule:
    """Per-rank programs of one allreduce of ``nelem`` elements over ``nranks`` ranks."""

    algorithm: str
    nranks: int
    nelem: int
    programs: List[RankProgram]
    params: Dict[str, object] = field(default_factory=dict)

    @property
    def max_tag(self) -> int:
        return max((s.tag for p in self.programs for s in p.steps), default=-1)

    def bytes_sent(self, rank: int, itemsize: int) -> int:
        return itemsize * sum(s.count for s in self.programs[rank].steps if s.op == Op.SEND)

    def describe(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.algorithm}({params})"


def split_even(n: int, parts: int) -> List[Tuple[int, int]]:
    """Split range(n) into ``parts`` contiguous (offset, count) slices differing by at most 1."""
    base, extra = divmod(n, parts)
    out, off = [], 0
    for i in range(parts):
        cnt = base + (1 if i < extra else 0)
        out.append((off, cnt))
        off += cnt
    return out


def segments(offset: int, count: int, seg: int) -> List[Tuple[int, int]]:
    """Cut [offset, offset+count) into pieces of at most ``seg`` elements (none if count is 0)."""
    if seg <= 0:
        seg = max(count, 1)
    return [(o, min(seg, offset + count - o)) for o in range(offset, offset + count, seg)]


class _Hazards:
    """Last writer and readers-since-write per elementary interval of one address space."""

    def __init__(self, bounds: Sequence[int]):
        self.bounds = list(bounds)
        self.writer: List[int] = [-1] * len(self.bounds)
        self.readers: List[List[int]] = [[] for _ in self.bounds]

    def _pieces(self, off: int, cnt: int) -> range:
        lo = bisect.bisect_left(self.bounds, off)
        hi = bisect.bisect_left(self.bounds, off + cnt)
        return range(lo, hi)

    def access(self, idx: int, off: int, cnt: int, read: bool, write: bool, deps: set) -> None:
        for piece in self._pieces(off, cnt):
            if self.writer[piece] >= 0:
                deps.add(self.writer[piece])           # read-after-write / write-after-write
            if write:
                deps.update(self.readers[piece])       # write-after-read
                self.writer[piece] = idx
                self.readers[piece] = []
            elif read:
                self.readers[piece].append(idx)


class Builder:
    """Collects transfers for all ranks, then derives tags, scratch slots and dependencies.

    ``depth`` is the number of scratch slots per (receiver, sender, color, lane): how
    many segments from one peer may be in flight before the receiver must have reduced
    the oldest one. It bounds scratch memory to depth x segment per peer, color and
    lane. A lane is a stream within a color that gets slots of its own (a ring's
    chunks: each chunk's segments then pipeline as they do in a flat ring).
    """

    def __init__(self, nranks: int, nelem: int, depth: int = 4):
        self.nranks = nranks
        self.nelem = nelem
        self.depth = max(1, depth)
        self._ops: List[List[tuple]] = [[] for _ in range(nranks)]
        self._tags: Dict[Tuple[int, int], int] = {}
        self._slot_use: Dict[Tuple[int, int, int, int], int] = {}    # (dst, src, color, lane) -> uses
        self._slot_size: Dict[Tuple[int, int, int, int], int] = {}   # (dst, src, color, lane) -> max count

    def transfer(self, src: int, dst: int, offset: int, count: int, reduce: bool, color: int = 0,
                 incoming_left: bool = False, lane: int = 0) -> None:
        """Move buf[offset:+count] from ``src`` to ``dst``; add it into dst's copy if ``reduce``.

        ``incoming_left`` makes the reduction op(src's data, dst's data) instead of
        op(dst's data, src's data).
        """
        if count <= 0 or src == dst:
            return
        tag = self._send(src, dst, offset, count, color)
        self._receive(src, dst, offset, count, tag, reduce, color, incoming_left, lane)

    def exchange(self, a: int, b: int, offset: int, count: int, color: int = 0) -> None:
        """Ranks ``a`` and ``b`` swap buf[offset:+count] and both reduce it, operands in rank order.

        Both sends come before both receives in program order, so each rank sends
        its own data, not what it has just reduced; both ranks then compute
        op(lower rank's data, higher rank's data) and hold bitwise equal results.
        """
        if count <= 0 or a == b:
            return
        tag_ab = self._send(a, b, offset, count, color)
        tag_ba = self._send(b, a, offset, count, color)
        self._receive(a, b, offset, count, tag_ab, True, color, incoming_left=a < b)
        self._receive(b, a, offset, count, tag_ba, True, color, incoming_left=b < a)

    def _send(self, src: int, dst: int, offset: int, count: int, color: int) -> int:
        tag = self._tags.get((src, dst), 0)
        self._tags[(src, dst)] = tag + 1
        self._ops[src].append((Op.SEND, dst, offset, count, None, tag, color, False))
        return tag

    def _receive(self, src: int, dst: int, offset: int, count: int, tag: int, reduce: bool,
                 color: int, incoming_left: bool, lane: int = 0) -> None:
        if reduce:
            key = (dst, src, color, lane)
            use = self._slot_use.get(key, 0)
            self._slot_use[key] = use + 1
            self._slot_size[key] = max(self._slot_size.get(key, 0), count)
            slot = (key, use % self.depth)
            self._ops[dst].append((Op.RECV_SCRATCH, src, -1, count, slot, tag, color, False))
            self._ops[dst].append((Op.REDUCE, -1, offset, count, slot, -1, color, incoming_left))
        else:
            self._ops[dst].append((Op.RECV, src, offset, count, None, tag, color, False))

    def build(self, algorithm: str, **params) -> Schedule:
        programs = [self._build_rank(r) for r in range(self.nranks)]
        return Schedule(algorithm, self.nranks, self.nelem, programs, dict(params))

    def _build_rank(self, rank: int) -> RankProgram:
        ops = self._ops[rank]
        # Lay out this rank's scratch slots: one region per (sender, color, lane), depth slots each,
        # or as many as it has receives (an unsegmented schedule's one receive needs one slot).
        base: Dict[Tuple[int, int, int, int], int] = {}
        total = 0
        for key in sorted(k for k in self._slot_size if k[0] == rank):
            base[key] = total
            total += min(self.depth, self._slot_use[key]) * self._slot_size[key]

        def scratch_off(slot) -> int:
            key, i = slot
            return base[key] + i * self._slot_size[key]

        buf_bounds, scr_bounds = set(), set()
        for op, _, off, cnt, slot, _, _, _ in ops:
            if off >= 0:
                buf_bounds.update((off, off + cnt))
            if slot is not None:
                s = scratch_off(slot)
                scr_bounds.update((s, s + cnt))
        buf, scr = _Hazards(sorted(buf_bounds)), _Hazards(sorted(scr_bounds))

        steps: List[Step] = []
        for idx, (op, peer, off, cnt, slot, tag, color, left) in enumerate(ops):
            deps: set = set()
            s_off = scratch_off(slot) if slot is not None else -1
            if op == Op.SEND:
                buf.access(idx, off, cnt, read=True, write=False, deps=deps)
            elif op == Op.RECV:
                buf.access(idx, off, cnt, read=False, write=True, deps=deps)
            elif op == Op.RECV_SCRATCH:
                scr.access(idx, s_off, cnt, read=False, write=True, deps=deps)
            else:  # REDUCE reads its scratch slot and updates the buffer in place
                scr.access(idx, s_off, cnt, read=True, write=False, deps=deps)
                buf.access(idx, off, cnt, read=True, write=True, deps=deps)
            steps.append(Step(op, peer, off, cnt, s_off, tag, tuple(sorted(deps)), color, left))
        return RankProgram(rank, steps, total)


def check_schedule(schedule: Schedule) -> Optional[str]:
    """Return a description of the first structural error, or None (used by tests)."""
    sends, recvs = {}, {}
    for prog in schedule.programs:
        for i, s in enumerate(prog.steps):
            if any(d >= i for d in s.deps):
                return f"rank {prog.rank} step {i} depends on a later step"
            if s.op == Op.SEND:
                sends[(prog.rank, s.peer, s.tag)] = s.count
            elif s.op in (Op.RECV, Op.RECV_SCRATCH):
                recvs[(s.peer, prog.rank, s.tag)] = s.count
    if sends != recvs:
        missing = set(sends.items()) ^ set(recvs.items())
        return f"unmatched messages: {sorted(missing)[:5]}"
    return None
