"""Routed calls in a Chrome-trace timeline (chrome://tracing, Perfetto), as Horovod's timeline.

``MCALLREDUCE_TIMELINE=FILE``, or Horovod's ``HOROVOD_TIMELINE=FILE`` (then Horovod keeps
FILE for its own calls and ours go beside it), makes every rank write
``<FILE stem>.mcallreduce.rank<r>.json`` at shutdown: one complete event per routed call
(its tensor or bucket name, bytes, start and end), on two rows: the companion metadata
allreduce and the data allreduces. What the engine does inside a call (check, reduce and
broadcast per color) is not in it.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import List, Optional, Sequence

from .. import config

__all__ = ["Timeline", "path_for"]


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
        self._t0 = time.perf_counter()

    def _now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def record(self, name: str, kind: str, check, parts: Sequence, nbytes: int) -> None:
        """One event for the metadata check, one for the data, each ending when its handles finish."""
        start = self._now_us()
        for row, handles, what in ((0, [check], "metadata check"), (1, list(parts), kind)):
            pending = [len(handles)]

            def done(_, row=row, what=what, pending=pending, n=len(handles)):
                with self._lock:
                    pending[0] -= 1
                    if pending[0] == 0:
                        self.events.append({"name": name, "cat": what, "ph": "X", "ts": start,
                                            "dur": self._now_us() - start, "pid": self.rank, "tid": row,
                                            "args": {"bytes": nbytes if row else 0, "engine_calls": n}})
            for handle in handles:
                handle.add_done_callback(done)

    def write(self) -> None:
        """Write the events (atomically: a reader never sees half a file)."""
        with self._lock:
            events = list(self.events)
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "metadata check"}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 1, "args": {"name": "allreduce"}}]
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, self.path)
