"""A threaded batch loader: decode and augmentation in a thread pool, batches prefetched.

Usable in place of DataLoader over any map-style dataset. Pillow and simplejpeg
release the GIL while decoding and resizing, so threads scale with cores
without the per-worker process, pickling and IPC of DataLoader workers.
"""
from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import Sampler, SequentialSampler, RandomSampler, default_collate

from .settings import data as settings


class ThreadedLoader:
    """``for images, labels in ThreadedLoader(dataset, batch_size, sampler=sampler): ...``

    ``prefetch`` batches are decoded ahead of the one being consumed. ``state_dict``
    counts batches actually handed to the caller, so a resume is exact.
    ``batch_transform`` is applied to each collated batch in the consuming thread,
    e.g. ``normalize.Normalize(device="cuda")`` after ``TrainTransform(normalize=False)``:
    the decode threads then hand out uint8 images and one vectorised op per batch
    turns them into normalised floats (as FFCV and DALI do).
    """

    def __init__(self, dataset, batch_size: int = 1, sampler: Optional[Sampler] = None, shuffle: bool = False,
                 num_threads: Optional[int] = None, prefetch: int = 2, drop_last: bool = False,
                 collate_fn=None, batch_transform: Optional[Callable] = None):
        if sampler is not None and shuffle:
            raise ValueError("sampler and shuffle are mutually exclusive (as in DataLoader)")
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.sampler = sampler or (RandomSampler(dataset) if shuffle else SequentialSampler(dataset))
        self.num_threads = num_threads or settings.threads()
        self.prefetch = max(1, prefetch)
        self.collate_fn = collate_fn or collate
        self.batch_transform = batch_transform
        self._pool: Optional[ThreadPoolExecutor] = None
        self._batches_done = 0
        self._consumed_base = 0
        self._counted_epoch = None   # the sampler's epoch that the two counters above describe

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _batches(self) -> Iterator[list]:
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __iter__(self):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="mcallreduce-decode")
        get = self.dataset.__getitem__
        pending = collections.deque()
        batches = self._batches()
        self._consumed_base = getattr(self.sampler, "_start", 0)   # a resumed sampler starts mid-epoch
        self._batches_done = 0
        self._counted_epoch = getattr(self.sampler, "epoch", None)
        for batch in batches:
            pending.append([self._pool.submit(get, i) for i in batch])
            if len(pending) > self.prefetch:
                yield self._finish(pending.popleft())
        while pending:
            yield self._finish(pending.popleft())

    def _finish(self, futures) -> object:
        batch = self.collate_fn([f.result() for f in futures])
        if self.batch_transform is not None:
            batch = self.batch_transform(batch)
        self._batches_done += 1
        return batch

    def state_dict(self) -> dict:
        """The sampler's state at the batches handed out so far (not those prefetched)."""
        if not hasattr(self.sampler, "state_dict"):
            raise TypeError(f"{type(self.sampler).__name__} has no state_dict: use InMemoryDistributedSampler")
        if self._counted_epoch is None or self._counted_epoch != getattr(self.sampler, "epoch", None):
            return self.sampler.state_dict()   # not iterated since a resume or set_epoch: the sampler's own
        consumed = min(self._consumed_base + self._batches_done * self.batch_size, len(self.sampler))
        return self.sampler.state_dict(consumed=consumed)

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._counted_epoch = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def collate(items: list):
    """(tensor, int) pairs -> (batched tensor, int64 labels), else torch's default_collate.

    The images are stacked with numpy: torch.stack enters torch's intra-op pool from
    every calling thread, much slower on a loaded machine (docs/data.md, "Decode pipeline").
    """
    first = items[0]
    if (isinstance(first, tuple) and len(first) == 2 and isinstance(first[0], torch.Tensor)
            and isinstance(first[1], int)):
        images = np.stack([item[0].numpy() for item in items])
        return torch.from_numpy(images), torch.tensor([item[1] for item in items], dtype=torch.int64)
    return default_collate(items)
