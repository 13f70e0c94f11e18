"""Ranks with different MCALLREDUCE_COLORS must all raise MismatchError (not hang)."""
import os

from mpi4py import MPI

os.environ["MCALLREDUCE_COLORS"] = str(1 + MPI.COMM_WORLD.Get_rank())

import numpy as np  # noqa: E402

import mcallreduce  # noqa: E402

try:
    mcallreduce.allreduce(np.ones(1 << 20, np.float32))
    print(f"rank {MPI.COMM_WORLD.Get_rank()} did not raise")
except mcallreduce.MismatchError as exc:
    assert "colors" in str(exc), exc
    print(f"rank {MPI.COMM_WORLD.Get_rank()} raised MismatchError: {exc}")
