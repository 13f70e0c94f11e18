"""An emulated multi-host cluster on one Linux machine: one network namespace per host.

    python -m mcallreduce.bench.cluster up --hosts 4 --rate 200mbit [--ranks-per-host R] [--rails 1|2]
    python -m mcallreduce.bench.cluster status
    python -m mcallreduce.bench.cluster run [-np N] [-x NAME=VALUE] -- python my_job.py
    python -m mcallreduce.bench.cluster check                  # raw TCP MB/s vs the rate
    python -m mcallreduce.bench.cluster allreduce --sizes 8M   # MPI_Allreduce busbw
    python -m mcallreduce.bench.cluster pingpong               # a hop while other ranks wait vs sleep
    python -m mcallreduce.bench.cluster down

Host i is namespace ``<prefix>-h<i>`` with NIC ``eth0`` (and ``eth1`` with two rails), one end of
a veth pair whose other end ``<prefix>-h<i>r<rail>`` is a port of bridge ``<prefix>-br<rail>``.
Both ends carry a tc tbf qdisc, so a host sends and receives at most ``rate`` per rail. mpirun
runs in namespace ``<prefix>-head`` (an unshaped port on rail 0) and starts its daemons through
a generated rsh agent that runs them under ``ip netns exec <host namespace>``, with the
namespace name as hostname (a UTS namespace: Open MPI keys shared memory by hostname).
The bridges have no real interface and no address, and no namespace has a default route:
nothing leaves the machine. Everything is found by its name prefix, so ``down`` also cleans up after a crash.
The topology and the measured numbers are in docs/cluster.md.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from mcallreduce import launch
from mcallreduce.bench.output import write_text
from mcallreduce.errors import ConfigError
from mcallreduce.units import parse_rate
from mcallreduce.bench.netns import (ClusterError, links, namespaces, require_root, root_namespace_networks, say, sh,
                                     tbf_options)

__all__ = ["Cluster", "ClusterConfig", "ClusterError", "parse_rate", "tbf_options", "main"]

DEFAULT_PREFIX = os.environ.get("MCALLREDUCE_CLUSTER_PREFIX", "mcar")
DEFAULT_SUBNET = "10.213.0.0/16"  # rail r is 10.213.r.0/24; host i is .i+1, the head is .254
STATE_ROOT = Path("/run/mcallreduce-cluster")  # tmpfs: forgotten at reboot, like the namespaces
HEAD_HOST_NUMBER = 254
MAX_HOSTS = 253
PREFIX_PATTERN = re.compile(r"^[a-z][a-z0-9]{0,6}$")  # keeps "<prefix>-h252r1" within 15 chars


# ---------------------------------------------------------------- configuration
@dataclass(frozen=True)
class ClusterConfig:
    hosts: int
    rate: str = "200mbit"
    ranks_per_host: int = 1
    rails: int = 1
    subnet: str = DEFAULT_SUBNET

    def validate(self) -> None:
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ClusterError(f"--hosts must be 1..{MAX_HOSTS}, got {self.hosts}")
        if self.rails not in (1, 2):
            raise ClusterError(f"--rails must be 1 or 2, got {self.rails}")
        if self.ranks_per_host < 1:
            raise ClusterError(f"--ranks-per-host must be >= 1, got {self.ranks_per_host}")
        parse_rate(self.rate)
        net = ipaddress.ip_network(self.subnet)
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


# ---------------------------------------------------------------- the cluster
class Cluster:
    """The emulated cluster named ``prefix``; its state lives in ``state_root/prefix``."""

    def __init__(self, prefix: str = DEFAULT_PREFIX, state_root: Path = STATE_ROOT):
        if not PREFIX_PATTERN.match(prefix):
            raise ClusterError(f"bad prefix {prefix!r}: 1-7 chars, [a-z][a-z0-9]*")
        self.prefix = prefix
        self.state_dir = Path(state_root) / prefix
        self.state_path = self.state_dir / "state.json"
        self.agent_path = self.state_dir / "rsh-agent.sh"
        self.ssh_dir = self.state_dir / "ssh"   # an ``ssh`` for horovodrun --gloo (run(gloo=True))

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

    def problems(self) -> list[str]:
        """What is missing compared with the recorded configuration (empty: the cluster is up)."""
        cfg = self.config()
        if cfg is None:
            return ["no state file (never brought up, or taken down)"]
        have_ns, have_links = set(namespaces()), set(links())
        wanted_ns = [self.head_ns] + [self.host_ns(i) for i in range(cfg.hosts)]
        wanted_links = [self.bridge(r) for r in range(cfg.rails)] + [self.head_port] + [
            self.host_port(i, r) for i in range(cfg.hosts) for r in range(cfg.rails)]
        missing = [f"namespace {n}" for n in wanted_ns if n not in have_ns]
        missing += [f"link {n}" for n in wanted_links if n not in have_links]
        if not self.agent_path.exists():
            missing.append(f"rsh agent {self.agent_path}")
        return missing

    def is_up(self) -> bool:
        return os.geteuid() == 0 and not self.problems()

    # up / down
    def up(self, hosts: int, rate: str = "200mbit", ranks_per_host: int = 1, rails: int = 1,
           subnet: str = DEFAULT_SUBNET) -> ClusterConfig:
        """Create (or converge to) the cluster; a no-op when it is already up as asked."""
        require_root()
        cfg = ClusterConfig(hosts, rate, ranks_per_host, rails, subnet)
        cfg.validate()
        old = self.config()
        leftovers = self._mine(namespaces()) or self._mine(links())
        if old is not None and (old.hosts, old.rails, old.subnet) != (hosts, rails, subnet):
            say(f"topology changed ({old.hosts} hosts x {old.rails} rails -> {hosts} x {rails}): rebuilding")
            self.down()
        elif old is None and leftovers:
            say(f"found leftovers of '{self.prefix}' without state (a crash?): removing them first")
            self.down()
        self._check_no_overlap(cfg)
        say(f"up: {hosts} hosts x {rails} rail(s) at {rate}, {ranks_per_host} rank(s) per host")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        have_links = set(links())
        for rail in range(rails):
            if self.bridge(rail) not in have_links:
                sh("ip", "link", "add", self.bridge(rail), "type", "bridge")
            sh("ip", "link", "set", self.bridge(rail), "addrgenmode", "none", "up")
        self._ensure_namespace(self.head_ns)
        self._ensure_nic(self.head_ns, self.head_port, "eth0", self.bridge(0), cfg.head_address(), None)
        tbf = tbf_options(parse_rate(rate))
        for host in range(hosts):
            self._ensure_namespace(self.host_ns(host))
            for rail in range(rails):
                self._ensure_nic(self.host_ns(host), self.host_port(host, rail), f"eth{rail}",
                                 self.bridge(rail), cfg.host_address(host, rail), tbf)
        self._write_agent(cfg)
        write_text(self.state_path, json.dumps(asdict(cfg), indent=1) + "\n", mode=0o644)
        say(f"up: done; mpirun runs in {self.head_ns} ({cfg.head_address()})")
        return cfg

    def _check_no_overlap(self, cfg: ClusterConfig) -> None:
        ours = ipaddress.ip_network(cfg.subnet)
        for net in root_namespace_networks():
            if net.overlaps(ours):
                raise ClusterError(f"--subnet {cfg.subnet} overlaps {net} of this machine: pick another")

    def _ensure_namespace(self, ns: str) -> None:
        if ns not in namespaces():
            sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _ensure_nic(self, ns: str, port: str, nic: str, bridge: str, address: str,
                    tbf: Optional[list[str]]) -> None:
        """veth ``port`` (root namespace, in ``bridge``) <-> ``nic`` in ``ns``; tbf on both ends."""
        if port not in links():
            sh("ip", "link", "add", port, "type", "veth", "peer", "name", nic, "netns", ns)
        # addrgenmode none: no IPv6 link-local addresses, so no chatter and no stray addresses
        sh("ip", "link", "set", port, "master", bridge, "addrgenmode", "none", "up")
        sh("ip", "-n", ns, "link", "set", nic, "addrgenmode", "none", "up")
        sh("ip", "-n", ns, "addr", "replace", f"{address}/24", "dev", nic)
        if tbf is not None:
            sh("tc", "qdisc", "replace", "dev", port, "root", "tbf", *tbf)  # towards the host
            sh("tc", "-n", ns, "qdisc", "replace", "dev", nic, "root", "tbf", *tbf)  # from the host

    def _write_agent(self, cfg: ClusterConfig) -> None:
        """The rsh agent: called like ssh (host, then a command line), runs it in that host's ns."""
        cases = "\n".join(
            f"  {'|'.join(cfg.host_address(i, r) for r in range(cfg.rails))}) ns={self.host_ns(i)} ;;"
            for i in range(cfg.hosts))
        script = f"""#!/bin/sh
# Generated by mcallreduce.bench.cluster for cluster '{self.prefix}'. Open MPI calls this
# like ssh: [options] host command...; it runs the command in that host's network namespace.
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1; shift
case "$host" in
{cases}
  *) echo "rsh agent of cluster '{self.prefix}': unknown host $host" >&2; exit 255 ;;
esac
# Its own UTS namespace too, so each host has its own hostname (= namespace name): Open MPI
# names shared-memory segments and session dirs by hostname, and ranks of two hosts that
# share one collide (vader segfaults when R > 1).
exec ip netns exec "$ns" unshare --uts /bin/sh -c \
  'echo "$0" > /proc/sys/kernel/hostname && exec /bin/sh -c "$1"' "$ns" "$*"
"""
        write_text(self.agent_path, script, mode=0o755)
        # horovodrun starts Gloo workers with ssh (options, host, options, command). Gloo
        # resolves the hostname to find its address, so the host's hostname becomes its address.
        self.ssh_dir.mkdir(parents=True, exist_ok=True)
        write_text(self.ssh_dir / "ssh", f"""#!/bin/sh
# Generated by mcallreduce.bench.cluster for cluster '{self.prefix}': ssh, as horovodrun calls it.
while [ $# -gt 0 ]; do case "$1" in -o|-p|-i) shift 2 ;; -*) shift ;; *) break ;; esac; done
host=$1; shift
while [ $# -gt 0 ]; do case "$1" in -o|-p|-i) shift 2 ;; *) break ;; esac; done
exec {self.agent_path} "$host" "echo $host > /proc/sys/kernel/hostname && $*"
""", mode=0o755)

    def down(self) -> list[str]:
        """Remove every namespace, link (and so qdisc) named ``<prefix>-*``, and the state."""
        require_root()
        removed: list[str] = []
        my_namespaces = self._mine(namespaces())
        self._kill_processes_in(my_namespaces)
        for link in sorted(self._mine(links()), key=lambda name: "-br" in name):  # ports first
            if sh("ip", "link", "del", link, check=False).returncode == 0:
                removed.append(f"link {link}")
        for ns in my_namespaces:
            if sh("ip", "netns", "del", ns, check=False).returncode == 0:
                removed.append(f"namespace {ns}")
        if self.state_dir.exists():
            shutil.rmtree(self.state_dir)
            removed.append(f"state {self.state_dir}")
        say(f"down: removed {len(removed)} item(s) of '{self.prefix}'")
        return removed

    def _kill_processes_in(self, nss: Sequence[str]) -> None:
        """SIGKILL what still runs inside our namespaces (a hung job's daemons and ranks)."""
        spare = {os.getpid(), os.getppid()}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pids = {int(pid) for ns in nss
                    for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split()} - spare
            if not pids:
                return
            for pid in pids:  # again each round: a dying daemon may have just forked a rank
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        say(f"could not kill everything in {', '.join(nss)} (pids {sorted(pids)})")

    # status
    def status_text(self) -> str:
        cfg = self.config()
        leftovers = self._mine(namespaces()) + self._mine(links())
        if cfg is None:
            extra = f"; leftovers (run down): {', '.join(leftovers)}" if leftovers else ""
            return f"cluster '{self.prefix}': down{extra}\n"
        problems = self.problems()
        lines = [f"cluster '{self.prefix}': {'up' if not problems else 'BROKEN (run up again)'}: "
                 f"{cfg.hosts} hosts x {cfg.rails} rail(s), rate {cfg.rate} per direction, "
                 f"{cfg.ranks_per_host} rank(s) per host; state {self.state_path}"]
        lines += [f"  missing: {p}" for p in problems]
        lines.append(f"  head  {self.head_ns:<12} eth0 {cfg.head_address():<15} (mpirun runs here, unshaped)")
        for host in range(cfg.hosts):
            for rail in range(cfg.rails):
                ns, nic = self.host_ns(host), f"eth{rail}"
                out_rate = _tbf_rate(["-n", ns, "qdisc", "show", "dev", nic])
                in_rate = _tbf_rate(["qdisc", "show", "dev", self.host_port(host, rail)])
                lines.append(f"  host{host:<2} {ns:<12} {nic} {cfg.host_address(host, rail):<15} "
                             f"send {out_rate}, receive {in_rate}")
        return "\n".join(lines) + "\n"

    # running MPI jobs
    def mpirun_argv(self, argv: Sequence[str], np: Optional[int] = None,
                    env: Optional[Mapping[str, str]] = None, mca: Optional[Mapping[str, str]] = None,
                    extra: Sequence[str] = ()) -> list[str]:
        """The full command (``ip netns exec <head> mpirun ...``) that runs ``argv`` on the hosts."""
        cfg = self._up_config()
        params = {
            "plm_rsh_agent": str(self.agent_path),
            "plm_rsh_no_tree_spawn": "1",  # mpirun starts every daemon itself: simpler to debug
            "btl": "tcp,self" + (",vader" if cfg.ranks_per_host > 1 else ""),
            "btl_tcp_if_include": ",".join(str(cfg.rail_subnet(r)) for r in range(cfg.rails)),
            "oob_tcp_if_include": str(cfg.rail_subnet(0)),
        }
        params.update(mca or {})
        hosts = [f"{cfg.host_address(i)}:{cfg.ranks_per_host}" for i in range(cfg.hosts)]
        cmd = launch.mpirun_command(np or cfg.hosts * cfg.ranks_per_host, argv, env=env,
                                    hosts=hosts, mca=params, extra=extra)
        return ["ip", "netns", "exec", self.head_ns] + cmd

    def _up_config(self) -> ClusterConfig:
        cfg = self.config()
        if cfg is None:
            raise ClusterError(f"cluster '{self.prefix}' is not up: run "
                               f"python -m mcallreduce.bench.cluster up --hosts N first")
        return cfg

    def horovodrun_gloo_argv(self, argv: Sequence[str], np: Optional[int] = None) -> list[str]:
        """``argv`` under Horovod's Gloo controller (``horovodrun --gloo``) on the hosts, from the
        head namespace; horovodrun passes its own environment on to the workers."""
        cfg = self._up_config()
        horovodrun = shutil.which("horovodrun") or str(Path(sys.executable).with_name("horovodrun"))
        hosts = ",".join(f"{cfg.host_address(i)}:{cfg.ranks_per_host}" for i in range(cfg.hosts))
        return ["ip", "netns", "exec", self.head_ns, "env", f"PATH={self.ssh_dir}:{os.environ.get('PATH', '')}",
                horovodrun, "--gloo", "-np", str(np or cfg.hosts * cfg.ranks_per_host), "-H", hosts,
                "--network-interface", "eth0", *argv]

    def run(self, argv: Sequence[str], np: Optional[int] = None,
            env: Optional[Mapping[str, str]] = None, timeout: Optional[float] = 300.0,
            mca: Optional[Mapping[str, str]] = None, extra: Sequence[str] = (),
            capture: bool = True, check: bool = False, gloo: bool = False) -> subprocess.CompletedProcess:
        """Run an MPI job across the hosts; ``env`` is exported to every rank (``-x``).
        ``gloo``: start it with ``horovodrun --gloo`` instead (Horovod's Gloo controller).

        A job that outlives ``timeout`` is killed with everything running on the emulated
        hosts and reported with returncode -9, so a hung collective fails instead of stalling.
        """
        require_root()
        # The daemons on the emulated hosts keep their session directories under /tmp and
        # leave them behind (a killed job always does): one fresh base per job, removed after.
        session = tempfile.mkdtemp(prefix=f"{self.prefix}-ompi-")
        cmd = (self.horovodrun_gloo_argv(argv, np=np) if gloo else
               self.mpirun_argv(argv, np=np, env=env, mca={"orte_tmpdir_base": session, **(mca or {})},
                                extra=extra))
        full_env = dict(os.environ)
        full_env.update(env or {})
        pipe = subprocess.PIPE if capture else None
        try:
            proc = subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, env=full_env,
                                    start_new_session=True)
            try:
                out, err = proc.communicate(timeout=timeout)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                self._kill_processes_in(self._mine(namespaces()))
                out, err = proc.communicate()
                code = -9
                err = (err or "") + f"\n[cluster] killed after {timeout:.0f}s timeout\n"
                if not capture:
                    say(f"killed after {timeout:.0f}s timeout")
        finally:
            shutil.rmtree(session, ignore_errors=True)
        result = subprocess.CompletedProcess(cmd, code, out, err)
        if check and code != 0:
            raise ClusterError(f"MPI job failed ({code}): {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
        return result

    def host_command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run directly (no MPI) on emulated host ``host``."""
        return ["ip", "netns", "exec", self.host_ns(host), *argv]


def _tbf_rate(tc_args: list[str]) -> str:
    proc = sh("tc", "-j", *tc_args, check=False)
    try:
        for qdisc in json.loads(proc.stdout or "[]"):
            if qdisc.get("kind") == "tbf":
                return f"{qdisc['options']['rate'] * 8 / 1e6:g}mbit"
    except (ValueError, KeyError):
        pass
    return "unshaped?"


# ---------------------------------------------------------------- command line
def main(args: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcallreduce.bench.cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX,
                        help="name prefix of everything created (default: %(default)s, "
                             "or $MCALLREDUCE_CLUSTER_PREFIX)")
    sub = parser.add_subparsers(dest="action", required=True)
    p_up = sub.add_parser("up", help="create the cluster (idempotent)")
    p_up.add_argument("--hosts", type=int, required=True)
    p_up.add_argument("--rate", default="200mbit", help="per NIC and direction (default %(default)s)")
    p_up.add_argument("--ranks-per-host", type=int, default=1)
    p_up.add_argument("--rails", type=int, choices=(1, 2), default=1)
    p_up.add_argument("--subnet", default=DEFAULT_SUBNET, help="private range, one /24 per rail")
    sub.add_parser("status", help="hosts, addresses, qdisc rates, up or not")
    sub.add_parser("down", help="remove everything named <prefix>-*")
    p_run = sub.add_parser("run", help="run an MPI job across the hosts: run [-np N] -- cmd ...")
    p_run.add_argument("-np", "--np", type=int, default=None, help="ranks (default hosts x R)")
    p_run.add_argument("-x", dest="env", action="append", default=[], metavar="NAME=VALUE")
    p_run.add_argument("--timeout", type=float, default=None, help="seconds (default: none)")
    p_run.add_argument("--dry-run", action="store_true", help="print the command only")
    p_run.add_argument("--gloo", action="store_true",
                       help="start it with horovodrun --gloo (Horovod's Gloo controller) instead of mpirun")
    p_run.add_argument("command", nargs=argparse.REMAINDER)
    p_check = sub.add_parser("check", help="raw TCP throughput between two hosts vs the rate")
    p_check.add_argument("--seconds", type=float, default=3.0, help="transfer length per rail")
    p_ar = sub.add_parser("allreduce", help="MPI_Allreduce bus bandwidth across the hosts")
    p_ar.add_argument("--sizes", default="8M,32M", help="bytes per rank, e.g. 8M,32M")
    p_ar.add_argument("--algorithm", choices=("default", "ring"), default="default",
                      help="Open MPI's tuned default, or its ring (coll_tuned algorithm 4)")
    p_dx = sub.add_parser("duplex", help="MPI streams host 0 <-> host 1: one way vs both ways, per message size")
    p_dx.add_argument("--segments", default="60K,256K,1M", help="message sizes, e.g. 60K,256K")
    p_dx.add_argument("--bytes", default="32M", help="bytes per direction and size")
    p_dx.add_argument("--window", type=int, default=8, help="messages in flight per direction")
    p_pp = sub.add_parser("pingpong", help="host 0 <-> host 1 latency while the other ranks wait in MPI vs sleep")
    p_pp.add_argument("--size", default="4K", help="message size (default %(default)s)")
    p_pp.add_argument("--count", type=int, default=400, help="timed round trips per case")
    p_pp.add_argument("-np", "--np", type=int, default=None, help="ranks (default hosts x R), placed by node")
    ns = parser.parse_args(args)
    try:
        cluster = Cluster(ns.prefix)
        if ns.action == "up":
            cluster.up(ns.hosts, ns.rate, ns.ranks_per_host, ns.rails, ns.subnet)
            print(cluster.status_text(), end="")
        elif ns.action == "status":
            require_root()
            print(cluster.status_text(), end="")
            return 0 if cluster.is_up() else 1
        elif ns.action == "down":
            cluster.down()
        elif ns.action == "run":
            argv = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
            if not argv:
                parser.error("run: no program given (use: run [-np N] -- program args...)")
            env = dict(item.split("=", 1) if "=" in item else (item, os.environ.get(item, ""))
                       for item in ns.env)
            if ns.dry_run:
                print(" ".join(cluster.horovodrun_gloo_argv(argv, np=ns.np) if ns.gloo else
                               cluster.mpirun_argv(argv, np=ns.np, env=env)))
                return 0
            return cluster.run(argv, np=ns.np, env=env, timeout=ns.timeout, capture=False, gloo=ns.gloo).returncode
        elif ns.action in ("check", "allreduce", "duplex", "pingpong"):
            from mcallreduce.bench import cluster_measure
            if ns.action == "check":
                return cluster_measure.check_main(cluster, ns.seconds)
            if ns.action == "pingpong":
                return cluster_measure.pingpong_main(cluster, ns.size, ns.count, ns.np)
            if ns.action == "duplex":
                return cluster_measure.duplex_main(cluster, ns.segments, ns.bytes, ns.window)
            return cluster_measure.allreduce_main(cluster, ns.sizes, ns.algorithm)
    except (ClusterError, ConfigError) as err:
        print(f"cluster: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
