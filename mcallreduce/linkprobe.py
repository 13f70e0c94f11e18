"""How fast the links between hosts are, measured once per communicator (collective): a
256 KiB message there and back between the first ranks of the first two hosts, three times.
The policy gives large calls longer segments on fast links (policy.FAST_LINK_BYTES_PER_S)."""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import numpy as np

from .errors import ConfigError
from .policy import FAST_LINK_BYTES_PER_S

__all__ = ["PROBE_BYTES", "one_way_bytes_per_s", "fast_links"]

PROBE_BYTES = 256 << 10   # above TCP's eager limit, as the large calls' segments are
_ROUNDS = 3               # the fastest counts: the first also opens the connection
_TAG = 1


def one_way_bytes_per_s(comm, hosts: Sequence[Sequence[int]]) -> float:
    """Bytes a second one way between hosts 0 and 1, as every rank of ``comm`` learns it from the
    first rank of host 0 (0.0 on one host). Collective; ``comm`` must carry no other messages."""
    if len(hosts) < 2:
        return 0.0
    first, second = hosts[0][0], hosts[1][0]
    rank = comm.Get_rank()
    best = math.inf
    if rank in (first, second):
        buf = np.zeros(PROBE_BYTES, np.uint8)
        peer = second if rank == first else first
        for _ in range(_ROUNDS):
            start = time.perf_counter()
            if rank == first:
                comm.Send(buf, peer, _TAG)
                comm.Recv(buf, peer, _TAG)
            else:
                comm.Recv(buf, peer, _TAG)
                comm.Send(buf, peer, _TAG)
            best = min(best, (time.perf_counter() - start) / 2)
    best = comm.bcast(best, root=first)
    return PROBE_BYTES / best


def fast_links(comm, hosts: Sequence[Sequence[int]], setting: Optional[bool]) -> bool:
    """``setting`` (MCALLREDUCE_FAST_LINKS) where the user gave one, else measured. Collective: a
    setting that differs across ranks raises on every rank (some would probe, the others not)."""
    if len(hosts) < 2:
        return False
    settings = comm.allgather(setting)
    if len(set(settings)) > 1:
        named = {None: "auto", True: "1", False: "0"}
        raise ConfigError("mcallreduce: MCALLREDUCE_FAST_LINKS differs across ranks: " +
                          ", ".join(f"rank {r}: {named[v]}" for r, v in enumerate(settings[:8])))
    if setting is not None:
        return setting
    return one_way_bytes_per_s(comm, hosts) >= FAST_LINK_BYTES_PER_S
