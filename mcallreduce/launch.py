"""The one way this project starts an MPI job (tests, benchmarks, examples).

Open MPI needs a few flags that depend on the machine rather than on the job:
``--allow-run-as-root`` as root, ``--oversubscribe`` (more ranks than cores may share them),
and then ``--mca mpi_yield_when_idle 1``: without it, ranks that spin in MPI's
progress loop starve each other and a benchmark measures the scheduler instead
of the network (docs/cluster.md).
:func:`run` and the command line also give each job its own shared-memory backing directory
and session directory and remove them afterwards, so a job killed at its timeout or stopped by
a signal leaves nothing in /dev/shm or /tmp; :func:`run` kills every process of the job's
session (ranks and their children), not mpirun alone.

    python -m mcallreduce.launch -np 4 -- python -m mcallreduce.bench --sizes 1M
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import sys
from typing import Dict, Iterator, List, Mapping, Optional, Sequence

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
    with _job_directories() as mca:
        cmd = mpirun_command(np, argv, env=env, mca={**mca, **(kwargs.pop("mca", None) or {})}, **kwargs)
        full_env = dict(os.environ)
        full_env.update(env or {})
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="backslashreplace", env=full_env, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            out, err = proc.communicate()
            code = -9
            err += f"\n[mcallreduce.launch] killed after {timeout:.0f}s timeout\n"
        except BaseException:   # Ctrl-C or an error here: the job must not outlive its caller
            _kill_session(proc)
            raise
    result = subprocess.CompletedProcess(cmd, code, out, err)
    if check and code != 0:
        raise RuntimeError(f"MPI job failed ({code}): {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
    return result


@contextlib.contextmanager
def _job_directories() -> Iterator[Dict[str, str]]:
    """A job's own directories, as mpirun's ``--mca`` settings, removed whatever happened: Open MPI's
    shared-memory transport keeps its files in /dev/shm, and mpirun its session under /tmp, and each
    removes them at a clean exit only."""
    made: List[str] = []
    try:
        made.append(tempfile.mkdtemp(prefix="mcallreduce-mpi-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        made.append(tempfile.mkdtemp(prefix="mcallreduce-ompi-"))
        # the transport's name in Open MPI 4 (vader) and 5 (sm); each ignores the other's
        yield {"btl_vader_backing_directory": made[0], "btl_sm_backing_directory": made[0],
               "orte_tmpdir_base": made[1]}
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def _kill_session(proc: subprocess.Popen) -> None:
    """Kill mpirun and everything in its session: Open MPI puts each rank in a process group of
    its own, so killing mpirun's group leaves ranks (and their children) running."""
    for pid in _session_members(proc.pid) + [proc.pid]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _session_members(sid: int) -> list[int]:
    """The processes whose session is ``sid`` (Linux /proc; none found elsewhere)."""
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()   # after the command name, which may hold spaces
                if int(fields[3]) == sid:   # state, ppid, pgrp, session
                    members.append(int(entry))
    return members


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
        if ns.dry_run:   # what runs, less the job's own directories
            print(shlex.join(mpirun_command(ns.np, argv, env=env)))
            return 0
        with _job_directories() as mca:
            return _supervise(mpirun_command(ns.np, argv, env=env, mca=mca))
    except ValueError as exc:
        parser.error(str(exc))
    except RuntimeError as exc:   # no mpirun: the shell's "command not found"
        print(f"python -m mcallreduce.launch: error: {exc}", file=sys.stderr)
        return 127


def _supervise(cmd: Sequence[str]) -> int:
    """Run mpirun as a child, with this process's output, passing it the signals that stop a job
    (mpirun stops the ranks), so that the job's directories are removed after it; its exit
    status as a shell reports it (128 + the signal)."""
    sys.stdout.flush()
    proc = subprocess.Popen(cmd)
    forward = {sig: signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
               for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = proc.wait()
    finally:
        for sig, previous in forward.items():
            signal.signal(sig, previous)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
