"""How fast the links between hosts are, measured once per communicator (collective): a
256 KiB message there and back between the first ranks of the first two hosts, three times; where
that reads fast, a stream of about 20 ms at that speed one way confirms it, timed by the receiver
from its first piece on, since a token-bucket shaper (the emulated cluster's tc tbf) lets a short
message through above the link's rate. On fast links the policy runs large calls as Open MPI's ring,
or in longer segments (policy.FAST_LINK_BYTES_PER_S)."""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import numpy as np

from . import hostlayout
from .policy import FAST_LINK_BYTES_PER_S

__all__ = ["PROBE_BYTES", "STREAM_SECONDS", "STREAM_PIECE_BYTES", "STREAM_PIECES", "stream_seconds",
           "one_way_bytes_per_s", "fast_links", "setting_problem"]

PROBE_BYTES = 256 << 10   # above TCP's eager limit, as the large calls' segments are
_ROUNDS = 3               # the fastest counts: the first also opens the connection
_TAG = 1
STREAM_SECONDS = 0.02     # the confirming stream's length at the first reading's speed
STREAM_PIECE_BYTES = 4 << 20
STREAM_PIECES = (3, 16)   # at least two timed after the first, at most 64 MiB


def one_way_bytes_per_s(comm, hosts: Sequence[Sequence[int]], confirm_from: float = math.inf) -> float:
    """Bytes a second one way between the first ranks of hosts 0 and 1, the same on every rank of
    ``comm`` (0.0 on one host): the fastest of three 256 KiB ping-pongs, and where that reads
    ``confirm_from`` or more, a stream's reading instead. Collective; ``comm`` must carry no
    other messages."""
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
    speed = PROBE_BYTES / comm.bcast(best, root=first)
    if speed < confirm_from:
        return speed
    pieces = min(max(math.ceil(speed * STREAM_SECONDS / STREAM_PIECE_BYTES), STREAM_PIECES[0]), STREAM_PIECES[1])
    seconds = stream_seconds(comm, first, second, pieces) if rank in (first, second) else 0.0
    return (pieces - 1) * STREAM_PIECE_BYTES / comm.bcast(seconds, root=second)


def stream_seconds(comm, sender: int, receiver: int, pieces: int) -> float:
    """On ``receiver``: seconds from the end of the first of ``pieces`` messages that ``sender``
    sends to the end of the last, so the bytes a shaper's bucket lets through at once fall
    mostly before the clock starts (0.0 on ``sender``)."""
    buf = np.zeros(STREAM_PIECE_BYTES, np.uint8)
    if comm.Get_rank() == sender:
        for _ in range(pieces):
            comm.Send(buf, receiver, _TAG)
        return 0.0
    comm.Recv(buf, sender, _TAG)
    start = time.perf_counter()
    for _ in range(pieces - 1):
        comm.Recv(buf, sender, _TAG)
    return max(time.perf_counter() - start, 1e-9)


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
    speed = one_way_bytes_per_s(comm, hosts, confirm_from=FAST_LINK_BYTES_PER_S)
    return speed >= FAST_LINK_BYTES_PER_S


def setting_problem(settings: Sequence[Optional[bool]]) -> Optional[str]:
    """Why every rank's MCALLREDUCE_FAST_LINKS (``settings``, by rank) cannot be followed: some ranks
    would probe and the others not (None where they agree)."""
    odd = [r for r, v in enumerate(settings) if v != settings[0]]
    if not odd:
        return None
    named = {None: "auto", True: "1", False: "0"}
    return (f"mcallreduce: MCALLREDUCE_FAST_LINKS differs across ranks: rank 0: {named[settings[0]]}, " +
            ", ".join(f"rank {r}: {named[settings[r]]}" for r in odd[:8]))
