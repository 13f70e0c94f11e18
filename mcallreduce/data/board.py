"""What a rank tells its DataLoader workers at each epoch, persistent workers included.

A DataLoader with ``persistent_workers=True`` keeps the copy of the dataset its workers got
when they started, so what the rank sets later (the epoch, the samples received for it) never
reaches that copy. A board is a few named int64 in a shared segment of the rank's own: the rank
publishes, its workers read (forked ones through the same mapping, spawned ones re-attached,
read-only). A sequence number makes each read see one whole publication: odd while the rank
writes, and the version by which a worker tells that something changed.
"""
from __future__ import annotations

import os
from typing import Dict, Tuple

import numpy as np

from .shm import SharedSegment

__all__ = ["Board"]


class Board:
    """Named int64 fields that this process publishes and its DataLoader workers read."""

    def __init__(self, **fields: int):
        self.names = tuple(fields)
        self.segment = SharedSegment(None, 8 * (1 + len(self.names)), tag="board")
        self._values = self.segment.array.view(np.int64)
        self.publish(**fields)

    @property
    def writable(self) -> bool:
        """False in a copy that re-attached (a spawned worker's, a deepcopy's): it only reads."""
        return bool(self._values.flags.writeable)

    @property
    def version(self) -> int:
        """Changes with every publication."""
        return int(self._values[0])

    def publish(self, **fields: int) -> None:
        values = self._values
        values[0] += 1   # odd: a reader retries until the fields are whole again
        for name, value in fields.items():
            values[1 + self.names.index(name)] = int(value)
        values[0] += 1

    def read(self) -> Dict[str, int]:
        return self.snapshot()[1]

    def snapshot(self) -> Tuple[int, Dict[str, int]]:
        """(version, fields) of one whole publication."""
        values = self._values
        while True:
            before = int(values[0])
            if before % 2 == 0:
                fields = {name: int(values[1 + i]) for i, name in enumerate(self.names)}
                if int(values[0]) == before:
                    return before, fields
            os.sched_yield()

    def __getstate__(self):
        return {"names": self.names, "segment": self.segment}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._values = self.segment.array.view(np.int64)
