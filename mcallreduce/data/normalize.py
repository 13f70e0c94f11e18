"""Batch-level normalisation of uint8 image batches, on the CPU or on a device."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class Normalize:
    """Batch-level ToTensor + Normalize for uint8 batches: ``ThreadedLoader(..., batch_transform=Normalize())``.

    With ``TrainTransform(normalize=False)`` (or EvalTransform) the decode threads
    hand out uint8 images, 4x fewer bytes than float32, as FFCV and DALI do; this
    turns a whole (N, 3, H, W) uint8 batch into ``dtype`` normalised with ``mean``
    and ``std`` (of 0..1 images), equal to what ``normalize=True`` gives per image.
    With ``device`` (say ``"cuda"``) the uint8 batch is copied there first and
    normalised there by one torch kernel; on the CPU one numpy pass does it (torch's
    CPU kernels for this uint8 -> float broadcast are slower: docs/data.md, "Decode pipeline").
    Takes the ``(images, labels)`` pairs of the loader (labels moved to ``device``
    too) or a bare image batch. ``channels_last`` returns that memory format.
    """

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 device=None, dtype: torch.dtype = torch.float32, channels_last: bool = False,
                 non_blocking: bool = True):
        self.device = torch.device(device) if device is not None else None
        self.dtype, self.channels_last, self.non_blocking = dtype, channels_last, non_blocking
        std255 = np.asarray(std, dtype=np.float64) * 255
        self._scale = (1.0 / std255).astype(np.float32)                                   # x * scale + bias
        self._bias = (-np.asarray(mean, dtype=np.float64) * 255 / std255).astype(np.float32)
        self._on = {}

    def _constants(self, device):
        if device not in self._on:
            shape = (1, 3, 1, 1)
            self._on[device] = (torch.tensor(self._scale, dtype=self.dtype, device=device).reshape(shape),
                                torch.tensor(self._bias, dtype=self.dtype, device=device).reshape(shape))
        return self._on[device]

    def images(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[1] != 3:
            raise TypeError(f"Normalize expects uint8 (N, 3, H, W) batches (TrainTransform(normalize=False)); "
                            f"got {x.dtype} {tuple(x.shape)}")
        if self.device is not None and self.device.type != "cpu":
            x = x.to(self.device, non_blocking=self.non_blocking)
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            scale, bias = self._constants(x.device)
            return torch.addcmul(bias, x, scale)     # promotes uint8 -> dtype inside the one kernel
        if self.dtype != torch.float32:
            return self._numpy(x).to(self.dtype)
        return self._numpy(x)

    def _numpy(self, x: torch.Tensor) -> torch.Tensor:
        array = x.numpy()
        if self.channels_last:       # NHWC storage, returned as an NCHW channels-last view
            out = np.empty((array.shape[0], array.shape[2], array.shape[3], 3), dtype=np.float32)
            np.multiply(array.transpose(0, 2, 3, 1), self._scale, out=out)
            out += self._bias
            return torch.from_numpy(out).permute(0, 3, 1, 2)
        out = np.empty(array.shape, dtype=np.float32)
        scale, bias = self._scale.reshape(3, 1, 1), self._bias.reshape(3, 1, 1)
        for image, result in zip(array, out):   # an image at a time: the second pass hits the cache
            np.multiply(image, scale, out=result)
            result += bias
        return torch.from_numpy(out)

    def __call__(self, batch):
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            images, labels = batch
            if self.device is not None and isinstance(labels, torch.Tensor):
                labels = labels.to(self.device, non_blocking=self.non_blocking)
            return self.images(images), labels
        return self.images(batch)
