"""The runtime under real mpirun jobs with 1 to 4 ranks (tests/mpi/allreduce_cases.py)."""
import re

import pytest

from _mpi import mpi_script, passed


def run_cases(np_, env=None, cases=(), numpy_only=False):
    """Run tests/mpi/allreduce_cases.py; its exit status is the result (FAIL lines say which case).
    ``numpy_only``: leave out the cases on torch tensors (a job about another setting)."""
    flags = ("--numpy-only",) if numpy_only else ()
    stdout = passed(mpi_script(np_, "allreduce_cases.py", *flags, *cases, env=env, timeout=300))
    return re.findall(rf"^PASS (\S+) ranks={np_}$", stdout, re.M)


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_all_cases(np_):
    run_cases(np_)


def test_all_cases_without_the_shared_memory_stage():
    # one host runs multicolor through shared memory up to MCALLREDUCE_SHM_BYTES; this keeps
    # its point-to-point schedules (what the hierarchy does on every host of a cluster) covered
    run_cases(3, env={"MCALLREDUCE_SHM_BYTES": "0"}, numpy_only=True)


def test_all_cases_with_the_single_copy_stage_at_every_size():
    # from MCALLREDUCE_SINGLE_COPY_BYTES on, the one-host stage reads and writes the peers'
    # buffers directly; with no table multicolor is that stage at every size
    run_cases(3, env={"MCALLREDUCE_SINGLE_COPY_BYTES": "1", "MCALLREDUCE_TUNING_FILE": "none"}, numpy_only=True)


def test_all_cases_with_the_window_stage_only():
    run_cases(2, env={"MCALLREDUCE_SINGLE_COPY_BYTES": "0", "MCALLREDUCE_ONE_SYNC_BYTES": "0",
                      "MCALLREDUCE_TUNING_FILE": "none"}, numpy_only=True)


def test_all_cases_with_the_one_sync_stage_up_to_8m():
    run_cases(3, env={"MCALLREDUCE_ONE_SYNC_BYTES": "8M", "MCALLREDUCE_TUNING_FILE": "none"}, numpy_only=True)


def test_hierarchical_two_virtual_hosts_of_two_ranks():
    # MCALLREDUCE_RANKS_PER_HOST groups ranks into virtual hosts, exercising the
    # intra-host reduce / inter-host trees / intra-host broadcast path under MPI
    cases = ["sum_matches_mpi_allreduce_all_lengths", "hierarchy_and_colors_variants_agree",
             "async_handles_waited_in_rank_dependent_order"]
    assert sorted(run_cases(4, env={"MCALLREDUCE_RANKS_PER_HOST": "2"}, cases=cases)) == sorted(cases)


@pytest.mark.parametrize("np_, mode", [(2, "caller"), (3, "thread")])
def test_a_rank_waiting_for_a_late_peer_sleeps(np_, mode):
    passed(mpi_script(np_, "late_peer.py", mode, timeout=120))


def test_a_wait_polls_as_long_as_the_user_asks():
    passed(mpi_script(2, "late_peer.py", "caller", env={"MCALLREDUCE_POLL_US": "3000000"}, timeout=120))


def test_mpi_collectives_without_the_check_never_block():
    # with no check to agree through, every rank takes the nonblocking path
    cases = ["mpi_collective_waited_alone_on_some_ranks_only",
             "a_table_pick_of_mpi_runs_the_rules_schedule_where_a_rank_cannot_block",
             "mpi_algorithm_async_with_rank_dependent_polling"]
    assert sorted(run_cases(3, env={"MCALLREDUCE_CHECK": "0"}, cases=cases)) == sorted(cases)


def test_mpi_ring_turned_off_by_the_user_runs_as_mpi():
    cases = ["mpi_ring_is_open_mpis_ring_where_it_can_be_forced"]
    assert run_cases(2, env={"OMPI_MCA_coll_tuned_use_dynamic_rules": "0"}, cases=cases) == cases


@pytest.mark.parametrize("np_", [2, 3])
def test_check_messages_in_pieces_across_virtual_hosts(np_):
    # across hosts the check's messages (and a fused call's data) travel in pieces under
    # the TCP eager limit; a limit of 8 KiB makes a 64 KiB fused call 17 pieces each way
    cases = ["sum_matches_mpi_allreduce_all_lengths", "length_mismatch_raises_on_every_rank",
             "a_call_fused_with_its_check_and_a_larger_one_raise_everywhere",
             "fused_calls_of_different_sizes_at_the_limit_raise_everywhere", "dtype_mismatch_raises_on_every_rank",
             "fused_halving_and_doubling_disagree_and_raise_everywhere", "async_handles_waited_in_rank_dependent_order"]
    env = {"MCALLREDUCE_RANKS_PER_HOST": "1", "OMPI_MCA_btl_tcp_eager_limit": "8192"}
    assert sorted(run_cases(np_, env=env, cases=cases)) == sorted(cases)


@pytest.mark.parametrize("np_", [2, 3])
def test_settings_differing_across_ranks_raise_not_hang(np_):
    passed(mpi_script(np_, "mismatched_settings.py", timeout=120))


def test_busy_calls_never_fail_as_stalled():
    # the inspector, looking every 50 ms, reads a blocking call the moment it releases the GIL:
    # its start time must already be set, or it looks hours old and every call in flight fails
    env = {"MCALLREDUCE_STALL_CHECK_TIME_SECONDS": "0.05", "MCALLREDUCE_STALL_SHUTDOWN_TIME_SECONDS": "10"}
    result = mpi_script(4, "busy_calls_no_false_stall.py", 5, env=env, timeout=120)
    passed(result)
    waits = [float(w) for w in re.findall(r"has waited (\d+) s", result.stderr)]
    assert all(w < 10 for w in waits), waits


@pytest.mark.parametrize("np_", [2, 3])
def test_a_stalled_call_is_reported_and_a_rank_that_leaves_makes_the_others_raise(np_):
    result = mpi_script(np_, "peer_leaves.py", 3, env={"MCALLREDUCE_STALL_CHECK_TIME_SECONDS": "1"}, timeout=60)
    passed(result)
    stalls = [ln for ln in result.stderr.splitlines() if "has waited" in ln]
    assert len(stalls) == np_ - 1, result.stderr
    assert all(re.search(r"waited \d+ s in the metadata check, waiting for rank \d", ln) for ln in stalls), stalls
    # then where each waiting rank is: inside MPI's wait, and the Python line that waits
    where = [ln for ln in result.stderr.splitlines() if "executor (the callers) is inside MPI_Testsome" in ln]
    assert len(where) == np_ - 1, result.stderr
    assert result.stderr.count('peer_leaves.py", line') >= np_ - 1, result.stderr


@pytest.mark.parametrize("mode", ["wait", "blocking"])
def test_a_call_whose_receive_fails_raises_and_the_next_one_runs(mode):
    passed(mpi_script(2, "failed_receive.py", mode, timeout=60))


@pytest.mark.parametrize("np_, mode", [(2, "caller"), (2, "thread"), (3, "caller")])
def test_past_the_stall_shutdown_time_a_call_fails_instead_of_waiting(np_, mode):
    env = {"MCALLREDUCE_STALL_SHUTDOWN_TIME_SECONDS": "2", "MCALLREDUCE_STALL_CHECK_TIME_SECONDS": "1"}
    result = mpi_script(np_, "stall_shutdown.py", mode, env=env, timeout=60)
    passed(result)


@pytest.mark.parametrize("np_", [2, 3])
def test_a_rank_that_finished_and_left_mpi_does_not_hold_up_its_peers(np_):
    passed(mpi_script(np_, "peer_idles.py", timeout=120))


@pytest.mark.parametrize("np_", [2, 3])
def test_background_progress_thread(np_):
    passed(mpi_script(np_, "progress_thread.py", timeout=120))


def test_verbose_reports_each_new_kind_of_call_once():
    # the rules' choice, not the built-in table's, so the line names a multicolor schedule
    result = mpi_script(2, "verbose.py", env={"MCALLREDUCE_VERBOSE": "1", "MCALLREDUCE_TUNING_FILE": "none"},
                        timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("mcallreduce: ")]
    assert len(lines) == 1 and "multicolor(colors=2" in lines[0], result.stderr
    assert result.stdout == ""


def test_without_the_thread_starting_a_call_advances_the_calls_in_flight():
    passed(mpi_script(2, "submit_progresses.py", timeout=120))


@pytest.mark.parametrize("case", ["freed_communicator", "freed_communicators_release_their_contexts",
                                  "foreign_byte_order", "raising_callback caller",
                                  "raising_callback thread", "option_on_one_rank", "every_tag_window_in_flight",
                                  "closed_with_a_call_in_flight", "abort_while_idle",
                                  "progress_thread_started_under_calls", "stall_report_to_a_stderr_without_a_file",
                                  "after_finalize", "lazy_tensor_view_on_one_rank", "intercommunicator"])
def test_the_api_where_a_user_strays_from_the_common_call(case):
    # each case once gave a wrong result, a wait that never ended, an error on one rank, or a crash
    env = {"MCALLREDUCE_STALL_SHUTDOWN_TIME_SECONDS": "2", "MCALLREDUCE_STALL_CHECK_TIME_SECONDS": "1"} \
        if case.startswith("stall") else None
    passed(mpi_script(2, "api_edges.py", *case.split(), env=env, timeout=90))


def test_emulated_hosts_group_the_jobs_ranks_also_on_a_reordered_communicator():
    passed(mpi_script(3, "host_layout.py", env={"MCALLREDUCE_RANKS_PER_HOST": "2"}, timeout=60))
