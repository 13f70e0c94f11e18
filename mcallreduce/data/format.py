"""The packed store file: encoded images back to back, plus a small index.

Layout (little-endian; every section starts at a multiple of 8 bytes)::

    [0, 4096)        header, see HEADER below; the rest of the page is zero
    [4096, ...)      blob: the files' bytes, unchanged, one after the other
    offsets          int64[N+1]: sample i is blob[offsets[i]:offsets[i+1]]
    labels           int32[N]:   class index of sample i (ImageFolder's)
    crcs             uint32[N]:  zlib.crc32 of sample i's bytes
    classes          UTF-8 JSON list of class names, in index order
    paths            UTF-8, '\\n'-joined paths relative to the source root

The header carries a CRC32 of itself and one of the five index sections, so a
truncated or damaged file is refused when opened; the per-sample CRCs let a host
check exactly the samples it loads. The blob starts page-aligned so it can be
mapped or read straight into a shared segment.

Sample order and labels follow torchvision's ImageFolder: class folders sorted
by name, files sorted within each (walking sub-folders), filtered by extension.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import multiprocessing
import os
import struct
import sys
import tempfile
import zlib
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..cgroups import usable_cores
from . import progress as progress_bar

MAGIC = b"MCIMSTOR"
VERSION = 1
BLOB_START = 4096
# magic, version, header size, N, classes, blob offset, blob bytes, then
# (offset, bytes) of offsets, labels, crcs, classes, paths; index CRC; header CRC.
HEADER = struct.Struct("<8sIIQQQQ" + "QQ" * 5 + "II")

# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class StoreFormatError(ValueError):
    """The file is not a store, or it is damaged."""


class CorruptImageError(ValueError):
    """A source file is not a decodable image (raised when packing with on_error='abort')."""


@dataclass
class FolderIndex:
    """What ImageFolder would see in a tree: sample paths, labels, class names."""
    root: str
    classes: List[str]
    paths: List[str]          # relative to root
    labels: np.ndarray        # int32

    def __len__(self) -> int:
        return len(self.paths)


def scan_image_folder(root: str, extensions: Sequence[str] = IMG_EXTENSIONS) -> FolderIndex:
    """List an ImageFolder tree in ImageFolder's order; errors as ImageFolder raises them."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"no such directory: {root}")
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {root}: an ImageFolder tree "
                                f"has one sub-folder per class (root/CLASS/IMAGE.jpg)")
    exts = tuple(e.lower() for e in extensions)
    paths: List[str] = []
    labels: List[int] = []
    empty = []
    for index, name in enumerate(classes):
        before = len(paths)
        class_dir = os.path.join(root, name)
        for dirpath, _, filenames in sorted(os.walk(class_dir, followlinks=True)):
            for filename in sorted(filenames):
                if filename.lower().endswith(exts):
                    paths.append(os.path.relpath(os.path.join(dirpath, filename), root))
                    labels.append(index)
        if len(paths) == before:
            empty.append(name)
    if empty:
        raise FileNotFoundError(f"Found no valid file for the classes {', '.join(sorted(empty))} in {root}. "
                                f"Supported extensions are: {', '.join(exts)}")
    return FolderIndex(root, classes, paths, np.asarray(labels, dtype=np.int32))


def check_image(data: bytes, check: str = "decode") -> Optional[str]:
    """None when ``data`` is a usable image, else the reason it is not.

    'decode' decodes every entropy-coded byte (for JPEG at 1/8 scale via draft
    mode, which is cheap) so truncated files are caught; 'header' only parses
    the header; 'none' accepts anything.
    """
    if check == "none":
        return None
    from PIL import Image
    try:
        with Image.open(io.BytesIO(data)) as image:
            if check == "header":
                image.verify()
                return None
            if image.format == "JPEG":
                image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))
            image.load()
            if image.width < 1 or image.height < 1:
                return "empty image"
    except Image.UnidentifiedImageError:
        return "not an image in a format Pillow recognises" if data else "empty file"
    except Exception as exc:  # Pillow raises many types for bad input
        return f"{type(exc).__name__}: {exc}"
    return None


def _read_and_check(job: Tuple[str, List[str], str]) -> List[Tuple[Optional[bytes], Optional[str]]]:
    root, paths, check = job
    out = []
    for rel in paths:
        try:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
        except OSError as exc:
            out.append((None, f"cannot read: {exc}"))
            continue
        reason = check_image(data, check)
        out.append((None, reason) if reason else (data, None))
    return out


@dataclass
class PackReport:
    path: str
    num_samples: int
    num_classes: int
    blob_bytes: int
    skipped: List[Tuple[str, str]] = field(default_factory=list)   # (path, reason)


_UNGUARDED = ("mcallreduce.data pack: its worker processes died. Each one imports the main script, so a "
              "script must call pack() under `if __name__ == \"__main__\":` (or pass workers=1)")


def pack(src: str, dst: str, *, workers: Optional[int] = None, on_error: str = "skip",
         check: str = "decode", batch: int = 64, progress: Optional[bool] = None) -> PackReport:
    """Pack the ImageFolder tree ``src`` into the store file ``dst``, atomically.

    Files are read and checked by ``workers`` processes; the parent writes them
    in ImageFolder order to a temporary file beside ``dst`` and renames it into
    place only when complete, so ``dst`` is either the old file or the new one.
    A file that is not a decodable image is reported on stderr and skipped
    (``on_error='skip'``) or aborts the pack (``'abort'``: CorruptImageError).
    """
    if on_error not in ("skip", "abort"):
        raise ValueError(f"on_error must be 'skip' or 'abort', got {on_error!r}")
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # a spawned worker importing an unguarded script: stop before creating a file its parent's pool would kill
        raise RuntimeError(_UNGUARDED)
    index = scan_image_folder(src)
    workers = workers or max(1, math.ceil(usable_cores()))   # a container's or batch job's cores, not the machine's
    jobs = [(index.root, index.paths[i:i + batch], check) for i in range(0, len(index), batch)]
    dst = os.path.abspath(dst)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(dst) + ".", suffix=".tmp", dir=os.path.dirname(dst))
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)   # mkstemp creates 0600; the store is an ordinary data file
    kept: List[int] = []
    sizes: List[int] = []
    crcs: List[int] = []
    skipped: List[Tuple[str, str]] = []
    try:
        with os.fdopen(fd, "wb") as out, progress_bar.bar(len(index), "packing", "img", show=progress) as bar:
            out.write(b"\0" * BLOB_START)
            with contextlib.closing(_read_all(jobs, workers)) as results:
                position = 0
                for results_batch in results:
                    for data, reason in results_batch:
                        i = position
                        position += 1
                        if reason is not None:
                            path = os.path.join(index.root, index.paths[i])
                            if on_error == "abort":
                                raise CorruptImageError(f"{path}: {reason}")
                            skipped.append((path, reason))
                            print(f"mcallreduce.data pack: skipping {path}: {reason}", file=sys.stderr)
                            continue
                        out.write(data)
                        kept.append(i)
                        sizes.append(len(data))
                        crcs.append(zlib.crc32(data))
                    bar.update(len(results_batch))
            labels = index.labels[np.asarray(kept, dtype=np.int64)] if kept else np.zeros(0, np.int32)
            lost = sorted(set(range(len(index.classes))) - set(np.unique(labels).tolist()))
            if lost:
                names = ", ".join(index.classes[c] for c in lost)
                raise FileNotFoundError(f"no decodable image left in the classes {names} of {index.root}")
            offsets = np.zeros(len(kept) + 1, dtype=np.int64)
            np.cumsum(sizes, out=offsets[1:])
            _write_index(out, offsets, labels, np.asarray(crcs, dtype=np.uint32), index.classes,
                         [index.paths[i] for i in kept])
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dst)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(os.path.dirname(dst))
    return PackReport(dst, len(kept), len(index.classes), int(offsets[-1]), skipped)


def _read_all(jobs: list, workers: int) -> Iterator[list]:
    """Each job's files read and checked, in order: by ``workers`` spawned processes, or here."""
    if workers <= 1:
        yield from map(_read_and_check, jobs)
        return
    # spawn, not fork: packing may be called from an MPI or threaded program
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        yield from pool.map(_read_and_check, jobs)
    except BrokenProcessPool as exc:
        raise RuntimeError(_UNGUARDED) from exc
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_index(out, offsets: np.ndarray, labels: np.ndarray, crcs: np.ndarray,
                 classes: Sequence[str], paths: Sequence[str]) -> None:
    """Append the index sections after the blob, then fill in the header."""
    sections = [offsets.astype("<i8").tobytes(), labels.astype("<i4").tobytes(), crcs.astype("<u4").tobytes(),
                json.dumps(list(classes)).encode(), "\n".join(paths).encode()]
    blob_bytes = int(offsets[-1])
    where = BLOB_START + blob_bytes
    places = []
    index_crc = 0
    for data in sections:
        pad = (-where) % 8
        out.write(b"\0" * pad)
        where += pad
        places += [where, len(data)]
        out.write(data)
        index_crc = zlib.crc32(data, index_crc)
        where += len(data)
    fields = [MAGIC, VERSION, BLOB_START, len(labels), len(classes), BLOB_START, blob_bytes, *places, index_crc]
    head = HEADER.pack(*fields, 0)
    head = HEADER.pack(*fields, zlib.crc32(head[:-4]))
    out.seek(0)
    out.write(head)


class StoreFile:
    """A packed store opened for reading: the index in memory, the blob on disk."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            head = f.read(HEADER.size)
            if len(head) < HEADER.size or head[:8] != MAGIC:
                raise StoreFormatError(f"{self.path}: not an mcallreduce image store (bad magic)")
            fields = HEADER.unpack(head)
            if fields[-1] != zlib.crc32(head[:-4]):
                raise StoreFormatError(f"{self.path}: header checksum mismatch (damaged file)")
            magic, version, _hsize, n, ncls, self.blob_offset, self.blob_bytes = fields[:7]
            if version != VERSION:
                raise StoreFormatError(f"{self.path}: format version {version}, this code reads {VERSION}")
            places = fields[7:17]
            sections = []
            index_crc = 0
            for k in range(5):
                f.seek(places[2 * k])
                data = f.read(places[2 * k + 1])
                if len(data) != places[2 * k + 1]:
                    raise StoreFormatError(f"{self.path}: truncated file")
                index_crc = zlib.crc32(data, index_crc)
                sections.append(data)
            if index_crc != fields[17]:
                raise StoreFormatError(f"{self.path}: index checksum mismatch (damaged file)")
        self.num_samples = n
        self.offsets = np.frombuffer(sections[0], dtype="<i8").astype(np.int64)
        self.labels = np.frombuffer(sections[1], dtype="<i4").astype(np.int32)
        self.crcs = np.frombuffer(sections[2], dtype="<u4").astype(np.uint32)
        self.classes: List[str] = json.loads(sections[3].decode())
        self._paths = sections[4]
        if len(self.offsets) != n + 1 or len(self.labels) != n or len(self.classes) != ncls \
                or self.offsets[-1] != self.blob_bytes:
            raise StoreFormatError(f"{self.path}: inconsistent index")

    @property
    def paths(self) -> List[str]:
        """Source paths relative to the packed root (decoded on demand: it is large for ImageNet)."""
        return self._paths.decode().split("\n") if self.num_samples else []

    def __len__(self) -> int:
        return self.num_samples

    def read_sample(self, i: int) -> bytes:
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        with open(self.path, "rb") as f:
            f.seek(self.blob_offset + start)
            return f.read(stop - start)


def read_ranges(path: str, file_offset: int, ranges: Iterable[Tuple[int, int, int]], out: np.ndarray,
                on_bytes=None) -> None:
    """Copy each (source start, length, destination start) of a file into ``out`` (no extra copy)."""
    view = memoryview(out).cast("B")
    with open(path, "rb", buffering=0) as f:
        for start, length, dest in ranges:
            done = 0
            while done < length:
                step = min(length - done, 64 << 20)
                got = os.preadv(f.fileno(), [view[dest + done:dest + done + step]], file_offset + start + done)
                if got <= 0:
                    raise StoreFormatError(f"{path}: unexpected end of file at byte {file_offset + start + done}")
                done += got
                if on_bytes is not None:
                    on_bytes(got)
