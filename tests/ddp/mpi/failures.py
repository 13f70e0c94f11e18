"""What goes wrong in a DDP job is reported on every rank, and nothing hangs.

* A bucket whose size differs across ranks (rank 1's model is larger; ``init_sync=False``
  skips DDP's own shape check) makes ``backward()`` raise on every rank, with the hook and
  on the backend.
* A ``Work.wait(timeout)`` past its timeout raises, and a later wait finishes the collective.
* The backend as the default group, initialised with ``init_method="mcallreduce://"`` or (with
  the argument ``bare``) as ``dist.init_process_group("mcallreduce")`` with no ``MASTER_ADDR``:
  broadcast, allgather, barrier and every supported reduce op give gloo's answers; an
  unsupported collective or op raises a clear error.

The exit status is the result.
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import mcallreduce.ddp

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
problems = []


def expect_raises(what: str, fn, exc_type=Exception, words=()) -> None:
    try:
        fn()
    except exc_type as exc:
        missing = [w for w in words if w not in str(exc)]
        if missing:
            problems.append(f"rank {rank} {what}: message lacks {missing}: {exc}")
        return
    problems.append(f"rank {rank} {what}: did not raise")


def mismatched_backward(group, hook: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 8 if rank != 1 else 9)
    ddp = DDP(model, process_group=group, init_sync=False)
    if hook:
        ddp.register_comm_hook(mcallreduce.ddp.MulticolorHookState(group), mcallreduce.ddp.multicolor_hook)
    ddp(torch.randn(4, 16)).sum().backward()


if sys.argv[1:] == ["bare"]:
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    dist.init_process_group("mcallreduce")      # torch's default env:// rendezvous, taken over MPI
else:
    dist.init_process_group(mcallreduce.ddp.BACKEND, init_method="mcallreduce://")
default = dist.group.WORLD
if dist.get_backend() != "mcallreduce":
    problems.append(f"default backend is {dist.get_backend()}")
gloo = dist.new_group(backend="gloo")   # torch's store works: other backends can join

# collectives of the backend against gloo's
for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
    for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
        if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
            continue
        base = torch.arange(1, 11, dtype=torch.float64).mul(rank + 1).to(dtype)
        ours, theirs = base.clone(), base.clone()
        dist.all_reduce(ours, op=op)
        if dtype == torch.bfloat16 or op == dist.ReduceOp.AVG:   # gloo's AVG is SUM then divide
            theirs = theirs.float()
            dist.all_reduce(theirs, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, group=gloo)
            theirs = (theirs / size if op == dist.ReduceOp.AVG else theirs).to(dtype)
        else:
            dist.all_reduce(theirs, op=op, group=gloo)
        if not torch.allclose(ours.double(), theirs.double(), rtol=1e-6):
            problems.append(f"rank {rank} all_reduce {op} {dtype}: {ours} != gloo's {theirs}")
work = dist.all_reduce(torch.ones(1000), async_op=True)
work.wait()
# a wait with a timeout raises once it passes (the last rank starts its part late), and a later wait finishes it
if rank == size - 1:
    time.sleep(1.2)
late = torch.ones(1000)
work = dist.all_reduce(late, async_op=True)
if rank != size - 1:
    t0 = time.monotonic()
    expect_raises("a wait past its timeout", lambda: work.wait(timeout=datetime.timedelta(seconds=0.3)),
                  RuntimeError, ["timeout"])
    if not 0.3 <= time.monotonic() - t0 < 1.5:
        problems.append(f"rank {rank}: the timed wait took {time.monotonic() - t0:.2f} s for a 0.3 s timeout")
work.wait()
if not torch.equal(late, torch.full((1000,), float(size))):
    problems.append(f"rank {rank} all_reduce after a timed-out wait: {late[:3]}")
t = torch.full((5,), float(rank)) if rank == 0 else torch.zeros(5)
dist.broadcast(t, src=0)
if not torch.equal(t, torch.zeros(5)):
    problems.append(f"rank {rank} broadcast from 0: {t}")
t = torch.full((3,), 7.0 + rank)
dist.broadcast(t, src=size - 1)
if not torch.equal(t, torch.full((3,), 7.0 + size - 1)):
    problems.append(f"rank {rank} broadcast from {size - 1}: {t}")
gathered = [torch.empty(2, dtype=torch.int64) for _ in range(size)]
dist.all_gather(gathered, torch.tensor([rank, 10 * rank]))
if [g.tolist() for g in gathered] != [[r, 10 * r] for r in range(size)]:
    problems.append(f"rank {rank} all_gather: {gathered}")
objects = [None] * size
dist.all_gather_object(objects, {"rank": rank})
if objects != [{"rank": r} for r in range(size)]:
    problems.append(f"rank {rank} all_gather_object: {objects}")
dist.barrier()
# a pending async allreduce is finished before a later broadcast reads the same tensor
t = torch.ones(100000)
dist.all_reduce(t, async_op=True)
dist.broadcast(t, src=0)
if not torch.equal(t, torch.full((100000,), float(size))):
    problems.append(f"rank {rank} broadcast after an async all_reduce saw {t[:3]}")

expect_raises("reduce_scatter", lambda: dist.reduce_scatter(torch.zeros(1), [torch.zeros(1)] * size),
              NotImplementedError, ["reduce_scatter", "gloo"])
expect_raises("all_to_all_single", lambda: dist.all_to_all_single(torch.zeros(size), torch.zeros(size)),
              Exception, ["all_to_all_single"])
expect_raises("BAND", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.BAND),
              ValueError, ["BAND", "SUM"])
if rank == 0 and size > 1:   # the other ranks are not members: torch does not call the backend there
    expect_raises("a subgroup", lambda: dist.new_group(ranks=[0], backend="mcallreduce"), RuntimeError, ["subset"])

# mismatched buckets: backward raises everywhere (hook on a gloo-backed model; the backend)
expect_raises("hook with mismatched buckets", lambda: mismatched_backward(gloo, True), RuntimeError, ["mcallreduce"])
expect_raises("backend with mismatched buckets", lambda: mismatched_backward(default, False), RuntimeError,
              ["mcallreduce"])

everyone = [p for ps in comm.allgather(problems) for p in ps]
if rank == 0:
    print("\n".join(everyone) or f"failures: all reported on {size} ranks", flush=True)
dist.destroy_process_group()
sys.exit(1 if everyone else 0)
