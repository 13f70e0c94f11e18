"""The Linux side of the emulated cluster: shell calls, root and tool checks, namespaces, links
and TCP's congestion control (the tbf arguments are :mod:`mcallreduce.shaping`'s). :mod:`.cluster_hosts`
builds hosts from them; :mod:`.cluster_measure` uses them too, without importing the cluster.
"""
from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

__all__ = ["ClusterError", "say", "sh", "require_root", "namespaces", "links",
           "root_namespace_networks", "check_congestion_control", "set_congestion_control"]


class ClusterError(RuntimeError):
    """A cluster operation failed; the message says what to do about it."""


def say(message: str) -> None:
    print(f"[cluster] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- shell helpers
def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


#: the commands the emulated cluster runs, and the Debian package of each (scripts/setup_env.sh installs them)
TOOLS = {"ip": "iproute2", "tc": "iproute2", "unshare": "util-linux"}


def require_root() -> None:
    """Namespaces, veths, bridges and qdiscs all need CAP_NET_ADMIN: say so plainly."""
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster needs root (it creates network namespaces, "
                           "veth pairs, bridges and tc qdiscs): run it as root, e.g. "
                           "sudo .venv/bin/python -m mcallreduce.bench.cluster ...")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        install = " ".join(sorted({TOOLS[tool] for tool in missing}))
        raise ClusterError(f"{', '.join(missing)} not found: apt-get install -y {install}")


def namespaces() -> list[str]:
    out = sh("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def links(netns: Optional[str] = None) -> list[str]:
    """Interface names ('eth0', not 'eth0@if12') in the root namespace or in ``netns``."""
    out = sh("ip", *(("-n", netns) if netns else ()), "-o", "link", "show").stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.strip()]


def root_namespace_networks() -> list[ipaddress.IPv4Network]:
    out = sh("ip", "-o", "-4", "addr", "show").stdout
    return [ipaddress.ip_interface(line.split()[3]).network for line in out.splitlines() if line.strip()]


# ---------------------------------------------------------------- TCP
#: the congestion controls a namespace other than the machine's own may switch to
ALLOWED_CONGESTION_CONTROLS = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")


def check_congestion_control(name: str) -> None:
    """Raise unless a namespace may switch to TCP congestion control ``name`` on this machine."""
    allowed = ALLOWED_CONGESTION_CONTROLS.read_text().split()
    if name not in allowed:
        raise ClusterError(f"TCP congestion control {name!r}: a namespace may use only {', '.join(allowed)} "
                           f"here; pick one of them, or add {name} to net.ipv4.tcp_allowed_congestion_control")


def set_congestion_control(netns: str, name: str) -> None:
    """Make ``name`` (:func:`check_congestion_control`) the TCP congestion control of new connections in ``netns``."""
    # written from inside the namespace, whose /proc/sys/net is its own
    write = f"open('/proc/sys/net/ipv4/tcp_congestion_control', 'w').write({name!r})"
    sh("ip", "netns", "exec", netns, sys.executable, "-c", write)


def tbf_rate(netns: Optional[str], dev: str) -> Optional[float]:
    """The rate (bits/s) of the tbf qdisc on ``dev`` (in ``netns``, or the root namespace), None if it has none."""
    proc = sh("tc", "-j", *(["-n", netns] if netns else []), "qdisc", "show", "dev", dev, check=False)
    try:
        return next((q["options"]["rate"] * 8.0 for q in json.loads(proc.stdout or "[]") if q.get("kind") == "tbf"),
                    None)
    except (ValueError, KeyError, TypeError):
        return None


def ipv4_addresses(netns: str, dev: str) -> list[str]:
    """The IPv4 addresses of ``dev`` in ``netns``."""
    proc = sh("ip", "-j", "-n", netns, "-4", "addr", "show", "dev", dev, check=False)
    try:
        return [a["local"] for link in json.loads(proc.stdout or "[]") for a in link.get("addr_info", [])]
    except (ValueError, KeyError, TypeError):
        return []
