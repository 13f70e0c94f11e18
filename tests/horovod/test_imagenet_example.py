"""examples/pytorch_imagenet_resnet50.py under mpirun: both --data modes, stock vs plugin, mid-epoch resume."""
import json

import pytest
import torch

from _horovod import OFF, REPO, explain, mpi_job, needs_horovod
from mcallreduce.bench import accuracy, e2e
from mcallreduce.data.photos import make_photo_folder

pytestmark = needs_horovod

EXAMPLE = REPO / "examples" / "pytorch_imagenet_resnet50.py"
PLUGIN = {"MCALLREDUCE_ALGORITHM": "multicolor", "MCALLREDUCE_PROGRESS_THREAD": "1"}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagenet-like")
    make_photo_folder(str(root / "train"), per_class=6, long_side=(48, 128), seed=1)    # 60 images
    make_photo_folder(str(root / "val"), per_class=2, long_side=(48, 128), seed=2)      # 20 images
    return root


def run(tree, out, *args, env=None, val="val", checkpoints="checkpoint-{epoch}.pt"):
    """Run the example at 2 ranks (a small CNN on 32 px crops)."""
    return mpi_job(2, EXAMPLE, "--train-dir", tree / "train", "--val-dir", tree / val, "--arch", "small_cnn",
                   "--image-size", 32, "--batch-size", 8, "--threads", 1, "--log-dir", out,
                   "--checkpoint-format", f"{out}/{checkpoints}", *args,
                   env={"MCALLREDUCE_DATA_PROGRESS": "0", **(env or OFF)}, timeout=300)


def train(tree, out, *args, env=None, **where):
    """Run the example at 2 ranks; its metrics.json."""
    result = run(tree, out, *args, env=env, **where)
    assert result.returncode == 0, explain(result)
    path = out / "metrics.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.parametrize("data,workers", [("folder", 0), ("memory", 2)])
def test_both_data_modes_train_and_validate(tree, tmp_path, data, workers):
    metrics = train(tree, tmp_path, "--data", data, "--epochs", 1, "--workers", workers)
    (epoch,) = metrics["epochs"]
    assert metrics["size"] == 2 and epoch["images"] == 60          # 60 images, 30 a rank
    assert 0 <= epoch["val_accuracy"] <= 1 and epoch["train_loss"] > 0 and epoch["images_per_s"] > 0
    assert len(epoch["ranks"]) == 2
    for rank in epoch["ranks"]:
        assert set(rank) == {"data", "forward_backward", "allreduce", "optimizer", "metrics"}
        assert rank["forward_backward"] > 0 and all(v >= 0 for v in rank.values())
    # the first step (batch 8 on each rank) apart, for the rate of a long epoch
    assert epoch["first_step_images"] == 16 and 0 < epoch["first_step_s"] < epoch["epoch_s"]
    for rank, first in zip(epoch["ranks"], epoch["ranks_first_step"]):
        assert all(0 <= first[part] <= rank[part] for part in rank)
    row = e2e.summarise(data, metrics, 1)              # what the ablation bench reports of it
    assert sum(row["shares"].values()) == pytest.approx(1.0) and row["images_per_s"] == epoch["images_per_s"]
    steady = row["steady"]
    assert steady["images"] == 44 and steady["seconds"] == pytest.approx(epoch["epoch_s"] - epoch["first_step_s"])
    assert sum(steady["shares"].values()) == pytest.approx(1.0)
    assert f"| {data} | " in e2e.table([row]) and f"| {data} | " in e2e.steady_table([row])
    # each rank's time to open its data (list the tree, or load its share of the store), once per job
    assert len(metrics["data_open_s"]) == 2 and all(s > 0 for s in metrics["data_open_s"])
    assert row["data_open_s"] == max(metrics["data_open_s"]) and f"| {data} | " in e2e.open_table([row])


def test_local_gradients_train_without_a_gradient_allreduce(tree, tmp_path):
    """The ablation's ceiling arm: the step runs with nothing to wait for between backward and the update."""
    metrics = train(tree, tmp_path, "--data", "memory", "--epochs", 1, "--workers", 0, "--local-gradients")
    (epoch,) = metrics["epochs"]
    assert epoch["images"] == 60 and epoch["train_loss"] > 0
    for rank in epoch["ranks"]:
        assert rank["allreduce"] < 0.01 < rank["forward_backward"]     # 4 steps of a no-op synchronize()
    assert "local" in e2e.ARMS and "local" not in e2e.DEFAULT_ARMS
    memory, local = e2e.summarise("memory", metrics, 1), e2e.summarise("local", metrics, 1)
    assert "| vs local |" in e2e.table([memory, local]) and "| vs local |" not in e2e.table([memory])


def assert_same_state(want_path, got_path):
    want, got = torch.load(want_path), torch.load(got_path)
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    for key, state in want["optimizer"]["state"].items():
        assert torch.equal(got["optimizer"]["state"][key]["momentum_buffer"], state["momentum_buffer"])


def stop_and_resume(tree, out, *args):
    """Stopped after 6 steps (epoch 2 of 4 steps, 2 done), with the plugin, then resumed."""
    assert train(tree, out, *args, "--checkpoint-steps", 1, "--stop-after-steps", 6, env=PLUGIN)
    assert (out / "checkpoint-2-partial.pt").exists() and not (out / "checkpoint-2.pt").exists()
    train(tree, out, *args, "--checkpoint-steps", 1, env=PLUGIN)
    assert not (out / "checkpoint-2-partial.pt").exists()        # superseded by the whole epoch


def test_same_seed_stock_and_plugin_agree_and_a_mid_epoch_resume_is_exact(tree, tmp_path):
    args = ("--data", "memory", "--epochs", 2, "--workers", 0)
    stock = train(tree, tmp_path / "stock", *args)
    plugin = train(tree, tmp_path / "plugin", *args, env=PLUGIN)
    for a, b in zip(stock["epochs"], plugin["epochs"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    stop_and_resume(tree, tmp_path / "resumed", *args)
    assert_same_state(tmp_path / "plugin" / "checkpoint-2.pt", tmp_path / "resumed" / "checkpoint-2.pt")


def test_a_folder_run_resumes_mid_epoch_exactly_with_any_number_of_workers(tree, tmp_path):
    """A stock DistributedSampler, wrapped so that it has a position; the crops keyed by sample."""
    train(tree, tmp_path / "whole", "--data", "folder", "--epochs", 2, "--workers", 0, env=PLUGIN)
    stop_and_resume(tree, tmp_path / "resumed", "--data", "folder", "--epochs", 2, "--workers", 2)
    assert_same_state(tmp_path / "whole" / "checkpoint-2.pt", tmp_path / "resumed" / "checkpoint-2.pt")


def test_persistent_workers_train_as_the_main_process_does_on_a_store_split_across_hosts(tree, tmp_path):
    """Two emulated hosts, a global shuffle: each epoch's exchanged samples reach the workers that live on."""
    args = ("--data", "memory", "--shuffle", "global", "--epochs", 2)
    split = {**OFF, "MCALLREDUCE_RANKS_PER_HOST": "1"}
    train(tree, tmp_path / "main", *args, "--workers", 0, env=split)
    train(tree, tmp_path / "persistent", *args, "--workers", 2, "--persistent-workers", env=split)
    assert_same_state(tmp_path / "main" / "checkpoint-2.pt", tmp_path / "persistent" / "checkpoint-2.pt")


def test_the_accuracy_bench_reports_every_arm(tmp_path, capsys):
    out, png = tmp_path / "accuracy.json", tmp_path / "accuracy.png"
    assert accuracy.main(["--tree", str(tmp_path / "digits"), "--np", "2", "--seeds", "0",
                          "--data", "folder,memory-global", "--json", str(out), "--plot", str(png), "--",
                          "--arch", "small_cnn", "--image-size", "16", "--epochs", "1", "--batch-size", "64",
                          "--workers", "0", "--threads", "1"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert {(r["data"], r["horovod"]) for r in runs} == {(d, h) for d in ("folder", "memory-global")
                                                         for h in ("stock", "plugin")}
    for r in runs:
        assert len(r["train_loss"]) == 1 and 0 <= r["val_accuracy"][0] <= 1
    table = capsys.readouterr().out
    assert "| memory-global | plugin |" in table and "+-" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_metrics_weigh_every_sample_alike(tree, tmp_path):
    # the model frozen (a zero learning rate), so every arrangement of the same samples scores the same:
    # the train loss was once recorded after its division by --batches-per-allreduce, and a short last
    # validation batch counted as much as a full one
    frozen = ("--data", "folder", "--epochs", 1, "--workers", 0, "--base-lr", 0, "--warmup-epochs", 0)
    one = train(tree, tmp_path / "one", *frozen, "--batch-size", 4, "--val-batch-size", 4)["epochs"][0]
    two = train(tree, tmp_path / "two", *frozen, "--batch-size", 4, "--batches-per-allreduce", 2,
                "--val-batch-size", 6)["epochs"][0]     # the same forward passes, so batch norm's statistics too
    assert one["train_loss"] == pytest.approx(two["train_loss"], rel=1e-5)
    assert one["val_loss"] == pytest.approx(two["val_loss"], rel=1e-5)
    assert one["val_accuracy"] == pytest.approx(two["val_accuracy"], abs=1e-6)   # float32 batch means
    assert round(one["val_accuracy"] * 20, 6).is_integer()     # a count out of the 20 validation images


def test_a_checkpoint_name_takes_a_format_spec_and_needs_the_epoch(tree, tmp_path):
    train(tree, tmp_path, "--data", "folder", "--epochs", 1, "--workers", 0, "--checkpoint-steps", 1,
          "--stop-after-steps", 2, checkpoints="ckpt-{epoch:03d}.pth.tar")
    assert (tmp_path / "ckpt-001-partial.pth.tar").exists()
    result = run(tree, tmp_path, "--data", "folder", "--epochs", 1, checkpoints="ckpt.pt")
    assert result.returncode != 0 and "needs {epoch}" in result.stderr, explain(result)


def test_a_validation_set_of_other_classes_is_refused(tree, tmp_path):
    import shutil
    shutil.copytree(tree / "val", tmp_path / "val")
    shutil.rmtree(sorted((tmp_path / "val").iterdir())[0])
    result = mpi_job(2, EXAMPLE, "--train-dir", tree / "train", "--val-dir", tmp_path / "val", "--arch", "small_cnn",
                     "--image-size", 32, "--epochs", 1, "--threads", 1,
                     "--checkpoint-format", f"{tmp_path}/checkpoint-{{epoch}}.pt", env=OFF, timeout=120)
    assert result.returncode != 0 and "are not the training set's" in result.stderr, explain(result)


def test_a_mid_epoch_resume_with_another_batch_size_is_refused(tree, tmp_path):
    args = ("--data", "memory", "--epochs", 1, "--workers", 0, "--checkpoint-steps", 1)
    train(tree, tmp_path, *args, "--stop-after-steps", 1)
    result = run(tree, tmp_path, *args, "--batch-size", 4)
    assert result.returncode != 0 and "cannot resume" in result.stderr, explain(result)
