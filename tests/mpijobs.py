"""MPI test helper: run tests/mpi/<script> under mpirun via mcallreduce.launch (a module with a
unique name: ``conftest`` is ambiguous when several test folders each have one)."""
import sys
from pathlib import Path

from mcallreduce.launch import run

HERE = Path(__file__).parent


def mpi_script(np_, name, *args, env=None, timeout=180):
    """Run tests/mpi/<name> on np_ ranks; return the CompletedProcess."""
    full_env = {"PYTHONPATH": str(HERE.parent)}
    full_env.update(env or {})
    return run(np_, [sys.executable, str(HERE / "mpi" / name), *map(str, args)], env=full_env, timeout=timeout)

