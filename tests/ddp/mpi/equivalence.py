"""DDP with the multicolor hook, or on the mcallreduce backend, ends where DDP on gloo ends.

Usage: equivalence.py hook|backend|hook,backend [cpu|cuda]. Every variant trains 20 steps from the
same start, on different data per rank: on gloo, then with each arm (a line of results per arm).
Parameters and buffers must agree (bitwise at 2 ranks, to 1e-6 relative beyond) and be bitwise
equal across ranks. Buckets compressed to float16 (PyTorch's compression hook, or its wrapper around ours)
agree to 1e-2 relative after the 20 steps wherever they are not bitwise: beyond 2 ranks such
sums in another order differ in the last bit, and a wrapped hook averages after the sum where
PyTorch's own compression hook divides first (in 16 bits, where small gradients lose bits).
On CUDA, buckets compressed to bfloat16 are checked the same way. On the backend, PowerSGD's
allreduces of its low-rank factors run on the group. The exit status is the result: 0 when
every check passed on every rank.
"""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from mpi4py import MPI
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import mcallreduce.ddp

ARMS = sys.argv[1].split(",")
DEVICE = torch.device(sys.argv[2] if len(sys.argv) > 2 else "cpu")   # cuda: the hook on GPU buckets
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
mcallreduce.ddp.init_process_group("gloo")
GROUP = None   # the mcallreduce backend's group, made after the hook's runs: those see none, as a hook user's
STEPS = 20


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x):
        return self.used(x)


def network(variant: str) -> nn.Module:
    torch.manual_seed(99 if variant == "rank1_differs" and rank == 1 else 0)
    if variant == "batchnorm":
        return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    if variant == "unused":
        return WithUnused()
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))


OPTIONS = {
    "plain": {}, "small_buckets": {"bucket_cap_mb": 0.002}, "bucket_view": {"gradient_as_bucket_view": True},
    "unused": {"find_unused_parameters": True}, "batchnorm": {}, "no_sync": {}, "rank1_differs": {},
    "static_graph": {"static_graph": True}, "join": {}, "fp16_compress": {},
}
# PowerSGD's own allreduces (of its low-rank factors) go to the group; its callbacks wait on
# further allreduces, which the progress thread must finish while they wait
BACKEND_ONLY = {"powersgd": {}}
# torch refuses its bfloat16 compression hooks without CUDA and NCCL: only float16 here
COMPRESSED = {"fp16_compress": default_hooks.fp16_compress_hook}
WRAPPERS = {"fp16_compress": default_hooks.fp16_compress_wrapper}
if DEVICE.type == "cuda":   # torch allows its bfloat16 compression only with CUDA and NCCL
    OPTIONS["bf16_compress"] = {}
    COMPRESSED["bf16_compress"] = default_hooks.bf16_compress_hook
    WRAPPERS["bf16_compress"] = default_hooks.bf16_compress_wrapper


def train(variant: str, arm: str):
    model = network(variant).to(DEVICE)
    options = {**OPTIONS, **BACKEND_ONLY}[variant]
    if arm == "backend":
        ddp = DDP(model, process_group=GROUP, **options)
    else:
        ddp = DDP(model, **options)
    if variant in COMPRESSED:   # PyTorch's own compression: its hook, or its wrapper around ours
        if arm == "hook":
            ddp.register_comm_hook(None, WRAPPERS[variant](mcallreduce.ddp.multicolor_hook))
        else:   # on gloo, or on the mcallreduce backend (the hook's allreduce goes to its group)
            ddp.register_comm_hook(GROUP if arm == "backend" else None, COMPRESSED[variant])
    elif variant == "powersgd":   # the same seed on both arms: the same random projections
        state = powerSGD_hook.PowerSGDState(process_group=GROUP if arm == "backend" else None,
                                            matrix_approximation_rank=2, start_powerSGD_iter=3, random_seed=5)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif arm == "hook":
        ddp.register_comm_hook(None, mcallreduce.ddp.multicolor_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)
    # uneven inputs: rank r stops 5 r steps early; the joined ranks run the hook on zeros, and
    # the last to join broadcasts the final model
    steps = STEPS - 5 * rank if variant == "join" else STEPS

    def loop():
        for step in range(steps):
            x, y = torch.randn(8, 16, generator=data), torch.randint(0, 4, (8,), generator=data)
            x, y = x.to(DEVICE), y.to(DEVICE)
            if variant == "no_sync" and step % 2 == 0:
                with ddp.no_sync():
                    nn.functional.cross_entropy(ddp(x), y).backward()
                continue
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    if variant == "join":
        with ddp.join():
            loop()
    else:
        loop()

    parameters = {name for name, _ in model.named_parameters()}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, parameters


def compare(variant: str, arm: str, reference: tuple, got: tuple) -> list:
    (reference, parameters), (got, _) = reference, got
    problems = []
    for name, ref in reference.items():
        mine = got[name]
        tolerance = 1e-2 if variant in COMPRESSED else 1e-6
        loose = variant in COMPRESSED and arm == "hook"
        if (size == 2 and not loose) or not ref.is_floating_point():
            same = torch.equal(ref, mine)
        else:
            same = bool(((ref - mine).abs() <= tolerance * ref.abs().max().clamp_min(1e-30)).all())
        if not same:
            diff = (ref.double() - mine.double()).abs().max().item()
            problems.append(f"rank {rank} {variant}/{arm}: {name} differs from gloo's by {diff:.3g}")
    # buffers (BatchNorm's running statistics) are each rank's own after the last forward
    flat = torch.cat([got[name].reshape(-1).double() for name in sorted(parameters)]).numpy().tobytes()
    if len(set(comm.allgather(flat))) != 1 and rank == 0:
        problems.append(f"{variant}/{arm}: parameters differ across ranks")
    return problems


def bf16_gradients(tested: str) -> list:
    """One backward of a bfloat16 model: the arm's reduced gradients are the exact result,
    rounded once (and bitwise gloo's at 2 ranks, where gloo rounds once too)."""
    grads = {}
    # gloo reduces no bfloat16 CUDA tensors: on the GPU, only the exact result is the reference
    arms = ("local", "gloo", tested) if DEVICE.type == "cpu" else ("local", tested)
    for arm in arms:
        torch.manual_seed(0)
        model = nn.Linear(64, 8).to(DEVICE, torch.bfloat16)
        ddp = model if arm == "local" else DDP(model, process_group=GROUP if arm == "backend" else None)
        if arm == "hook":
            ddp.register_comm_hook(None, mcallreduce.ddp.multicolor_hook)
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(7 + rank)).to(DEVICE, torch.bfloat16)
        ddp(x).float().pow(2).sum().backward()
        grads[arm] = [p.grad.cpu().clone() for p in model.parameters()]
    problems = []
    for i, (local, ours, gloo) in enumerate(zip(grads["local"], grads[tested], grads.get("gloo", grads[tested]))):
        if tested == "backend":   # DDP divides each rank's bucket first (in bfloat16), then sums
            exact = sum(comm.allgather((local / size).double()))
        else:
            exact = sum(comm.allgather(local.double())) / size
        if not torch.equal(ours, exact.to(torch.bfloat16)):
            problems.append(f"rank {rank} bfloat16/{tested}: gradient {i} is not the exact result, rounded once")
        if size == 2 and "gloo" in grads and not torch.equal(ours, gloo):
            problems.append(f"rank {rank} bfloat16/{tested}: gradient {i} differs from gloo's")
    return problems


failed = False
gloo = {variant: train(variant, "gloo") for variant in {**OPTIONS, **(BACKEND_ONLY if "backend" in ARMS else {})}}
for arm in ARMS:
    if arm == "backend":
        GROUP = dist.new_group(backend="mcallreduce")
    variants = {**OPTIONS, **BACKEND_ONLY} if arm == "backend" else OPTIONS
    problems = [p for variant in variants for p in compare(variant, arm, gloo[variant], train(variant, arm))]
    problems += bf16_gradients(arm)
    everyone = [p for ps in comm.allgather(problems) for p in ps]
    failed = failed or bool(everyone)
    if rank == 0:
        print("\n".join(everyone) or f"{arm} on {DEVICE.type}: {len(variants)} variants agree with gloo at {size} "
              "ranks; bfloat16 buckets are the exact result, rounded once", flush=True)
dist.destroy_process_group()
sys.exit(1 if failed else 0)
