"""Background progress thread: allreduces complete while the main thread computes, and an
idle thread leaves the cores alone (it sleeps instead of polling MPI)."""
import os
import resource
import sys
import time

import numpy as np
from mpi4py import MPI

import mcallreduce
from mcallreduce.engine import PROGRESS_THREAD_OS_NAME
from mcallreduce.runtime import start_progress_thread

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
start_progress_thread()
start_progress_thread()  # idempotent

bufs = [np.full(200000 + i, rank + 1, np.float32) for i in range(6)]
handles = [mcallreduce.allreduce_async(b, algorithm=("multicolor", "ring")[i % 2]) for i, b in enumerate(bufs)]
# The main thread neither tests nor waits for a while: the thread must finish the work alone.
deadline = time.time() + 30
while not all(h.done for h in handles) and time.time() < deadline:
    time.sleep(0.01)
finished_alone = all(h.done for h in handles)
for h in reversed(handles):
    h.wait()
ok = finished_alone and all(np.all(b == size * (size + 1) / 2) for b in bufs)


def os_thread_names() -> list:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return names


# ps -L and top -H tell the thread's CPU apart from the training's
ok = ok and os_thread_names().count(PROGRESS_THREAD_OS_NAME) == 1
# errors still reach every rank in thread mode
try:
    mcallreduce.allreduce(np.ones(10 + rank, np.float32))
    mismatch = False
except mcallreduce.MismatchError:
    mismatch = True


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)   # every thread of this process
    return usage.ru_utime + usage.ru_stime


# Nothing in flight while the main thread sleeps: a thread that waited in MPI_Waitsome would
# poll a core for the whole second (with mpi_yield_when_idle it yields, but keeps polling).
comm.Barrier()
before = cpu_seconds()
time.sleep(1.0)
idle_cpu = cpu_seconds() - before
woken = np.full(1000, rank + 1, np.float64)
mcallreduce.allreduce(woken)   # and it still wakes for new work
ok = ok and idle_cpu < 0.25 and np.all(woken == size * (size + 1) / 2)
oks = comm.gather((ok, mismatch, round(idle_cpu, 3)), root=0)
everyone_ok = comm.bcast(all(a and b for a, b, _ in oks) if rank == 0 else None, root=0)
if rank == 0:
    print("THREAD", "ok" if everyone_ok else f"FAILED {oks}", flush=True)
    print("idle CPU seconds per rank:", [c for _, _, c in oks], flush=True)
sys.exit(0 if everyone_ok else 1)
