"""The single-host shared-memory stage (mcallreduce/shared_stage.py) over p virtual ranks in-process.

The runtime runs the same sequence in C (native/shared_stage.c) on an MPI shared-memory
window; here the window is one numpy array and the three steps run rank after rank, with
the syncs between.
"""
import numpy as np
import pytest

from mcallreduce import shared_stage as shared
from mcallreduce.shared_stage import scale_

DTYPES = (np.float16, np.float32, np.float64, np.int32, np.int64)


def play(buffers, ufunc=np.add, pre=1.0):
    """publish on every rank | sync 1 | reduce on every rank | sync 2 | collect on every rank."""
    p, n, dtype = len(buffers), buffers[0].size, buffers[0].dtype
    window = np.full((shared.areas(p), max(n, 1)), 99, dtype)   # stale data must not leak in
    slots, result = [window[q][:n] for q in range(p)], window[p][:n]
    scale = None if pre == 1.0 else (lambda copy: scale_(copy, pre))
    for r in range(p):
        shared.publish(buffers[r], slots[r], r, p, scale)
    for r in range(p):
        shared.reduce_color(shared.sources(slots, buffers[r], r, scale is not None), result, r, ufunc)
    for r in range(p):
        shared.collect(buffers[r], result)


def reference(inputs, ufunc, pre=1.0):
    data = [x.copy() for x in inputs]
    for x in data:
        scale_(x, pre)
    out = data[0].copy()
    for x in data[1:]:
        ufunc(out, x, out=out)   # the stage's fixed order: rank 0, 1, ..., p-1
    return out


@pytest.mark.parametrize("p", [2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_length_matches_the_fixed_order_reference_bitwise(p, dtype):
    rng = np.random.default_rng(p)
    for n in (0, 1, p - 1, p, p + 1, 13, 97, 1031):
        inputs = [(rng.standard_normal(n) * 50).astype(dtype) for _ in range(p)]
        bufs = [x.copy() for x in inputs]
        play(bufs)
        want = reference(inputs, np.add)
        for b in bufs:
            assert b.tobytes() == want.tobytes(), (p, dtype, n)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_copy_gives_the_window_stage_result_bitwise_in_any_rank_order(p, dtype):
    # ranks run concurrently: playing them in rank order and in reverse shows that no rank
    # reads a range another rank has already written
    rng = np.random.default_rng(p + 100)
    for n in (0, 1, p - 1, p + 1, 97, 1031):
        inputs = [(rng.standard_normal(n) * 50).astype(dtype) for _ in range(p)]
        want = reference(inputs, np.add)
        for order in (range(p), reversed(range(p))):
            bufs = [x.copy() for x in inputs]
            for r in order:
                shared.reduce_color_direct(bufs, r, np.add, chunk=7)
            for b in bufs:
                assert b.tobytes() == want.tobytes(), (p, dtype, n)


@pytest.mark.parametrize("ufunc", [np.minimum, np.maximum, np.multiply])
def test_ops_and_signed_zeros_agree_on_every_rank(ufunc):
    p = 4
    inputs = [np.array([0.0, -0.0, np.nan, 1.5, -2.0], np.float32) * (1 if r % 2 else -1) for r in range(p)]
    bufs = [x.copy() for x in inputs]
    play(bufs, ufunc)
    want = reference(inputs, ufunc)
    assert all(b.tobytes() == want.tobytes() for b in bufs)


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_prescale_applies_to_the_copy_not_before_the_check(dtype):
    p = 3
    inputs = [np.arange(10, dtype=dtype) + r for r in range(p)]
    bufs = [x.copy() for x in inputs]
    window = np.zeros((shared.areas(p), 10), dtype)
    shared.publish(bufs[0], window[0], 0, p, lambda copy: scale_(copy, 2.0))
    assert np.array_equal(bufs[0], inputs[0]), "publish must not touch the caller's buffer"
    play(bufs, pre=2.0)
    assert all(np.array_equal(b, reference(inputs, np.add, 2.0)) for b in bufs)


def test_publish_without_prescale_leaves_the_own_color_to_the_buffer():
    p, n = 2, 10
    slot = np.full(n, -1, np.float32)
    shared.publish(np.ones(n, np.float32), slot, 0, p, None)
    (lo, count), _ = shared.colors(n, p)
    assert np.all(slot[lo:lo + count] == -1) and np.all(slot[lo + count:] == 1)


def play_one_sync(calls, slots_per_rank=2, ufunc=np.add):
    """One-sync calls, rank 0 as far ahead as the protocol lets it get: it publishes call k+1
    (its call k is done once every rank published k) before the other ranks reduce call k."""
    p, n, dtype = len(calls[0]), calls[0][0].size, calls[0][0].dtype
    small = np.full((shared.small_areas(p), max(n, 1)), 99, dtype)

    def slot(q, k):
        return small[2 * q + (k % slots_per_rank)][:n]

    for q in range(p):
        slot(q, 0)[...] = calls[0][q]
    for k in range(len(calls)):
        sources = [slot(q, k) for q in range(p)]
        shared.reduce_whole(sources, calls[k][0], ufunc)
        if k + 1 < len(calls):
            slot(0, k + 1)[...] = calls[k + 1][0]
        for q in range(1, p):
            shared.reduce_whole(sources, calls[k][q], ufunc)
            if k + 1 < len(calls):
                slot(q, k + 1)[...] = calls[k + 1][q]


@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_sync_gives_the_window_stage_result_bitwise_with_a_rank_a_call_ahead(p, dtype):
    rng = np.random.default_rng(p + 200)
    for n in (0, 1, p + 1, 97):
        inputs = [[(rng.standard_normal(n) * 50).astype(dtype) for _ in range(p)] for _ in range(4)]
        calls = [[x.copy() for x in call] for call in inputs]
        play_one_sync(calls)
        for call_in, call_out in zip(inputs, calls):
            two_sync = [x.copy() for x in call_in]
            play(two_sync)
            for b in call_out:
                assert b.tobytes() == two_sync[0].tobytes(), (p, dtype, n)


def test_one_sync_with_one_slot_per_rank_would_read_a_peer_s_next_call():
    # why two slots: with one, rank 0's next call overwrites what the others still reduce
    calls = [[np.full(4, 10.0 * k + q) for q in range(2)] for k in range(3)]
    play_one_sync(calls, slots_per_rank=1)
    assert not np.array_equal(calls[0][1], calls[0][0])
