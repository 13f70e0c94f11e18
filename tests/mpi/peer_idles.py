"""A rank that has finished an allreduce and then stays out of MPI (computing, or waiting in
gloo) must not hold up a peer still finishing the same allreduce. Each rank times its call,
then sleeps 1.5 s without calling MPI; no call may take 1 s (one takes 0.1-0.4 s). Exit status is the result."""
import sys
import time

import numpy as np
from mpi4py import MPI

import mcallreduce

comm = MPI.COMM_WORLD
failures = []
for algorithm in ("multicolor", "ring"):
    buf = np.ones(25_000_000, np.float32)   # 100 MB: beyond the shared-memory stage, many 64 KiB segments
    comm.Barrier()
    start = time.monotonic()
    mcallreduce.allreduce(buf, algorithm=algorithm)
    seconds = time.monotonic() - start
    time.sleep(1.5)
    slowest = max(comm.allgather(seconds))
    if slowest > 1.0 or not np.all(buf == comm.Get_size()):
        failures.append(f"{algorithm}: the slowest rank took {slowest:.2f} s (a peer's sleep is 1.5 s)")
if comm.Get_rank() == 0:
    print("\n".join(failures) or "no rank waited for an idle peer", flush=True)
sys.exit(1 if failures else 0)
