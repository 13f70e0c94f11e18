"""The crop-and-resize step: one antialiased bilinear resize of the crop box to the output size.

The resizer (``auto``) is torch's AVX2 uint8 kernel when there is one (Pillow's BILINEAR filter,
several times faster than Pillow's own scalar code), else Pillow; OpenCV is opt-in.
"""
from __future__ import annotations

import threading
from typing import Optional, Tuple

import numpy as np
import torch
from PIL import Image

from .crop_boxes import Box

RESIZERS = ("torch", "pil", "cv2")
_torch_aa = None     # torch's uint8 antialiased bilinear resize, once probed
_probe_lock = threading.Lock()


def _torch_resize_op():
    """torch's uint8 antialiased bilinear resize, or None where it is not the fast kernel.

    Since torch 2.1, ``interpolate(uint8 channels-last, mode="bilinear", antialias=True)``
    runs an AVX2 port of Pillow-SIMD's convolution resize: the same filter as
    Pillow's BILINEAR (results within 1 of 255), several times faster than Pillow's
    scalar code, and it runs inline in the calling thread (no intra-op pool, so
    it is safe to call from every decode thread at once). Elsewhere (no AVX2,
    older torch) the generic kernel would enter torch's thread pool: not used.
    """
    global _torch_aa
    if _torch_aa is None:
        with _probe_lock:   # decode threads may ask at once: they wait for one probe's answer
            if _torch_aa is None:
                _torch_aa = _probe_torch_resize()
    return _torch_aa or None


def _probe_torch_resize():
    """The kernel, where it matches Pillow's filter on a probe image; else False."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
        op = getattr(torch._C._nn, "_upsample_bilinear2d_aa", None)
        if capability in ("AVX2", "AVX512") and op is not None:
            probe = np.arange(16 * 20 * 3, dtype=np.uint8).reshape(16, 20, 3)
            got = op(torch.from_numpy(probe).permute(2, 0, 1).unsqueeze(0), [7, 9], False, None)
            want = np.asarray(Image.fromarray(probe).resize((9, 7), Image.BILINEAR)).transpose(2, 0, 1)
            if got.dtype == torch.uint8 and np.abs(got[0].numpy().astype(int) - want).max() <= 1:
                return op
    except (AttributeError, TypeError, RuntimeError, NotImplementedError):   # old torch, no uint8 kernel: Pillow resizes
        pass
    return False


def _cv2():
    try:
        import cv2
    except ImportError:
        return None
    return cv2


def available_resizers() -> Tuple[str, ...]:
    """The resizers that run here: Pillow always, torch's and OpenCV's where present."""
    return tuple(r for r in RESIZERS
                 if r == "pil" or (r == "torch" and _torch_resize_op() is not None) or (r == "cv2" and _cv2()))


def resizer_name(resizer: Optional[str] = None) -> str:
    """``auto`` (default): torch's fast uint8 kernel when present, else Pillow. ``cv2`` is opt-in."""
    name = resizer or "auto"
    if name == "auto":
        return "torch" if _torch_resize_op() is not None else "pil"
    if name not in RESIZERS:
        raise ValueError(f"resizer must be one of auto, {', '.join(RESIZERS)}; got {name!r}")
    if name == "torch" and _torch_resize_op() is None:
        raise RuntimeError("resizer='torch' needs torch >= 2.1 on an AVX2 CPU (its fast uint8 antialiased "
                           "kernel); use resizer='pil'")
    if name == "cv2":
        cv = _cv2()
        if cv is None:
            raise ImportError("resizer='cv2' asked for, but cv2 does not import (pip install opencv-python-headless)")
        cv.setNumThreads(1)   # called from the decode threads: no nested pool
    return name


def pixel_box(box: Box, width: int, height: int) -> Tuple[int, int, int, int]:
    """``box`` rounded to whole pixels inside a width x height image, at least 1x1."""
    left = min(max(int(round(box[0])), 0), width - 1)
    top = min(max(int(round(box[1])), 0), height - 1)
    right = min(max(int(round(box[2])), left + 1), width)
    bottom = min(max(int(round(box[3])), top + 1), height)
    return left, top, right, bottom


def crop_resize(image, box: Box, out: Tuple[int, int], flip: bool = False, resizer: str = "torch") -> np.ndarray:
    """``box`` of ``image`` (HxWxC uint8 array, C >= 3, or PIL image) resized to ``out`` = (width, height)
    with an antialiased bilinear filter, mirrored when ``flip``: a 3 x height x width uint8 array.

    ``pil`` resizes the (fractional) box itself; ``torch`` and ``cv2`` round it to whole pixels
    (at most half a pixel of shift) and resize a contiguous copy of it.
    ``cv2`` (opt-in) is OpenCV's INTER_LINEAR: not antialiased when shrinking.
    """
    if resizer == "pil":
        if not isinstance(image, Image.Image):
            if image.shape[2] == 4:   # RGBX is Pillow's own layout: wrap the array, no copy
                image = Image.frombuffer("RGBX", (image.shape[1], image.shape[0]), image, "raw", "RGBX", 0, 1)
            else:
                image = Image.fromarray(np.ascontiguousarray(image[:, :, :3]))
        small = image.resize(out, Image.BILINEAR, box=box)
        if flip:
            small = small.transpose(Image.FLIP_LEFT_RIGHT)
        return np.ascontiguousarray(np.asarray(small).transpose(2, 0, 1)[:3])
    array = np.asarray(image)
    left, top, right, bottom = pixel_box(box, array.shape[1], array.shape[0])
    # torch's kernel wants contiguous channels-last: numpy copies the box (torch would, through its thread pool).
    crop = np.ascontiguousarray(array[top:bottom, left:right])
    if crop.shape[1] == out[0] and crop.shape[0] == out[1]:
        small = crop.transpose(2, 0, 1)[:3]
    elif resizer == "cv2":
        small = _cv2().resize(crop, out, interpolation=_cv2().INTER_LINEAR).transpose(2, 0, 1)[:3]
    else:
        small = _torch_resize_op()(torch.from_numpy(crop).permute(2, 0, 1).unsqueeze(0),
                                   [out[1], out[0]], False, None)[0, :3].numpy()   # NCHW: 3 planes, contiguous
    # Mirror the small CHW result, not the box: numpy copies 3-byte pixels backwards far slower than bytes.
    return np.ascontiguousarray(small[:, :, ::-1] if flip else small)
