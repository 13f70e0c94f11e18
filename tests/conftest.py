"""Shared test helpers. MPI tests run small scripts under mpirun via mcallreduce.launch."""
import sys
from pathlib import Path

import pytest

from mcallreduce.launch import run

HERE = Path(__file__).parent


def mpi_script(np_, name, *args, env=None, timeout=180):
    """Run tests/mpi/<name> on np_ ranks; return the CompletedProcess."""
    full_env = {"PYTHONPATH": str(HERE.parent), "OMPI_MCA_btl_vader_single_copy_mechanism": "cma"}
    full_env.update(env or {})
    return run(np_, [sys.executable, str(HERE / "mpi" / name), *map(str, args)], env=full_env, timeout=timeout)


@pytest.fixture
def mpirun():
    return mpi_script
