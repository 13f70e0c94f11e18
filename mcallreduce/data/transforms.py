"""Decode-aware training and validation transforms (no torchvision needed).

A random-resized crop of 224 px usually keeps a small part of the image, so
these transforms pick the crop box first, from the JPEG header alone, and then
let libjpeg decode at the smallest power-of-two scale (1/2, 1/4, 1/8: DCT-domain
scaling) that keeps the box at least 224 px; one antialiased bilinear resize of
the box follows (Pillow's BILINEAR filter, run by torch's AVX2 uint8 kernel when
there is one: several times faster than Pillow's own scalar code). The decoder
(``auto``) is ``turbo`` when its extension is built (:mod:`.jpeg`: libjpeg-turbo
decodes only the box), else simplejpeg (libjpeg-turbo, whole image), else
Pillow's draft mode; Pillow also takes non-JPEG and CMYK files, and whatever a
faster decoder refuses. Decoders and resize release the GIL, so a thread pool
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

import io
import math
import random
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from ..config import data as config
from . import jpeg

try:
    import simplejpeg
except ImportError:  # optional: Pillow's draft mode is the fallback
    simplejpeg = None

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
Box = Tuple[float, float, float, float]   # left, top, right, bottom in source pixels


DECODERS = ("turbo", "simplejpeg", "pil")


def decoder_name(decoder: Optional[str] = None) -> str:
    """``auto`` (default): ``turbo`` when its extension imports, else ``simplejpeg``, else ``pil``."""
    name = decoder or config.decoder()
    if name == "auto":
        name = "turbo" if jpeg.available else "simplejpeg" if simplejpeg is not None else "pil"
    if name not in DECODERS:
        raise ValueError(f"decoder must be one of auto, {', '.join(DECODERS)}; got {name!r}")
    if name == "turbo" and not jpeg.available:
        raise ImportError(f"decoder 'turbo' asked for, but its extension does not import ({jpeg.import_error}); "
                          f"it is built by 'pip install -e .' when gcc and libjpeg's headers are there "
                          f"(Debian: apt-get install gcc libjpeg62-turbo-dev)")
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
    if decoder == "turbo" and jpeg.available and _is_jpeg(data):
        try:
            return jpeg.header(data)
        except ValueError:
            pass
    if decoder in ("simplejpeg", "turbo") and simplejpeg is not None and _is_jpeg(data):
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


RESIZERS = ("torch", "pil", "cv2")
_torch_aa = None     # torch's uint8 antialiased bilinear resize, once probed


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
        _torch_aa = False
        try:
            capability = torch.backends.cpu.get_cpu_capability()
            op = getattr(torch._C._nn, "_upsample_bilinear2d_aa", None)
            if capability in ("AVX2", "AVX512") and op is not None:
                probe = np.arange(16 * 20 * 3, dtype=np.uint8).reshape(16, 20, 3)
                got = op(torch.from_numpy(probe).permute(2, 0, 1).unsqueeze(0), [7, 9], False, None)
                want = np.asarray(Image.fromarray(probe).resize((9, 7), Image.BILINEAR)).transpose(2, 0, 1)
                if got.dtype == torch.uint8 and np.abs(got[0].numpy().astype(int) - want).max() <= 1:
                    _torch_aa = op
        except Exception:   # old torch, no uint8 kernel, ...: Pillow does the resize
            _torch_aa = False
    return _torch_aa or None


def _cv2():
    try:
        import cv2
    except ImportError:
        return None
    return cv2


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


def _decode(data, k: int, width: int, height: int, decoder: str, layout: str):
    """Decode at 1/k scale: an HxWxC uint8 array (``layout`` RGB or RGBX) or, from Pillow, an RGB image."""
    if decoder == "simplejpeg" and simplejpeg is not None and _is_jpeg(data):
        try:
            return simplejpeg.decode_jpeg(data, colorspace=layout, min_factor=k,
                                          min_width=math.ceil(width / k), min_height=math.ceil(height / k))
        except ValueError:   # CMYK, progressive oddities, ...: let Pillow try
            pass
    image = Image.open(io.BytesIO(data))
    if image.format == "JPEG" and k > 1:
        image.draft("RGB", (math.ceil(width / k), math.ceil(height / k)))
    return image if image.mode == "RGB" else image.convert("RGB")


def _pixel_box(box: Box, width: int, height: int) -> Tuple[int, int, int, int]:
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
    left, top, right, bottom = _pixel_box(box, array.shape[1], array.shape[0])
    # torch's kernel wants contiguous channels-last: numpy copies the box (torch would, through its thread pool).
    crop = np.ascontiguousarray(array[top:bottom, left:right])
    if crop.shape[1] == out[0] and crop.shape[0] == out[1]:
        small = crop.transpose(2, 0, 1)[:3]
    elif resizer == "cv2":
        small = _cv2().resize(crop, out, interpolation=_cv2().INTER_LINEAR).transpose(2, 0, 1)[:3]
    else:
        small = _torch_resize_op()(torch.from_numpy(crop).permute(2, 0, 1).unsqueeze(0),
                                   [out[1], out[0]], False, None)[0, :3].numpy()   # NCHW: 3 planes, contiguous
    # Mirror the small CHW result, not the box: numpy copies 3-byte pixels backwards 15x slower than bytes.
    return np.ascontiguousarray(small[:, :, ::-1] if flip else small)


def _decode_box(data, k: int, width: int, height: int, box: Box, out: Tuple[int, int], flip: bool,
                resizer: str) -> np.ndarray:
    """:func:`decode_crop` with the ``turbo`` decoder: only (about) the box is decoded."""
    sw, sh = jpeg.scaled_size(width, height, k)
    sx, sy = sw / width, sh / height
    scaled = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    if resizer == "pil":
        # Pillow resizes a fractional box and its filter reads up to ~(box / out) pixels
        # beyond it: decode that margin too, so the result equals the whole-image path.
        margin = 1 + math.ceil(max((scaled[2] - scaled[0]) / out[0], (scaled[3] - scaled[1]) / out[1]))
        left, top = max(0, math.floor(scaled[0]) - margin), max(0, math.floor(scaled[1]) - margin)
        right, bottom = min(sw, math.ceil(scaled[2]) + margin), min(sh, math.ceil(scaled[3]) + margin)
        local = (scaled[0] - left, scaled[1] - top, scaled[2] - left, scaled[3] - top)
    else:
        # torch/cv2 resize the box rounded to whole pixels: decode exactly that (a contiguous array).
        left, top, right, bottom = _pixel_box(scaled, sw, sh)
        local = (0, 0, right - left, bottom - top)
    region = jpeg.decode_box(data, k, (left, top, right, bottom))
    return crop_resize(region, local, out, flip, resizer)


def decode_crop(data, box: Box, out: Tuple[int, int], decoder: str = "simplejpeg",
                size: Optional[Tuple[int, int]] = None, flip: bool = False, resizer: str = "torch") -> np.ndarray:
    """Decode only as many pixels as needed; ``box`` (source pixels) resized to ``out``: 3xHxW uint8."""
    width, height = size or image_size(data, decoder)
    k = _scale_for(width, height, box, out)
    if decoder == "turbo" and jpeg.available and _is_jpeg(data):
        try:
            return _decode_box(data, k, width, height, box, out, flip, resizer)
        except ValueError:   # CMYK, corrupt data (libjpeg warnings included): the whole-image path decides
            decoder = "simplejpeg"
    image = _decode(data, k, width, height, decoder, "RGBX" if resizer == "pil" else "RGB")
    w, h = (image.size if isinstance(image, Image.Image) else (image.shape[1], image.shape[0]))
    sx, sy = w / width, h / height
    return crop_resize(image, (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy), out, flip, resizer)


def decode_region(data, box: Box, out: Tuple[int, int], decoder: str = "simplejpeg",
                  size: Optional[Tuple[int, int]] = None, resizer: Optional[str] = None) -> Image.Image:
    """:func:`decode_crop` as an RGB PIL image."""
    chw = decode_crop(data, box, out, decoder, size, resizer=resizer_name(resizer))
    return Image.fromarray(np.ascontiguousarray(chw.transpose(1, 2, 0)))


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
    """3xHxW uint8 array -> float32 normalised tensor (or the uint8 tensor when ``normalize`` is False).

    numpy, not torch ops: torch's intra-op thread pool, entered from every decode
    thread at once for a 224x224 image, was 20x slower than one numpy pass here.
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


class Normalize:
    """Batch-level ToTensor + Normalize for uint8 batches: ``ThreadedLoader(..., batch_transform=Normalize())``.

    With ``TrainTransform(normalize=False)`` (or EvalTransform) the decode threads
    hand out uint8 images, 4x fewer bytes than float32, as FFCV and DALI do; this
    turns a whole (N, 3, H, W) uint8 batch into ``dtype`` normalised with ``mean``
    and ``std`` (of 0..1 images), equal to what ``normalize=True`` gives per image.
    With ``device`` (say ``"cuda"``) the uint8 batch is copied there first and
    normalised there by one torch kernel; on the CPU one numpy pass does it (torch's
    CPU kernels for this uint8 -> float broadcast measured 2-4x slower than numpy).
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
