"""The crop-box JPEG decoder (mcallreduce/data/_jpegroi.c via mcallreduce.data.jpeg) and the
``turbo`` decoder of the transforms: bit-exact boxes, the same crops as the simplejpeg path,
fallbacks, corrupt input, the GIL released."""
import io
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import threading
import time

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from mcallreduce import config
from mcallreduce.data import settings
from mcallreduce.data import ImageStore, jpeg
from mcallreduce.data.photos import photo_paths
from mcallreduce.data.crop_boxes import centre_crop_box, random_resized_crop_box
from mcallreduce.data.decode import _scale_for, decode_crop, decoder_name, image_size
from mcallreduce.data.resize import _torch_resize_op
from mcallreduce.data.transforms import EvalTransform, TrainTransform

CAN_BUILD = os.path.exists("/usr/include/jpeglib.h") and shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc")


def test_extension_is_built_where_it_can_be():
    """setup.py builds it as an optional extension: here, with a compiler and jpeglib.h, it must be there."""
    if not CAN_BUILD:
        pytest.skip("no C compiler or /usr/include/jpeglib.h: the optional extension is not expected")
    assert jpeg.available, jpeg.import_error
    assert decoder_name("auto") == "turbo"


pytestmark_turbo = pytest.mark.skipif(not jpeg.available, reason="the _jpegroi extension is not built")


def encode(image: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", **kw)
    return buf.getvalue()


def random_boxes(rng, width, height, n):
    """Random boxes plus the awkward ones: whole image, 1x1 corners, edge rows and columns."""
    boxes = [(0, 0, width, height), (0, 0, 1, 1), (width - 1, height - 1, width, height),
             (width - 1, 0, width, height), (0, height - 1, width, height), (0, 0, width, 1)]
    for _ in range(n):
        left, top = rng.randrange(width), rng.randrange(height)
        boxes.append((left, top, rng.randint(left + 1, width), rng.randint(top + 1, height)))
    return boxes


@pytest.fixture(scope="module")
def store(packed):
    return ImageStore.open(packed[0], num_replicas=1, rank=0)


@pytest.fixture(scope="module")
def jpegs(store):
    """The photographs of the store that are JPEGs, as numpy views into the store (what the Dataset passes)."""
    out = [store.sample_bytes(i) for i in range(len(store))]
    return [b for b in out if bytes(b[:2]) == b"\xff\xd8"]


@pytest.fixture(scope="module")
def variants():
    """One photograph in every layout libjpeg treats differently: 4:4:4, 4:2:2, 4:2:0, greyscale,
    baseline and progressive, an odd size, and big enough (1283x965) for the 1/2..1/8 scales."""
    with Image.open(dict(photo_paths())["chelsea"]) as source:
        big = source.convert("RGB").resize((1283, 965), Image.BILINEAR)
    out = {}
    for progressive in (False, True):
        for subsampling in (0, 1, 2):
            out[f"sub{subsampling}-prog{int(progressive)}"] = encode(big, quality=90, subsampling=subsampling,
                                                                     progressive=progressive)
        out[f"grey-prog{int(progressive)}"] = encode(big.convert("L"), quality=90, progressive=progressive)
    return out


@pytestmark_turbo
def test_fixture_has_the_layouts_that_matter(jpegs):
    kinds = set()
    for b in jpegs:
        with Image.open(io.BytesIO(bytes(b))) as im:
            kinds.add((im.mode, bool(im.info.get("progressive"))))
    assert {("RGB", False), ("RGB", True), ("L", False), ("L", True)} <= kinds


@pytestmark_turbo
def test_box_is_bit_exact_against_the_full_decode(jpegs, variants):
    """Every box, at every scale, equals the same pixels of a whole-image decode: the same libjpeg
    build (jpeg.decode) exactly, and simplejpeg's build to within rounding (measured: exactly too)."""
    rng = random.Random(0)
    sources = [(bytes(b), (1,)) for b in jpegs[::4]] + [(b, (1, 2, 4, 8)) for b in variants.values()]
    diffs = []
    for data, scales in sources:
        width, height = jpeg.header(data)
        assert (width, height) == image_size(data, "simplejpeg")
        for k in scales:
            full = jpeg.decode(data, k)
            reference = simplejpeg.decode_jpeg(data, "RGB", min_factor=k, min_width=full.shape[1],
                                               min_height=full.shape[0])
            assert full.shape == reference.shape == (*jpeg.scaled_size(width, height, k)[::-1], 3)
            diffs.append(np.abs(full.astype(np.int16) - reference).mean())
            for box in random_boxes(rng, full.shape[1], full.shape[0], 6):
                got = jpeg.decode_box(data, k, box)
                assert got.shape == (box[3] - box[1], box[2] - box[0], 3) and got.flags.c_contiguous
                assert np.array_equal(got, full[box[1]:box[3], box[0]:box[2]]), (k, box, width, height)
    assert float(np.mean(diffs)) < 0.5 and float(np.max(diffs)) < 1.0


@pytestmark_turbo
def test_tiny_and_odd_images():
    rng = np.random.default_rng(1)
    for width, height in ((1, 1), (2, 1), (17, 9), (33, 65)):
        for mode in ("RGB", "L"):
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            data = encode(Image.fromarray(pixels).convert(mode), quality=95)
            assert jpeg.header(data) == (width, height)
            full = jpeg.decode(data)
            assert full.shape == (height, width, 3)
            assert np.array_equal(full, simplejpeg.decode_jpeg(data, "RGB"))
            for box in random_boxes(random.Random(width), width, height, 5):
                assert np.array_equal(jpeg.decode_box(data, 1, box), full[box[1]:box[3], box[0]:box[2]])
            # through the transform: a 1x1 box (or image) still gives a 224 px crop, same as simplejpeg
            for box in ((0, 0, 1, 1), (0, 0, width, height)):
                ours = decode_crop(data, box, (224, 224), "turbo", resizer="pil")
                theirs = decode_crop(data, box, (224, 224), "simplejpeg", resizer="pil")
                assert ours.shape == (3, 224, 224) and np.abs(ours.astype(int) - theirs).max() <= 1


@pytestmark_turbo
@pytest.mark.parametrize("resizer", ["torch", "pil"])
def test_decode_crop_matches_the_simplejpeg_path(jpegs, variants, resizer):
    """TrainTransform's crops (box, scale, flip) with decoder turbo vs simplejpeg: the same box semantics.
    The torch resizer gets the same whole-pixel box (identical results where the libjpeg outputs are);
    Pillow's fractional box is offset into the decoded region (float rounding: within 1 of 255)."""
    if resizer == "torch" and _torch_resize_op() is None:
        pytest.skip("torch's uint8 antialiased kernel not available here")
    rng = random.Random(2)
    diffs, worst, scales = [], 0, set()
    for data in [bytes(b) for b in jpegs[::3]] + list(variants.values()):
        width, height = image_size(data, "turbo")
        for _ in range(4):
            box = random_resized_crop_box(width, height, rng=rng)
            scales.add(_scale_for(width, height, box, (224, 224)))
            flip = rng.random() < 0.5
            ours = decode_crop(data, box, (224, 224), "turbo", (width, height), flip, resizer)
            theirs = decode_crop(data, box, (224, 224), "simplejpeg", (width, height), flip, resizer)
            assert ours.shape == (3, 224, 224) and ours.dtype == np.uint8 and ours.flags.c_contiguous
            d = np.abs(ours.astype(np.int16) - theirs)
            diffs.append(d.mean())
            worst = max(worst, int(d.max()))
    assert scales >= {1, 2}, scales     # crops decoded at full and at reduced scale
    assert float(np.mean(diffs)) < 0.5 and worst <= 8, (float(np.mean(diffs)), worst)
    if resizer == "torch":
        assert float(np.mean(diffs)) < 0.05


@pytestmark_turbo
def test_flip_and_the_transforms(jpegs):
    data = jpegs[7]
    width, height = image_size(data, "turbo")
    box = random_resized_crop_box(width, height, rng=random.Random(5))
    plain = decode_crop(data, box, (224, 224), "turbo")
    assert np.array_equal(decode_crop(data, box, (224, 224), "turbo", flip=True), plain[:, :, ::-1])
    for cls in (TrainTransform, EvalTransform):
        a = cls(decoder="turbo", normalize=False, **({"seed": 3} if cls is TrainTransform else {}))
        b = cls(decoder="simplejpeg", normalize=False, **({"seed": 3} if cls is TrainTransform else {}))
        for x in jpegs[:20]:
            ours, theirs = a(x), b(x)
            assert ours.shape == (3, 224, 224) and np.abs(ours.numpy().astype(int) - theirs.numpy()).mean() < 0.5
    box = centre_crop_box(width, height, 256, 224)
    assert decode_crop(data, box, (224, 224), "turbo").shape == (3, 224, 224)


@pytestmark_turbo
def test_any_buffer_is_accepted_without_copy(jpegs):
    view = jpegs[3]                      # a uint8 numpy view into the shared segment
    width, height = jpeg.header(view)
    box = (width // 4, height // 4, width // 2, height // 2)
    want = jpeg.decode_box(bytes(view), 1, box)
    for data in (view, memoryview(view), bytearray(view)):
        assert np.array_equal(jpeg.decode_box(data, 1, box), want)


@pytestmark_turbo
def test_bad_arguments_raise():
    data = encode(Image.new("RGB", (40, 30), (10, 200, 30)))
    out = np.empty((10, 10, 3), np.uint8)
    from mcallreduce.data import _jpegroi
    with pytest.raises(ValueError, match="does not fit"):
        jpeg.decode_box(data, 1, (35, 0, 45, 10))            # past the right edge
    with pytest.raises(ValueError, match="does not fit"):
        jpeg.decode_box(data, 2, (0, 0, 21, 10))              # 40/2 = 20 columns at 1/2
    with pytest.raises(ValueError, match="scale"):
        _jpegroi.decode(data, out, 3, 0, 0, 10, 10)
    with pytest.raises(ValueError, match="bad box"):
        _jpegroi.decode(data, out, 1, -1, 0, 10, 10)
    with pytest.raises(ValueError, match="output buffer"):
        _jpegroi.decode(data, out, 1, 0, 0, 11, 10)
    with pytest.raises((BufferError, TypeError, ValueError)):
        _jpegroi.decode(data, np.empty((10, 20, 3), np.uint8)[:, ::2], 1, 0, 0, 10, 10)   # not contiguous
    with pytest.raises(TypeError):
        _jpegroi.decode(data, bytes(300), 1, 0, 0, 10, 10)     # read-only
    with pytest.raises(TypeError):
        jpeg.header("not bytes")


@pytestmark_turbo
def test_cmyk_is_unsupported_and_falls_back():
    pixels = np.random.default_rng(3).integers(0, 256, (48, 64, 4), dtype=np.uint8)
    data = encode(Image.fromarray(pixels, "CMYK"), quality=95)
    with pytest.raises(jpeg.UnsupportedError, match="colour space"):
        jpeg.decode_box(data, 1, (0, 0, 8, 8))
    assert issubclass(jpeg.UnsupportedError, ValueError)
    box = (3.5, 2.0, 50.0, 40.5)
    ours = decode_crop(data, box, (32, 32), "turbo", resizer="pil")
    assert np.array_equal(ours, decode_crop(data, box, (32, 32), "simplejpeg", resizer="pil"))


@pytestmark_turbo
def test_corrupt_input_raises_or_falls_back_never_crashes(jpegs, photo_tree):
    data = bytes(jpegs[0])
    width, height = jpeg.header(data)
    truncated = data[: len(data) // 2]
    with pytest.raises(ValueError, match="Premature end"):      # libjpeg's warning, as an error
        jpeg.decode_box(truncated, 1, (0, height - 2, width, height))
    for bad in (b"", b"\xff\xd8", b"this is not a JPEG" * 10):
        with pytest.raises(ValueError):
            jpeg.header(bad)
        with pytest.raises(ValueError):
            jpeg.decode_box(bad, 1, (0, 0, 1, 1))
    # decode_crop on the truncated file: whatever the whole-image path does (Pillow raises on truncation)
    box = (0, 0, width, height)
    with pytest.raises(OSError) as theirs:
        decode_crop(truncated, box, (64, 64), "simplejpeg", (width, height))
    with pytest.raises(type(theirs.value)):
        decode_crop(truncated, box, (64, 64), "turbo", (width, height))
    # fuzz: flipped bytes and truncations give an array or a ValueError, nothing else
    rng = random.Random(4)
    sources = [bytes(b) for b in jpegs[:40:4]]
    outcomes = {"ok": 0, "error": 0}
    for _ in range(300):
        mutated = bytearray(rng.choice(sources))
        for _ in range(rng.randint(1, 6)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        if rng.random() < 0.3:
            mutated = mutated[: rng.randrange(len(mutated))]
        try:
            w, h = jpeg.header(mutated)
            k = rng.choice((1, 2, 4, 8))
            sw, sh = jpeg.scaled_size(w, h, k)
            if sw * sh > 1 << 24:        # a damaged header can claim 65500 x 65500: not worth the memory
                continue
            left, top = rng.randrange(sw), rng.randrange(sh)
            box = (left, top, rng.randint(left + 1, sw), rng.randint(top + 1, sh))
            assert jpeg.decode_box(mutated, k, box).shape == (box[3] - box[1], box[2] - box[0], 3)
            outcomes["ok"] += 1
        except ValueError:
            outcomes["error"] += 1
    assert outcomes["ok"] > 0 and outcomes["error"] > 0, outcomes


@pytestmark_turbo
def test_decode_releases_the_gil():
    """While one thread is inside a long decode (~0.1 s), another thread keeps running Python code.
    Held, the GIL would stop it for the whole call: at most a switch interval (5 ms) at either end,
    so the check looks at the middle half of the call only."""
    with Image.open(dict(photo_paths())["astronaut"]) as source:
        data = encode(source.convert("RGB").resize((8000, 6000), Image.BILINEAR), quality=95)
    width, height = jpeg.header(data)
    for attempt in range(3):
        stamps, stop, calls = [], threading.Event(), []

        def spin():
            while not stop.is_set():
                stamps.append(time.perf_counter())

        spinner = threading.Thread(target=spin)
        spinner.start()
        try:
            time.sleep(0.01)
            start = time.perf_counter()
            jpeg.decode_box(data, 1, (0, 0, width, height))
            calls.append((start, time.perf_counter()))
        finally:
            stop.set()
            spinner.join()
        start, end = calls[0]
        quarter = (end - start) / 4
        inside = sum(1 for t in stamps if start + quarter < t < end - quarter)
        if end - start > 0.04 and inside >= 3:
            return
    pytest.fail(f"the other thread ran {inside} times in the middle of a {end - start:.3f} s decode")


def test_config_and_fallback_without_the_extension(monkeypatch):
    monkeypatch.setenv("MCALLREDUCE_DATA_DECODER", "turbo")
    assert settings.data.decoder() == "turbo"
    monkeypatch.setenv("MCALLREDUCE_DATA_DECODER", "libjpeg")
    with pytest.raises(config.ConfigError, match="turbo"):
        settings.data.decoder()
    monkeypatch.delenv("MCALLREDUCE_DATA_DECODER")
    with pytest.raises(ValueError, match="decoder must be one of"):
        decoder_name("libjpeg")
    monkeypatch.setattr(jpeg, "available", False)
    assert decoder_name("auto") == "simplejpeg"
    with pytest.raises(ImportError, match="turbo"):
        decoder_name("turbo")
    # a fresh interpreter where the extension cannot be imported: jpeg.py says so, auto picks simplejpeg
    code = ("import sys; sys.modules['mcallreduce.data._jpegroi'] = None\n"
            "from mcallreduce.data import jpeg, transforms\n"
            "assert not jpeg.available and jpeg.import_error is not None\n"
            "assert transforms.decoder_name() == 'simplejpeg'\n"
            "import io; from PIL import Image; b = io.BytesIO(); Image.new('RGB', (300, 200)).save(b, 'JPEG')\n"
            "assert transforms.TrainTransform(seed=0)(b.getvalue()).shape == (3, 224, 224)\n")
    env = {k: v for k, v in os.environ.items() if k != "MCALLREDUCE_DATA_DECODER"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
