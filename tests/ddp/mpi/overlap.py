"""Without the progress thread, the multicolor hook's gradient polls finish a bucket during backward.

The model's last layer fills DDP's first bucket (1 MiB); the rest of the model is the second. Between
the two, six pauses in backward give the peers time to start the first bucket, and no bucket boundary
polls it. From the second step on (the hook learns the parameters from the first), a check that runs
late in backward finds the first bucket finished, before DDP waits for it at the end of backward.
Run with MCALLREDUCE_PROGRESS_THREAD=0. The exit status is the result.
"""
import sys

import torch
import torch.nn as nn
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import mcallreduce.ddp
from _pause import Pause

comm = MPI.COMM_WORLD
mcallreduce.ddp.init_process_group("gloo")


class Paused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(512, 512)
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(512)) for _ in range(6)])
        self.last = nn.Linear(512, 512)   # 1 MiB of weights: DDP's first bucket on its own

    def forward(self, x):
        h = self.first(x)
        for s in self.scales:
            h = s * Pause.apply(h)
        return self.last(h)


model = Paused()
ddp = DDP(model)
state = mcallreduce.ddp.MulticolorHookState()
if state.threaded:
    sys.exit("run this job with MCALLREDUCE_PROGRESS_THREAD=0")
ddp.register_comm_hook(state, mcallreduce.ddp.multicolor_hook)
seen = []


def first_bucket_pending(_param):   # registered after the hook's own polls on this parameter
    seen.append(any(h.name == "DDP bucket 0" and not h.done for h in state.pending))


for step in range(3):
    ddp(torch.randn(4, 512)).sum().backward()
    if step == 0:
        model.scales[0].register_post_accumulate_grad_hook(first_bucket_pending)
finished = not any(seen) and len(seen) == 2
everywhere = comm.allreduce(int(finished), op=MPI.MIN)
if comm.rank == 0:
    print(f"first bucket finished during backward on every rank: {bool(everywhere)} (pending at the check: {seen})")
sys.exit(0 if everywhere else 1)
