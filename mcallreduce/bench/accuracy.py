"""``python -m mcallreduce.bench accuracy``: does the in-memory store or the plugin cost accuracy?

Trains a small CNN on scikit-learn's handwritten digits (real labelled images, written as
JPEGs by ``python -m mcallreduce.data make-digits``) with examples/pytorch_imagenet_resnet50.py,
on ``-np`` ranks of this host, each rank its own emulated host (MCALLREDUCE_RANKS_PER_HOST=1),
so the store is split and the shuffle modes differ. Arms: ``folder`` (ImageFolder +
DistributedSampler) and ``memory-local``, ``memory-partial``, ``memory-global``, each with
stock Horovod and with the plugin, for every seed. Prints the final top-1 mean +- sd per arm,
and how far each plugin run's loss curve is from the same arm and seed without it.

    python -m mcallreduce.bench accuracy --tree /var/tmp/digits --seeds 0,1,2 \\
        --json docs/data/accuracy-digits.json --plot docs/img/accuracy-digits.png
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Dict, List, Optional, Sequence

from . import example, output
from .output import subcommand_command, write_json
from .provenance import provenance, utc_now

DATA = {"folder": ["--data", "folder"], "memory-local": ["--data", "memory", "--shuffle", "local"],
        "memory-partial": ["--data", "memory", "--shuffle", "partial"],
        "memory-global": ["--data", "memory", "--shuffle", "global"]}
HOROVOD = {"stock": {"MCALLREDUCE_HOROVOD": "0"}, "plugin": {"MCALLREDUCE_ALGORITHM": "multicolor"}}
# Digits: no flips (a mirrored 2 is no 2), crops that keep half the digit, the learning rate cut twice.
DEFAULT_ARGS = ["--arch", "small_cnn", "--image-size", "32", "--batch-size", "32", "--epochs", "12",
                "--warmup-epochs", "2", "--base-lr", "0.025", "--lr-decay-epochs", "8,11", "--crop-scale", "0.5",
                "--flip", "0", "--workers", "0", "--threads", "1"]


def table(rows: List[dict]) -> str:
    lines = ["| data | Horovod | top-1 per seed | top-1 mean +- sd | vs folder/stock (pp) | loss curve vs stock, max rel. diff |",
             "|---|---|---|---:|---:|---:|"]
    final = {}
    for row in rows:
        final.setdefault((row["data"], row["horovod"]), []).append(row["val_accuracy"][-1])
    base = statistics.mean(final[("folder", "stock")]) if ("folder", "stock") in final else None
    for (data, horovod), accs in final.items():
        mean, sd = statistics.mean(accs), statistics.stdev(accs) if len(accs) > 1 else 0.0
        delta = f"{100 * (mean - base):+.2f}" if base is not None else "-"
        drift = "-"
        if horovod == "plugin":
            diffs = [curve_difference(r, rows) for r in rows if (r["data"], r["horovod"]) == (data, "plugin")]
            diffs = [d for d in diffs if d is not None]
            drift = f"{max(diffs):.1e}" if diffs else "-"
        lines.append(f"| {data} | {horovod} | " + ", ".join(f"{100 * a:.2f}" for a in accs)
                     + f" | {100 * mean:.2f} +- {100 * sd:.2f} | {delta} | {drift} |")
    return "\n".join(lines)


def curve_difference(row: dict, rows: List[dict]) -> Optional[float]:
    """Largest relative difference between ``row``'s training-loss curve and its stock twin's."""
    twin = [r for r in rows if (r["data"], r["seed"], r["horovod"]) == (row["data"], row["seed"], "stock")]
    if not twin:
        return None
    return max(abs(a - b) / abs(b) for a, b in zip(row["train_loss"], twin[0]["train_loss"]))


def plot(rows: List[dict], path: str) -> None:
    plt = output.pyplot()
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    arms = list(dict.fromkeys((r["data"], r["horovod"]) for r in rows))
    for data, horovod in arms:
        runs = [r for r in rows if (r["data"], r["horovod"]) == (data, horovod)]
        epochs = range(1, len(runs[0]["train_loss"]) + 1)
        style = "-" if horovod == "stock" else "--"
        loss_ax.plot(epochs, [statistics.mean(v) for v in zip(*(r["train_loss"] for r in runs))], style,
                     label=f"{data}, {horovod}")
        acc_ax.plot(epochs, [100 * statistics.mean(v) for v in zip(*(r["val_accuracy"] for r in runs))], style,
                    label=f"{data}, {horovod}")
    loss_ax.set(xlabel="epoch", ylabel="training loss (mean over seeds)", yscale="log")
    acc_ax.set(xlabel="epoch", ylabel="validation top-1 % (mean over seeds)")
    acc_ax.legend(fontsize=7)
    output.save_png(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcallreduce.bench accuracy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", required=True, help="holds train/ and val/ (made by make-digits if absent)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--data", default=",".join(DATA), help=f"comma-separated, of {', '.join(DATA)}")
    parser.add_argument("-np", "--np", type=int, default=4, help="ranks, each an emulated host")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--json", help="write the runs and the table here")
    parser.add_argument("--plot", help="write a PNG of the loss and accuracy curves here")
    parser.add_argument("example_args", nargs=argparse.REMAINDER,
                        help=f"-- then the example's arguments (default: {' '.join(DEFAULT_ARGS)})")
    ns = parser.parse_args(argv)
    example_args = [a for a in ns.example_args if a != "--"] or DEFAULT_ARGS
    datas = [d for d in ns.data.split(",") if d]
    if set(datas) - set(DATA):
        parser.error(f"unknown --data {sorted(set(datas) - set(DATA))}; choose from {', '.join(DATA)}")
    tree = os.path.abspath(ns.tree)
    if not os.path.isdir(os.path.join(tree, "train")):
        from ..data.photos import make_digits_folder
        print(make_digits_folder(tree), flush=True)
    started = utc_now()
    rows: List[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in [int(s) for s in ns.seeds.split(",")]:
            for i, data in enumerate(datas):
                # stock and plugin alternate which goes first
                for horovod in (("stock", "plugin") if (seed + i) % 2 == 0 else ("plugin", "stock")):
                    out = os.path.join(tmp, f"{data}-{horovod}-{seed}")
                    env: Dict[str, str] = {"MCALLREDUCE_RANKS_PER_HOST": "1", **HOROVOD[horovod]}
                    metrics = example.train([*DATA[data], "--train-dir", os.path.join(tree, "train"),
                                             "--val-dir", os.path.join(tree, "val"), "--seed", seed,
                                             *example_args], out, env, np=ns.np, timeout=ns.timeout)
                    epochs = metrics["epochs"]
                    rows.append({"data": data, "horovod": horovod, "seed": seed,
                                 "train_loss": [e["train_loss"] for e in epochs],
                                 "val_loss": [e["val_loss"] for e in epochs],
                                 "val_accuracy": [e["val_accuracy"] for e in epochs]})
                    print(f"seed {seed} {data} {horovod}: top-1 {100 * epochs[-1]['val_accuracy']:.2f}%", flush=True)
    rows.sort(key=lambda r: (list(DATA).index(r["data"]), r["horovod"] != "stock", r["seed"]))
    text = table(rows)
    print(text)
    if ns.json:
        write_json(ns.json, {"argv": subcommand_command("accuracy", argv), **provenance(started),
                             "np": ns.np, "example_args": example_args, "runs": rows, "table": text})
    if ns.plot:
        plot(rows, ns.plot)
    return 0
