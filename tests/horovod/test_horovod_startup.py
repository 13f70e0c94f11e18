"""The startup hook: an unmodified Horovod script gets the plugin only when asked."""
import os
import re
import subprocess
import sys

import pytest

from _horovod import REPO, explain, install_startup_hook, mpi_job, needs_horovod


@pytest.fixture(scope="module", autouse=True)
def startup_hook():
    install_startup_hook()


def routed(result):
    """(routed calls, buckets) that a passed unmodified.py reports."""
    assert result.returncode == 0, explain(result)
    calls, buckets = re.search(r"^ROUTED (\d+) BUCKETS (\d+)$", result.stdout, re.M).groups()
    return int(calls), int(buckets)


@needs_horovod
@pytest.mark.parametrize("env, active", [
    ({}, False),                                                         # nothing set: stock
    ({"MCALLREDUCE_ALGORITHM": "multicolor"}, True),                     # the documented switch
    ({"MCALLREDUCE_HOROVOD": "1"}, True),
    ({"MCALLREDUCE_ALGORITHM": "ring", "MCALLREDUCE_HOROVOD": "0"}, False),   # 0 wins
])
def test_unmodified_script(env, active):
    result = mpi_job(2, "unmodified.py", "plugin" if active else "stock", env=env)
    calls, _ = routed(result)
    lines = [l for l in result.stderr.splitlines() if "allreduce active" in l]
    if active:
        algorithm = env.get("MCALLREDUCE_ALGORITHM", "multicolor")
        assert len(lines) == 1 and re.search(
            rf"^mcallreduce \S+: {algorithm} allreduce active \(ranks=2, hosts=1, colors=auto\)$", lines[0]), lines
        assert calls == 1, result.stdout     # the one hvd.allreduce; the optimizer's go as buckets
    else:
        assert lines == [], lines
    # nothing else on stdout: the plugin prints nothing there
    assert len(result.stdout.splitlines()) == 1, result.stdout


def test_unset_costs_no_import():
    # Without MCALLREDUCE_* the .pth line must not even import mcallreduce.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCALLREDUCE_")}
    code = "import sys; print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('mcallreduce', 'torch', 'mpi4py'))))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == []
    # With the variable set it installs the finder, still without torch or MPI.
    env["MCALLREDUCE_ALGORITHM"] = "multicolor"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    modules = out.stdout.split()
    assert "mcallreduce.horovod.startup" in modules and not [m for m in modules if not m.startswith("mcallreduce")]


@needs_horovod
@pytest.mark.parametrize("env, active", [({"MCALLREDUCE_ALGORITHM": "multicolor"}, True), ({}, False)])
def test_horovodrun_launch(env, active):
    # The documented command: `MCALLREDUCE_ALGORITHM=multicolor horovodrun -np 2 python train.py`.
    # horovodrun starts mpirun itself (adding --allow-run-as-root and --tag-output) and
    # forwards the environment, so the startup hook must see the variable in every rank.
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        pytest.skip("horovodrun is not installed next to this Python")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MCALLREDUCE_")}
    full_env.update({"PYTHONPATH": str(REPO), "OMPI_MCA_btl_vader_single_copy_mechanism": "cma",
                     "OMPI_MCA_mpi_yield_when_idle": "1", "PYTHONWARNINGS": "ignore::DeprecationWarning"})
    full_env.update(env)
    script = os.path.join(os.path.dirname(__file__), "mpi", "unmodified.py")
    result = subprocess.run([horovodrun, "-np", "2", "-H", "localhost:2", sys.executable, script,
                             "plugin" if active else "stock"],
                            env=full_env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, explain(result)   # the script checked the plugin's state itself
    output = result.stdout + result.stderr
    activation = re.findall(r"mcallreduce \S+: multicolor allreduce active \(ranks=2, hosts=1, colors=auto\)", output)
    assert len(activation) == (1 if active else 0), output[-3000:]


@needs_horovod
def test_multicolor_op_routes_only_its_calls_in_a_stock_script():
    # from mcallreduce.horovod import MultiColor, as Horovod users write op=hvd.Adasum
    result = mpi_job(2, "multicolor_op.py", env={})
    assert result.returncode == 0, explain(result)


@needs_horovod
@pytest.mark.parametrize("variant", ["defaults", "two colors over messages"])
def test_routed_calls_are_in_a_chrome_trace_on_every_rank(tmp_path, variant):
    import json
    env = {"MCALLREDUCE_HOROVOD": "1", "MCALLREDUCE_TIMELINE": str(tmp_path / "t.json")}
    if variant != "defaults":   # a schedule of two colors instead of the one-host shared-memory stage
        env.update(MCALLREDUCE_SHM_BYTES="0", MCALLREDUCE_COLORS="2", MCALLREDUCE_TUNING_FILE="none")
    result = mpi_job(2, "unmodified.py", "plugin", env=env)
    calls, buckets = routed(result)
    for rank in (0, 1):
        trace = json.loads((tmp_path / f"t.mcallreduce.rank{rank}.json").read_text())
        events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        data = [e for e in events if e["tid"] == 1]
        assert len(data) == calls + buckets, (events, calls, buckets)
        assert all(e["dur"] >= 0 and e["pid"] == rank for e in events)
        assert any(e["cat"] == "gradient bucket" for e in data) and any(e["args"]["bytes"] == 4000 for e in data)
        assert len([e for e in events if e["tid"] == 0]) == len(data)   # one metadata check per call
        # each data allreduce's engine phases, in order, inside its span (1 us of rounding)
        phases = {(e["args"]["seq"], e["cat"]): e for e in events if 2 <= e["tid"] <= 4}
        colors = {}
        for e in events:
            if e["tid"] >= 5:
                assert e["tid"] == 5 + e["args"]["color"] and e["cat"] in ("color reduce", "color broadcast"), e
                colors[(e["args"]["seq"], e["args"]["color"], e["cat"])] = e
        for e in data:
            for seq in e["args"]["seqs"]:
                spans = [phases[(seq, p)] for p in ("queued", "check", "reduce")]
                assert spans[0]["ts"] >= e["ts"] - 1, (e, spans)
                assert spans[-1]["ts"] + spans[-1]["dur"] <= e["ts"] + e["dur"] + 1, (e, spans)
                for a, b in zip(spans, spans[1:]):
                    assert abs(a["ts"] + a["dur"] - b["ts"]) <= 1, (a, b)
                # each color's reduce then broadcast, inside the reduction's span
                body = spans[-1]
                for (s, c, cat), red in colors.items():
                    if s != seq or cat != "color reduce":
                        continue
                    bcast = colors[(seq, c, "color broadcast")]
                    assert abs(red["ts"] - body["ts"]) <= 1 and abs(red["ts"] + red["dur"] - bcast["ts"]) <= 1
                    assert bcast["ts"] + bcast["dur"] <= body["ts"] + body["dur"] + 1, (body, red, bcast)
        ran = {c for _, c, _ in colors}
        if variant == "defaults":
            assert ran, sorted(colors)                 # the shared-memory stage: this rank's color
        else:
            assert ran == {0, 1}, sorted(colors)


@needs_horovod
def test_under_horovods_gloo_controller_the_plugin_declines_and_stock_runs():
    # horovodrun --gloo starts no MPI, which the engine needs: the job stays stock, with a warning
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MCALLREDUCE_")},
           "MCALLREDUCE_ALGORITHM": "multicolor", "PYTHONPATH": str(REPO),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    result = subprocess.run([horovodrun, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
                             str(REPO / "tests" / "horovod" / "mpi" / "unmodified.py"), "declined"],
                            capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, explain(result)   # the script checked that nothing was routed
    assert result.stderr.count("the Gloo controller (horovodrun --gloo) is not supported") == 2, explain(result)
