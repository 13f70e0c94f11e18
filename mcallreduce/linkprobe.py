"""How fast the links between hosts are, measured once per communicator (collective): a
256 KiB message there and back between the first ranks of the first two hosts, three times.
The policy gives large calls longer segments on fast links (policy.FAST_LINK_BYTES_PER_S)."""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import numpy as np

from . import hostlayout
from .policy import FAST_LINK_BYTES_PER_S

__all__ = ["PROBE_BYTES", "one_way_bytes_per_s", "fast_links", "setting_problem"]

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


def fast_links(comm, hosts: Sequence[Sequence[int]], setting: Optional[bool], emulated: bool = False) -> bool:
    """``setting`` (MCALLREDUCE_FAST_LINKS, the same on every rank) where the user gave one, else
    measured. Collective. ``emulated``: ``hosts`` were grouped by MCALLREDUCE_RANKS_PER_HOST, and
    two of them on one machine have no link between them, whatever their shared memory measures
    (real hosts are apart by construction)."""
    if len(hosts) < 2:
        return False
    if setting is not None:
        return setting
    if emulated:
        real = hostlayout.host_comm(comm)
        try:
            node_of = hostlayout.host_of_rank(comm, real)
        finally:
            real.Free()
        if node_of[hosts[0][0]] == node_of[hosts[1][0]]:
            return False
    return one_way_bytes_per_s(comm, hosts) >= FAST_LINK_BYTES_PER_S


def setting_problem(settings: Sequence[Optional[bool]]) -> Optional[str]:
    """Why every rank's MCALLREDUCE_FAST_LINKS (``settings``, by rank) cannot be followed: some ranks
    would probe and the others not (None where they agree)."""
    odd = [r for r, v in enumerate(settings) if v != settings[0]]
    if not odd:
        return None
    named = {None: "auto", True: "1", False: "0"}
    return (f"mcallreduce: MCALLREDUCE_FAST_LINKS differs across ranks: rank 0: {named[settings[0]]}, " +
            ", ".join(f"rank {r}: {named[settings[r]]}" for r in odd[:8]))
