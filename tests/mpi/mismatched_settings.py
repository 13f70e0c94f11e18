"""Ranks with different MCALLREDUCE_COLORS, or different routes, must all raise MismatchError (not hang).
The exit status is the result."""
import os
import sys

from mpi4py import MPI

os.environ["MCALLREDUCE_COLORS"] = str(1 + MPI.COMM_WORLD.Get_rank())

import numpy as np  # noqa: E402

import mcallreduce  # noqa: E402

rank = MPI.COMM_WORLD.Get_rank()
failures = []
for what, kwargs in (("colors", {}), ("route", {"colors": 2, "route": ("tree", "ring")[rank % 2]})):
    try:
        mcallreduce.allreduce(np.ones(1 << 20, np.float32), **kwargs)
        failures.append(f"rank {rank}: different {what}s did not raise")
    except mcallreduce.MismatchError as exc:
        if what not in str(exc):
            failures.append(f"rank {rank}: the error does not name the {what}: {exc}")
        print(f"rank {rank} raised MismatchError: {exc}")
if failures:
    sys.exit("\n".join(failures))
