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
import os
import sys
import time

from ..bench.output import write_json, write_text
from ..bench.provenance import provenance, utc_now
from .bench_measure import (NoDecode, decode_per_core, memory_worker, round_robin, run_memory, source_paths,
                            time_epochs)
from .bench_report import format_decode_table, format_table, plot
from .throttle import ReadThrottle, parse_read_limits


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
    started = utc_now()
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
                   {"command": command, **provenance(started), "cpus": os.cpu_count(), "decode_per_core": d})
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
    write_json(os.path.join(args.out, "bench.json"), {**provenance(started), **results})
    plot(results, os.path.join(args.out, "bench.png"))
    print(f"wrote {args.out}/bench.md, bench.json, bench.png", file=sys.stderr)
    return 0
