"""The one MPI launcher: flags depend on the machine, not on the caller."""
import os
import tempfile

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


def test_a_job_killed_at_its_timeout_or_interrupted_takes_its_ranks_and_their_children_with_it(tmp_path):
    # Open MPI gives each rank a process group of its own: killing mpirun's group once left ranks
    # that never started MPI, and every rank's children, running; and an interrupt left the whole job
    import signal
    import subprocess
    import sys
    import time
    marker = f"mcallreduce-test-{tmp_path.name}"
    hang = f"import subprocess, time; subprocess.Popen(['sleep', '60', '{marker}']); print('up', flush=True); time.sleep(60)"

    def left():
        ps = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
        return ps.stdout.split()
    r = run(2, [sys.executable, "-c", hang], timeout=4)
    assert r.returncode == -9 and r.stdout.count("up") == 2, r.stdout + r.stderr
    assert left() == []
    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        signal.alarm(3)
        with pytest.raises(KeyboardInterrupt):
            run(2, [sys.executable, "-c", hang], timeout=60)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    time.sleep(0.5)
    assert left() == []
    assert not [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("mcallreduce-ompi-")]


def test_the_command_line_stops_its_job_on_sigterm_and_leaves_no_files():
    # it once replaced itself with mpirun: a stopped job left its transport's files in /dev/shm
    import glob
    import signal
    import subprocess
    import sys
    import time
    before = set(glob.glob("/dev/shm/*"))
    hang = "from mpi4py import MPI; import time; MPI.COMM_WORLD.Barrier(); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-m", "mcallreduce.launch", "-np", "2", "--", sys.executable, "-c", hang],
                            stdout=subprocess.PIPE, text=True)
    seen = ""
    while seen.count("up") < 2:   # both ranks in MPI (their lines may interleave)
        line = proc.stdout.readline()
        assert line, seen
        seen += line
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) != 0
    time.sleep(0.5)
    assert set(glob.glob("/dev/shm/*")) - before == set()
    assert not [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("mcallreduce-ompi-")]


def test_run_keeps_output_that_is_not_utf8():
    import sys
    r = run(1, [sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'ok\\xff\\n')"], timeout=60)
    assert r.returncode == 0 and r.stdout == "ok\\xff\n", r.stdout


def test_the_launcher_without_mpirun_says_so(monkeypatch, capsys):
    from mcallreduce.launch import main
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["-np", "2", "--", "true"]) == 127 and "no mpirun on PATH" in capsys.readouterr().err


def test_x_exports_as_mpirun_does_and_leaves_an_unset_name_unset(monkeypatch, capsys):
    from mcallreduce.launch import exported_env
    monkeypatch.setenv("SET_HERE", "v")
    monkeypatch.delenv("NOT_SET_HERE", raising=False)
    assert exported_env(["A=1", "B=x=y", "SET_HERE", "NOT_SET_HERE"]) == {"A": "1", "B": "x=y", "SET_HERE": "v"}
    assert "NOT_SET_HERE: not set" in capsys.readouterr().err   # it used to be exported, empty
    with pytest.raises(ValueError, match="no variable name"):
        exported_env(["=v"])
