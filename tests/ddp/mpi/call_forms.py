"""What DDP and torch call beyond the common path, without the progress thread: each ends,
with gloo's answer or a clear error, on every rank.

* DDP's first static-graph step reduces every bucket from its end-of-backward callback, none
  of them "last" (a float32 and a float64 layer: two buckets), through the hook.
* ProcessGroup's shorthand forms on the backend: ``allreduce(tensor)``, ``allreduce([t], op)``,
  ``broadcast(tensor, root)``, ``allgather(outputs, tensor)``; DDP's ``join()`` with
  ``find_unused_parameters`` calls the first.
* ``Work.is_completed()`` turns True by itself, polled; ``Work.result()`` gives the outputs.
* int8, uint8 and bool ``all_reduce`` with every op, as gloo's (integers wrap, a bool's sum is or);
  non-contiguous tensors to ``broadcast`` and ``allgather``.
* ``all_gather_into_tensor`` is refused, naming itself.
* ``destroy_process_group()`` frees the group's shared-memory window (24 MiB of /dev/shm at 2 ranks)
  and lets its engine go: init and destroy in a loop leave neither behind.

    python -m mcallreduce.launch -np N -- python call_forms.py     (MCALLREDUCE_PROGRESS_THREAD=0)

The exit status is the result.
"""
import gc
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import mcallreduce.ddp
from mcallreduce.context import Context

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
total = size * (size - 1) / 2   # the sum of the ranks
total_of_ranks_plus_one = size * (size + 1) / 2


class TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4).double()

    def forward(self, x):
        return self.b(self.a(x).double())


def live_contexts() -> int:
    gc.collect()
    return sum(type(o) is Context for o in gc.get_objects())


def windows() -> int:
    """The shared-memory windows this process maps (Open MPI's osc/sm segments)."""
    with open("/proc/self/maps") as maps:
        return sum("/osc_sm." in line for line in maps)


mcallreduce.ddp.init_process_group("mcallreduce")
torch.manual_seed(0)
model = DDP(TwoDtypes(), static_graph=True)
model.register_comm_hook(None, mcallreduce.ddp.multicolor_hook)
inputs = torch.Generator().manual_seed(1 + rank)   # other data on each rank: equal gradients mean averaged ones
for _ in range(3):
    model.zero_grad()
    model(torch.randn(4, 8, generator=inputs)).sum().backward()
grads = torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])
assert all(torch.allclose(grads, g, rtol=0, atol=1e-12) for g in comm.allgather(grads)), "gradients not averaged"

group = dist.distributed_c10d._get_default_group()
t = torch.full((3,), float(rank))
group.allreduce(t).wait()
assert torch.equal(t, torch.full((3,), total)), t
t = torch.tensor([float(rank), 2.0 * rank])
group.allreduce([t], dist.ReduceOp.MAX).wait()
assert t.tolist() == [size - 1.0, 2.0 * (size - 1)], t
t = torch.full((2,), float(rank))
group.broadcast(t, size - 1).wait()
assert t.tolist() == [size - 1.0] * 2, t
outputs = [torch.empty(2) for _ in range(size)]
group.allgather(outputs, torch.full((2,), float(rank))).wait()
assert [o.tolist() for o in outputs] == [[float(r)] * 2 for r in range(size)], outputs

uneven = DDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), find_unused_parameters=True)
with uneven.join():
    for _ in range(3 + rank):
        uneven(torch.randn(4, 8)).sum().backward()

def of_rank(r, dtype):
    if dtype == torch.bool:
        return torch.tensor([(r >> b) & 1 for b in range(4)] + [1, 0], dtype=torch.bool)
    return torch.tensor([100, -100, 3 - 8 * r, 7 * r, 120, -128], dtype=torch.int16).to(dtype)   # wraps into uint8


folds = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.PRODUCT: torch.mul, dist.ReduceOp.MIN: torch.minimum,
         dist.ReduceOp.MAX: torch.maximum}
for dtype in (torch.int8, torch.uint8, torch.bool):
    for reduce_op, fold in folds.items():
        want = of_rank(0, dtype)
        for r in range(1, size):
            want = fold(want, of_rank(r, dtype))
        t = of_rank(rank, dtype)
        dist.all_reduce(t, reduce_op)
        assert torch.equal(t, want), (dtype, reduce_op, t, want)

strided = torch.arange(12.0).reshape(3, 4).t() * (rank + 1)
work = dist.all_reduce(strided, async_op=True)
assert [torch.equal(x, strided) for x in work.result()] == [True], work.result()
assert torch.equal(strided, torch.arange(12.0).reshape(3, 4).t() * total_of_ranks_plus_one), strided
strided = torch.full((4, 3), float(rank)).t()
assert not strided.is_contiguous()
dist.broadcast(strided, src=size - 1)
assert torch.equal(strided, torch.full((3, 4), size - 1.0)), strided
outputs = [torch.empty(3, 2).t() for _ in range(size)]
mine = (torch.arange(6.0).reshape(3, 2) + rank).t()
assert not mine.is_contiguous() and not outputs[0].is_contiguous()
dist.all_gather(outputs, mine)
assert all(torch.equal(o, (torch.arange(6.0).reshape(3, 2) + r).t()) for r, o in enumerate(outputs)), outputs

work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
deadline = time.monotonic() + 10
while not work.is_completed():
    assert time.monotonic() < deadline, "is_completed() stayed False"
    time.sleep(0.001)

try:
    dist.all_gather_into_tensor(torch.empty(2 * size), torch.ones(2))
    sys.exit("all_gather_into_tensor was not refused")
except NotImplementedError as exc:
    assert "all_gather" in str(exc) and "gloo" in str(exc), exc

dist.destroy_process_group()
before = windows()   # the hook's context over COMM_WORLD keeps its window until exit
contexts = live_contexts()
for _ in range(2):
    mcallreduce.ddp.init_process_group("mcallreduce")
    dist.all_reduce(torch.ones(1 << 16))
    dist.destroy_process_group()
    assert windows() == before, f"{windows() - before} shared-memory windows left after destroy_process_group()"
    assert live_contexts() == contexts, "a destroyed group's engine stayed (its buffers and threads with it)"
print(f"rank {rank}: every call form ended", flush=True)
