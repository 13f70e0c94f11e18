"""The progress engine: posts schedule steps as MPI calls and completes them.

One engine per communicator context drives *all* allreduces in flight, so
waiting on one handle progresses every other one too: ranks that wait on their
handles in different orders cannot deadlock each other.

A step is posted as soon as the steps it depends on have completed: sends and
receives as ``Isend``/``Irecv`` on the user's buffer or the preallocated
scratch, reductions as numpy in-place ufuncs. The loop blocks in ``Waitsome``
(which releases the GIL) and never spins in Python.

The metadata check is one small ``Iallreduce`` per call (libnbc) when ranks span
hosts. On one host it is a point-to-point exchange of the metadata vectors between
all ranks instead: there the shared-memory stage (mcallreduce/shared.py) uses that
exchange as its first synchronisation, and every call, shared or not, must check the
same way, or ranks that disagree about a call (one within the shared-memory size,
one above it) would wait in two different exchanges instead of raising.

Two ways to drive it:

* caller-driven (default): ``Handle.wait()`` / ``test()`` progress under the
  engine lock, in the calling thread;
* a background progress thread (:meth:`Engine.start_thread`, used by the
  Horovod plugin to overlap communication with the backward pass): new
  allreduces are queued, and an event plus a one-byte message to self wake the
  thread (the message gets it out of ``Waitsome``); handles then just wait for
  an event. With nothing in flight the thread sleeps on that event instead of
  waiting in MPI, whose progress loop polls a core (with ``mpi_yield_when_idle``
  it yields, but stays runnable) that the backward pass could use.
"""
from __future__ import annotations

import atexit
import collections
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from .schedule import Op, apply_reduce
from . import shared

if TYPE_CHECKING:
    from .runtime import Context, Handle

__all__ = ["OPS", "TAG_SPAN", "MAX_SCHEDULE_TAGS", "Engine"]

#: reduction operators: name -> (numpy ufunc, MPI op); "average" is "sum" then a scale
OPS: Dict[str, Tuple[Callable, Any]] = {
    "sum": (np.add, MPI.SUM), "average": (np.add, MPI.SUM),
    "min": (np.minimum, MPI.MIN), "max": (np.maximum, MPI.MAX), "product": (np.multiply, MPI.PROD),
}
TAG_SPAN = 1 << 20   # tags per allreduce: seq window w uses tags [w * TAG_SPAN, (w + 1) * TAG_SPAN)
META_TAG, SYNC_TAG = TAG_SPAN - 1, TAG_SPAN - 2   # a window's last tags: check, shared sync 2
MAX_SCHEDULE_TAGS = TAG_SPAN - 2                  # the rest are the schedule's
SYNC_PAYLOAD = np.empty(0, np.uint8)            # shared sync 2 carries nothing
_CHECK, _MPI, _SYNC = -1, -2, -3  # owner markers: metadata check, "mpi" collective, shared sync 2


class _RunState:
    """Dependency counters of one schedule execution on this rank."""

    def __init__(self, h: "Handle", tag0: int, scratch: np.ndarray):
        prog = h.schedule.programs[h.ctx.rank]
        self.handle, self.tag0, self.steps = h, tag0, prog.steps
        self.ufunc = OPS[h.op][0]
        self.mem = h.arr.view(np.uint8)
        self.scratch = scratch
        self.scr_mem = scratch.view(np.uint8)
        self.waiting = [len(s.deps) for s in self.steps]
        self.dependents = prog.dependents
        self.ready = [i for i in range(len(self.steps) - 1, -1, -1) if self.waiting[i] == 0]
        self.remaining = len(self.steps)

    def complete(self, i: int) -> None:
        self.remaining -= 1
        for j in self.dependents[i]:
            self.waiting[j] -= 1
            if self.waiting[j] == 0:
                self.ready.append(j)


class Engine:
    def __init__(self, ctx: "Context"):
        self.ctx = ctx
        self.lock = threading.RLock()
        self.reqs: List[MPI.Request] = []
        self.owners: List[Tuple["Handle", int]] = []   # (handle, step index | _CHECK | _MPI)
        self.active: Dict[int, "Handle"] = {}          # seq window -> handle
        self._state: Dict[int, _RunState] = {}
        self._pool: Dict[Tuple[str, int], List[np.ndarray]] = {}
        self._queue: Deque["Handle"] = collections.deque()
        self._thread: Optional[threading.Thread] = None
        self._thread_lock = threading.Lock()
        self._stop = False
        self._wake_comm: Optional[MPI.Comm] = None
        self._kick = threading.Event()   # new work or stop, for the progress thread
        self._shared_queue: Deque["Handle"] = collections.deque()   # one shared call at a time
        self._shared_busy: Optional["Handle"] = None

    # ------------------------------------------------------------------ submission
    @property
    def idle(self) -> bool:
        """Nothing in flight and no progress thread: a blocking call may run on its own."""
        return self._thread is None and not self.active

    def submit(self, h: "Handle") -> None:
        if self._thread is not None:
            self._queue.append(h)
            self._wake()
            return
        with self.lock:
            self._admit(h)

    def _admit(self, h: "Handle") -> None:
        window = h.seq % self.ctx.windows
        if window in self.active:
            h.error = RuntimeError("mcallreduce: too many allreduces in flight "
                                   f"(at most {self.ctx.windows}); wait on older handles first")
            h._finish()
            return
        self.active[window] = h
        if h.shared:
            self._shared_queue.append(h)
            self._next_shared()
        elif h._meta is None:
            self._start(h)
        elif self.ctx.shared is not None:
            self._exchange_meta(h)
        else:
            h._pending = 1
            self._post(self.ctx.ctl.Iallreduce(h._meta, h._meta_out, op=MPI.MAX), h, _CHECK)

    def _exchange(self, h: "Handle", tag: int, send, recv, owner: int) -> None:
        """Post a send to and a receive from every other rank (a barrier that carries data)."""
        comm, rank = self.ctx.comm, self.ctx.rank
        tag += (h.seq % self.ctx.windows) * TAG_SPAN
        h._pending = 2 * (self.ctx.size - 1)
        for q in range(self.ctx.size):
            if q != rank:
                self._post(comm.Irecv(recv(q), q, tag), h, owner)
                self._post(comm.Isend(send, q, tag), h, owner)

    def _exchange_meta(self, h: "Handle") -> None:
        """The single-host metadata check: every rank's vector to every other rank."""
        h._metas = np.empty((self.ctx.size, h._meta.size), np.int64)
        h._metas[self.ctx.rank] = h._meta
        self._exchange(h, META_TAG, h._meta, lambda q: h._metas[q], _CHECK)

    def _checked(self, h: "Handle") -> None:
        """All of the check's requests are done: raise everywhere, or go on."""
        if h._metas is not None:
            np.max(h._metas, axis=0, out=h._meta_out)   # what the MAX Iallreduce would give
        h._check_meta()
        if h.error is not None:
            self._retire(h)
        elif h.shared:
            self._shared_reduce(h)
        else:
            self._start(h)

    # ------------------------------------------------------------------ shared memory (one host)
    def _next_shared(self) -> None:
        """Publish the next queued shared-memory call and post its sync 1 (the meta exchange)."""
        if self._shared_busy is not None or not self._shared_queue:
            return
        h = self._shared_busy = self._shared_queue.popleft()
        win = self.ctx.shared
        h._areas = win.areas(h.arr.dtype, h.arr.size)
        scale = None if h.pre == 1.0 else h._prescale
        shared.publish(h.arr, h._areas[self.ctx.rank], self.ctx.rank, self.ctx.size, scale)
        win.sync()
        self._exchange_meta(h)

    def _shared_reduce(self, h: "Handle") -> None:
        win = self.ctx.shared
        win.sync()
        rank = self.ctx.rank
        data = shared.sources(h._areas[:-1], h.arr, rank, h.pre != 1.0)
        shared.reduce_color(data, h._areas[-1], rank, OPS[h.op][0])
        win.sync()
        self._exchange(h, SYNC_TAG, SYNC_PAYLOAD, lambda q: SYNC_PAYLOAD, _SYNC)

    def _shared_collect(self, h: "Handle") -> None:
        self.ctx.shared.sync()
        shared.collect(h.arr, h._areas[-1])
        h._areas = None
        self._retire(h)

    def _post(self, req: MPI.Request, h: "Handle", step: int) -> None:
        self.reqs.append(req)
        self.owners.append((h, step))

    def _start(self, h: "Handle") -> None:
        h._begin()
        if h.algorithm == "mpi":
            mpi_type = MPI._typedict.get(h.arr.dtype.char)
            if mpi_type is None:
                h.error = TypeError(f"mcallreduce: algorithm 'mpi' cannot reduce {h.arr.dtype.name} "
                                    "with this MPI library; use multicolor or ring")
                return self._retire(h)
            req = self.ctx.coll.Iallreduce(MPI.IN_PLACE, [h.arr, mpi_type], op=OPS[h.op][1])
            return self._post(req, h, _MPI)
        prog = h.schedule.programs[self.ctx.rank]
        state = _RunState(h, (h.seq % self.ctx.windows) * TAG_SPAN, self._scratch(prog.scratch_elems, h.arr.dtype))
        self._state[h.seq] = state
        self._post_ready(state)

    def _scratch(self, nelem: int, dtype: np.dtype) -> np.ndarray:
        """A scratch area from the pool: allreduces of recurring sizes allocate nothing."""
        free = self._pool.get((np.dtype(dtype).str, nelem))
        return free.pop() if free else np.empty(nelem, dtype=dtype)

    def _release(self, arr: np.ndarray) -> None:
        free = self._pool.setdefault((arr.dtype.str, arr.size), [])
        if len(free) < 4:
            free.append(arr)

    def _post_ready(self, st: _RunState) -> None:
        comm, h = self.ctx.comm, st.handle
        steps, mem, scr, isz = st.steps, st.mem, st.scr_mem, h.arr.itemsize
        while st.ready:
            i = st.ready.pop()
            s = steps[i]
            if s.op == Op.REDUCE:
                view = h.arr[s.offset:s.offset + s.count]
                apply_reduce(st.ufunc, view, st.scratch[s.scratch:s.scratch + s.count], s)
                st.complete(i)
                continue
            if s.op == Op.SEND:
                req = comm.Isend([mem[s.offset * isz:(s.offset + s.count) * isz], MPI.BYTE], s.peer,
                                 st.tag0 + s.tag)
            elif s.op == Op.RECV:
                req = comm.Irecv([mem[s.offset * isz:(s.offset + s.count) * isz], MPI.BYTE], s.peer,
                                 st.tag0 + s.tag)
            else:
                req = comm.Irecv([scr[s.scratch * isz:(s.scratch + s.count) * isz], MPI.BYTE], s.peer,
                                 st.tag0 + s.tag)
            self._post(req, h, i)
        if st.remaining == 0:
            del self._state[h.seq]
            self._release(st.scratch)
            self._retire(h)

    def _retire(self, h: "Handle") -> None:
        self.active.pop(h.seq % self.ctx.windows, None)
        h._finish()
        if h is self._shared_busy:
            self._shared_busy = None
            self._next_shared()

    # ------------------------------------------------------------------ progress
    def progress(self, block: bool, until: Optional["Handle"] = None) -> None:
        """Caller-driven progress: post what is ready, then wait (block) or test for completions."""
        if self._thread is not None:       # the progress thread owns MPI; just wait for it
            if block and until is not None:
                if until._event is not None:
                    until._event.wait()
                else:                      # created before the thread started: rare, poll
                    while not until.done:
                        time.sleep(1e-4)
            return
        with self.lock:
            if until is not None and until.done:
                return
            if not self.reqs:
                if self.active:
                    raise RuntimeError("mcallreduce: internal error, allreduce in flight with nothing posted")
                return
            indices = MPI.Request.Waitsome(self.reqs) if block else MPI.Request.Testsome(self.reqs)
            self._completed(indices or [])

    def _completed(self, indices: List[int]) -> None:
        if not indices:
            return
        # In call order: "mpi" collectives then start in the same order on every rank.
        finished = sorted((self.owners[i] for i in indices), key=lambda owner: owner[0].seq)
        # Remove the completed entries by moving the tail into their places, highest index
        # first (every larger completed index is gone by then, so the tail is a live one):
        # O(completed), where rebuilding both lists cost O(outstanding) per completion,
        # and a star over 4 hosts keeps ~800 requests outstanding.
        reqs, owners = self.reqs, self.owners
        for i in sorted(indices, reverse=True):
            last = reqs.pop()
            owner = owners.pop()
            if i < len(reqs):
                reqs[i], owners[i] = last, owner
        touched: Dict[int, _RunState] = {}
        for h, i in finished:
            if i == _MPI:
                self._retire(h)
            elif i == _CHECK:
                h._pending -= 1
                if h._pending == 0:
                    self._checked(h)
            elif i == _SYNC:
                h._pending -= 1
                if h._pending == 0:
                    self._shared_collect(h)
            else:
                st = self._state[h.seq]
                st.complete(i)
                touched[h.seq] = st
        for st in touched.values():
            self._post_ready(st)

    # ------------------------------------------------------------------ background thread
    @property
    def threaded(self) -> bool:
        return self._thread is not None

    def start_thread(self) -> None:
        """Progress on a daemon thread from now on (idempotent). Needs MPI_THREAD_MULTIPLE."""
        # Not self.lock: the running thread holds that one for its whole life.
        with self._thread_lock:
            if self._thread is not None:
                return
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise RuntimeError("mcallreduce: a progress thread needs MPI_THREAD_MULTIPLE, but MPI "
                                   f"provides level {MPI.Query_thread()}; use an MPI built with thread support")
            self._wake_comm = self.ctx.comm.Dup()
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="mcallreduce-progress", daemon=True)
            with self.lock:      # wait until caller-driven progress (if any) has returned
                self._thread.start()
            atexit.register(self.stop_thread)

    def stop_thread(self) -> None:
        with self._thread_lock:
            thread = self._thread
            if thread is None:
                return
            self._stop = True
            self._wake()
            thread.join()
            self._thread = None

    def _wake(self) -> None:
        self._kick.set()
        # An eager one-byte send to ourselves completes at once and makes Waitsome return.
        self._wake_comm.Send([b"\0", MPI.BYTE], dest=self.ctx.rank, tag=0)

    def _run(self) -> None:
        buf = bytearray(1)
        wake = self._wake_comm.Irecv([buf, MPI.BYTE], source=self.ctx.rank, tag=0)
        with self.lock:   # the thread owns the engine; callers only queue and wait
            while True:
                self._kick.clear()
                while self._queue:
                    self._admit(self._queue.popleft())
                if self._stop and not self.reqs and not self._queue:
                    break
                if not self.reqs:       # idle: sleep until a submission or stop, off the cores
                    self._kick.wait()
                    continue
                indices = MPI.Request.Waitsome(self.reqs + [wake]) or []
                if len(self.reqs) in indices:      # woken: new work or stop
                    indices.remove(len(self.reqs))
                    wake = self._wake_comm.Irecv([buf, MPI.BYTE], source=self.ctx.rank, tag=0)
                self._completed(indices)
        wake.Cancel()
        wake.Wait()
