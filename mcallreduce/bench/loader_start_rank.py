"""One rank of ``python -m mcallreduce.bench loader-start``: the seconds from ``iter(DataLoader)`` to
its first batch, epoch after epoch, with each epoch read to its end as training reads it.

    python -m mcallreduce.bench.loader_start_rank none|preload|persistent STORE OUT.json [options]

``none``: forkserver workers that import torch and the data package again every epoch; ``preload``:
the server imports them once (``multiprocessing.set_forkserver_preload``, as the ImageNet example
does); ``persistent``: the preload and ``persistent_workers=True``, so workers start once.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from typing import List, Optional, Sequence

from .output import write_json

ARMS = ("none", "preload", "persistent")


def first_batch_seconds(loader, dataset, epochs: int) -> List[float]:
    """Per epoch: seconds from a new iterator to its first batch; then the rest of the epoch, untimed."""
    seconds = []
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        t0 = time.perf_counter()
        batches = iter(loader)
        next(batches)
        seconds.append(time.perf_counter() - t0)
        for _ in batches:
            pass
    return seconds


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcallreduce.bench.loader_start_rank", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("arm", choices=ARMS)
    parser.add_argument("store", help="a packed store (python -m mcallreduce.data pack)")
    parser.add_argument("out", help="this rank's seconds, as JSON (RANK in the name becomes the rank)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=64)
    ns = parser.parse_args(argv)
    # the data package's modules, imported only now: the "none" arm's server must not inherit them
    from torch.utils.data import DataLoader
    from ..data import InMemoryImageFolder, TrainTransform
    from ..data.world import mpi
    transform = TrainTransform(ns.image_size, seed=1)
    dataset = InMemoryImageFolder(ns.store, transform=transform, partition="full")
    if ns.arm != "none":
        mp.set_forkserver_preload(["torch", type(dataset).__module__, type(transform).__module__])
    loader = DataLoader(dataset, batch_size=ns.batch_size, num_workers=ns.workers, shuffle=True,
                        multiprocessing_context="forkserver", persistent_workers=ns.arm == "persistent")
    seconds = first_batch_seconds(loader, dataset, ns.epochs)
    MPI = mpi()
    out = ns.out.replace("RANK", str(MPI.COMM_WORLD.Get_rank() if MPI else 0))
    write_json(out, {"arm": ns.arm, "host": os.uname().nodename, "seconds": seconds}, indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
