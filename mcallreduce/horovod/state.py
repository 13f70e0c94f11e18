"""Plugin counters, one-time warnings and the stock-Horovod bypass. Light on purpose: the
startup hook's path imports it, so it must not import torch, Horovod or mpi4py.

The plugin's switches (MCALLREDUCE_HOROVOD, MCALLREDUCE_BUCKET_BYTES,
MCALLREDUCE_PROGRESS_THREAD) are read in mcallreduce/config.py with every other variable.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import warnings
from typing import Dict, Iterator

#: ``op=MultiColor``: a Horovod reduction op, like ``hvd.Adasum``, that averages through the
#: multi-color allreduce, whether or not the environment routes every call (the value is far
#: from Horovod's own ops, 0-5; stock Horovod never sees it: unrouted, it becomes Average)
MULTICOLOR_OP = 1 << 20

#: what the plugin did, per kind: "routed" hvd.allreduce* calls, "buckets" of gradients,
#: "fallback" calls handed to stock Horovod, "served_joined" allreduces of other ranks this
#: rank contributed zeros to from inside hvd.join()
counters: collections.Counter = collections.Counter()
#: whether MPI was initialised by mpi4py before Horovod started, so that Horovod never finalizes it
mpi_outlives_horovod = False
_warned: set = set()
_local = threading.local()


def warn_once(feature: str) -> None:
    """One warning per feature and process: the call itself goes to stock Horovod."""
    counters["fallback"] += 1
    if feature not in _warned:
        _warned.add(feature)
        warnings.warn(f"mcallreduce: {feature} is not supported by the multi-color fast path; "
                      "stock Horovod handles it", RuntimeWarning, stacklevel=4)


def bypassed() -> bool:
    return getattr(_local, "bypass", 0) > 0


@contextlib.contextmanager
def stock_horovod() -> Iterator[None]:
    """Within this block (in this thread) every Horovod call goes to stock Horovod."""
    _local.bypass = getattr(_local, "bypass", 0) + 1
    try:
        yield
    finally:
        _local.bypass -= 1


def stats() -> Dict[str, int]:
    """Counts of routed calls, gradient buckets, fallbacks and allreduces served inside hvd.join()."""
    return {name: counters[name] for name in ("routed", "buckets", "fallback", "served_joined")}
