"""Shared memory segments (one per host, or one process's for its DataLoader workers) which
cannot outlive the processes using them.

The host's first rank creates a file in /dev/shm and reserves its pages
(posix_fallocate: a too-small /dev/shm fails here with ENOSPC rather than with
SIGBUS on first touch); the other ranks of the host open and map it; then,
once all have mapped it, the name is unlinked. From then on the memory belongs
to the open mappings alone: the kernel frees it when the last process using it
exits, however it exits (exception, signal, SIGKILL); before that, SIGTERM unlinks the
name first. A SIGKILL in that moment leaves the file; the next segment made on the host
removes it (:func:`remove_leftovers`). Nothing is registered
with multiprocessing's resource_tracker, so its at-exit unlinking and "leaked
shared_memory" warnings (bpo-39959; ``track=False`` arrived only in 3.13) do not
apply.

DataLoader workers started by fork inherit the mapping. Workers started by
spawn or forkserver unpickle the segment by opening ``/proc/<pid>/fd/<fd>`` of
the rank that still holds the descriptor, which reaches the unlinked file.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import secrets
import signal
import threading
import time
import weakref
from typing import Optional

import numpy as np

from ..errors import MemoryBudgetError

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
NAME_PREFIX = "mcallreduce-data-"
_HELD: "weakref.WeakSet[SharedSegment]" = weakref.WeakSet()   # the segments this process made or joined
LEFTOVER_AGE_S = 60.0   # a segment's name lives while the host's ranks map it: seconds, not minutes


def _directory() -> str:
    import tempfile
    return SHM_DIR or tempfile.gettempdir()


def _new_path(tag: str) -> str:
    return os.path.join(_directory(), f"{NAME_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(6)}")


def remove_leftovers(directory: Optional[str] = None, min_age_s: float = LEFTOVER_AGE_S) -> list:
    """Unlink the segments that a SIGKILL left named: this user's, older than ``min_age_s``, and
    locked by no one (the creator holds a shared flock for the segment's life, which its death
    releases, whatever PID namespace it ran in); returns their paths."""
    directory = directory or _directory()
    removed = []
    for entry in os.scandir(directory):
        if not entry.name.startswith(NAME_PREFIX):
            continue
        with contextlib.suppress(OSError):
            info = entry.stat(follow_symlinks=False)
            if info.st_uid != os.getuid() or time.time() - info.st_mtime < min_age_s:
                continue
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # BlockingIOError (an OSError): its creator lives
                os.unlink(entry.path)
                removed.append(entry.path)
            finally:
                os.close(fd)
    return removed


class _unlinked_on_sigterm:
    """While the segment has a name (until every rank of the host mapped it), SIGTERM, which
    mpirun sends to end a job, unlinks it before the previous handling runs. Its Python
    handler runs only between bytecodes, so the host's barrier waits in naps (world.py)."""

    def __init__(self, path: str):
        self.path, self.previous = path, None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        self.restore()
        signal.raise_signal(signum)

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None


def held_bytes() -> int:
    """Bytes of the segments this process made or joined and still holds: the host's shared stores
    (one copy for the host, which every rank of it maps) and this rank's own epoch caches."""
    return sum(segment.size for segment in list(_HELD))


class SharedSegment:
    """``size`` bytes shared by the ranks of one host (a single process without MPI); with
    ``world`` None, by this process and its DataLoader workers alone."""

    def __init__(self, world, size: int, tag: str = "store"):
        self.size = int(size)
        self.name: Optional[str] = None
        path, error = None, None
        leader = world is None or world.is_leader
        named = _unlinked_on_sigterm(_new_path(tag)) if leader else None
        if leader:
            remove_leftovers()
            try:
                path = self._create(named.path)
            except OSError as exc:
                named.restore()
                error = (f"cannot reserve {self.size:,} bytes of shared memory in {SHM_DIR or 'the temp dir'} "
                         f"({exc.strerror}); free space there is limited by its size "
                         f"(in Docker, run with --shm-size=...)")
        if world is not None:
            path, error = world.host_bcast((path, error))
        if error:
            raise MemoryBudgetError(error)
        failure = None
        try:
            if not leader:
                self.fd = os.open(path, os.O_RDWR)
            self._map()
        except OSError as exc:
            failure = exc
        finally:
            # Every rank has now opened (or failed to open) the file: drop the name.
            if world is not None:
                world.host_barrier()
            if leader:
                with contextlib.suppress(FileNotFoundError):   # a SIGTERM handler that returned unlinked it
                    os.unlink(path)
                named.restore()
        self.owner_pid = os.getpid()
        _HELD.add(self)
        # one rank's failure is the host's: its peers would otherwise wait for it in the store's next step
        if (world.host_any(failure is not None) if world is not None else failure is not None):
            self.close()
            raise failure or OSError(f"another rank of this host could not map the shared segment {path}")

    @classmethod
    def attach(cls, pid: int, fd: int, size: int) -> "SharedSegment":
        """Map, read-only, the segment that process ``pid`` holds open as ``fd`` (see :attr:`where`)."""
        segment = cls.__new__(cls)
        segment.__setstate__({"size": size, "path": f"/proc/{pid}/fd/{fd}"})
        return segment

    @property
    def where(self) -> tuple:
        """(pid, fd): how another process of this host reaches the segment, while this one holds it."""
        return self.owner_pid, self.fd

    def _create(self, path: str) -> str:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_SH)   # held while this process lives: the name is no leftover
        try:
            if self.size:
                os.posix_fallocate(self.fd, 0, self.size)
        except OSError:
            os.close(self.fd)
            os.unlink(path)
            raise
        return path

    def _map(self, writable: bool = True) -> None:
        length = max(self.size, 1)
        if self.size == 0:
            self.mmap = None
            self.array = np.zeros(0, dtype=np.uint8)
            return
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        self.mmap = mmap.mmap(self.fd, length, access=access)
        self.array = np.frombuffer(self.mmap, dtype=np.uint8, count=self.size)

    # DataLoader workers (spawn/forkserver) re-attach through the owner's descriptor.
    def __getstate__(self):
        return {"size": self.size, "path": f"/proc/{self.owner_pid}/fd/{self.fd}"}

    def __setstate__(self, state):
        self.size = state["size"]
        self.owner_pid = None
        self.fd = os.open(state["path"], os.O_RDONLY)
        self._map(writable=False)

    def release_pages(self) -> bool:
        """Free the segment's memory now, though other processes (persistent DataLoader workers)
        still map it: a hole punched over all of it, which reads back as zeros. False where the
        file system cannot (the memory then goes with the last mapping, as always)."""
        if not self.size or self.fd is None:
            return True
        # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE: the size stays, so no mapping faults; to a page
        # boundary, or the last page, partly covered, would only be zeroed
        length = -(-self.size // mmap.PAGESIZE) * mmap.PAGESIZE
        return ctypes.CDLL(None).fallocate(self.fd, 3, ctypes.c_long(0), ctypes.c_long(length)) == 0

    def __del__(self):
        self.close()   # a board or an epoch's samples dropped without close(): no descriptor left open

    def close(self) -> None:
        """Unmap now if no array still points into the segment; the memory goes with the last mapping."""
        array, self.array = getattr(self, "array", None), None
        del array
        if getattr(self, "mmap", None) is not None:
            try:
                self.mmap.close()
            except BufferError:
                pass  # views are still alive; the mapping goes when they do
            self.mmap = None
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None
        _HELD.discard(self)
