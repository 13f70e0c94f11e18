"""A rank that stalls is reported, and one that leaves makes the others raise instead of waiting.

    python -m mcallreduce.launch -np N -- python tests/mpi/peer_leaves.py SECONDS

The last rank does one allreduce with the others, then sleeps SECONDS without starting the
next one and exits. Every other rank starts that next allreduce: it must be reported on
stderr after MCALLREDUCE_STALL_CHECK_TIME_SECONDS, and it must raise once the last rank has
left (within 10 s), naming that rank. Exit status 0 when all of that held on every rank.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

import mcallreduce

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
linger = float(sys.argv[1])
x = np.ones(1000, np.float32)
mcallreduce.allreduce(x)
assert np.all(x == size)
if rank == size - 1:
    time.sleep(linger)
    print(f"rank {rank} leaves", flush=True)
    sys.exit(0)
t0 = time.monotonic()
for call in (lambda: mcallreduce.allreduce(np.ones(1000, np.float32)),
             lambda: mcallreduce.allreduce_async(np.ones(1 << 20, np.float32)).wait()):
    try:
        call()
        sys.exit(f"rank {rank}: an allreduce without rank {size - 1} returned")
    except RuntimeError as exc:
        waited = time.monotonic() - t0
        assert f"rank {size - 1} shut down" in str(exc), exc
assert linger - 1 <= waited <= linger + 10, waited
print(f"rank {rank} raised after {waited:.1f} s", flush=True)
