"""hvd.join() (uneven inputs) when allreduces are routed, and the last rank to join.

A rank that joins keeps serving the others' routed allreduces until every rank has joined:
it first starts stock Horovod's join (so Horovod's own collectives, fallbacks included, get
its zeros as usual), then loops on the companion allreduce (:mod:`.companion`) with a
"joined" marker and neutral metadata. Each round either shows that every rank joined (all
leave the loop at the same point of the sequence, then stock join returns the last rank to
join) or gives the metadata of the next routed allreduce of the ranks still working, to
which the joined rank contributes zeros, as Horovod's joined ranks do (Average still divides
by the full size, as in Horovod). This is why every routed allreduce, the optimizer's
gradient buckets included, carries its companion metadata on every call: a joined rank
cannot know the sizes in advance.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from . import state
from .companion import ORDER_ADVICE, joined_vector, next_call
from .router import ROUTER, Finished


def wait_idle(handle) -> None:
    """Wait without keeping a core busy: a joined rank may wait a whole training step for the
    next allreduce, and its core is better left to the ranks still computing."""
    pause = 2e-5
    while not handle.test():
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def serve_joined() -> int:
    """The routed side of hvd.join(): contribute zeros to the other ranks' routed allreduces
    until every rank has joined. Returns the number of allreduces served."""
    from mcallreduce import runtime
    served = 0
    while True:
        with ROUTER.lock:
            check = runtime.allreduce_async(joined_vector(), op="max", comm=ROUTER.comm)
        wait_idle(check)
        call = next_call(check.result)
        if call is None:      # every rank sent the joined marker: all leave here, in step
            return served
        op, pre, post, sizes = call
        with ROUTER.lock:
            parts = [runtime.allreduce_async(torch.zeros(count, dtype=dtype), op=op, prescale=pre,
                                             postscale=post, comm=ROUTER.comm)
                     for count, dtype in sizes]
        for part in parts:
            try:
                part.wait()
            except Exception:
                pass         # a mismatch among the working ranks: they raise it
        served += 1
        state.counters["served_joined"] += 1


def last_to_join(served: int) -> Optional[int]:
    """The rank that joined last: the one that served the fewest routed allreduces while
    joined (it joined after all of them), or None when several share that count (they
    joined between the same two allreduces). Called by every rank, in step."""
    from mcallreduce import runtime
    ctx = runtime.Context.get(ROUTER.comm)
    counts = np.full(ctx.size, -1, dtype=np.int64)   # every rank's count, in its own slot
    counts[ctx.rank] = served
    with ROUTER.lock:
        every = runtime.allreduce_async(counts, op="max", comm=ROUTER.comm)
    wait_idle(every)
    fewest = np.flatnonzero(every.result == every.result.min())
    return int(fewest[0]) if len(fewest) == 1 else None


def join(stock_lib, stock_join, output, device) -> int:
    """hvd.join() through the mpi_lib proxy: stock Horovod's join (``stock_join`` of
    ``stock_lib``), plus serving the routed allreduces of the ranks that have not joined yet.
    Ignores stock_horovod(): the other ranks' routed allreduces need this rank either way."""
    if not ROUTER.active:
        return stock_join(output, device)
    # Stock join first: Horovod's own collectives (fallbacks) then get this rank's zeros.
    handle = stock_join(output, device)
    try:
        served = serve_joined()
        last = last_to_join(served)
    except Exception as exc:
        raise RuntimeError(
            f"mcallreduce: hvd.join() could not follow the other ranks' allreduces ({exc}). "
            + ORDER_ADVICE) from exc
    # Every rank started stock join before leaving the loop, so it completes now. Its
    # answer (the last join request Horovod saw) cannot tell apart joins that reach it in one
    # cycle, which routed allreduces in between make common; ours can, where it is unique.
    stock_lib.horovod_torch_wait_and_clear(handle)
    if last is not None:
        output.fill_(last)
    mine = ROUTER.new_handle()
    ROUTER.inflight[mine] = Finished()
    return mine
