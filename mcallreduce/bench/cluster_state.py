"""The emulated cluster's names and saved state: the configuration of the last ``up``
(``state.json`` under the cluster's state directory), the names of its namespaces, bridges
and ports, and what is missing compared with that configuration.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from mcallreduce.units import parse_rate
from mcallreduce.bench.autogroups import Autogroups
from mcallreduce.bench.cluster_cpu import DEFAULT_CPU_PERIOD_MS, HostCpuBudget
from mcallreduce.bench.netns import ClusterError, ipv4_addresses, links, namespaces, tbf_rate

__all__ = ["ClusterConfig", "ClusterState", "DEFAULT_CONGESTION_CONTROL", "DEFAULT_PREFIX", "DEFAULT_SUBNET", "STATE_ROOT"]

DEFAULT_PREFIX = os.environ.get("MCALLREDUCE_CLUSTER_PREFIX", "mcar")
DEFAULT_SUBNET = "10.213.0.0/16"  # rail r is 10.213.r.0/24; host i is .i+1, the head is .254
STATE_ROOT = Path("/run/mcallreduce-cluster")  # tmpfs: forgotten at reboot, like the namespaces
HEAD_HOST_NUMBER = 254
MAX_HOSTS = 253
DEFAULT_MTU = 1500         # Ethernet's; 9000 is the usual jumbo frame of a cluster network
# Linux's default is cubic, which a namespace may not pick unless the machine allows it; reno is of its
# family, and the BBR a namespace would otherwise inherit here stretched some calls (docs/cluster.md, "TCP")
DEFAULT_CONGESTION_CONTROL = "reno"
MIN_MTU, MAX_MTU = 576, 65535
PREFIX_PATTERN = re.compile(r"^[a-z][a-z0-9]{0,6}$")  # keeps "<prefix>-h252r1" within 15 chars


@dataclass(frozen=True)
class ClusterConfig:
    hosts: int
    rate: str = "200mbit"
    ranks_per_host: int = 1
    rails: int = 1
    subnet: str = DEFAULT_SUBNET
    cpus_per_host: Optional[float] = None   # None: the hosts share the machine's cores
    cpu_period_ms: float = DEFAULT_CPU_PERIOD_MS
    mtu: int = DEFAULT_MTU   # every NIC, port and bridge of the cluster
    keep_autogroups: bool = False   # False: the kernel's autogroups are off while it is up
    congestion_control: str = DEFAULT_CONGESTION_CONTROL   # TCP's, in every namespace of the cluster

    def validate(self) -> None:
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ClusterError(f"--hosts must be 1..{MAX_HOSTS}, got {self.hosts}")
        if self.rails not in (1, 2):
            raise ClusterError(f"--rails must be 1 or 2, got {self.rails}")
        if self.ranks_per_host < 1:
            raise ClusterError(f"--ranks-per-host must be >= 1, got {self.ranks_per_host}")
        if self.cpus_per_host is not None and not 0.01 <= self.cpus_per_host <= (os.cpu_count() or 1):
            raise ClusterError(f"--cpus-per-host must be 0.01..{os.cpu_count()} (this machine's cores), "
                               f"got {self.cpus_per_host:g}")
        if not 1 <= self.cpu_period_ms <= 1000:
            raise ClusterError(f"--cpu-period-ms must be 1..1000, got {self.cpu_period_ms:g}")
        if self.cpus_per_host is not None and self.cpus_per_host * self.cpu_period_ms < 1:
            raise ClusterError(f"--cpus-per-host {self.cpus_per_host:g} is a quota under 1 ms per "
                               f"{self.cpu_period_ms:g} ms period, which the kernel refuses: raise --cpu-period-ms")
        if not MIN_MTU <= self.mtu <= MAX_MTU:
            raise ClusterError(f"--mtu must be {MIN_MTU}..{MAX_MTU} (IPv4's least datagram to veth's largest frame), "
                               f"got {self.mtu}")
        parse_rate(self.rate)
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError as exc:
            raise ClusterError(f"--subnet {self.subnet}: {exc}") from None
        if net.prefixlen > 24 - (self.rails > 1) or not net.is_private:
            raise ClusterError(f"--subnet {self.subnet}: need a private /23 or wider (one /24 per rail)")

    def rail_subnet(self, rail: int) -> ipaddress.IPv4Network:
        return list(ipaddress.ip_network(self.subnet).subnets(new_prefix=24))[rail]

    def host_address(self, host: int, rail: int = 0) -> str:
        return str(self.rail_subnet(rail)[host + 1])

    def head_address(self) -> str:
        return str(self.rail_subnet(0)[HEAD_HOST_NUMBER])

    @property
    def rate_bytes_per_s(self) -> float:
        return parse_rate(self.rate) / 8


class ClusterState:
    """The names and the recorded state of the emulated cluster ``prefix``, kept in ``state_root/prefix``."""

    def __init__(self, prefix: str = DEFAULT_PREFIX, state_root: Path = STATE_ROOT):
        if not PREFIX_PATTERN.match(prefix):
            raise ClusterError(f"bad prefix {prefix!r}: 1-7 chars, [a-z][a-z0-9]*")
        self.prefix = prefix
        self.autogroups = Autogroups(state_root)
        self.state_dir = Path(state_root) / prefix
        self.state_path = self.state_dir / "state.json"
        self.agent_path = self.state_dir / "rsh-agent.sh"
        self.ssh_dir = self.state_dir / "ssh"   # an ``ssh`` for horovodrun --gloo (run(gloo=True))

    @property
    def cpu_budget(self) -> HostCpuBudget:
        """The hosts' cgroups of ``up --cpus-per-host``."""
        return HostCpuBudget(self.prefix, self.state_dir)

    # names: everything this cluster creates starts with "<prefix>-"
    def host_ns(self, host: int) -> str:
        return f"{self.prefix}-h{host}"

    @property
    def head_ns(self) -> str:
        return f"{self.prefix}-head"

    def bridge(self, rail: int) -> str:
        return f"{self.prefix}-br{rail}"

    def host_port(self, host: int, rail: int) -> str:
        return f"{self.prefix}-h{host}r{rail}"

    @property
    def head_port(self) -> str:
        return f"{self.prefix}-hdr0"

    def _mine(self, names: Sequence[str]) -> list[str]:
        return [name for name in names if name.startswith(self.prefix + "-")]

    # state
    def config(self) -> Optional[ClusterConfig]:
        """The configuration of the last successful ``up``, or None."""
        try:
            return ClusterConfig(**json.loads(self.state_path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as err:
            raise ClusterError(f"unreadable state {self.state_path} ({err}): run down, then up") from None

    def _up_config(self) -> ClusterConfig:
        cfg = self.config()
        if cfg is None:
            raise ClusterError(f"cluster '{self.prefix}' is not up: run "
                               f"python -m mcallreduce.bench.cluster --prefix {self.prefix} up --hosts N first")
        return cfg

    def _working_config(self) -> ClusterConfig:
        """The configuration of a cluster that is up and whole: a job on a broken one would wait forever."""
        cfg = self._up_config()
        missing = self._missing_parts(cfg)
        if missing:
            raise ClusterError(f"cluster '{self.prefix}' is BROKEN ({'; '.join(missing)}): run up again, or down")
        return cfg

    def problems(self) -> list[str]:
        """What is missing compared with the recorded configuration (empty: the cluster is up)."""
        cfg = self.config()
        if cfg is None:
            return ["no state file (never brought up, or taken down)"]
        missing = self._missing_parts(cfg)
        if not missing:
            missing += self._misconfigured_nics(cfg)
        if not cfg.keep_autogroups and self.autogroups.enabled():
            missing.append("autogroups off (the kernel's sched_autogroup_enabled is 1)")
        if cfg.cpus_per_host is not None:
            budget = self.cpu_budget
            missing += [f"cpu cgroup of host {i}" for i in range(cfg.hosts)
                        if budget.limit(i) is None or not os.path.ismount(budget.mount_point(i))]
            if not os.path.ismount(budget.root_mount_point()):
                missing.append("the cpu hierarchy's mount for the ranks")
        return missing

    def _missing_parts(self, cfg: ClusterConfig) -> list[str]:
        """The namespaces, links and rsh agent of ``cfg`` that are gone: without them a job never starts."""
        have_ns, have_links = set(namespaces()), set(links())
        wanted_ns = [self.head_ns] + [self.host_ns(i) for i in range(cfg.hosts)]
        wanted_links = [self.bridge(r) for r in range(cfg.rails)] + [self.head_port] + [
            self.host_port(i, r) for i in range(cfg.hosts) for r in range(cfg.rails)]
        missing = [f"namespace {n}" for n in wanted_ns if n not in have_ns]
        missing += [f"link {n}" for n in wanted_links if n not in have_links]
        if not self.agent_path.exists():
            missing.append(f"rsh agent {self.agent_path}")
        return missing

    def _misconfigured_nics(self, cfg: ClusterConfig) -> list[str]:
        """The hosts' NICs whose shaping or address is not what ``up`` set (an interrupted up, a hand-made change)."""
        wrong, rate = [], parse_rate(cfg.rate)
        for host in range(cfg.hosts):
            for rail in range(cfg.rails):
                ns, nic, port = self.host_ns(host), f"eth{rail}", self.host_port(host, rail)
                for way, got in (("send", tbf_rate(ns, nic)), ("receive", tbf_rate(None, port))):
                    if got is None or abs(got - rate) > 0.01 * rate:
                        wrong.append(f"host{host} {nic}: {way} {'unshaped' if got is None else f'{got / 1e6:g}mbit'}, "
                                     f"not {cfg.rate}")
                if cfg.host_address(host, rail) not in ipv4_addresses(ns, nic):
                    wrong.append(f"host{host} {nic}: no address {cfg.host_address(host, rail)}")
        return wrong

    def is_up(self) -> bool:
        return os.geteuid() == 0 and not self.problems()
