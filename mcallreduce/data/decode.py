"""JPEG decoding at reduced scale: only as many pixels as the crop box needs.

The decoder (``auto``) is ``turbo`` when its extension is built (:mod:`.jpeg`: libjpeg-turbo decodes
only the box), else simplejpeg (libjpeg-turbo, whole image), else Pillow's draft mode; Pillow also takes
non-JPEG and CMYK files, and whatever a faster decoder refuses. The decoded box is then resized by
:func:`.resize.crop_resize`.
"""
from __future__ import annotations

import io
import math
from typing import Optional, Tuple

import numpy as np
from PIL import Image

from .settings import data as settings
from . import jpeg
from .crop_boxes import Box
from .resize import pixel_box, crop_resize, resizer_name

try:
    import simplejpeg
except ImportError:  # optional: Pillow's draft mode is the fallback
    simplejpeg = None

DECODERS = ("turbo", "simplejpeg", "pil")


def decoder_name(decoder: Optional[str] = None) -> str:
    """``auto`` (default): ``turbo`` when its extension imports, else ``simplejpeg``, else ``pil``."""
    name = decoder or settings.decoder()
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
        left, top, right, bottom = pixel_box(scaled, sw, sh)
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
