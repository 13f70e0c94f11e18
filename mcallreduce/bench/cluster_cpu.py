"""A CPU budget per emulated host: one cgroup per host namespace, capped at ``cpus`` cores.

Without it the emulated hosts share the machine's cores, so one host's waiting (a rank polling
MPI) takes CPU from the ranks of *other* hosts, which separate machines never do
(docs/cluster.md, "A CPU budget per host"). The cgroups are named like the namespaces
(``<prefix>-h<i>``) in the ``cpu`` hierarchy (cgroup v1, or the v2 unified one). The rsh agent
moves every daemon it starts into its host's cgroup before anything else runs, so the
ranks and every process they start (DataLoader workers) stay inside it.

``ip netns exec`` mounts a fresh ``/sys`` without the cgroup hierarchies, so each host's
cgroup is also bind-mounted under the cluster's state directory (``cpu-h<i>``), where the
agent, running in mpirun's namespace, can still reach it, and so is the hierarchy's root
(``cpu-root``), which the agent mounts back in its place inside each host's namespace so that
a rank reads its host's budget as it would a container's (``cgroups.usable_cores``).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional, Tuple

from mcallreduce.cgroups import Hierarchy, cap_cpu, cpu_hierarchy, read_cpu_cap
from mcallreduce.bench.netns import ClusterError, sh

__all__ = ["DEFAULT_CPU_PERIOD_MS", "HostCpuBudget"]

# Short, so a host that spent its quota is stopped for milliseconds, not for the kernel's 100 ms.
DEFAULT_CPU_PERIOD_MS = 10.0


class HostCpuBudget:
    """The ``cpu`` cgroups of the hosts of cluster ``prefix``, bind-mounted under ``state_dir``."""

    def __init__(self, prefix: str, state_dir: Path):
        self.prefix = prefix
        self.state_dir = Path(state_dir)
        self.hierarchy = cpu_hierarchy()

    def _require(self) -> Hierarchy:
        if self.hierarchy is None:
            raise ClusterError("--cpus-per-host needs the cgroup cpu controller, and neither a cgroup v1 "
                               "'cpu' hierarchy nor a v2 one offering 'cpu' is mounted on this machine")
        return self.hierarchy

    def path(self, host: int) -> str:
        """The host's cgroup directory (it may not exist)."""
        return self._require().path(f"{self.prefix}-h{host}")

    def mount_point(self, host: int) -> Path:
        return self.state_dir / f"cpu-h{host}"

    def root_mount_point(self) -> Path:
        return self.state_dir / "cpu-root"

    def root_in_namespace(self) -> Tuple[str, str]:
        """(where the hierarchy's root is reachable from any namespace, where a host's namespace mounts it)."""
        return str(self.root_mount_point()), self._require().root

    def procs_file(self, host: int) -> str:
        """Writing a pid here moves that process (and its future children) into the host's budget;
        the path works inside ``ip netns exec`` too."""
        return str(self.mount_point(host) / "cgroup.procs")

    def apply(self, hosts: int, cpus: float, period_ms: float = DEFAULT_CPU_PERIOD_MS) -> None:
        """Create (or update in place) hosts' cgroups, each capped at ``cpus`` cores: a quota of
        ``cpus x period`` per period."""
        hierarchy = self._require()
        for host in range(hosts):
            try:
                path = hierarchy.ensure(f"{self.prefix}-h{host}")
                cap_cpu(hierarchy, path, cpus, period_ms)
            except OSError as err:
                raise ClusterError(f"cannot set up the cpu cgroup of host {host} in {hierarchy.root} ({err}); "
                                   f"inside a container the cgroups may be read-only or delegated elsewhere") from None
            _bind(path, self.mount_point(host))
        _bind(hierarchy.root, self.root_mount_point())

    def limit(self, host: int) -> Optional[Tuple[float, float]]:
        """(cores, period in ms) as the kernel holds them; None when the host has no cgroup or no cap."""
        return None if self.hierarchy is None else read_cpu_cap(self.hierarchy, self.path(host))

    def cgroup_names(self) -> list[str]:
        """Every cgroup of this cluster in the cpu hierarchy, whatever its host count was."""
        if self.hierarchy is None or not os.path.isdir(self.hierarchy.root):
            return []
        return sorted(name for name in os.listdir(self.hierarchy.root)
                      if name.startswith(self.prefix + "-h") and os.path.isdir(self.hierarchy.path(name)))

    def unmount_and_remove(self, wait_s: float = 5.0) -> list[str]:
        """Unmount and remove every cgroup of this cluster. Nothing is touched unless all are empty
        within ``wait_s`` (a killed process leaves its cgroup a moment after its namespace)."""
        names = self.cgroup_names()
        paths = [self._require().path(name) for name in names]
        deadline = time.monotonic() + wait_s
        for path in paths:
            while _members(path):
                if time.monotonic() > deadline:
                    raise ClusterError(f"cpu cgroup {path} still holds processes {_members(path)}: "
                                       f"stop them, then run down again")
                time.sleep(0.05)
        for mount_point in sorted(self.state_dir.glob("cpu-*")):
            if os.path.ismount(mount_point):
                sh("umount", str(mount_point))
            mount_point.rmdir()     # never a recursive removal: it could be a cgroup still
        for path in paths:
            os.rmdir(path)
        return names


def _bind(src: str, mount_point: Path) -> None:
    """Bind-mount ``src`` at ``mount_point`` unless something is mounted there already."""
    if not os.path.ismount(mount_point):
        mount_point.mkdir(parents=True, exist_ok=True)
        sh("mount", "--bind", src, str(mount_point))


def _members(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(pid) for pid in f.read().split()]
    except FileNotFoundError:
        return []
