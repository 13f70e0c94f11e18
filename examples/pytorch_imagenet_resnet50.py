"""ImageNet training with Horovod, with the command line and behaviour of Horovod's
examples/pytorch/pytorch_imagenet_resnet50.py (written for this project), plus ``--data``:

- ``folder``: what a user has today: an ImageFolder read from disk (torchvision's when it
  imports, else mcallreduce.data.ImageFolder), a stock DistributedSampler, DataLoader workers;
- ``memory``: the training set held once in the cluster's RAM (mcallreduce.data): only the
  dataset and sampler lines differ (docs/e2e.md shows the diff).

The multi-color allreduce needs no change here: set ``MCALLREDUCE_ALGORITHM=multicolor``.

    python -m mcallreduce.launch -np 4 -x MCALLREDUCE_ALGORITHM=multicolor -- \\
        python examples/pytorch_imagenet_resnet50.py --data memory --train-dir T --val-dir V

Each epoch, rank 0 prints and (with ``--log-dir``) writes metrics.json: loss, accuracy,
img/s and every rank's time split into data wait, forward/backward, allreduce wait,
optimizer step and metrics, with the epoch's first step also apart (it waits for the
DataLoader's workers to start); and, once, each rank's seconds to open its data (list the
tree, or load its share of the store). Checkpoints as Horovod's (per epoch, resumed from the latest),
and also within an epoch (``--checkpoint-steps``), resumed exactly.
"""
import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader, DistributedSampler
import horovod.torch as hvd

from mcallreduce.data import EvalTransform, ImageFolder, InMemoryDistributedSampler, InMemoryImageFolder
from mcallreduce.data import ResumableSampler, ThreadedLoader, TrainTransform
from mcallreduce.data.progress import bar as progress_bar   # tqdm; redraws every 10 s on a pipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resnet import ARCHS, model as build_model  # noqa: E402

try:   # torchvision's PyPI wheel raises a RuntimeError beside a CPU build of torch
    from torchvision import datasets
    ImageFolder = datasets.ImageFolder  # noqa: F811
except Exception:
    pass

parser = argparse.ArgumentParser(description="PyTorch ImageNet Example",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--train-dir", default=os.path.expanduser("~/imagenet/train"), help="path to training data")
parser.add_argument("--val-dir", default=os.path.expanduser("~/imagenet/validation"), help="path to validation data")
parser.add_argument("--log-dir", default=None, help="rank 0 writes metrics.json here")
parser.add_argument("--checkpoint-format", default="./checkpoint-{epoch}.pth.tar", help="checkpoint file format")
parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="use fp16 compression during allreduce")
parser.add_argument("--batches-per-allreduce", type=int, default=1,
                    help="number of batches processed locally before executing allreduce across workers; "
                         "it multiplies total batch size.")
parser.add_argument("--use-adasum", action="store_true", default=False, help="use adasum algorithm to do reduction")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer")
# Default settings from https://arxiv.org/abs/1706.02677, as in Horovod's example.
parser.add_argument("--batch-size", type=int, default=32, help="input batch size for training")
parser.add_argument("--val-batch-size", type=int, default=32, help="input batch size for validation")
parser.add_argument("--epochs", type=int, default=90, help="number of epochs to train")
parser.add_argument("--base-lr", type=float, default=0.0125, help="learning rate for a single GPU")
parser.add_argument("--warmup-epochs", type=float, default=5, help="number of warmup epochs")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--lr-decay-epochs", default="30,60,80", help="after warm-up, the learning rate is /10 at each")
parser.add_argument("--wd", type=float, default=0.00005, help="weight decay")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, help="random seed")
# Added here.
parser.add_argument("--data", choices=("folder", "memory"), default="folder",
                    help="folder: ImageFolder from disk + DistributedSampler; memory: mcallreduce.data")
parser.add_argument("--shuffle", choices=("local", "partial", "global"), default="local",
                    help="--data memory: the sampler's shuffle mode")
parser.add_argument("--arch", choices=ARCHS, default="resnet50", help="model")
parser.add_argument("--image-size", type=int, default=224, help="training crop; validation resizes to 8/7 of it")
parser.add_argument("--crop-scale", type=float, default=0.08, help="smallest share of the image a random crop keeps")
parser.add_argument("--flip", type=float, default=0.5, help="probability of a horizontal flip (0 for digits)")
parser.add_argument("--workers", type=int, default=4, help="DataLoader workers (decode threads with --loader threaded)")
parser.add_argument("--persistent-workers", action="store_true", default=False,
                    help="DataLoader workers that live for the whole job instead of starting every epoch")
parser.add_argument("--loader", choices=("dataloader", "threaded"), default="dataloader",
                    help="DataLoader worker processes, or mcallreduce.data.ThreadedLoader's decode threads")
parser.add_argument("--threads", type=int, default=4, help="torch intra-op threads per rank")
parser.add_argument("--checkpoint-steps", type=int, default=0,
                    help="also checkpoint every N steps within an epoch (0: per epoch only)")
parser.add_argument("--stop-after-steps", type=int, default=0,
                    help="stop after N steps of this run, as a preempted job would (after a mid-epoch "
                         "checkpoint)")
parser.add_argument("--local-gradients", action="store_true", default=False,
                    help="no gradient allreduce: each rank steps on its own gradients, so the models drift "
                         "apart; an ablation's ceiling for what any allreduce could give")


class Metric:
    """A running mean over all ranks' samples. Horovod's example averages each update's per-rank means,
    which lets a short last batch count as much as a full one; here each update weighs its samples."""

    def __init__(self, name):
        self.name, self.sum, self.n = name, torch.tensor(0., dtype=torch.float64), torch.tensor(0., dtype=torch.float64)

    def update(self, value, samples):
        both = torch.stack([value.detach().cpu().double() * samples, torch.tensor(float(samples), dtype=torch.float64)])
        total, count = hvd.allreduce(both, op=hvd.Sum, name=self.name)
        self.sum += total
        self.n += count

    @property
    def avg(self):
        return self.sum / max(self.n, 1)


class StepTimer:
    """Seconds of this rank in each part of a training step; ``first`` holds the epoch's first step
    apart, since it also waits for the DataLoader's workers to start."""
    PARTS = ("data", "forward_backward", "allreduce", "optimizer", "metrics")

    def __init__(self):
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self.start = self.last = time.perf_counter()
        self.first, self.first_s = None, None

    def end_of_step(self):
        if self.first is None:
            self.first, self.first_s = dict(self.seconds), self.last - self.start

    def lap(self, part):
        if args.cuda:
            torch.cuda.synchronize()    # GPU work is asynchronous: charge it to the part that queued it
        now = time.perf_counter()
        self.seconds[part] += now - self.last
        self.last = now


def accuracy(output, target):
    return output.argmax(1).eq(target).float().mean()


def adjust_learning_rate(epoch, batch_idx, steps_per_epoch):
    """Linear warm-up from base_lr to base_lr * size, then /10 at each of --lr-decay-epochs (Goyal et al.)."""
    if epoch < args.warmup_epochs:
        progress = epoch + float(batch_idx + 1) / steps_per_epoch
        lr_adj = 1. / hvd.size() * (progress * (hvd.size() - 1) / args.warmup_epochs + 1)
    else:
        lr_adj = 10. ** -sum(epoch >= int(e) for e in args.lr_decay_epochs.split(","))
    for group in optimizer.param_groups:
        group["lr"] = args.base_lr * lr_scaler * lr_adj


def checkpoint_path(epoch, partial=False):
    """The epoch's checkpoint, or its partial one: ``-partial`` before the file's extensions."""
    path = args.checkpoint_format.format(epoch=epoch)
    if not partial:
        return path
    folder, name = os.path.split(path)
    stem, dot, extensions = name.partition(".")
    return os.path.join(folder, f"{stem}-partial{dot}{extensions}")


def save_checkpoint(epoch, step=None):
    """Rank 0 writes the state (atomically). ``step``: batches of epoch ``epoch`` done (a mid-epoch one)."""
    if hvd.rank() != 0:
        return
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
    path = checkpoint_path(epoch + 1)
    if step is not None:
        state.update(step=step, sampler=train_sampler.state_dict(consumed=step * allreduce_batch_size),
                     resume={"data": args.data, "allreduce_batch_size": allreduce_batch_size, "size": hvd.size()})
        path = checkpoint_path(epoch + 1, partial=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "wb") as f:   # on disk before its name: a crash leaves the old file or the new
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    if step is None and os.path.exists(checkpoint_path(epoch + 1, partial=True)):
        os.remove(checkpoint_path(epoch + 1, partial=True))    # the whole epoch supersedes it


def find_resume_point():
    """(epochs done, the partial checkpoint of the next epoch or None), decided by rank 0."""
    done, partial = 0, None
    if hvd.rank() == 0:
        for epoch in range(args.epochs, 0, -1):
            if os.path.exists(checkpoint_path(epoch)):
                done = epoch
                break
        if os.path.exists(checkpoint_path(done + 1, partial=True)):
            partial = checkpoint_path(done + 1, partial=True)
    return hvd.broadcast_object((done, partial), root_rank=0, name="resume_point")


def train(epoch, first_step=0):
    """One epoch from batch ``first_step`` on; None when stopped within it (--stop-after-steps)."""
    global steps_run, stop
    model.train()
    train_sampler.set_epoch(epoch)
    train_loss, train_accuracy = Metric("train_loss"), Metric("train_accuracy")
    timer, images, first_images = StepTimer(), 0, 0
    steps = len(train_loader)      # the whole epoch's, also when resumed within it
    with progress_bar(steps, f"Train Epoch     #{epoch + 1}", show=verbose, initial=first_step) as t:
        for batch_idx, (data, target) in enumerate(train_loader, start=first_step):
            if args.cuda:
                data, target = data.cuda(non_blocking=True), target.cuda(non_blocking=True)
            timer.lap("data")
            adjust_learning_rate(epoch, batch_idx, steps)
            optimizer.zero_grad()
            outputs = []
            for i in range(0, len(data), args.batch_size):    # sub-batches, gradients averaged over them
                output = model(data[i:i + args.batch_size])
                loss = F.cross_entropy(output, target[i:i + args.batch_size])
                outputs.append((output.detach(), loss.detach().clone()))   # div_ below scales loss in place
                loss.div_(math.ceil(float(len(data)) / args.batch_size))
                loss.backward()
            timer.lap("forward_backward")
            optimizer.synchronize()
            timer.lap("allreduce")
            with optimizer.skip_synchronize():
                optimizer.step()
            timer.lap("optimizer")
            for i, (output, loss) in zip(range(0, len(data), args.batch_size), outputs):
                train_accuracy.update(accuracy(output, target[i:i + args.batch_size]), len(output))
                train_loss.update(loss, len(output))
            images += len(data)
            t.set_postfix({"loss": train_loss.avg.item(), "accuracy": 100. * train_accuracy.avg.item()}, refresh=False)
            t.update(1)
            done = batch_idx + 1
            if args.checkpoint_steps and done % args.checkpoint_steps == 0 and done < steps:
                save_checkpoint(epoch, step=done)
            timer.lap("metrics")
            timer.end_of_step()
            first_images = first_images or images
            steps_run += 1
            if args.stop_after_steps and steps_run >= args.stop_after_steps:
                stop = True
                if done < steps:
                    save_checkpoint(epoch, step=done)
                    return None
                break
    seconds = time.perf_counter() - timer.start
    images, first_images = hvd.allreduce(torch.tensor([images, first_images]), op=hvd.Sum, name="images").tolist()
    return {"train_loss": train_loss.avg.item(), "train_accuracy": train_accuracy.avg.item(),
            "epoch_s": seconds, "images": int(images),
            "ranks": hvd.allgather_object(timer.seconds, name="step_split"),
            # the epoch's first step apart: the rest is the rate of an epoch long enough to hide worker start-up
            "first_step_s": timer.first_s, "first_step_images": int(first_images),
            "ranks_first_step": hvd.allgather_object(timer.first, name="first_step_split")}


def validate(epoch):
    model.eval()
    val_loss, val_accuracy = Metric("val_loss"), Metric("val_accuracy")
    with progress_bar(len(val_loader), f"Validate Epoch  #{epoch + 1}", show=verbose) as t:
        with torch.no_grad():
            for data, target in val_loader:
                if args.cuda:
                    data, target = data.cuda(non_blocking=True), target.cuda(non_blocking=True)
                output = model(data)
                val_loss.update(F.cross_entropy(output, target), len(output))
                val_accuracy.update(accuracy(output, target), len(output))
                t.set_postfix({"loss": val_loss.avg.item(), "accuracy": 100. * val_accuracy.avg.item()}, refresh=False)
                t.update(1)
    return {"val_loss": val_loss.avg.item(), "val_accuracy": val_accuracy.avg.item()}


def earlier_epochs(resume_from_epoch):
    """Rank 0: the epochs a resumed job's metrics.json already holds (before the one it resumes in)."""
    path = os.path.join(args.log_dir, "metrics.json") if args.log_dir else None
    if hvd.rank() != 0 or not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [e for e in json.load(f)["epochs"] if e["epoch"] < resume_from_epoch]


def log_epoch(record):
    """Rank 0 prints the epoch and rewrites metrics.json (atomically) with every epoch so far."""
    if not verbose:
        return
    record["images_per_s"] = record["images"] / record["epoch_s"]
    history.append(record)
    split = {part: sum(r[part] for r in record["ranks"]) / len(record["ranks"]) for part in StepTimer.PARTS}
    total = sum(split.values())
    print(f"epoch {record['epoch'] + 1}: train loss {record['train_loss']:.4f} acc {record['train_accuracy']:.4f}  "
          f"val loss {record['val_loss']:.4f} acc {record['val_accuracy']:.4f}  {record['images_per_s']:.1f} img/s  "
          + "  ".join(f"{part} {100 * s / total:.0f}%" for part, s in split.items()), flush=True)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        path = os.path.join(args.log_dir, "metrics.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"args": vars(args), "size": hvd.size(), "data_open_s": data_open_s, "epochs": history}, f,
                      indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    args = parser.parse_args()
    if args.checkpoint_format.format(epoch=1) == args.checkpoint_format.format(epoch=2):
        parser.error(f"--checkpoint-format {args.checkpoint_format!r} names every epoch's checkpoint alike; "
                     "it needs {epoch}")
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    allreduce_batch_size = args.batch_size * args.batches_per_allreduce

    hvd.init()
    torch.manual_seed(args.seed)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)
    resume_from_epoch, partial = find_resume_point()
    verbose = hvd.rank() == 0
    history, steps_run, stop = earlier_epochs(resume_from_epoch), 0, False
    torch.set_num_threads(args.threads)

    kwargs = {"num_workers": args.workers, "pin_memory": args.cuda,
              "persistent_workers": args.persistent_workers and args.workers > 0}
    # forkserver, not fork, for the workers: some InfiniBand stacks are not fork-safe (as Horovod's example).
    if args.workers > 0 and "forkserver" in mp.get_all_start_methods():
        kwargs["multiprocessing_context"] = "forkserver"
    Loader = DataLoader
    if args.loader == "threaded":
        Loader, kwargs = ThreadedLoader, {"num_threads": max(1, args.workers)}
    train_transform = TrainTransform(args.image_size, scale=(args.crop_scale, 1.0), flip=args.flip, seed=args.seed)
    val_transform = EvalTransform(args.image_size, resize=round(args.image_size * 8 / 7))

    opened = time.perf_counter()
    if args.data == "folder":
        train_dataset = ImageFolder(args.train_dir, transform=train_transform)
        train_sampler = DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
        val_dataset = ImageFolder(args.val_dir, transform=val_transform)
        val_sampler = DistributedSampler(val_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    else:
        train_dataset = InMemoryImageFolder(args.train_dir, transform=train_transform)
        train_sampler = InMemoryDistributedSampler(train_dataset, shuffle_mode=args.shuffle, seed=args.seed)
        val_dataset = InMemoryImageFolder(args.val_dir, transform=val_transform)
        val_sampler = InMemoryDistributedSampler(val_dataset, shuffle=False)
    if kwargs.get("multiprocessing_context") == "forkserver":
        # The server imports the workers' modules once, so each epoch's new workers start in a fraction of
        # a second instead of importing torch again (docs/e2e.md, "The epoch's first step").
        mp.set_forkserver_preload(["torch"] + sorted({type(o).__module__ for o in (
            train_dataset, val_dataset, train_transform, val_transform)}))
    if list(val_dataset.classes) != list(train_dataset.classes):   # labels would mean other classes
        raise SystemExit(f"the validation set's classes ({len(val_dataset.classes)}, from {args.val_dir}) are not "
                         f"the training set's ({len(train_dataset.classes)}, from {args.train_dir})")
    data_open_s = hvd.allgather_object(time.perf_counter() - opened, name="data_open")   # per rank: scan or load
    if not hasattr(train_sampler, "state_dict"):     # a stock sampler keeps no position within an epoch
        train_sampler = ResumableSampler(train_sampler)
    train_loader = Loader(train_dataset, batch_size=allreduce_batch_size, sampler=train_sampler, **kwargs)
    val_loader = Loader(val_dataset, batch_size=args.val_batch_size, sampler=val_sampler, **kwargs)

    model = build_model(args.arch, num_classes=len(train_dataset.classes))
    # Adasum needs no scaling of the learning rate; sum and average scale it by the number of batches.
    lr_scaler = args.batches_per_allreduce * hvd.size() if not args.use_adasum else 1
    if args.cuda:
        model.cuda()
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = args.batches_per_allreduce * hvd.local_size()
    optimizer = optim.SGD(model.parameters(), lr=args.base_lr * lr_scaler, momentum=args.momentum,
                          weight_decay=args.wd)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    if args.local_gradients:     # the step a free allreduce would give; metrics still synchronise the ranks
        optimizer.synchronize, optimizer.skip_synchronize = (lambda: None), contextlib.nullcontext
    else:
        optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression,
            backward_passes_per_step=args.batches_per_allreduce, op=hvd.Adasum if args.use_adasum else hvd.Average,
            gradient_predivide_factor=args.gradient_predivide_factor)

    first_step = 0
    if hvd.rank() == 0 and (resume_from_epoch > 0 or partial):
        checkpoint = torch.load(partial or checkpoint_path(resume_from_epoch))
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    if partial:   # every rank resumes the sampler where rank 0's checkpoint left it
        sampler_state, first_step, saved = hvd.broadcast_object(
            (checkpoint["sampler"], checkpoint["step"], checkpoint.get("resume")) if hvd.rank() == 0 else None,
            root_rank=0, name="sampler")
        now = {"data": args.data, "allreduce_batch_size": allreduce_batch_size, "size": hvd.size()}
        if saved != now:   # the step and the sampler's position would not mean the same samples
            raise SystemExit(f"cannot resume {partial} within its epoch: it was saved with {saved}, this job has "
                             f"{now}; rerun with the saved settings, or remove it to resume from the epoch's start")
        train_sampler.load_state_dict(sampler_state)
    # Optimizer state first: a rank without the checkpoint's state takes a zero-gradient step to create
    # it, which with weight decay moves its parameters; the parameters' broadcast then undoes that.
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    for epoch in range(resume_from_epoch, args.epochs):
        record = train(epoch, first_step if epoch == resume_from_epoch else 0)
        if record is None:    # stopped on purpose
            break
        record.update(validate(epoch), epoch=epoch)
        if epoch == resume_from_epoch and first_step:
            record["resumed_at_step"] = first_step     # its train metrics cover the steps from there on
        save_checkpoint(epoch)
        log_epoch(record)
        if stop:
            break
