"""The emulated cluster, for real: namespaces, veths, tbf, mpirun over the rsh agent.

Every test uses its own prefix ("mct*"), so a cluster a developer has up ("mcar") is never
touched. Needs root and working ``ip netns``; skipped with the reason otherwise.
"""
import importlib.util
import json
import os
import re
import shutil
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from mcallreduce.config import ConfigError
from mcallreduce.units import parse_rate
from mcallreduce.bench.cluster import Cluster, ClusterConfig, main
from mcallreduce.bench.netns import ClusterError, links, namespaces
from mcallreduce.shaping import tbf_options
from mcallreduce.bench.cluster_measure import measure_tcp, parse_size

REPO = Path(__file__).resolve().parents[1]
PREFIX = "mctest"
CLI = [sys.executable, "-m", "mcallreduce.bench.cluster"]


def _why_no_cluster():
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "ip netns does not work here"
    if shutil.which("mpirun") is None:
        return "no mpirun on PATH"
    return None


needs_cluster = pytest.mark.skipif(_why_no_cluster() is not None, reason=str(_why_no_cluster()))


def cli(*args, prefix=PREFIX, timeout=120):
    return subprocess.run(CLI + ["--prefix", prefix, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def leftovers(prefix):
    """Namespaces, links, cpu cgroups and mounts named after the cluster."""
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
              if f"/{prefix}/" in line.split()[1]]
    named = [n for n in namespaces() + links() if n.startswith(prefix + "-")]
    return named + Cluster(prefix).cpu_budget.cgroup_names() + mounts


# ---------------------------------------------------------------- no root needed
def test_rates_and_tbf_burst():
    assert parse_rate("200mbit") == 200_000_000
    assert parse_rate("1Gbit") == 1_000_000_000
    assert parse_rate("25mbps") == 200_000_000
    with pytest.raises(ConfigError, match="bad rate"):
        parse_rate("fast")
    opts = tbf_options(parse_rate("10gbit"))
    burst = int(opts[opts.index("burst") + 1])
    assert burst >= 10e9 / 8 * 0.004  # enough for a timer tick at 10 Gbit/s
    assert parse_size("8M") == 8 << 20 and parse_size("64K") == 64 << 10


def test_bad_prefix_is_refused():
    with pytest.raises(ClusterError, match="bad prefix"):
        Cluster("this-is-far-too-long")


def test_a_cpu_budget_or_mtu_out_of_range_is_refused_before_anything_is_made():
    ClusterConfig(2, cpus_per_host=0.5, cpu_period_ms=100).validate()
    for cpus, period, match in ((0, 10, "--cpus-per-host"), (os.cpu_count() + 1, 10, "--cpus-per-host"),
                                (0.5, 0.1, "--cpu-period-ms"), (0.5, 5000, "--cpu-period-ms"),
                                (0.05, 10, "under 1 ms")):
        with pytest.raises(ClusterError, match=match):
            ClusterConfig(2, cpus_per_host=cpus, cpu_period_ms=period).validate()
    for mtu in (100, 70000):
        with pytest.raises(ClusterError, match="--mtu"):
            ClusterConfig(2, mtu=mtu).validate()


def test_measurement_sizes_and_windows_that_measure_nothing_are_refused_before_any_job(capsys):
    """Checked before the cluster is looked at: no cluster named PREFIX is up here."""
    for args, match in ((["allreduce", "--sizes", "8M,3"], "3 bytes is not a positive multiple of 4"),
                        (["allreduce", "--sizes", "0"], "0 bytes"),
                        (["duplex", "--segments", "60K,0"], "--segments: 0 bytes"),
                        (["duplex", "--bytes", "0"], "--bytes: 0 bytes")):
        assert main(["--prefix", PREFIX, *args]) == 2
        assert match in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--prefix", PREFIX, "duplex", "--window", "0"])
    assert exit_.value.code == 2 and "'0' is not a whole number of 1 or more" in capsys.readouterr().err


def test_non_root_gets_a_clear_error(capsys):
    args = ["--prefix", PREFIX, "up", "--hosts", "2"]
    if os.geteuid() != 0:  # we are the unprivileged user already
        assert main(args) == 2
        assert "needs root" in capsys.readouterr().err
        return
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv to drop root")
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + CLI + args,
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert "needs root" in proc.stderr


# ---------------------------------------------------------------- a real 2-host cluster
@pytest.fixture(scope="module")
def cluster():
    why = _why_no_cluster()
    if why:
        pytest.skip(why)
    c = Cluster(PREFIX)
    c.down()
    c.up(2, rate="200mbit")
    yield c
    c.down()
    assert leftovers(PREFIX) == []


JOB = textwrap.dedent("""
    import subprocess
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    ns = subprocess.run(["ip", "netns", "identify"], capture_output=True, text=True).stdout.strip()
    addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True,
                          text=True).stdout.split()[3]
    buf = np.full(1 << 18, comm.rank + 1, dtype=np.float32)   # 1 MiB over the shaped link
    comm.Allreduce(MPI.IN_PLACE, buf)
    rows = comm.gather(f"{comm.rank} {comm.size} {ns} {addr} {int(buf.min())} {int(buf.max())}")
    if comm.rank == 0:  # one writer: lines of ranks on one host may interleave mid-line
        print("\\n".join(rows), flush=True)
""")


def run_job(cluster, tmp_path, **kwargs):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    proc = cluster.run([sys.executable, str(script)], timeout=120, **kwargs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line.split() for line in proc.stdout.splitlines() if line.strip()]


@needs_cluster
def test_status_shows_hosts_addresses_and_rates(cluster):
    proc = cli("status")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "up:" in proc.stdout and "2 hosts" in proc.stdout
    for host in range(2):
        assert f"{PREFIX}-h{host}" in proc.stdout and cluster.config().host_address(host) in proc.stdout
    assert proc.stdout.count("send 200mbit, receive 200mbit") == 2


@needs_cluster
def test_a_dry_run_prints_the_job_with_its_temporary_directory_and_starts_nothing(cluster):
    proc = cli("run", "--dry-run", "-x", "ONE=1", "--", "echo", "two words")
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    assert argv[-2:] == ["echo", "two words"] and "ONE=1" in argv, argv
    tmpdir = argv[argv.index("orte_tmpdir_base") + 1]
    assert tmpdir == os.path.join(tempfile.gettempdir(), f"{PREFIX}-ompi-XXXXXXXX") and not os.path.exists(tmpdir)


@needs_cluster
def test_run_spans_both_hosts_and_sums_right(cluster, tmp_path):
    rows = sorted(run_job(cluster, tmp_path))
    assert [r[0] for r in rows] == ["0", "1"]
    assert {r[2] for r in rows} == {f"{PREFIX}-h0", f"{PREFIX}-h1"}  # one rank per namespace
    assert {r[3] for r in rows} == {"10.213.0.1/24", "10.213.0.2/24"}
    assert all(r[4] == r[5] == "3" for r in rows)  # 1 + 2 everywhere


@needs_cluster
def test_a_benchmark_record_made_on_the_cluster_names_its_settings(cluster, tmp_path):
    out = tmp_path / "bench.json"
    proc = cluster.run([sys.executable, "-m", "mcallreduce.bench", "--sizes", "4K", "--algorithms", "multicolor",
                        "--iters", "2", "--json", str(out)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert record["cluster"]["hosts"] == 2 and record["cluster"]["rate"] == "200mbit"
    assert record["cluster"]["congestion_control"] == "reno" and record["cluster"]["mtu"] == 1500


GLOO_JOB = textwrap.dedent("""
    import subprocess
    import torch
    import horovod.torch as hvd
    hvd.init()   # Horovod's Gloo controller: no MPI
    ns = subprocess.run(["ip", "netns", "identify"], capture_output=True, text=True).stdout.strip()
    total = hvd.allreduce(torch.full((1 << 18,), float(hvd.rank() + 1)), op=hvd.Sum)   # Gloo's ring
    names = hvd.allgather_object(ns)
    if hvd.rank() == 0:
        print("GLOO", hvd.size(), int(total.min()), int(total.max()), *sorted(names), flush=True)
""")


@needs_cluster
@pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="Horovod is not installed")
def test_run_with_gloo_starts_horovods_gloo_controller_on_both_hosts(cluster, tmp_path):
    script = tmp_path / "gloo_job.py"
    script.write_text(GLOO_JOB)
    proc = cluster.run([sys.executable, str(script)], timeout=180, gloo=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if "GLOO" in ln)
    assert line.split("GLOO", 1)[1].split() == ["2", "3", "3", f"{PREFIX}-h0", f"{PREFIX}-h1"], line


@needs_cluster
def test_up_is_idempotent_and_changes_rate_slots_and_mtu_in_place(cluster, tmp_path):
    before = sorted(leftovers(PREFIX))
    proc = cli("up", "--hosts", "2", "--rate", "200mbit")
    assert proc.returncode == 0 and "rebuilding" not in proc.stderr, proc.stderr
    assert sorted(leftovers(PREFIX)) == before
    try:
        assert cli("up", "--hosts", "2", "--rate", "100mbit", "--ranks-per-host", "2", "--mtu", "9000").returncode == 0
        assert sorted(leftovers(PREFIX)) == before
        status = cli("status").stdout
        assert status.count("send 100mbit, receive 100mbit") == 2 and "MTU 9000" in status
        nic = subprocess.run(["ip", "-n", f"{PREFIX}-h1", "-j", "link", "show", "eth0"], capture_output=True, text=True)
        assert json.loads(nic.stdout)[0]["mtu"] == 9000
        rows = run_job(cluster, tmp_path)  # np defaults to hosts x R = 4; vader within a host
        assert sorted(r[2] for r in rows) == [f"{PREFIX}-h0"] * 2 + [f"{PREFIX}-h1"] * 2
        assert all(r[4] == r[5] == "10" for r in rows)  # 1 + 2 + 3 + 4
    finally:
        cluster.up(2, rate="200mbit")


BURN_JOB = textwrap.dedent("""
    import os, threading, time
    from mpi4py import MPI
    from mcallreduce.cgroups import usable_cores
    from mcallreduce.policy import progress_thread

    def burn(seconds=1.5):
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            pass

    fields = [line.rstrip("\\n").split(":", 2) for line in open("/proc/self/cgroup")]
    cgroup = next((path for _, names, path in fields if "cpu" in names.split(",")),      # cgroup v1
                  next(path for _, names, path in fields if names == ""))               # else v2
    before, start = os.times(), time.monotonic()
    child = os.fork()
    if child == 0:      # a DataLoader worker, as it were
        burn()
        os._exit(0)
    thread = threading.Thread(target=burn)
    thread.start()
    burn()
    thread.join()
    os.waitpid(child, 0)
    after, wall = os.times(), time.monotonic() - start
    cores = (sum(after[:4]) - sum(before[:4])) / wall   # user + system, own and the child's
    seen = f"{usable_cores():g} {progress_thread([[0]], {})}"     # what the policy counts on this host
    rows = MPI.COMM_WORLD.gather(f"{MPI.COMM_WORLD.rank} {cgroup} {cores:.3f} {seen}")
    if MPI.COMM_WORLD.rank == 0:
        print("\\n".join(rows), flush=True)
""")


@needs_cluster
def test_cpu_overlap_measures_two_capped_processes_and_restores_the_slice():
    from mcallreduce.bench import cpu_overlap
    from mcallreduce.cgroups import cpu_hierarchy
    if cpu_hierarchy() is None:
        pytest.skip("no cgroup cpu controller is mounted")
    before = Path(cpu_overlap.SLICE_FILE).read_text()
    proc = subprocess.run([sys.executable, "-m", "mcallreduce.bench.cpu_overlap", "--cpus", "0.5", "--seconds", "1",
                           "--slice-us", "1000"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert Path(cpu_overlap.SLICE_FILE).read_text() == before
    one, two, both = (float(x) for x in re.search(r"a CPU ([\d.]+), ([\d.]+) of the time; both at once ([\d.]+)",
                                                  proc.stdout).groups())
    shares = [one, two]
    assert abs(sum(shares) - 0.5) < 0.1, proc.stdout          # the two share the half core
    assert 0 <= both <= min(shares) + 0.01, proc.stdout
    assert cpu_overlap.both_running([(0, 10), (20, 30)], [(5, 25)]) == 10


def test_a_process_in_a_capped_cgroup_counts_its_quota_and_keeps_no_progress_thread():
    from mcallreduce.cgroups import cap_cpu, cpu_hierarchy
    hierarchy = cpu_hierarchy()
    if hierarchy is None or os.geteuid() != 0:
        pytest.skip("no cgroup cpu controller, or not root")
    path = hierarchy.ensure(f"mctest-quota-{os.getpid()}")
    try:
        cap_cpu(hierarchy, path, 0.5, 10)   # a container's or a batch job's half core
        code = ("from mcallreduce.cgroups import usable_cores; from mcallreduce.policy import progress_thread; "
                "print(usable_cores(), progress_thread([[0]], {}))")
        proc = subprocess.run(["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(path, "cgroup.procs"),
                               sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["0.5", "False"]   # one rank, half a core: none to spare for the thread
    finally:
        os.rmdir(path)


@needs_cluster
def test_a_cpu_budget_per_host_caps_a_rank_with_its_threads_and_children(cluster, tmp_path):
    if cluster.cpu_budget.hierarchy is None:
        pytest.skip("no cgroup cpu controller is mounted")
    script = tmp_path / "burn.py"
    script.write_text(BURN_JOB)
    try:
        proc = cli("up", "--hosts", "2", "--rate", "200mbit", "--cpus-per-host", "0.25")
        assert proc.returncode == 0, proc.stderr
        assert cli("status").stdout.count("cpu 0.25") == 2
        out = cluster.run([sys.executable, str(script)], timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        rows = sorted(line.split() for line in out.stdout.splitlines() if line.strip())
        assert [(r[0], r[1]) for r in rows] == [("0", f"/{PREFIX}-h0"), ("1", f"/{PREFIX}-h1")], rows
        # three busy loops (main thread, a thread, a forked child) get a quarter of a core together
        assert all(0.15 < float(r[2]) < 0.35 for r in rows), rows
        # and each rank sees its host's quarter core, as a container's, so `auto` keeps no progress thread
        assert [r[3:] for r in rows] == [["0.25", "False"]] * 2, rows
        budgeted = max(float(r[2]) for r in rows)
        code = "from mcallreduce.cgroups import usable_cores; print(usable_cores())"   # a plain process too
        plain = subprocess.run(cluster.host_command(1, [sys.executable, "-c", code]), capture_output=True,
                               text=True, timeout=60, cwd=REPO)
        assert (plain.returncode, plain.stdout.split()) == (0, ["0.25"]), plain.stderr
    finally:
        cluster.up(2, rate="200mbit")
    assert cluster.cpu_budget.cgroup_names() == [] and "cpu " not in cli("status").stdout
    out = cluster.run([sys.executable, str(script)], timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = sorted(line.split() for line in out.stdout.splitlines())
    assert len(rows) == 2 and not any(PREFIX in r[1] for r in rows), rows
    assert all(float(r[2]) > 2 * budgeted for r in rows), rows     # the shared machine again
    assert all(float(r[3]) == len(os.sched_getaffinity(0)) for r in rows), rows


@needs_cluster
def test_shaping_holds_raw_tcp_near_the_rate(cluster):
    mbs = measure_tcp(cluster, 0, 1, rail=0, seconds=1.0)
    assert 0.8 * 25.0 < mbs < 1.02 * 25.0, f"{mbs:.1f} MB/s at 200mbit"


@needs_cluster
def test_duplex_measures_one_way_and_two_way_streams(cluster, tmp_path):
    out = tmp_path / "duplex.json"
    proc = cli("duplex", "--segments", "60K,4K", "--bytes", "2M", "--window", "4", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {int(line.split()[0]): [float(x) for x in line.split()[1:]]
            for line in proc.stdout.splitlines() if line.split() and line.split()[0].isdigit()}
    assert sorted(rows) == [4096, 61440]
    for one, two, ratio in rows.values():
        assert 0 < one < 1.1 * 25.0 and 0 < two < 1.1 * 25.0 and ratio == pytest.approx(two / one, abs=0.01)
    record = json.loads(out.read_text())   # the same rows, for docs/data
    assert record["rate"] == "200mbit" and record["bytes_per_direction"] == 2 << 20
    assert record["cluster"]["congestion_control"] == "reno" and record["cluster"]["hosts"] == 2
    saved = {(r["segment"], r["both"]): r["MBps_per_direction"] for r in record["rows"]}
    for seg, (one, two, _) in rows.items():
        assert saved[(seg, False)] == pytest.approx(one, abs=0.05) and saved[(seg, True)] == pytest.approx(two, abs=0.05)


@needs_cluster
def test_pingpong_times_a_hop_with_the_other_ranks_waiting_and_sleeping(cluster):
    proc = cli("pingpong", "--size", "4K", "--count", "50", "-np", "4")   # 2 ranks per host
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line[:14].strip(): float(line.split()[-1]) for line in proc.stdout.splitlines()
            if line.startswith(("wait in MPI", "sleep"))}
    assert sorted(rows) == ["sleep", "wait in MPI"], proc.stdout
    # a message crosses the veths and the shaper: more than a microsecond, far less than 100 ms
    assert all(1 < us < 100_000 for us in rows.values()), rows


def netns_pids(ns: str) -> str:
    """The processes in namespace ``ns``; a failing ``ip`` (the namespace gone) raises, not reads as none."""
    return subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=True).stdout


@needs_cluster
def test_a_hung_job_is_killed_with_its_ranks(cluster):
    import glob
    sessions = set(glob.glob("/tmp/ompi.*/*"))   # the daemons' session directories
    proc = cluster.run([sys.executable, "-c", "import time; time.sleep(120)"], timeout=5)
    assert proc.returncode == -9 and "timeout" in proc.stderr
    for ns in (cluster.host_ns(0), cluster.host_ns(1)):
        assert netns_pids(ns) == ""
    # killed daemons cannot remove their session directories; every job gets a base of its
    # own, removed by the launcher (they used to pile up in /tmp/ompi.<host>.0, one per kill)
    assert set(glob.glob("/tmp/ompi.*/*")) - sessions == set()
    assert glob.glob(f"/tmp/{PREFIX}-ompi-*") == []


@needs_cluster
def test_a_terminated_or_interrupted_run_takes_its_job_with_it(cluster):
    # the job runs in a session of its own: a signal to the command once left mpirun and the ranks running
    for how in ("SIGTERM", "SIGINT"):
        proc = subprocess.Popen(["python3", "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                                 "os.execvp(sys.argv[1], sys.argv[1:])", *CLI, "--prefix", PREFIX, "run", "--",
                                 "sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while netns_pids(cluster.host_ns(1)) == "":
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else how
            time.sleep(0.2)
        proc.send_signal(getattr(signal, how))
        assert proc.wait(timeout=30) in (130, 143), how
        for ns in (cluster.host_ns(0), cluster.host_ns(1), cluster.head_ns):
            assert netns_pids(ns) == "", (how, ns)
    assert cli("run", "--timeout", "2", "--", "sleep", "30").returncode == 137   # killed, as a shell reports it


@needs_cluster
def test_a_broken_cluster_is_refused_and_a_rejected_up_leaves_the_running_one_alone(cluster):
    from mcallreduce.bench.netns import root_namespace_networks
    taken = next((net for net in root_namespace_networks() if net.is_private and net.prefixlen <= 24), None)
    if taken is not None:   # a /24 of this machine's own network
        out = cli("up", "--hosts", "3", "--subnet", str(next(taken.subnets(new_prefix=24))))
        assert out.returncode == 2 and "overlaps" in out.stderr, out.stderr
        assert cli("status").returncode == 0   # it used to be taken down before the subnet was checked
    prefix = "mctestb"
    try:
        assert cli("up", "--hosts", "2", prefix=prefix).returncode == 0
        subprocess.run(["ip", "link", "del", f"{prefix}-h1r0"], check=True)
        out = cli("run", "--", "hostname", prefix=prefix, timeout=60)
        assert out.returncode == 2 and "BROKEN" in out.stderr and f"link {prefix}-h1r0" in out.stderr, out.stderr
    finally:
        cli("down", prefix=prefix)
    assert leftovers(prefix) == []
    out = cli("run", "--", "hostname", prefix=prefix)
    assert out.returncode == 2 and f"--prefix {prefix} up" in out.stderr, out.stderr


@needs_cluster
def test_status_says_broken_when_a_nic_is_not_shaped_as_up_left_it_and_up_repairs_it(cluster):
    cfg = cluster.config()
    other = "1gbit" if parse_rate(cfg.rate) != parse_rate("1gbit") else "100mbit"
    subprocess.run(["ip", "netns", "exec", cluster.host_ns(1), "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
                    *tbf_options(parse_rate(other))], check=True)
    out = cli("status")
    assert out.returncode == 1 and f"host1 eth0: send {parse_rate(other) / 1e6:g}mbit, not {cfg.rate}" in out.stdout, \
        out.stdout   # it said "up", exit 0
    cluster.up(cfg.hosts, rate=cfg.rate, ranks_per_host=cfg.ranks_per_host, mtu=cfg.mtu)
    assert cli("status").returncode == 0


@needs_cluster
def test_bridges_and_ports_take_no_ipv6_address(cluster):
    v6 = subprocess.run(["ip", "-6", "-o", "addr"], capture_output=True, text=True).stdout
    assert f"{PREFIX}-" not in v6, v6


@needs_cluster
def test_a_job_on_a_cluster_that_is_down_is_refused_and_leaves_nothing_behind():
    import glob
    prefix = "mctestz"
    with pytest.raises(ClusterError, match="not up"):
        Cluster(prefix).run([sys.executable, "-c", "pass"], timeout=5)
    assert glob.glob(f"/tmp/{prefix}-ompi-*") == []


# ---------------------------------------------------------------- down and crash recovery
@needs_cluster
def test_two_rails_up_then_down_removes_everything():
    prefix = "mctestd"
    autogroups_before = Cluster(prefix).autogroups.enabled()
    try:
        proc = cli("up", "--hosts", "2", "--rails", "2", "--rate", "300mbit", prefix=prefix)
        assert proc.returncode == 0, proc.stderr
        if autogroups_before is not None:   # off while up, whoever else holds them off
            assert Cluster(prefix).autogroups.enabled() is False and "autogroups off" in cli("status", prefix=prefix).stdout
        assert f"{prefix}-h1" in namespaces() and f"{prefix}-br1" in links()
        nics = subprocess.run(["ip", "-n", f"{prefix}-h1", "-o", "-4", "addr"], capture_output=True,
                              text=True).stdout
        assert "eth0" in nics and "10.213.0.2/24" in nics and "eth1" in nics and "10.213.1.2/24" in nics
        routes = subprocess.run(["ip", "-n", f"{prefix}-h1", "route"], capture_output=True, text=True).stdout
        assert "default" not in routes
        state = json.loads((Cluster(prefix).state_path).read_text())
        assert state["rails"] == 2 and state["rate"] == "300mbit"
        # whatever the machine's own TCP runs
        assert [congestion_control(f"{prefix}-{ns}") for ns in ("head", "h0", "h1")] == ["reno"] * 3
        assert "TCP reno" in cli("status", prefix=prefix).stdout
        if Cluster(prefix).cpu_budget.hierarchy is not None:   # down must unmount and remove the budget too
            assert cli("up", "--hosts", "2", "--rails", "2", "--rate", "300mbit", "--cpus-per-host", "0.5",
                       prefix=prefix).returncode == 0
            budget = Cluster(prefix).cpu_budget
            assert budget.cgroup_names() == [f"{prefix}-h0", f"{prefix}-h1"]
            assert [str(budget.mount_point(h)) for h in (0, 1)] + [str(budget.root_mount_point())] == \
                leftovers(prefix)[-3:]
    finally:
        proc = cli("down", prefix=prefix)
    assert proc.returncode == 0, proc.stderr
    assert leftovers(prefix) == []
    assert not Cluster(prefix).state_dir.exists()
    assert "down" in cli("status", prefix=prefix).stdout
    assert Cluster(prefix).autogroups.enabled() == autogroups_before


def congestion_control(ns: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/sys/net/ipv4/tcp_congestion_control"],
                          capture_output=True, text=True, check=True).stdout.strip()


@needs_cluster
def test_a_congestion_control_namespaces_may_not_use_is_refused_before_anything_is_built():
    prefix = "mctestt"
    try:
        proc = cli("up", "--hosts", "2", "--congestion-control", "no-such-tcp", prefix=prefix)
        assert proc.returncode == 2 and "a namespace may use only" in proc.stderr and "reno" in proc.stderr, proc.stderr
        assert leftovers(prefix) == []
    finally:
        cli("down", prefix=prefix)


@needs_cluster
def test_down_after_a_crash_finds_leftovers_by_prefix():
    prefix = "mctestc"
    try:
        subprocess.run(["ip", "netns", "add", f"{prefix}-h7"], check=True)
        subprocess.run(["ip", "link", "add", f"{prefix}-br0", "type", "bridge"], check=True)
        subprocess.run(["ip", "link", "add", f"{prefix}-h7r0", "type", "veth", "peer", "name", "eth0",
                        "netns", f"{prefix}-h7"], check=True)
        budget = Cluster(prefix).cpu_budget
        if budget.hierarchy is not None:     # a crash also leaves the hosts' cpu cgroups
            os.makedirs(budget.path(7))
        assert "leftovers" in cli("status", prefix=prefix).stdout
    finally:
        proc = cli("down", prefix=prefix)
    assert proc.returncode == 0, proc.stderr
    assert leftovers(prefix) == []


# ---------------------------------------------------------------- autogroups (a file stands in for the switch)
def test_autogroups_are_held_off_by_every_cluster_and_restored_by_the_last(tmp_path):
    from mcallreduce.bench.autogroups import Autogroups
    switch = tmp_path / "sched_autogroup_enabled"
    switch.write_text("1\n")
    groups = Autogroups(tmp_path / "state", switch)
    assert groups.enabled() is True
    groups.hold_off("a")
    groups.hold_off("a")          # up is idempotent
    groups.hold_off("b")
    assert switch.read_text() == "0\n" and groups.holders() == ["a", "b"]
    assert groups.release("a") is False and switch.read_text() == "0\n"
    assert groups.release("a") is False          # down twice: nothing more to do
    assert groups.release("b") is True and switch.read_text() == "1\n"
    assert groups.holders() == [] and not groups.record.exists()


def test_autogroups_already_off_or_absent_are_left_alone(tmp_path):
    from mcallreduce.bench.autogroups import Autogroups
    switch = tmp_path / "sched_autogroup_enabled"
    switch.write_text("0\n")
    groups = Autogroups(tmp_path / "state", switch)
    groups.hold_off("a")
    assert groups.holders() == [] and groups.release("a") is False and switch.read_text() == "0\n"
    absent = Autogroups(tmp_path / "state", tmp_path / "no-such-switch")
    assert absent.enabled() is None
    absent.hold_off("a")
    assert absent.holders() == [] and not (tmp_path / "no-such-switch").exists()
