"""Where a job's cores go: CPU seconds per kind of thread, sampled from /proc while it runs.

A job's ranks are the processes that run the script ``marker`` names (``python SCRIPT ...``)
and whose parent does not; the job is the ranks and everything they start (DataLoader workers,
forked or from a forkserver). Start the sampler before the job: each thread's user and system
time since it began is sampled every ``interval`` seconds and kept at its last value, so a
thread that ends counts up to its last sample. The kinds:

- ``main``: a rank's main thread (the training loop, forward/backward, the optimizer);
- ``progress``: mcallreduce's progress thread (engine.PROGRESS_THREAD_OS_NAME);
- ``other``: a rank's other threads (Horovod's background thread, torch's and MPI's own);
- ``workers``: the processes a rank started, every thread of them.

``machine`` is /proc/stat's busy and idle core-seconds over the same time, so a slower arm
can be told apart as short of CPU (no idle left) or waiting (cores idle).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Dict, Optional, Tuple

from ..engine import PROGRESS_THREAD_OS_NAME

KINDS = ("main", "progress", "other", "workers")
TICK = os.sysconf("SC_CLK_TCK")


def _stat(path: str) -> Optional[Tuple[str, int, float, float]]:
    """(comm, ppid, user s, system s) of a /proc stat file, None if the task is gone."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()   # fields from the state on (stat's 3rd)
    return comm, int(fields[1]), int(fields[11]) / TICK, int(fields[12]) / TICK


def _machine() -> Tuple[float, float]:
    """(busy, idle) core-seconds since boot, from /proc/stat's cpu line."""
    with open("/proc/stat") as f:
        values = [int(v) / TICK for v in f.readline().split()[1:]]
    idle = values[3] + values[4]   # idle and iowait
    return sum(values[:8]) - idle, idle


class ThreadCpu(threading.Thread):
    """Samples from start() to stop(); ``result()`` gives the CPU seconds per kind."""

    def __init__(self, marker: str, interval: float = 0.25):
        super().__init__(daemon=True, name="mcallreduce-thread-cpu")
        self.marker, self.interval = marker, interval
        self.threads: Dict[int, Tuple[str, float, float]] = {}   # tid: (kind, user, system)
        self.cmdlines: Dict[int, bool] = {}                      # pid: runs the script
        self.stopped = threading.Event()

    def run(self) -> None:
        self.begin, self.machine0 = time.monotonic(), _machine()
        while not self.stopped.wait(self.interval):
            self.sample()
        self.sample()
        self.end, self.machine1 = time.monotonic(), _machine()

    def stop(self) -> dict:
        self.stopped.set()
        self.join()
        return self.result()

    def _runs_script(self, pid: int) -> bool:
        if pid not in self.cmdlines:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                return False
            self.cmdlines[pid] = len(argv) > 1 and b"python" in os.path.basename(argv[0]) and \
                argv[1].endswith(self.marker.encode())
        return self.cmdlines[pid]

    def sample(self) -> None:
        parent = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = _stat(f"/proc/{name}/stat")
                if st is not None:
                    parent[int(name)] = st[1]
        ranks = {pid for pid, ppid in parent.items() if self._runs_script(pid) and not self._runs_script(ppid)}
        for pid in parent:
            ancestor, is_worker = parent.get(pid), False
            while ancestor and not is_worker:       # a descendant of a rank is one of its workers
                is_worker, ancestor = ancestor in ranks, parent.get(ancestor)
            if pid in ranks or is_worker:
                self._sample_process(pid, pid in ranks)

    def _sample_process(self, pid: int, rank: bool) -> None:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return
        for tid in map(int, tids):
            st = _stat(f"/proc/{pid}/task/{tid}/stat")
            if st is None:
                continue
            if not rank:
                kind = "workers"
            elif tid == pid:
                kind = "main"
            else:
                kind = "progress" if st[0] == PROGRESS_THREAD_OS_NAME else "other"
            self.threads[tid] = (kind, st[2], st[3])

    def result(self) -> dict:
        out = {kind: {"user_s": 0.0, "system_s": 0.0} for kind in KINDS}
        for kind, user, system in self.threads.values():
            out[kind]["user_s"] += user
            out[kind]["system_s"] += system
        busy = self.machine1[0] - self.machine0[0]
        idle = self.machine1[1] - self.machine0[1]
        return {"wall_s": self.end - self.begin, "threads": out,
                "machine": {"busy_s": busy, "idle_s": idle}}
