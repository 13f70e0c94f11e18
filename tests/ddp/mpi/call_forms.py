"""What DDP and torch call beyond the common path, without the progress thread: each ends,
with gloo's answer or a clear error, on every rank.

* DDP's first static-graph step reduces every bucket from its end-of-backward callback, none
  of them "last" (a float32 and a float64 layer: two buckets), through the hook.
* ProcessGroup's shorthand forms on the backend: ``allreduce(tensor)``, ``allreduce([t], op)``,
  ``broadcast(tensor, root)``, ``allgather(outputs, tensor)``; DDP's ``join()`` with
  ``find_unused_parameters`` calls the first.
* ``Work.is_completed()`` turns True by itself, polled.
* ``all_gather_into_tensor`` is refused, naming itself.

    python -m mcallreduce.launch -np N -- python call_forms.py     (MCALLREDUCE_PROGRESS_THREAD=0)

The exit status is the result.
"""
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
total = size * (size - 1) / 2   # the sum of the ranks


class TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4).double()

    def forward(self, x):
        return self.b(self.a(x).double())


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
print(f"rank {rank}: every call form ended", flush=True)
