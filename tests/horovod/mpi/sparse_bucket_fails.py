"""A gradient bucket that fails still synchronizes the stock Horovod handles of the sparse
gradients in it, so Horovod's handle map keeps none of them.

    mpirun -np N python sparse_bucket_fails.py

An embedding with sparse gradients (stock Horovod reduces those) shares a bucket with a
layer whose shape differs between ranks, so the bucket's metadata check fails the step.
"""
import sys
import warnings

import torch
import horovod.torch as hvd
from horovod.torch import mpi_ops

warnings.simplefilter("ignore")   # the sparse fallback's warning
hvd.init()
model = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 1 + hvd.rank()))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
model(torch.tensor([1, 2])).sum().backward()
try:
    opt.step()
    sys.exit("a step over layers whose shapes differ between ranks succeeded")
except hvd.HorovodInternalError:
    pass
assert mpi_ops._handle_map == {}, f"stock handles left unsynchronized: {sorted(mpi_ops._handle_map)}"
print("SPARSE OK", flush=True)
