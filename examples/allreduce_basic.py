"""The allreduce API in a few lines.

    .venv/bin/python -m mcallreduce.launch -np 4 -- .venv/bin/python examples/allreduce_basic.py
"""
import numpy as np
import torch
from mpi4py import MPI

import mcallreduce

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()

# In place, numpy: every rank ends with the same sum, bit for bit.
grad = np.full(1 << 20, rank + 1, dtype=np.float32)
mcallreduce.allreduce(grad)
assert np.all(grad == size * (size + 1) / 2)

# Horovod's Average on a torch tensor (zero copy): sum(prescale * x) * postscale / size.
weights = torch.full((256, 256), float(rank))
mcallreduce.allreduce(weights, op="average")
assert torch.allclose(weights, torch.full_like(weights, (size - 1) / 2))

# Nonblocking: start several, overlap other work, then wait (in any order).
buckets = [np.ones(n, np.float32) for n in (1000, 250_000, 4_000_000)]
handles = [mcallreduce.allreduce_async(b) for b in buckets]
busy = sum(i * i for i in range(10_000))          # stand-in for the rest of the backward pass
for h in reversed(handles):
    h.wait()
assert all(np.all(b == size) for b in buckets)

if rank == 0:
    print(f"ok: {size} ranks, multicolor allreduce (mcallreduce {mcallreduce.__version__})")
