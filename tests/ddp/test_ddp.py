"""PyTorch DDP over the multi-color allreduce: the comm hook and the mcallreduce backend against
DDP on gloo, under mpirun at 2 and 3 ranks; failures reported on every rank; a torchrun-style
launch without mpirun refused clearly. Each job's exit status is its result."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _mpi import REPO as ROOT, explain, passed, run_job

JOBS = Path(__file__).parent / "mpi"


def job(np_, script, *args, env=None, timeout=240):
    return passed(run_job(np_, JOBS / script, *args, env=env, timeout=timeout))


@pytest.fixture(scope="module", params=[(2, "0"), (2, "1"), (3, "0"), (3, "1")], ids=lambda p: f"{p[0]}-thread{p[1]}")
def both_arms_against_gloo(request):
    """One job per (ranks, progress thread) trains on gloo once, then with each arm."""
    np_, thread = request.param
    return np_, run_job(np_, JOBS / "equivalence.py", "hook,backend", env={"MCALLREDUCE_PROGRESS_THREAD": thread},
                        timeout=240)


@pytest.mark.parametrize("arm, variants", [("hook", 10), ("backend", 11)])
def test_ddp_ends_with_the_parameters_of_ddp_on_gloo(both_arms_against_gloo, arm, variants):
    np_, result = both_arms_against_gloo
    assert result.returncode == 0, explain(result)
    assert f"{arm} on cpu: {variants} variants agree with gloo at {np_} ranks" in result.stdout, explain(result)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("thread", ["0", "1"])
@pytest.mark.parametrize("np_", [2, 3])
def test_the_hook_on_cuda_buckets_ends_with_the_parameters_of_ddp_on_gloo(np_, thread):
    out = job(np_, "equivalence.py", "hook", "cuda", env={"MCALLREDUCE_PROGRESS_THREAD": thread}, timeout=600)
    assert "hook on cuda: " in out and f"agree with gloo at {np_} ranks" in out


@pytest.mark.parametrize("np_,init", [(2, "url"), (3, "bare")])
def test_failures_raise_on_every_rank_and_the_backend_matches_gloo(np_, init):
    assert f"all reported on {np_} ranks" in job(np_, "failures.py", init, timeout=120)


@pytest.mark.parametrize("np_,thread", [(2, "1"), (3, "0")])
def test_broadcast_allgather_and_barrier_do_what_gloo_users_rely_on(np_, thread):
    # each once failed: stale results after a barrier with the thread on, copies into parameters
    # that require grad, a sparse bucket's error, a barrier that waited for ever, a rank that hung
    out = job(np_, "side_collectives.py", env={"MCALLREDUCE_PROGRESS_THREAD": thread}, timeout=120)
    assert f"side collectives as gloo's on {np_} ranks" in out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_torchrun_launch_without_mpirun_is_refused_clearly():
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(JOBS / "torchrun_world.py")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("every way in raised clearly" in out for out in outs)


def test_the_ddp_benchmark_runs_every_arm_and_writes_its_table(tmp_path):
    out = tmp_path / "ddp.json"
    result = subprocess.run([sys.executable, "-m", "mcallreduce.bench", "ddp", "-np", "2", "--arms",
                             "gloo,hook:MCALLREDUCE_PROGRESS_THREAD=0,backend", "--runs", "1", "--json", str(out), "--", "--image-size", "32",
                             "--batch-size", "2", "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
                             "--num-iters", "1", "--threads", "1"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [r["comm"] for r in doc["runs"]] == ["gloo", "hook", "backend"]   # later rounds: bench.timing.alternated
    assert doc["runs"][1]["arm"] == "hook:MCALLREDUCE_PROGRESS_THREAD=0"   # an arm with a variable of its own
    assert all(r["ranks"] == 2 and r["total_img_sec"] > 0 for r in doc["runs"])
    assert "| hook:MCALLREDUCE_PROGRESS_THREAD=0 |" in doc["table"] and "vs gloo" in doc["table"]
    assert doc["started"] <= doc["runs"][0]["started"] <= doc["finished"] and doc["cluster"] is None   # on this host


def test_without_an_mpi_launcher_env_rendezvous_is_torchs_own(monkeypatch):
    import mcallreduce.ddp
    from mcallreduce.launch import LAUNCHER_VARS
    import importlib
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    for name in (*LAUNCHER_VARS, "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    mcallreduce.ddp.backend.register()             # a second time: env:// stays wrapped once
    handler = rendezvous._rendezvous_handlers["env"]
    assert not hasattr(handler.env_handler, "env_handler")
    with pytest.raises(ValueError, match="environment variable RANK expected"):
        next(rendezvous.rendezvous("env://"))


def test_without_the_thread_gradient_hooks_finish_a_bucket_during_backward():
    job(2, "overlap.py", env={"MCALLREDUCE_PROGRESS_THREAD": "0"})


def test_without_the_thread_the_backend_lets_backward_go_on_while_a_bucket_travels():
    job(2, "backend_overlap.py", env={"MCALLREDUCE_PROGRESS_THREAD": "0"})


@pytest.mark.parametrize("np_", [2, 3])
def test_without_the_thread_every_call_form_ends_with_glooish_answers(np_):
    # each once hung (DDP's first static-graph step through the hook; a polled is_completed()),
    # misread its arguments (allgather(outputs, tensor)), or failed DDP's join() on the backend
    env = {"MCALLREDUCE_PROGRESS_THREAD": "0", "MCALLREDUCE_STALL_SHUTDOWN_TIME_SECONDS": "30"}
    assert "every call form ended" in job(np_, "call_forms.py", env=env, timeout=120)


def test_with_the_thread_every_call_form_ends_and_a_destroyed_group_lets_its_engine_go():
    # the thread's completer once kept the last call's handle, and through it the group's engine
    env = {"MCALLREDUCE_PROGRESS_THREAD": "1", "MCALLREDUCE_STALL_SHUTDOWN_TIME_SECONDS": "30"}
    assert "every call form ended" in job(2, "call_forms.py", env=env, timeout=120)


def test_a_torch_without_the_autograd_node_query_says_the_overlap_is_lost(monkeypatch):
    import warnings
    from mcallreduce.ddp import futures
    assert futures.inside_backward_node() is False   # outside backward, on this torch
    monkeypatch.setattr(futures, "_CURRENT_NODE", None)
    monkeypatch.setattr(futures, "_warned_no_node_query", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert futures.inside_backward_node() is False and futures.inside_backward_node() is False
    assert len(seen) == 1 and "no longer overlaps" in str(seen[0].message), seen
