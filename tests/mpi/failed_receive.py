"""A call whose receive fails raises at once, and the next call runs.

    python -m mcallreduce.launch -np 2 -- python tests/mpi/failed_receive.py MODE

MODE is ``wait`` (the handle's wait) or ``blocking`` (allreduce). Rank 1 does not start the
call: it sends rank 0, on the tag of each of rank 0's receives from it, a message longer than
that receive. Rank 0's receive fails (MPI_ERR_TRUNCATE) while its other requests are still
posted; its call must raise within 10 s, and the job's next call must give the right sum.
Exit status 0 when all of that held on both ranks.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

import mcallreduce
from mcallreduce import config
from mcallreduce.engine import TAG_SPAN
from mcallreduce.runtime import Context
from mcallreduce.schedule import Op

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
assert size == 2, "two ranks"
mode = sys.argv[1]
ctx = Context.get()
n, f32 = 256, np.dtype(np.float32)   # every message eager: rank 1 sends before rank 0 receives
settings = config.current().with_overrides(algorithm="ring", check=False)
program = ctx.plan(settings, n, f32, "sum", 1.0, 1.0).schedule.programs[0]
tags = sorted({s.tag for s in program.steps if s.op in (Op.RECV, Op.RECV_SCRATCH) and s.peer == 1})
seq = ctx.next_seq() + 1   # the failing call's: rank 1 skips it, so the next call stays aligned
if rank == 1:
    ctx.next_seq()
tag0 = (seq % ctx.windows) * TAG_SPAN
if rank == 0:
    x = np.ones(n, np.float32)
    comm.Barrier()   # rank 1's messages are on their way
    t0 = time.monotonic()
    try:
        if mode == "wait":
            mcallreduce.allreduce_async(x, algorithm="ring", check=False).wait()
        else:
            mcallreduce.allreduce(x, algorithm="ring", check=False)
        sys.exit("rank 0: a call whose receive failed returned")
    except RuntimeError as exc:
        assert "a send or receive" in str(exc), exc
    assert time.monotonic() - t0 < 10, time.monotonic() - t0
else:
    too_long = np.zeros(n, np.float32)   # twice the longest receive
    for tag in tags:
        ctx.comm.Send(too_long, dest=0, tag=tag0 + tag)
    comm.Barrier()
comm.Barrier()
y = np.full(1000, rank + 1, np.float64)
mcallreduce.allreduce(y, algorithm="mpi")
assert np.all(y == 3), y[:4]
print(f"rank {rank}: the failed call raised and the next one ran", flush=True)
