"""``python -m mcallreduce.data pack SRC DST``, ``make-imagenet-like DIR``, ``make-digits DIR``, ``bench``."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcallreduce.data",
                                     description="In-memory ImageNet: pack an ImageFolder tree, or benchmark loading.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="pack an ImageFolder tree into one store file")
    p.add_argument("src", help="ImageFolder root (one sub-folder per class)")
    p.add_argument("dst", help="store file to write (atomically)")
    p.add_argument("--workers", type=int, default=None, help="reader/checker processes (default: the cores this process may use)")
    p.add_argument("--abort-on-corrupt", action="store_true",
                   help="stop at the first file that is not a decodable image (default: report and skip it)")
    p.add_argument("--check", choices=("decode", "header", "none"), default="decode",
                   help="how to check each image: decode (1/8-scale decode, catches truncation), header, none")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                   help="no progress bar (default: MCALLREDUCE_DATA_PROGRESS, on)")
    m = sub.add_parser("make-imagenet-like", help="write train/ and val/ ImageFolder trees of ImageNet-sized JPEGs "
                                                "(crops of photographs shipped in scikit-image and scikit-learn)")
    m.add_argument("dst", help="directory to create")
    m.add_argument("--train-per-class", type=int, default=100, help="images a class in train (default: %(default)s)")
    m.add_argument("--val-per-class", type=int, default=20, help="images a class in val (default: %(default)s)")
    m.add_argument("--classes", type=int, default=None, help="at most 10 (one per bundled photograph)")
    m.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("make-digits", help="write train/ and val/ trees of scikit-learn's handwritten digits")
    d.add_argument("dst", help="directory to create")
    d.add_argument("--size", type=int, default=32, help="side in pixels (the digits are 8x8, upscaled)")
    d.add_argument("--val-fraction", type=float, default=0.2)
    d.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("bench", help="compare the in-memory store with ImageFolder-style reading from disk")
    from .bench import add_arguments
    add_arguments(b)
    args = parser.parse_args(argv)
    if args.command == "pack":
        from .format import CorruptImageError, pack
        try:
            report = pack(args.src, args.dst, workers=args.workers, check=args.check, progress=args.progress,
                          on_error="abort" if args.abort_on_corrupt else "skip")
        except (FileNotFoundError, CorruptImageError) as exc:
            print(f"mcallreduce.data pack: error: {exc}", file=sys.stderr)
            return 2
        print(f"packed {report.num_samples} images in {report.num_classes} classes, "
              f"{report.blob_bytes:,} bytes, into {report.path}; skipped {len(report.skipped)} bad file(s)")
        return 0
    if args.command == "make-imagenet-like":
        from .photos import make_imagenet_like
        summary = make_imagenet_like(args.dst, args.train_per_class, args.val_per_class, args.classes, args.seed)
        for split, row in summary.items():
            print(f"{args.dst}/{split}: {row['images']} images, mean {row['mean_bytes'] / 1000:.0f} kB")
        return 0
    if args.command == "make-digits":
        from .photos import make_digits_folder
        counts = make_digits_folder(args.dst, args.size, args.val_fraction, args.seed)
        print(f"{args.dst}: {counts['train']} training and {counts['val']} validation digits")
        return 0
    from ..config import ConfigError
    from .bench import run
    from .throttle import ThrottleError
    try:
        return run(args)
    except (ConfigError, ThrottleError) as exc:
        print(f"mcallreduce.data bench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
