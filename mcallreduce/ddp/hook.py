"""A DDP communication hook: each gradient bucket averaged by the multi-color allreduce.

    model = DistributedDataParallel(net)
    model.register_comm_hook(None, mcallreduce.ddp.multicolor_hook)

The hook starts the bucket's allreduce and returns at once with a future that the engine
completes, so later buckets' gradients are computed while earlier ones travel. Who drives
the engine meanwhile:

* the progress thread (``MCALLREDUCE_PROGRESS_THREAD``; auto: when the host has a core to
  spare), which completes each future the moment its bucket is reduced;
* without it, the hooks themselves: each one progresses the buckets before it, and the
  last bucket's hook finishes them all (DDP calls hooks in bucket order and waits on the
  futures only after the last one), so nothing is left for a thread nobody runs. Between
  buckets, every parameter's gradient hook tests the oldest bucket in flight once (from the
  second step on: the first tells the hook which parameters its buckets hold), so a bucket's
  later rounds overlap the rest of backward, as the Horovod plugin's optimizer does.
"""
# (no "from __future__ import annotations": DDP checks the hook's annotations as objects)

import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import policy
from .futures import InFlight, future_for, inside_backward_node, reducible
from .rendezvous import check_matches_mpi

__all__ = ["MulticolorHookState", "multicolor_hook"]


class MulticolorHookState:
    """What :func:`multicolor_hook` reduces with. Built at registration, it checks that
    torch.distributed's ranks are the MPI communicator's (raises there, not in backward).

    ``process_group``: DDP's group (default: the default group); ``comm``: the MPI
    communicator the buckets are reduced over (default COMM_WORLD); ``algorithm`` and
    ``overrides`` (colors=, segment_bytes=, ...) as for :func:`mcallreduce.allreduce`;
    ``progress_thread``: True, False, or None for ``MCALLREDUCE_PROGRESS_THREAD``.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, comm: Any = None,
                 algorithm: Optional[str] = None, progress_thread: Optional[bool] = None, **overrides):
        from mpi4py import MPI
        from .. import runtime
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        check_matches_mpi(process_group, self.comm, "mcallreduce.ddp.multicolor_hook")
        self.process_group, self.algorithm, self.overrides = process_group, algorithm, overrides
        self._allreduce_async = runtime.allreduce_async
        context = runtime.Context.get(comm)   # collective: every rank registers its hook
        if progress_thread is None:
            progress_thread = policy.progress_thread(context.hosts)
        if progress_thread:
            runtime.start_progress_thread(comm)
        self.threaded = context.engine.threaded
        self.pending = InFlight()   # without the thread: this backward's handles, not yet finished
        self.polled = {}   # id -> weak reference: the parameters whose gradient hook tests the oldest of them

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        tensor = bucket.buffer()
        work, finish = reducible(tensor)
        handle = self._allreduce_async(work, op="average", comm=self.comm, algorithm=self.algorithm,
                                       **self.overrides)
        handle.name = f"DDP bucket {bucket.index()}"
        future = future_for(handle, tensor, finish)
        if not self.threaded:
            self._poll_from(bucket.parameters())
            # outside a node of backward (DDP's first static-graph step reduces every bucket from its
            # end-of-backward callback, each "not last", then waits): finish each one now
            self._drive(handle, bucket.is_last() or not inside_backward_node())
        return future

    def _poll_from(self, params) -> None:
        for p in params:
            known = self.polled.get(id(p))
            if known is None or known() is not p:
                self.polled[id(p)] = weakref.ref(p)
                p.register_post_accumulate_grad_hook(self._poll)

    def _poll(self, _param) -> None:
        self.pending.advance(finish=False)

    def _drive(self, handle, last: bool) -> None:
        """Caller-driven progress: test the buckets in flight, finish them all at the last."""
        self.pending.add(handle)
        self.pending.advance(finish=last)


_DEFAULT: Optional[MulticolorHookState] = None


def multicolor_hook(state: Optional[MulticolorHookState], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average ``bucket`` over the ranks with the multi-color allreduce.

    ``state=None`` takes the defaults (built, and the ranks checked, at the first bucket).
    """
    global _DEFAULT
    if state is None:
        if _DEFAULT is None:
            _DEFAULT = MulticolorHookState()
        state = _DEFAULT
    return state.reduce(bucket)
