"""InMemoryDistributedSampler without MPI: counts, coverage, determinism, resume, shuffle modes."""
import itertools

import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from mcallreduce.data.partition import owner_of_samples
from mcallreduce.data.sampler import InMemoryDistributedSampler


class Labelled:
    """A dataset of n samples in `classes` classes, ImageFolder-ordered (labels non-decreasing)."""
    def __init__(self, n, classes=7):
        self.targets = np.sort(np.random.default_rng(n).integers(0, classes, n)).astype(np.int32)

    def __len__(self):
        return len(self.targets)


def epoch_of(dataset, world, per_host, epoch=0, **kw):
    samplers = [InMemoryDistributedSampler(dataset, num_replicas=world, rank=r, ranks_per_host=per_host, **kw)
                for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


LAYOUTS = [(w, p) for w in (1, 2, 3, 4) for p in sorted({1, 2, w}) if p <= w]
MODES = [("local", 0.0), ("global", 0.0), ("partial", 0.3), ("partial", 1.0)]


@pytest.mark.parametrize("world,per_host", LAYOUTS)
@pytest.mark.parametrize("mode,q", MODES)
@pytest.mark.parametrize("n", [101, 64])
def test_equal_counts_and_disjoint_coverage(world, per_host, mode, q, n):
    dataset = Labelled(n)
    samplers, orders = epoch_of(dataset, world, per_host, epoch=3, shuffle_mode=mode, exchange_fraction=q)
    counts = {len(o) for o in orders}
    assert counts == {len(samplers[0])} == {-(-n // world)}
    everything = list(itertools.chain(*orders))
    assert set(everything) == set(range(n))                       # every sample, once ...
    assert len(everything) - n == samplers[0].total_size - n      # ... plus only the padding


@pytest.mark.parametrize("mode,q", MODES)
def test_drop_last_counts_and_no_repeats(mode, q):
    dataset = Labelled(103)
    _, orders = epoch_of(dataset, 4, 2, epoch=1, drop_last=True, shuffle_mode=mode, exchange_fraction=q)
    everything = list(itertools.chain(*orders))
    assert {len(o) for o in orders} == {103 // 4}
    assert len(set(everything)) == len(everything)


@pytest.mark.parametrize("world,per_host", [(1, 1), (3, 1), (4, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_global_mode_is_distributedsampler_index_for_index(world, per_host, drop_last):
    dataset = Labelled(101)
    for epoch in (0, 5):
        _, ours = epoch_of(dataset, world, per_host, epoch, shuffle_mode="global", seed=7, drop_last=drop_last)
        for r in range(world):
            theirs = DistributedSampler(dataset, num_replicas=world, rank=r, seed=7, drop_last=drop_last)
            theirs.set_epoch(epoch)
            assert ours[r] == list(theirs)


@pytest.mark.parametrize("mode,q", MODES)
def test_order_is_a_function_of_seed_epoch_layout(mode, q):
    dataset = Labelled(90)
    kw = dict(shuffle_mode=mode, exchange_fraction=q)
    _, a = epoch_of(dataset, 4, 2, epoch=2, seed=1, **kw)
    _, b = epoch_of(dataset, 4, 2, epoch=2, seed=1, **kw)
    _, other_epoch = epoch_of(dataset, 4, 2, epoch=3, seed=1, **kw)
    _, other_seed = epoch_of(dataset, 4, 2, epoch=2, seed=2, **kw)
    _, other_layout = epoch_of(dataset, 4, 1, epoch=2, seed=1, **kw)
    assert a == b
    assert a != other_epoch and a != other_seed
    if mode != "global":   # global ignores the host layout, like DistributedSampler
        assert a != other_layout


def test_local_mode_stays_on_the_host_partition_and_partial_moves_q():
    dataset = Labelled(400, classes=10)
    owner = owner_of_samples(dataset.targets, np.array([2, 2]))
    host_of_rank = [0, 0, 1, 1]
    _, local = epoch_of(dataset, 4, 2, epoch=1, shuffle_mode="local")
    for r, order in enumerate(local):
        assert set(owner[order]) == {host_of_rank[r]}
    # Each host's share is class-stratified: every class is on both hosts, in similar numbers.
    for h in (0, 1):
        held = np.bincount(dataset.targets[owner == h], minlength=10)
        total = np.bincount(dataset.targets, minlength=10)
        assert np.all(np.abs(held - total / 2) <= 1)
    for q in (0.25, 0.5):
        _, partial = epoch_of(dataset, 4, 2, epoch=1, shuffle_mode="partial", exchange_fraction=q)
        moved = [np.mean(owner[order] != host_of_rank[r]) for r, order in enumerate(partial)]
        # Q of each partition is pooled and dealt back at random, so about Q(1 - 1/hosts) lands elsewhere.
        assert abs(np.mean(moved) - q / 2) < 0.08
    _, q0 = epoch_of(dataset, 4, 2, epoch=1, shuffle_mode="partial", exchange_fraction=0.0)
    assert q0 == local


@pytest.mark.parametrize("mode,q", MODES)
@pytest.mark.parametrize("stop", [0, 1, 17, 25])
def test_resume_mid_epoch_equals_uninterrupted(mode, q, stop):
    dataset = Labelled(100)
    kw = dict(num_replicas=4, rank=1, ranks_per_host=2, seed=3, shuffle_mode=mode, exchange_fraction=q)
    full = InMemoryDistributedSampler(dataset, **kw)
    full.set_epoch(4)
    expected = list(full)
    first = InMemoryDistributedSampler(dataset, **kw)
    first.set_epoch(4)
    it = iter(first)
    seen = [next(it) for _ in range(stop)]
    state = first.state_dict()
    resumed = InMemoryDistributedSampler(dataset, **kw)
    resumed.load_state_dict(state)
    resumed.set_epoch(4)          # the training loop calls it again with the saved epoch
    assert seen + list(resumed) == expected
    resumed.set_epoch(5)          # and the next epoch starts from its beginning
    nxt = InMemoryDistributedSampler(dataset, **kw)
    nxt.set_epoch(5)
    assert list(resumed) == list(nxt)


def test_resume_refuses_a_different_configuration():
    dataset = Labelled(50)
    state = InMemoryDistributedSampler(dataset, num_replicas=2, rank=0, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        InMemoryDistributedSampler(dataset, num_replicas=2, rank=0, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_replicas"):
        InMemoryDistributedSampler(dataset, num_replicas=4, rank=0, seed=1).load_state_dict(state)


def test_no_shuffle_is_sequential_within_hosts():
    dataset = Labelled(20)
    _, orders = epoch_of(dataset, 2, 2, shuffle=False, shuffle_mode="local")
    assert orders == [list(range(0, 20, 2)), list(range(1, 20, 2))]
    with pytest.raises(ValueError):
        InMemoryDistributedSampler(dataset, num_replicas=2, rank=0, shuffle_mode="random")


@pytest.mark.parametrize("mode,q", MODES)
def test_a_state_saved_after_set_epoch_resumes_at_that_epochs_start(mode, q):
    # the loop that checkpoints after set_epoch(next) and before its first batch
    dataset = Labelled(60)
    kw = dict(num_replicas=2, rank=0, seed=5, shuffle_mode=mode, exchange_fraction=q)
    first = InMemoryDistributedSampler(dataset, **kw)
    first.set_epoch(0)
    list(first)
    first.set_epoch(1)
    state = first.state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 0)
    resumed = InMemoryDistributedSampler(dataset, **kw)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert list(resumed) == list(first)


def test_resume_refuses_another_host_layout_where_the_order_depends_on_it():
    dataset = Labelled(40)
    for mode in ("local", "partial"):
        state = InMemoryDistributedSampler(dataset, num_replicas=4, rank=0, ranks_per_host=2,
                                           shuffle_mode=mode, exchange_fraction=0.3).state_dict()
        other = InMemoryDistributedSampler(dataset, num_replicas=4, rank=0, ranks_per_host=4,
                                           shuffle_mode=mode, exchange_fraction=0.3)
        with pytest.raises(ValueError, match="hosts"):
            other.load_state_dict(state)
    # the global order is DistributedSampler's, whatever the hosts
    state = InMemoryDistributedSampler(dataset, num_replicas=4, rank=0, ranks_per_host=2,
                                       shuffle_mode="global").state_dict()
    InMemoryDistributedSampler(dataset, num_replicas=4, rank=0, ranks_per_host=4,
                               shuffle_mode="global").load_state_dict(state)


def test_one_of_num_replicas_and_rank_takes_the_other_from_the_world():
    # as DistributedSampler: here the world is one process, so rank 0 and a world of 1
    dataset = Labelled(40)
    four = InMemoryDistributedSampler(dataset, num_replicas=4)
    assert (four.num_replicas, four.rank, len(four)) == (4, 0, 10)
    with pytest.raises(ValueError, match="Invalid rank 3"):
        InMemoryDistributedSampler(dataset, rank=3)


def test_exchange_rounds_keep_every_rank_under_the_round_bound():
    # ids dealt to rounds by id % rounds: a skewed set (large samples on even ids) overfills a round
    # at the average's count of rounds, so rounds are added until none is over
    from mcallreduce.data.exchange import busiest_round, count_rounds
    rng = np.random.default_rng(0)
    ids = np.arange(400)
    sizes = np.where(ids % 2 == 0, 1000, 10) + rng.integers(0, 5, ids.size)
    sender, dest = ids % 2, 2 + ids % 3
    bound = 22_000
    rounds = count_rounds(ids, sender, dest, sizes, 5, bound)
    assert busiest_round(ids, sender, dest, sizes, 5, rounds) <= bound
    average = int(np.ceil(busiest_round(ids, sender, dest, sizes, 5, 1) / bound))
    assert busiest_round(ids, sender, dest, sizes, 5, average) > bound   # the case the loop exists for
