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

A caller may also bound every call of an engine (:meth:`StallInspector.limit_calls`: a DDP
group's ``timeout``): once a call has waited that long, every call in flight fails, as a timed-out
collective breaks a gloo or NCCL group.

The inspector is a daemon thread that sleeps between looks (it never polls MPI), started
with the engine unless ``*_STALL_CHECK_DISABLE=1``, or by the first limit on calls.
"""
from __future__ import annotations

import faulthandler
import sys
import threading
import time
from typing import TYPE_CHECKING, Optional, Tuple

from . import config

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["StallInspector"]


class StallInspector:
    def __init__(self, engine: "Engine", warn_after: Optional[float], fail_after: Optional[float]):
        """``warn_after`` None: no reports (a limit on calls only)."""
        self.engine, self.warn_after, self.fail_after = engine, warn_after, fail_after
        self._call_limit: Optional[Tuple[float, str]] = None   # (seconds, its name for the error)
        self._failed_below = 0    # calls before this one were failed already: they only wait to be reported
        self._stop = False
        self._look = threading.Event()   # stop, or a new limit: look now
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

    def limit_calls(self, seconds: float, what: str) -> None:
        """From any thread: once a call has waited ``seconds``, every call in flight fails with an
        error that names ``what`` (a DDP group's timeout, say)."""
        self._call_limit = (seconds, what)
        self._look.set()

    def stop(self) -> None:
        """End the thread (and so its hold on the engine) before returning."""
        self._stop = True
        self._look.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _period(self) -> float:
        limits = [s for s in (self.warn_after, self.fail_after, self._call_limit and self._call_limit[0]) if s]
        return min(max(0.05, min(limits) / 4), 5.0) if limits else 5.0

    def _run(self) -> None:
        while True:
            self._look.wait(self._period())
            self._look.clear()
            if self._stop:
                return
            now = time.monotonic()
            waiting = [w for w in self.engine.waiting() if w[0] >= self._failed_below]
            for seq, since, name, nbytes in waiting:
                if self.warn_after is not None and seq not in self._warned and now - since >= self.warn_after:
                    self._warned.add(seq)
                    self._report(seq, now - since, name, nbytes)
            longest = max((now - since for _, since, _, _ in waiting), default=None)
            limit = self._call_limit
            if longest is not None and limit is not None and longest >= limit[0]:
                self._fail(f"the call did not finish within {limit[1]}: a rank failed, or did not call it")
            elif longest is not None and self.fail_after and longest >= self.fail_after:
                self._fail(f"the call waited longer than the stall shutdown time "
                           f"({self.fail_after:g} s); a rank has not started it")
            live = {seq for seq, _, _, _ in waiting}
            self._warned &= live

    def _fail(self, reason: str) -> None:
        # the calls it failed only wait to be reported: the next looks pass over them
        self._failed_below = self.engine.fail_all(reason)

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
