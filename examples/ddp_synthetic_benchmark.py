"""Synthetic-data DDP benchmark: the model and loop of horovod_synthetic_benchmark.py, on
PyTorch DistributedDataParallel. ``--comm`` picks how gradient buckets are reduced:

* ``gloo``: DDP on gloo, stock;
* ``hook``: DDP on gloo with ``mcallreduce.ddp.multicolor_hook``;
* ``backend``: DDP on the ``mcallreduce`` backend.

    python -m mcallreduce.launch -np 2 -- python examples/ddp_synthetic_benchmark.py --comm hook
"""
import argparse
import json
import os
import sys
import timeit

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import mcallreduce.ddp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resnet import resnet50  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--comm", choices=["gloo", "hook", "backend"], default="gloo")
parser.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
parser.add_argument("--image-size", type=int, default=224)
parser.add_argument("--num-classes", type=int, default=1000)
parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
parser.add_argument("--num-warmup-batches", type=int, default=10)
parser.add_argument("--num-batches-per-iter", type=int, default=10)
parser.add_argument("--num-iters", type=int, default=10)
parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads per rank (0: torch's choice)")
parser.add_argument("--json", help="rank 0 appends one JSON line with the result here")
parser.add_argument("--no-cuda", action="store_true", default=False,
                    help="train on the CPU even where CUDA is available (the backend arm always does)")
args = parser.parse_args()
args.cuda = not args.no_cuda and args.comm != "backend" and torch.cuda.is_available()

mcallreduce.ddp.init_process_group("mcallreduce" if args.comm == "backend" else "gloo")
rank, size = dist.get_rank(), dist.get_world_size()
if args.threads:
    torch.set_num_threads(args.threads)
torch.manual_seed(42)
if args.cuda:   # a host's GPUs dealt to its ranks in turn
    from mpi4py import MPI
    local_rank = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
else:
    device = torch.device("cpu")

model = DDP(resnet50(args.num_classes).to(device), bucket_cap_mb=args.bucket_cap_mb)
if args.comm == "hook":
    model.register_comm_hook(None, mcallreduce.ddp.multicolor_hook)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size)
data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
target = torch.randint(0, args.num_classes, (args.batch_size,), device=device)


def benchmark_step():
    optimizer.zero_grad()
    F.cross_entropy(model(data), target).backward()
    optimizer.step()
    if args.cuda:   # the step is done when the GPU is
        torch.cuda.synchronize()


def log(text):
    if rank == 0:
        print(text, flush=True)


nparams = sum(p.numel() for p in model.parameters())
log(f"Model: resnet50 ({nparams / 1e6:.1f}M parameters)  Batch size: {args.batch_size}  Image size: "
    f"{args.image_size}  Ranks: {size}  Comm: {args.comm}  bucket_cap_mb: {args.bucket_cap_mb}  Device: {device}")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
img_secs = []
for i in range(args.num_iters):
    seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_secs.append(args.batch_size * args.num_batches_per_iter / seconds)
    log(f"Iter #{i}: {img_secs[-1]:.1f} img/sec per rank")
mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
log(f"Total img/sec on {size} rank(s): {size * mean:.1f} +-{size * conf:.1f}")
if args.json and rank == 0:
    with open(args.json, "a") as f:
        f.write(json.dumps({"comm": args.comm, "ranks": size, "batch_size": args.batch_size,
                            "image_size": args.image_size, "bucket_cap_mb": args.bucket_cap_mb,
                            "device": device.type,
                            "img_sec_per_rank": mean, "conf": conf, "total_img_sec": size * mean,
                            "iters": img_secs}) + "\n")
dist.destroy_process_group()
