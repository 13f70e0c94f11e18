"""Kernel-limited disk reads for the cold-cache benchmark (mcallreduce.data.throttle)."""
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from mcallreduce.config import ConfigError
from mcallreduce.data.throttle import (PREFIX, ReadLimit, ReadThrottle, ThrottleError, block_device,
                                       parse_read_limits)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20


def _why_no_throttle(path: str):
    if os.geteuid() != 0:
        return "limiting reads needs root (a blkio cgroup)"
    try:
        ReadThrottle(path)
    except ThrottleError as exc:
        return str(exc)
    return None


def test_limits_parse():
    assert parse_read_limits("25M, 12.5M,200iops,8M+100iops") == [
        ReadLimit(25 * MiB), ReadLimit(int(12.5 * MiB)), ReadLimit(iops=200), ReadLimit(8 * MiB, 100)]
    assert parse_read_limits("") == []
    assert ReadLimit(25 * MiB, 200).label == "25 MiB/s + 200 IOPS" and ReadLimit(iops=150).key == "150iops"
    for bad in ("fast", "0iops", "-3iops", "1K"):
        with pytest.raises(ConfigError, match="read limit"):
            parse_read_limits(bad)


def test_memory_file_systems_are_refused():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        with pytest.raises(ThrottleError, match="not on a block device"):
            block_device(d)


def test_bench_reports_bad_limits_before_any_work(tmp_path):
    cmd = [sys.executable, "-m", "mcallreduce.data", "bench", "--root", str(tmp_path), "--out", str(tmp_path / "o")]
    proc = subprocess.run(cmd + ["--cold-read-limits", "fast"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "is not a size" in proc.stderr, proc.stderr
    if os.geteuid() == 0:
        with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
            proc = subprocess.run(cmd[:4] + ["--root", d, "--out", str(tmp_path / "o"), "--cold-read-limits", "8M"],
                                  capture_output=True, text=True, cwd=REPO, timeout=120)
        assert proc.returncode == 2 and "not on a block device" in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "o" / "train.mcstore")   # refused before packing


def test_non_root_gets_a_clear_error():
    code = "from mcallreduce.data.throttle import ReadThrottle; ReadThrottle('.')"
    if os.geteuid() != 0:
        argv = [sys.executable, "-c", code]
    elif shutil.which("setpriv"):
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code]
    else:
        pytest.skip("no setpriv to drop root")
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode != 0 and "needs root" in proc.stderr, proc.stderr


def _cgroups() -> str:
    with open("/proc/self/cgroup") as f:
        return f.read()


def test_reads_are_limited_and_the_cgroup_removed(tmp_path):
    why = _why_no_throttle(str(tmp_path))
    if why:
        pytest.skip(why)
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(4 * MiB))
    os.sync()

    def cold_read() -> float:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        start = time.perf_counter()
        assert len(path.read_bytes()) == 4 * MiB
        return time.perf_counter() - start

    before = _cgroups()
    # a cgroup left by a process that died is removed when the next one is made
    dead = subprocess.Popen(["true"])
    dead.wait()
    throttle = ReadThrottle(str(tmp_path))
    stale = os.path.join(throttle.hierarchy.root, f"{PREFIX}{dead.pid}")
    os.makedirs(stale, exist_ok=True)
    with throttle:
        assert not os.path.exists(stale)
        assert os.path.isdir(throttle.cgroup) and _cgroups() != before
        throttle.set(ReadLimit(bps=8 * MiB))
        limited = cold_read()
        start = time.perf_counter()
        path.read_bytes()                       # page-cache hits do no block I/O: not limited
        warm = time.perf_counter() - start
        throttle.set(None)
        lifted = cold_read()
        cgroup = throttle.cgroup
    assert limited >= 0.4, f"4 MiB at 8 MiB/s took {limited:.3f} s"
    assert warm < limited / 4 and lifted < limited / 2, (warm, lifted, limited)
    assert not os.path.exists(cgroup) and _cgroups() == before


def test_a_loop_disk_takes_the_limit_alone_and_leaves_nothing(tmp_path):
    why = _why_no_throttle(str(tmp_path))
    if why or shutil.which("losetup") is None or shutil.which("mkfs.ext4") is None:
        pytest.skip(why or "needs losetup and mkfs.ext4")
    from mcallreduce.data.throttle import LoopDisk
    tree = tmp_path / "tree"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "blob").write_bytes(os.urandom(2 * MiB))
    for i in range(300):                       # many small files: inodes and block rounding
        (tree / "a" / f"{i}.txt").write_bytes(b"x")
    store = tmp_path / "tree.train.mcstore"    # a packed store, copied beside the tree on the same disk
    store.write_bytes(os.urandom(3 * MiB))
    with LoopDisk(str(tree), beside=[str(store)]) as root:
        mount = os.path.dirname(root)
        assert block_device(root).startswith("7:") and block_device(root) != block_device(str(tmp_path))
        assert sorted(os.listdir(os.path.join(root, "a"))) == sorted(os.listdir(tree / "a"))
        beside = os.path.join(mount, store.name)
        assert block_device(beside) == block_device(root) and open(beside, "rb").read() == store.read_bytes()
        blob = os.path.join(root, "a", "blob")
        with ReadThrottle(root) as throttle:
            throttle.set(ReadLimit(bps=4 * MiB))
            fd = os.open(blob, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            start = time.perf_counter()
            with open(blob, "rb") as f:
                assert len(f.read()) == 2 * MiB
            limited = time.perf_counter() - start
        device = subprocess.run(["findmnt", "-no", "SOURCE", mount], capture_output=True, text=True).stdout.strip()
    assert limited >= 0.3, f"2 MiB at 4 MiB/s took {limited:.3f} s"
    assert not os.path.exists(mount)
    assert device and device not in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
