"""ResumableSampler: a stock DistributedSampler resumed within an epoch, and its epoch passed on."""
import pytest
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from mcallreduce.data.resumable import ResumableSampler


class Keyed:
    """A dataset that, like this package's, takes the epoch and returns (epoch, index)."""
    epoch = None

    def __len__(self):
        return 50

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __getitem__(self, index):
        return self.epoch, index


def sampler(seed=7, rank=1, num_replicas=3, dataset=None):
    return ResumableSampler(DistributedSampler(dataset or Keyed(), num_replicas=num_replicas, rank=rank, seed=seed))


@pytest.mark.parametrize("stop", [0, 1, 9, 17])
def test_a_resumed_epoch_yields_what_the_uninterrupted_one_had_left(stop):
    full = sampler()
    full.set_epoch(3)
    expected = list(full)
    first = sampler()
    first.set_epoch(3)
    it = iter(first)
    seen = [next(it) for _ in range(stop)]
    resumed = sampler()
    resumed.load_state_dict(first.state_dict())
    resumed.set_epoch(3)             # the training loop sets the saved epoch again
    assert len(resumed) == len(full) == 17
    assert seen + list(resumed) == expected
    resumed.set_epoch(4)             # the next epoch starts from its beginning
    nxt = sampler()
    nxt.set_epoch(4)
    assert list(resumed) == list(nxt)


def test_a_prefetching_loader_saves_the_consumed_count_it_passes():
    dataset = Keyed()
    first = sampler(dataset=dataset)
    first.set_epoch(2)
    loader = DataLoader(dataset, batch_size=4, sampler=first)
    batches = iter(loader)
    done = [next(batches) for _ in range(2)]
    state = first.state_dict(consumed=2 * 4)
    resumed = sampler(dataset=dataset)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)
    rest = [index for batch in DataLoader(dataset, batch_size=4, sampler=resumed) for index in batch[1].tolist()]
    whole = sampler()
    whole.set_epoch(2)
    assert [i for b in done for i in b[1].tolist()] + rest == list(whole)
    assert all(b[0].eq(2).all() for b in done)     # the samples were keyed by the epoch


def test_the_epoch_reaches_the_dataset_and_every_rank_may_resume_rank_0s_state():
    dataset = Keyed()
    s = sampler(rank=0, dataset=dataset)
    s.set_epoch(5)
    assert dataset.epoch == 5
    other = sampler(rank=2, dataset=dataset)
    other.load_state_dict(s.state_dict(consumed=4))      # the rank is not part of what must match
    assert dataset.epoch == 5 and len(list(other)) == len(other) - 4


def test_a_different_configuration_or_an_unreplayable_sampler_is_refused():
    state = sampler(seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        sampler(seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_replicas"):
        sampler(seed=1, num_replicas=2).load_state_dict(state)
    with pytest.raises(TypeError, match="set_epoch"):
        ResumableSampler(SequentialSampler(range(10)))


def test_a_state_saved_after_set_epoch_resumes_at_that_epochs_start():
    first = sampler()
    first.set_epoch(0)
    list(first)
    first.set_epoch(1)
    state = first.state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 0)
    resumed = sampler()
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert list(resumed) == list(first)


class Indices:
    """Forty samples in four classes; an item is its index."""
    targets = [i % 4 for i in range(40)]

    def __len__(self):
        return 40

    def __getitem__(self, index):
        return index


def test_the_threaded_loader_saves_the_samplers_own_position_before_its_first_batch():
    from mcallreduce.data.loader import ThreadedLoader
    from mcallreduce.data.sampler import InMemoryDistributedSampler

    def loader():
        return ThreadedLoader(Indices(), batch_size=4, num_threads=2,
                              sampler=InMemoryDistributedSampler(Indices(), num_replicas=2, rank=0))
    first = loader()
    first.sampler.set_epoch(3)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    assert (state["epoch"], state["consumed"]) == (3, 8)
    first.sampler.set_epoch(4)           # a checkpoint after the next set_epoch: that epoch's start
    assert (first.state_dict()["epoch"], first.state_dict()["consumed"]) == (4, 0)
    resumed = loader()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(3)         # saved again before its first batch: the same position
    assert resumed.state_dict()["consumed"] == 8
    first.close(), resumed.close()
