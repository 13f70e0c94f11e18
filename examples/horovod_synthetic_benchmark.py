"""Synthetic-data Horovod + PyTorch benchmark (in the style of Horovod's
pytorch_synthetic_benchmark.py, written for this project). Unmodified Horovod code: run it
with and without the plugin and compare img/sec.

    python -m mcallreduce.launch -np 2 -- python examples/horovod_synthetic_benchmark.py
    python -m mcallreduce.launch -np 2 -x MCALLREDUCE_ALGORITHM=multicolor -- \
        python examples/horovod_synthetic_benchmark.py
"""
import argparse
import os
import sys
import timeit

import numpy as np
import torch
import torch.nn.functional as F
import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resnet import resnet50  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="resnet50", help="resnet50, or any torchvision.models name")
parser.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
parser.add_argument("--image-size", type=int, default=224)
parser.add_argument("--num-classes", type=int, default=1000)
parser.add_argument("--num-warmup-batches", type=int, default=10)
parser.add_argument("--num-batches-per-iter", type=int, default=10)
parser.add_argument("--num-iters", type=int, default=10)
parser.add_argument("--fp16-allreduce", action="store_true", help="Compression.fp16 for gradients")
parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads per rank (0: torch's choice)")
parser.add_argument("--json", help="rank 0 appends one JSON line with the result here")
args = parser.parse_args()

hvd.init()
if args.threads:
    torch.set_num_threads(args.threads)
torch.manual_seed(42)

if args.model == "resnet50":
    model = resnet50(args.num_classes)
else:
    from torchvision import models
    model = getattr(models, args.model)(num_classes=args.num_classes)

optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.randint(0, args.num_classes, (args.batch_size,))


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def log(text):
    if hvd.rank() == 0:
        print(text, flush=True)


nparams = sum(p.numel() for p in model.parameters())
log(f"Model: {args.model} ({nparams / 1e6:.1f}M parameters)  Batch size: {args.batch_size}  "
    f"Image size: {args.image_size}  Ranks: {hvd.size()}  fp16 allreduce: {args.fp16_allreduce}")
log("Running warmup...")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

log("Running benchmark...")
img_secs = []
for i in range(args.num_iters):
    seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / seconds
    log(f"Iter #{i}: {img_sec:.1f} img/sec per rank")
    img_secs.append(img_sec)

mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
if args.json and hvd.rank() == 0:
    import json
    mode = "plugin" if getattr(hvd, "_mcallreduce_patched", False) else "stock"
    with open(args.json, "a") as f:
        f.write(json.dumps({"mode": mode, "ranks": hvd.size(), "model": args.model, "batch_size": args.batch_size,
                            "image_size": args.image_size, "img_sec_per_rank": mean, "conf": conf,
                            "total_img_sec": hvd.size() * mean,
                            "algorithm": os.environ.get("MCALLREDUCE_ALGORITHM", "")}) + "\n")
