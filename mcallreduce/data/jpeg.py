"""Decode only the crop box of a JPEG: libjpeg-turbo's partial decode (``_jpegroi.c``).

The extension is optional (built by setup.py when a C compiler and libjpeg-turbo's
headers are there); ``available`` says whether it imported. What it skips: rows below
the box are never decoded at all; rows above it are entropy-decoded only; within the
box's rows only the columns of the box (widened to the iMCU grid) go through IDCT,
upsampling and colour conversion. The GIL is released during the decode.
"""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np

try:
    from . import _jpegroi
except ImportError as exc:     # not built: the transforms use simplejpeg or Pillow
    _jpegroi = None
    import_error = exc
else:
    import_error = None

available = _jpegroi is not None
#: A valid JPEG this path does not decode (CMYK, YCCK): decode it another way. A ValueError.
UnsupportedError = _jpegroi.UnsupportedError if available else ValueError
#: the libjpeg-turbo version the extension was compiled against, or None
libjpeg_turbo_version = getattr(_jpegroi, "libjpeg_turbo_version", None)


def header(data) -> Tuple[int, int]:
    """(width, height) from the header alone. ValueError if ``data`` is not a JPEG."""
    return _jpegroi.header(data)


def scaled_size(width: int, height: int, k: int) -> Tuple[int, int]:
    """The image size libjpeg decodes at 1/k scale (it rounds up)."""
    return math.ceil(width / k), math.ceil(height / k)


def decode_box(data, k: int, box: Tuple[int, int, int, int]) -> np.ndarray:
    """The pixels ``box`` = (left, top, right, bottom) of the image decoded at 1/``k``
    (k in 1, 2, 4, 8; box in pixels of that scaled image): an HxWx3 uint8 RGB array.

    ``data``: any buffer (bytes, memoryview, a uint8 numpy slice of the store; not copied).
    Raises :data:`UnsupportedError` for CMYK/YCCK files and ValueError for corrupt data
    (libjpeg's message; its warnings count as errors) or a box outside the image.
    """
    left, top, right, bottom = box
    out = np.empty((bottom - top, right - left, 3), dtype=np.uint8)
    _jpegroi.decode(data, out, k, left, top, right - left, bottom - top)
    return out


def decode(data, k: int = 1) -> np.ndarray:
    """The whole image at 1/``k`` scale (the same decoder; for comparisons)."""
    width, height = scaled_size(*header(data), k)
    return decode_box(data, k, (0, 0, width, height))
