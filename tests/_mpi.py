"""The one way the tests run an MPI job: a script under mpirun (mcallreduce.launch) whose exit
status is the result.

Job scripts live beside the tests that start them (tests/mpi, tests/data, tests/ddp/mpi,
tests/horovod/mpi), run at any number of ranks, and exit non-zero on every rank that saw a
failure, saying why on stderr; what a test compares across ranks they print on stdout.
"""
import sys
from pathlib import Path

from mcallreduce.launch import run

TESTS = Path(__file__).parent
REPO = TESTS.parent
# Every job gets these unless its test sets them: a call that hangs fails after 4 minutes with
# the stall report's stacks instead of waiting for the job's timeout, and a process that
# crashes prints every thread's Python stack (Open MPI's own handler prints only C frames).
JOB_DEFAULTS = {"MCALLREDUCE_STALL_SHUTDOWN_TIME_SECONDS": "240", "PYTHONFAULTHANDLER": "1"}


def run_job(np_, script, *args, env=None, timeout=180, abort_on_exception=False):
    """Run ``script`` (a path) on ``np_`` ranks; return the CompletedProcess.

    ``abort_on_exception``: run it as ``python -m mpi4py script``, so that an unhandled exception
    on one rank aborts the job instead of leaving its peers waiting."""
    full_env = {**JOB_DEFAULTS, "PYTHONPATH": f"{REPO}:{TESTS}"}
    full_env.update(env or {})
    python = [sys.executable, "-m", "mpi4py"] if abort_on_exception else [sys.executable]
    return run(np_, [*python, str(script), *map(str, args)], env=full_env, timeout=timeout)


def explain(result):
    """The end of a job's output, for an assertion message, with every rank's stall report
    line in full (the tail alone can lose the ranks that reported first)."""
    stalls = "\n".join(ln for ln in result.stderr.splitlines() if ln.startswith("mcallreduce: stall:"))
    return (f"rc={result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stall reports\n{stalls[-6000:]}"
            f"\n--- stderr\n{result.stderr[-5000:]}")


def passed(result):
    """Assert the job exited 0; return its stdout."""
    assert result.returncode == 0, explain(result)
    return result.stdout


def mpi_script(np_, name, *args, env=None, timeout=180):
    """Run tests/mpi/<name> on ``np_`` ranks; return the CompletedProcess."""
    return run_job(np_, TESTS / "mpi" / name, *args, env=env, timeout=timeout)
