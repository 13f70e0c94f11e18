"""hvd.join() returns the rank that joined last, also when the joins reach Horovod in one cycle.

Usage (under mpirun, any number of ranks): join_order.py. Trial t: rank t % size joins first,
the others run one allreduce (which the joined rank serves), then join. A long
HOROVOD_CYCLE_TIME puts the join requests into one Horovod cycle. The exit status is the result.
"""
import sys

import torch
import horovod.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
wrong = []
for trial in range(2 * size):
    first = trial % size
    if rank != first:
        hvd.allreduce(torch.ones(10), op=hvd.Sum, name=f"before_join_{trial}")
    last = hvd.join()
    if last == first:
        wrong.append(f"trial {trial}: hvd.join() returned {last}, the rank that joined first")
if wrong:
    sys.exit(f"rank {rank}: " + "; ".join(wrong))
