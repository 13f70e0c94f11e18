"""Training equivalence and plugin-only behaviour under mpirun."""
import re

import torch

from _horovod import OFF, ON, explain, mpi_job, needs_horovod

pytestmark = needs_horovod


def test_training_with_and_without_plugin_reaches_the_same_parameters(tmp_path):
    outs = {}
    # the progress thread forced on: the overlap path (auto leaves it off on a 2-core machine)
    for mode, env in (("stock", OFF), ("plugin", {**ON, "MCALLREDUCE_PROGRESS_THREAD": "1"})):
        result = mpi_job(2, "train_cnn.py", tmp_path / f"{mode}.pt", 30, env=env)
        assert result.returncode == 0 and "TRAINED" in result.stdout, explain(result)
        outs[mode] = torch.load(tmp_path / f"{mode}.pt")
    stock, plugin = outs["stock"], outs["plugin"]
    assert plugin["losses"][-1] < 0.5 * plugin["losses"][0], plugin["losses"]
    torch.testing.assert_close(plugin["losses"], stock["losses"], rtol=1e-4, atol=1e-5)
    for name, want in stock["params"].items():
        torch.testing.assert_close(plugin["params"][name], want, rtol=1e-4, atol=1e-5, msg=name)


def test_plugin_only_behaviour():
    result = mpi_job(2, "plugin_only.py", env=ON)
    checks = dict(re.findall(r"^CHECK (\S+) (.*)$", result.stdout, re.M))
    assert result.returncode == 0 and len(checks) == 6, explain(result)
    assert all(v == "ok" for v in checks.values()), checks
