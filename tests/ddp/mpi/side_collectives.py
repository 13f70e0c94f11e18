"""The backend's broadcast, allgather and barrier against what a gloo user relies on.

* After ``all_reduce(t, async_op=True)``, a barrier (or an allgather) sees the allreduce's result
  in ``t``, also where the result is copied back (a strided or bfloat16 tensor) and the
  progress thread completes it.
* Results are copied into parameters that require grad (bfloat16, strided; broadcast into a
  strided one), as gloo writes them.
* A sparse tensor is refused with a TypeError that says so.
* A barrier that a rank reaches after the group's timeout raises RuntimeError on the ranks that
  waited, instead of waiting for ever; so does an all_reduce (last: the group is not usable after
  it). The late rank's all_reduce may finish (what it needs may have arrived before its peers gave
  up) or raise, but not wait for ever.
* Torch ranks that are a permutation of MPI's raise on every rank, the rank whose two ranks
  happen to agree included (it used to wait alone in the collective that follows).

The exit status is the result.
"""
import datetime
import sys
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import mcallreduce.ddp
from mcallreduce.ddp.rendezvous import require_mpi_ranks

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
problems = []
TIMEOUT_S = 3.0
mcallreduce.ddp.init_process_group("mcallreduce", timeout=datetime.timedelta(seconds=TIMEOUT_S))
total = float(size * (size + 1) // 2)   # every rank contributes rank + 1

# an async allreduce, then a barrier or an allgather: the result is in place when they return
for kind in ("strided", "bfloat16"):
    for then in ("barrier", "all_gather"):
        stale = 0
        for _ in range(20):
            if kind == "strided":
                t = torch.full((1 << 16, 2), float(rank + 1)).t()
            else:
                t = torch.full((2, 1 << 16), float(rank + 1), dtype=torch.bfloat16)
            dist.all_reduce(t, async_op=True)
            if then == "barrier":
                dist.barrier()
            else:
                dist.all_gather([torch.zeros(1) for _ in range(size)], torch.ones(1))
            stale += not bool((t == total).all())
        if stale:
            problems.append(f"rank {rank}: {stale} of 20 {kind} results not in place after {then}")

# copies into parameters that require grad
for name, param in (("bfloat16", torch.nn.Parameter(torch.full((4,), float(rank + 1), dtype=torch.bfloat16))),
                    ("strided", torch.nn.Parameter(torch.full((4, 2), float(rank + 1)).t()))):
    try:
        dist.all_reduce(param)
        if not bool((param.detach() == total).all()):
            problems.append(f"rank {rank}: all_reduce of a {name} parameter gave {param.detach().tolist()}")
    except RuntimeError as exc:
        problems.append(f"rank {rank}: all_reduce of a {name} parameter raised {exc}")
param = torch.nn.Parameter(torch.full((4, 2), float(rank)).t())
try:
    dist.broadcast(param, src=0)
    if not bool((param.detach() == 0).all()):
        problems.append(f"rank {rank}: broadcast into a strided parameter gave {param.detach().tolist()}")
except RuntimeError as exc:
    problems.append(f"rank {rank}: broadcast into a strided parameter raised {exc}")

# sparse tensors: a clear refusal (DDP's sparse embedding gradients among them)
try:
    dist.all_reduce(torch.eye(3).to_sparse())
    problems.append(f"rank {rank}: a sparse all_reduce did not raise")
except Exception as exc:   # noqa: BLE001  (its type is part of what is checked)
    if not isinstance(exc, TypeError) or "sparse" not in str(exc):
        problems.append(f"rank {rank}: a sparse all_reduce raised {type(exc).__name__}: {exc}")

# a barrier that the last rank reaches after the timeout: the others raise, then all go on
comm.Barrier()
if rank == size - 1:
    time.sleep(TIMEOUT_S + 2)
started = time.monotonic()
try:
    dist.barrier()
    if rank != size - 1:
        problems.append(f"rank {rank}: a barrier past the group's timeout returned")
except RuntimeError as exc:
    waited = time.monotonic() - started
    if rank == size - 1 or "timeout" not in str(exc) or not TIMEOUT_S <= waited < TIMEOUT_S + 2:
        problems.append(f"rank {rank}: barrier raised after {waited:.1f} s: {exc}")

# torch ranks reversed: every rank raises (with 3 ranks, rank 1's two ranks agree)
try:
    require_mpi_ranks(size - 1 - rank, size, comm, "the test")
    problems.append(f"rank {rank}: reversed torch ranks passed the check")
except RuntimeError:
    pass

# an all_reduce that the last rank reaches after the timeout: the others raise; none waits for ever
comm.Barrier()
late = rank == size - 1
if late:   # past the timeout and the inspector's next look (a quarter of it), with room for a busy machine
    time.sleep(TIMEOUT_S + 5)
started = time.monotonic()
try:
    dist.all_reduce(torch.ones(1000))
    if not late:
        problems.append(f"rank {rank}: an all_reduce past the group's timeout returned")
except RuntimeError as exc:
    waited = time.monotonic() - started
    if "timeout" not in str(exc) or not (0 if late else TIMEOUT_S) <= waited < TIMEOUT_S + 4:
        problems.append(f"rank {rank}: all_reduce raised after {waited:.1f} s: {exc}")
if late and time.monotonic() - started >= TIMEOUT_S + 4:
    problems.append(f"rank {rank}: the late all_reduce took {time.monotonic() - started:.1f} s")

dist.destroy_process_group()
problems = [p for ps in comm.allgather(problems) for p in ps]
if rank == 0:
    print("\n".join(problems) if problems else f"side collectives as gloo's on {size} ranks", flush=True)
sys.exit(1 if problems else 0)
