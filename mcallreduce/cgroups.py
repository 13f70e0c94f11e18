"""The kernel's control groups, as far as this package uses them: finding a controller's
hierarchy (cgroup v1, or the v2 unified one), a process's place in it, and moving processes.

Three users: the read throttle of the data benchmarks (``io``/``blkio``, data/throttle.py) and
the CPU budget per emulated host (``cpu``, bench/cluster_cpu.py), which need root; and
:func:`usable_cores`, which only reads: the cores this process may run on, for the policy.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["CgroupError", "Hierarchy", "cap_cpu", "cpu_hierarchy", "cpu_quota_cores", "find_hierarchy", "own_cgroup",
           "read_cpu_cap", "usable_cores", "write"]

CGROUP_ROOT = "/sys/fs/cgroup"
V2_ROOTS = (CGROUP_ROOT, os.path.join(CGROUP_ROOT, "unified"))   # unified alone, or beside v1 ("hybrid")


class CgroupError(RuntimeError):
    pass


@dataclass(frozen=True)
class Hierarchy:
    """Where a controller's cgroups live: ``root`` of a v1 hierarchy (``version`` 1) or of the v2 one.
    ``controller`` is its v2 name, ``v1_name`` its v1 one (``io`` was ``blkio``)."""
    controller: str
    version: int
    root: str
    v1_name: str

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def ensure(self, name: str) -> str:
        """Create cgroup ``name`` (a child of the root) with the controller enabled; its path."""
        path = self.path(name)
        if self.version == 2:
            write(os.path.join(self.root, "cgroup.subtree_control"), f"+{self.controller}")
        os.makedirs(path, exist_ok=True)
        return path

    def move(self, pid: int, name_or_path: str) -> None:
        """Move process ``pid`` (all its threads) into the cgroup; its future children follow it."""
        write(os.path.join(self.path(name_or_path), "cgroup.procs"), str(pid))

    def own(self) -> str:
        """The path of this process's own cgroup in this hierarchy."""
        return os.path.join(self.root, own_cgroup(self.v1_name if self.version == 1 else None).lstrip("/"))


def find_hierarchy(controller: str, v1_name: str, v1_probe: str) -> Optional[Hierarchy]:
    """The v1 hierarchy ``/sys/fs/cgroup/<v1_name>`` when it has file ``v1_probe``, else the
    v2 hierarchy when it offers ``controller``, else None (not mounted, or bound elsewhere)."""
    v1_root = os.path.join(CGROUP_ROOT, v1_name)
    if os.path.exists(os.path.join(v1_root, v1_probe)):
        return Hierarchy(controller, 1, v1_root, v1_name)
    for root in V2_ROOTS:
        try:
            with open(os.path.join(root, "cgroup.controllers")) as f:
                if controller in f.read().split():
                    return Hierarchy(controller, 2, root, v1_name)
        except OSError:
            continue
    return None


def cpu_hierarchy() -> Optional[Hierarchy]:
    """The ``cpu`` controller's hierarchy (v1 or v2), or None."""
    return find_hierarchy("cpu", "cpu", "cpu.cfs_quota_us")


def cap_cpu(hierarchy: Hierarchy, path: str, cpus: float, period_ms: float) -> None:
    """Cap cgroup ``path`` of the cpu ``hierarchy`` at ``cpus`` cores: a quota of
    ``cpus x period`` per period."""
    period, quota = round(period_ms * 1000), round(cpus * period_ms * 1000)
    if hierarchy.version == 1:
        # uncapped while the period changes, so no step is refused for exceeding a parent's cap
        write(os.path.join(path, "cpu.cfs_quota_us"), "-1")
        write(os.path.join(path, "cpu.cfs_period_us"), str(period))
        write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
    else:
        write(os.path.join(path, "cpu.max"), f"{quota} {period}")


def read_cpu_cap(hierarchy: Hierarchy, path: str) -> Optional[Tuple[float, float]]:
    """The CPU cap of cgroup ``path`` as (cores, period in ms), the reverse of :func:`cap_cpu`; None
    where it has none (or it cannot be read)."""
    try:
        if hierarchy.version == 1:
            with open(os.path.join(path, "cpu.cfs_quota_us")) as q, open(os.path.join(path, "cpu.cfs_period_us")) as p:
                quota, period = int(q.read()), int(p.read())
        else:
            with open(os.path.join(path, "cpu.max")) as f:
                fields = f.read().split()
            if fields[0] == "max":
                return None
            quota, period = int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
    return (quota / period, period / 1000) if quota > 0 and period > 0 else None


def cpu_quota_cores() -> Optional[float]:
    """The tightest CPU quota, in cores, from this process's cgroup up to its hierarchy's root (a
    container's or a batch job's limit, or an emulated host's); None where none is set or none can be read."""
    try:
        hierarchy = cpu_hierarchy()
        if hierarchy is None:
            return None
        root, path = os.path.realpath(hierarchy.root), os.path.realpath(hierarchy.own())
    except (OSError, CgroupError, ValueError):
        return None
    quotas = []
    while True:
        cap = read_cpu_cap(hierarchy, path)
        quotas.append(cap[0] if cap else None)
        if path == root or not path.startswith(root + os.sep):
            break
        path = os.path.dirname(path)
    return min((q for q in quotas if q is not None), default=None)


def usable_cores() -> float:
    """The cores this process may use: those its CPU affinity allows (mpirun's binding, taskset, a
    batch system's), capped by its cgroups' CPU quota."""
    try:
        cores: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cpu_quota_cores()
    return min(cores, quota) if quota is not None else cores


def own_cgroup(controller: Optional[str]) -> str:
    """This process's cgroup path in the v1 hierarchy of ``controller`` (None: the v2 one)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if (controller is None and names == "") or (controller and controller in names.split(",")):
                return path
    raise CgroupError(f"this process is in no {'cgroup v2' if controller is None else controller} hierarchy")


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
