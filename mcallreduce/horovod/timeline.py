"""Routed calls in a Chrome-trace timeline (chrome://tracing, Perfetto), as Horovod's timeline.

``MCALLREDUCE_TIMELINE=FILE``, or Horovod's ``HOROVOD_TIMELINE=FILE`` (then Horovod keeps
FILE for its own calls and ours go beside it), makes every rank write
``<FILE stem>.mcallreduce.rank<r>.json`` at shutdown: one complete event per routed call
(its tensor or bucket name, bytes, start and end), on two rows: the companion metadata
allreduce and the data allreduces; and, from the engine's own timestamps, three more rows
with each data allreduce's phases: queued (submitted, not yet started by the executor: the
progress thread was busy), the metadata check, and the reduction (the schedule, MPI's
allreduce or the shared-memory stage); and one row per color, with the color's reduce phase
(from the check's end until its last reducing step on this rank ended) and its broadcast
phase (until its last step ended). The shared-memory stage shows the color this rank
reduces; MPI's allreduce shows no colors.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import List, Optional, Sequence

from .. import config

__all__ = ["Timeline", "path_for"]

_PHASES = ("queued", "check", "reduce")   # between the handle's four timestamps
_COLOR_ROW = 5                             # color c's row: _COLOR_ROW + c


def path_for(rank: int, environ=None) -> Optional[str]:
    """Where this rank writes its timeline, or None when no timeline is asked for."""
    base = config.timeline_file(environ)
    if base is None:
        return None
    stem, ext = os.path.splitext(base)
    return f"{stem}.mcallreduce.rank{rank}{ext or '.json'}"


class Timeline:
    def __init__(self, path: str, rank: int):
        self.path, self.rank = path, rank
        self.events: List[dict] = []
        self._lock = threading.Lock()
        self._t0 = time.monotonic()   # the engine's timestamps are on this clock too
        self._colors = set()

    def _now_us(self) -> float:
        return (time.monotonic() - self._t0) * 1e6

    def _us(self, t: float) -> float:
        return (t - self._t0) * 1e6

    def record(self, name: str, kind: str, check, parts: Sequence, nbytes: int) -> None:
        """One event for the metadata check, one for the data, each ending when its handles finish."""
        start = self._now_us()
        for row, handles, what in ((0, [check], "metadata check"), (1, list(parts), kind)):
            pending = [len(handles)]

            def done(_, row=row, what=what, handles=handles, pending=pending):
                with self._lock:
                    pending[0] -= 1
                    if pending[0]:
                        return
                    # from the first submission on, so that the phases below fall inside
                    begin = min([start] + [self._us(h.times[0]) for h in handles if h.times is not None])
                    self.events.append({"name": name, "cat": what, "ph": "X", "ts": begin,
                                        "dur": self._now_us() - begin, "pid": self.rank, "tid": row,
                                        "args": {"bytes": nbytes if row else 0, "engine_calls": len(handles),
                                                 "seqs": [h.seq for h in handles]}})
                    if row:
                        self._phases(name, handles)
            for handle in handles:
                handle.add_done_callback(done)

    def _phases(self, name: str, handles: Sequence) -> None:
        """Each engine call's queued, check and reduction spans (rows 2-4); under the lock."""
        for handle in handles:
            if handle.times is None:     # failed before the executor started it
                continue
            for row, (phase, begin, end) in enumerate(zip(_PHASES, handle.times, handle.times[1:]), start=2):
                self.events.append({"name": f"{name}: {phase}", "cat": phase, "ph": "X", "ts": self._us(begin),
                                    "dur": max(0.0, (end - begin) * 1e6), "pid": self.rank, "tid": row,
                                    "args": {"seq": handle.seq}})
            body = handle.times[2]
            for color, reduced, done in handle.color_times:
                self._colors.add(color)
                reduced = max(reduced, body)    # 0: the color had no reducing step here
                for phase, begin, end in (("reduce", body, reduced), ("broadcast", reduced, done)):
                    self.events.append({"name": f"{name}: color {color} {phase}", "cat": f"color {phase}", "ph": "X",
                                        "ts": self._us(begin), "dur": max(0.0, (end - begin) * 1e6),
                                        "pid": self.rank, "tid": _COLOR_ROW + color,
                                        "args": {"seq": handle.seq, "color": color}})

    def write(self) -> None:
        """Write the events (atomically: a reader never sees half a file)."""
        with self._lock:
            events, colors = list(self.events), sorted(self._colors)
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "metadata check"}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 1, "args": {"name": "allreduce"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": row, "args": {"name": f"engine: {phase}"}}
                 for row, phase in enumerate(_PHASES, start=2)]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": _COLOR_ROW + c,
                  "args": {"name": f"engine: color {c}"}} for c in colors]
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, self.path)
