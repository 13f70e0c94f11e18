"""The in-memory image store: each host's share of the encoded images, in one shared segment.

    store = ImageStore.open("imagenet-train.mcstore")      # or an ImageFolder directory
    data = store.sample_bytes(i)                            # a uint8 view, no copy

Every rank of a host maps the same segment, which holds the whole index
(offsets, labels, where each held sample lies) and the host's share of the
JPEG bytes, so the host's memory holds one copy whatever its number of ranks.
The index is flat numpy arrays: DataLoader workers share it without
copy-on-write (no Python lists of bytes or paths).

Opening is collective over all ranks (under MPI): rank 0 reads the index and
broadcasts it, each host checks its memory budget before allocating, and the
ranks of a host load disjoint parts of the share in parallel.
"""
from __future__ import annotations

import os
import zlib
from typing import List, Optional, Tuple

import numpy as np

from .settings import data as settings
from ..errors import ConfigError, MemoryBudgetError
from ..units import format_bytes
from . import world as world_mod
from .format import StoreFile, read_ranges, scan_image_folder
from .partition import owner_of_samples
from . import progress as progress_bar
from .board import Board
from .shm import SharedSegment, held_bytes


class StoreCorruptError(ValueError):
    """Loaded bytes do not match the checksums written by ``pack``."""


def available_memory() -> Tuple[int, str]:
    """(bytes, where the limit comes from): the least of what the host, its cgroup,
    /dev/shm and MCALLREDUCE_DATA_MEMORY_LIMIT allow."""
    candidates = []
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    candidates.append((info.get("MemAvailable", info["MemFree"]), "MemAvailable in /proc/meminfo"))
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = open(limit_file).read().strip()
            if limit != "max" and int(limit) < 1 << 60:
                candidates.append((int(limit) - int(open(usage_file).read()), f"cgroup limit {limit_file}"))
            break
        except (OSError, ValueError):
            continue
    if os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        candidates.append((st.f_bavail * st.f_frsize, "free space in /dev/shm"))
    cap = settings.memory_limit()
    if cap is not None:   # the other limits see what is held already; this one is told
        held = held_bytes()
        candidates.append((cap - held, "MCALLREDUCE_DATA_MEMORY_LIMIT" +
                           (f", less the {format_bytes(held)} the data package holds here" if held else "")))
    return min(candidates)


def check_memory_budget(needed: int, what: str, suggestion: str) -> None:
    """Raise MemoryBudgetError before allocating ``needed`` bytes the host cannot spare."""
    available, source = available_memory()
    usable = int(available * settings.memory_fraction())
    if needed > usable:
        raise MemoryBudgetError(
            f"mcallreduce.data: {what} needs {format_bytes(needed)} ({needed:,} bytes) but only {format_bytes(usable)} "
            f"may be used on this host ({settings.memory_fraction():.0%} of {format_bytes(available)} available, "
            f"limited by {source}). {suggestion}")


def _read_index(source: str) -> dict:
    """The dataset's index from a packed store file or an ImageFolder tree."""
    if os.path.isdir(source):
        index = scan_image_folder(source)
        sizes = np.fromiter((os.stat(os.path.join(index.root, p)).st_size for p in index.paths),
                            dtype=np.int64, count=len(index))
        offsets = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        return dict(kind="folder", offsets=offsets, labels=index.labels, crcs=None,
                    classes=index.classes, paths=index.paths, root=index.root, blob_offset=0)
    f = StoreFile(source)
    return dict(kind="packed", offsets=f.offsets, labels=f.labels, crcs=f.crcs, classes=f.classes,
                paths=None, root=None, blob_offset=f.blob_offset)


def _runs(ids: np.ndarray) -> List[Tuple[int, int]]:
    """Sorted ids -> [(first, stop)) runs of consecutive ids."""
    if len(ids) == 0:
        return []
    breaks = np.nonzero(np.diff(ids) != 1)[0] + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(ids)]])
    return [(int(ids[a]), int(ids[b - 1]) + 1) for a, b in zip(starts, stops)]


def _cache_views(segment, count: int):
    """(ids, positions, bytes) of an epoch's samples: int64[count], int64[count], then the bytes."""
    seg = segment.array if segment is not None else np.zeros(0, dtype=np.uint8)
    return seg[:8 * count].view(np.int64), seg[8 * count:16 * count].view(np.int64), seg[16 * count:]


def _index_layout(n: int):
    """Byte offsets of the segment's index for n samples: labels start, positions start, blob start
    (int64 offsets[n+1], int32 labels[n] padded to 8 bytes, int64 positions[n])."""
    cut1 = 8 * (n + 1)
    cut2 = cut1 + 8 * ((4 * n + 7) // 8)
    return cut1, cut2, cut2 + 8 * n


class ImageStore:
    """A host's share of an image dataset, held in RAM and shared by the host's ranks."""

    @classmethod
    def open(cls, source: str, *, num_replicas: Optional[int] = None, rank: Optional[int] = None,
             ranks_per_host: Optional[int] = None, partition: Optional[str] = None,
             verify: Optional[bool] = None, progress: Optional[bool] = None) -> "ImageStore":
        """Load ``source`` (a file written by ``pack`` or an ImageFolder tree); collective under MPI.

        ``partition``: 'split' (default: each host holds its share, proportional to
        its ranks), 'full' (every host holds everything), or 'auto' (full when it
        fits in the memory budget, else split).
        """
        world = world_mod.current(num_replicas, rank, ranks_per_host)
        return cls(os.fspath(source), world, partition or settings.partition(),
                   settings.verify() if verify is None else verify, progress)

    def __init__(self, source: str, world, partition: str, verify: bool, progress: Optional[bool]):
        if world.comm is None and world.layout.num_replicas > 1:
            raise RuntimeError(
                f"mcallreduce.data: an ImageStore of {world.layout.num_replicas} ranks needs MPI: a host's ranks "
                "share one copy and split its loading over MPI, and without it every process would load "
                "the whole set alone. Launch with mpirun or horovodrun (not torchrun), or open the store "
                "with num_replicas=1, rank=0 and pass the world to InMemoryDistributedSampler")
        self.source, self.world, self.layout = source, world, world.layout
        index, error = None, None
        if self.layout.rank == 0:
            try:
                index = _read_index(source)
            except Exception as exc:
                error = exc
        index, error = world.world_bcast((index, error))
        if error is not None:
            raise error
        self.classes: List[str] = index["classes"]
        self.num_samples = len(index["labels"])
        offsets, labels = index["offsets"], index["labels"]
        self.owner = owner_of_samples(labels, self.layout.ranks_per_host_array())
        host = self.layout.host

        # Decide what this host holds, and check that it fits, before allocating anything.
        index_bytes = _index_layout(self.num_samples)[2]
        share_ids = np.nonzero(self.owner == host)[0]
        share_bytes = int((offsets[share_ids + 1] - offsets[share_ids]).sum())
        full_bytes = int(offsets[-1])
        decision = None
        if world.is_leader:
            try:
                hosts = self.layout.num_hosts
                if partition == "auto":
                    try:
                        check_memory_budget(full_bytes + index_bytes, "a full copy", "")
                        partition = "full"
                    except MemoryBudgetError:
                        partition = "split"
                needed = (full_bytes if partition == "full" or hosts == 1 else share_bytes) + index_bytes
                what = (f"the image store ({'a full copy' if partition == 'full' else f'host {host} share of 1/{hosts}'}"
                        f" of {format_bytes(full_bytes)} of images, plus a {format_bytes(index_bytes)} index)")
                check_memory_budget(needed, what,
                                    "Run on more hosts (each holds its share), use partition='split' if you asked "
                                    "for 'full', or raise MCALLREDUCE_DATA_MEMORY_LIMIT / _MEMORY_FRACTION.")
                decision = (partition, None)
            except (MemoryBudgetError, ConfigError) as exc:   # the host's other ranks wait for the decision
                decision = (partition, exc)
        partition, error = world.host_bcast(decision)
        self.holds_all = partition == "full" or self.layout.num_hosts == 1
        held_ids = np.arange(self.num_samples) if self.holds_all else share_ids
        blob_bytes = full_bytes if self.holds_all else share_bytes
        # Which hosts hold everything (needed to plan exchanges), and any host's refusal: every
        # rank of every host raises, rather than the other hosts waiting in their next collective.
        decided = world.comm.allgather((self.holds_all, error)) if world.comm is not None else [(self.holds_all, error)]
        refused = [e for _, e in decided if e is not None]
        if refused:
            raise error or refused[0]
        self.host_holds_all = np.array([decided[r[0]][0] for r in
                                        (self.layout.ranks_of(h) for h in range(self.layout.num_hosts))])

        problem, own = None, None
        try:   # raises on every rank of the host or on none (shm.py)
            self.segment = SharedSegment(world, index_bytes + blob_bytes)
        except (MemoryError, OSError) as exc:
            problem, own = f"rank {self.layout.rank}: {type(exc).__name__}: {exc}", exc
        if problem is None:
            self._map_segment()
            sizes = offsets[1:] - offsets[:-1]
            if world.is_leader:
                self.offsets[:] = offsets
                self.labels[:] = labels
                self.position[:] = -1
                self.position[held_ids] = np.concatenate([[0], np.cumsum(sizes[held_ids])[:-1]]) if len(held_ids) else []
            world.host_barrier()
            try:
                mine = self._my_part(held_ids, sizes)
                problem = self._load(mine, index, progress)
                if problem is None and verify and index["crcs"] is not None:
                    problem = self._verify(mine, index)
            except Exception as exc:
                problem = f"rank {self.layout.rank}: {type(exc).__name__}: {exc}"
        # every host's outcome, so that one host's failure is every rank's error, not a hang
        problems = world.comm.allgather(problem) if world.comm is not None else [problem]
        problems = [p for p in problems if p]
        if problems:
            self.close()
            if own is not None:
                raise own
            raise StoreCorruptError(f"loading {source} failed: " + "; ".join(problems))
        self.share_ids = held_ids
        self.blob_bytes = blob_bytes
        # Keep only flat arrays: a Python list of 1.28M paths would be copied into every forked worker.
        self._paths = np.array(index["paths"], dtype="S") if index["paths"] is not None else None
        # The samples received for this epoch (exchange.py), in a segment of this rank's own that
        # the board names, so that persistent DataLoader workers follow each epoch's.
        self._cache_board = Board(pid=-1, fd=-1, size=0, count=0)
        self._cache_segment: Optional[SharedSegment] = None
        self._use_epoch_cache(None, 0, self._cache_board.version)
        self.epoch_prepared: Optional[tuple] = None

    def _my_part(self, held_ids: np.ndarray, sizes: np.ndarray) -> List[Tuple[int, int]]:
        """This rank's runs of held ids: the host's runs cut into pieces, dealt by bytes."""
        pieces = []
        limit = 32 << 20
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        for first, stop in _runs(held_ids):
            start = first
            while start < stop:   # cut long runs so the ranks of a host get similar work
                end = max(start + 1, int(np.searchsorted(offsets, offsets[start] + limit, side="right")) - 1)
                end = min(end, stop)
                pieces.append((start, end))
                start = end
        local, size = self.layout.local_rank, self.layout.local_size
        return pieces[local::size]

    def _load(self, pieces, index, progress) -> Optional[str]:
        offsets = index["offsets"]
        total = sum(int(offsets[b] - offsets[a]) for a, b in pieces)
        show = progress if self.layout.rank == 0 else False     # one bar for the job, as Horovod's examples
        with progress_bar.bar(total, f"loading store (host {self.layout.host})", "B", show=show) as bar:
            if index["kind"] == "packed":
                ranges = [(int(offsets[a]), int(offsets[b] - offsets[a]), int(self.position[a])) for a, b in pieces]
                read_ranges(self.source, index["blob_offset"], ranges, self.blob, on_bytes=bar.update)
                return None
            view = memoryview(self.blob)
            for a, b in pieces:
                for i in range(a, b):
                    path = os.path.join(index["root"], index["paths"][i])
                    want = int(offsets[i + 1] - offsets[i])
                    with open(path, "rb", buffering=0) as f:
                        got = f.readinto(view[self.position[i]:self.position[i] + want])
                        if got != want or f.read(1):
                            return f"{path} changed size while loading ({want} bytes when listed)"
                    bar.update(want)
        return None

    def _verify(self, pieces, index) -> Optional[str]:
        bad = []
        crcs = index["crcs"]
        for a, b in pieces:
            for i in range(a, b):
                if zlib.crc32(self.sample_bytes(i)) != crcs[i]:
                    bad.append(i)
        if bad:
            return f"{len(bad)} sample(s) fail their CRC32 check, e.g. ids {bad[:5]}: the store file is damaged; repack it"
        return None

    # --- access -------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_samples

    def sample_size(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def holds(self, i: int) -> bool:
        return self.position[i] >= 0

    def sample_bytes(self, i: int) -> np.ndarray:
        """The encoded image of sample ``i`` as a uint8 view (no copy)."""
        size = self.offsets[i + 1] - self.offsets[i]
        p = self.position[i]
        if p >= 0:
            return self.blob[p:p + size]
        if self._cache_board.version != self._cache_version:   # a DataLoader worker: the rank exchanged since
            self._follow_epoch_cache()
        k = np.searchsorted(self._cache_ids, i)
        if k < len(self._cache_ids) and self._cache_ids[k] == i:
            p = self._cache_pos[k]
            return self._cache[p:p + size]
        if self.epoch_prepared is None:
            raise KeyError(f"sample {i} is not held on host {self.layout.host}: the store is split across hosts "
                           f"(partition 'split') and no samples were exchanged. Either the sampler draws from "
                           f"the whole set (a stock DistributedSampler does: iterate with "
                           f"InMemoryDistributedSampler, shuffle=False for validation, or open the store with "
                           f"partition='full'), or InMemoryDistributedSampler's set_epoch(epoch) was not called "
                           f"on every rank before the DataLoader's workers started")
        raise KeyError(f"sample {i} is not held on host {self.layout.host} and was not exchanged for this epoch: "
                       f"call sampler.set_epoch(epoch) on every rank before iterating")

    def sample_path(self, i: int) -> str:
        """Where sample i came from (relative to the packed root), for error messages."""
        if self._paths is not None:
            return self._paths[i].decode()
        return StoreFile(self.source).paths[i] if os.path.isfile(self.source) else f"sample {i}"

    # --- the samples received for an epoch (exchange.py) -----------------------------------
    @staticmethod
    def new_epoch_cache(count: int, nbytes: int) -> Tuple[SharedSegment, np.ndarray, np.ndarray, np.ndarray]:
        """A segment for ``count`` samples of ``nbytes`` in all: it and its views (ids, positions, bytes)."""
        segment = SharedSegment(None, 16 * count + nbytes, tag="epoch")
        return (segment,) + _cache_views(segment, count)

    def install_epoch_cache(self, segment: Optional[SharedSegment], count: int) -> None:
        """This epoch's samples (ids sorted), or none; its workers follow at their next miss."""
        pid, fd = segment.where if segment is not None else (-1, -1)
        self._cache_board.publish(pid=pid, fd=fd, size=segment.size if segment is not None else 0, count=count)
        self._use_epoch_cache(segment, count, self._cache_board.version)

    def _follow_epoch_cache(self) -> None:
        version, fields = self._cache_board.snapshot()
        segment = SharedSegment.attach(fields["pid"], fields["fd"], fields["size"]) if fields["pid"] >= 0 else None
        self._use_epoch_cache(segment, fields["count"], version)

    def _use_epoch_cache(self, segment: Optional[SharedSegment], count: int, version: int) -> None:
        old, self._cache_segment = self._cache_segment, segment
        self._cache_version = version
        self._cache_ids, self._cache_pos, self._cache = _cache_views(segment, count)
        if old is not None:
            if old.owner_pid == os.getpid():   # the rank's own: its idle persistent workers still map it
                old.release_pages()
            old.close()

    @property
    def cache_bytes(self) -> int:
        return len(self._cache)

    def resident_bytes(self) -> int:
        """Bytes of this host's segment (index + images)."""
        return self.segment.size

    def close(self) -> None:
        for name in ("offsets", "labels", "position", "blob"):
            setattr(self, name, None)
        self.segment.close() if hasattr(self, "segment") else None
        if getattr(self, "_cache_board", None) is not None:
            self._use_epoch_cache(None, 0, -1)
            self._cache_board.segment.close()

    # Pickled into DataLoader workers: the segments re-attach, the small index does not travel.
    def __getstate__(self):
        state = self.__dict__.copy()
        for name in ("offsets", "labels", "position", "blob", "world", "_cache_segment", "_cache_ids",
                     "_cache_pos", "_cache"):
            state.pop(name, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.world = None
        self._map_segment()
        self._cache_segment = None
        self._follow_epoch_cache()

    def _map_segment(self) -> None:
        """Views of the shared segment: offsets, labels, positions, then the JPEG blob."""
        seg = self.segment.array
        n = self.num_samples
        cut1, cut2, index_bytes = _index_layout(n)
        self.offsets = seg[:cut1].view(np.int64)
        self.labels = seg[cut1:cut1 + 4 * n].view(np.int32)
        self.position = seg[cut2:cut2 + 8 * n].view(np.int64)
        self.blob = seg[index_bytes:]
