"""Exhaustive in-process tests of the schedules the MPI runtime executes."""
import numpy as np
import pytest

from mcallreduce.algorithms import Params, build_multicolor, build_ring, build_schedule
from mcallreduce.algorithms.trees import color_trees
from mcallreduce.inprocess import DeadlockError, execute
from mcallreduce.lowering import BROADCASTING, COLUMNS, REDUCING, early_steps, lower, phases, with_done_messages
from mcallreduce.schedule import Builder, Op, Schedule, RankProgram, Step, check_schedule

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]


def flat(p):
    return [[r] for r in range(p)]


def paired(p):
    return [list(range(s, min(s + 2, p))) for s in range(0, p, 2)]


def lengths(p):
    return sorted({0, 1, max(p - 1, 0), 13, 97})


def reference_run(schedule, p, n, dtype, seed):
    rng = np.random.default_rng(seed)
    bufs = [rng.integers(-8, 9, size=n).astype(dtype) for _ in range(p)]
    expected = np.sum(np.stack(bufs).astype(np.float64), axis=0).astype(dtype) if n else np.zeros(0, dtype)
    execute(schedule, bufs)
    return bufs, expected


def sweep(p):
    """(name, hosts, n, params) of every schedule the exhaustive tests cover on p ranks."""
    layouts = [flat(p)] + ([paired(p)] if p > 1 else [])
    for hosts in layouts:
        for n in lengths(p):
            variants = [(name, Params(segment=s)) for name in ("ring", "doubling", "halving") for s in (0, 5)]
            hier = (True, False) if len(hosts) < p else (True,)  # flat layout: same schedule
            variants += [("multicolor", Params(colors=k, segment=s, hierarchical=h, route=route))
                         for k in (1, 2, 3, 4) for s in (0, 3) for h in hier for route in ("tree", "ring")]
            for name, params in variants:
                yield name, hosts, n, params


_SWEPT = {}


def swept(p, last_use=False):
    """(name, hosts, n, params, schedule) for sweep(p), built once for the two exhaustive tests
    (build_schedule's cache holds 256, sized for a job's few calls, not for a sweep's 300)."""
    if p not in _SWEPT:
        _SWEPT[p] = [(*case, build_schedule(*case)) for case in sweep(p)]
    return _SWEPT.pop(p) if last_use else _SWEPT[p]


@pytest.mark.parametrize("p", range(1, 18))
def test_every_algorithm_sums_every_length(p):
    for name, hosts, n, params, sched in swept(p):
        assert check_schedule(sched) is None
        bufs, expected = reference_run(sched, p, n, np.int64, seed=p * 7919 + n)
        for r, b in enumerate(bufs):
            assert np.array_equal(b, expected), (name, params, hosts, n, r)


def assert_early_steps_pair_up(sched, case, max_count):
    """What posting before the check rests on (native/early.c): early steps are sends from the
    buffer and receives into scratch of at most ``max_count`` elements that wait for nothing, and
    from every rank to every peer the early sends and the peer's early receives are the same
    messages in the same order."""
    early = [early_steps(sched, r, max_count) for r in range(sched.nranks)]
    for a, prog in enumerate(sched.programs):
        for i in early[a]:
            s = prog.steps[i]
            assert s.op in (Op.SEND, Op.RECV_SCRATCH) and not s.deps and 0 < s.count <= max_count, (case, a, i)
        for b in range(sched.nranks):
            sends = [prog.steps[i] for i in sorted(early[a]) if prog.steps[i].op == Op.SEND and prog.steps[i].peer == b]
            recvs = [sched.programs[b].steps[i] for i in sorted(early[b])
                     if sched.programs[b].steps[i].op == Op.RECV_SCRATCH and sched.programs[b].steps[i].peer == a]
            assert [(s.tag, s.count) for s in sends] == [(r.tag, r.count) for r in recvs], (case, a, b)
            assert [s.tag for s in sends] == sorted(s.tag for s in sends), (case, a, b)
    name, hosts, n, params = case
    if name in ("ring", "halving") and sched.nranks > 1 and n >= sched.nranks and max_count >= n:
        assert any(early), case   # their first round travels early
    return early


def test_the_executor_reads_the_columns_lowering_writes():
    executor = pytest.importorskip("mcallreduce._executor", reason="the compiled executor is not built")
    assert executor.LOWERED_COLUMNS == len(COLUMNS)


@pytest.mark.parametrize("p", range(1, 18))
def test_lowered_arrays_are_the_schedule_its_done_messages_and_its_early_steps(p):
    # what the compiled executor runs is, row by row, the schedule the in-process executor plays,
    # then the done messages; with them the schedule still checks and sums
    for name, hosts, n, params, sched in swept(p, last_use=True):
        assert_early_steps_pair_up(sched, (name, hosts, n, params), max_count=4)   # some too big to go early
        early = assert_early_steps_pair_up(sched, (name, hosts, n, params), max_count=max(n, 1))
        done_tag = sched.max_tag + 1
        programs = [with_done_messages(prog, done_tag) for prog in sched.programs]
        for prog, full in zip(sched.programs, programs):
            assert full.steps[:len(prog.steps)] == prog.steps
            extra = full.steps[len(prog.steps):]
            sent_to = {s.peer for s in prog.steps if s.op == Op.SEND}
            received_from = {s.peer for s in prog.steps if s.op in (Op.RECV, Op.RECV_SCRATCH)}
            assert sorted(s.peer for s in extra if s.op == Op.SEND) == sorted(sent_to)
            assert sorted(s.peer for s in extra if s.op == Op.RECV) == sorted(received_from)
            for s in extra:
                assert s.count == 0 and s.tag == done_tag
                if s.op == Op.SEND:   # after every data send to that peer
                    assert set(s.deps) == {i for i, t in enumerate(prog.steps) if t.op == Op.SEND and t.peer == s.peer}
            low = lower(prog, done_tag, early[prog.rank])
            assert low.steps.dtype == np.int64 and low.steps.shape == (len(full.steps), len(COLUMNS))
            assert low.scratch_elems == prog.scratch_elems
            phase = phases(prog) + [REDUCING] * len(extra)
            # what the timeline's per-color phases rest on: final values arrive by receives into
            # the buffer and are never reduced again; partial ones travel to scratch
            for i, step in enumerate(prog.steps):
                if step.op == Op.RECV:
                    assert phase[i] == BROADCASTING, (name, params, hosts, n, i)
                elif step.op in (Op.REDUCE, Op.RECV_SCRATCH):
                    assert phase[i] == REDUCING, (name, params, hosts, n, i)
                if phase[i] == REDUCING:
                    assert all(phase[d] == REDUCING for d in step.deps), (name, params, hosts, n, i)
            for i, (row, step) in enumerate(zip(low.steps.tolist(), full.steps)):
                color = step.color if i < len(prog.steps) else -1   # a done message has none
                assert row == [int(step.op), step.peer, step.offset, step.count, step.scratch, step.tag,
                               len(step.deps), int(step.incoming_left), color, phase[i],
                               int(i in early[prog.rank])], (name, params, hosts, n, i)
                deps = low.dependents[low.dep_ptr[i]:low.dep_ptr[i + 1]].tolist()
                assert deps == full.dependents[i], (name, params, hosts, n, i)
            assert low.dep_ptr[-1] == len(low.dependents) == sum(len(s.deps) for s in full.steps)
        augmented = Schedule(sched.algorithm, sched.nranks, sched.nelem, programs, sched.params)
        assert check_schedule(augmented) is None
        bufs, expected = reference_run(augmented, p, n, np.int64, seed=p)
        assert all(np.array_equal(b, expected) for b in bufs), (name, params, hosts, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,route", [("multicolor", "tree"), ("multicolor", "ring"), ("doubling", "tree"),
                                        ("halving", "tree")])
def test_all_dtypes_bitwise_identical_on_every_rank(dtype, name, route):
    p, n = 6, 1001
    sched = build_schedule(name, paired(p), n, Params(colors=3, segment=64, route=route))
    rng = np.random.default_rng(1)
    bufs = [(rng.standard_normal(n) * 4).astype(dtype) for _ in range(p)]
    exact = np.sum(np.stack([b.astype(np.float64) for b in bufs]), axis=0)
    execute(sched, bufs)
    for b in bufs[1:]:
        assert b.tobytes() == bufs[0].tobytes()
    tol = 0.05 if dtype == np.float16 else 1e-4
    assert np.allclose(bufs[0].astype(np.float64), exact, rtol=tol, atol=tol)
    # and the reduction order is fixed: a second run gives the same bits
    rng = np.random.default_rng(1)
    again = [(rng.standard_normal(n) * 4).astype(dtype) for _ in range(p)]
    execute(sched, again)
    assert again[0].tobytes() == bufs[0].tobytes()


@pytest.mark.parametrize("p", [2, 3, 4, 7])
@pytest.mark.parametrize("ufunc", [np.minimum, np.maximum, np.add])
def test_doubling_orders_operands_by_rank(p, ufunc):
    # Two ranks compute every value of a doubling schedule, so operand order must not
    # depend on who computes it: min/max of +0/-0 and NaN payloads are order-sensitive.
    n = 8
    nan_a = np.array([0x7FF8000000000001], dtype=np.int64).view(np.float64)[0]
    nan_b = np.array([0x7FF8000000000002], dtype=np.int64).view(np.float64)[0]
    bufs = []
    for r in range(p):
        b = np.full(n, (0.0 if r % 2 else -0.0))
        b[1] = (nan_a if r % 2 else nan_b)
        b[2] = float(r)
        bufs.append(b)
    ref = [x.copy() for x in bufs]
    expected = ref[0]
    for x in ref[1:]:
        expected = ufunc(expected, x)       # one fixed left-to-right order
    execute(build_schedule("doubling", flat(p), n, Params()), bufs, reduce=ufunc)
    for b in bufs:
        assert b.tobytes() == bufs[0].tobytes()
    assert bufs[0][2] == expected[2]


def test_doubling_sends_whole_buffer_log2_p_times():
    n = 1000
    for p, rounds in [(2, 1), (4, 2), (8, 3)]:
        sched = build_schedule("doubling", flat(p), n, Params())
        for r in range(p):
            assert sched.bytes_sent(r, 4) == rounds * n * 4
    # a non-power of two folds: rank 1 sends once to rank 0 and receives the result
    sched = build_schedule("doubling", flat(3), n, Params())
    assert sched.bytes_sent(1, 4) == n * 4 and sched.bytes_sent(0, 4) == 2 * n * 4


def test_halving_sends_a_rings_bytes_in_2_log2_p_rounds():
    n = 1024
    for p in (2, 4, 8, 16):
        sched = build_schedule("halving", flat(p), n, Params())
        for r in range(p):
            assert sched.bytes_sent(r, 4) == 2 * (p - 1) * (n // p) * 4
            assert len({s.peer for s in sched.programs[r].steps if s.op == Op.SEND}) == p.bit_length() - 1
    # a non-power of two folds first: rank 1 of 3 sends its buffer once and receives the result
    sched = build_schedule("halving", flat(3), n, Params())
    assert sched.bytes_sent(1, 4) == n * 4


def test_halving_keeps_its_largest_exchange_on_the_host():
    # lowest bit first, as Open MPI and the executor's fused call pair the ranks: with two ranks
    # per host only a quarter of the buffer each way crosses a host, not a half
    n = 1024
    hosts = [[0, 1], [2, 3], [4, 5], [6, 7]]
    sched = build_schedule("halving", hosts, n, Params())
    host_of = {r: h for h, ranks in enumerate(hosts) for r in ranks}
    for r in range(8):
        sent = {"across": 0, "local": 0}
        for s in sched.programs[r].steps:
            if s.op == Op.SEND:
                sent["local" if host_of[s.peer] == host_of[r] else "across"] += s.count
        assert sent == {"across": 2 * (n // 4 + n // 8), "local": 2 * (n // 2)}, r


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("ufunc", [np.minimum, np.maximum])
def test_halving_is_bitwise_the_same_on_every_rank(p, ufunc):
    # each part of the result is reduced by one rank and copied: min/max of +0/-0 agree everywhere
    n = 24
    bufs = [np.full(n, (0.0 if r % 2 else -0.0)) for r in range(p)]
    execute(build_schedule("halving", flat(p), n, Params()), bufs, reduce=ufunc)
    for b in bufs:
        assert b.tobytes() == bufs[0].tobytes()


def test_float_result_close_to_exact_sum():
    p, n = 9, 4099
    rng = np.random.default_rng(3)
    src = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    exact = np.sum(np.stack(src).astype(np.float64), axis=0)
    for name, params in [("ring", Params(segment=100)), ("multicolor", Params(colors=4, segment=100))]:
        bufs = [s.copy() for s in src]
        execute(build_schedule(name, flat(p), n, params), bufs)
        assert np.allclose(bufs[0], exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", range(1, 18))
@pytest.mark.parametrize("k", range(1, 5))
def test_trees_span_and_each_node_is_interior_at_most_once(n, k):
    trees = color_trees(n, k)
    assert len(trees) == min(k, n)
    interior = [0] * n
    for c, t in enumerate(trees):
        # spanning: every node reaches the root, exactly one root
        assert [v for v in range(n) if t.parent[v] < 0] == [t.root]
        assert sorted(t.postorder()) == list(range(n))
        for v in t.interior:
            interior[v] += 1
        # depth is logarithmic in n: fan-out >= 2
        assert t.depth() <= max(1, int(np.ceil(np.log2(n)))) + 1
    assert max(interior) <= 1 or n == 1
    # distinct roots, one per color
    assert len({t.root for t in trees}) == len(trees)


def test_two_trees_complement_like_nccl_double_binary_tree():
    for n in range(3, 18):
        a, b = color_trees(n, 2)
        assert not set(a.interior) & set(b.interior)
        assert a.root != b.root


def test_star_when_one_color_per_node_is_direct_reduce_scatter():
    for n in range(2, 9):
        for c, t in enumerate(color_trees(n, n)):
            assert t.root == c and t.interior == [c] and t.depth() == 1


def test_bytes_sent_per_rank_near_ring():
    # the structural claim behind "ring-equal bandwidth": no rank sends more than
    # (k + f)/k * n with f = k children per interior node, i.e. 2n
    p, n = 16, 1 << 14
    sched = build_schedule("multicolor", flat(p), n, Params(colors=4, segment=256))
    ring = build_schedule("ring", flat(p), n, Params(segment=256))
    worst = max(sched.bytes_sent(r, 1) for r in range(p))
    assert worst <= 2 * n
    assert max(ring.bytes_sent(r, 1) for r in range(p)) == pytest.approx(2 * (p - 1) / p * n, rel=0.01)


def test_hierarchical_sends_fewer_bytes_across_hosts_than_flat():
    hosts = [[0, 1], [2, 3], [4, 5], [6, 7]]
    n = 1 << 12

    def cross(sched):
        host_of = {r: h for h, rs in enumerate(hosts) for r in rs}
        return sum(s.count for prog in sched.programs for s in prog.steps
                   if s.op == Op.SEND and host_of[s.peer] != host_of[prog.rank])
    hier = build_multicolor(hosts, n, colors=4, segment=128, hierarchical=True)
    flat_sched = build_multicolor(hosts, n, colors=4, segment=128, hierarchical=False)
    assert cross(hier) < cross(flat_sched)


def test_ring_route_sends_each_hosts_share_one_way_to_one_neighbour():
    # the property that made the route faster on shaped links: every host's inter-host bytes
    # are 2(N-1)/N of the message (the bound), all to the next host, none back
    hosts = [[0, 1], [2, 3], [4, 5], [6, 7]]
    N, n = len(hosts), 1 << 14
    host_of = {r: h for h, rs in enumerate(hosts) for r in rs}
    sched = build_multicolor(hosts, n, colors=2, segment=256, route="ring")
    out = {}
    for prog in sched.programs:
        for step in prog.steps:
            if step.op == Op.SEND and host_of[step.peer] != host_of[prog.rank]:
                key = (host_of[prog.rank], host_of[step.peer])
                out[key] = out.get(key, 0) + step.count
    assert sorted(out) == [(h, (h + 1) % N) for h in range(N)]
    assert all(v == pytest.approx(2 * (N - 1) / N * n, rel=0.01) for v in out.values())
    # one ring per local rank: both local ranks of a host send across hosts
    senders = {prog.rank for prog in sched.programs for st in prog.steps
               if st.op == Op.SEND and host_of[st.peer] != host_of[prog.rank]}
    assert senders == set(range(8))
    with pytest.raises(ValueError, match="route"):
        build_multicolor(hosts, n, colors=2, route="star")


def test_ring_route_of_one_color_pipelines_as_deep_as_the_flat_ring():
    # one rank per host and one color: the route is the flat ring, and every chunk keeps
    # depth scratch slots of its own, so the same segments are in flight (same dependencies)
    for p, n, seg in ((4, 1 << 14, 256), (5, 1000, 64), (8, 4096, 0)):
        ring = build_schedule("ring", flat(p), n, Params(segment=seg, depth=2))
        routed = build_multicolor(flat(p), n, colors=1, segment=seg, route="ring", depth=2)
        for a, b in zip(ring.programs, routed.programs):
            assert [(s.op, s.peer, s.offset, s.count, s.scratch, s.tag, s.deps) for s in a.steps] == \
                   [(s.op, s.peer, s.offset, s.count, s.scratch, s.tag, s.deps) for s in b.steps]
            assert a.scratch_elems == b.scratch_elems


def test_pipelining_bounds_scratch_memory():
    sched = build_schedule("multicolor", flat(4), 1 << 16, Params(colors=2, segment=1024, depth=4))
    for prog in sched.programs:
        # at most depth slots of one segment per (sender, color)
        assert prog.scratch_elems <= 4 * 1024 * 3 * 2


def test_an_unsegmented_schedule_holds_one_slot_per_receive():
    # halving on 4 ranks receives half, then a quarter of the buffer to reduce: a slot each,
    # not depth of them (the executor allocates the whole scratch area on every call)
    n = 1 << 20
    sched = build_schedule("halving", flat(4), n, Params(segment=0, depth=4))
    assert [prog.scratch_elems for prog in sched.programs] == [n // 2 + n // 4] * 4


def test_deadlock_is_detected():
    # two ranks that each wait to receive before sending: a real deadlock under MPI
    recv_first = [Step(Op.RECV, 1, 0, 1, -1, 0), Step(Op.SEND, 1, 0, 1, -1, 0, deps=(0,))]
    other = [Step(Op.RECV, 0, 0, 1, -1, 0), Step(Op.SEND, 0, 0, 1, -1, 0, deps=(0,))]
    bad = Schedule("bad", 2, 1, [RankProgram(0, recv_first, 0), RankProgram(1, other, 0)])
    with pytest.raises(DeadlockError):
        execute(bad, [np.zeros(1), np.zeros(1)])


def test_builder_derives_hazards():
    b = Builder(2, 4)
    b.transfer(0, 1, 0, 4, reduce=True)   # 1 adds 0's data
    b.transfer(1, 0, 0, 4, reduce=False)  # then sends the result back
    s = b.build("t")
    ops1 = [st.op for st in s.programs[1].steps]
    assert ops1 == [Op.RECV_SCRATCH, Op.REDUCE, Op.SEND]
    assert s.programs[1].steps[2].deps == (1,)      # send waits for the reduction
    assert s.programs[0].steps[1].deps == (0,)      # receive waits until the send left


def test_ring_reports_its_name_and_params():
    s = build_ring(flat(3), 10, segment=2)
    assert s.describe() == "ring(segment=2)"


@pytest.mark.parametrize("p", [2, 5, 16])
def test_large_prime_length_with_many_segments(p):
    n = 100_003
    for name, params in [("ring", Params(segment=4099)), ("multicolor", Params(colors=3, segment=4099))]:
        sched = build_schedule(name, paired(p), n, params)
        bufs, expected = reference_run(sched, p, n, np.int32, seed=p)
        for b in bufs:
            assert np.array_equal(b, expected), (name, p)


def test_layouts_and_parameters_that_name_no_allreduce_are_refused():
    # [[0, 0], [1]] once left rank 2 out of the sum; the others failed deep inside a builder
    for hosts in ([[0, 0], [1]], [[0], [2]], [], [[], [0, 1]]):
        with pytest.raises(ValueError, match="each rank once"):
            build_schedule("ring", hosts, 16, Params())
    for params in (Params(colors=0), Params(segment=-1), Params(depth=0), Params(fanout=1)):
        with pytest.raises(ValueError, match="no schedule"):
            build_schedule("multicolor", [[0], [1]], 16, params)
