"""A plain Horovod script (no mcallreduce import): only the environment decides.

    unmodified.py plugin|stock|declined    (what the environment should give; checked)

Checks itself: the allreduced sum, equal weights after one optimizer step on every rank, and
that the startup hook patched horovod.torch and routed calls exactly when the argument says
(read from sys.modules, so this script itself never imports mcallreduce); ``declined``: the
hook patched horovod.torch, and the plugin then declined at ``hvd.init()``. Rank 0 prints how
many calls were routed, for the tests that compare that with a trace. The exit status is the
result.
"""
import sys

import torch
import horovod.torch as hvd

want = sys.argv[1]
want_plugin = want == "plugin"
hvd.init()
total = hvd.allreduce(torch.full((1000,), float(hvd.rank() + 1)), op=hvd.Sum)
torch.manual_seed(0)   # same initial weights on every rank (no broadcast in this script)
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
model(torch.ones(3, 4) * hvd.rank()).sum().backward()
opt.step()
weights = hvd.allgather(model.weight.detach().reshape(1, -1))

state = sys.modules.get("mcallreduce.horovod.state")
counts = state.stats() if state else {"routed": 0, "buckets": 0, "fallback": 0}
patched = getattr(hvd, "_mcallreduce_patched", False)
size = hvd.size()
problems = []
if not torch.all(total == size * (size + 1) / 2):
    problems.append(f"the sum is {total[0].item():g}, not {size * (size + 1) // 2}")
if not all(torch.equal(weights[0], w) for w in weights):
    problems.append("the weights differ across ranks after one step")
if want != "declined" and patched != want_plugin:
    problems.append(f"horovod.torch {'was' if patched else 'was not'} patched")
if want_plugin and not (counts["routed"] >= 1 and counts["buckets"] >= 1):
    problems.append(f"the plugin routed too little: {counts}")
if not want_plugin and (counts["routed"] or counts["buckets"]):
    problems.append(f"{want}, yet calls were routed: {counts}")
if hvd.rank() == 0:
    print(f"ROUTED {counts['routed']} BUCKETS {counts['buckets']}", flush=True)
for problem in problems:
    print(f"rank {hvd.rank()}: {problem}", file=sys.stderr, flush=True)
sys.exit(1 if problems else 0)
