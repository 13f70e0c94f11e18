"""Crop boxes in source pixels, computed from the image size alone, before any decoding.

``random_resized_crop_box`` draws torchvision's RandomResizedCrop box; ``centre_crop_box`` is the box
that Resize then CenterCrop keep.
"""
from __future__ import annotations

import math
import random
from typing import Tuple

Box = Tuple[float, float, float, float]   # left, top, right, bottom in source pixels


def random_resized_crop_box(width: int, height: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                            rng: random.Random = random) -> Box:
    """torchvision's RandomResizedCrop.get_params: ten tries, then a centre crop of clamped ratio."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = rng.randint(0, height - h)
            left = rng.randint(0, width - w)
            return (left, top, left + w, top + h)
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return (left, top, left + w, top + h)


def centre_crop_box(width: int, height: int, resize: int, crop: int) -> Box:
    """The source box that Resize(resize) then CenterCrop(crop) keeps."""
    s = resize / min(width, height)
    side_w, side_h = min(crop / s, width), min(crop / s, height)
    left, top = (width - side_w) / 2, (height - side_h) / 2
    return (left, top, left + side_w, top + side_h)
