"""Run under mpirun: every rank runs every case and prints PASS/FAIL lines.

    python -m mcallreduce.launch -np 3 -- python tests/mpi/allreduce_cases.py [--numpy-only] [case ...]

``--numpy-only`` leaves out the cases on torch tensors, for jobs about another setting: a
tensor is a numpy view before any stage sees it, and importing torch is most of a rank's start-up.
"""
import contextlib
import itertools
import sys
import traceback

import numpy as np
from mpi4py import MPI

import mcallreduce
from mcallreduce import ConfigError, MismatchError, config
from mcallreduce.algorithms.doubling import build_doubling
from mcallreduce.algorithms.halving import build_halving
from mcallreduce.inprocess import execute
from mcallreduce.policy import FUSED_MAX_BYTES
from mcallreduce.runtime import Context

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
ALGOS = ("multicolor", "ring", "mpi")
CASES = {}
PEERS = set()   # cases about ranks that disagree: at least 2 ranks
TORCH = set()   # cases on torch tensors


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def between_peers(fn):
    PEERS.add(fn.__name__)
    return fn


def on_torch_tensors(fn):
    TORCH.add(fn.__name__)
    return fn


def data(n, dtype, r=None):
    r = rank if r is None else r
    return ((np.arange(n) * 7 + 3 * r) % 23 - 11).astype(dtype)


def expected(n, dtype):
    if np.dtype(dtype).kind in "iub":   # numpy's own sum of the inputs: integers wrap, a bool's sum is or
        return np.add.reduce([data(n, dtype, r) for r in range(size)]).astype(dtype)
    return sum(data(n, np.float64, r) for r in range(size)).astype(dtype) if n else np.zeros(0, dtype)


def same_on_all_ranks(arr):
    digest = np.frombuffer(arr.tobytes(), np.uint8).astype(np.int64).sum() * 1000003 + arr.size
    return comm.allreduce(int(digest), op=MPI.MIN) == comm.allreduce(int(digest), op=MPI.MAX)


def raises(exc_type, fn):
    try:
        fn()
    except exc_type as exc:
        return str(exc)
    raise AssertionError(f"{exc_type.__name__} not raised")


@case
def sum_matches_mpi_allreduce_all_lengths():
    for algorithm in ("multicolor", "ring", "doubling", "halving"):
        # fused calls just under and at the fused limit, and just above it
        fused = FUSED_MAX_BYTES // 4
        for n in (0, 1, size - 1, size + 1, 17, 1000, fused - 84, fused, fused + 1, (1 << 18) + 3):
            for dtype in (np.float32, np.int64):
                x = data(n, dtype)
                ref = x.copy()
                comm.Allreduce(MPI.IN_PLACE, ref, op=MPI.SUM)
                mcallreduce.allreduce(x, algorithm=algorithm)
                assert np.array_equal(x, ref), (algorithm, n, dtype)


@case
def every_dtype_at_every_size_of_the_builtin_table():
    # the default (multicolor) follows the measured table, whose rows may name MPI's allreduce:
    # for a dtype MPI lacks (float16) the call must still run, on our own schedules
    from mcallreduce.policy import BUILTIN_TABLE
    import json
    sizes = {row["size_bytes"] for rows in json.load(open(BUILTIN_TABLE))["tables"].values() for row in rows}
    for nbytes in sorted(s for s in sizes if s <= (4 << 20)):
        for dtype in mcallreduce.DTYPES:
            dt = np.dtype(dtype)
            x = data(nbytes // dt.itemsize, dt)
            mcallreduce.allreduce(x)
            assert np.array_equal(x, expected(x.size, dt)), (nbytes, dt)


@case
def every_dtype_bitwise_identical_across_ranks_and_runs():
    rng = np.random.default_rng(rank)
    for dtype in mcallreduce.DTYPES:
        for algorithm in ("multicolor", "ring", "doubling", "halving"):
            src = (rng.standard_normal(300007) * 3).astype(dtype)
            a = src.copy()
            b = src.copy()
            mcallreduce.allreduce(a, algorithm=algorithm)
            mcallreduce.allreduce(b, algorithm=algorithm)
            assert a.tobytes() == b.tobytes(), (dtype, algorithm, "differs between runs")
            assert same_on_all_ranks(a), (dtype, algorithm, "differs between ranks")
            if np.dtype(dtype).kind in "iub":
                assert np.array_equal(a, np.add.reduce(comm.allgather(src)).astype(dtype)), (dtype, algorithm)
                continue
            exact = np.zeros(src.size)
            comm.Allreduce(src.astype(np.float64), exact)
            tol = 0.1 if dtype == "float16" else 1e-4
            assert np.allclose(a.astype(np.float64), exact, rtol=tol, atol=tol * size), dtype


@case
def fused_calls_reduce_in_the_order_of_their_schedules():
    # the executor's fused doubling and halving (native/check.c) must fold and pair the ranks as
    # the schedules the in-process executor and the cost model play; magnitudes from 1e-8 to 1e16
    # make float64 sums that any other order rounds differently (with 3 ranks, the fold decides)
    def values(r, n):
        rng = np.random.default_rng(100 + r)
        return rng.choice([-1.0, 1.0], n) * 10.0 ** rng.integers(-8, 17, n)
    for algorithm, build in (("doubling", build_doubling), ("halving", build_halving)):
        for n in (1, 7, 1000, FUSED_MAX_BYTES // 8):
            played = [values(r, n) for r in range(size)]
            execute(build([list(range(size))], n), played)
            x = values(rank, n)
            mcallreduce.allreduce(x, algorithm=algorithm)
            assert x.tobytes() == played[rank].tobytes(), (algorithm, n, int(np.sum(x != played[rank])))


@case
def float16_rounds_as_numpys_float16_arithmetic():
    # ranks 0 and 1 send every kind of float16 (subnormals, overflow, infinities, NaN); the rest
    # send each op's identity, so any order of the fold gives numpy's one result, bit for bit
    n = 100003   # not a multiple of any vector width
    bits = np.random.default_rng(7).integers(0, 1 << 16, (2, n), dtype=np.uint16)
    bits[bits == 0x8000] = 0   # -0 + +0 is +0: one sign for any order
    pair = bits.view(np.float16)
    identity = {"sum": 0.0, "product": 1.0, "min": np.inf, "max": -np.inf, "scaled": 0.0}
    numpy_op = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum}
    pre, post = 0.37, 1.9   # "scaled": Horovod's prescale and postscale, each rounded to float16 once

    def scaled(x, factor):
        return (x.astype(np.float32) * np.float32(factor)).astype(np.float16)

    for op in identity:
        with np.errstate(over="ignore", invalid="ignore"):
            want = (scaled(scaled(pair[0], pre) + scaled(pair[1], pre), post) if op == "scaled"
                    else numpy_op[op](pair[0], pair[1])).view(np.uint16)
        for algorithm in ("multicolor", "ring", "doubling", "halving"):
            x = pair[rank].copy() if rank < 2 else np.full(n, identity[op], np.float16)
            args = dict(op="sum", prescale=pre, postscale=post) if op == "scaled" else dict(op=op)
            got = mcallreduce.allreduce(x, algorithm=algorithm, **args).view(np.uint16)
            if size == 1:
                continue   # nothing to combine
            nan = np.isnan(want.view(np.float16))
            assert np.array_equal(np.isnan(got.view(np.float16)), nan), (op, algorithm)
            assert np.array_equal(got[~nan], want[~nan]), (op, algorithm, np.flatnonzero(got[~nan] != want[~nan])[:5])


@case
def large_pipelined_many_segments():
    x = data(3 * (1 << 20) + 5, np.float32)
    mcallreduce.allreduce(x, segment_bytes=64 << 10, colors=3)
    assert np.array_equal(x, expected(x.size, np.float32))


@case
def ops_average_and_scaling_follow_horovod():
    x = data(1001, np.float32)
    mcallreduce.allreduce(x, op="average", prescale=0.5, postscale=3.0)
    assert np.allclose(x, expected(1001, np.float64) * 0.5 * 3.0 / size, atol=1e-5)
    i = data(1001, np.int64)
    mcallreduce.allreduce(i, op="average")
    assert np.array_equal(i, (expected(1001, np.float64) / size).astype(np.int64))  # truncation, as Horovod
    # float16 has no MPI op: its reference is numpy's over every rank's input, exact for these values
    # at any rank count (products of 1s and 2s are powers of two: exact in float16, or inf in both)
    folds = {"min": (np.minimum, 3), "max": (np.maximum, 3), "product": (np.multiply, 2)}
    for op, (fold, values) in folds.items():
        for dtype, algorithm in [(np.int32, a) for a in ALGOS] + [(np.float16, "multicolor"), (np.float16, "ring")]:
            y = data(257, dtype) % values + 1
            ref = fold.reduce([data(257, np.float64, r) % values + 1 for r in range(size)]).astype(dtype)
            mcallreduce.allreduce(y, op=op, algorithm=algorithm)
            assert np.array_equal(y, ref), (op, dtype, algorithm)


@case
def small_integers_and_bool_reduce_as_numpy_and_never_in_mpis_call():
    # Open MPI's vectorised sums of 8- and 16-bit integers saturate; numpy's and ours wrap
    rng = np.random.default_rng(rank)
    folds = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}
    for dtype in ("int8", "uint8", "int16", "uint16", "bool"):
        for n in (1, 7, 1000, 70001):   # 70001: past the fused limit, segmented on every schedule
            if dtype == "bool":
                src = rng.integers(0, 2, n).astype(bool)
            else:
                info = np.iinfo(dtype)
                src = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
            inputs = comm.allgather(src)
            for op, fold in folds.items():
                want = fold.reduce(inputs).astype(dtype)
                for algorithm in ("multicolor", "ring", "doubling", "halving"):
                    got = src.copy()
                    mcallreduce.allreduce(got, op=op, algorithm=algorithm)
                    assert np.array_equal(got, want), (dtype, n, op, algorithm)
        msg = raises(TypeError, lambda: mcallreduce.allreduce(np.ones(200, dtype), algorithm="mpi"))
        assert dtype in msg and "float32, float64, int32, int64" in msg, msg
    for dtype in ("int8", "uint8", "int16"):   # average: summed, then scaled in float64 and truncated
        x = np.full(10, 6 * (rank + 1), dtype)
        mcallreduce.allreduce(x, op="average")
        assert (x == int(sum(6 * (q + 1) for q in range(size)) / size)).all(), (dtype, x)
    msg = raises(TypeError, lambda: mcallreduce.allreduce(np.ones(3, bool), op="average"))
    assert "bool" in msg, msg


@case
@on_torch_tensors
def torch_tensors_zero_copy_and_out_and_strided_ones_refused():
    import torch
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank
    ptr = t.data_ptr()
    res = mcallreduce.allreduce(t)
    assert res is t and t.data_ptr() == ptr
    ref = torch.arange(12, dtype=torch.float32).reshape(3, 4) * size + size * (size - 1) / 2
    assert torch.equal(t, ref)
    src = data(100, np.float64)
    out = np.empty_like(src)
    keep = src.copy()
    got = mcallreduce.allreduce(src, out=out)
    assert got is out and np.array_equal(src, keep) and np.array_equal(out, expected(100, np.float64))
    h = torch.ones(10, dtype=torch.float16, requires_grad=True)
    with torch.no_grad():
        mcallreduce.allreduce(h)
    assert torch.equal(h.detach(), torch.full((10,), float(size), dtype=torch.float16))
    msg = raises(ValueError, lambda: mcallreduce.allreduce(torch.ones(4, 4).t()))
    assert "contiguous" in msg


@case
def async_handles_waited_in_rank_dependent_order():
    bufs = [data(50000 + 1000 * i, np.float32) for i in range(5)]
    handles = [mcallreduce.allreduce_async(b, algorithm="multicolor" if i % 2 else "ring")
               for i, b in enumerate(bufs)]
    order = list(range(5)) if rank % 2 == 0 else list(reversed(range(5)))
    polled = handles[order[0]].test()   # may or may not be done; must not block
    assert polled in (True, False)
    for i in order:
        handles[i].wait()
    for b in bufs:
        assert np.array_equal(b, expected(b.size, np.float32))
    assert all(h.done for h in handles)


@case
@between_peers
def length_mismatch_raises_on_every_rank():
    n = 100 + (rank == size - 1)
    for algorithm in ALGOS + ("doubling",):   # doubling: reduced along its check (fused)
        buf = np.ones(n, np.float32)
        msg = raises(MismatchError, lambda: mcallreduce.allreduce(buf, algorithm=algorithm, prescale=2.0))
        assert "element count" in msg, msg
        assert np.all(buf == 1.0), "a failed allreduce must leave the buffer untouched"
    # the library is still usable afterwards
    x = data(10, np.float32)
    mcallreduce.allreduce(x)
    assert np.array_equal(x, expected(10, np.float32))


@case
@between_peers
def lengths_either_side_of_the_shared_memory_limit_raise_everywhere():
    # one rank within MCALLREDUCE_SHM_BYTES (shared memory), one above it (messages): both must
    # meet in the same metadata exchange and raise, not wait in two different protocols
    limit = config.current().shm_bytes // 4
    n = limit + 1000 if rank == size - 1 else max(limit - 1000, 1)
    buf = np.ones(n, np.float32)
    msg = raises(MismatchError, lambda: mcallreduce.allreduce(buf))
    assert "element count" in msg, msg
    assert np.all(buf == 1.0)
    handle = mcallreduce.allreduce_async(np.ones(n, np.float32))
    assert "element count" in raises(MismatchError, handle.wait)
    x = data(1000, np.float32)
    mcallreduce.allreduce(x)   # still usable
    assert np.array_equal(x, expected(1000, np.float32))


@case
@between_peers
def a_call_fused_with_its_check_and_a_larger_one_raise_everywhere():
    # one rank's call small enough to travel with its metadata check, another's not: both run
    # the same check messages and raise, and a fused call leaves the buffer untouched
    n = (1 << 20) if rank == size - 1 else 1000
    for algorithm in ("doubling", "ring", "mpi", None):
        buf = np.ones(n, np.float32)
        msg = raises(MismatchError, lambda: mcallreduce.allreduce(buf, algorithm=algorithm or "doubling"
                                                                  if rank != size - 1 else algorithm))
        assert "differs" in msg, msg
        assert np.all(buf == 1.0)
    handles = [mcallreduce.allreduce_async(np.ones(n, np.float32), algorithm="doubling") for _ in range(3)]
    for h in reversed(handles):
        assert "element count" in raises(MismatchError, h.wait)
    x = data(1000, np.float32)
    mcallreduce.allreduce(x, algorithm="doubling", prescale=0.5, postscale=4.0)   # still usable, fused
    assert np.array_equal(x, expected(1000, np.float32) * 2.0)


@case
@between_peers
def small_fused_calls_keep_their_check_with_the_check_off():
    # the check travels in a small doubling or halving call's own messages and costs it nothing,
    # so check=False keeps that path: exact sums, and a length mismatch still raises everywhere
    from mcallreduce import _executor
    from mcallreduce.runtime import Context
    for algorithm, kind in (("doubling", _executor.KIND_FUSED_DOUBLING), ("halving", _executor.KIND_FUSED_HALVING)):
        plan = Context.get().plan(config.current().with_overrides(algorithm=algorithm, check=False), 1000,
                                  np.dtype(np.float32), "sum", 1.0, 1.0)
        assert plan.kind == kind and plan.check == _executor.CHECK_ON, (algorithm, plan.kind)
        x = data(1000, np.float32)
        mcallreduce.allreduce(x, algorithm=algorithm, check=False)
        assert np.array_equal(x, expected(1000, np.float32)), algorithm
        buf = np.ones(1000 + (rank == size - 1), np.float32)
        assert "element count" in raises(MismatchError,
                                         lambda: mcallreduce.allreduce(buf, algorithm=algorithm, check=False))
        assert np.all(buf == 1.0)


@case
@between_peers
def fused_halving_and_doubling_disagree_and_raise_everywhere():
    # halving sends part of its range in each exchange and doubling all of it: the messages
    # differ in size, yet every rank takes them, raises, and leaves its buffer untouched
    last = rank == size - 1
    for n in (1000, FUSED_MAX_BYTES // 4):
        buf = np.ones(n, np.float32)
        msg = raises(MismatchError, lambda: mcallreduce.allreduce(buf, algorithm="halving" if last else "doubling"))
        assert "algorithm" in msg, msg
        assert np.all(buf == 1.0)
        buf = np.ones(n + last, np.float32)   # at the limit, one rank's call is over it: early data
        assert "element count" in raises(MismatchError, lambda: mcallreduce.allreduce(buf, algorithm="halving"))
        assert np.all(buf == 1.0)
    x = data(1000, np.float32)
    mcallreduce.allreduce(x, algorithm="halving", prescale=0.5, postscale=4.0)   # still usable, fused
    assert np.array_equal(x, expected(1000, np.float32) * 2.0)


@case
@between_peers
def fused_calls_of_different_sizes_at_the_limit_raise_everywhere():
    # the fused limit against half of it: every rank still takes the messages the others
    # send, raises, and leaves its buffer untouched
    limit = FUSED_MAX_BYTES // 4
    for algorithm in ("doubling", "halving"):
        n = limit if rank == size - 1 else limit // 2
        buf = np.ones(n, np.float32)
        assert "element count" in raises(MismatchError, lambda: mcallreduce.allreduce(buf, algorithm=algorithm))
        assert np.all(buf == 1.0)
        # several in flight at once, waited in a rank-dependent order, bitwise the exact sum
        xs = [data(limit, np.float32) + k for k in range(4)]
        handles = [mcallreduce.allreduce_async(x, algorithm=algorithm) for x in xs]
        for h in (reversed(handles) if rank % 2 else handles):
            h.wait()
        for k, x in enumerate(xs):
            assert np.array_equal(x, expected(limit, np.float32) + k * size), (algorithm, k)


@case
@between_peers
def dtype_mismatch_raises_on_every_rank():
    dtype = np.float64 if rank == 0 else np.float32
    msg = raises(MismatchError, lambda: mcallreduce.allreduce(np.ones(10, dtype)))
    assert "dtype" in msg, msg


@case
def bad_buffer_on_one_rank_raises_everywhere():
    bad = np.ones(10, np.uint32) if rank == 0 else np.ones(10, np.float32)
    if rank == 0:
        msg = raises(TypeError, lambda: mcallreduce.allreduce(bad))
        assert "uint32" in msg and ", ".join(mcallreduce.DTYPES) in msg, msg
    else:
        msg = raises(MismatchError, lambda: mcallreduce.allreduce(bad))
        assert "rank 0" in msg, msg
    strided = np.ones(20, np.float32)[::2]
    msg = raises(ValueError, lambda: mcallreduce.allreduce(strided))
    assert "contiguous" in msg


@case
def unknown_algorithm_and_bad_environment_are_named():
    msg = raises(ConfigError, lambda: mcallreduce.allreduce(np.ones(4, np.float32), algorithm="bogus"))
    assert "multicolor" in msg
    import os
    os.environ["MCALLREDUCE_COLORS"] = "zero"
    try:
        msg = raises(ConfigError, config.reload)
        assert "MCALLREDUCE_COLORS" in msg and "auto" in msg, msg
    finally:
        del os.environ["MCALLREDUCE_COLORS"]
        config.reload()


@case
def hierarchy_and_colors_variants_agree():
    n = 200003
    ref = data(n, np.int32)
    comm.Allreduce(MPI.IN_PLACE, ref)
    for colors in (1, 2, 3, 5):
        for hierarchy in (True, False):
            for route in ("tree", "ring"):
                x = data(n, np.int32)
                mcallreduce.allreduce(x, colors=colors, hierarchy=hierarchy, segment_bytes=32 << 10, route=route)
                assert np.array_equal(x, ref), (colors, hierarchy, route)


@case
def mpi_algorithm_async_with_rank_dependent_polling():
    # "mpi" collectives start when their check completes, which depends on when each rank
    # polls; they must still start in call order on every rank.
    bufs = [data(1000 + i, np.float32) for i in range(6)]
    handles = []
    for i, b in enumerate(bufs):
        handles.append(mcallreduce.allreduce_async(b, algorithm="mpi" if i % 2 == 0 else "multicolor"))
        if rank == 0:
            for h in handles:
                h.test()
    for h in reversed(handles):
        h.wait()
    for b in bufs:
        assert np.array_equal(b, expected(b.size, np.float32))


@case
def mpi_collective_waited_alone_on_some_ranks_only():
    # MPI never matches a blocking allreduce with a nonblocking one: a rank whose engine is idle
    # when the call comes (it waited for the earlier call) must still run what the busy ranks run
    for algorithm in ("mpi", "mpi-ring"):
        for n in (1000, (1 << 18) + 3):
            for idle in (0, size - 1):
                a, b = data(n, np.float32), data(n, np.float64)
                h = mcallreduce.allreduce_async(a, algorithm="multicolor")
                if rank == idle:
                    h.wait()
                mcallreduce.allreduce(b, algorithm=algorithm)
                h.wait()
                assert np.array_equal(a, expected(n, np.float32)), (algorithm, n, idle)
                assert np.array_equal(b, expected(n, np.float64)), (algorithm, n, idle)


TABLES = itertools.count()


def three_in_flight(n):
    """Three async calls of n float32 in flight, waited for in reverse; checked, and returned."""
    bufs = [data(n, np.float32) for _ in range(3)]
    handles = [mcallreduce.allreduce_async(b) for b in bufs]
    for h in reversed(handles):
        h.wait()
    for b in bufs:
        assert np.array_equal(b, expected(n, np.float32)), n
        assert same_on_all_ranks(b)
    return handles


@contextlib.contextmanager
def tuning_table(**sections):
    """MCALLREDUCE_TUNING_FILE set, for the block, to a table of this job's layout with these
    sections (name -> rows)."""
    import json
    import os
    import tempfile
    from mcallreduce.runtime import Context
    hosts = Context.get().hosts
    layout = f"{len(hosts)}h{max(len(h) for h in hosts)}r"
    # a path of its own: plans are memoised per configuration, which names the table by its path
    path = os.path.join(tempfile.gettempdir(), f"mcallreduce-table-{os.getppid()}-{rank}-{next(TABLES)}.json")
    with open(path, "w") as f:
        json.dump({name: {layout: rows} for name, rows in sections.items()}, f)
    os.environ["MCALLREDUCE_TUNING_FILE"] = path
    try:
        config.reload()
        yield
    finally:
        del os.environ["MCALLREDUCE_TUNING_FILE"]
        os.unlink(path)
        config.reload()


@case
def a_table_pick_of_mpi_runs_the_rules_schedule_where_a_rank_cannot_block():
    # MPI_Iallreduce in place is a binomial tree of the whole buffer (Open MPI 4.1): a call the
    # table gives to MPI runs the rules' schedule instead where some rank cannot block
    from mcallreduce.runtime import Context
    with tuning_table(tables=[{"size_bytes": 1 << 30, "algorithm": "mpi-ring"}]):
        for n in (1000, (1 << 18) + 3):
            plan = Context.get().plan(config.current(), n, np.dtype(np.float32), "sum", 1.0, 1.0)
            assert size == 1 or plan.algorithm in ("mpi", "mpi-ring"), plan.algorithm
            for h in three_in_flight(n):
                assert size == 1 or h.color_times, "MPI_Iallreduce ran, not the schedule"
            b = data(n, np.float64)
            mcallreduce.allreduce(b)   # every rank waits for it alone: MPI's blocking call
            assert np.array_equal(b, expected(n, np.float64))


@case
def counts_beyond_a_c_int_never_go_to_mpis_allreduce():
    # MPI takes element counts as C ints: a table's MPI pick gives way to its "instead", and a
    # forced MPI call is refused by name (no buffer is needed to plan one)
    from mcallreduce.runtime import Context
    n, f32 = (1 << 31) + 5, np.dtype(np.float32)
    instead = {"algorithm": "ring", "segment_bytes": 1 << 26}
    with tuning_table(tables=[{"size_bytes": 1 << 40, "algorithm": "mpi", "instead": instead}]):
        assert Context.get().plan(config.current(), n - (1 << 31), f32, "sum", 1.0, 1.0).algorithm in ("mpi", "multicolor")
        plan = Context.get().plan(config.current(), n, f32, "sum", 1.0, 1.0)
        assert size == 1 or plan.algorithm == "ring", plan.algorithm
    forced = config.current().with_overrides(algorithm="mpi")
    assert "at most 2147483647 elements" in raises(ValueError, lambda: Context.get().plan(forced, n, f32, "sum", 1.0, 1.0))


@case
def a_tables_nonblocking_rows_decide_async_calls():
    # rows measured with nonblocking calls: an async call the table gives to MPI runs
    # MPI_Iallreduce, as it was timed; blocking calls keep the blocking rows
    from mcallreduce.runtime import Context
    with tuning_table(tables=[{"size_bytes": 1 << 30, "algorithm": "ring", "segment_bytes": 0}],
                      nonblocking_tables=[{"size_bytes": 1 << 30, "algorithm": "mpi"}]):
        for n in (1000, (1 << 18) + 3):
            ctx = Context.get()
            nonblocking = ctx.plan(config.current(), n, np.dtype(np.float32), "sum", 1.0, 1.0, nonblocking=True)
            assert size == 1 or (nonblocking.algorithm == "mpi" and nonblocking.schedule is None), nonblocking.algorithm
            blocking = ctx.plan(config.current(), n, np.dtype(np.float32), "sum", 1.0, 1.0)
            assert size == 1 or blocking.algorithm == "ring", blocking.algorithm
            for h in three_in_flight(n):
                assert size == 1 or not h.color_times, "a schedule ran, not MPI_Iallreduce"
            b = data(n, np.float64)
            mcallreduce.allreduce(b)
            assert np.array_equal(b, expected(n, np.float64))
        if size > 1:   # one rank blocking, the others not: the kinds' picks differ, and every rank says so
            x = np.ones(1000, np.float32)
            call = (lambda: mcallreduce.allreduce(x)) if rank == 0 else (lambda: mcallreduce.allreduce_async(x).wait())
            assert "algorithm" in raises(MismatchError, call)


@case
def a_repeated_blocking_call_skips_the_general_path():
    # a small allreduce is mostly Python: once its plan is known, a blocking call with nothing
    # else in flight must reach the executor without the general submission path
    from mcallreduce import runtime
    x = np.ones(1024, np.float32)
    mcallreduce.allreduce(x, check=False)
    submit, runtime._submit = runtime._submit, None   # calling it would raise TypeError
    try:
        for _ in range(3):
            x[...] = 1
            mcallreduce.allreduce(x, check=False)
            assert np.all(x == size)
    finally:
        runtime._submit = submit


@case
def mpi_ring_is_open_mpis_ring_where_it_can_be_forced():
    # Open MPI's ring runs on a communicator of its own: on every rank or on none (the launcher
    # turns dynamic rules on; a user's OMPI_MCA_coll_tuned_use_dynamic_rules=0 turns it off)
    import os
    from mcallreduce.runtime import Context
    ring = int(Context.get().coll_ring is not None)
    assert comm.allreduce(ring, op=MPI.MIN) == comm.allreduce(ring, op=MPI.MAX), "ring on some ranks only"
    expect = "Open MPI" in MPI.Get_library_version() and os.environ.get(
        "OMPI_MCA_coll_tuned_use_dynamic_rules", "1") != "0"
    assert ring == expect, (ring, expect)
    for n in (0, 1, size + 1, 1000, (1 << 18) + 3):
        for dtype in (np.float32, np.float64, np.int32, np.int64):
            x = data(n, dtype)
            ref = x.copy()
            comm.Allreduce(MPI.IN_PLACE, ref, op=MPI.SUM)
            mcallreduce.allreduce(x, algorithm="mpi-ring")
            assert np.array_equal(x, ref), (n, dtype)
    # in flight beside MPI's default and a schedule: each communicator keeps the call order
    bufs = [data(4000 + i, np.float32) for i in range(6)]
    handles = [mcallreduce.allreduce_async(b, algorithm=("mpi-ring", "mpi", "multicolor")[i % 3])
               for i, b in enumerate(bufs)]
    for h in reversed(handles):
        h.wait()
    for b in bufs:
        assert np.array_equal(b, expected(b.size, np.float32))
    msg = raises(Exception, lambda: mcallreduce.allreduce(np.ones(8, np.float16), algorithm="mpi-ring"))
    assert "float16" in msg, msg


@case
@between_peers
def a_mismatch_after_data_sent_before_the_check_leaves_no_message_behind():
    # a schedule's first messages travel before its metadata check (native/early.c); when the
    # ranks disagree, every rank drains what the others sent it, so the call that later reuses
    # the mismatched call's tag window receives only its own messages, and exactly
    last = rank == size - 1
    n = FUSED_MAX_BYTES // 4 + 4000   # above the fused limit: halving runs its schedule, not its check
    mismatched = [   # (what differs, this rank's call): bigger messages, other bytes, no early data
        ("element count", dict(count=n + 3001 if last else n, dtype=np.float32, algorithm="ring")),
        ("dtype", dict(count=n, dtype=np.int32 if last else np.float32, algorithm="halving")),
        ("algorithm", dict(count=n, dtype=np.float32, algorithm="mpi" if last else "halving")),
    ]
    for what, call in mismatched:
        buf = np.ones(call["count"], call["dtype"])
        msg = raises(MismatchError, lambda: mcallreduce.allreduce(buf, algorithm=call["algorithm"],
                                                                  segment_bytes=16 << 10))
        assert what in msg, msg
        assert np.all(buf == 1), "a failed allreduce must leave the buffer untouched"
    filler = np.ones(4, np.float32)
    for _ in range(Context.get(comm).windows - len(mismatched)):   # small calls ride their check (no early tag)
        mcallreduce.allreduce(filler, algorithm="doubling")
    for algorithm in ("ring", "halving", "halving"):   # the same windows as the mismatched calls
        x = data(n, np.float32)
        mcallreduce.allreduce(x, algorithm=algorithm, segment_bytes=16 << 10)
        assert np.array_equal(x, expected(n, np.float32)), algorithm


@case
@between_peers
def algorithm_mismatch_mpi_vs_schedule_raises_everywhere():
    # the check itself must not depend on the algorithm, or one rank would wait in a
    # collective while another runs the point-to-point check
    alg = "mpi" if rank == 0 else "multicolor"
    msg = raises(MismatchError, lambda: mcallreduce.allreduce(np.ones(10, np.float32), algorithm=alg))
    assert "algorithm" in msg, msg
    x = np.ones(10, np.float32)          # the failed "mpi" call is skipped in the start order
    mcallreduce.allreduce(x, algorithm="mpi")
    assert np.all(x == size)


@case
def mpi_algorithm_async_large_calls_are_exact_for_every_op():
    # a nonblocking "mpi" call sends from a copy of the buffer from 4 ranks on (libnbc's
    # reduce-scatter and allgather rather than its in-place binomial tree): several in flight,
    # each with a copy of its own, every op exact and alike on every rank
    n = (1 << 17) + 5
    ops = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}
    for dtype in (np.float32, np.float64, np.int32, np.int64):
        inputs = {op: data(n, dtype) + k for k, op in enumerate(ops)}
        handles = {op: mcallreduce.allreduce_async(x.copy(), algorithm="mpi", op=op) for op, x in inputs.items()}
        for op, handle in reversed(list(handles.items())):
            got, ref = handle.wait(), inputs[op].copy()
            comm.Allreduce(MPI.IN_PLACE, ref, op=ops[op])
            assert np.array_equal(got, ref) and same_on_all_ranks(got), (dtype, op)
    x = data(n, np.float32)
    got = mcallreduce.allreduce_async(x, algorithm="mpi", op="average").wait()
    assert np.allclose(got, expected(n, np.float64) / size, atol=1e-6) and same_on_all_ranks(got)


@case
@between_peers
def one_sync_calls_stay_exact_after_a_stage_call_on_one_rank_only():
    # the one-host stage's small calls reuse each slot every other stage call, counting only
    # the calls every rank agreed on: a call that is a stage call on some ranks only must not
    # shift anyone's count (on several hosts the stage is not used, and this is a plain mismatch)
    early = [mcallreduce.allreduce_async(data(1000 + k, np.float32)) for k in range(3)]
    odd = np.ones(1000, np.float32)
    assert raises(MismatchError, lambda: mcallreduce.allreduce(odd, algorithm="ring" if rank == 0 else None))
    for k, handle in enumerate(early):
        assert np.array_equal(handle.wait(), expected(1000 + k, np.float32)), k
    for dtype in (np.float16, np.float32, np.int64):
        inputs = [data(500 + 37 * k, dtype) * (k + 1) for k in range(6)]
        floating = np.dtype(dtype).kind == "f"
        kwargs = [{"op": "average"} if k == 4 and floating else {"prescale": 2.0} if k == 5 else {} for k in range(6)]
        handles = [mcallreduce.allreduce_async(x.copy(), **kw) for x, kw in zip(inputs, kwargs)]
        for k in reversed(range(6)):
            got = handles[k].wait()
            two_sync = mcallreduce.allreduce(inputs[k].copy(), one_sync_bytes=0, **kwargs[k])
            assert got.tobytes() == two_sync.tobytes() and same_on_all_ranks(got), (dtype, k)
            if k < 4:
                assert np.array_equal(got, (expected(inputs[k].size, np.float64) * (k + 1)).astype(dtype)), (dtype, k)


@case
def split_communicator():
    sub = comm.Split(color=rank % 2, key=rank)
    x = np.full(1000, rank + 1, np.int64)
    mcallreduce.allreduce(x, comm=sub)
    assert np.all(x == sum(r + 1 for r in range(size) if r % 2 == rank % 2))
    sub.Free()


def main(names):
    """Rank 0 prints one line per case: PASS name ranks=N, or FAIL name rank=R: error.
    The exit status is the result: 0 when every case passed on every rank."""
    failures = 0
    numpy_only = "--numpy-only" in names
    names = [name for name in names if name != "--numpy-only"]
    names = names or [name for name in CASES if (size > 1 or name not in PEERS)
                      and not (numpy_only and name in TORCH)]
    for name in names:
        try:
            CASES[name]()
            detail = None
        except Exception:  # report, keep going: later cases still run on every rank
            detail = traceback.format_exc().strip().splitlines()[-1]
        results = comm.gather(detail, root=0)
        if rank == 0:
            bad = [(r, d) for r, d in enumerate(results) if d is not None]
            failures += bool(bad)
            for r, d in bad:
                print(f"FAIL {name} rank={r}: {d}", flush=True)
            if not bad:
                print(f"PASS {name} ranks={size}", flush=True)
    return 1 if comm.bcast(failures, root=0) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
