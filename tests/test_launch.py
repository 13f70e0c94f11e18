"""The one MPI launcher: flags depend on the machine, not on the caller."""
import os

import pytest

from mcallreduce.launch import mpirun_command, run


def test_flags_for_root_and_oversubscription():
    cmd = mpirun_command(64, ["prog"], env={"A": "1"})
    assert "--oversubscribe" in cmd                     # more ranks than cores
    i = cmd.index("mpi_yield_when_idle")
    assert cmd[i - 1] == "--mca" and cmd[i + 1] == "1"  # ranks must not spin
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)
    assert cmd[-3:] == ["-x", "A=1", "prog"]


def test_every_job_may_oversubscribe():
    # mpirun counts physical cores as slots: hardware threads, an affinity or a quota give other counts
    assert "--oversubscribe" in mpirun_command(1, ["prog"])
    assert "--oversubscribe" in mpirun_command(1, ["prog"], hosts=["10.0.0.1"])


def test_open_mpis_ring_can_be_forced_unless_the_user_decides(monkeypatch):
    # dynamic rules let the runtime force Open MPI's ring on a communicator of its own
    # (mcallreduce/mpit.py); a user's own setting is left as it is (importing mcallreduce
    # set it in this process: the ranks inherit it from mpirun's environment then)
    monkeypatch.delenv("OMPI_MCA_coll_tuned_use_dynamic_rules", raising=False)
    cmd = mpirun_command(2, ["prog"])
    i = cmd.index("coll_tuned_use_dynamic_rules")
    assert cmd[i - 1] == "--mca" and cmd[i + 1] == "1"
    cmd = mpirun_command(2, ["prog"], env={"OMPI_MCA_coll_tuned_use_dynamic_rules": "0"})
    assert "coll_tuned_use_dynamic_rules" not in cmd


def test_run_reports_exit_code_and_output():
    r = run(2, ["sh", "-c", "echo rank; exit 3"], timeout=60)
    assert r.returncode != 0 and r.stdout.count("rank") == 2


def test_hung_job_is_killed_at_timeout():
    r = run(2, ["sleep", "30"], timeout=3)
    assert r.returncode == -9 and "timeout" in r.stderr


def test_killed_job_leaves_no_shared_memory_behind():
    # A job killed at its timeout (SIGKILL: Open MPI cannot clean up) must not leave its
    # shared-memory transport files in /dev/shm: run() gives every job its own backing
    # directory and removes it afterwards.
    import glob
    import sys
    before = set(glob.glob("/dev/shm/*"))
    hang = "from mpi4py import MPI; import time; MPI.COMM_WORLD.Barrier(); print('up', flush=True); time.sleep(60)"
    r = run(2, [sys.executable, "-c", hang], timeout=8)
    assert r.returncode == -9 and r.stdout.count("up") == 2, r.stdout + r.stderr
    assert set(glob.glob("/dev/shm/*")) - before == set()


def test_x_exports_as_mpirun_does_and_leaves_an_unset_name_unset(monkeypatch, capsys):
    from mcallreduce.launch import exported_env
    monkeypatch.setenv("SET_HERE", "v")
    monkeypatch.delenv("NOT_SET_HERE", raising=False)
    assert exported_env(["A=1", "B=x=y", "SET_HERE", "NOT_SET_HERE"]) == {"A": "1", "B": "x=y", "SET_HERE": "v"}
    assert "NOT_SET_HERE: not set" in capsys.readouterr().err   # it used to be exported, empty
    with pytest.raises(ValueError, match="no variable name"):
        exported_env(["=v"])
