"""The engine's Python side: handles, the call bookkeeping and the progress thread.

Everything that touches MPI requests runs in the compiled executor
(mcallreduce/native/executor.c) with the GIL released: the metadata check, the
schedule's sends, receives and reductions, MPI's own allreduce and the one-host
shared-memory stage. This module only decides *when* it runs:

* caller-driven (default): ``Handle.wait()`` / ``test()`` call into the executor under
  the engine lock, in the calling thread; waiting on one handle progresses every other
  call in flight, so ranks that wait in different orders cannot deadlock each other;
* a background progress thread (:meth:`Engine.start_thread`, used by the Horovod plugin
  to overlap communication with the backward pass): new calls are queued, and an event
  plus a generalized request that every wait includes wake the thread (completing the
  request gets it out of its wait without a message, so the thread that submits
  does no point-to-point MPI beside the thread that progresses). With nothing in flight the
  thread sleeps on that event; with calls in flight it waits as every blocking wait does,
  polling while messages complete and sleeping between polls once they stop
  (native/naps.c), so no wait keeps a core that the backward pass could use.

Every call's metadata check is the same recursive doubling of the vector on every rank
(native/check.c), whatever the call: ranks that disagree about a call (one within the
shared-memory size, one above it, say) then still exchange the same messages and raise.
A small ``doubling`` or ``halving`` call travels with its check ("fused": its exchanges are the
check's), and on
one host the completed check is the shared-memory stage's first synchronisation.
"""
from __future__ import annotations

import atexit
import collections
import ctypes
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from . import _executor
from .lowering import EARLY_MAX_BYTES
from .policy import FUSED_MAX_BYTES
from .stall import StallInspector

if TYPE_CHECKING:
    from .context import Context

__all__ = ["TAG_SPAN", "MAX_SCHEDULE_TAGS", "PROGRESS_THREAD_NAME", "PROGRESS_THREAD_OS_NAME", "Handle", "Engine"]

TAG_SPAN = 1 << 20   # tags per allreduce: seq window w uses tags [w * TAG_SPAN, (w + 1) * TAG_SPAN)
SYNC_TAG, CHECK_TAG = TAG_SPAN - 1, TAG_SPAN - 2  # a window's last tags: shared sync 2; the check's
MAX_SCHEDULE_TAGS = TAG_SPAN - 64                 # steps use CHECK_TAG - step (2 + 2 log2(p) steps at
                                                  # most, under 62); the rest are the schedule's
EARLY_TAG = MAX_SCHEDULE_TAGS                     # a schedule's messages sent before its check
ONE_PIECE = 1 << 30   # a check message's piece size that never splits it
PROGRESS_THREAD_NAME = "mcallreduce-progress"
PROGRESS_THREAD_OS_NAME = "mcallreduce"   # what top -H, ps -L and /proc show (Linux keeps 15 bytes)


def call_weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method``, called through a weak reference to its object: an exit hook that keeps
    nothing alive (it does nothing once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()
    return call


def _name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` where the OS shows threads, so its CPU can be told apart."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)   # 15: PR_SET_NAME
    except (OSError, AttributeError):   # not Linux: the name is only cosmetic
        pass


class Handle:
    """An allreduce in flight. ``test()`` progresses without blocking; ``wait()`` finishes it."""

    __slots__ = ("result", "seq", "error", "name", "times", "color_times", "_engine", "_done", "_event",
                 "_callbacks", "_finisher")

    def __init__(self, engine: "Engine", seq: int, result: Any,
                 finisher: Optional[Callable[[Optional[BaseException]], Optional[BaseException]]] = None):
        self.result, self.seq, self.error = result, seq, None
        self.name: Optional[str] = None     # what the stall inspector calls it ("tensor 'x'", "DDP bucket 0")
        # once finished: (submitted, started, checked, done), time.monotonic() seconds: queued in
        # Python until started, the metadata check until checked, then the reduction itself
        self.times: Optional[Tuple[float, float, float, float]] = None
        # and per color that ran: (color, reduced, done), the ends of its reduction and of its
        # broadcast on this rank (the shared-memory stage: this rank's own color)
        self.color_times: List[Tuple[int, float, float]] = []
        self._engine, self._done = engine, False
        self._event = threading.Event() if engine.threaded else None   # only a thread signals
        self._callbacks: Optional[List[Callable[["Handle"], None]]] = None
        # runs before anyone sees the call done, and may turn it into an error (a GPU copy-back)
        self._finisher = finisher

    def test(self) -> bool:
        """True when finished (raises the allreduce's error, if any)."""
        if not self._done:
            self._engine.progress(block=False)
        if self._done and self.error is not None:
            raise self.error
        return self._done

    def wait(self) -> Any:
        """Finish the allreduce and return the result buffer (raises its error, if any)."""
        while not self._done:
            self._engine.progress(block=True, until=self)
        if self.error is not None:
            raise self.error
        return self.result

    @property
    def done(self) -> bool:
        return self._done

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call ``fn(handle)`` once the allreduce has finished (at once if it has), exactly once,
        from whichever thread finishes it; ``fn`` must not block on other allreduces."""
        with self._engine.callback_lock:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        _call_back(fn, self)

    def _finish(self, error: Optional[BaseException]) -> None:
        if self._finisher is not None:
            error, self._finisher = self._finisher(error), None
        with self._engine.callback_lock:
            self.error, self._done = error, True
            callbacks, self._callbacks = self._callbacks, None
        if self._event is not None:
            self._event.set()
        for fn in callbacks or ():
            _call_back(fn, self)


def _call_back(fn: Callable[[Handle], None], handle: Handle) -> None:
    """Run a done callback; one that raises is logged, as concurrent.futures does, and the
    engine goes on reporting the other calls."""
    try:
        fn(handle)
    except Exception:   # noqa: BLE001
        logging.getLogger("mcallreduce").exception("a done callback of allreduce #%d raised", handle.seq)


class _Call:
    """The engine's side of one allreduce: what to submit, and how to report its outcome."""

    __slots__ = ("handle", "template", "buffer", "prescale", "on_mismatch", "local_error", "since")

    def __init__(self, handle: Handle, template, buffer: np.ndarray, prescale: float, on_mismatch: Callable,
                 local_error: Optional[BaseException]):
        self.handle, self.template, self.buffer, self.prescale = handle, template, buffer, prescale
        self.on_mismatch, self.local_error = on_mismatch, local_error
        self.since = time.monotonic()


class Engine:
    """Every allreduce in flight on one :class:`~mcallreduce.context.Context`."""

    def __init__(self, ctx: "Context"):
        self.ctx = ctx
        # TCP's eager limit applies across hosts only: on one host a check message is one piece
        piece = ctx.config.inter_host_segment if len(ctx.hosts) > 1 else ONE_PIECE
        self.native = _executor.Engine(ctx.comm.py2f(), ctx.ctl.py2f(), ctx.coll.py2f(), CHECK_TAG, SYNC_TAG,
                                       EARLY_TAG, EARLY_MAX_BYTES, FUSED_MAX_BYTES, piece, ctx.config.poll_us * 1e-6,
                                       ctx.coll_ring.py2f() if ctx.coll_ring is not None else -1)
        self.lock = threading.RLock()            # serialises calls into the executor
        self.callback_lock = threading.Lock()
        self.calls: Dict[int, _Call] = {}        # seq -> call, until the executor reports it
        self.windows_in_use: Dict[int, int] = {}   # tag window -> seq
        self._queue: Deque[_Call] = collections.deque()
        self._thread: Optional[threading.Thread] = None
        self._thread_lock = threading.RLock()   # a done callback may submit while it is held
        self._stop = False
        self._kick = threading.Event()   # new work or stop, for the progress thread
        # a generalized request wakes a waiting executor (new work, stop, the stall limit);
        # a peer's goodbye fails the calls it will never take part in
        self._bye_comm = ctx.comm.Dup()
        self.native.enable_wake()
        self.native.enable_goodbye(self._bye_comm.py2f())
        self.inspector = StallInspector.start(self)
        self._closed = False
        self._stop_at_exit: Optional[Callable[[], None]] = None

    def set_window(self, win, address: int, slot_bytes: int, small_bytes: int) -> None:
        """Use (or, with ``win`` None, stop using) a shared-memory window for the one-host stages:
        before the progress thread starts, or once the engine is closed (the thread holds the lock
        for its whole life, and calls in flight use the window)."""
        if self._thread is not None or (self.calls and not self._closed):   # closed: its calls were failed
            raise RuntimeError("mcallreduce: the shared-memory window changes only with no call in flight "
                               "and no progress thread (close the context first)")
        with self.lock:
            self.native.set_window(win.py2f() if win is not None else -1, address, slot_bytes, small_bytes)

    # ------------------------------------------------------------------ submission
    @property
    def threaded(self) -> bool:
        return self._thread is not None

    def submit(self, seq: int, result: Any, template, buffer: np.ndarray, prescale: float,
               on_mismatch: Callable, local_error: Optional[BaseException] = None,
               finisher: Optional[Callable] = None) -> Handle:
        """Start one call of a plan (``template``: the executor's fixed arguments) on ``buffer``;
        ``finisher(error)`` runs when it ends, before the handle reports it (see Handle)."""
        # decided with start_thread() excluded: a handle made without the thread must be admitted
        # before it starts (which finishes the calls in flight), or it waits on a lock the thread keeps
        with self._thread_lock:
            handle = Handle(self, seq, result, finisher)
            call = _Call(handle, template, buffer, prescale, on_mismatch, local_error)
            if self._thread is not None:
                self._queue.append(call)
                self._wake()
                return handle
            with self.lock:
                earlier = bool(self.calls)
                self._admit(call)
                if earlier:   # one test advances the calls already in flight, as the caller's own test would
                    self._report(self.native.progress(False, -1))
        return handle

    def run_if_idle(self, next_seq: Callable[[], int], template, buffer: np.ndarray, prescale: float,
                    on_mismatch: Callable) -> bool:
        """Run a blocking call at once, submitted and waited for in one executor call with no
        handle, when nothing else is in flight and no progress thread owns the executor (that
        thread holds the lock for its whole life: never block on it). Returns whether it ran;
        raises the call's error."""
        lock = self.lock
        if not lock.acquire(False):
            return False
        try:
            if self._thread is not None or self.calls:
                return False
            seq = next_seq()
            status, payload = self.native.submit(seq, (seq % self.ctx.windows) * TAG_SPAN, True, template, buffer,
                                                 prescale)
        finally:
            lock.release()
        if status:   # not STATUS_OK
            error = self._outcome(status, payload, on_mismatch, None)
            if error is not None:
                raise error
        return True

    def _admit(self, call: _Call) -> None:
        seq = call.handle.seq
        window = seq % self.ctx.windows
        # the tags come round again: the call that holds them finishes first, on every rank alike
        while window in self.windows_in_use:
            self._report(self.native.progress(True, self.windows_in_use[window]))
        self.windows_in_use[window] = seq
        self.calls[seq] = call
        try:
            self.native.submit(seq, window * TAG_SPAN, False, call.template, call.buffer, call.prescale)
        except BaseException:   # not started: nothing may wait for it
            del self.windows_in_use[window], self.calls[seq]
            raise

    @staticmethod
    def _outcome(status: int, payload: Any, on_mismatch: Callable,
                 local_error: Optional[BaseException]) -> Optional[BaseException]:
        if status == _executor.STATUS_OK and local_error is None:
            return None
        if status == _executor.STATUS_ERROR:
            return RuntimeError(f"mcallreduce: {payload}")
        meta_out = np.frombuffer(payload, np.int64) if payload is not None else None
        return on_mismatch(meta_out, local_error)

    def _report(self, finished: List[Tuple[int, int, Any, Tuple[float, float, float], List]]) -> None:
        for seq, status, payload, times, colors in finished:
            call = self.calls.pop(seq)
            self.windows_in_use.pop(seq % self.ctx.windows, None)
            call.handle.times = (call.since, *times)
            call.handle.color_times = colors
            call.handle._finish(self._outcome(status, payload, call.on_mismatch, call.local_error))

    # ------------------------------------------------------------------ progress
    def progress(self, block: bool, until: Optional[Handle] = None) -> None:
        """Caller-driven progress: block until ``until`` finishes, or test once."""
        if self._thread is not None:       # the progress thread owns MPI; just wait for it
            if block and until is not None:
                until._event.wait()
            return
        with self.lock:
            if until is not None and until.done:
                return
            if not self.calls:
                return
            self._report(self.native.progress(block, until.seq if until is not None else -1))

    # ------------------------------------------------------------------ background thread
    def start_thread(self) -> None:
        """Progress on a daemon thread from now on (idempotent). Needs MPI_THREAD_MULTIPLE."""
        from mpi4py import MPI
        with self._thread_lock:
            if self._thread is not None:
                return
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise RuntimeError("mcallreduce: a progress thread needs MPI_THREAD_MULTIPLE, but MPI "
                                   f"provides level {MPI.Query_thread()}; use an MPI built with thread support")
            with self.lock:      # finish what callers started: their handles have no event
                while self.calls:
                    self._report(self.native.progress(True, -1))
                self._stop = False
                self._thread = threading.Thread(target=self._run, name=PROGRESS_THREAD_NAME, daemon=True)
                self._thread.start()
            if self._stop_at_exit is None:
                self._stop_at_exit = call_weakly(self.stop_thread)
                atexit.register(self._stop_at_exit)

    def stop_thread(self) -> None:
        with self._thread_lock:
            thread = self._thread
            if thread is None:
                return
            self._stop = True
            self._wake()
        thread.join()   # outside the lock: a done callback on the thread may submit
        with self._thread_lock:
            self._thread = None
            with self.lock:   # calls queued after the thread's last look: their callers progress them
                while self._queue:
                    self._admit(self._queue.popleft())

    def waiting(self) -> List[Tuple[int, float, Optional[str], int]]:
        """(seq, since, name, bytes) of every call in flight (any thread may ask)."""
        out = [(seq, c.since, c.handle.name, c.buffer.nbytes) for seq, c in list(self.calls.items())]
        waited = self.native.waited()   # run_if_idle's call, which has no handle
        if waited is not None:
            out.append((waited[0], waited[1], None, waited[2]))
        return out

    def limit_calls(self, seconds: float, what: str) -> None:
        """Every call in flight fails once one has waited ``seconds`` since it was submitted (``what``:
        the limit's name in the error), even where the stall check is off: a DDP group's timeout."""
        if not seconds > 0:
            raise ValueError(f"mcallreduce: a limit on calls must be positive, not {seconds!r}")
        if self.inspector is None:
            self.inspector = StallInspector(self, None, None)
        self.inspector.limit_calls(seconds, what)

    def fail_all(self, reason: str) -> int:
        """From any thread: every call in flight fails with ``reason`` (the stall limit). Returns the
        first sequence number it spares (the calls submitted after it)."""
        spared = self.native.abort(reason)   # the error adds "mcallreduce: "
        self.native.wake()
        return spared

    def close(self) -> None:
        """At exit or hvd.shutdown(), on every rank: stop the thread, tell the peers this rank
        leaves (calls it never started fail there instead of waiting), stop listening."""
        from mpi4py import MPI
        if self._closed or MPI.Is_finalized():   # the user may have finalized MPI already
            return
        self._closed = True
        self.stop_thread()
        if self.inspector is not None:
            self.inspector.stop()
        with self.lock:
            self.native.goodbye()
            self.native.disable_wake()
            if self.calls:   # their peers fail them now (the goodbye), and so do they here: nothing stays posted
                self.native.abort("this rank closed its allreduce context (at exit or hvd.shutdown()) with "
                                  "the call in flight")
                self._report(self.native.progress(False, -1))

    def release(self) -> None:
        """After :meth:`close`: drop the exit hook, so nothing but handles keeps the engine (its
        executor then frees its buffers, but for those MPI may still write to)."""
        if self._stop_at_exit is not None:
            atexit.unregister(self._stop_at_exit)
            self._stop_at_exit = None

    def _wake(self) -> None:
        self._kick.set()
        self.native.wake()

    def _run(self) -> None:
        _name_os_thread(PROGRESS_THREAD_OS_NAME)
        with self.lock:   # the thread owns the engine; callers only queue and wait
            while True:
                self._kick.clear()
                while self._queue:
                    self._admit(self._queue.popleft())
                if self._stop and not self.calls and not self._queue:
                    break
                if not self.calls:      # idle: sleep until a submission or stop, off the cores
                    self._kick.wait()
                    continue
                self._report(self.native.progress(True, -1))
