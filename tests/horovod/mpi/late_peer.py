"""A routed hvd.allreduce_ that waits for a late peer sleeps: the calling thread uses little
CPU while rank 0 arrives a second late. A spinning wait competed for the cores with stock
Horovod's own background thread, and the ranks returned from the same call up to a
scheduler tick apart (Horovod's test_global_barrier_op then failed). Exit status is the result.
"""
import sys
import time

import torch

import horovod.torch as hvd

LATE_S = 1.0
hvd.init()
hvd.allreduce_(torch.ones(4), name="warm", op=hvd.Sum)   # plans built, peers connected
x = torch.ones(1 << 10)
if hvd.rank() == 0:
    time.sleep(LATE_S)
cpu, wall = time.thread_time(), time.monotonic()   # the caller's own CPU: Horovod's thread spins
hvd.allreduce_(x, name="waited", op=hvd.Sum)
cpu, wall = time.thread_time() - cpu, time.monotonic() - wall
ok = bool(torch.all(x == hvd.size())) and (hvd.rank() == 0 or (wall > 0.8 * LATE_S and cpu < 0.25 * wall))
results = hvd.allgather_object((hvd.rank(), ok, round(cpu, 3), round(wall, 3)))
if hvd.rank() == 0:
    print("(rank, ok, caller CPU s, wall s) per rank:", results, flush=True)
sys.exit(0 if all(r[1] for r in results) else 1)
