"""Run the examples as MPI jobs (this host or the emulated cluster); read what the ImageNet one writes."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

from .. import launch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pytorch_imagenet_resnet50.py"


def run(argv: Sequence[str], env: Mapping[str, str], np: Optional[int] = None, cluster=None,
        timeout: float = 1800.0) -> None:
    """``argv`` on ``np`` ranks of this host, or on ``cluster`` (a bench.cluster.Cluster); exits on failure."""
    result = cluster.run(argv, env=env, timeout=timeout) if cluster is not None else \
        launch.run(np, argv, env=env, timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(f"failed ({result.returncode}): {' '.join(argv)}\n"
                         f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")


def train(args: Sequence[str], out: str, env: Mapping[str, str], np: Optional[int] = None,
          cluster=None, timeout: float = 1800.0) -> dict:
    """The ImageNet example with ``args`` (its log and checkpoints under ``out``); its metrics.json."""
    argv = [sys.executable, str(EXAMPLE), *map(str, args), "--log-dir", out,
            "--checkpoint-format", os.path.join(out, "checkpoint-{epoch}.pt")]
    run(argv, {"MCALLREDUCE_DATA_PROGRESS": "0", **env}, np, cluster, timeout)
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)
