"""What the Horovod plugin tests share: the Horovod switch, and their jobs (tests/horovod/mpi)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _mpi import JOB_DEFAULTS, REPO, explain, run_job  # noqa: F401  (REPO, explain: for the tests)

HERE = Path(__file__).parent

needs_horovod = pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                                   reason="Horovod is not installed (scripts/build_horovod.sh)")

ON = {"MCALLREDUCE_HOROVOD": "1"}
OFF = {"MCALLREDUCE_HOROVOD": "0"}


def mpi_job(np_, script, *args, env=None, timeout=240):
    """Run tests/horovod/mpi/<script> on np_ ranks; the caller's MCALLREDUCE_* are dropped
    (the jobs' defaults stay)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("MCALLREDUCE_") and k not in JOB_DEFAULTS}
    try:
        full_env = {"OMPI_MCA_btl_vader_single_copy_mechanism": "cma", "PYTHONWARNINGS": "ignore::DeprecationWarning"}
        full_env.update(env or {})
        return run_job(np_, HERE / "mpi" / script, *args, env=full_env, timeout=timeout)
    finally:
        os.environ.update(saved)


def install_startup_hook():
    """Put mcallreduce-horovod.pth into this venv's site-packages (idempotent)."""
    subprocess.run([sys.executable, "-m", "mcallreduce.horovod.startup", "install"], check=True)
