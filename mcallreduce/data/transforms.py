"""Decode-aware training and validation transforms (no torchvision needed).

A random-resized crop of 224 px usually keeps a small part of the image, so
these transforms pick the crop box first, from the JPEG header alone
(:mod:`.crop_boxes`), and then let libjpeg decode at the smallest power-of-two
scale (1/2, 1/4, 1/8: DCT-domain scaling) that keeps the box at least 224 px
(:mod:`.decode`); one antialiased bilinear resize of the box follows
(:mod:`.resize`). Decoders and resize release the GIL, so a thread pool
scales with cores.

Transforms with ``takes_encoded = True`` receive the encoded bytes from the
Dataset; any other callable receives a decoded RGB PIL image, as with ImageFolder.
A ``Compose``-style list (torchvision's or any object with ``.transforms``) whose
first step takes encoded bytes keeps the reduced-scale decode (:func:`apply`).

Randomness: with ``TrainTransform(seed=s)`` the crop and flip of a sample are a
pure function of (s, epoch, sample index), which the datasets of this package
pass in (``key``) once their epoch is set (InMemoryDistributedSampler sets it),
so they do not depend on the number of workers or threads, and a resumed run
draws what the uninterrupted one drew. Without a seed they come from Python's
``random``, which DataLoader reseeds in every worker every epoch.
Output: float32 normalised CHW tensors, or uint8 with ``normalize=False``, to be
normalised a batch at a time by :class:`Normalize` (on the GPU, for instance).
"""
from __future__ import annotations

import random
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from .crop_boxes import Box, centre_crop_box, random_resized_crop_box
from .decode import DECODERS, decode_crop, decode_image, decode_region, decoder_name, image_size
from .normalize import IMAGENET_MEAN, IMAGENET_STD, Normalize
from .resize import RESIZERS, crop_resize, resizer_name

__all__ = ["Box", "DECODERS", "IMAGENET_MEAN", "IMAGENET_STD", "RESIZERS", "EvalTransform", "Normalize",
           "TrainTransform", "apply", "centre_crop_box", "crop_resize", "decode_crop", "decode_image",
           "decode_region", "decoder_name", "image_size", "random_resized_crop_box", "resizer_name"]


class _ToTensor:
    """3xHxW uint8 array -> float32 normalised tensor (or the uint8 tensor when ``normalize`` is False).

    numpy, not torch ops: torch's intra-op thread pool, entered from every decode
    thread at once, is much slower than one numpy pass (docs/data.md, "Decode pipeline").
    """

    def __init__(self, normalize: bool, mean: Sequence[float], std: Sequence[float]):
        self.normalize = normalize
        self.shift = (np.asarray(mean, dtype=np.float32) * 255).reshape(3, 1, 1)
        self.scale = (1.0 / (np.asarray(std, dtype=np.float32) * 255)).reshape(3, 1, 1)

    def __call__(self, chw: np.ndarray) -> torch.Tensor:
        if not self.normalize:
            return torch.from_numpy(chw)
        out = np.empty(chw.shape, dtype=np.float32)    # contiguous CHW, filled in one pass
        np.subtract(chw, self.shift, out=out)
        out *= self.scale
        return torch.from_numpy(out)


class TrainTransform:
    """RandomResizedCrop(size) + RandomHorizontalFlip + ToTensor + Normalize, decoding at reduced scale.

    ``normalize=False`` returns uint8 CHW tensors (normalise per batch: :class:`Normalize`).
    ``resizer``: ``auto`` (torch's uint8 antialiased bilinear kernel when present, else
    Pillow's), ``torch``, ``pil`` or ``cv2`` (opt-in, OpenCV INTER_LINEAR, not antialiased).
    """
    takes_encoded = True
    takes_key = True       # gets key=(epoch, sample index) from the datasets of this package

    def __init__(self, size: int = 224, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip: float = 0.5,
                 normalize: bool = True, mean=IMAGENET_MEAN, std=IMAGENET_STD, decoder: Optional[str] = None,
                 seed: Optional[int] = None, resizer: Optional[str] = None):
        self.size, self.scale, self.ratio, self.flip = size, scale, ratio, flip
        self.decoder = decoder_name(decoder)
        self.resizer = resizer_name(resizer)
        self.seed = None if seed is None else int(seed)
        self._stream, self._stream_worker = None, None   # seeded, but called without a key
        self.to_tensor = _ToTensor(normalize, mean, std)

    def rng(self, key: Optional[Tuple[int, int]] = None):
        """The generator for one sample: keyed by (seed, epoch, index) when both are known.

        Seeded but without a key, a stream of this process; in a DataLoader worker it
        starts from the worker's seed, which differs per worker and per epoch.
        """
        if self.seed is None:
            return random      # the module's generator, which DataLoader reseeds per worker and epoch
        if key is not None:
            epoch, index = key
            return random.Random(f"{self.seed}:{epoch}:{index}")
        info = torch.utils.data.get_worker_info()
        worker = None if info is None else info.seed
        if self._stream is None or worker != self._stream_worker:
            self._stream = random.Random(self.seed if worker is None else f"{self.seed}:worker:{worker}")
            self._stream_worker = worker
        return self._stream

    def __call__(self, data, key: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """``key`` = (epoch, sample index), passed by this package's datasets."""
        out, rng = (self.size, self.size), self.rng(key)
        if isinstance(data, Image.Image):   # also usable on decoded images
            box = random_resized_crop_box(data.width, data.height, self.scale, self.ratio, rng)
            chw = crop_resize(data.convert("RGB"), box, out, rng.random() < self.flip, self.resizer)
        else:
            width, height = image_size(data, self.decoder)
            box = random_resized_crop_box(width, height, self.scale, self.ratio, rng)
            chw = decode_crop(data, box, out, self.decoder, (width, height), rng.random() < self.flip,
                              self.resizer)
        return self.to_tensor(chw)


class EvalTransform:
    """Resize(resize) + CenterCrop(size) + ToTensor + Normalize, decoding at reduced scale."""
    takes_encoded = True
    takes_key = True       # gets key=(epoch, sample index) from the datasets of this package

    def __init__(self, size: int = 224, resize: int = 256, normalize: bool = True, mean=IMAGENET_MEAN,
                 std=IMAGENET_STD, decoder: Optional[str] = None, resizer: Optional[str] = None):
        self.size, self.resize = size, resize
        self.decoder = decoder_name(decoder)
        self.resizer = resizer_name(resizer)
        self.to_tensor = _ToTensor(normalize, mean, std)

    def __call__(self, data, key: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        out = (self.size, self.size)
        if isinstance(data, Image.Image):
            box = centre_crop_box(data.width, data.height, self.resize, self.size)
            chw = crop_resize(data.convert("RGB"), box, out, False, self.resizer)
        else:
            width, height = image_size(data, self.decoder)
            box = centre_crop_box(width, height, self.resize, self.size)
            chw = decode_crop(data, box, out, self.decoder, (width, height), False, self.resizer)
        return self.to_tensor(chw)


def apply(transform: Optional[Callable], data, key: Optional[Tuple[int, int]]):
    """Run ``transform`` on a sample's encoded bytes, as the datasets of this package do.

    A transform that takes encoded bytes gets them (and ``key=``, when it sets ``takes_key = True``);
    a Compose-style ``.transforms`` list whose first step takes them runs that step
    on the bytes and the rest on its result; anything else gets the decoded RGB image.
    """
    steps = getattr(transform, "transforms", None)
    if not getattr(transform, "takes_encoded", False) and isinstance(steps, (list, tuple)) and steps \
            and getattr(steps[0], "takes_encoded", False):
        image = apply(steps[0], data, key)
        for step in steps[1:]:
            image = step(image)
        return image
    if getattr(transform, "takes_encoded", False):
        return transform(data, key=key) if getattr(transform, "takes_key", False) else transform(data)
    image = decode_image(data)
    return image if transform is None else transform(image)
