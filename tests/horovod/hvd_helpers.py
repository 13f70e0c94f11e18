"""Helpers for the Horovod plugin tests: real mpirun jobs via mcallreduce.launch."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcallreduce.launch import run

HERE = Path(__file__).parent
REPO = HERE.parent.parent

needs_horovod = pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                                   reason="Horovod is not installed (scripts/build_horovod.sh)")

ON = {"MCALLREDUCE_HOROVOD": "1"}
OFF = {"MCALLREDUCE_HOROVOD": "0"}


def mpi_job(np_, script, *args, env=None, timeout=240):
    """Run tests/horovod/mpi/<script> on np_ ranks; the caller's MCALLREDUCE_* are dropped."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("MCALLREDUCE_")}
    try:
        full_env = {"PYTHONPATH": str(REPO), "OMPI_MCA_btl_vader_single_copy_mechanism": "cma",
                    "PYTHONWARNINGS": "ignore::DeprecationWarning"}
        full_env.update(env or {})
        return run(np_, [sys.executable, str(HERE / "mpi" / script), *map(str, args)],
                   env=full_env, timeout=timeout)
    finally:
        os.environ.update(saved)


def install_startup_hook():
    """Put mcallreduce-horovod.pth into this venv's site-packages (idempotent)."""
    subprocess.run([sys.executable, "-m", "mcallreduce.horovod.startup", "install"], check=True)


def explain(result):
    return f"rc={result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}"
