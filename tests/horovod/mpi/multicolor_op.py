"""op=MultiColor with stock ``import horovod.torch``: only those calls are routed, averaged as
Horovod's Average would; DistributedOptimizer(op=MultiColor) trains as op=Average does."""
import sys

import torch
import horovod.torch as hvd

hvd.init()
from mcallreduce.horovod import MultiColor, is_active, stats   # noqa: E402  (after init: collective)

rank, size = hvd.rank(), hvd.size()
assert hvd.MultiColor == MultiColor and is_active()
x = torch.arange(40, dtype=torch.float32) * (rank + 1)
routed = stats()["routed"]
stock = hvd.allreduce(x, op=hvd.Average, name="stock")
assert stats()["routed"] == routed, "an op=Average call was routed in op-only mode"
ours = hvd.allreduce(x, op=MultiColor, name="multicolor")
assert stats()["routed"] == routed + 1
assert torch.allclose(ours, stock, rtol=1e-6), (ours, stock)
grouped = hvd.grouped_allreduce([x, x.double()], op=MultiColor, name="grouped")
assert torch.allclose(grouped[1], stock.double(), rtol=1e-6)


def train(op):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=op)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


buckets = stats()["buckets"]
reference = train(hvd.Average)
assert stats()["buckets"] == buckets, "op=Average gradients were routed in op-only mode"
trained = train(MultiColor)
assert stats()["buckets"] > buckets
assert torch.allclose(trained, reference, rtol=1e-5, atol=1e-6), (trained - reference).abs().max()
print(f"MULTICOLOR-OP ok rank {rank}", flush=True)
sys.stdout.flush()
