"""The selection policy without MPI: a tuning table's size -> algorithm rows are what resolve picks."""
import json

import pytest

from mcallreduce.algorithms import Params
from mcallreduce.config import Config, ConfigError
from mcallreduce.policy import BUILTIN_TABLE, resolve, table_problem


def test_a_measured_table_decides_the_algorithm_per_size(tmp_path):
    rows = [{"size_bytes": 4 << 10, "algorithm": "multicolor", "colors": 2, "segment_bytes": 0,
             "hierarchical": True, "route": "tree", "shared": True},
            {"size_bytes": 64 << 10, "algorithm": "mpi"},
            {"size_bytes": 1 << 20, "algorithm": "ring", "segment_bytes": 256 << 10},
            {"size_bytes": 4 << 20, "algorithm": "halving", "segment_bytes": 60 << 10},
            {"size_bytes": 8 << 20, "algorithm": "doubling"},
            {"size_bytes": 64 << 20, "algorithm": "multicolor", "colors": 2, "segment_bytes": 1 << 20,
             "hierarchical": True, "route": "tree", "shared": False}]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"measured": True, "tables": {"1h2r": rows}}))
    config = Config(tuning_file=str(path))
    host = [[0, 1]]
    slot = 8 << 20
    assert resolve(config, 4 << 10, 4, host, shared_slot=slot)[1].shared
    assert resolve(config, 4 << 10, 4, host)[0] == "doubling"            # no window: the rules' messages
    assert resolve(config, 64 << 10, 4, host, shared_slot=slot)[0] == "mpi"
    # MPI has no float16: the table's MPI row gives way to the rules (the shared stage here)
    algorithm, params = resolve(config, 64 << 10, 2, host, shared_slot=slot, mpi_type=False)
    assert algorithm == "multicolor" and params.shared
    assert resolve(config, 64 << 10, 2, host, mpi_type=False)[0] in ("multicolor", "doubling")
    algorithm, params = resolve(config, 1 << 20, 4, host, shared_slot=slot)
    assert (algorithm, params.segment) == ("ring", (256 << 10) // 4)
    algorithm, params = resolve(config, 4 << 20, 4, host, shared_slot=slot)
    assert (algorithm, params.segment) == ("halving", (60 << 10) // 4)
    assert resolve(config, 8 << 20, 4, host, shared_slot=slot)[0] == "doubling"
    algorithm, params = resolve(config, 32 << 20, 4, host, shared_slot=slot)
    assert (algorithm, params.colors, params.segment, params.shared) == ("multicolor", 2, (1 << 20) // 4, False)
    # an explicit algorithm or knob is the user's, not the table's
    assert resolve(Config(algorithm="ring", tuning_file=str(path)), 64 << 10, 4, host)[0] == "ring"
    assert resolve(Config(colors=3, tuning_file=str(path)), 64 << 10, 4, host)[1].colors == 3
    # no row for this layout: the built-in rules
    flat4 = [[0], [1], [2], [3]]
    assert resolve(config, 64 << 10, 4, flat4) == resolve(Config(tuning_file="none"), 64 << 10, 4, flat4)


def test_the_rules_give_medium_calls_across_hosts_to_halving_fused_with_its_check_or_to_the_ring_where_it_folds():
    from mcallreduce.policy import FUSED_MAX_BYTES, fused_with_check
    rules = Config(tuning_file="none")
    flat4, pair, one_host = [[0], [1], [2], [3]], [[0], [1]], [[0, 1, 2, 3]]
    crossing = ([[0], [1], [2]], [[0], [1], [2], [3], [4]], [[0], [1, 2]])
    layouts = (flat4, [[0, 1], [2, 3]], [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 1], [2]], [[0, 1], [2, 3], [4, 5]],
               *crossing)
    for nbytes in ((16 << 10) + 4, 64 << 10, 128 << 10, FUSED_MAX_BYTES):
        for hosts in layouts:   # more than two ranks on more than one host, float16 too
            # the ring from 128 KiB where the fold crosses hosts (0 and 1 on two hosts), not where it stays on one
            folds = hosts in crossing
            for mpi_type in (True, False):
                algorithm, params = resolve(rules, nbytes, 4, hosts, mpi_type=mpi_type)
                if folds and nbytes >= 128 << 10:
                    assert algorithm == "ring" and params == resolve(Config(algorithm="ring"), nbytes, 4, hosts)[1]
                else:
                    assert algorithm == "halving" and fused_with_check(algorithm, nbytes), (nbytes, hosts, algorithm)
        # two ranks: one exchange up to 64 KiB, then halving's two; on one host, the stages
        assert resolve(rules, nbytes, 4, pair)[0] == ("doubling" if nbytes <= 64 << 10 else "halving")
        assert resolve(rules, nbytes, 4, one_host)[0] == "multicolor"
    assert resolve(rules, 256 << 10, 4, [[0, 1]], shared_slot=0)[0] == "doubling"   # a pair on one host, no stage
    assert resolve(rules, 16 << 10, 4, flat4)[0] == "doubling"
    assert resolve(rules, FUSED_MAX_BYTES + 4, 4, flat4)[0] == "multicolor"


def test_on_fast_links_the_rules_give_large_calls_across_hosts_longer_segments():
    from mcallreduce.policy import FAST_LINK_LARGE_BYTES, FAST_LINK_SEGMENT_BYTES
    rules = Config(tuning_file="none")
    eager = rules.inter_host_segment
    for hosts in ([[0], [1]], [[0], [1], [2]], [[0], [1], [2], [3]], [[0, 1], [2, 3], [4, 5], [6, 7]]):
        for nbytes, itemsize in ((FAST_LINK_LARGE_BYTES, 4), (32 << 20, 4), (64 << 20, 2)):
            slow = resolve(rules, nbytes, itemsize, hosts)
            fast = resolve(rules, nbytes, itemsize, hosts, fast_links=True)
            assert slow[1].segment * itemsize == eager - eager % itemsize, (hosts, nbytes, slow)
            assert fast[1].segment * itemsize == FAST_LINK_SEGMENT_BYTES, (hosts, nbytes, fast)
            assert fast[0] == slow[0] and fast[1].colors == slow[1].colors and fast[1].route == slow[1].route
        below = FAST_LINK_LARGE_BYTES - 4   # smaller calls keep the eager segments
        assert resolve(rules, below, 4, hosts, fast_links=True) == resolve(rules, below, 4, hosts)
    # one host has no links; a measured table and the user's own segment size decide for themselves
    one_host = [[0, 1, 2, 3]]
    assert resolve(rules, 32 << 20, 4, one_host, fast_links=True) == resolve(rules, 32 << 20, 4, one_host)
    mine = Config(tuning_file="none", segment_bytes=1 << 20)
    assert resolve(mine, 32 << 20, 4, [[0], [1]], fast_links=True)[1].segment == (1 << 20) // 4
    # trees carry data both ways on a connection, where eager segments avoid the clear-to-send's wait
    # (more than 8 hosts, or the route set): unmeasured with longer segments, so they stay eager
    for config, hosts in ((rules, [[h] for h in range(9)]), (Config(tuning_file="none", route="tree"), [[0], [1]])):
        assert resolve(config, 32 << 20, 4, hosts, fast_links=True)[1].segment * 4 == eager - eager % 4


def test_on_fast_links_large_calls_run_open_mpis_ring_where_it_exists():
    from mcallreduce.policy import FAST_LINK_LARGE_BYTES, FAST_LINK_MPI_RING_FROM_BYTES as low
    rules = Config(tuning_file="none")
    flat = ([[0], [1]], [[0], [1], [2]], [[0], [1], [2], [3]], [[h] for h in range(8)])
    for hosts in flat + ([[0, 1], [2, 3], [4, 5], [6, 7]],):
        several = len(hosts[0]) > 1   # the hierarchical schedule's segments from FAST_LINK_LARGE_BYTES
        for nbytes in (low, FAST_LINK_LARGE_BYTES - 4, FAST_LINK_LARGE_BYTES, 1 << 30):
            ring = resolve(rules, nbytes, 4, hosts, fast_links=True, mpi_ring=True)
            rest = resolve(rules, nbytes, 4, hosts, fast_links=True)
            assert rest[0] == "multicolor", rest
            assert ring == (rest if several and nbytes >= FAST_LINK_LARGE_BYTES else ("mpi-ring", Params())), \
                (hosts, nbytes, ring)
            # slow links, no Open MPI ring, a type MPI lacks, a nonblocking call (MPI's blocking call
            # would never run for it), no check (nor then): the rules
            fast = {"fast_links": True, "mpi_ring": True}
            assert resolve(rules, nbytes, 4, hosts, mpi_ring=True) == resolve(rules, nbytes, 4, hosts)
            for config, kwargs in ((rules, {**fast, "mpi_type": False}), (rules, {**fast, "nonblocking": True}),
                                   (Config(tuning_file="none", check=False), fast)):
                assert resolve(config, nbytes, 4, hosts, **kwargs) == rest, (hosts, nbytes, kwargs)
        assert resolve(rules, low - 4, 4, hosts, fast_links=True, mpi_ring=True) == resolve(rules, low - 4, 4, hosts)
    # one host has no links; more than 8 hosts are unmeasured; a user's knob, or another algorithm, is followed
    for hosts in ([[0, 1, 2, 3]], [[h] for h in range(9)]):
        assert resolve(rules, low, 4, hosts, fast_links=True, mpi_ring=True)[0] == "multicolor"
    assert resolve(Config(tuning_file="none", segment_bytes=1 << 20), low, 4, [[0], [1], [2]],
                   fast_links=True, mpi_ring=True)[0] == "multicolor"
    assert resolve(Config(tuning_file="none", algorithm="ring"), low, 4, [[0], [1], [2]],
                   fast_links=True, mpi_ring=True)[0] == "ring"


def test_a_table_row_naming_open_mpis_ring_runs_it_where_it_exists(tmp_path):
    rows = [{"size_bytes": 64 << 10, "algorithm": "doubling"},
            {"size_bytes": 32 << 20, "algorithm": "mpi-ring"}]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"measured": True, "tables": {"2h1r": rows}}))
    config = Config(tuning_file=str(path))
    hosts = [[0], [1]]
    assert resolve(config, 8 << 20, 4, hosts, mpi_ring=True)[0] == "mpi-ring"
    assert resolve(config, 8 << 20, 4, hosts, mpi_ring=False)[0] == "mpi"   # not forced here: MPI's default
    assert resolve(config, 8 << 20, 2, hosts, mpi_type=False, mpi_ring=True)[0] not in ("mpi", "mpi-ring")
    assert resolve(config, 64 << 10, 4, hosts, mpi_ring=True)[0] == "doubling"
    # asked for by name: the same fallback
    assert resolve(Config(algorithm="mpi-ring"), 1 << 20, 4, hosts, mpi_ring=True)[0] == "mpi-ring"
    assert resolve(Config(algorithm="mpi-ring"), 1 << 20, 4, hosts, mpi_ring=False)[0] == "mpi"


def test_the_tuner_times_open_mpis_ring_only_where_it_runs_as_itself():
    from mcallreduce.bench.tune_measure import candidates
    assert "mpi-ring" in [name for name, _, _ in candidates(True)]
    assert "mpi-ring" not in [name for name, _, _ in candidates(False)]


def test_none_switches_every_table_off_and_the_builtin_table_is_measured():
    rules = resolve(Config(tuning_file="none"), 1 << 20, 4, [[0, 1]])
    assert rules[0] == "multicolor"
    table = json.loads(open(BUILTIN_TABLE).read())
    assert table["measured"] is True and "1h2r" in table["tables"]
    assert {r["algorithm"] for r in table["tables"]["1h2r"]} <= {"multicolor", "ring", "doubling", "halving", "mpi", "mpi-ring"}


def test_a_measured_table_keeps_the_builtin_choice_within_the_margin():
    from mcallreduce.bench.tune_measure import choose
    times = {"multicolor": 102e-6, "ring": 100e-6, "mpi": 120e-6}
    assert choose(times, margin=0.03) == "multicolor"    # 2 % slower: noise, not a reason to switch
    assert choose(times, margin=0.01) == "ring"
    assert choose({"multicolor": 2e-3, "ring": 1.3e-3, "mpi": 1.7e-3}, margin=0.03) == "ring"


def test_the_tuner_ranks_candidates_by_their_typical_call_not_their_luckiest_pass():
    import numpy as np
    from mcallreduce.bench.tune_measure import CANDIDATES, choose, typical_times
    # "scattered" has one quick pass and two slow ones; "steady" is the same in every pass
    passes = [np.array([[1.0, 3.0]] * 5), np.array([[5.0, 3.0]] * 5), np.array([[5.0, 3.1]] * 5)]
    times = typical_times(passes, ["scattered", "steady"])
    assert times == {"scattered": 5.0, "steady": 3.0}
    assert choose({"multicolor": 9.0, **times}, margin=0.03) == "steady"
    # halving, Open MPI's own choice on 4 ranks at medium sizes, is timed whole and in 256 KiB segments
    segments = {(algorithm, overrides.get("segment_bytes")) for _, algorithm, overrides in CANDIDATES}
    assert {("halving", 0), ("halving", 256 << 10)} <= segments


def test_nonblocking_calls_follow_the_rows_measured_with_them(tmp_path):
    from mcallreduce.policy import measured_nonblocking
    blocking = [{"size_bytes": 1 << 20, "algorithm": "halving", "segment_bytes": 60 << 10},
                {"size_bytes": 8 << 20, "algorithm": "mpi"}]
    nonblocking = [{"size_bytes": 1 << 20, "algorithm": "mpi"},
                   {"size_bytes": 8 << 20, "algorithm": "ring", "segment_bytes": 256 << 10}]
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"measured": True, "tables": {"4h1r": blocking},
                                "nonblocking_tables": {"4h1r": nonblocking}}))
    only_blocking = tmp_path / "blocking.json"
    only_blocking.write_text(json.dumps({"measured": True, "tables": {"4h1r": blocking}}))
    hosts = [[0], [1], [2], [3]]
    config = Config(tuning_file=str(both))
    assert resolve(config, 1 << 20, 4, hosts)[0] == "halving"
    assert resolve(config, 1 << 20, 4, hosts, nonblocking=True)[0] == "mpi"
    assert resolve(config, 8 << 20, 4, hosts)[0] == "mpi"
    algorithm, params = resolve(config, 8 << 20, 4, hosts, nonblocking=True)
    assert (algorithm, params.segment) == ("ring", (256 << 10) // 4)
    assert measured_nonblocking(config, hosts)
    # a table without nonblocking rows decides both kinds of call with its blocking ones
    config = Config(tuning_file=str(only_blocking))
    assert resolve(config, 1 << 20, 4, hosts, nonblocking=True)[0] == "halving"
    assert resolve(config, 8 << 20, 4, hosts, nonblocking=True)[0] == "mpi"
    assert not measured_nonblocking(config, hosts)
    # another layout, a named algorithm, or no table: the rows do not apply
    assert not measured_nonblocking(Config(tuning_file=str(both)), [[0, 1]])
    assert not measured_nonblocking(Config(algorithm="ring", tuning_file=str(both)), hosts)
    assert not measured_nonblocking(Config(tuning_file="none"), hosts)


def test_progress_thread_on_auto_only_where_the_host_has_a_core_to_spare():
    from mcallreduce.cgroups import usable_cores
    from mcallreduce.policy import progress_thread
    cores = int(usable_cores())
    full, spare = [list(range(cores))], [list(range(cores - 1)) or [0]]   # one host: as many ranks as cores, or one fewer
    assert progress_thread(full, {}) is False and progress_thread(spare, {}) is (cores > 1)
    assert progress_thread(full + spare, {}) is False   # the most crowded host decides
    assert progress_thread(full, {"MCALLREDUCE_PROGRESS_THREAD": "1"}) is True
    assert progress_thread([[0]], {"MCALLREDUCE_PROGRESS_THREAD": "0"}) is False
    # a host's usable cores, not the machine's: a quota of half a core leaves none to spare for one rank
    assert progress_thread([[0]], {}, cores=0.5) is False and progress_thread([[0]], {}, cores=1.5) is True


def test_usable_cores_take_the_tightest_quota_up_the_cgroup_tree(tmp_path, monkeypatch):
    import os
    from mcallreduce import cgroups
    for version, files in ((2, {"a/cpu.max": "150000 100000", "a/b/cpu.max": "max 100000", "a/b/c/cpu.max": "max 100000"}),
                           (1, {"a/cpu.cfs_quota_us": "50000", "a/cpu.cfs_period_us": "100000",
                                "a/b/cpu.cfs_quota_us": "-1", "a/b/cpu.cfs_period_us": "100000"})):
        root = tmp_path / f"v{version}"
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text + "\n")
        leaf = "/a/b/c" if version == 2 else "/a/b"
        monkeypatch.setattr(cgroups, "cpu_hierarchy", lambda root=root, v=version: cgroups.Hierarchy("cpu", v, str(root), "cpu"))
        monkeypatch.setattr(cgroups, "own_cgroup", lambda controller, leaf=leaf: leaf)
        want = 1.5 if version == 2 else 0.5
        assert cgroups.cpu_quota_cores() == want
        assert cgroups.usable_cores() == min(want, len(os.sched_getaffinity(0)))
    monkeypatch.setattr(cgroups, "cpu_hierarchy", lambda: None)   # no cpu controller: the affinity alone
    assert cgroups.cpu_quota_cores() is None and cgroups.usable_cores() == len(os.sched_getaffinity(0))


def test_a_call_mpi_cannot_serve_takes_the_rows_fastest_other_candidate(tmp_path):
    from mcallreduce.bench.tune_measure import choose_ours
    instead = {"algorithm": "multicolor", "colors": 1, "segment_bytes": 1 << 20, "hierarchical": True,
               "route": "ring", "shared": False}
    rows = [{"size_bytes": 1 << 20, "algorithm": "mpi", "instead": {"algorithm": "halving", "segment_bytes": 0}},
            {"size_bytes": 8 << 20, "algorithm": "mpi-ring", "instead": instead},
            {"size_bytes": 32 << 20, "algorithm": "mpi"}]                     # a table from before "instead"
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"measured": True, "tables": {"4h1r": rows}}))
    config, hosts = Config(tuning_file=str(path)), [[0], [1], [2], [3]]
    assert resolve(config, 1 << 20, 4, hosts)[0] == "mpi"                    # float32, blocking: the row's pick
    assert resolve(config, 1 << 20, 2, hosts, mpi_type=False) == ("halving", resolve(
        Config(algorithm="halving", segment_bytes=0), 1 << 20, 2, hosts)[1])   # float16: the row's "instead"
    algorithm, params = resolve(config, 8 << 20, 2, hosts, mpi_type=False)
    assert (algorithm, params.colors, params.segment, params.route) == ("multicolor", 1, (1 << 20) // 2, "ring")
    # without "instead", the built-in rules, as before rows had it
    rules = Config(tuning_file="none")
    assert resolve(config, 32 << 20, 2, hosts, mpi_type=False) == resolve(rules, 32 << 20, 2, hosts)
    # the tuner names as "instead" the fastest of our own candidates, with the same margin for the built-in one
    times = {"multicolor": 2.0, "multicolor-1M": 1.5, "ring": 1.6, "mpi": 1.0, "mpi-ring": 1.1}
    assert choose_ours(times, margin=0.03) == "multicolor-1M"
    assert choose_ours({**times, "multicolor": 1.52}, margin=0.03) == "multicolor"
    # on fast links the built-in choice may have run as MPI's own call: then it is not ours
    ran = {"multicolor": "mpi-ring", "multicolor-1M": "multicolor", "ring": "ring", "mpi": "mpi",
           "mpi-ring": "mpi-ring"}
    assert choose_ours({**times, "multicolor": 1.05}, margin=0.03, ran=ran) == "multicolor-1M"


@pytest.mark.parametrize("text, says", [('{"tables": {"1h2r": [', "not JSON"), ("[]", "not a JSON object"),
                                        ('{"a": 1}', 'neither "tables"'),
                                        ('{"tables": {"1h2r": [{"algorithm": "ring"}]}}', "size_bytes"),
                                        ('{"tables": {"1h2r": [{"size_bytes": 4096, "algorithm": "bogus"}]}}', "bogus"),
                                        ('{"tables": {"1h2r": [{"size_bytes": 4096, "algorithm": "mpi", '
                                         '"instead": {"algorithm": "nope"}}]}}', "nope"),
                                        ('{"tables": {"1h2r": [{"size_bytes": 4096, "colors": "2"}]}}', "colors"),
                                        ('{"tables": {"1h2r": [{"size_bytes": 4096, "colors": 0}]}}', "colors"),
                                        ('{"tables": {"1h2r": [{"size_bytes": 4096, "segment_bytes": 1.5}]}}',
                                         "segment_bytes"),
                                        ('{"tables": {"1h2r": [{"size_bytes": 4096, "hierarchical": 1}]}}',
                                         "hierarchical"),
                                        ('{"tables": {"1h2r": [{"size_bytes": 4096, "route": "star"}]}}', "route"),
                                        ('{"tables": {"1h2r": [{"size_bytes": 4096, "algorithm": "mpi", '
                                         '"instead": {"algorithm": "mpi-ring"}}]}}', "instead that names MPI"),
                                        # once followed as multicolor, shadowed, read as 1, or never matched
                                        ('{"tables": {"1h2r": [{"size_bytes": 4096, "algoritm": "ring"}]}}',
                                         "unknown keys algoritm"),
                                        ('{"tables": {"1h2r": [{"size_bytes": 4096, "algorithm": "mpi", '
                                         '"instead": {"algorithm": "ring", "size_bytes": 1}}]}}', "unknown keys size"),
                                        ('{"tables": {"1h2r": [{"size_bytes": 4096}, {"size_bytes": 4096}]}}',
                                         "no other row has"),
                                        ('{"tables": {"1h2r": [{"size_bytes": true}]}}', "size_bytes of 0 or more"),
                                        ('{"tables": {"1h2r": [{"size_bytes": -5}]}}', "size_bytes of 0 or more"),
                                        ('{"tables": {"1H2R": [{"size_bytes": 4096}]}}', "is not a layout")])
def test_a_table_that_would_be_misread_raises_naming_its_file(tmp_path, text, says):
    # it was once followed in part, or ignored for the rules, or failed with a bare KeyError
    path = tmp_path / "table.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=says) as error:
        resolve(Config(tuning_file=str(path)), 4096, 4, [[0, 1]])
    assert str(path) in str(error.value)


def test_a_table_that_goes_away_after_start_raises_instead_of_leaving_the_rank_to_the_rules(tmp_path, monkeypatch):
    # a relative name follows the file, not the working directory; a missing file is an error on
    # this rank, where its peers would follow the table (and the ranks' calls would not match)
    table = tmp_path / "table.json"
    table.write_text('{"tables": {"2h1r": [{"size_bytes": 1048576, "algorithm": "ring"}]}}')
    monkeypatch.chdir(tmp_path)
    config = Config.from_env({"MCALLREDUCE_TUNING_FILE": "table.json"})
    monkeypatch.chdir("/")
    assert resolve(config, 4096, 4, [[0], [1]])[0] == "ring" and table_problem(config) is None
    table.unlink()
    assert "cannot be read" in table_problem(config)
    with pytest.raises(ConfigError, match="cannot be read"):
        resolve(config, 4096, 4, [[0], [1]])


def test_a_row_measured_with_the_one_host_stage_gives_way_to_the_rules_where_the_stage_is_off():
    # MCALLREDUCE_SHM_BYTES=0: the built-in table's shared rows once ran multicolor's message trees
    for nbytes, rules in ((4096, "doubling"), (64 << 10, "doubling"), (1 << 20, "multicolor")):
        algorithm, params = resolve(Config(shm_bytes=0), nbytes, 4, [[0, 1]], shared_slot=1 << 20)
        assert (algorithm, params.shared) == (rules, False), nbytes
        assert algorithm == resolve(Config(shm_bytes=0, tuning_file="none"), nbytes, 4, [[0, 1]], shared_slot=1 << 20)[0]
