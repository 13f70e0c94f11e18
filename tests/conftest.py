"""Makes tests/ importable for its helper modules (_mpi.py), and keeps MPI out of pytest.

Importing ``mpi4py.MPI`` initialises MPI (as a singleton) in the pytest process; the
mpirun jobs that later tests start from that process then inherit its environment and
can fail without a word (the cluster's duplex job did). Test modules import only the
pure parts of mcallreduce; jobs run their MPI code under mpirun.
"""
import os
import sys

from _mpi import JOB_DEFAULTS

# jobs started without tests/_mpi.py (the benchmark and example tests) get the same defaults
for _name, _value in JOB_DEFAULTS.items():
    os.environ.setdefault(_name, _value)


def pytest_collection_finish(session):
    if "mpi4py.MPI" in sys.modules:
        raise RuntimeError("a test module imported mpi4py.MPI into the pytest process (directly or through "
                           "mcallreduce.runtime/engine); MPI jobs started from it would break. Import only "
                           "MPI-free modules in tests and run MPI code under mpirun (tests/_mpi.py).")
