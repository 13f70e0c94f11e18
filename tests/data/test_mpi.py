"""The store under real mpirun jobs (tests/data/mpi_job.py, which checks itself): one shared copy per
host, no shared memory left behind, the memory budget, a damaged file, and the cross-host exchange
(also read by persistent DataLoader workers)."""
import glob
import os
import sys
from pathlib import Path

import pytest

from _mpi import explain, passed, run_job

JOB = os.path.join(os.path.dirname(__file__), "mpi_job.py")
PERSISTENT_JOB = os.path.join(os.path.dirname(__file__), "persistent_workers_job.py")


def job(np_, scenario, path, env=None):
    env = {"MCALLREDUCE_DATA_PROGRESS": "0", **(env or {})}
    # -m mpi4py: an unhandled exception on one rank aborts the job (else its peers wait forever).
    return run_job(np_, JOB, scenario, path, timeout=150, env=env, abort_on_exception=True)


def our_segments():
    return set(glob.glob("/dev/shm/mcallreduce-data-*"))


def test_two_ranks_on_a_host_share_one_copy(packed):
    before = our_segments()
    passed(job(2, "shared", packed[0]))
    assert our_segments() <= before


def test_no_segment_left_when_a_rank_raises(packed):
    before = our_segments()
    result = job(2, "raise", packed[0])
    # the abort ends the job (-9 would be the launcher's kill at the timeout: a hang)
    assert result.returncode not in (0, -9) and "fails on purpose" in result.stderr, explain(result)
    assert our_segments() <= before


def test_memory_budget_error_is_clear_and_collective(packed):
    before = our_segments()
    passed(job(2, "budget", packed[0], env={"MCALLREDUCE_DATA_MEMORY_LIMIT": "1M"}))
    assert our_segments() <= before


def test_a_memory_setting_that_does_not_parse_raises_on_every_rank(packed):
    passed(job(2, "bad_setting", packed[0], env={"MCALLREDUCE_DATA_MEMORY_FRACTION": "2"}))


def test_a_budget_error_on_one_host_is_every_hosts(packed):
    passed(job(2, "budget_on_one_host", packed[0], env={"MCALLREDUCE_RANKS_PER_HOST": "1"}))


def test_damaged_blob_fails_on_every_rank(packed, copy_of):
    from mcallreduce.data import StoreFile
    damaged = copy_of(packed[0])
    f = StoreFile(damaged)
    with open(damaged, "r+b") as out:
        out.seek(f.blob_offset + f.blob_bytes // 2)
        out.write(b"\x00\x01\x02\x03")
    before = our_segments()
    passed(job(2, "corrupt", damaged))
    assert our_segments() <= before


def test_two_emulated_hosts_exchange_samples_for_global_and_partial_shuffles(packed):
    passed(job(4, "exchange", packed[0], env={"MCALLREDUCE_RANKS_PER_HOST": "2"}))


def test_validation_on_a_store_split_across_hosts_visits_every_sample(packed):
    passed(job(4, "validate", packed[0], env={"MCALLREDUCE_RANKS_PER_HOST": "2"}))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_persistent_workers_read_each_epochs_exchanged_samples(packed, context):
    before = our_segments()
    passed(run_job(2, PERSISTENT_JOB, packed[0], context, timeout=150, abort_on_exception=True,
                   env={"MCALLREDUCE_DATA_PROGRESS": "0", "MCALLREDUCE_RANKS_PER_HOST": "1"}))
    assert our_segments() <= before


def test_a_job_ended_while_a_segment_still_has_its_name_leaves_no_file(tmp_path):
    # mpirun ends a job with SIGTERM; the leader may then be waiting for its host's ranks to
    # map the segment, the one moment its file has a name
    import signal
    import subprocess
    import time
    from mcallreduce.launch import mpirun_command
    before = our_segments()
    cmd = mpirun_command(2, [sys.executable, str(Path(__file__).parent / "segment_sigterm_job.py")],
                         env={"PYTHONPATH": str(Path(__file__).parents[2]), "MCALLREDUCE_RANKS_PER_HOST": "2"})
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (our_segments() - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert our_segments() - before, "the leader never created its segment"
        time.sleep(0.5)   # inside the host's barrier
        job.send_signal(signal.SIGTERM)
        out, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode != 0, out
    assert not (our_segments() - before), out

