"""Small ImageFolders of real images, for tests, benchmarks and examples.

No download: the photographs ship inside scikit-image (skimage/data) and
scikit-learn (sklearn/datasets/images), and so do scikit-learn's 1,797
handwritten digits (:func:`make_digits_folder`, labelled: for accuracy runs). Each class is one photograph; its
samples are random crops of it, rescaled to random sizes and saved as JPEG at
random qualities (some greyscale, some progressive, a few PNG), so sizes,
subsampling and colour modes vary as in ImageNet.
"""
from __future__ import annotations

import os
import random
from typing import List, Optional, Tuple

from PIL import Image

# (package, file inside the package): ten distinct scenes, colour and greyscale.
SOURCES = [
    ("skimage", "data/astronaut.png"), ("skimage", "data/camera.png"), ("skimage", "data/chelsea.png"),
    ("skimage", "data/coffee.png"), ("skimage", "data/coins.png"), ("skimage", "data/rocket.jpg"),
    ("skimage", "data/retina.jpg"), ("skimage", "data/hubble_deep_field.jpg"),
    ("sklearn", "datasets/images/china.jpg"), ("sklearn", "datasets/images/flower.jpg"),
]


def photo_paths() -> List[Tuple[str, str]]:
    """[(class name, path)] of the bundled photographs; ImportError names the missing package."""
    import importlib
    out = []
    for package, rel in SOURCES:
        try:
            module = importlib.import_module(package)
        except ImportError as exc:
            raise ImportError(f"the test photographs come from {package}: pip install -r "
                              f"scripts/requirements-data.txt") from exc
        path = os.path.join(os.path.dirname(module.__file__), rel)
        out.append((os.path.splitext(os.path.basename(rel))[0], path))
    return out


def make_photo_folder(root: str, per_class: int = 30, long_side: Tuple[int, int] = (96, 480),
                      classes: Optional[int] = None, png_every: int = 0, seed: int = 0,
                      quality: Tuple[int, int] = (75, 95), subsampling: Optional[int] = None) -> List[str]:
    """Write ``root/CLASS/NNNN.jpg`` (crops of each photograph); return the paths written.
    ``subsampling``: Pillow's JPEG chroma subsampling (0 is 4:4:4); None leaves Pillow's default."""
    rng = random.Random(seed)
    written = []
    for name, path in photo_paths()[:classes]:
        with Image.open(path) as source:
            source.load()
        class_dir = os.path.join(root, name)
        os.makedirs(class_dir, exist_ok=True)
        for k in range(per_class):
            w, h = source.size
            frac = rng.uniform(0.3, 1.0)
            cw, ch = max(8, int(w * frac)), max(8, int(h * frac * rng.uniform(0.7, 1.3)))
            cw, ch = min(cw, w), min(ch, h)
            left, top = rng.randint(0, w - cw), rng.randint(0, h - ch)
            crop = source.crop((left, top, left + cw, top + ch))
            scale = rng.randint(*long_side) / max(cw, ch)
            crop = crop.resize((max(8, round(cw * scale)), max(8, round(ch * scale))), Image.BILINEAR)
            if crop.mode not in ("RGB", "L"):
                crop = crop.convert("RGB")
            if png_every and k % png_every == png_every - 1:
                out = os.path.join(class_dir, f"{k:04d}.png")
                crop.save(out)
            else:
                out = os.path.join(class_dir, f"{k:04d}.jpg")
                options = {} if subsampling is None else {"subsampling": subsampling}
                crop.save(out, quality=rng.randint(*quality), progressive=rng.random() < 0.2, **options)
            written.append(out)
    return written


# ImageNet-1k's training JPEGs: about 110 KB on average, most sides 333-500 px (docs/data.md). The
# bundled photographs are smoother than ImageNet's, so near-lossless 4:4:4 JPEG brings them to that size.
IMAGENET_LIKE = {"long_side": (350, 500), "quality": (98, 100), "subsampling": 0}


def make_imagenet_like(root: str, train_per_class: int = 100, val_per_class: int = 20,
                       classes: Optional[int] = None, seed: int = 0) -> dict:
    """``root/train`` and ``root/val`` ImageFolder trees of ImageNet-sized JPEGs; a summary of what was written."""
    summary = {}
    for split, per_class, split_seed in (("train", train_per_class, seed), ("val", val_per_class, seed + 1)):
        paths = make_photo_folder(os.path.join(root, split), per_class=per_class, classes=classes,
                                  seed=split_seed, **IMAGENET_LIKE)
        sizes = [os.path.getsize(p) for p in paths]
        summary[split] = {"images": len(paths), "mean_bytes": sum(sizes) / max(1, len(sizes))}
    return summary


def make_digits_folder(root: str, size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> dict:
    """scikit-learn's digits (8x8, 17 grey levels) as ``size``-px greyscale JPEGs in ``root/train`` and
    ``root/val``, split per class with ``val_fraction`` held out; the number of images of each split."""
    import numpy as np
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("the digits come from scikit-learn: pip install -r scripts/requirements-data.txt") from exc
    digits = load_digits()
    rng = np.random.default_rng(seed)
    counts = {"train": 0, "val": 0}
    for label in range(10):
        ids = rng.permutation(np.nonzero(digits.target == label)[0])
        held = int(round(val_fraction * len(ids)))
        for split, chosen in (("val", ids[:held]), ("train", ids[held:])):
            class_dir = os.path.join(root, split, str(label))
            os.makedirs(class_dir, exist_ok=True)
            for i in chosen:
                pixels = (digits.images[i] * (255 / 16)).round().astype(np.uint8)
                image = Image.fromarray(pixels, "L").resize((size, size), Image.BICUBIC)
                image.save(os.path.join(class_dir, f"{i:04d}.jpg"), quality=95)
                counts[split] += 1
    return counts


def add_bad_files(root: str) -> List[str]:
    """Files ImageFolder would list but that are not decodable images, plus a non-image it ignores.
    Returns the paths that ``pack`` must report (the .txt file is not one: its extension excludes it)."""
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    first = os.path.join(root, classes[0])
    donor = sorted(f for f in os.listdir(first) if f.endswith(".jpg"))[0]
    data = open(os.path.join(first, donor), "rb").read()
    bad = {
        os.path.join(first, "zz_truncated.jpg"): data[: len(data) // 2],
        os.path.join(root, classes[1], "zz_text.jpg"): b"this is not a JPEG\n" * 20,
        os.path.join(root, classes[2], "zz_empty.jpeg"): b"",
    }
    for path, content in bad.items():
        with open(path, "wb") as f:
            f.write(content)
    with open(os.path.join(root, classes[0], "README.txt"), "w") as f:
        f.write("not an image; ImageFolder skips it by extension\n")
    return sorted(bad)
