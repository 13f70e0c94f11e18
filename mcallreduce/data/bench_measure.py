"""The measurement arms of ``python -m mcallreduce.data bench``: loading throughput of each source,
decode throughput on one core, and resident memory per rank under mpirun."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import List, Optional

import numpy as np

from ..bench.output import write_json
from .throttle import drop_page_cache


class NoDecode:
    """Transform that only counts bytes: isolates where the bytes come from."""
    takes_encoded = True

    def __call__(self, data):
        import torch
        return torch.tensor(len(data))


def time_epochs(dataset, args, epochs: int, before_epoch=None, first_epoch: int = 0) -> dict:
    from .loader import ThreadedLoader
    from .sampler import InMemoryDistributedSampler
    sampler = InMemoryDistributedSampler(dataset, num_replicas=1, rank=0, seed=0)
    loader = ThreadedLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_threads=args.threads)
    times = []
    for epoch in range(first_epoch, first_epoch + epochs):
        sampler.set_epoch(epoch)
        if before_epoch:
            before_epoch()
        start = time.perf_counter()
        count = 0
        for images, labels in loader:
            count += len(labels)
        times.append(time.perf_counter() - start)
    loader.close()
    return summarise(count, times)


def summarise(count: int, times: List[float]) -> dict:
    median = float(np.median(times))
    return {"images": count, "epoch_s": median, "epoch_times_s": times, "images_per_s": count / median}


def round_robin(paths: dict, args, epochs: int) -> dict:
    """One epoch of each path in turn, ``epochs`` times: load from other users of the
    machine then hits every path alike. Each path reports its median epoch."""
    times = {name: [] for name in paths}
    count = {}
    for epoch in range(epochs):
        for name, (dataset, before) in paths.items():
            one = time_epochs(dataset, args, 1, before_epoch=before, first_epoch=epoch)
            times[name] += one["epoch_times_s"]
            count[name] = one["images"]
    return {name: summarise(count[name], times[name]) for name in paths}


def source_paths(folder, memory, throttle, limits) -> dict:
    """name -> (dataset, hook before each epoch): the three sources, plus one cold path per read limit.
    Every hook sets the read limit of its own path (none but the limited ones)."""
    def hook(limit=None, evict=False):
        def before():
            if throttle is not None:
                throttle.set(limit)
            if evict:
                drop_page_cache(path for path, _ in folder.samples)
        return before
    paths = {"folder_cold": (folder, hook(evict=True)), "folder_warm": (folder, hook()), "memory": (memory, hook())}
    for limit in limits:
        paths[f"folder_cold_{limit.key}"] = (folder, hook(limit, evict=True))
    return paths


def decode_per_core(store, decoder: str, limit: int = 400, rounds: int = 3, chunk: int = 25,
                    batch_size: int = 64) -> dict:
    """One thread, bytes in memory: the decoder alone on full images vs decode + RRC-224 (+ normalise).

    Every case runs on the same ``limit`` JPEGs, round robin in chunks of ``chunk``
    images, ``rounds`` times over, so load from other users of the machine hits
    every case alike; the ratios are of total times. Cases:

      simplejpeg_full_decode / pil_full_decode   the decoder library alone, full size, RGB
                         (simplejpeg's is the reference: "the decoder library alone")
      turbo_full_decode  our extension (mcallreduce/data/jpeg.py) decoding the whole image: the
                         same libjpeg-turbo code path as the crop decode, to tell the gain of
                         decoding the box only from differences between libjpeg-turbo builds
      rrc_<resizer>      TrainTransform(normalize=False): reduced decode + RRC-224 + flip, uint8 CHW
                         (the headline "decode + random-resized-crop to 224 px"), for each resizer
      rrc_simplejpeg     the same with the whole-image simplejpeg decode (the previous default),
                         default resizer; only when the default decoder is another one
      train_transform    TrainTransform() as constructed by default: + per-image float normalise
      batch_normalize    normalize.Normalize (CPU: one numpy pass) on uint8 batches of ``batch_size``,
                         per image; rrc + batch Normalize = the full pipeline with normalisation
    """
    import io
    import simplejpeg
    import torch
    from PIL import Image
    from . import jpeg
    from .normalize import Normalize
    from .resize import available_resizers, resizer_name
    from .transforms import TrainTransform
    blobs = [bytes(store.sample_bytes(i)) for i in range(min(limit, len(store)))]
    jpegs = [b for b in blobs if b[:2] == b"\xff\xd8"]
    default = TrainTransform(decoder=decoder, seed=0)
    resizers = available_resizers()
    cases = {"simplejpeg_full_decode": lambda b: simplejpeg.decode_jpeg(b, colorspace="RGB"),
             "pil_full_decode": lambda b: Image.open(io.BytesIO(b)).convert("RGB"),
             "train_transform": default}
    if jpeg.available:
        cases["turbo_full_decode"] = jpeg.decode
    for r in resizers:
        cases[f"rrc_{r}"] = TrainTransform(decoder=decoder, seed=0, normalize=False, resizer=r)
    if default.decoder != "simplejpeg":
        cases["rrc_simplejpeg"] = TrainTransform(decoder="simplejpeg", seed=0, normalize=False)
    normalize = Normalize()
    batch = torch.randint(0, 256, (batch_size, 3, 224, 224), dtype=torch.uint8)
    for f in cases.values():
        f(jpegs[0])
    normalize(batch)
    total = {name: 0.0 for name in cases}
    total["batch_normalize"] = 0.0
    for _ in range(rounds):
        for i in range(0, len(jpegs), chunk):
            part = jpegs[i:i + chunk]
            for name, f in cases.items():
                start = time.perf_counter()
                for b in part:
                    f(b)
                total[name] += time.perf_counter() - start
            start = time.perf_counter()
            normalize(batch)     # one batch, charged per image of this chunk
            total["batch_normalize"] += (time.perf_counter() - start) * len(part) / batch_size
    n = rounds * len(jpegs)
    results = {"images": len(jpegs), "rounds": rounds, "decoder": default.decoder,
               "resizer": default.resizer, "resizers": resizers, "batch_size": batch_size}
    results.update({name: n / t for name, t in total.items()})
    reference = "simplejpeg_full_decode" if default.decoder != "pil" else "pil_full_decode"
    results["reference"] = reference
    results["rrc_batch_normalize"] = n / (total[f"rrc_{default.resizer}"] + total["batch_normalize"])
    for name in [f"rrc_{r}" for r in resizers] + ["train_transform", "rrc_batch_normalize"]:
        results[f"ratio_{name}"] = results[name] / results[reference]
    # The headline figure: decode + RRC-224 (+ flip), the default resizer, uint8 out.
    results["ratio_to_decoder_alone"] = results[f"ratio_rrc_{default.resizer}"]
    if "rrc_simplejpeg" in results:
        results["ratio_rrc_simplejpeg"] = results["rrc_simplejpeg"] / results[reference]
    if "turbo_full_decode" in results:   # against the extension's own full decode: same libjpeg build
        results["ratio_to_own_full_decode"] = results[f"rrc_{default.resizer}"] / results["turbo_full_decode"]
    results["libjpeg_turbo_version"] = jpeg.libjpeg_turbo_version
    results["train_transform_resizer"] = resizer_name(None)
    return results


def memory_of_process(segment_address: Optional[int] = None) -> dict:
    """RSS and PSS of this process, and the PSS of the mapping containing ``segment_address``."""
    out = {"rss": 0, "pss": 0, "segment_pss": 0, "segment_rss": 0}
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = segment_address is not None and lo <= segment_address < hi
            elif head[0] in ("Rss:", "Pss:"):
                value = int(head[1]) * 1024
                out[head[0][:-1].lower()] += value
                if inside:
                    out["segment_" + head[0][:-1].lower()] += value
    return out


def memory_worker(args) -> int:
    """One rank of the memory run (under mpirun): open the store, read a full epoch share, report memory."""
    from mpi4py import MPI
    from .dataset import InMemoryImageFolder
    from .loader import ThreadedLoader
    from .sampler import InMemoryDistributedSampler
    from .transforms import TrainTransform
    comm = MPI.COMM_WORLD
    before = memory_of_process()
    start = time.perf_counter()
    dataset = InMemoryImageFolder(args.store, TrainTransform(decoder=args.decoder))
    load_s = time.perf_counter() - start
    sampler = InMemoryDistributedSampler(dataset)
    loader = ThreadedLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_threads=args.threads)
    start = time.perf_counter()
    count = sum(len(labels) for _, labels in loader)
    epoch_s = time.perf_counter() - start
    store = dataset.store
    comm.Barrier()   # measure together: PSS splits a page only among the ranks that touched it so far
    after = memory_of_process(store.segment.array.ctypes.data if store.segment.size else None)
    mine = {"rank": comm.rank, "host": store.layout.host, "images": count, "epoch_s": epoch_s, "load_s": load_s,
            "rss_before": before["rss"], "pss_before": before["pss"], **after,
            "share_bytes": int(store.blob_bytes), "segment_bytes": int(store.segment.size)}
    everyone = comm.gather(mine, root=0)
    if comm.rank == 0:
        write_json(os.path.join(args.out, f"memory-np{comm.size}.json"), everyone, indent=None)
    return 0


def run_memory(args, store_path: str, ranks: List[int]) -> List[dict]:
    from mcallreduce.launch import run
    rows = []
    for np_ in ranks:
        cmd = [sys.executable, "-m", "mcallreduce.data", "bench", "--memory-worker", "--store", store_path,
               "--out", args.out, "--threads", str(args.threads), "--batch-size", str(args.batch_size)]
        if args.decoder:
            cmd += ["--decoder", args.decoder]
        result = run(np_, cmd, timeout=600, env={"MCALLREDUCE_DATA_PROGRESS": "0"})
        if result.returncode != 0:
            raise RuntimeError(f"memory run with {np_} ranks failed:\n{result.stderr[-3000:]}")
        with open(os.path.join(args.out, f"memory-np{np_}.json")) as f:
            per_rank = json.load(f)
        host_segment = sum(r["segment_pss"] for r in per_rank)
        rows.append({"ranks": np_, "per_rank": per_rank,
                     "share_bytes": per_rank[0]["share_bytes"],
                     "host_store_resident": host_segment,
                     "host_store_ratio": host_segment / per_rank[0]["share_bytes"],
                     "host_pss_total": sum(r["pss"] for r in per_rank),
                     "rank_rss_mean": float(np.mean([r["rss"] for r in per_rank])),
                     "rank_pss_mean": float(np.mean([r["pss"] for r in per_rank])),
                     "images_per_s_host": sum(r["images"] for r in per_rank) / max(r["epoch_s"] for r in per_rank)})
    return rows
