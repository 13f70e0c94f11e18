"""Plugin behaviour stock Horovod has no counterpart for (run with the plugin on).

Prints one "CHECK <name> <ok|FAILED ...>" line per check from rank 0.
"""
import warnings

import torch
import mcallreduce.horovod.torch as hvd
import mcallreduce.horovod as plugin
from _pause import Pause

hvd.init()
rank, size = hvd.rank(), hvd.size()
checks = {}

# 1. different names at the same position raise on every rank (stock would match by name),
#    saying what to do
try:
    hvd.allreduce(torch.ones(5), name=f"metric.{rank}")
    checks["name_mismatch_raises"] = False
except hvd.HorovodInternalError as exc:
    checks["name_mismatch_raises"] = "metric." in str(exc) and "MCALLREDUCE_HOROVOD=0" in str(exc)


# 1b. ... and in place, the tensors keep their values on every rank: the check runs before any
#     result reaches them (blocking, async, grouped with two dtypes, and a count mismatch)
def unchanged_after_error(start):
    tensors = [torch.arange(7.0) + 100 * rank, torch.arange(4, dtype=torch.int64) + 100 * rank]
    before = [t.clone() for t in tensors]
    try:
        start(tensors)
        return False
    except hvd.HorovodInternalError:
        return all(torch.equal(t, b) for t, b in zip(tensors, before))


checks["inplace_unchanged_after_name_mismatch"] = all([
    unchanged_after_error(lambda ts: hvd.allreduce_(ts[0], name=f"inplace.{rank}", prescale_factor=2.0)),
    unchanged_after_error(lambda ts: hvd.synchronize(hvd.allreduce_async_(ts[1], name=f"async.{rank}",
                                                                          op=hvd.Sum))),
    unchanged_after_error(lambda ts: hvd.grouped_allreduce_(ts, name=f"grouped.{rank}", op=hvd.Sum)),
    unchanged_after_error(lambda ts: hvd.allreduce_(ts[0][:7 - rank], name="count")),
    hvd.allreduce(torch.ones(2), name="after", op=hvd.Sum).tolist() == [float(size)] * 2,
])

# 2. a feature off the fast path warns once and still gives stock Horovod's answer
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    before = plugin.stats()["fallback"]
    a = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Max)
    b = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Max)
    messages = [str(w.message) for w in caught if "op Max" in str(w.message)]
    checks["fallback_warns_once"] = (len(messages) == 1 and a.item() == b.item() == size - 1
                                     and plugin.stats()["fallback"] - before == 2)

# 3. routed calls are counted; the optimizer's gradients travel in buckets
before = plugin.stats()
model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
model(torch.ones(2, 10)).sum().backward()
opt.step()
hvd.allreduce(torch.ones(3))
after = plugin.stats()
checks["counts"] = after["routed"] - before["routed"] == 1 and after["buckets"] - before["buckets"] >= 1
checks["active"] = plugin.is_active()

# 4. rank-dependent hook order (a layer used only on rank 0) still reduces correctly
model = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                               named_parameters=model.named_parameters())
x = torch.ones(1, 4)
out = model[1](model[0](x)) if rank == 0 else model[0](x)
out.sum().backward()
opt.synchronize()
grads = hvd.allgather(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).reshape(1, -1))
checks["dynamic_graph"] = all(torch.equal(grads[0], g) for g in grads)
with opt.skip_synchronize():
    opt.step()



# 5. without the progress thread, each gradient hook drives the buckets already in flight: the
#    first bucket finishes during backward, before synchronize() (pauses in backward give the
#    peer time to launch it too)
first, last = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
scales = [torch.nn.Parameter(torch.ones(1)) for _ in range(6)]
params = [first.weight, first.bias, *scales, last.weight, last.bias]
opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                               groups=[[last.weight, last.bias], [first.weight, first.bias, *scales]])
seen = {}


def note_first_bucket(_param):   # runs after the optimizer's own hook on the same parameter
    routed = opt._buckets[0].routed
    seen["done"] = all(h.done for h in [routed.check] + routed.parts)


scales[0].register_post_accumulate_grad_hook(note_first_bucket)
h = first(torch.ones(2, 4))
for s in scales:
    h = s * Pause.apply(h)
last(h).sum().backward()
opt.synchronize()
with opt.skip_synchronize():
    opt.step()
checks["hooks_drive_buckets_in_flight"] = seen.get("done", False)

oks = hvd.allgather_object(checks)
if rank == 0:
    for name in checks:
        ok = all(c[name] for c in oks)
        print(f"CHECK {name} {'ok' if ok else 'FAILED ' + str([c[name] for c in oks])}", flush=True)
