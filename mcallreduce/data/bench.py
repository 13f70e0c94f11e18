"""``python -m mcallreduce.data bench``: in-memory store vs ImageFolder-style reading from disk.

All three paths run the same sampler, the same ThreadedLoader (same threads,
same batch size) and the same TrainTransform; only where the bytes come from
differs:

  folder-cold  one file read per sample, page cache of those files evicted
               (posix_fadvise DONTNEED) before each epoch
  folder-warm  the same with the files in the page cache (after a warm-up epoch)
  memory       the in-memory store (one shared segment per host)
  folder-cold-<limit>  (``--cold-read-limits``) folder-cold with the disk's reads limited to a
               rate or IOPS by a blkio cgroup (:mod:`.throttle`): storage slower than decoding,
               as a shared file system's per-node share or a spinning disk is

It also measures decode throughput per core (TrainTransform vs the decoder
alone on full images) and, under mpirun with 1, 2 and 4 ranks on this host,
the resident memory per rank and per host. Results: a table on stdout and in
``--out``/bench.md, JSON, and a PNG plot.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import List, Optional

import numpy as np

from ..bench.output import pyplot, save_png, write_json, write_text
from .throttle import ReadThrottle, drop_page_cache, parse_read_limits

HERE = os.path.dirname(os.path.abspath(__file__))


def add_arguments(p) -> None:
    p.add_argument("--root", help="ImageFolder tree to use (default: generate photographs under --out)")
    p.add_argument("--out", default="bench-results/data", help="folder for data, table, JSON and plot")
    p.add_argument("--images", type=int, default=1200, help="images to generate when --root is not given")
    p.add_argument("--threads", type=int, default=2, help="decode threads (same for every path)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per path")
    p.add_argument("--ranks", default="1,2,4", help="local rank counts for the memory runs ('' skips them)")
    p.add_argument("--decoder", default=None, help="turbo, simplejpeg or pil (default: MCALLREDUCE_DATA_DECODER)")
    p.add_argument("--cold-read-limits", default="",
                   help="extra cold-cache paths with the disk's reads limited by the kernel (root; blkio cgroup), "
                        "comma-separated: bytes/s (25M = 25 MiB/s), IOPS (200iops) or both (25M+200iops)")
    p.add_argument("--decode-only", action="store_true",
                   help="only the one-core decode table (decode + RRC-224 vs the decoder alone)")
    p.add_argument("--memory-worker", action="store_true", help=argparse_hidden())
    p.add_argument("--store", help=argparse_hidden())


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


# --- memory accounting ------------------------------------------------------------------
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
                         (the issue's "decode + random-resized-crop to 224 px"), for each resizer
      rrc_simplejpeg     the same with the whole-image simplejpeg decode (the previous default),
                         default resizer; only when the default decoder is another one
      train_transform    TrainTransform() as constructed by default: + per-image float normalise
      batch_normalize    transforms.Normalize (CPU: one numpy pass) on uint8 batches of ``batch_size``,
                         per image; rrc + batch Normalize = the full pipeline with normalisation
    """
    import io
    import simplejpeg
    import torch
    from PIL import Image
    from . import jpeg
    from .transforms import Normalize, TrainTransform, _cv2, _torch_resize_op, resizer_name
    blobs = [bytes(store.sample_bytes(i)) for i in range(min(limit, len(store)))]
    jpegs = [b for b in blobs if b[:2] == b"\xff\xd8"]
    default = TrainTransform(decoder=decoder, seed=0)
    resizers = [r for r in ("torch", "pil", "cv2")
                if r == "pil" or (r == "torch" and _torch_resize_op() is not None) or (r == "cv2" and _cv2())]
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
    # The figure: decode + RRC-224 (+ flip), the default resizer, uint8 out.
    results["ratio_to_decoder_alone"] = results[f"ratio_rrc_{default.resizer}"]
    if "rrc_simplejpeg" in results:
        results["ratio_rrc_simplejpeg"] = results["rrc_simplejpeg"] / results[reference]
    if "turbo_full_decode" in results:   # against the extension's own full decode: same libjpeg build
        results["ratio_to_own_full_decode"] = results[f"rrc_{default.resizer}"] / results["turbo_full_decode"]
    results["libjpeg_turbo_version"] = jpeg.libjpeg_turbo_version
    results["train_transform_resizer"] = resizer_name(None)
    return results


def format_decode_table(d: dict) -> List[str]:
    ref = d[d["reference"]]
    notes = {"torch": "torch uint8 antialiased bilinear (default)", "pil": "Pillow antialiased bilinear",
             "cv2": "OpenCV INTER_LINEAR, not antialiased (opt-in)"}
    lines = [f"One thread, the first {d['images']} JPEGs of the store held in memory, every case round robin "
             f"in chunks of 25 images, {d['rounds']} rounds; ratios of total times.", "",
             "| one core, bytes in memory | images/s | / decoder alone |", "|---|---:|---:|",
             f"| simplejpeg full decode (RGB) | {d['simplejpeg_full_decode']:.0f} | "
             f"{d['simplejpeg_full_decode'] / ref:.2f} |",
             f"| Pillow full decode (RGB) | {d['pil_full_decode']:.0f} | {d['pil_full_decode'] / ref:.2f} |"]
    if "turbo_full_decode" in d:
        lines.append(f"| turbo full decode (RGB; our extension, system libjpeg-turbo "
                     f"{d.get('libjpeg_turbo_version')}) | {d['turbo_full_decode']:.0f} | "
                     f"{d['turbo_full_decode'] / ref:.2f} |")
    for r in d["resizers"]:
        bold = "**" if r == d["resizer"] else ""
        lines.append(f"| decode ({d['decoder']}) + RRC-224 + flip, uint8 out; resize: {notes.get(r, r)} | "
                     f"{d['rrc_' + r]:.0f} | {bold}{d['ratio_rrc_' + r]:.2f}{bold} |")
    if "rrc_simplejpeg" in d:
        lines.append(f"| decode (simplejpeg, whole image) + RRC-224 + flip, uint8 out; resize: {d['resizer']} | "
                     f"{d['rrc_simplejpeg']:.0f} | {d['ratio_rrc_simplejpeg']:.2f} |")
    lines += [f"| the same ({d['resizer']}) + batch Normalize to float32 ({d['batch_size']} per batch, "
              f"numpy on the CPU) | {d['rrc_batch_normalize']:.0f} | {d['ratio_rrc_batch_normalize']:.2f} |",
              f"| TrainTransform() default: + per-image normalise to float32 | {d['train_transform']:.0f} | "
              f"{d['ratio_train_transform']:.2f} |",
              "", f"Decode + RRC-224 ({d['decoder']}, resize {d['resizer']}) / decoder alone: "
                  f"**{d['ratio_to_decoder_alone']:.2f}x**; with normalisation per batch "
                  f"{d['ratio_rrc_batch_normalize']:.2f}x, per image {d['ratio_train_transform']:.2f}x."]
    if "ratio_to_own_full_decode" in d:
        lines[-1] += (f" Against the extension's own full decode (same libjpeg-turbo build): "
                      f"{d['ratio_to_own_full_decode']:.2f}x.")
    return lines


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


def prepare_data(args) -> str:
    root = args.root
    if root is None:
        from .photos import make_photo_folder
        root = os.path.join(args.out, "train")
        if not os.path.isdir(root):
            print(f"generating {args.images} photographs in {root}", file=sys.stderr)
            make_photo_folder(root, per_class=max(1, args.images // 10), long_side=(375, 640),
                              quality=(90, 97), seed=0)
            os.sync()   # clean pages, so DONTNEED can evict them
    return root


def run(args) -> int:
    if args.memory_worker:
        return memory_worker(args)
    os.makedirs(args.out, exist_ok=True)
    from .format import pack
    from .store import ImageStore
    from .transforms import TrainTransform
    command = "python -m mcallreduce.data bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
    root = prepare_data(args)
    store_path = os.path.join(args.out, "train.mcstore")
    transform = TrainTransform(decoder=args.decoder)
    if args.decode_only:
        if not os.path.exists(store_path):   # reuse the store of an earlier run
            pack(root, store_path, workers=os.cpu_count(), progress=False)
        store = ImageStore.open(store_path, num_replicas=1, rank=0, progress=False)
        d = decode_per_core(store, transform.decoder)
        store.close()
        table = "\n".join([f"`{command}`", ""] + format_decode_table(d))
        print(table)
        write_json(os.path.join(args.out, "decode.json"),
                   {"command": command, "cpus": os.cpu_count(), "decode_per_core": d})
        print(f"wrote {args.out}/decode.json", file=sys.stderr)
        return 0
    limits = parse_read_limits(args.cold_read_limits)
    # made here, so it fails before any work where reads cannot be limited; entered below
    throttle = ReadThrottle(root) if limits else None
    start = time.perf_counter()
    report = pack(root, store_path, workers=os.cpu_count(), progress=False)
    pack_s = time.perf_counter() - start
    os.sync()
    results = {"command": command, "threads": args.threads, "batch_size": args.batch_size,
               "images": report.num_samples, "bytes": report.blob_bytes, "mean_image_bytes":
               report.blob_bytes / report.num_samples, "pack_s": pack_s, "decoder": transform.decoder,
               "cpus": os.cpu_count()}
    from .dataset import InMemoryImageFolder
    start = time.perf_counter()
    store = ImageStore.open(store_path, num_replicas=1, rank=0, progress=False)
    results["memory_load_s"] = time.perf_counter() - start
    from .folder import ImageFolder
    folder = ImageFolder(root, transform)
    time_epochs(folder, args, 1)   # warm-up (imports, thread pool, page cache)
    memory = InMemoryImageFolder(store, transform)
    raw, raw_memory = ImageFolder(root, NoDecode()), InMemoryImageFolder(store, NoDecode())
    with throttle or contextlib.nullcontext():
        results.update(round_robin(source_paths(folder, memory, throttle, limits), args, args.epochs))
        # The same sources without decoding: what the storage alone delivers.
        results["read_only"] = round_robin(source_paths(raw, raw_memory, throttle, limits), args, 3)
    if limits:
        results["read_limits"] = [{"key": x.key, "label": x.label, "bps": x.bps, "iops": x.iops} for x in limits]
        results["read_limit_device"] = throttle.device
    results["decode_per_core"] = decode_per_core(store, transform.decoder)
    store.close()
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    results["memory_runs"] = run_memory(args, store_path, ranks) if ranks else []
    mem = results["memory"]["images_per_s"]
    results["ratio_memory_vs_cold"] = mem / results["folder_cold"]["images_per_s"]
    results["ratio_memory_vs_warm"] = mem / results["folder_warm"]["images_per_s"]
    for x in results.get("read_limits", []):
        results[f"ratio_memory_vs_cold_{x['key']}"] = mem / results[f"folder_cold_{x['key']}"]["images_per_s"]
    table = format_table(results)
    print(table)
    write_text(os.path.join(args.out, "bench.md"), table + "\n")
    write_json(os.path.join(args.out, "bench.json"), results)
    plot(results, os.path.join(args.out, "bench.png"))
    print(f"wrote {args.out}/bench.md, bench.json, bench.png", file=sys.stderr)
    return 0


def format_table(r: dict) -> str:
    mb = 1 << 20
    lines = [f"`{r['command']}`", "",
             f"{r['images']} JPEGs, {r['bytes'] / mb:.1f} MiB (mean {r['mean_image_bytes'] / 1024:.0f} KiB), "
             f"{r['threads']} decode threads, batch {r['batch_size']}, decoder {r['decoder']}, {r['cpus']} CPUs", "",
             "| path | images/s (decode + RRC-224) | epoch s | vs in-memory | images/s, bytes only (no decode) |",
             "|---|---:|---:|---:|---:|"]
    for key, name in source_names(r):
        x = r[key]
        lines.append(f"| {name} | {x['images_per_s']:.0f} | {x['epoch_s']:.2f} | "
                     f"{x['images_per_s'] / r['memory']['images_per_s']:.2f} | "
                     f"{r['read_only'][key]['images_per_s']:.0f} |")
    lines += ["", f"In-memory / cold: **{r['ratio_memory_vs_cold']:.2f}x**; in-memory / warm: "
                  f"**{r['ratio_memory_vs_warm']:.2f}x**."]
    if r.get("read_limits"):
        lines[-1] += " In-memory / cold with the disk's reads limited (blkio cgroup on device " + \
            f"{r['read_limit_device']}): " + "; ".join(
                f"{x['label']} **{r['ratio_memory_vs_cold_' + x['key']]:.2f}x**" for x in r["read_limits"]) + "."
    lines += [""] + format_decode_table(r["decode_per_core"])
    if r["memory_runs"]:
        lines += ["", "| ranks on host | store share MiB | store resident on host MiB (sum of segment PSS) | ratio |"
                      " RSS/rank MiB | PSS/rank MiB | PSS host total MiB | images/s host |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for m in r["memory_runs"]:
            lines.append(f"| {m['ranks']} | {m['share_bytes'] / mb:.1f} | {m['host_store_resident'] / mb:.1f} | "
                         f"{m['host_store_ratio']:.3f} | {m['rank_rss_mean'] / mb:.0f} | {m['rank_pss_mean'] / mb:.0f} | "
                         f"{m['host_pss_total'] / mb:.0f} | {m['images_per_s_host']:.0f} |")
    return "\n".join(lines)


def source_names(r: dict) -> List[tuple]:
    """(result key, row name) of every source path a bench result holds, in table order."""
    names = [("folder_cold", "ImageFolder, cold page cache")]
    names += [(f"folder_cold_{x['key']}", f"ImageFolder, cold, disk reads limited to {x['label']}")
              for x in r.get("read_limits", [])]
    return names + [("folder_warm", "ImageFolder, warm page cache"), ("memory", "in-memory store")]


def plot(r: dict, path: str) -> None:
    try:
        plt = pyplot()
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = [k for k, _ in source_names(r)]
    names = [k.replace("folder_cold_", "cold\n").replace("folder_", "").replace("_", " ").replace("+", "\n+")
             for k in keys]
    colors = {"folder_cold": "#999", "folder_warm": "#69c", "memory": "#2a2"}
    axes[0].bar(names, [r[k]["images_per_s"] for k in keys], color=[colors.get(k, "#c96") for k in keys])
    axes[0].tick_params(axis="x", labelsize=8)
    axes[0].set_ylabel("images/s")
    axes[0].set_title(f"{r['threads']} threads, batch {r['batch_size']}, RRC-224")
    if r["memory_runs"]:
        ranks = [m["ranks"] for m in r["memory_runs"]]
        mb = 1 << 20
        axes[1].plot(ranks, [m["host_store_resident"] / mb for m in r["memory_runs"]], "o-", label="store resident / host")
        axes[1].plot(ranks, [m["share_bytes"] / mb for m in r["memory_runs"]], "k--", label="JPEG bytes of share")
        axes[1].plot(ranks, [m["host_pss_total"] / mb for m in r["memory_runs"]], "s-", label="all PSS / host")
        axes[1].set_xlabel("ranks on the host")
        axes[1].set_ylabel("MiB")
        axes[1].set_xticks(ranks)
        axes[1].legend()
        axes[1].set_title("one shared copy per host")
    save_png(fig, path, dpi=100)
