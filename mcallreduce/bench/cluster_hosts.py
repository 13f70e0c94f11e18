"""The emulated cluster's hosts: bringing up (or converging to) the namespaces, bridges, veth
pairs and tbf qdiscs of a configuration, taking everything named ``<prefix>-*`` down again,
and the status report of hosts, addresses and shaped rates.
"""
from __future__ import annotations

import ipaddress
import json
import shutil
from dataclasses import asdict
from typing import Optional

from mcallreduce.units import parse_rate
from mcallreduce.bench.autogroups import state_word
from mcallreduce.bench.cluster_cpu import DEFAULT_CPU_PERIOD_MS
from mcallreduce.bench.cluster_jobs import kill_processes_in, write_launch_scripts
from mcallreduce.bench.cluster_state import (DEFAULT_CONGESTION_CONTROL, DEFAULT_MTU, DEFAULT_SUBNET, ClusterConfig,
                                            ClusterState)
from mcallreduce.bench.netns import (ClusterError, links, namespaces, require_root, root_namespace_networks, say, sh, tbf_rate,
                                     check_congestion_control, set_congestion_control)
from mcallreduce.bench.output import write_text
from mcallreduce.shaping import tbf_options

__all__ = ["ClusterHosts"]


class ClusterHosts(ClusterState):
    """Creating, removing and reporting the namespaces and links of a cluster."""

    def up(self, hosts: int, rate: str = "200mbit", ranks_per_host: int = 1, rails: int = 1,
           subnet: str = DEFAULT_SUBNET, cpus_per_host: Optional[float] = None,
           cpu_period_ms: float = DEFAULT_CPU_PERIOD_MS, mtu: int = DEFAULT_MTU,
           keep_autogroups: bool = False,
           congestion_control: str = DEFAULT_CONGESTION_CONTROL) -> ClusterConfig:
        """Create (or converge to) the cluster; a no-op when it is already up as asked.
        ``cpus_per_host``: cap each host's processes at that many cores per ``cpu_period_ms``
        (None: they share the machine's). ``mtu``: the frame size of every link.
        ``keep_autogroups``: leave the kernel's autogroups on (mcallreduce/bench/autogroups.py).
        ``congestion_control``: TCP's in every namespace of the cluster."""
        require_root()
        cfg = ClusterConfig(hosts, rate, ranks_per_host, rails, subnet, cpus_per_host, cpu_period_ms, mtu,
                            keep_autogroups, congestion_control)
        cfg.validate()
        check_congestion_control(congestion_control)
        self._check_no_overlap(cfg)   # before anything of a running cluster is taken down
        old = self.config()
        leftovers = self._mine(namespaces()) or self._mine(links()) or self.cpu_budget.cgroup_names()
        if old is not None and (old.hosts, old.rails, old.subnet) != (hosts, rails, subnet):
            say(f"topology changed ({old.hosts} hosts x {old.rails} rails -> {hosts} x {rails}): rebuilding")
            self.down()
        elif old is None and leftovers:
            say(f"found leftovers of '{self.prefix}' without state (a crash?): removing them first")
            self.down()
        budget = "" if cpus_per_host is None else f", {cpus_per_host:g} core(s) each per {cpu_period_ms:g} ms"
        frames = "" if mtu == DEFAULT_MTU else f", MTU {mtu}"
        say(f"up: {hosts} hosts x {rails} rail(s) at {rate}{frames}, {ranks_per_host} rank(s) per host{budget}")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        have_links = set(links())
        for rail in range(rails):
            if self.bridge(rail) not in have_links:
                sh("ip", "link", "add", self.bridge(rail), "type", "bridge")
            # addrgenmode in a command of its own, before up: in one command the kernel brings the link
            # up first, and a bridge without ports takes an IPv6 link-local address at once
            sh("ip", "link", "set", self.bridge(rail), "mtu", str(mtu), "addrgenmode", "none")
            sh("ip", "link", "set", self.bridge(rail), "up")
        self._ensure_namespace(self.head_ns, congestion_control)
        self._ensure_nic(self.head_ns, self.head_port, "eth0", self.bridge(0), cfg.head_address(), None, mtu)
        tbf = tbf_options(parse_rate(rate))
        for host in range(hosts):
            self._ensure_namespace(self.host_ns(host), congestion_control)
            for rail in range(rails):
                self._ensure_nic(self.host_ns(host), self.host_port(host, rail), f"eth{rail}",
                                 self.bridge(rail), cfg.host_address(host, rail), tbf, mtu)
        if cpus_per_host is None:
            self.cpu_budget.unmount_and_remove()
        else:
            self.cpu_budget.apply(hosts, cpus_per_host, cpu_period_ms)
        if keep_autogroups:
            self.autogroups.release(self.prefix)
        else:
            self.autogroups.hold_off(self.prefix)
        write_launch_scripts(self, cfg)
        write_text(self.state_path, json.dumps(asdict(cfg), indent=1) + "\n", mode=0o644)
        say(f"up: done; mpirun runs in {self.head_ns} ({cfg.head_address()})")
        return cfg

    def _check_no_overlap(self, cfg: ClusterConfig) -> None:
        ours = ipaddress.ip_network(cfg.subnet)
        for net in root_namespace_networks():
            if net.overlaps(ours):
                raise ClusterError(f"--subnet {cfg.subnet} overlaps {net} of this machine: pick another")

    def _ensure_namespace(self, ns: str, congestion_control: str) -> None:
        if ns not in namespaces():
            sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        set_congestion_control(ns, congestion_control)

    def _ensure_nic(self, ns: str, port: str, nic: str, bridge: str, address: str,
                    tbf: Optional[list[str]], mtu: int) -> None:
        """veth ``port`` (root namespace, in ``bridge``) <-> ``nic`` in ``ns``; tbf on both ends."""
        if port not in links():
            sh("ip", "link", "add", port, "type", "veth", "peer", "name", nic, "netns", ns)
        # addrgenmode none: no IPv6 link-local addresses, so no chatter and no stray addresses
        sh("ip", "link", "set", port, "master", bridge, "mtu", str(mtu), "addrgenmode", "none")
        sh("ip", "link", "set", port, "up")
        sh("ip", "-n", ns, "link", "set", nic, "mtu", str(mtu), "addrgenmode", "none")
        sh("ip", "-n", ns, "link", "set", nic, "up")
        sh("ip", "-n", ns, "addr", "replace", f"{address}/24", "dev", nic)
        if tbf is not None:
            sh("tc", "qdisc", "replace", "dev", port, "root", "tbf", *tbf)  # towards the host
            sh("tc", "-n", ns, "qdisc", "replace", "dev", nic, "root", "tbf", *tbf)  # from the host

    def down(self) -> list[str]:
        """Remove every namespace, link (and so qdisc) named ``<prefix>-*``, and the state."""
        require_root()
        removed: list[str] = []
        my_namespaces = self._mine(namespaces())
        kill_processes_in(my_namespaces)
        for link in sorted(self._mine(links()), key=lambda name: "-br" in name):  # ports first
            if sh("ip", "link", "del", link, check=False).returncode == 0:
                removed.append(f"link {link}")
        for ns in my_namespaces:
            if sh("ip", "netns", "del", ns, check=False).returncode == 0:
                removed.append(f"namespace {ns}")
        # raises with the state left in place: a recursive removal must not reach a mounted cgroup
        removed += [f"cpu cgroup {name}" for name in self.cpu_budget.unmount_and_remove()]
        if self.autogroups.release(self.prefix):
            removed.append("autogroups off (restored)")
        if self.state_dir.exists():
            shutil.rmtree(self.state_dir)
            removed.append(f"state {self.state_dir}")
        say(f"down: removed {len(removed)} item(s) of '{self.prefix}'")
        return removed

    def status_text(self, problems: Optional[list[str]] = None) -> str:
        """What ``status`` prints; ``problems``: :meth:`problems`, where the caller has them already."""
        cfg = self.config()
        leftovers = self._mine(namespaces()) + self._mine(links()) + self.cpu_budget.cgroup_names()
        if cfg is None:
            extra = f"; leftovers (run down): {', '.join(leftovers)}" if leftovers else ""
            return f"cluster '{self.prefix}': down{extra}\n"
        problems = self.problems() if problems is None else problems
        lines = [f"cluster '{self.prefix}': {'up' if not problems else 'BROKEN (run up again)'}: "
                 f"{cfg.hosts} hosts x {cfg.rails} rail(s), rate {cfg.rate} per direction, "
                 f"{cfg.ranks_per_host} rank(s) per host, MTU {cfg.mtu}, TCP {cfg.congestion_control}, "
                 f"autogroups {state_word(self.autogroups.enabled())}, "
                 + ("shared cores" if cfg.cpus_per_host is None else
                    f"{cfg.cpus_per_host:g} core(s) per host (per {cfg.cpu_period_ms:g} ms)") + "; "
                 f"state {self.state_path}"]
        lines += [f"  problem: {p}" for p in problems]
        budget = self.cpu_budget
        lines.append(f"  head  {self.head_ns:<12} eth0 {cfg.head_address():<15} (mpirun runs here, unshaped)")
        for host in range(cfg.hosts):
            for rail in range(cfg.rails):
                ns, nic = self.host_ns(host), f"eth{rail}"
                out_rate = _rate_text(tbf_rate(ns, nic))
                in_rate = _rate_text(tbf_rate(None, self.host_port(host, rail)))
                limit = budget.limit(host) if rail == 0 else None
                cpu = "" if limit is None else f", cpu {limit[0]:g} per {limit[1]:g} ms"
                lines.append(f"  host{host:<2} {ns:<12} {nic} {cfg.host_address(host, rail):<15} "
                             f"send {out_rate}, receive {in_rate}{cpu}")
        return "\n".join(lines) + "\n"


def _rate_text(bits_per_s: Optional[float]) -> str:
    return "unshaped?" if bits_per_s is None else f"{bits_per_s / 1e6:g}mbit"
