"""Calls that never wait long never fail as stalled, however often the stall inspector looks.

    python -m mcallreduce.launch -np N -x MCALLREDUCE_STALL_CHECK_TIME_SECONDS=0.05 \
        -x MCALLREDUCE_STALL_SHUTDOWN_TIME_SECONDS=10 -- python tests/mpi/busy_calls_no_false_stall.py SECONDS

Every rank runs small blocking allreduces back to back for SECONDS (Python holds the GIL
between them, so the inspector thread mostly runs at the moment a call releases it), then a
few larger ones. None may raise; a report on stderr must give the time the call really
waited (the test reads it). Exit status 0 when every call returned the right sum on every rank.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

import mcallreduce

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
seconds = float(sys.argv[1])
x = np.ones(256, np.float32)
calls, deadline = 0, time.monotonic() + seconds
while True:
    x[:] = 1
    mcallreduce.allreduce(x)
    assert np.all(x == size), x[:4]
    calls += 1
    # every rank stops after the same call: rank 0 decides and tells the others along the way
    if calls % 64 == 0 and comm.bcast(time.monotonic() > deadline, root=0):
        break
for _ in range(4):
    y = np.ones(200003, np.int32)
    mcallreduce.allreduce(y, segment_bytes=32 << 10)
    assert np.all(y == size)
print(f"rank {rank}: {calls} calls returned", flush=True)
