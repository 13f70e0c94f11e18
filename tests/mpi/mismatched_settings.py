"""Ranks with different MCALLREDUCE_COLORS, or different routes, must all raise MismatchError (not hang)."""
import os

from mpi4py import MPI

os.environ["MCALLREDUCE_COLORS"] = str(1 + MPI.COMM_WORLD.Get_rank())

import numpy as np  # noqa: E402

import mcallreduce  # noqa: E402

rank = MPI.COMM_WORLD.Get_rank()
for what, kwargs in (("colors", {}), ("route", {"colors": 2, "route": ("tree", "ring")[rank % 2]})):
    try:
        mcallreduce.allreduce(np.ones(1 << 20, np.float32), **kwargs)
        print(f"rank {rank} did not raise")
    except mcallreduce.MismatchError as exc:
        assert what in str(exc), exc
        print(f"rank {rank} raised MismatchError: {exc}")
