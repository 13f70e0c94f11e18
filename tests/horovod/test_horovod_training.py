"""Training equivalence and plugin-only behaviour under mpirun."""
import re

import pytest
import torch

from _horovod import OFF, ON, explain, mpi_job, needs_horovod

pytestmark = needs_horovod


def test_training_with_and_without_plugin_reaches_the_same_parameters(tmp_path):
    outs = {}
    # the progress thread forced on: the overlap path (auto leaves it off on a 2-core machine);
    # "views": gradients left as views of their bucket, zeroed in place so backward accumulates into them
    views = {**ON, "MCALLREDUCE_PROGRESS_THREAD": "1", "MCALLREDUCE_GRADIENT_AS_BUCKET_VIEW": "1"}
    for mode, env, args in (("stock", OFF, ()), ("plugin", {**ON, "MCALLREDUCE_PROGRESS_THREAD": "1"}, ()),
                            ("views", views, ("keep-grads",))):
        result = mpi_job(2, "train_cnn.py", tmp_path / f"{mode}.pt", 30, *args, env=env)
        assert result.returncode == 0 and "TRAINED" in result.stdout, explain(result)
        outs[mode] = torch.load(tmp_path / f"{mode}.pt")
    stock = outs["stock"]
    assert stock["losses"][-1] < 0.5 * stock["losses"][0], stock["losses"]
    for mode in ("plugin", "views"):
        torch.testing.assert_close(outs[mode]["losses"], stock["losses"], rtol=1e-4, atol=1e-5, msg=mode)
        for name, want in stock["params"].items():
            torch.testing.assert_close(outs[mode]["params"][name], want, rtol=1e-4, atol=1e-5, msg=f"{mode} {name}")
    # every gradient its own tensor, except as views: all of them in the model's one bucket
    assert stock["grad_storages"] == outs["plugin"]["grad_storages"] > 1
    assert outs["views"]["grad_storages"] == 1


def test_plugin_only_behaviour():
    result = mpi_job(2, "plugin_only.py", env=ON)
    checks = dict(re.findall(r"^CHECK (\S+) (.*)$", result.stdout, re.M))
    assert result.returncode == 0 and len(checks) == 7, explain(result)
    assert all(v == "ok" for v in checks.values()), checks


@pytest.mark.parametrize("np_, how", [(2, "raise"), (2, "shutdown"), (3, "raise")])
def test_a_rank_that_leaves_on_an_error_makes_the_others_raise_as_stock_does(np_, how):
    # the others are in a stock allgather, which the plugin's goodbye does not reach: what ends
    # their wait is Horovod's own shutdown, which the leaving rank must reach without them
    result = mpi_job(np_, "rank_leaves_in_error.py", how, env=ON, timeout=90)
    # counted in the whole output: two ranks' lines can interleave (an unbuffered print writes its
    # newline apart from its text)
    raised = re.findall(r"rank \d+ raised HorovodInternalError", result.stdout)
    # 1: the leaving rank's own error, not a kill at the timeout after the others stopped
    assert result.returncode == 1 and len(raised) == np_ - 1, explain(result)
    assert f"rank {np_ - 1} leaves on an error" in result.stderr, explain(result)


def test_a_failed_bucket_still_synchronizes_its_sparse_gradients_stock_handles():
    # stock Horovod leaves them in its handle map too, but there the failing call is its own
    result = mpi_job(2, "sparse_bucket_fails.py", env=ON, timeout=90)
    assert result.returncode == 0 and result.stdout.count("SPARSE OK") == 2, explain(result)
