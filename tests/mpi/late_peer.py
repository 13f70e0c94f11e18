"""A rank that waits for a late peer sleeps instead of spinning: while rank 0 arrives a second
late, the other ranks' processes use little CPU (a spinning wait held a core for the whole
second), also with MPI's own nonblocking allreduce posted, which only a poll advances. With
MCALLREDUCE_POLL_US longer than that second, they poll for all of it instead.
Exit status is the result.

    python -m mcallreduce.launch -np 2 -- python tests/mpi/late_peer.py caller|thread
"""
import resource
import sys
import time

import numpy as np
from mpi4py import MPI

import mcallreduce
from mcallreduce.config import current
from mcallreduce.runtime import start_progress_thread

LATE_S = 1.0
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
polls = current().poll_us * 1e-6 > LATE_S
if sys.argv[1:] == ["thread"]:
    start_progress_thread()


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)   # every thread of this process
    return usage.ru_utime + usage.ru_stime


mcallreduce.allreduce(np.ones(1000, np.float32))   # plans built, peers connected
# the last: MPI_Iallreduce posted at once (no check to wait in first), which only a poll advances
for nbytes, algorithm in ((4 << 10, "multicolor"), (1 << 20, "multicolor"), (1 << 20, "ring"), (1 << 20, "mpi")):
    x = np.ones(nbytes // 4, np.float32)
    comm.Barrier()
    if rank == 0:
        time.sleep(LATE_S)
    cpu, wall = cpu_seconds(), time.monotonic()
    if algorithm == "mpi":
        mcallreduce.allreduce_async(x, algorithm=algorithm, check=False).wait()
    else:
        mcallreduce.allreduce(x, algorithm=algorithm)
    cpu, wall = cpu_seconds() - cpu, time.monotonic() - wall
    busy = cpu > 0.6 * wall if polls else cpu < 0.25 * wall
    ok = bool(np.all(x == size)) and (rank == 0 or (wall > 0.8 * LATE_S and busy))
    results = comm.allgather((rank, ok, round(cpu, 3), round(wall, 3)))
    if rank == 0:
        print(f"{algorithm} {nbytes} B, (rank, ok, CPU s, wall s) per rank: {results}", flush=True)
    if not all(r[1] for r in results):
        sys.exit(1)
