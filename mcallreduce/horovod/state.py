"""Plugin switches, counters and one-time warnings. Light on purpose: the startup hook
imports this module in every Python process where a MCALLREDUCE_* variable is set, so it
must not import torch, Horovod or mpi4py.

Switches (read from the environment when asked, so tests can change them):

* ``MCALLREDUCE_HOROVOD``: ``1`` forces the plugin on, ``0`` forces it off (stock Horovod even
  with the one-line import), unset or ``auto`` leaves the decision to the next rules;
* startup hook (zero code change): on when ``MCALLREDUCE_ALGORITHM`` is set and not empty;
* ``import mcallreduce.horovod.torch``: on unless ``MCALLREDUCE_HOROVOD=0``;
* ``MCALLREDUCE_BUCKET_BYTES``: gradient bucket capacity of DistributedOptimizer (default 25M);
* ``MCALLREDUCE_PROGRESS_THREAD``: ``1`` progress communication on a background thread,
  ``0`` in the thread that waits, ``auto`` (default): a thread when the host has a core to
  spare for it (more cores than ranks on it), since MPI's progress loop polls a core.
"""
from __future__ import annotations

import collections
import contextlib
import os
import re
import threading
import warnings
from typing import Dict, Iterator, Mapping, Optional

SWITCH = "MCALLREDUCE_HOROVOD"
BUCKET_VARIABLE = "MCALLREDUCE_BUCKET_BYTES"
PROGRESS_VARIABLE = "MCALLREDUCE_PROGRESS_THREAD"
DEFAULT_BUCKET_BYTES = 25 << 20   # as DDP's default bucket: a few buckets for a ResNet-50

#: what the plugin did, per kind: "routed" hvd.allreduce* calls, "buckets" of gradients,
#: "fallback" calls handed to stock Horovod, "served_joined" allreduces of other ranks this
#: rank contributed zeros to from inside hvd.join()
counters: collections.Counter = collections.Counter()
_warned: set = set()
_local = threading.local()


def switch(environ: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    """MCALLREDUCE_HOROVOD as True, False or None (unset/auto)."""
    value = (os.environ if environ is None else environ).get(SWITCH, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{SWITCH}={value!r}: allowed values are 1, 0, auto")


def requested_by_startup_hook(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the startup hook patches horovod.torch (no code change in the user's script)."""
    env = os.environ if environ is None else environ
    forced = switch(env)
    if forced is not None:
        return forced
    return bool(env.get("MCALLREDUCE_ALGORITHM", "").strip())


def requested_by_import(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``import mcallreduce.horovod.torch`` patches horovod.torch."""
    return switch(environ) is not False


def bucket_bytes(environ: Optional[Mapping[str, str]] = None) -> int:
    value = (os.environ if environ is None else environ).get(BUCKET_VARIABLE, "").strip()
    if not value:
        return DEFAULT_BUCKET_BYTES
    m = re.match(r"^(\d+)([kKmMgG]?)$", value)
    if not m or int(m.group(1)) == 0:
        raise ValueError(f"{BUCKET_VARIABLE}={value!r}: expected a size > 0 such as 4M or 262144")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def progress_thread(ranks_on_host: int, environ: Optional[Mapping[str, str]] = None) -> bool:
    value = (os.environ if environ is None else environ).get(PROGRESS_VARIABLE, "").strip().lower()
    if value in ("", "auto"):
        return (os.cpu_count() or 1) > ranks_on_host
    if value in ("1", "0"):
        return value == "1"
    raise ValueError(f"{PROGRESS_VARIABLE}={value!r}: allowed values are auto, 1, 0")


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
