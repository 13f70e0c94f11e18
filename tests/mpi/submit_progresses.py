"""Without the progress thread, starting an allreduce advances the ones already in flight.

Both ranks start a 4 KiB doubling call (one exchange, its metadata check along it); rank 1 finishes
it, then the ranks meet at a barrier outside the engine. Rank 0 has not tested or waited, so its
call can only end when something drives the engine: starting the next call must, as a test would.
Two ranks: with more, a peer's exchange waits on rank 0's, which waits on that drive. The exit
status is the result.

    python -m mcallreduce.launch -np 2 -- python tests/mpi/submit_progresses.py
"""
import sys

import numpy as np
from mpi4py import MPI

import mcallreduce

comm = MPI.COMM_WORLD
if comm.size != 2:
    sys.exit("run with 2 ranks")
mcallreduce.allreduce(np.ones(1024, np.float32), algorithm="doubling")   # plans built, peers connected
failures = []
for attempt in range(3):
    first, second = np.ones(1024, np.float32), np.ones(1024, np.float32)
    handle = mcallreduce.allreduce_async(first, algorithm="doubling")
    if comm.rank == 1:
        handle.wait()
    comm.Barrier()
    later = mcallreduce.allreduce_async(second, algorithm="doubling")
    done_at_submit = handle.done
    handle.wait()
    later.wait()
    if comm.rank == 0 and not done_at_submit:
        failures.append(f"attempt {attempt}: the first call was still in flight after the next one started")
    if not (np.all(first == 2) and np.all(second == 2)):
        failures.append(f"attempt {attempt}: wrong sums")
for failure in failures:
    print(f"rank {comm.rank}: {failure}", flush=True)
everywhere = comm.allreduce(int(not failures), op=MPI.MIN)
if comm.rank == 0:
    print(f"a submission advanced the call in flight on every attempt: {bool(everywhere)}")
sys.exit(0 if everywhere else 1)
