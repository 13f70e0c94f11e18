"""The cost model: simulator semantics, model invariants, Open MPI models, calibration, tuner, report."""
import json

import numpy as np
import pytest

from mcallreduce import tuning
from mcallreduce.algorithms import Params, build_schedule
from mcallreduce.inprocess import execute
from mcallreduce.schedule import Builder, check_schedule
from mcallreduce.sim.calibrate import fit, fit_line, fit_overhead
from mcallreduce.sim.model import ClusterModel, emulated, link_bytes_per_s, paper
from mcallreduce.sim.mpi_models import (nonoverlapping, ompi_default, ompi_schedule, rabenseifner,
                                        recursive_doubling)
from mcallreduce.sim.predict import predict
from mcallreduce.sim.simulate import DeadlockError, simulate
from mcallreduce.sim import tuner

# a plain alpha-beta machine: no CPU cost, no shaper effects
PLAIN = dict(nic_Bps=1e8, alpha=10e-6, overhead=0.0, gamma=0.0, intra_Bps=1e10, intra_alpha=1e-6,
             eager_bytes=1 << 30)


def plain(hosts, **kw):
    return ClusterModel(hosts=hosts, **{**PLAIN, **kw})


def flat(p):
    return [[r] for r in range(p)]


def one_message(nbytes, model):
    b = Builder(2, nbytes)
    b.transfer(0, 1, 0, nbytes, reduce=False)
    return simulate(b.build("x"), model, itemsize=1)


def test_one_message_is_alpha_plus_n_beta():
    m = plain(2)
    for n in (1, 1000, 10 ** 6):
        assert one_message(n, m).time == pytest.approx(10e-6 + n / 1e8)


def test_rendezvous_costs_a_round_trip_and_overhead_is_per_step():
    m = plain(2, eager_bytes=100)
    assert one_message(1000, m).time == pytest.approx(3 * 10e-6 + 1000 / 1e8)
    m = plain(2, overhead=5e-6)   # the SEND and the RECV are posted at 5 us, in parallel
    assert one_message(1000, m).time == pytest.approx(5e-6 + 10e-6 + 1000 / 1e8)


def test_token_bucket_passes_bursts_fast_then_the_rate():
    m = plain(2, burst_bytes=1000, peak_Bps=1e10)
    assert one_message(1000, m).time == pytest.approx(10e-6 + 1000 / 1e10)
    assert one_message(11000, m).time == pytest.approx(10e-6 + 10000 / 1e8, rel=1e-6)


def test_back_to_back_calls_find_the_bucket_drained():
    # one call passes at the burst speed; repeated ones cannot average above the rate
    b = Builder(2, 10 ** 6)
    b.transfer(0, 1, 0, 10 ** 6, reduce=False)
    res = simulate(b.build("x"), plain(2, burst_bytes=2 * 10 ** 6, peak_Bps=1e10), itemsize=1)
    assert res.time == pytest.approx(10e-6 + 10 ** 6 / 1e10)
    assert res.steady_time == pytest.approx(10 ** 6 / 1e8)
    assert simulate(b.build("x"), plain(2), itemsize=1).steady_time == pytest.approx(10e-6 + 10 ** 6 / 1e8)


def test_incast_serialises_on_the_receiver_port():
    b = Builder(3, 10 ** 6)
    b.transfer(1, 0, 0, 10 ** 6, reduce=False)
    b.transfer(2, 0, 0, 10 ** 6, reduce=False)
    # both land in rank 0's buffer range: the second RECV waits for the first (WAW), still 2 x n beta
    t = simulate(b.build("incast"), plain(3), itemsize=1).time
    assert t == pytest.approx(2 * 10 ** 6 / 1e8 + 10e-6, rel=0.01)


def test_duplex_factor_slows_two_way_exchanges_only():
    n = 10 ** 6
    b = Builder(2, 2 * n)
    b.transfer(0, 1, 0, n, reduce=False)
    b.transfer(1, 0, n, n, reduce=False)
    sched = b.build("exchange")
    full = simulate(sched, plain(2, eager_bytes=1000)).time          # rendezvous: 3 alpha
    half = simulate(sched, plain(2, eager_bytes=1000, duplex=0.5)).time
    assert full == pytest.approx(30e-6 + 4 * n / 1e8, rel=0.01)
    assert half == pytest.approx(30e-6 + 4 * n / 0.5e8, rel=0.01)
    assert one_message(n, plain(2, duplex=0.5)).time == pytest.approx(one_message(n, plain(2)).time)


def test_duplex_loss_spares_eager_messages():
    # a two-way stream: the handshake of a rendezvous message queues behind the reverse
    # data (duplex < 1); an eager one has no handshake (duplex_eager, 1 by default)
    def stream(seg):
        b = Builder(2, 2 * 20 * seg)
        for k in range(20):
            b.transfer(0, 1, k * seg, seg, reduce=False)
            b.transfer(1, 0, (20 + k) * seg, seg, reduce=False)
        return simulate(b.build("two-way"), plain(2, eager_bytes=65536, duplex=0.5, duplex_small=0.5),
                        itemsize=1).time
    eager, rendezvous = stream(60 << 10), stream(256 << 10)
    assert eager == pytest.approx(20 * (60 << 10) / 1e8, rel=0.05)   # both ways at the full rate
    assert rendezvous / (256 / 60) > 1.8 * eager


def test_shared_cores_slow_down_cpu_bound_schedules():
    m = plain(8, overhead=20e-6)
    s = build_schedule("ring", flat(8), 64, Params())
    assert simulate(s, m.with_(cores=1)).time > 1.5 * simulate(s, m).time


def test_polling_ranks_share_the_cores_only_when_they_outnumber_them():
    # CPU-bound ring (no latency, no bandwidth cost): all time is the ranks' per-step work
    cpu_only = dict(overhead=20e-6, alpha=0.0, intra_alpha=0.0, nic_Bps=1e15)
    m8 = plain(8, **cpu_only)
    s8 = build_schedule("ring", flat(8), 64, Params())
    own = simulate(s8, m8).time
    # 8 polling ranks on 2 cores: every rank's work runs at 2/8 of a core, all the time
    assert simulate(s8, m8.with_(cores=2, polling=True)).time == pytest.approx(4 * own, rel=1e-6)
    # no effect without shared cores (the paper's scale) or with a core per rank
    assert simulate(s8, m8.with_(polling=True)).time == own
    assert simulate(s8, m8.with_(cores=8, polling=True)).time == pytest.approx(own, rel=1e-9)
    # the calibration's case, 2 ranks on 2 cores: same time as without shared cores, so the
    # overhead fitted there (fit_overhead, cores None) is the per-step cost on a core of its own
    m2 = emulated(2, cores=2)
    assert m2.polling
    s2 = build_schedule("ring", m2.layout(), 1, Params())
    assert simulate(s2, m2).time == pytest.approx(simulate(s2, m2.with_(cores=None)).time, rel=1e-9)
    assert fit_overhead(1e-3, m2) == pytest.approx(fit_overhead(1e-3, m2.with_(cores=None)), rel=1e-9)


def test_polling_slows_steps_the_fifo_cores_leave_alone():
    # a tree keeps only a few ranks busy at a time: FIFO cores (sleeping waiters) hardly
    # queue, polling waiters still take their share of the cores from the working ranks
    m = plain(8, overhead=20e-6)
    s = build_schedule("multicolor", flat(8), 64, Params(colors=1))
    own, fifo = simulate(s, m).time, simulate(s, m.with_(cores=2)).time
    poll = simulate(s, m.with_(cores=2, polling=True)).time
    assert poll > fifo >= own and poll > 1.5 * own


def test_paper_scale_is_unaffected_by_polling():
    m = paper(4, 2)
    assert m.cores is None
    for algo, n in (("ring", 64 << 10), ("multicolor", 1 << 20)):
        assert predict(algo, m.with_(polling=True), n, check=False) == predict(algo, m, n, check=False)


def test_unmatched_schedule_raises_deadlock():
    b = Builder(2, 4)
    b.transfer(0, 1, 0, 4, reduce=False)
    sched = b.build("x")
    sched.programs[1].steps.pop()        # the receive is gone
    with pytest.raises(DeadlockError):
        simulate(sched, plain(2))


# ---------------------------------------------------------------- invariants
def test_ring_time_grows_linearly_with_p_for_small_n():
    t = {p: predict("ring", plain(p, overhead=5e-6), 1024, params=Params(), check=False) for p in (4, 8, 16, 32)}
    d1, d2, d3 = t[8] - t[4], t[16] - t[8], t[32] - t[16]
    assert d2 == pytest.approx(2 * d1, rel=0.1) and d3 == pytest.approx(2 * d2, rel=0.1)
    mc = {p: predict("multicolor", plain(p, overhead=5e-6), 1024, params=Params(colors=1), check=False)
          for p in (4, 8, 16, 32)}
    assert mc[32] - mc[16] < 0.5 * d3          # a tree adds O(1) hops per doubling, not O(p)


def test_ring_reaches_the_bandwidth_bound_for_large_n():
    p, n = 8, 64 << 20
    t = predict("ring", plain(p), n, params=Params(segment=(1 << 20) // 4), check=False)
    bound = 2 * (p - 1) / p * n / 1e8
    assert bound <= t <= 1.05 * bound


@pytest.mark.parametrize("k", [2, 4])
def test_k_colors_never_lose_to_one_color_on_a_k_rail_host(k):
    for policy in ("color", "stripe"):
        m = plain(8, nics=k, nic_policy=policy, overhead=2e-6)
        for n in (256 << 10, 8 << 20):
            seg = (256 << 10) // 4
            one = predict("multicolor", m, n, params=Params(colors=1, segment=seg), check=False)
            many = predict("multicolor", m, n, params=Params(colors=k, segment=seg), check=False)
            assert many <= one * 1.001, (policy, n)
    m = plain(8, nics=k, nic_policy="color")
    n = 8 << 20
    one = predict("multicolor", m, n, params=Params(colors=1, segment=(256 << 10) // 4), check=False)
    many = predict("multicolor", m, n, params=Params(colors=k, segment=(256 << 10) // 4), check=False)
    assert many < 0.6 * one                    # the k colors really use the k rails


def test_hierarchical_multicolor_uses_every_local_rank_on_the_network():
    m = plain(4, ranks_per_host=2, nics=2, nic_policy="rank")
    n, seg = 8 << 20, (256 << 10) // 4
    hier = predict("multicolor", m, n, params=Params(colors=2, segment=seg, hierarchical=True), check=False)
    ring = predict("ring", m, n, params=Params(segment=seg), check=False)
    assert hier < ring


# ---------------------------------------------------------------- Open MPI models
@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8, 12, 16])
def test_ompi_models_compute_the_sum(p):
    n = 37
    for build in (recursive_doubling, rabenseifner, nonoverlapping):
        s = build(p, n)
        assert check_schedule(s) is None
        bufs = [np.arange(n, dtype=np.int64) * (r + 1) for r in range(p)]
        expected = sum(bufs)
        execute(s, bufs)
        assert all(np.array_equal(b, expected) for b in bufs), (build.__name__, p)


def test_ompi_default_decision_matches_open_mpi_41():
    assert ompi_default(4, 4096) == 3 and ompi_default(4, 32 << 20) == 6
    assert ompi_default(8, 4096) == 3 and ompi_default(8, 8192) == 6
    assert ompi_default(16, 64 << 10) == 6 and ompi_default(2, 1 << 20) == 6
    assert ompi_default(2, 32 << 10) == 4 and ompi_default(256, 1024) == 2
    assert ompi_schedule(4, 1024, 4).algorithm == "mpi:recursive_doubling"


# ---------------------------------------------------------------- calibration
def test_fit_line_and_overhead_recover_known_values():
    a, b = fit_line([0, 1, 2, 3], [1.0, 3.0, 5.0, 7.0])
    assert (a, b) == pytest.approx((1.0, 2.0))
    model = ClusterModel(hosts=2, nic_Bps=25e6, alpha=40e-6, overhead=0.0)
    sched = build_schedule("ring", model.layout(), 1, Params())
    measured = simulate(sched, model.with_(overhead=73e-6)).time
    assert fit_overhead(measured, model) == pytest.approx(73e-6, rel=1e-3)


def test_fit_turns_raw_measurements_into_model_constants():
    alpha, peak, rate = 30e-6, 400e6, 25e6
    raw = {"inter": {"pingpong": [(s, alpha + s / peak) for s in (8, 256, 1024, 2048, 4096, 16384)],
                     "stream_Bps": 0.96 * rate, "exchange_Bps": 0.6 * 0.96 * rate},
           "intra": {"pingpong": [(s, 5e-6 + s / 2e9) for s in (256, 1024, 4096)], "stream_Bps": 2e9},
           "gamma": 1e-10, "engine_ring_1elem_s": 500e-6}
    c = fit(raw, rate)
    assert c["alpha"] == pytest.approx(alpha, rel=1e-6) and c["peak_Bps"] == pytest.approx(peak, rel=1e-6)
    assert c["nic_efficiency"] == pytest.approx(0.96) and c["duplex"] == pytest.approx(0.6)
    assert c["intra_alpha"] == pytest.approx(5e-6, rel=1e-6) and c["intra_Bps"] == 2e9
    assert 20e-6 < c["overhead"] < 200e-6
    m = emulated(2, calibration=c, cores=None)
    sched = build_schedule("ring", m.layout(), 1, Params())
    assert simulate(sched, m).time == pytest.approx(500e-6, rel=1e-3)


def test_parse_rate_and_presets():
    assert link_bytes_per_s("200mbit") == 25e6 and link_bytes_per_s("1gbit") == 125e6
    m = emulated(4, 2)
    assert m.nranks == 8 and m.layout() == [[0, 1], [2, 3], [4, 5], [6, 7]] and m.cores == 2 and m.polling
    assert paper(32, 2).nranks == 128 and paper(32, 2).nics == 2


# ---------------------------------------------------------------- tuner and report
def test_tuner_latency_regime_small_many_colors_large():
    m = plain(8, overhead=3e-6)
    hosts = flat(8)
    algo, small = tuner.best_params(hosts, 1024, 4, model=m)
    assert algo == "doubling" and small.segment == 0        # latency-bound: log2(p) exchanges
    algo, small = tuner.best_params(hosts, 1024, 4, model=m, algorithms=("ring",))
    assert algo == "ring"                                   # the family is only searched when asked
    algo, large = tuner.best_params(hosts, 4 << 20, 4, model=m)
    assert algo == "multicolor"
    # bandwidth-bound: pipelined, over several trees or a ring (the same bytes per link)
    assert large.segment > 0 and (large.colors >= 2 or large.route == "ring")
    rows = tuner.table(m, [1024, 4 << 20])
    assert [r["size_bytes"] for r in rows] == [1024, 4 << 20]
    assert rows[0]["speedup_vs_ring"] > 1 and (rows[1]["colors"], rows[1]["route"]) == (large.colors, large.route)
    assert rows[0]["algorithm"] == "doubling" and rows[1]["algorithm"] == "multicolor"


def test_tuning_table_lookup(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tables": {"4h2r": [
        {"size_bytes": 4096, "colors": 1, "segment_bytes": 0, "hierarchical": True},
        {"size_bytes": 1 << 20, "colors": 4, "segment_bytes": 262144, "hierarchical": False}]}}))
    hosts = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert tuning.lookup(hosts, 100, 4, str(path)) == ("multicolor", Params(colors=1, segment=0, hierarchical=True))
    assert tuning.lookup(hosts, 64 << 20, 4, str(path)) == (
        "multicolor", Params(colors=4, segment=65536, hierarchical=False))
    assert tuning.lookup(flat(4), 100, 4, str(path)) is None


def test_report_splices_only_its_section_and_checks_goals(tmp_path):
    from mcallreduce.bench import report
    md = tmp_path / "report.md"
    md.write_text("# Report\n\nhand-written table\n")
    report.splice(md, f"{report.BEGIN}\nfirst\n{report.END}\n")
    report.splice(md, f"{report.BEGIN}\nsecond\n{report.END}\n")
    text = md.read_text()
    assert "hand-written table" in text and "second" in text and "first" not in text
    assert text.count(report.BEGIN) == 1

    def rec(a, size, t, p=4):
        return {"algorithm": a, "size_bytes": size, "time_s": t, "busbw_Bps": size / t * 2 * (p - 1) / p}
    setups = [{"setup": "4h1r", "records": [rec("multicolor", 32 << 20, 2.1), rec("mpi", 32 << 20, 2.5),
                                            rec("mpi-ring", 32 << 20, 2.2)]},
              {"setup": "4h2r", "records": [rec("multicolor", 32 << 20, 2.1, 8), rec("ring", 32 << 20, 2.2, 8)]}]
    rows = {name: ok for name, _, _, ok in report.goals(setups, 25e6)}
    assert rows == {"4 hosts, 32 MiB: multicolor busbw / link rate": True,   # 0.959 of the link
                    "4 hosts, 32 MiB: multicolor vs MPI default": False,     # 1.19x
                    "4 hosts, 32 MiB: multicolor vs Open MPI ring": True,    # 1.05x
                    "4 hosts x 2 ranks, 32 MiB: hierarchical multicolor vs flat ring": False}   # 1.05x


def test_tune_cli_writes_the_table(tmp_path, capsys):
    from mcallreduce.bench import tune
    out = tmp_path / "tuning.json"
    # a size named twice is one row (a table with two rows of one size is refused)
    assert tune.main(["--hosts", "2", "--ranks-per-host", "1,2", "--sizes", "256K,4K,4096", "--out", str(out)]) == 0
    tuning.check_file(str(out))
    tables = json.loads(out.read_text())["tables"]
    assert set(tables) == {"2h1r", "2h2r"} and [r["size_bytes"] for r in tables["2h2r"]] == [4096, 262144]
    assert "vs ring" in capsys.readouterr().out
    assert tuning.lookup([[0, 1], [2, 3]], 5000, 4, str(out))[0] == "multicolor"


def test_report_from_saved_measurements(tmp_path):
    from mcallreduce.bench import report
    data = tmp_path / "data"
    data.mkdir()
    recs = [{"algorithm": a, "size_bytes": n, "time_s": t, "busbw_Bps": n / t, "ranks": 2, "correct": True}
            for a in report.ALGOS for n, t in ((4096, 1e-3), (1 << 20, 0.05))]
    (data / "bench-2h1r.json").write_text(json.dumps(
        {"setup": "2h1r", "hosts": 2, "ranks_per_host": 1, "rate": "200mbit",
         "barrier": {"ranks": 2, "barrier_s": 5e-4}, "records": recs}))
    (data / "sweep-log.json").write_text(json.dumps({"log": ["2h1r: 9 s"], "date": "d", "autogroups": "off"}))
    (tmp_path / "report.md").write_text("# Report\n\nkeep me\n")
    assert report.main(["--skip-measure", "--skip-paper", "--setups", "2x1", "--docs", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "keep me" in text and report.BEGIN in text and "Model vs measurement" in text
    assert "Kernel autogroups while the hosts were up: off" in text
    assert (tmp_path / "img" / "busbw.png").read_bytes()[:4] == b"\x89PNG"
    pts = json.loads((data / "model-vs-measured.json").read_text())
    assert len(pts) == len(recs) and all(p["predicted_s"] > 0 for p in pts)


def test_the_sweep_names_the_autogroups_it_ran_with():
    from mcallreduce.bench.autogroups import state_word
    from mcallreduce.bench.report.measure import autogroups_word
    assert [state_word(v) for v in (False, True, None)] == ["off", "on", "absent"]
    assert [autogroups_word(s) for s in ({"off"}, {"on"}, {"absent"}, {"off", "on"})] == ["off", "on", "absent", "mixed"]


def test_the_modelled_check_is_the_runtimes_vector():
    from mcallreduce import check
    from mcallreduce.sim import predict
    sent = check.vector(0, 0, (0,) * len(check.FIELDS))
    assert predict.CHECK_BYTES == sent.nbytes == check.VECTOR_BYTES


def test_a_doubling_call_reduced_along_its_check_is_not_charged_the_check_twice():
    # up to FUSED_MAX_BYTES a doubling call's data rides its own metadata check (native/check.c),
    # so the check costs it nothing; a larger one waits for its check first
    from mcallreduce.policy import FUSED_MAX_BYTES
    model = emulated(4, rate="10gbit")
    fused = predict("multicolor", model, 8 << 10, params=None)
    assert fused == predict("multicolor", model, 8 << 10, check=False)
    big = FUSED_MAX_BYTES * 4
    assert predict("doubling", model, big, params=Params()) > predict("doubling", model, big, params=Params(), check=False)


def test_the_check_gates_every_step_but_the_early_ones():
    from mcallreduce.lowering import EARLY_MAX_BYTES, early_steps
    model = emulated(4, 1, "200mbit")
    schedule = build_schedule("ring", model.layout(), (1 << 20) // 4, Params(segment=15360))
    early = [early_steps(schedule, r, EARLY_MAX_BYTES // 4) for r in range(4)]
    assert all(early)   # a ring's first segments wait for nothing
    plain, check = simulate(schedule, model).time, 0.1   # longer than the early segments take
    assert simulate(schedule, model, gate=check).time == pytest.approx(plain + check)   # nothing early: all wait
    assert plain < simulate(schedule, model, gate=check, early=early).time < plain + check


def test_a_faster_link_is_never_slower():
    # every link above 400 Mbit/s was once priced at the calibration's 50 MB/s burst speed
    for algorithm in ("ring", "multicolor", "mpi"):
        times = [predict(algorithm, emulated(4, rate=rate), 4 << 20) for rate in ("200mbit", "1gbit", "10gbit", "100gbit")]
        assert times == sorted(times, reverse=True) and times[2] < times[1] / 5, (algorithm, times)


def test_constants_and_sizes_that_price_nothing_are_refused():
    from mcallreduce.sim.predict import busbw
    model = emulated(4)
    for bad in ({"gamma": float("nan")}, {"alpha": -1.0}, {"overhead": -1.0}, {"nic_Bps": 0.0},
                {"oversubscription": 0.0}, {"cores": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ClusterModel(4, **{**PLAIN, **bad})
    for nbytes in (0, -4096, 1.5, True):
        with pytest.raises(ValueError, match="nbytes"):
            predict("ring", model, nbytes)
    assert busbw(1 << 20, 1e-3, 1) == 0.0 and predict("ring", emulated(1), 1 << 20) >= 0
