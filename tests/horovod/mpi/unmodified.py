"""A plain Horovod script (no mcallreduce import): only the environment decides.

Prints from rank 0 the allreduced values and, for the test, whether the startup hook
patched horovod.torch and how many calls it routed (read from sys.modules, so this script
itself never imports mcallreduce).
"""
import sys

import torch
import horovod.torch as hvd

hvd.init()
total = hvd.allreduce(torch.full((1000,), float(hvd.rank() + 1)), op=hvd.Sum)
torch.manual_seed(0)   # same initial weights on every rank (no broadcast in this script)
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
model(torch.ones(3, 4) * hvd.rank()).sum().backward()
opt.step()
weights = hvd.allgather(model.weight.detach().reshape(1, -1))
same = all(torch.equal(weights[0], w) for w in weights)

state = sys.modules.get("mcallreduce.horovod.state")
counts = state.stats() if state else {"routed": 0, "buckets": 0, "fallback": 0}
if hvd.rank() == 0:
    print(f"SUM {total[0].item():g}", flush=True)
    print(f"WEIGHTS_EQUAL {same}", flush=True)
    print(f"PATCHED {getattr(hvd, '_mcallreduce_patched', False)}", flush=True)
    print(f"ROUTED {counts['routed']} BUCKETS {counts['buckets']}", flush=True)
