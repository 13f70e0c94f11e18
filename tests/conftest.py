"""Makes tests/ importable for its helper modules (mpijobs.py), and keeps MPI out of pytest.

Importing ``mpi4py.MPI`` initialises MPI (as a singleton) in the pytest process; the
mpirun jobs that later tests start from that process then inherit its environment and
can fail without a word (the cluster's duplex job did). Test modules import only the
pure parts of mcallreduce; jobs run their MPI code under mpirun.
"""
import os
import sys

# A call that hangs in a test job fails after 4 minutes, with the stall report's stacks,
# instead of waiting for the job's timeout (tests that check the stall machinery set their own).
os.environ.setdefault("MCALLREDUCE_STALL_SHUTDOWN_TIME_SECONDS", "240")
# A job's process that crashes prints every thread's Python stack (Open MPI keeps a handler
# that is installed before MPI_Init, and prints its own C backtrace otherwise).
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def pytest_collection_finish(session):
    if "mpi4py.MPI" in sys.modules:
        raise RuntimeError("a test module imported mpi4py.MPI into the pytest process (directly or through "
                           "mcallreduce.runtime/engine); MPI jobs started from it would break. Import only "
                           "MPI-free modules in tests and run MPI code under mpirun (tests/mpijobs.py).")
