"""A map-style Dataset over the in-memory store, returning ``(image, label)`` like ImageFolder."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np
from torch.utils.data import Dataset

from .board import Board
from .store import ImageStore
from .transforms import apply


class EncodedImageDataset(Dataset):
    """What this package's datasets share: each item is a sample's encoded bytes, its
    transform (:func:`.transforms.apply`, keyed by the epoch once it is set) and its label."""

    transform: Optional[Callable] = None
    target_transform: Optional[Callable] = None
    _epoch_board: Optional[Board] = None     # none until an epoch is set: seeded transforms get no key

    @property
    def epoch(self) -> Optional[int]:
        """The epoch set last in the rank (None: never), in its DataLoader workers too."""
        return None if self._epoch_board is None else self._epoch_board.read()["epoch"]

    def set_epoch(self, epoch: int) -> None:
        """The epoch a seeded transform keys its randomness by; :class:`InMemoryDistributedSampler`
        calls it from its own ``set_epoch``. Persistent DataLoader workers follow it (a board
        shared with them), if the first epoch was set before they started."""
        if self._epoch_board is None or not self._epoch_board.writable:   # a copy sets an epoch of its own
            self._epoch_board = Board(epoch=int(epoch))
        else:
            self._epoch_board.publish(epoch=int(epoch))

    def _where(self, index: int) -> str:
        """Where sample ``index`` came from, for an error message (looked up only then)."""
        raise NotImplementedError

    def _item(self, index: int, data, target: int):
        try:
            epoch = self.epoch   # one read of the board per item
            image = apply(self.transform, data, None if epoch is None else (epoch, index))
        except Exception as exc:
            # a note, not a new exception of the same type: not every type takes one message
            if hasattr(exc, "add_note"):   # Python 3.11
                exc.add_note(f"mcallreduce.data: while transforming sample {index} ({self._where(index)})")
            raise
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


class InMemoryImageFolder(EncodedImageDataset):
    """ImageFolder's interface over an :class:`ImageStore`.

    ``source`` is a store, a packed file or an ImageFolder directory (opened with
    ``store_options``, collectively under MPI). ``transform`` is any callable: it
    receives a decoded RGB PIL image, or the encoded bytes when it sets
    ``takes_encoded = True`` (TrainTransform, EvalTransform), so it can decode
    at reduced scale. Pickling (DataLoader workers) re-attaches to the host's
    shared segment instead of copying the images.
    """

    def __init__(self, source, transform: Optional[Callable] = None,
                 target_transform: Optional[Callable] = None, **store_options):
        self.store = source if isinstance(source, ImageStore) else ImageStore.open(source, **store_options)
        self.transform, self.target_transform = transform, target_transform
        self.classes: List[str] = self.store.classes
        self.class_to_idx: Dict[str, int] = {name: i for i, name in enumerate(self.classes)}

    @property
    def targets(self) -> np.ndarray:
        """Class index of every sample (a flat int32 array, not a list)."""
        return self.store.labels

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: int):
        return self._item(index, self.store.sample_bytes(index), int(self.store.labels[index]))

    def _where(self, index: int) -> str:
        return self.store.sample_path(index)   # may read the packed file's path table: only on errors
