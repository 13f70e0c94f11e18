"""A position within an epoch for any sampler whose order is a function of its epoch.

A stock ``DistributedSampler`` draws its order from ``seed + epoch`` and keeps no
position, so a job pre-empted within an epoch can resume only at the epoch's start.
Wrapped, it saves how many indices the epoch had handed out and skips them on the
next iteration, as :class:`.InMemoryDistributedSampler` does for its own order::

    sampler = ResumableSampler(DistributedSampler(dataset, num_replicas=size, rank=rank, seed=seed))
    state = sampler.state_dict(consumed=batches_done * batch_size)   # into the checkpoint
    sampler.load_state_dict(state)                                    # after a restart

It also passes the epoch on to a dataset that takes one (this package's datasets), so
that seeded augmentations are keyed by (seed, epoch, sample index) and a resumed
epoch draws the same crops as the uninterrupted one.
"""
from __future__ import annotations

import itertools
from typing import Iterator, Optional

from torch.utils.data import Sampler

# What must match between the saved sampler and the one resuming; the rank need not,
# since every rank consumes the same count and the checkpoint is rank 0's.
_MATCHED = ("seed", "num_replicas", "shuffle", "drop_last")


class ResumableSampler(Sampler):

    def __init__(self, sampler: Sampler):
        if not hasattr(sampler, "set_epoch"):
            raise TypeError(f"{type(sampler).__name__} has no set_epoch: its order cannot be replayed on resume")
        self.sampler = sampler
        self.epoch = getattr(sampler, "epoch", 0)
        self._start = 0          # indices to skip on the next iteration (a resumed epoch)
        self._yielded = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:   # a new epoch: nothing of it handed out yet
            self._start = self._yielded = 0
        self.epoch = int(epoch)
        self.sampler.set_epoch(self.epoch)
        dataset_set_epoch = getattr(getattr(self.sampler, "dataset", None), "set_epoch", None)
        if dataset_set_epoch is not None:
            dataset_set_epoch(self.epoch)

    def __len__(self) -> int:
        return len(self.sampler)       # the whole epoch's, as a loader's step count expects

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        self._yielded = start
        for index in itertools.islice(iter(self.sampler), start, None):
            self._yielded += 1
            yield index

    def _identity(self) -> dict:
        found = {key: getattr(self.sampler, key) for key in _MATCHED if hasattr(self.sampler, key)}
        return {"sampler": type(self.sampler).__name__, **found, "length": len(self.sampler)}

    def state_dict(self, consumed: Optional[int] = None) -> dict:
        """The position in the epoch. ``consumed`` overrides the count of indices handed out,
        for loaders that prefetch (DataLoader: batches_done * batch_size)."""
        return {"epoch": self.epoch, "consumed": self._yielded if consumed is None else int(consumed),
                **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next iteration of the saved epoch yields exactly what it had left."""
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise ValueError(f"cannot resume: saved {key}={state.get(key)!r}, this sampler has {value!r}")
        self.set_epoch(int(state["epoch"]))
        self._start = self._yielded = int(state["consumed"])
