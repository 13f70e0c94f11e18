"""MCALLREDUCE_* parsing, error messages and the size-based defaults."""
import subprocess
import sys

import pytest

from mcallreduce.config import Config, ConfigError, parse_size
from mcallreduce.policy import resolve


def rules_only(**kwargs):
    return Config(tuning_file="none", **kwargs)


def test_defaults_without_variables():
    c = Config.from_env({})
    assert c == Config()
    assert c.algorithm == "multicolor" and c.colors is None and c.check


@pytest.mark.parametrize("text,value", [("4096", 4096), ("256K", 256 << 10), ("1M", 1 << 20), ("2GiB", 2 << 30),
                                        ("0", 0)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_every_variable_is_read():
    env = {"MCALLREDUCE_ALGORITHM": "ring", "MCALLREDUCE_COLORS": "3", "MCALLREDUCE_SEGMENT_BYTES": "128K",
           "MCALLREDUCE_FANOUT": "4", "MCALLREDUCE_HIERARCHY": "0", "MCALLREDUCE_PIPELINE_DEPTH": "2",
           "MCALLREDUCE_CHECK": "0", "MCALLREDUCE_VERBOSE": "1", "MCALLREDUCE_RANKS_PER_HOST": "2",
           "MCALLREDUCE_SHM_BYTES": "2M", "MCALLREDUCE_ROUTE": "Ring"}
    c = Config.from_env(env)
    assert (c.algorithm, c.colors, c.segment_bytes, c.fanout, c.hierarchy, c.depth, c.check, c.verbose,
            c.ranks_per_host, c.shm_bytes, c.route) == ("ring", 3, 128 << 10, 4, False, 2, False, True, 2, 2 << 20,
                                                        "ring")
    assert Config.from_env({"MCALLREDUCE_ROUTE": "auto"}).route is None


@pytest.mark.parametrize("name,value,hint", [
    ("ALGORITHM", "tree", "multicolor, ring, doubling, halving, mpi"),
    ("COLORS", "0", "'auto' or an integer >= 1"),
    ("COLORS", "many", "'auto' or an integer >= 1"),
    ("SEGMENT_BYTES", "big", "256K"),
    ("FANOUT", "1", "integer >= 2"),
    ("HIERARCHY", "maybe", "'auto', 1, 0"),
    ("ROUTE", "star", "tree, ring, auto"),
    ("CHECK", "auto", "1, 0"),
    ("PIPELINE_DEPTH", "0", "integer >= 1"),
])
def test_invalid_values_name_the_variable_and_allowed_values(name, value, hint):
    with pytest.raises(ConfigError) as err:
        Config.from_env({"MCALLREDUCE_" + name: value})
    assert "MCALLREDUCE_" + name in str(err.value) and hint in str(err.value)


def test_size_table():
    # the built-in rules, without the built-in measured table (tests/test_policy.py covers tables)
    Config = rules_only
    one_host_two = [[0, 1]]
    flat4 = [[0], [1], [2], [3]]
    # latency regime: recursive doubling for small messages, and for a pair up to 256 KiB
    for hosts in (one_host_two, flat4, [[0, 1], [2, 3], [4]]):
        algo, p = resolve(Config(), 4 << 10, 4, hosts)
        assert (algo, p.segment) == ("doubling", 0)
    assert resolve(Config(), 256 << 10, 4, one_host_two)[0] == "doubling"
    assert resolve(Config(), 1 << 20, 4, one_host_two)[0] == "multicolor"
    assert resolve(Config(), 1 << 20, 4, flat4)[0] == "multicolor"
    algo, p = resolve(Config(colors=1), 4 << 10, 4, one_host_two)      # a multicolor knob set: multicolor
    assert (algo, p.colors, p.segment, p.hierarchical) == ("multicolor", 1, 0, True)
    # across hosts, above the latency regime up to 256 KiB: halving fused with its check
    for nbytes in ((16 << 10) + 4, 64 << 10, (64 << 10) + 4, 256 << 10):
        assert resolve(Config(), nbytes, 4, flat4)[0] == "halving"
        assert resolve(Config(), nbytes, 4, [[0, 1], [2, 3]])[0] == "halving"
    assert resolve(Config(), 64 << 10, 4, one_host_two)[0] == "doubling"          # a pair: doubling to 256 KiB
    assert resolve(Config(), 64 << 10, 4, [[0, 1, 2, 3]])[0] == "multicolor"      # one host: ours
    algo, p = resolve(Config(), 1 << 20, 4, [[0, 1], [2, 3]])
    assert (algo, p.colors) == ("multicolor", 2)
    assert resolve(Config(), 4 << 10, 4, [[0]])[0] == "multicolor"   # one rank: nothing to exchange
    algo, p = resolve(Config(), 64 << 20, 4, one_host_two)
    assert p.colors == 2 and p.segment == (256 << 10) // 4
    _, p = resolve(Config(), 64 << 20, 4, flat4)
    assert (p.route, p.colors) == ("ring", 1) and not p.hierarchical   # large, few hosts: a ring
    assert p.segment == (60 << 10) // 4               # across hosts: segments sent eagerly
    _, p = resolve(Config(), 64 << 20, 4, [[0, 1]] * 1 + [[2, 3], [4, 5], [6, 7]])
    assert (p.route, p.colors, p.hierarchical) == ("ring", 2, True)    # one ring per local rank
    _, p = resolve(Config(route="tree"), 64 << 20, 4, flat4)
    assert (p.route, p.colors) == ("tree", 4)         # one color per host: direct reduce-scatter
    _, p = resolve(Config(), 64 << 20, 4, [[r] for r in range(9)])
    assert p.route == "tree"                          # the ring route is measured up to 8 hosts
    four_by_two = [[0, 1], [2, 3], [4, 5], [6, 7]]   # the rules' halving takes medium sizes there
    assert resolve(Config(colors=2), 128 << 10, 4, four_by_two)[1].route == "tree"   # medium: trees (2 log N hops)
    assert resolve(Config(), 512 << 10, 4, four_by_two)[1].route == "ring"
    _, p = resolve(Config(route="ring", colors=3), 1 << 20, 4, flat4)
    assert (p.colors, p.segment) == (3, (60 << 10) // 4)
    _, p = resolve(Config(colors=3, segment_bytes=0, hierarchy=False), 64 << 20, 8, one_host_two)
    assert (p.colors, p.segment, p.hierarchical) == (3, 0, False)
    _, p = resolve(Config(), 1 << 20, 4, [[0, 1], [2, 3]])
    assert p.colors == 2 and p.segment == (60 << 10) // 4   # crosses hosts: eager segments even so
    _, p = resolve(Config(colors=2), 1 << 20, 4, [[0, 1, 2, 3]])
    assert p.colors == 2 and p.segment == 0            # one host, 512 KiB per color: too few to pipeline
    _, p = resolve(Config(), 64 << 10, 8, flat4, mpi_type=False)
    assert p.segment == 0                              # 32 KiB per color: one eager message already
    _, p = resolve(Config(segment_bytes=1 << 20), 64 << 20, 4, flat4)
    assert p.segment == (1 << 20) // 4                 # the variable still wins
    algo, p = resolve(Config(algorithm="ring"), 64 << 20, 4, flat4)
    assert algo == "ring" and p.segment == (60 << 10) // 4   # across hosts the ring's too are eager
    algo, p = resolve(Config(algorithm="ring"), 64 << 20, 4, one_host_two)
    assert algo == "ring" and p.segment == (256 << 10) // 4  # one host: no TCP, no eager rule
    algo, p = resolve(Config(algorithm="ring"), 128 << 10, 4, flat4)
    assert p.segment == 0                                    # 32 KiB chunks: eager already


def test_shared_memory_stage_on_one_host_only():
    one_host, two_hosts = [[0, 1, 2]], [[0, 1], [2, 3]]
    slot = 8 << 20
    for nbytes in (0, 4 << 10, 1 << 20, 8 << 20):
        algo, p = resolve(Config(), nbytes, 4, one_host, shared_slot=slot)
        assert (algo, p.shared, p.colors) == ("multicolor", True, 3)   # every local rank a color
    assert not resolve(Config(), (8 << 20) + 4, 4, one_host, shared_slot=slot)[1].shared   # above the limit
    assert not resolve(Config(), 1 << 20, 4, one_host)[1].shared                  # no window: messages
    assert not resolve(Config(), 0, 4, one_host)[1].shared
    assert not resolve(Config(shm_bytes=0), 0, 4, one_host, shared_slot=slot)[1].shared
    assert not resolve(Config(), 1 << 20, 4, two_hosts, shared_slot=slot)[1].shared
    assert not resolve(Config(shm_bytes=0), 1 << 20, 4, one_host, shared_slot=slot)[1].shared
    assert not resolve(Config(shm_bytes=1 << 20), 2 << 20, 4, one_host, shared_slot=slot)[1].shared
    assert not resolve(Config(), 1 << 20, 4, one_host, shared_slot=512 << 10)[1].shared   # the window's size
    assert not resolve(Config(), 1 << 20, 4, [[0]], shared_slot=slot)[1].shared   # one rank: nothing to do
    for forced in (Config(colors=2), Config(segment_bytes=0), Config(hierarchy=True), Config(algorithm="ring"),
                   Config(algorithm="doubling"), Config(algorithm="mpi")):
        assert not resolve(forced, 1 << 20, 4, one_host, shared_slot=slot)[1].shared, forced
    assert Config.from_env({"MCALLREDUCE_SHM_BYTES": "1M"}).shm_bytes == 1 << 20
    assert Config.from_env({"MCALLREDUCE_SHM_BYTES": "0"}).shm_bytes == 0
    assert Config.from_env({}).shm_bytes == 8 << 20
    for bad in ("lots", "2G"):
        with pytest.raises(ConfigError, match="MCALLREDUCE_SHM_BYTES"):
            Config.from_env({"MCALLREDUCE_SHM_BYTES": bad})


def test_small_one_host_calls_synchronise_once():
    one_host, slot, small = [[0, 1, 2]], 8 << 20, 32 << 10
    for nbytes, one_sync in ((0, True), (4 << 10, True), (32 << 10, True), ((32 << 10) + 4, False), (64 << 10, False)):
        _, p = resolve(Config(), nbytes, 4, one_host, shared_slot=slot, single_copy_ok=True, small_slot=small)
        assert p.shared and p.one_sync == one_sync and p.single_copy == (nbytes >= 64 << 10), nbytes
    _, p = resolve(Config(one_sync_bytes=1 << 20), 64 << 10, 4, one_host, shared_slot=slot, single_copy_ok=True,
                   small_slot=small)
    assert p.single_copy and not p.one_sync                                 # larger than the small slots
    _, p = resolve(Config(one_sync_bytes=1 << 20), 64 << 10, 4, one_host, shared_slot=slot, single_copy_ok=True,
                   small_slot=1 << 20)
    assert p.one_sync and not p.single_copy                                 # a user's larger limit wins
    _, p = resolve(Config(one_sync_bytes=1 << 20), 256 << 10, 4, one_host, shared_slot=slot, small_slot=small)
    assert not p.one_sync                                                   # larger than the small slots
    for nbytes in (0, 4 << 10):   # off is off, for an empty call too
        _, p = resolve(Config(one_sync_bytes=0), nbytes, 4, one_host, shared_slot=slot, small_slot=small)
        assert p.shared and not p.one_sync, nbytes
    assert not resolve(Config(), 4 << 10, 4, one_host, shared_slot=slot)[1].one_sync   # no small slots
    assert Config.from_env({"MCALLREDUCE_ONE_SYNC_BYTES": "16K"}).one_sync_bytes == 16 << 10
    assert Config.from_env({}).one_sync_bytes == 32 << 10
    for bad in ("lots", "128M"):
        with pytest.raises(ConfigError, match="MCALLREDUCE_ONE_SYNC_BYTES"):
            Config.from_env({"MCALLREDUCE_ONE_SYNC_BYTES": bad})


def test_inter_host_segment_follows_the_tcp_eager_limit():
    from mcallreduce.config import inter_host_segment_bytes
    assert inter_host_segment_bytes({}) == 60 << 10                    # 64 KiB less the headers
    assert inter_host_segment_bytes({"OMPI_MCA_btl_tcp_eager_limit": "1M"}) == (1 << 20) - 4096
    assert inter_host_segment_bytes({"OMPI_MCA_btl_tcp_eager_limit": "2048"}) == 4096   # a floor
    # as Open MPI reads it (strtoull, base 0): once a ConfigError on every call
    assert inter_host_segment_bytes({"OMPI_MCA_btl_tcp_eager_limit": "0x10000"}) == 60 << 10
    env = {"OMPI_MCA_btl_tcp_eager_limit": "262144"}
    _, p = resolve(Config.from_env(env), 64 << 20, 4, [[0], [1], [2], [3]])
    assert p.segment == (256 << 10) // 4 - 1024
    with pytest.raises(ConfigError, match="OMPI_MCA_btl_tcp_eager_limit"):
        Config.from_env({"OMPI_MCA_btl_tcp_eager_limit": "lots"})


def test_tuning_file_replaces_auto_choices(tmp_path):
    import json
    table = {"tables": {"4h1r": [{"size_bytes": 1 << 20, "colors": 3, "segment_bytes": 65536, "hierarchical": False},
                                 {"size_bytes": 1 << 30, "colors": 2, "segment_bytes": 0, "hierarchical": False}]}}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(table))
    c = Config.from_env({"MCALLREDUCE_TUNING_FILE": str(path)})
    flat4 = [[0], [1], [2], [3]]
    _, p = resolve(c, 4 << 10, 4, flat4)
    assert (p.colors, p.segment) == (3, 65536 // 4)
    _, p = resolve(c, 64 << 20, 4, flat4)
    assert (p.colors, p.segment) == (2, 0)
    _, p = resolve(Config(colors=5, tuning_file=str(path)), 64 << 20, 4, flat4)   # explicit setting wins
    assert p.colors == 5
    table["tables"]["4h1r"][0]["algorithm"] = "doubling"    # the tuner may pick the latency regime
    path.write_text(json.dumps(table))
    c = Config.from_env({"MCALLREDUCE_TUNING_FILE": str(path)})   # the table rewritten in place is read again
    assert resolve(c, 4 << 10, 4, flat4)[0] == "doubling"
    assert resolve(c, 64 << 20, 4, flat4)[0] == "multicolor"
    _, p = resolve(c, 64 << 20, 4, [[0, 1]])        # no row for this layout: the built-in table
    assert p.colors == 2 and p.segment == (256 << 10) // 4
    with pytest.raises(ConfigError, match="MCALLREDUCE_TUNING_FILE"):
        Config.from_env({"MCALLREDUCE_TUNING_FILE": str(tmp_path / "missing.json")})


def test_config_is_the_one_place_and_imports_only_the_standard_library():
    import subprocess
    import sys
    code = ("import sys, mcallreduce.config as c; "
            "print(sorted(m for m in sys.modules if m.startswith(('numpy', 'mpi4py', 'torch', 'mcallreduce.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # mpit (ctypes and os only) is the package's: it sets one Open MPI variable before MPI starts
    assert out.strip() == ("['mcallreduce.config', 'mcallreduce.envparse', 'mcallreduce.errors', 'mcallreduce.mpit', "
                           "'mcallreduce.units']"), out
    from mcallreduce.algorithms import SCHEDULED
    from mcallreduce.config import ALGORITHMS
    assert ALGORITHMS == SCHEDULED + ("mpi", "mpi-ring")


def test_horovod_and_data_variables():
    from mcallreduce import config as c
    assert c.horovod_requested_by_startup_hook({}) is False
    assert c.horovod_requested_by_startup_hook({"MCALLREDUCE_ALGORITHM": "ring"}) is True
    assert c.horovod_requested_by_startup_hook({"MCALLREDUCE_ALGORITHM": "ring", "MCALLREDUCE_HOROVOD": "0"}) is False
    assert c.horovod_requested_by_import({}) is True
    assert c.bucket_bytes({}) == 25 << 20 and c.bucket_bytes({"MCALLREDUCE_BUCKET_BYTES": "4M"}) == 4 << 20
    assert c.bucket_bytes({"HOROVOD_FUSION_THRESHOLD": "67108864"}) == 64 << 20      # Horovod's knob
    assert c.bucket_bytes({"HOROVOD_FUSION_THRESHOLD": "0"}) == 1                    # no fusion
    # read as Horovod reads it (strtol: the leading integer), where hvd.init() once raised on what stock takes
    assert [c.bucket_bytes({"HOROVOD_FUSION_THRESHOLD": v}) for v in ("64MB", "1e6", "-1", "x", "")] == [64, 1, 1, 1, 1]
    assert [c.horovod_mpi_threads_disabled({"HOROVOD_MPI_THREADS_DISABLE": v}) for v in ("1", "+1", "0", "x")] \
        == [True, True, False, False]
    assert c.timeline_file({"HOROVOD_TIMELINE": "DYNAMIC"}) is None   # Horovod's "hvd.start_timeline() decides"
    assert c.timeline_file({"HOROVOD_TIMELINE": "t.json"}) == "t.json"
    assert c.bucket_bytes({"HOROVOD_FUSION_THRESHOLD": "0", "MCALLREDUCE_BUCKET_BYTES": "1M"}) == 1 << 20
    assert c.stall_check_seconds({}) == 60 and c.stall_check_seconds({"HOROVOD_STALL_CHECK_TIME_SECONDS": "5"}) == 5
    assert c.stall_check_seconds({"HOROVOD_STALL_CHECK_TIME_SECONDS": "5",
                                  "MCALLREDUCE_STALL_CHECK_TIME_SECONDS": "2"}) == 2
    assert c.stall_check_seconds({"HOROVOD_STALL_CHECK_DISABLE": "1"}) is None
    assert c.stall_shutdown_seconds({}) is None and c.stall_shutdown_seconds({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "9"}) == 9
    # Horovod's own variables as Horovod reads them (strtol; the check is off for any value above 0),
    # where hvd.init() once raised on what stock takes, or read "true" as off where stock keeps it on
    assert [c.stall_check_seconds({"HOROVOD_STALL_CHECK_DISABLE": v}) for v in ("2", "+1", "true", "0")] \
        == [None, None, 60, 60]
    assert [c.stall_check_seconds({"HOROVOD_STALL_CHECK_TIME_SECONDS": v}) for v in ("60s", "-1", "x", "")] == [60, 0, 0, 0]
    assert c.stall_shutdown_seconds({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90sec"}) == 90
    # the MCALLREDUCE_ variable decides where it is set, also to turn the check back on
    assert c.stall_check_seconds({"MCALLREDUCE_STALL_CHECK_DISABLE": "0", "HOROVOD_STALL_CHECK_DISABLE": "1"}) == 60
    assert c.progress_thread_setting({"MCALLREDUCE_PROGRESS_THREAD": "1"}) is True
    assert c.progress_thread_setting({"MCALLREDUCE_PROGRESS_THREAD": "0"}) is False
    assert c.progress_thread_setting({}) is None
    assert c.gradient_as_bucket_view({}) is False
    assert c.gradient_as_bucket_view({"MCALLREDUCE_GRADIENT_AS_BUCKET_VIEW": "1"}) is True
    for fn, env in [(c.horovod_switch, {"MCALLREDUCE_HOROVOD": "maybe"}),
                    (c.bucket_bytes, {"MCALLREDUCE_BUCKET_BYTES": "0"}),
                    (c.gradient_as_bucket_view, {"MCALLREDUCE_GRADIENT_AS_BUCKET_VIEW": "auto"}),
                    (c.bucket_bytes, {"MCALLREDUCE_BUCKET_BYTES": "lots"}),
                    (c.stall_check_seconds, {"MCALLREDUCE_STALL_CHECK_TIME_SECONDS": "soon"})]:
        with pytest.raises(ConfigError, match=next(iter(env))):
            fn(env)
    with pytest.raises(ConfigError, match="MCALLREDUCE_PROGRESS_THREAD"):
        c.progress_thread_setting({"MCALLREDUCE_PROGRESS_THREAD": "2"})
    assert c.parse_size("1.5G") == 3 << 29 and c.parse_size("2T") == 2 << 40


def test_data_variables(monkeypatch):
    from mcallreduce import config
    from mcallreduce.data.settings import data
    assert config.data is data   # where the namespace was before
    assert data.threads() == 4 and data.partition() == "split" and data.ranks_per_host() is None
    monkeypatch.setenv("MCALLREDUCE_DATA_MEMORY_LIMIT", "1.5G")
    monkeypatch.setenv("MCALLREDUCE_RANKS_PER_HOST", "2")
    assert data.memory_limit() == 3 << 29 and data.ranks_per_host() == 2
    assert data.exchange_round_bytes() == 1 << 30
    for name, value in [("MCALLREDUCE_DATA_THREADS", "many"), ("MCALLREDUCE_DATA_PARTITION", "half"),
                        ("MCALLREDUCE_DATA_MEMORY_FRACTION", "2"), ("MCALLREDUCE_DATA_DECODER", "gpu"),
                        # 0 once divided by zero; 2G overflows Alltoallv's counts
                        ("MCALLREDUCE_DATA_EXCHANGE_ROUND_BYTES", "0"), ("MCALLREDUCE_DATA_EXCHANGE_ROUND_BYTES", "2G")]:
        monkeypatch.setenv(name, value)
        getter = {"THREADS": data.threads, "PARTITION": data.partition, "MEMORY_FRACTION": data.memory_fraction,
                  "DECODER": data.decoder, "EXCHANGE_ROUND_BYTES": data.exchange_round_bytes}[name.split("DATA_")[1]]
        with pytest.raises(ConfigError, match=name):
            getter()


def test_poll_time_is_microseconds_from_zero():
    assert Config.from_env({}).poll_us == 1000
    assert Config.from_env({"MCALLREDUCE_POLL_US": "0"}).poll_us == 0
    for bad in ("-1", "1ms", "auto"):
        with pytest.raises(ConfigError, match="MCALLREDUCE_POLL_US"):
            Config.from_env({"MCALLREDUCE_POLL_US": bad})


def test_fast_links_are_measured_unless_the_user_says():
    assert [Config.from_env({"MCALLREDUCE_FAST_LINKS": v}).fast_links for v in ("auto", "1", "0", "")] == \
        [None, True, False, None]
    with pytest.raises(ConfigError, match="MCALLREDUCE_FAST_LINKS"):
        Config.from_env({"MCALLREDUCE_FAST_LINKS": "fast"})


def test_a_stall_shutdown_time_below_the_check_time_never_fails_a_call_as_in_horovod(monkeypatch, capsys):
    # Horovod warns and never shuts down; calls here once failed before any stall was reported
    from types import SimpleNamespace
    from mcallreduce.stall import StallInspector
    engine = SimpleNamespace(ctx=SimpleNamespace(rank=0), waiting=lambda: [])
    for ours in ("MCALLREDUCE_STALL_CHECK_TIME_SECONDS", "MCALLREDUCE_STALL_SHUTDOWN_TIME_SECONDS"):
        monkeypatch.delenv(ours, raising=False)   # conftest sets a shutdown time for every job
    for check, shutdown, ours, fails_after in (("60", "30", None, None), ("10", "30", None, 30.0),
                                              ("60", "90", "30", 30.0)):   # our own variable: as documented
        monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", check)
        monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", shutdown)
        if ours:
            monkeypatch.setenv("MCALLREDUCE_STALL_SHUTDOWN_TIME_SECONDS", ours)
        inspector = StallInspector.start(engine)
        inspector.stop()
        assert inspector.fail_after == fails_after
    assert capsys.readouterr().err.count("calls will not fail on a stall, as in Horovod") == 1


def test_a_limit_on_calls_fails_them_once_and_only_calls_past_it():
    # a DDP group's timeout: the stall check is off here, so the limit alone starts the watcher
    import time
    from types import SimpleNamespace
    from mcallreduce.stall import StallInspector
    now = time.monotonic()
    calls = [(1, now - 5.0, None, 8), (2, now, None, 8)]   # (seq, since, name, bytes): #1 waited 5 s
    failed = []

    def fail_all(reason):   # as the engine's: every call submitted so far fails, the later ones are spared
        failed.append(reason)
        return max(seq for seq, _, _, _ in calls) + 1
    engine = SimpleNamespace(ctx=SimpleNamespace(rank=0), waiting=lambda: list(calls), fail_all=fail_all)
    inspector = StallInspector(engine, None, None)
    try:
        time.sleep(0.3)
        assert failed == []                                # no limit yet
        inspector.limit_calls(10.0, "a limit no call has reached")
        time.sleep(0.3)
        assert failed == []                                # calls under the limit are left alone
        inspector.limit_calls(2.0, "the process group's timeout (0:00:02)")
        deadline = time.monotonic() + 5
        while not failed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert failed == ["the call did not finish within the process group's timeout (0:00:02): "
                          "a rank failed, or did not call it"]
        time.sleep(0.8)
        assert len(failed) == 1                            # the failed calls only wait to be reported
        calls.append((3, time.monotonic() - 3.0, None, 8))   # a later call past the limit fails anew
        deadline = time.monotonic() + 5
        while len(failed) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(failed) == 2
    finally:
        inspector.stop()


def test_a_calls_options_are_checked_as_the_variables_are():
    # colors=0 once counted as auto yet as a knob set (the one-host stage off), a negative segment as 1 element
    base = Config()
    assert base.with_overrides(colors=2, segment_bytes=0, fanout=2, depth=1).colors == 2
    for bad in ({"colors": 0}, {"colors": 1.5}, {"segment_bytes": -8}, {"fanout": 1}, {"depth": 0}, {"colors": True}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            base.with_overrides(**bad)
    # names in any case, as MCALLREDUCE_ALGORITHM and MCALLREDUCE_ROUTE read them
    named = base.with_overrides(algorithm="Ring", route="TREE")
    assert (named.algorithm, named.route) == ("ring", "tree")


def test_every_name_a_module_exports_exists():
    # ``from mcallreduce.config import *`` once raised AttributeError on a renamed function;
    # run apart: importing the Horovod plugin's modules patches horovod.torch
    script = """if True:
        import importlib, pkgutil, mcallreduce
        missing = []
        for info in pkgutil.walk_packages(mcallreduce.__path__, "mcallreduce."):
            if not info.name.endswith("__main__"):
                try:
                    module = importlib.import_module(info.name)
                except ImportError as exc:   # an optional integration whose framework is not installed
                    if (exc.name or "").split(".")[0] in ("horovod", "cupy"):
                        continue
                    raise
                missing += [f"{info.name}.{n}" for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
        assert not missing, missing
    """
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
