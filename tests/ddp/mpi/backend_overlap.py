"""Without the progress thread, DDP on the mcallreduce backend goes on with backward while a bucket travels.

From the second step on (DDP reduces the first in one bucket, then rebuilds its buckets) the model's
last layer fills DDP's first bucket. Rank 1 starts each backward 0.5 s late, so that bucket cannot
finish on rank 0 before rank 1 starts it. A check late in rank 0's backward must find it still in
flight (a backend that finished each bucket before returning its future to DDP would have held
backward there), and after every backward each rank's gradients must be the mean of the ranks' own.
Run with MCALLREDUCE_PROGRESS_THREAD=0. The exit status is the result.
"""
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import mcallreduce.ddp
from _pause import Pause

comm = MPI.COMM_WORLD
mcallreduce.ddp.init_process_group("gloo")
group = dist.new_group(backend="mcallreduce")
if group._threaded:
    sys.exit("run this job with MCALLREDUCE_PROGRESS_THREAD=0")


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(512, 512)
        self.last = nn.Linear(512, 512)   # 1 MiB of weights: DDP's first bucket on its own

    def forward(self, x):
        return Pause.apply(self.last(torch.relu(self.first(x))), 0.5 if comm.rank == 1 else 0.0)


model = TwoLayers()
local = copy.deepcopy(model)
ddp = DDP(model, process_group=group)
in_flight_late = []
model.first.weight.register_post_accumulate_grad_hook(
    lambda _p: in_flight_late.append(sum(not h.done for h in group._in_flight)))
failures = []
for step in range(3):
    model.zero_grad()
    local.zero_grad()
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(100 * step + comm.rank))
    ddp(x).sum().backward()
    local(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), local.parameters()):
        mean = torch.from_numpy(comm.allreduce(q.grad.numpy(), op=MPI.SUM)) / comm.size
        if not torch.allclose(p.grad, mean, rtol=1e-5, atol=1e-6):
            failures.append(f"step {step}: {name}'s gradient is not the ranks' mean")
if comm.rank == 0 and (len(in_flight_late) != 3 or not all(in_flight_late[1:])):
    failures.append(f"rank 0: allreduces in flight late in backward, by step: {in_flight_late} (expected >= 1 from the second)")
for failure in failures:
    print(f"rank {comm.rank}: {failure}", flush=True)
everywhere = comm.allreduce(int(not failures), op=MPI.MIN)
if comm.rank == 0:
    print(f"backward went on while a bucket travelled, gradients averaged, on every rank: {bool(everywhere)} "
          f"(in flight late in backward: {in_flight_late})")
sys.exit(0 if everywhere else 1)
