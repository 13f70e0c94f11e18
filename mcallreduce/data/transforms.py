"""Decode-aware training and validation transforms (no torchvision needed).

A random-resized crop of 224 px usually keeps a small part of the image, so
these transforms pick the crop box first, from the JPEG header alone, and then
let libjpeg decode at the smallest power-of-two scale (1/2, 1/4, 1/8: DCT-domain
scaling) that keeps the box at least 224 px; one antialiased bilinear resize of
the box follows. The decoder is simplejpeg when it imports (libjpeg-turbo) and
Pillow's draft mode otherwise, or for non-JPEG and CMYK files. Both release the
GIL, so a thread pool scales with cores.

Transforms with ``takes_encoded = True`` receive the encoded bytes from the
Dataset; any other callable receives a decoded RGB PIL image, as with ImageFolder.
"""
from __future__ import annotations

import io
import math
import random
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from . import config

try:
    import simplejpeg
except ImportError:  # optional: Pillow's draft mode is the fallback
    simplejpeg = None

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
Box = Tuple[float, float, float, float]   # left, top, right, bottom in source pixels


def decoder_name(decoder: Optional[str] = None) -> str:
    name = decoder or config.decoder()
    if name == "auto":
        name = "simplejpeg" if simplejpeg is not None else "pil"
    if name == "simplejpeg" and simplejpeg is None:
        raise ImportError("decoder 'simplejpeg' asked for, but simplejpeg does not import (pip install simplejpeg)")
    return name


def _is_jpeg(data) -> bool:
    return len(data) > 2 and data[0] == 0xFF and data[1] == 0xD8


def decode_image(data) -> Image.Image:
    """Full-size decode to an RGB PIL image (what ImageFolder's loader returns)."""
    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def image_size(data, decoder: str = "simplejpeg") -> Tuple[int, int]:
    """(width, height) from the header alone."""
    if decoder == "simplejpeg" and simplejpeg is not None and _is_jpeg(data):
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            return width, height
        except ValueError:
            pass
    with Image.open(io.BytesIO(data)) as image:
        return image.size


def _scale_for(width: int, height: int, box: Box, out: Tuple[int, int]) -> int:
    """The largest power-of-two reduction (<= 8) that keeps ``box`` at least ``out``."""
    bw, bh = box[2] - box[0], box[3] - box[1]
    k = 8
    while k > 1 and (bw / k < out[0] or bh / k < out[1]):
        k //= 2
    return k


def decode_region(data, box: Box, out: Tuple[int, int], decoder: str = "simplejpeg",
                  size: Optional[Tuple[int, int]] = None) -> Image.Image:
    """Decode only as many pixels as needed and return ``box`` resized to ``out`` (mode RGB or RGBX)."""
    width, height = size or image_size(data, decoder)
    k = _scale_for(width, height, box, out)
    image = None
    if decoder == "simplejpeg" and simplejpeg is not None and _is_jpeg(data):
        try:
            # RGBX is Pillow's own pixel layout: frombuffer then wraps the array without a copy.
            array = simplejpeg.decode_jpeg(data, colorspace="RGBX", min_factor=k,
                                           min_width=math.ceil(width / k), min_height=math.ceil(height / k))
            image = Image.frombuffer("RGBX", (array.shape[1], array.shape[0]), array, "raw", "RGBX", 0, 1)
        except ValueError:   # CMYK, progressive oddities, ...: let Pillow try
            image = None
    if image is None:
        image = Image.open(io.BytesIO(data))
        if image.format == "JPEG" and k > 1:
            image.draft("RGB", (math.ceil(width / k), math.ceil(height / k)))
        if image.mode not in ("RGB", "RGBX"):
            image = image.convert("RGB")
    sx, sy = image.width / width, image.height / height
    scaled = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    return image.resize(out, Image.BILINEAR, box=scaled)


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


class _ToTensor:
    """HWC uint8 image -> CHW float normalised (or uint8 when ``normalize`` is False).

    numpy, not torch ops: torch's intra-op thread pool, entered from every decode
    thread at once for a 224x224 image, was 20x slower than one numpy pass here.
    """

    def __init__(self, normalize: bool, mean: Sequence[float], std: Sequence[float]):
        self.normalize = normalize
        self.shift = (np.asarray(mean, dtype=np.float32) * 255).reshape(3, 1, 1)
        self.scale = (1.0 / (np.asarray(std, dtype=np.float32) * 255)).reshape(3, 1, 1)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        chw = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)[:3]   # RGBX images carry a 4th byte
        if not self.normalize:
            return torch.from_numpy(np.ascontiguousarray(chw))
        out = np.empty(chw.shape, dtype=np.float32)    # contiguous CHW, filled in one pass
        np.subtract(chw, self.shift, out=out)
        out *= self.scale
        return torch.from_numpy(out)


class TrainTransform:
    """RandomResizedCrop(size) + RandomHorizontalFlip + ToTensor + Normalize, decoding at reduced scale."""
    takes_encoded = True

    def __init__(self, size: int = 224, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip: float = 0.5,
                 normalize: bool = True, mean=IMAGENET_MEAN, std=IMAGENET_STD, decoder: Optional[str] = None,
                 seed: Optional[int] = None):
        self.size, self.scale, self.ratio, self.flip = size, scale, ratio, flip
        self.decoder = decoder_name(decoder)
        self.rng = random.Random(seed)
        self.to_tensor = _ToTensor(normalize, mean, std)

    def __call__(self, data) -> torch.Tensor:
        if isinstance(data, Image.Image):   # also usable on decoded images
            box = random_resized_crop_box(data.width, data.height, self.scale, self.ratio, self.rng)
            image = data.convert("RGB").resize((self.size, self.size), Image.BILINEAR, box=box)
        else:
            width, height = image_size(data, self.decoder)
            box = random_resized_crop_box(width, height, self.scale, self.ratio, self.rng)
            image = decode_region(data, box, (self.size, self.size), self.decoder, (width, height))
        if self.rng.random() < self.flip:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return self.to_tensor(image)


class EvalTransform:
    """Resize(resize) + CenterCrop(size) + ToTensor + Normalize, decoding at reduced scale."""
    takes_encoded = True

    def __init__(self, size: int = 224, resize: int = 256, normalize: bool = True, mean=IMAGENET_MEAN,
                 std=IMAGENET_STD, decoder: Optional[str] = None):
        self.size, self.resize = size, resize
        self.decoder = decoder_name(decoder)
        self.to_tensor = _ToTensor(normalize, mean, std)

    def __call__(self, data) -> torch.Tensor:
        if isinstance(data, Image.Image):
            box = centre_crop_box(data.width, data.height, self.resize, self.size)
            image = data.convert("RGB").resize((self.size, self.size), Image.BILINEAR, box=box)
        else:
            width, height = image_size(data, self.decoder)
            box = centre_crop_box(width, height, self.resize, self.size)
            image = decode_region(data, box, (self.size, self.size), self.decoder, (width, height))
        return self.to_tensor(image)
