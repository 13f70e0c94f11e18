"""The benchmark CLI end to end: table, JSON records and the plot."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcallreduce.bench.tune_measure import DEFAULT_MARGIN
from mcallreduce.launch import run


def rejected(*args):
    """The bench's command line ``args`` on one rank, which must fail; mpirun is told not to wait
    its usual 2 s before it kills what is left of a failed job (with one rank, nothing)."""
    return run(1, [sys.executable, "-m", "mcallreduce.bench", *args], timeout=60,
               mca={"odls_base_sigkill_timeout": "0"})


def test_bench_table_json_and_plot(tmp_path):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    r = run(2, [sys.executable, "-m", "mcallreduce.bench", "--sizes", "4K,256K", "--iters", "3",
                "--json", str(out), "--plot", str(png)], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "busbw(GB/s)" in r.stdout and "[1/2] 4K: multicolor, ring, mpi, mpi-ring" in r.stderr   # table and progress
    record = json.loads(out.read_text())
    assert record["argv"][:4] == ["python", "-m", "mcallreduce.bench", "--sizes"]   # as typed, no local path
    assert record["started"] <= record["finished"] and record["finished"].endswith(" UTC")   # when, and where
    assert record["machine"]["cores"] == os.cpu_count() and record["cluster"] is None    # not on the emulated cluster
    assert record["mpi"].startswith("Open MPI") and isinstance(record["environment"], dict)
    records = record["records"]
    assert {rec["algorithm"] for rec in records} == {"multicolor", "ring", "mpi", "mpi-ring"}
    for rec in records:
        assert "skipped" not in rec, rec
        assert {"algorithm", "size_bytes", "ranks", "hosts", "time_s", "algbw_Bps", "busbw_Bps", "correct"} <= set(rec)
        assert rec["correct"] is True and rec["ranks"] == 2 and rec["time_s"] > 0
        assert abs(rec["busbw_Bps"] - rec["algbw_Bps"]) < 1e-6 * rec["algbw_Bps"]   # 2(p-1)/p = 1 at p=2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_unknown_algorithm():
    r = rejected("--algorithms", "tree")
    assert r.returncode != 0 and "unknown algorithm" in r.stderr


def test_bench_rejects_unknown_buffers_and_cuda_without_a_gpu():
    r = rejected("--buffers", "gpu")
    assert r.returncode != 0 and "--buffers takes cpu and/or cuda" in r.stderr
    import torch
    if not torch.cuda.is_available():
        r = rejected("--sizes", "4K", "--buffers", "cpu,cuda")
        assert r.returncode != 0 and "torch sees no CUDA device" in r.stdout + r.stderr


def test_nonblocking_calls_time_every_arm_and_check_its_result(tmp_path):
    out = tmp_path / "n.json"
    r = run(2, [sys.executable, "-m", "mcallreduce.bench", "--sizes", "4K,256K", "--iters", "3", "--nonblocking",
                "--json", str(out), "--quiet"], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nonblocking calls" in r.stdout
    records = json.loads(out.read_text())["records"]
    # Open MPI's forced ring binds blocking calls only: a nonblocking mpi-ring arm would time mpi again
    assert {rec["algorithm"] for rec in records if "skipped" not in rec} == {"multicolor", "ring", "mpi"}
    assert all("libnbc" in rec["skipped"] for rec in records if rec["algorithm"] == "mpi-ring")
    assert all(rec["correct"] is True and rec["calls"] == "nonblocking" for rec in records if "skipped" not in rec)
    r = rejected("--nonblocking", "--buffers", "cuda")
    assert r.returncode != 0 and "--nonblocking times cpu buffers only" in r.stderr


def test_bench_time_budget_keeps_at_least_min_iters(tmp_path):
    # --iters 0 sizes the run by --seconds; a tiny budget still times --min-iters calls
    out = tmp_path / "m.json"
    r = run(2, [sys.executable, "-m", "mcallreduce.bench", "--sizes", "1M", "--algorithms", "ring,mpi",
                "--iters", "0", "--seconds", "0.000001", "--min-iters", "4", "--json", str(out), "--quiet"],
            timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert {rec["iters"] for rec in json.loads(out.read_text())["records"]} == {4}


def test_bench_help_lists_every_subcommand():
    import subprocess
    from mcallreduce.bench import __main__ as entry
    r = subprocess.run([sys.executable, "-m", "mcallreduce.bench", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert {"tune", "report"} <= set(entry.COMMANDS)
    for name in entry.COMMANDS:
        assert f"mcallreduce.bench {name} " in r.stdout


def test_the_reports_stock_horovod_arm_times_every_size():
    r = run(2, [sys.executable, "-m", "mcallreduce.bench.report.horovod_rank", "4096,65536", "0", "0.05", "3"],
            timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("HOROVOD "))
    records = json.loads(line[len("HOROVOD "):])
    assert [rec["size_bytes"] for rec in records] == [4096, 65536]
    assert all(rec["ranks"] == 2 and rec["time_s"] > 0 for rec in records)


def test_tune_measure_writes_a_table_that_the_policy_then_follows(tmp_path):
    table = tmp_path / "tuning.json"
    r = run(2, [sys.executable, "-m", "mcallreduce.bench", "tune", "--measure", "--sizes", "4K,64K",
                "--seconds", "0.01", "--min-iters", "2", "--passes", "2", "--out", str(table)], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    written = json.loads(table.read_text())
    from mcallreduce import config, policy
    cfg = config.Config.from_env({"MCALLREDUCE_TUNING_FILE": str(table)})
    for section, nonblocking in (("tables", False), ("nonblocking_tables", True)):   # both kinds of call by default
        rows = written[section]["1h2r"]
        assert [row["size_bytes"] for row in rows] == [4096, 65536]
        for row in rows:   # each row names its fastest candidate, and keeps every candidate's time
            times = row["measured_s"]
            best = min(times, key=times.get)
            if times["multicolor"] <= (1 + DEFAULT_MARGIN) * times[best]:   # a near tie: the built-in choice
                best = "multicolor"
            want = "multicolor" if best.startswith("multicolor") else best   # multicolor-256K: a segment size
            assert row["algorithm"] == want, row
            # a row that picked MPI also names our fastest candidate, for calls MPI cannot serve
            assert ("instead" in row) == (want in ("mpi", "mpi-ring")), row
            assert row.get("instead", {}).get("algorithm") not in ("mpi", "mpi-ring"), row
        for row in rows:
            algorithm, params = policy.resolve(cfg, row["size_bytes"], 4, [[0, 1]], 1 << 24, nonblocking=nonblocking)
            assert algorithm == row["algorithm"] and params.shared == row["shared"], (row, algorithm, params)


@pytest.mark.parametrize("kind, other", [("nonblocking", "tables"), ("blocking", "nonblocking_tables")])
def test_tune_measure_times_one_kind_of_call_when_asked(tmp_path, kind, other):
    table = tmp_path / "tuning.json"
    r = run(2, [sys.executable, "-m", "mcallreduce.bench", "tune", "--measure", "--sizes", "4K", "--calls",
                kind, "--seconds", "0.01", "--min-iters", "2", "--passes", "1", "--out", str(table)],
            timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    written = json.loads(table.read_text())
    section = "nonblocking_tables" if kind == "nonblocking" else "tables"
    assert other not in written and [row["size_bytes"] for row in written[section]["1h2r"]] == [4096]
    # a table without nonblocking rows says what the plugin's and DDP's calls then follow
    assert ("no nonblocking rows" in r.stderr) == (kind == "blocking"), r.stderr
    r = rejected("tune", "--measure", "--calls", "async", "--out", str(tmp_path / "no.json"))
    assert r.returncode != 0 and "--calls 'async'" in r.stderr, r.stderr


def test_records_name_the_command_as_typed_not_a_local_path():
    import mcallreduce
    from mcallreduce.bench.output import command
    package = Path(mcallreduce.__file__).parent
    assert command([str(package / "bench" / "__main__.py"), "tune"]) == ["python", "-m", "mcallreduce.bench", "tune"]
    assert command([str(package / "bench" / "cluster.py"), "up"]) == ["python", "-m", "mcallreduce.bench.cluster", "up"]
    assert command(["/somewhere/bin/mcallreduce-bench", "--sizes", "1M"]) == ["python", "-m", "mcallreduce.bench",
                                                                              "--sizes", "1M"]
    assert command(["/home/me/train.py", "-x"]) == ["python", "train.py", "-x"]
    assert command(["/usr/bin/pytest", "-q"]) == ["pytest", "-q"]
    # the subcommands' records: the arguments the dispatcher passed, after the subcommand's name
    from mcallreduce.bench.output import subcommand_command
    assert subcommand_command("e2e", ["--runs", "3"]) == ["python", "-m", "mcallreduce.bench", "e2e", "--runs", "3"]
    assert subcommand_command("ddp", []) == ["python", "-m", "mcallreduce.bench", "ddp"]


def test_e2e_arm_variants_add_variables_to_their_arm():
    from mcallreduce.bench import e2e
    data, env, more = e2e.arm_settings("thread:MCALLREDUCE_BUCKET_BYTES=2M:HOROVOD_CYCLE_TIME=5")
    assert (data, more) == e2e.ARMS["thread"][::2]
    assert env == {**e2e.ARMS["thread"][1], "MCALLREDUCE_BUCKET_BYTES": "2M", "HOROVOD_CYCLE_TIME": "5"}
    assert e2e.arm_settings("memory:MCALLREDUCE_HOROVOD=1")[1]["MCALLREDUCE_HOROVOD"] == "1"   # the arm's own is overridden
    assert e2e.arm_settings("local:--persistent-workers:X=1") == (
        "memory", {**e2e.ARMS["local"][1], "X": "1"}, ("--local-gradients", "--persistent-workers"))
    for bad in ("fast", "thread:BUCKET", "thread:=2M"):
        try:
            e2e.arm_settings(bad)
        except ValueError as exc:
            assert repr(bad.split(":")[0]) in str(exc) or "ARM:NAME=VALUE" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")
    r = rejected("e2e", "--tree", "/nonexistent", "--arms", "thread:X")
    assert r.returncode != 0 and "expected ARM:NAME=VALUE" in r.stderr


def test_whole_job_benchmarks_alternate_their_arms_round_by_round():
    from mcallreduce.bench.timing import alternated
    assert list(alternated(["gloo", "hook", "backend"], 3)) == [
        (0, "gloo"), (0, "hook"), (0, "backend"), (1, "backend"), (1, "hook"), (1, "gloo"),
        (2, "gloo"), (2, "hook"), (2, "backend")]
    assert list(alternated(["a"], 0)) == []


def test_interleaved_arms_follow_every_other_arm_equally_often():
    from collections import Counter
    from mcallreduce.bench.timing import carryover_balanced
    for n in range(2, 8):
        orders = carryover_balanced(n)
        assert all(sorted(order) == list(range(n)) for order in orders)
        follows = Counter((order[i], order[i + 1]) for order in orders for i in range(n - 1))
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1, (n, follows)


def test_the_sweep_and_the_tuner_time_whole_rounds_of_orders():
    from mcallreduce.bench.timing import whole_rounds
    assert [whole_rounds(i, 3) for i in (1, 6, 7)] == [6, 6, 12]   # 3 arms: 6 orders
    assert whole_rounds(5, 4) == 8
    # iterations() is what both call: its count is whole rounds too. In a process of its own: MPI
    # initialised in pytest's would hand its variables to every mpirun the later tests start
    script = ("from mpi4py import MPI\nfrom mcallreduce.bench.timing import carryover_balanced, iterations\n"
              "for narms in (2, 3, 5):\n"
              "    count = iterations(MPI.COMM_SELF, [lambda: None] * narms, 1e-9, 1, cap=100)\n"
              "    assert count % len(carryover_balanced(narms)) == 0 and count > 0, (narms, count)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_a_record_names_the_cluster_that_cluster_run_hands_its_ranks(monkeypatch):
    from mcallreduce.bench.cluster_state import ClusterConfig
    from mcallreduce.bench.provenance import cluster_env, provenance, utc_now
    started = utc_now()
    (name, value), = cluster_env(ClusterConfig(hosts=3, rate="10gbit", cpus_per_host=0.5,
                                               congestion_control="bbr")).items()
    monkeypatch.setenv(name, value)
    cluster = provenance(started)["cluster"]
    assert (cluster["hosts"], cluster["rate"], cluster["cpus_per_host"]) == (3, "10gbit", 0.5)
    assert cluster["congestion_control"] == "bbr" and cluster["keep_autogroups"] is False
    monkeypatch.delenv(name)
    assert provenance(started)["cluster"] is None
    from mcallreduce.bench.e2e import record    # a driver that runs the cluster's jobs names it itself
    e2e = record(["--runs", "1"], ClusterConfig(hosts=4, ranks_per_host=2), 0, [], started)
    assert (e2e["cluster"]["hosts"], e2e["cluster"]["ranks_per_host"], e2e["cluster"]["congestion_control"]) == (4, 2, "reno")


def test_every_goal_reads_arms_and_sizes_its_job_measures():
    from mcallreduce.bench.goals import LAYOUTS
    for name, layout in LAYOUTS.items():
        for goal in layout.goals:
            args = layout.jobs[goal.job]
            sizes = args[args.index("--sizes") + 1].split(",")
            arms = args[args.index("--algorithms") + 1].split(",")
            assert goal.size in sizes, (name, goal.text)
            for operand in (goal.numerator, goal.denominator):
                needs = {"best-mpi": ["mpi", "mpi-ring"], "link": [], "stream": []}.get(operand, [operand])
                assert set(needs) <= set(arms), (name, goal.text, operand)
            assert goal.numerator != "link" and (goal.denominator != "link" or layout.cluster), (name, goal.text)
            assert goal.denominator != "stream" or layout.duplex, (name, goal.text)


def test_a_goals_figure_is_its_ratio_in_one_job_and_its_verdict_counts_the_jobs():
    from mcallreduce.bench.goals import Goal, figure, table, verdict
    def rec(arm, time_s, busbw=0.0, cpu=0.0):
        return {"algorithm": arm, "size_bytes": 65536, "time_s": time_s, "busbw_Bps": busbw, "cpu_s": cpu}
    records = [rec("multicolor", 2.0, busbw=24e6, cpu=3.0), rec("mpi", 3.0), rec("mpi-ring", 2.5, cpu=2.0)]
    best = Goal("best", "main", "64K", "best-mpi", "multicolor", "time_s", 1.0)
    assert figure(best, records, None, None) == 1.25
    link = Goal("link", "main", "64K", "multicolor", "link", "busbw_Bps", 0.95)
    assert figure(link, records, 25e6, None) == 0.96
    cpu = Goal("cpu", "main", "64K", "multicolor", "mpi-ring", "cpu_s", 1.2, at_most=True)
    assert figure(cpu, records, None, None) == 1.5
    try:
        figure(Goal("s", "main", "64K", "multicolor", "stream", "busbw_Bps", 0.9), records, None, None)
    except ValueError as exc:
        assert "no stream rate" in str(exc)
    else:
        raise AssertionError("a missing stream rate was not reported")
    assert verdict(best, [1.1, 1.0]) == "yes" and verdict(best, [0.9, 1.1, 1.2]) == "in 2 of 3 jobs"
    assert verdict(best, [0.9, 0.95, 1.2]) == "no" and verdict(cpu, [1.5]) == "no" and verdict(cpu, [1.2]) == "yes"
    text = table([{"layout": "4h10g", "goal": "best", "target": 1.0, "at_most": False, "figures": [1.25],
                   "met": "yes"}])
    assert text.splitlines()[-1] == "| 4h10g | best | >= 1 | 1.250 | yes |"


def test_bench_rejects_what_it_cannot_time_and_goes_on_where_nothing_runs():
    for args, says in ((("--sizes", ","), "at least one value"), (("--algorithms", ""), "at least one value"),
                       (("--sizes", "5X"), "is not a size"), (("--seconds", "0"), "--seconds more than 0"),
                       (("--min-iters", "0"), "--min-iters 1 or more")):
        r = rejected(*args)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    # MPI has no float16: every arm of the size is skipped, and the run still ends with its table
    r = run(1, [sys.executable, "-m", "mcallreduce.bench", "--sizes", "4K", "--algorithms", "mpi",
                "--dtype", "float16", "--quiet"], timeout=60)
    assert r.returncode == 0 and "skipped: MPI has no float16 type" in r.stdout, r.stdout + r.stderr


def test_goals_without_jobs_are_not_measured_rather_than_met():
    from mcallreduce.bench.goals import Goal, main, verdict
    assert verdict(Goal("g", "main", "64K", "best-mpi", "multicolor", "time_s", 1.0), []) == "not measured"
    with pytest.raises(SystemExit):
        main(["--layouts", "1h2r", "--jobs", "0"])


def test_the_model_tuner_names_the_option_it_cannot_read():
    for args, says in ((("--sizes", "5X"), "--sizes: '5X' is not a size"),
                       (("--hosts", "x"), "--hosts: 'x' is not"), (("--ranks-per-host", "0"), "--ranks-per-host: '0'"),
                       (("--calibration", "/nonexistent.json"), "calibration file /nonexistent.json")):
        r = subprocess.run([sys.executable, "-m", "mcallreduce.bench", "tune", *args, "--out", "-"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_a_tuning_table_is_written_a_row_a_line_and_reads_back_the_same(tmp_path):
    from mcallreduce.bench.output import write_table_json
    from mcallreduce.policy import BUILTIN_TABLE
    table = json.loads(Path(BUILTIN_TABLE).read_text())
    out = tmp_path / "t.json"
    write_table_json(out, {**table, "empty": {}})
    assert json.loads(out.read_text()) == {**table, "empty": {}}
    rows = sum(len(r) for section in ("tables", "nonblocking_tables") for r in table[section].values())
    assert len(out.read_text().splitlines()) < rows + 20
