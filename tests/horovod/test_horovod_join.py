"""hvd.join() with uneven inputs under mpirun -np 2: the plugin gives stock Horovod's results."""
import pytest
import torch

from _horovod import OFF, ON, explain, mpi_job, needs_horovod

pytestmark = needs_horovod


def join_run(env, path):
    # a hang (a joined rank not serving the others' allreduces) ends in the timeout
    result = mpi_job(2, "join_uneven.py", path, env=env, timeout=150)
    assert result.returncode == 0 and "JOINED" in result.stdout, explain(result)
    saved = torch.load(path)
    assert saved["size"] == 2
    return saved["ranks"]


def test_join_with_uneven_steps_matches_stock_horovod(tmp_path):
    stock = join_run(OFF, tmp_path / "stock.pt")
    # both ways of progressing: the waiting thread (auto on 2 cores) and the progress thread
    for mode, env in (("plugin", ON), ("plugin_thread", {**ON, "MCALLREDUCE_PROGRESS_THREAD": "1"})):
        plugin = join_run(env, tmp_path / f"{mode}.pt")
        for rank, (want, got) in enumerate(zip(stock, plugin)):
            # epoch 1: rank 1 runs more steps and joins last; epoch 2: rank 0
            assert want["last_joined"] == got["last_joined"] == [1, 0], (mode, rank, got["last_joined"])
            assert len(got["steps"]) == len(want["steps"]) == 6, (mode, rank)
            for i, (w, g) in enumerate(zip(want["steps"], got["steps"])):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=f"{mode} rank {rank} step {i}")
            for w, g in zip(want["params"], got["params"]):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{mode} rank {rank} params")
            assert torch.equal(got["after"], want["after"]), (mode, rank)
            assert got["unnamed"].tolist() == [3.0] * 3, (mode, rank, got["unnamed"])
            # the routed path was taken, and the rank that joined first served the other's
            # allreduces (2 extra steps x (bucket, metric, average, grouped) in each epoch)
            assert got["stats"]["routed"] > 0 and got["stats"]["served_joined"] == 8, (mode, rank, got["stats"])


@needs_horovod
@pytest.mark.parametrize("env", [OFF, ON], ids=["stock", "plugin"])
def test_join_returns_the_last_rank_when_the_joins_share_a_horovod_cycle(env):
    # a joined rank serves the other's allreduce within microseconds, so both join requests
    # can reach Horovod's coordinator in one cycle (50 ms here make sure they do)
    result = mpi_job(2, "join_order.py", env={**env, "HOROVOD_CYCLE_TIME": "50"}, timeout=120)
    assert result.returncode == 0, explain(result)
