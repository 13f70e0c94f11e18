"""The stall inspector: calls that wait too long are reported, then failed, as Horovod's are.

A call that has waited ``stall_check_seconds()`` (``MCALLREDUCE_`` or ``HOROVOD_STALL_CHECK_TIME_SECONDS``,
default 60) is reported once on stderr: its sequence number, what it is when a caller named it
(a tensor or its metadata check, a DDP bucket), size, and what it waits for (the metadata
check's peer, the schedule, MPI's allreduce), then, once per process, where the executor is
(the MPI call it is inside, wake-up sends in progress) and every Python thread's stack: enough
to tell a rank that never started the call from one stuck inside MPI. Past
``stall_shutdown_seconds()`` (if Horovod's variable set it, only when not below the check time,
as Horovod's rule is) every call in flight fails with an error instead of waiting forever. A
peer that shuts down is noticed sooner by its goodbye (native/executor.c).

The inspector is a daemon thread that sleeps between looks (it never polls MPI), started
with the engine unless ``*_STALL_CHECK_DISABLE=1``.
"""
from __future__ import annotations

import faulthandler
import sys
import threading
import time
from typing import TYPE_CHECKING, Optional

from . import config

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["StallInspector"]


class StallInspector:
    def __init__(self, engine: "Engine", warn_after: float, fail_after: Optional[float]):
        self.engine, self.warn_after, self.fail_after = engine, warn_after, fail_after
        self._stop = threading.Event()
        self._warned: set = set()
        self._dumped = False      # the threads' stacks: once per process, they are long
        self._thread = threading.Thread(target=self._run, name="mcallreduce-stall", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, engine: "Engine") -> Optional["StallInspector"]:
        warn_after = config.stall_check_seconds()
        if warn_after is None:
            return None
        fail_after = config.stall_shutdown_seconds()
        # Horovod's rule for its own variable: report first, or never fail
        if fail_after is not None and fail_after < warn_after and config.stall_shutdown_is_horovods():
            if engine.ctx.rank == 0:
                _say(f"mcallreduce: the stall shutdown time ({fail_after:g} s) is less than the stall check time "
                     f"({warn_after:g} s): calls will not fail on a stall, as in Horovod")
            fail_after = None
        return cls(engine, warn_after, fail_after)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        period = max(0.05, min(self.warn_after, self.fail_after or self.warn_after) / 4)
        while not self._stop.wait(min(period, 5.0)):
            now = time.monotonic()
            waiting = self.engine.waiting()
            for seq, since, name, nbytes in waiting:
                if seq not in self._warned and now - since >= self.warn_after:
                    self._warned.add(seq)
                    self._report(seq, now - since, name, nbytes)
            if self.fail_after and any(now - since >= self.fail_after for _, since, _, _ in waiting):
                self.engine.fail_all(f"the call waited longer than the stall shutdown time "
                                     f"({self.fail_after:g} s); a rank has not started it")
            live = {seq for seq, _, _, _ in waiting}
            self._warned &= live

    def _report(self, seq: int, waited: float, name: Optional[str], nbytes: int) -> None:
        what, peer = self.engine.native.waiting_on(seq)
        ctx = self.engine.ctx
        who = f", waiting for rank {peer}" if peer >= 0 else ""
        call = f"{name}, " if name else ""
        _say(f"mcallreduce: stall: rank {ctx.rank}'s allreduce #{seq} ({call}{nbytes} bytes) has waited "
             f"{waited:.0f} s in {what}{who}. Every rank must start the same allreduces in the same "
             f"order; the ranks that have not started this one cannot be named without a coordinator. "
             f"(MCALLREDUCE_/HOROVOD_STALL_CHECK_TIME_SECONDS sets when this is reported, "
             f"*_STALL_SHUTDOWN_TIME_SECONDS when the call fails.)")
        if not self._dumped:
            self._dumped = True
            self._dump(ctx.rank)

    def _dump(self, rank: int) -> None:
        in_mpi, wakes, requests = self.engine.native.activity()
        where = f"inside {in_mpi}" if in_mpi else "not inside MPI"
        thread = "its progress thread" if self.engine.threaded else "the callers"
        _say(f"mcallreduce: stall: rank {rank}'s executor ({thread}) is {where}, with {requests} requests "
             f"posted and {wakes} wake-up sends in progress; the Python threads of rank {rank}:")
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError, OSError):   # a stderr with no file descriptor (a notebook, a tee)
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)


def _say(line: str) -> None:
    """One line to stderr in one write (print() writes the newline apart), so that the lines of
    ranks sharing mpirun's stderr never interleave; any stderr object will do."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
