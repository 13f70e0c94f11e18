"""An emulated multi-host cluster on one Linux machine: one network namespace per host.

    python -m mcallreduce.bench.cluster up --hosts 4 --rate 200mbit [--ranks-per-host R] [--rails 1|2] \\
        [--cpus-per-host C] [--mtu N] [--keep-autogroups] [--congestion-control NAME]
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
With ``--cpus-per-host C`` each host's processes are also capped at C cores (bench/cluster_cpu.py).
While a cluster is up the kernel's autogroups are off (bench/autogroups.py: they let a host's
thread spinning in ``sched_yield`` hold a core for seconds), and TCP in every namespace runs reno
unless ``--congestion-control`` says otherwise (docs/cluster.md, "TCP").
The bridges have no real interface and no address, and no namespace has a default route:
nothing leaves the machine. Everything is found by its name prefix, so ``down`` also cleans up after a crash.
The topology and the measured numbers are in docs/cluster.md.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

from mcallreduce import launch
from mcallreduce.errors import ConfigError
from mcallreduce.bench.cluster_cpu import DEFAULT_CPU_PERIOD_MS
from mcallreduce.bench.cluster_hosts import ClusterHosts
from mcallreduce.bench.cluster_jobs import TMPDIR_MCA, ClusterJobs
from mcallreduce.bench.cluster_state import (DEFAULT_CONGESTION_CONTROL, DEFAULT_MTU, DEFAULT_PREFIX, DEFAULT_SUBNET,
                                            ClusterConfig)
from mcallreduce.bench.netns import ClusterError, require_root

__all__ = ["Cluster", "ClusterConfig", "ClusterError", "main"]


class Cluster(ClusterHosts, ClusterJobs):
    """The emulated cluster named ``prefix``; its state lives in ``state_root/prefix``.

    Its names and saved state come from :mod:`.cluster_state`, ``up``/``down``/``status_text``
    from :mod:`.cluster_hosts`, ``run`` and the other job commands from :mod:`.cluster_jobs`.
    """


# ---------------------------------------------------------------- command line
def positive(text: str) -> int:
    """A whole number of 1 or more (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return value


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
    p_up.add_argument("--cpus-per-host", type=float, default=None, metavar="C",
                      help="cap each host's processes at C cores, a cgroup per host (default: the hosts "
                           "share the machine's cores)")
    p_up.add_argument("--cpu-period-ms", type=float, default=DEFAULT_CPU_PERIOD_MS, metavar="MS",
                      help="with --cpus-per-host: the period over which the cap holds (default %(default)g; "
                           "a host that spent its share stops until the period ends)")
    p_up.add_argument("--mtu", type=int, default=DEFAULT_MTU,
                      help="frame size of every link (default %(default)s; 9000: jumbo frames)")
    p_up.add_argument("--keep-autogroups", action="store_true",
                      help="leave the kernel's autogroups on (by default they are off while the cluster is up: "
                           "a host's thread spinning in sched_yield can hold a core for seconds; docs/cluster.md)")
    p_up.add_argument("--congestion-control", default=DEFAULT_CONGESTION_CONTROL, metavar="NAME",
                      help="TCP congestion control in every namespace (default %(default)s; docs/cluster.md, \"TCP\")")
    sub.add_parser("status", help="hosts, addresses, qdisc rates, up or not")
    sub.add_parser("down", help="remove everything named <prefix>-*")
    p_run = sub.add_parser("run", help="run an MPI job across the hosts: run [-np N] -- cmd ...")
    p_run.add_argument("-np", "--np", type=positive, default=None, help="ranks (default hosts x R)")
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
    p_dx.add_argument("--window", type=positive, default=8, help="messages in flight per direction")
    p_dx.add_argument("--json", help="also write the rows to this file")
    p_pp = sub.add_parser("pingpong", help="host 0 <-> host 1 latency while the other ranks wait in MPI vs sleep")
    p_pp.add_argument("--size", default="4K", help="message size (default %(default)s)")
    p_pp.add_argument("--count", type=int, default=400, help="timed round trips per case")
    p_pp.add_argument("-np", "--np", type=positive, default=None, help="ranks (default hosts x R), placed by node")
    ns = parser.parse_args(args)
    try:
        cluster = Cluster(ns.prefix)
        if ns.action == "up":
            cluster.up(ns.hosts, ns.rate, ns.ranks_per_host, ns.rails, ns.subnet, ns.cpus_per_host, ns.cpu_period_ms,
                       ns.mtu, ns.keep_autogroups, ns.congestion_control)
            print(cluster.status_text(), end="")
        elif ns.action == "status":
            require_root()
            problems = cluster.problems()
            print(cluster.status_text(problems), end="")
            return 0 if not problems else 1
        elif ns.action == "down":
            cluster.down()
        elif ns.action == "run":
            argv = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
            if not argv:
                parser.error("run: no program given (use: run [-np N] -- program args...)")
            env = launch.exported_env(ns.env)
            if ns.dry_run:   # what run executes; mkdtemp ends the per-job directory's name at run time
                tmpdir = os.path.join(tempfile.gettempdir(), cluster.job_tmpdir_prefix + "XXXXXXXX")
                print(shlex.join(cluster.job_argv(argv, np=ns.np, env=env, mca={TMPDIR_MCA: tmpdir}, gloo=ns.gloo)[0]))
                return 0
            code = cluster.run(argv, np=ns.np, env=env, timeout=ns.timeout, capture=False, gloo=ns.gloo).returncode
            return 128 - code if code < 0 else code   # a signal's death as a shell reports it (137: killed)
        elif ns.action in ("check", "allreduce", "duplex", "pingpong"):
            from mcallreduce.bench import cluster_measure
            if ns.action == "check":
                return cluster_measure.check_main(cluster, ns.seconds)
            if ns.action == "pingpong":
                return cluster_measure.pingpong_main(cluster, ns.size, ns.count, ns.np)
            if ns.action == "duplex":
                return cluster_measure.duplex_main(cluster, ns.segments, ns.bytes, ns.window, ns.json)
            return cluster_measure.allreduce_main(cluster, ns.sizes, ns.algorithm)
    except (ClusterError, ConfigError, ValueError, RuntimeError) as err:
        print(f"cluster: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # the job is gone with it (Cluster.run)
        print("cluster: interrupted", file=sys.stderr)
        return 130
    except subprocess.CalledProcessError as err:   # a command on the hosts (ip, tc, iperf-like probes) failed
        print(f"cluster: error: {' '.join(map(str, err.cmd))} failed ({err.returncode}): "
              f"{(err.stderr or '').strip()[-500:]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
