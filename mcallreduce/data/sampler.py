"""A DistributedSampler for data partitioned across hosts, with exact mid-epoch resume.

Same interface as ``torch.utils.data.DistributedSampler`` (``num_replicas``,
``rank``, ``shuffle``, ``seed``, ``drop_last``, ``set_epoch``) and the same
guarantees: every rank gets ``len(sampler)`` indices per epoch, no index twice
within an epoch except the padding that makes the counts equal, and the order
is a pure function of (seed, epoch, world layout). Shuffle modes:

- ``global``: DistributedSampler's own order (``torch.randperm`` seeded with
  seed + epoch, padded, ``indices[rank::num_replicas]``), index for index. Samples
  a host does not hold are fetched at the start of the epoch (exchange.py).
- ``local``: each host permutes its own partition every epoch; its ranks take
  strided slices. No traffic. (The paper's in-memory scheme.)
- ``partial``: before each epoch a fraction ``exchange_fraction`` (Q) of every
  host's partition is pooled, permuted across hosts and dealt back in equal
  numbers; each host then shuffles locally. Q=0 is local; Q=1 draws each host's
  epoch set uniformly from the whole set (Nguyen et al., IPDPS'22).

``set_epoch`` is collective when samples must be exchanged: call it on every
rank, before iterating, as Horovod scripts already do.
"""
from __future__ import annotations

import itertools
import math
from typing import Iterator, Optional

import numpy as np
import torch
from torch.utils.data import Sampler

from . import world as world_mod
from .partition import owner_of_samples

# names a sampler in its store's record of the exchanged epoch (an id() comes back for a later sampler)
_SAMPLER_NUMBERS = itertools.count()

MODES = ("local", "global", "partial")


class InMemoryDistributedSampler(Sampler[int]):

    def __init__(self, dataset, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, shuffle_mode: str = "local",
                 exchange_fraction: float = 0.1, ranks_per_host: Optional[int] = None):
        if shuffle_mode not in MODES:
            raise ValueError(f"shuffle_mode must be one of {MODES}, got {shuffle_mode!r}")
        if not 0.0 <= exchange_fraction <= 1.0:
            raise ValueError(f"exchange_fraction must be in [0, 1], got {exchange_fraction}")
        self.store = _store_of(dataset)
        self._dataset_epoch = getattr(dataset, "set_epoch", None)   # seeded transforms key on the epoch
        # a store opened without MPI holds everything: the world is then the caller's or
        # torch.distributed's, not the store's one rank
        if self.store is not None and self.store.world.comm is not None:
            self.layout = self.store.layout
            if (num_replicas not in (None, self.layout.num_replicas)) or (rank not in (None, self.layout.rank)):
                raise ValueError(f"num_replicas={num_replicas}, rank={rank} differ from the store's world "
                                 f"({self.layout.num_replicas} ranks, this is rank {self.layout.rank})")
            self.owner = self.store.owner
        else:
            # No store, or a store opened without MPI: the caller states the world, or torch.distributed.
            self.layout = world_mod.current(num_replicas, rank, ranks_per_host).layout
            labels = self.store.labels if self.store is not None else \
                np.asarray(getattr(dataset, "targets", np.zeros(len(dataset), np.int32)))
            self.owner = owner_of_samples(labels, self.layout.ranks_per_host_array())
        self.num_replicas, self.rank = self.layout.num_replicas, self.layout.rank
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.shuffle_mode, self.exchange_fraction = shuffle_mode, float(exchange_fraction)
        self.dataset_size = len(dataset)
        n, w = self.dataset_size, self.num_replicas
        # DistributedSampler's arithmetic, so lengths match it exactly.
        self.num_samples = math.ceil((n - w) / w) if drop_last and n % w else math.ceil(n / w)
        self.total_size = self.num_samples * w
        self.epoch = 0
        if self._dataset_epoch is not None:
            self._dataset_epoch(0)      # keyed crops from the first epoch on, set_epoch called or not
        self._number = next(_SAMPLER_NUMBERS)
        self._start = 0          # where the next iteration starts (mid-epoch resume)
        self._yielded = 0
        self._cached = (None, None)

    def __len__(self) -> int:
        return self.num_samples

    # --- the order --------------------------------------------------------------------
    def _rng(self, epoch: int, *words: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch, *words])))

    def assignment(self, epoch: int) -> np.ndarray:
        """int64[num_replicas, num_samples]: every rank's indices for ``epoch``."""
        if self._cached[0] == epoch:
            return self._cached[1]
        if self.shuffle_mode == "global":
            table = self._global(epoch)
        else:
            table = np.empty((self.num_replicas, self.num_samples), dtype=np.int64)
            for host, ids in enumerate(self._host_sets(epoch)):
                ranks = self.layout.ranks_of(host)
                if self.shuffle:
                    ids = ids[self._rng(epoch, 0, host).permutation(len(ids))]
                need = len(ranks) * self.num_samples
                if len(ids) == 0 and need:
                    raise ValueError(f"host {host} holds no samples: the dataset ({self.dataset_size}) is smaller "
                                     f"than the number of hosts ({self.layout.num_hosts})")
                ids = np.resize(ids, need)   # cuts (drop_last) or repeats the start (padding), cyclically
                for local, r in enumerate(ranks):
                    table[r] = ids[local::len(ranks)]
        self._cached = (epoch, table)
        return table

    def _global(self, epoch: int) -> np.ndarray:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            indices = torch.randperm(self.dataset_size, generator=g).numpy().astype(np.int64)
        else:
            indices = np.arange(self.dataset_size, dtype=np.int64)
        indices = np.resize(indices, self.total_size)
        return indices.reshape(self.num_samples, self.num_replicas).T.copy()

    def _host_sets(self, epoch: int):
        """Each host's samples for the epoch: its partition, with a fraction swapped in 'partial' mode."""
        shares = [np.nonzero(self.owner == h)[0] for h in range(self.layout.num_hosts)]
        if self.shuffle_mode == "local" or not self.shuffle or self.exchange_fraction == 0:
            return shares
        leaving = []
        for h, ids in enumerate(shares):
            m = int(round(self.exchange_fraction * len(ids)))
            leaving.append(np.sort(self._rng(epoch, 1, h).choice(len(ids), m, replace=False)))
        pool = np.concatenate([ids[out] for ids, out in zip(shares, leaving)])
        pool = pool[self._rng(epoch, 2).permutation(len(pool))]
        sets, at = [], 0
        for ids, out in zip(shares, leaving):
            staying = np.delete(ids, out)
            sets.append(np.sort(np.concatenate([staying, pool[at:at + len(out)]])))
            at += len(out)
        return sets

    # --- epochs and iteration -----------------------------------------------------------
    @property
    def needs_exchange(self) -> bool:
        # global mode strides over the whole set, shuffled or not; partial moves samples only shuffled
        return (self.store is not None and not self.store.host_holds_all.all()
                and (self.shuffle_mode == "global" or
                     (self.shuffle_mode == "partial" and self.shuffle and self.exchange_fraction > 0)))

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (collective when samples must move: call it on every rank)."""
        if epoch != self.epoch:   # a new epoch: nothing of it handed out yet
            self._start = self._yielded = 0
        self.epoch = epoch
        self._prepare()

    def _prepare(self) -> None:
        if self._dataset_epoch is not None:
            self._dataset_epoch(self.epoch)
        self._exchange()

    def _exchange(self) -> None:
        if self.needs_exchange and self.store.epoch_prepared != (self._number, self.epoch):
            from .exchange import exchange_epoch
            exchange_epoch(self.store, self.assignment(self.epoch))
            self.store.epoch_prepared = (self._number, self.epoch)

    def __iter__(self) -> Iterator[int]:
        self._prepare()
        row = self.assignment(self.epoch)[self.rank]
        start, self._start = self._start, 0
        self._yielded = start
        for index in row[start:].tolist():
            self._yielded += 1
            yield index

    # --- resume --------------------------------------------------------------------------
    def state_dict(self, consumed: Optional[int] = None) -> dict:
        """The position in the epoch. ``consumed`` overrides the count of indices handed out,
        for loaders that prefetch (DataLoader: batches_done * batch_size)."""
        return {"epoch": self.epoch, "consumed": self._yielded if consumed is None else int(consumed),
                "seed": self.seed, "num_replicas": self.num_replicas, "shuffle": self.shuffle,
                "shuffle_mode": self.shuffle_mode, "exchange_fraction": self.exchange_fraction,
                "drop_last": self.drop_last, "dataset_size": self.dataset_size, "hosts": self._hosts()}

    def _hosts(self) -> Optional[list]:
        """The host of every rank where the order depends on it (local and partial modes)."""
        return None if self.shuffle_mode == "global" else list(self.layout.host_of_rank)

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next iteration yields exactly what the saved one had left."""
        for key in ("seed", "num_replicas", "shuffle", "shuffle_mode", "exchange_fraction", "drop_last",
                    "dataset_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"cannot resume: saved {key}={state[key]!r}, this sampler has {getattr(self, key)!r}")
        if state.get("hosts") is not None and state["hosts"] != self._hosts():   # absent: saved by a version that did not record it
            raise ValueError(f"cannot resume: the saved order put ranks on hosts {state['hosts']}, this job has "
                             f"{self._hosts()}; the {self.shuffle_mode} order depends on it")
        self.epoch = int(state["epoch"])
        self._start = int(state["consumed"])
        self._yielded = self._start
        if self._dataset_epoch is not None:
            self._dataset_epoch(self.epoch)


def _store_of(dataset):
    """The in-memory store behind ``dataset``: itself, its ``store``, or that of the dataset it wraps
    (``.dataset``, as torch's Subset names it); None for a dataset with no store behind it."""
    from .store import ImageStore
    seen = set()
    while dataset is not None and id(dataset) not in seen:
        seen.add(id(dataset))
        if isinstance(dataset, ImageStore):
            return dataset
        if isinstance(getattr(dataset, "store", None), ImageStore):
            return dataset.store
        dataset = getattr(dataset, "dataset", None)
    return None
