"""The library's state for one user communicator: its duplicates, host layout, one-host
shared-memory window, engine and memoised plans, and their lifetime."""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import sys
import threading
from typing import Dict, List, Optional

import numpy as np
from mpi4py import MPI

from . import hostlayout, linkprobe, mpit
from . import config as _config
from .config import MPI_ALGORITHMS, Config, ConfigError
from .engine import TAG_SPAN, Engine, call_weakly
from .memory import SharedWindow
from .plan import Plan
from .policy import table_problem


class Context:
    """Library state for one communicator: duplicated comms, host layout, window, engine."""

    _cache: Dict[int, "Context"] = {}   # by the communicator's handle, which MPI reuses once it is freed
    _lock = threading.Lock()
    _keyval: Optional[int] = None       # an attribute whose deletion (MPI_Comm_free) forgets the handle

    def __init__(self, comm: MPI.Comm, config: Config):
        if comm == MPI.COMM_NULL:
            raise ValueError("mcallreduce: comm is MPI.COMM_NULL (a rank outside a Split's or Create's group)")
        if comm.Is_inter():   # the schedules and MPI_Comm_split_type need one group (an intercomm crashed there)
            raise TypeError("mcallreduce: an intercommunicator has no allreduce here; Merge() it first")
        # a table that one rank cannot follow, or a link setting that differs, fails every rank now,
        # not the first call on that rank alone (or the probe, which some ranks would skip)
        checks = comm.allgather((table_problem(config), config.fast_links))
        problems = [(r, p) for r, (p, _) in enumerate(checks) if p]
        if problems:
            raise ConfigError("; ".join(f"rank {r}: {p}" for r, p in problems[:4]))
        links_problem = linkprobe.setting_problem([fast for _, fast in checks])
        if links_problem:
            raise ConfigError(links_problem)
        self.comm = comm.Dup()   # data messages of the schedules
        self.ctl = comm.Dup()    # metadata checks, posted in call order on every rank
        self.coll = comm.Dup()   # "mpi" collectives, started in call order once checked
        # "mpi-ring": Open MPI's ring allreduce on a communicator of its own (None: unavailable
        # on some rank, and "mpi-ring" runs as "mpi" on every rank)
        self.coll_ring = mpit.forced_comm(comm, "ring")
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.config = config     # the environment when the context was made
        self.hosts = hostlayout.hosts(comm, config.ranks_per_host)
        self.fast_links = linkprobe.fast_links(self.comm, self.hosts, config.fast_links,
                                               emulated=config.ranks_per_host is not None)
        # one host: multicolor's local stages through shared memory (native/shared_stage.c)
        self.shared = (SharedWindow.create(self.comm, config.shm_bytes, config.one_sync_bytes)
                       if len(self.hosts) == 1 else None)
        # TAG_UB is an attribute of COMM_WORLD only (MPI-3.1 §8.1.2); Split comms lack it.
        tag_ub = self.comm.Get_attr(MPI.TAG_UB) or MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self.windows = max(1, (tag_ub + 1) // TAG_SPAN)   # allreduces in flight at most
        self.engine = Engine(self)
        self.closed = False
        # before the window is freed and MPI finalized; weakly, so a released context is collected
        self._close_at_exit = call_weakly(self.close)
        atexit.register(self._close_at_exit)
        if self.shared is not None:
            self.engine.set_window(self.shared.win, self.shared.address, self.shared.slot_bytes,
                                   self.shared.small_bytes)
        self.single_copy = self.shared is not None and self._peers_readable()
        self._plans: Dict[tuple, Plan] = {}
        self.calls: Dict[tuple, Plan] = {}    # the fast path's plans, by call arguments
        self._bases: List[Config] = []        # the configs behind its keys' ids, kept alive
        self.submit_lock = threading.Lock()   # allreduces get their sequence number in call order
        self.next_seq = itertools.count().__next__   # atomic under the GIL, whichever lock is held

    @classmethod
    def get(cls, comm: Optional[MPI.Comm] = None) -> "Context":
        key = 0 if comm is None else comm.py2f()   # 0: COMM_WORLD, the common case
        ctx = cls._cache.get(key)
        if ctx is None:
            with cls._lock:
                ctx = cls._cache.get(key)
                if ctx is None:
                    ctx = Context(MPI.COMM_WORLD if comm is None else comm, _config.current())
                    cls._cache[key] = ctx
                    if comm is not None and comm != MPI.COMM_WORLD and comm != MPI.COMM_SELF:   # never freed
                        cls._forget_when_freed(comm, key, ctx)
                    if comm is None:
                        cls._cache[MPI.COMM_WORLD.py2f()] = ctx
        return ctx

    @classmethod
    def _forget_when_freed(cls, comm: MPI.Comm, key: int, ctx: "Context") -> None:
        """Drop the cache entry when ``comm`` is freed: a communicator made later may get the same
        handle, and must not find this context (whose communicators span the freed one's group).
        The attribute names its context: replacing it (a new context after a close) drops only the old."""
        if cls._keyval is None:
            cls._keyval = MPI.Comm.Create_keyval(delete_fn=lambda _comm, _keyval, value: cls._forget(*value))
        comm.Set_attr(cls._keyval, (key, ctx))

    @classmethod
    def _forget(cls, key: int, ctx: "Context") -> None:
        if cls._cache.get(key) is ctx:
            del cls._cache[key]
        try:
            ctx.release()   # MPI_Comm_free is collective: every rank of the group is here
        except Exception:   # noqa: BLE001  (MPI's callback has no way to raise it)
            logging.getLogger("mcallreduce").exception("mcallreduce: releasing a freed communicator's context")

    def plan(self, config: Config, nelem: int, dtype: np.dtype, op: str, pre: float, post: float,
             nonblocking: bool = False) -> "Plan":
        """Everything about an allreduce that depends only on its arguments, memoised:
        a training loop repeats a few bucket sizes, and this keeps their calls cheap.
        ``nonblocking``: ``allreduce_async``'s call, which a table may decide otherwise."""
        key = (config, nelem, dtype, op, pre, post, nonblocking)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 4096:
                self._plans.clear()
            plan = self._plans[key] = Plan(self, config, nelem, dtype, op, pre, post, nonblocking)
            if config.verbose and self.rank == 0:   # once per new kind of call, not per call
                what = plan.schedule.describe() if plan.schedule is not None else plan.algorithm
                if plan.algorithm in MPI_ALGORITHMS and plan.schedule is not None:
                    what = f"{plan.algorithm} (where a rank cannot block: {what})"
                if plan.params.shared:
                    copy = ", single copy" if plan.params.single_copy else ", one sync" if plan.params.one_sync else ""
                    what = f"{plan.algorithm}(colors={plan.params.colors}, shared memory{copy})"
                print(f"mcallreduce: {nelem} x {dtype} {op} on {self.size} ranks / {len(self.hosts)} hosts "
                      f"-> {what}", file=sys.stderr, flush=True)
        return plan

    def _peers_readable(self) -> bool:
        """Whether every rank can read every peer's memory (Linux CMA: process_vm_readv, which
        ptrace rules and containers may forbid), as the single-copy stage does; collective."""
        probe = np.array([(self.rank + 1) * 7919], np.int64)
        peers = self.comm.allgather((os.getpid(), probe.ctypes.data))
        ok = all(self.engine.native.probe_copy(pid, address) == (0, (q + 1) * 7919)
                 for q, (pid, address) in enumerate(peers) if q != self.rank)
        return bool(self.comm.allreduce(int(ok), op=MPI.MIN))   # probe stays alive until every rank read it

    def close(self) -> None:
        """Leave (every rank, at exit or hvd.shutdown()): the engine says goodbye to the peers,
        so their calls that this rank never started fail instead of waiting; the next
        ``Context.get`` for this communicator builds a new context (collectively)."""
        if self.closed:
            return
        self.closed = True
        for key in [k for k, ctx in Context._cache.items() if ctx is self]:
            del Context._cache[key]
        self.engine.close()

    def release(self) -> None:
        """Close, then let go of what the context holds (collective: DDP's destroy_process_group,
        hvd.shutdown() and freeing the user's communicator call it on every rank): the window,
        the plans, and the engine's buffers once no handle refers to it. Its duplicates of the
        communicator stay allocated and idle: a message still in flight on one (a goodbye, a
        failed call's) must not reach a later communicator that MPI gives the same context id."""
        self.close()
        try:
            self.release_shared()
        finally:
            self._plans.clear()
            self.calls.clear()
            self._bases.clear()
            atexit.unregister(self._close_at_exit)
            self.engine.release()

    def release_shared(self) -> None:
        """Free the shared-memory window now (collective; after :meth:`close`)."""
        if self.shared is not None:
            self.engine.set_window(None, 0, 0, 0)
            self.shared.free()
            self.shared = None
            self.single_copy = False   # its stage publishes through the window too
            self._plans.clear()   # plans made for the window's slots
            self.calls.clear()

    def remember(self, key: tuple, base: Config, plan: "Plan") -> None:
        """Keep ``plan`` for the fast path; ``key`` names ``base`` by id, so base stays alive."""
        if len(self.calls) > 4096:
            self.calls.clear()
            self._bases.clear()
        if not any(b is base for b in self._bases):
            self._bases.append(base)
        self.calls[key] = plan
