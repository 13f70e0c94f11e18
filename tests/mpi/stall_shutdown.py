"""Past the stall shutdown time, a call that a rank never starts fails instead of waiting.

    python -m mcallreduce.launch -np N -x MCALLREDUCE_STALL_SHUTDOWN_TIME_SECONDS=2 -- \\
        python tests/mpi/stall_shutdown.py caller|thread

The last rank takes part in one allreduce, then stays out of MPI without starting the next
until every other rank has failed (told through files beside each other, on one host) or 6 s
have passed, and exits. Every other rank starts that next one, blocking (``caller``: the stall
inspector must wake the caller inside MPI_Waitsome) or through the progress thread (``thread``). It must
fail with the stall shutdown's error within 1.5 s of the limit, long before the last rank
leaves. The exit status is the result.
"""
import os
import shutil
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

import mcallreduce
from mcallreduce import config, runtime

MODE = sys.argv[1]
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
failed_dir = comm.bcast(tempfile.mkdtemp(prefix="stall-shutdown-") if rank == 0 else None)
if MODE == "thread":
    runtime.start_progress_thread()
x = np.ones(1000, np.float32)
mcallreduce.allreduce(x)
assert np.all(x == size)
if rank == size - 1:
    deadline = time.monotonic() + 6
    while len(os.listdir(failed_dir)) < size - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    if len(os.listdir(failed_dir)) == size - 1:
        shutil.rmtree(failed_dir)
    sys.exit(0)
limit = config.stall_shutdown_seconds()
t0 = time.monotonic()
try:
    if MODE == "thread":
        mcallreduce.allreduce_async(np.ones(1000, np.float32)).wait()
    else:
        mcallreduce.allreduce(np.ones(1000, np.float32))
    sys.exit(f"rank {rank}: an allreduce without rank {size - 1} returned")
except RuntimeError as exc:
    waited = time.monotonic() - t0
    assert "stall shutdown time" in str(exc), exc
assert limit <= waited <= limit + 1.5, (waited, limit)
print(f"rank {rank} ({MODE}) failed after {waited:.1f} s", flush=True)
open(os.path.join(failed_dir, str(rank)), "w").close()
