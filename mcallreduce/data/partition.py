"""Which host holds which samples (a pure function of the labels and the layout).

Each host gets a share proportional to its number of ranks, and within that
share the same fraction of every class: host h takes the h-th slice of each
class folder. Class-stratified shares keep a host's local shuffle close to the
whole set's class mix; slices of a class are contiguous in the store file, so a
host reads about one run per class instead of scattered samples.
"""
from __future__ import annotations

import numpy as np


def owner_of_samples(labels: np.ndarray, ranks_per_host: np.ndarray) -> np.ndarray:
    """int32[N]: the host holding each sample. Host sizes differ from N*share by < 1."""
    labels = np.asarray(labels)
    n = len(labels)
    weights = np.asarray(ranks_per_host, dtype=np.float64)
    owner = np.zeros(n, dtype=np.int32)
    if len(weights) == 1 or n == 0:
        return owner
    by_class = np.argsort(labels, kind="stable")                 # ids grouped by class, in id order
    counts = np.bincount(labels, minlength=int(labels.max()) + 1)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    position = np.arange(n) - starts[labels[by_class]]           # index of each id within its class
    key = (position + 0.5) / counts[labels[by_class]]            # relative place in its class, in (0, 1)
    order = by_class[np.argsort(key, kind="stable")]             # all classes interleaved by place
    cuts = np.floor(np.cumsum(weights) / weights.sum() * n + 1e-9).astype(np.int64)
    cuts[-1] = n
    begin = 0
    for host, end in enumerate(cuts):
        owner[order[begin:end]] = host
        begin = end
    return owner
