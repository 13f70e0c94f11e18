"""hvd.join() with uneven inputs: ranks run different numbers of steps, then join.

Usage (under mpirun): join_uneven.py OUT.pt
Two epochs: in the first rank r runs 2 + 2r steps (the last rank joins last), in the second
the order is reversed (rank 0 joins last). Every step: a DistributedOptimizer step, an
in-place metric, an Average with scale factors, a grouped allreduce of two dtypes and a Max
(a stock fallback while other ranks are inside join). Ranks that joined contribute zeros, as
in stock Horovod. Rank 0 saves every rank's record to OUT.pt; the pytest side compares the
plugin with stock Horovod.
"""
import sys
import warnings

import torch
import horovod.torch as hvd

warnings.simplefilter("ignore")   # the Max fallback warning
hvd.init()
rank, size = hvd.rank(), hvd.size()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters())
g = torch.Generator().manual_seed(rank)
record = {"steps": [], "last_joined": [], "params": []}


def step(i):
    x = torch.randn(4, 6, generator=g)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    metric = torch.tensor([float(i + 1), float(rank + 1)])
    hvd.allreduce_(metric, op=hvd.Sum, name="metric")
    avg = hvd.allreduce(torch.full((5,), float(rank + 1)), op=hvd.Average, name="avg",
                        prescale_factor=2.0, postscale_factor=0.5)
    grouped = hvd.grouped_allreduce([torch.full((3,), rank + 1, dtype=torch.int64),
                                     torch.full((2, 2), rank + 1.0, dtype=torch.float64)],
                                    op=hvd.Sum, name="grouped")
    biggest = hvd.allreduce(torch.tensor([rank - 10.0]), op=hvd.Max, name="max")
    return torch.cat([metric, avg, grouped[0].double(), grouped[1].reshape(-1), biggest])


for epoch in range(2):
    order = rank if epoch == 0 else size - 1 - rank
    for i in range(2 + 2 * order):
        record["steps"].append(step(i))
    record["last_joined"].append(hvd.join())
    # back in step: a routed allreduce and the parameters
    record["after"] = hvd.allreduce(torch.full((4,), float(rank)), op=hvd.Sum, name=f"after.{epoch}")
    record["params"].append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))

# Unnamed tensors after uneven work: Horovod names them by a per-rank call counter, which now
# differs between the ranks (stock Horovod would stall); the plugin matches them by position.
if getattr(hvd, "_mcallreduce_patched", False):
    record["unnamed"] = hvd.allreduce(torch.full((3,), float(rank + 1)), op=hvd.Sum)

stats = sys.modules.get("mcallreduce.horovod.state")
record["stats"] = stats.stats() if stats else {}
everyone = hvd.allgather_object(record)
if rank == 0:
    torch.save({"size": size, "ranks": everyone}, sys.argv[1])
    print(f"JOINED {[r['last_joined'] for r in everyone]}", flush=True)
