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
                           "mcallreduce.runtime, context or engine); MPI jobs started from it would break. Import only "
                           "MPI-free modules in tests and run MPI code under mpirun (tests/_mpi.py).")


# CI (CI=true, a fresh machine of the project's kind) installs everything the tests need and has
# every capability they probe for (network namespaces, cgroups, loop devices) but a GPU, so any other
# skip there is a missing install step or capability, which a skip would hide: the run fails and names it.
GPU_ABSENT = ("no CUDA device", "CuPy is not installed")
_unexpected_skips = []


def _note_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and os.environ.get("CI") == "true":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(absent in reason for absent in GPU_ABSENT):
            _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_collectreport(report):   # a module that skips itself (importorskip at its top)
    _note_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if _unexpected_skips:
        lines = "\n".join(_unexpected_skips)
        sys.stderr.write(f"\nCI=true: {len(_unexpected_skips)} test(s) skipped for a reason other than a "
                         f"missing GPU (an install step is missing?):\n{lines}\n")
        if session.exitstatus == 0:
            session.exitstatus = 1
