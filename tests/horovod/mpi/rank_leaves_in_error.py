"""A rank that leaves on an error while the others are inside a stock Horovod call (an
allgather, which the plugin does not route) makes them raise HorovodInternalError, as stock
Horovod does, instead of waiting forever.

    mpirun -np N python rank_leaves_in_error.py raise|shutdown

The last rank does one allreduce with the others, then raises (``raise``), or calls
hvd.shutdown() first as an ``except:`` block would (``shutdown``). Every other rank must
raise HorovodInternalError from its allgather within 10 s; those ranks exit with status 0.
"""
import sys
import time

import torch
import horovod.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
hvd.allreduce(torch.ones(8), name="warm")
if rank == size - 1:
    time.sleep(0.5)
    if sys.argv[1] == "shutdown":
        hvd.shutdown()
    raise RuntimeError(f"rank {rank} leaves on an error")
t0 = time.monotonic()
try:
    hvd.allgather(torch.ones(2), name="metrics")
    sys.exit(f"rank {rank}: an allgather without rank {size - 1} returned")
except hvd.HorovodInternalError:
    waited = time.monotonic() - t0
assert waited < 10, waited
print(f"rank {rank} raised HorovodInternalError after {waited:.1f} s", flush=True)
