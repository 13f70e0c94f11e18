"""The one way this project starts an MPI job (tests, benchmarks, examples).

Open MPI needs a few flags that depend on the machine rather than on the job:
``--allow-run-as-root`` as root, ``--oversubscribe`` (more ranks than cores may share them),
and then ``--mca mpi_yield_when_idle 1``: without it, ranks that spin in MPI's
progress loop starve each other and a benchmark measures the scheduler instead
of the network (docs/cluster.md).
:func:`run` also gives each job its own shared-memory backing directory and removes it
afterwards, so a job killed at its timeout leaves nothing in /dev/shm.

    python -m mcallreduce.launch -np 4 -- python -m mcallreduce.bench --sizes 1M
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import tempfile
import sys
from typing import Dict, Mapping, Optional, Sequence

from .mpit import DYNAMIC_RULES, DYNAMIC_RULES_ENV

__all__ = ["mpirun_command", "run", "main", "launched_by_mpirun", "LAUNCHER_VARS"]

#: what MPI launchers put into every rank's environment (Open MPI, Hydra, PMIx, Intel MPI)
LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def launched_by_mpirun() -> bool:
    """Whether an MPI launcher started this process; read from the environment, MPI untouched."""
    return any(name in os.environ for name in LAUNCHER_VARS)


def _mpirun() -> str:
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        raise RuntimeError("no mpirun on PATH: install Open MPI (apt-get install openmpi-bin libopenmpi-dev)")
    return exe


def mpirun_command(
    np: int,
    argv: Sequence[str],
    *,
    env: Optional[Mapping[str, str]] = None,
    hosts: Optional[Sequence[str]] = None,
    mca: Optional[Mapping[str, str]] = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """Return the mpirun argv that runs ``argv`` on ``np`` ranks.

    ``env`` names variables exported to every rank (``-x NAME=VALUE``);
    ``hosts`` is an Open MPI host list (``ip1,ip2`` or ``ip1:2,ip2:2``);
    ``mca`` adds ``--mca KEY VALUE`` pairs; ``extra`` is appended verbatim.
    """
    if np < 1:
        raise ValueError(f"np must be >= 1, got {np}")
    cmd = [_mpirun(), "-np", str(np)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    # always: mpirun's slots count physical cores, which no count here matches on every machine
    # (hardware threads, a CPU affinity or a cgroup quota give others), and with more ranks than
    # slots it refuses to start; the flag changes nothing when the ranks fit
    cmd.append("--oversubscribe")
    # Always yield when idle: on a shared or oversubscribed machine a spinning rank
    # steals the core its peer needs. It costs nothing measurable when cores are free.
    params = {"mpi_yield_when_idle": "1"}
    # Open MPI's ring on demand (mcallreduce/mpit.py), also for scripts that import mpi4py first;
    # with nothing forced, Open MPI keeps its own decisions. A user's own setting wins.
    if DYNAMIC_RULES_ENV not in os.environ and DYNAMIC_RULES_ENV not in (env or {}):
        params[DYNAMIC_RULES] = "1"
    params.update(mca or {})
    for key, value in params.items():
        cmd += ["--mca", key, str(value)]
    cmd += ["--bind-to", "none"]
    if hosts is not None:
        cmd += ["--host", ",".join(hosts)]
    for key, value in (env or {}).items():
        cmd += ["-x", f"{key}={value}"]
    cmd += list(extra)
    cmd += list(argv)
    return cmd


def run(
    np: int,
    argv: Sequence[str],
    *,
    timeout: float = 300.0,
    env: Optional[Mapping[str, str]] = None,
    check: bool = False,
    **kwargs,
) -> subprocess.CompletedProcess:
    """Run an MPI job to completion, capturing its output as text.

    ``env`` is exported to the ranks and also set for mpirun itself. A job that
    outlives ``timeout`` is killed (with its ranks) and reported as a failure
    with returncode -9, so a hung collective fails a test instead of stalling it.
    """
    # Open MPI's shared-memory transport keeps its files in /dev/shm and removes them at a
    # clean exit only; a job killed here (SIGKILL) would leave them. Each job gets its own
    # backing directory, removed whatever happened.
    shm = tempfile.mkdtemp(prefix="mcallreduce-mpi-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    # the transport's name in Open MPI 4 (vader) and 5 (sm); each ignores the other's
    mca = {"btl_vader_backing_directory": shm, "btl_sm_backing_directory": shm, **(kwargs.pop("mca", None) or {})}
    cmd = mpirun_command(np, argv, env=env, mca=mca, **kwargs)
    full_env = dict(os.environ)
    full_env.update(env or {})
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=full_env, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            code = -9
            err += f"\n[mcallreduce.launch] killed after {timeout:.0f}s timeout\n"
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    result = subprocess.CompletedProcess(cmd, code, out, err)
    if check and code != 0:
        raise RuntimeError(f"MPI job failed ({code}): {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
    return result


def exported_env(items: Sequence[str]) -> Dict[str, str]:
    """``-x`` items as mpirun reads them: NAME=VALUE, or NAME alone for this process's value; a NAME
    that is not set here is not exported (mpirun warns, and so does this)."""
    env: Dict[str, str] = {}
    for item in items:
        name, value = item.split("=", 1) if "=" in item else (item, os.environ.get(item))
        if not name:
            raise ValueError(f"-x {item!r}: no variable name")
        if value is None:
            print(f"mcallreduce: -x {name}: not set in this environment, not exported", file=sys.stderr)
            continue
        env[name] = value
    return env


def main(args: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcallreduce.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-np", "--np", type=int, required=True, help="number of ranks")
    parser.add_argument("-x", dest="env", action="append", default=[], metavar="NAME=VALUE",
                        help="export a variable to every rank (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="print the mpirun command only")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program [args...]")
    ns = parser.parse_args(args)
    argv = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not argv:
        parser.error("no program given (use: -np N -- program args...)")
    try:
        env = exported_env(ns.env)
        cmd = mpirun_command(ns.np, argv, env=env)
    except ValueError as exc:
        parser.error(str(exc))
    if ns.dry_run:
        print(shlex.join(cmd))
        return 0
    sys.stdout.flush()
    os.execv(cmd[0], cmd)  # mpirun takes this process's place: signals and exit code go straight through
    return 127


if __name__ == "__main__":
    sys.exit(main())
