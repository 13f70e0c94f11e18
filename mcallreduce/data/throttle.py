"""Reads from the disk under a path, limited by the kernel: the slow storage of the cold-cache benchmark.

On a training cluster the ImageFolder tree usually sits on a shared file system (NFS, GPFS,
Lustre) or a spinning disk, whose share per node is far below what the node can decode; the
paper's system is that case. A local SSD, or a virtual disk served from the hypervisor's
cache, is faster than two cores can decode, and then the in-memory store can only win by
the cost of a read. To measure the store against storage slower than decoding, the bench
puts itself into a blkio cgroup whose read limit (bytes/s, IOPS or both) applies to the
block device holding the tree: the kernel's own throttle of real block reads, as ``tc``
shapes the emulated cluster's links. Page-cache hits (the warm path) and the in-memory
store do no block I/O, so the limit touches the cold path only.

cgroup v1 (``blkio.throttle.read_bps_device`` / ``read_iops_device``) and v2 (``io.max``)
are supported; root is required. :class:`ReadThrottle` is a context manager that creates
one cgroup for this process, moves the process in (all its threads), sets and clears the
limit on demand, and on exit moves the process back and removes the cgroup; a cgroup left
by a process that died is removed the next time one is made.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..cgroups import find_hierarchy, write
from ..errors import ConfigError
from ..units import parse_size

__all__ = ["LoopDisk", "ReadLimit", "ReadThrottle", "ThrottleError", "block_device", "drop_page_cache",
           "parse_read_limits"]

PREFIX = "mcallreduce-read-"


class ThrottleError(RuntimeError):
    pass


@dataclass(frozen=True)
class ReadLimit:
    """Bytes per second and reads per second of one block device; 0 = no limit on that one."""
    bps: int = 0
    iops: int = 0

    @property
    def label(self) -> str:
        parts = []
        if self.bps:
            mib = self.bps / (1 << 20)
            parts.append(f"{mib:g} MiB/s")
        if self.iops:
            parts.append(f"{self.iops} IOPS")
        return " + ".join(parts) or "no limit"

    @property
    def key(self) -> str:
        """A name for JSON keys: '25MiBps', '200iops', '25MiBps+200iops'."""
        parts = ([f"{self.bps / (1 << 20):g}MiBps"] if self.bps else []) + ([f"{self.iops}iops"] if self.iops else [])
        return "+".join(parts) or "none"


def parse_read_limits(text: str) -> List[ReadLimit]:
    """'50M,12.5M,200iops,25M+400iops' -> ReadLimits (sizes binary: 50M = 50 MiB/s)."""
    limits = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        bps = iops = 0
        for part in item.split("+"):
            part = part.strip().lower()
            if part.endswith("iops"):
                number = part[:-4]
                if not number.isdigit() or int(number) < 1:
                    raise ConfigError(f"read limit {item!r}: {part!r} is not a positive IOPS count (e.g. 200iops)")
                iops = int(number)
            else:
                bps = parse_size(part.rstrip("/s"), what=f"read limit {item!r}")
                if bps < 4096:
                    raise ConfigError(f"read limit {item!r}: under 4 KiB/s; give bytes per second, e.g. 25M")
        limits.append(ReadLimit(bps, iops))
    return limits


def block_device(path: str) -> str:
    """'MAJ:MIN' of the whole disk holding ``path`` (the throttle takes disks, not partitions)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    sys_dir = f"/sys/dev/block/{major}:{minor}"
    if major == 0 or not os.path.isdir(sys_dir):
        raise ThrottleError(f"{path} is not on a block device (device {major}:{minor}: tmpfs, overlay or a "
                            f"network file system); reads there cannot be limited with a blkio cgroup. "
                            f"Put the tree on a local disk (--root) to use --cold-read-limits")
    if os.path.exists(os.path.join(sys_dir, "partition")):
        with open(os.path.join(os.path.realpath(sys_dir), "..", "dev")) as f:
            return f.read().strip()
    return f"{major}:{minor}"


def drop_page_cache(paths) -> None:
    """Drop these files' pages from the page cache (clean pages only: write and sync them first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class ReadThrottle:
    """Limit this process's block reads from the disk under ``path``; ``set(limit)`` changes the limit."""

    def __init__(self, path: str):
        if os.geteuid() != 0:
            raise ThrottleError("limiting reads needs root (it creates a cgroup); run the bench with sudo, "
                                "or leave out --cold-read-limits")
        self.device = block_device(path)
        self.cgroup: Optional[str] = None
        self.home: Optional[str] = None
        hierarchy = find_hierarchy("io", "blkio", "blkio.throttle.read_bps_device")
        if hierarchy is None:
            raise ThrottleError("no blkio (cgroup v1) or io (cgroup v2) controller is mounted: reads "
                                "cannot be limited on this machine")
        self.hierarchy = hierarchy

    def __enter__(self) -> "ReadThrottle":
        self._remove_stale()
        self.home = self.hierarchy.own()
        self.cgroup = self.hierarchy.ensure(f"{PREFIX}{os.getpid()}")
        self.hierarchy.move(os.getpid(), self.cgroup)
        return self

    def set(self, limit: Optional[ReadLimit]) -> None:
        """Apply ``limit`` (None or ReadLimit() lifts it) from the next block read on."""
        limit = limit or ReadLimit()
        if self.hierarchy.version == 1:
            write(os.path.join(self.cgroup, "blkio.throttle.read_bps_device"), f"{self.device} {limit.bps}")
            write(os.path.join(self.cgroup, "blkio.throttle.read_iops_device"), f"{self.device} {limit.iops}")
        else:
            write(os.path.join(self.cgroup, "io.max"), f"{self.device} rbps={limit.bps or 'max'} "
                                                        f"riops={limit.iops or 'max'}")

    def __exit__(self, *exc) -> None:
        if self.cgroup is None:
            return
        self.hierarchy.move(os.getpid(), self.home)
        os.rmdir(self.cgroup)   # empty now; the rules go with it
        self.cgroup = None

    def _remove_stale(self) -> None:
        """Cgroups of earlier runs whose process is gone (killed before __exit__)."""
        for name in os.listdir(self.hierarchy.root):
            m = re.fullmatch(re.escape(PREFIX) + r"(\d+)", name)
            if m and not os.path.exists(f"/proc/{m.group(1)}"):
                try:
                    os.rmdir(os.path.join(self.hierarchy.root, name))
                except OSError:
                    pass   # still has members (a child that outlived it): leave it


#: the commands a loop disk runs (scripts/setup_env.sh installs them)
LOOP_DISK_TOOLS = ("losetup", "mkfs.ext4", "mount", "umount")


class LoopDisk:
    """A disk of its own for a tree: an ext4 image file attached as a loop device and mounted.

    The throttle limits a whole block device, and a multi-process job reads more than its
    data from the system disk (page faults of the Python libraries of each new process): on
    a loop device of its own, only the tree's reads are limited. ``with LoopDisk(src) as
    root:`` copies ``src`` onto the new disk; on exit the disk is unmounted, detached and its
    image removed. Files named in ``beside`` are copied next to the tree's root on the disk. Needs
    root, ``losetup`` and ``mkfs.ext4``.
    """

    def __init__(self, source: str, image_dir: str = "/var/tmp", beside: Sequence[str] = ()):
        if os.geteuid() != 0:
            raise ThrottleError("a loop disk for the tree needs root (losetup, mount)")
        for tool in LOOP_DISK_TOOLS:
            if shutil.which(tool) is None:
                raise ThrottleError(f"a loop disk for the tree needs {tool}, which is not installed")
        self.source, self.image_dir = os.path.abspath(source), image_dir
        self.beside = [os.path.abspath(f) for f in beside]
        self.image = self.device = self.mount = None

    def __enter__(self) -> str:
        files = [os.path.join(d, f) for d, _, names in os.walk(self.source) for f in names] + self.beside
        blocks = sum(-(-os.path.getsize(f) // 4096) for f in files)     # each file in whole 4 KiB blocks
        fd, self.image = tempfile.mkstemp(prefix="mcallreduce-disk-", suffix=".img", dir=self.image_dir)
        os.close(fd)
        try:
            os.truncate(self.image, int(blocks * 4096 * 1.2) + (64 << 20))     # room for ext4's metadata
            inodes = 2 * len(files) + 4096                                      # small files need more than the default
            subprocess.run(["mkfs.ext4", "-q", "-F", "-N", str(inodes), self.image], check=True, capture_output=True)
            self.device = subprocess.run(["losetup", "-f", "--show", self.image], check=True,
                                         capture_output=True, text=True).stdout.strip()
            self.mount = tempfile.mkdtemp(prefix="mcallreduce-disk-")
            subprocess.run(["mount", self.device, self.mount], check=True, capture_output=True)
            root = os.path.join(self.mount, os.path.basename(self.source))
            shutil.copytree(self.source, root)
            for path in self.beside:
                shutil.copy(path, self.mount)
            os.sync()   # clean pages: DONTNEED can drop them
            return root
        except BaseException:
            try:
                self.__exit__()
            except OSError:
                pass     # the original error is the one to report
            raise

    def __exit__(self, *exc) -> None:
        """Unmount (lazily if still busy), detach, remove: each step runs whatever the one before did."""
        mount, device, image = self.mount, self.device, self.image
        self.image = self.device = self.mount = None
        try:
            if mount:
                if subprocess.run(["umount", mount], check=False, capture_output=True).returncode != 0:
                    subprocess.run(["umount", "-l", mount], check=False, capture_output=True)
                try:
                    os.rmdir(mount)
                except OSError:
                    pass     # a lazy unmount may hold it a little longer: an empty directory is left
        finally:
            try:
                if device:
                    subprocess.run(["losetup", "-d", device], check=False, capture_output=True)
            finally:
                if image and os.path.exists(image):
                    os.remove(image)
