"""The start-of-epoch exchange: each rank receives the samples it will read this
epoch that its host does not hold, with MPI Alltoallv.

Nothing is requested: the epoch's assignment of samples to ranks is a pure
function of (seed, epoch, layout) and the partition is a pure function of the
labels and the layout, so every rank computes the same plan and knows what it
sends to whom and what it receives from whom. A sample held by host h is sent
by rank ``ranks_of(h)[id % ranks_on_h]``, spreading the sending over h's ranks.
MPI-3 counts are 32-bit, so the exchange runs in rounds of at most
MCALLREDUCE_DATA_EXCHANGE_ROUND_BYTES per rank (samples go to round id % rounds, with rounds
added until no round is over the bound).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .settings import data as settings
from .store import ImageStore, check_memory_budget


@dataclass
class ExchangePlan:
    ids: np.ndarray      # foreign (sample, destination rank) pairs ...
    dest: np.ndarray
    sender: np.ndarray
    sizes: np.ndarray
    rounds: int

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())


def make_plan(store: ImageStore, assignment: np.ndarray, round_bytes: int) -> ExchangePlan:
    """Every (sample, rank) pair of ``assignment`` (ranks x samples) whose rank's host lacks the sample."""
    layout = store.layout
    n_total = store.num_samples
    world_size, per_rank = assignment.shape
    dest = np.repeat(np.arange(world_size, dtype=np.int64), per_rank)
    pairs = np.unique(dest * n_total + assignment.ravel().astype(np.int64))   # padding repeats count once
    dest, ids = pairs // n_total, pairs % n_total
    host_of_rank = np.asarray(layout.host_of_rank)
    dest_host = host_of_rank[dest]
    foreign = (store.owner[ids] != dest_host) & ~store.host_holds_all[dest_host]
    dest, ids = dest[foreign], ids[foreign]
    src_host = store.owner[ids]
    ranks_per_host = layout.ranks_per_host_array()
    table = np.full((layout.num_hosts, ranks_per_host.max()), -1, dtype=np.int64)
    for h in range(layout.num_hosts):
        table[h, :ranks_per_host[h]] = layout.ranks_of(h)
    sender = table[src_host, ids % ranks_per_host[src_host]]
    sizes = store.offsets[ids + 1] - store.offsets[ids]
    return ExchangePlan(ids, dest, sender, sizes, count_rounds(ids, sender, dest, sizes, world_size, round_bytes))


def busiest_round(ids, sender, dest, sizes, world_size: int, rounds: int) -> int:
    """The most bytes one rank sends or receives in one round, samples dealt to round id % rounds."""
    k = ids % rounds
    return int(max(np.bincount(sender * rounds + k, sizes, world_size * rounds).max(initial=0),
                   np.bincount(dest * rounds + k, sizes, world_size * rounds).max(initial=0)))


def count_rounds(ids, sender, dest, sizes, world_size: int, round_bytes: int) -> int:
    """Enough rounds that no rank sends or receives more than ``round_bytes`` in one (where no
    single sample is larger): dealing by id bounds a round only on average, so add rounds until
    the busiest is under the bound."""
    rounds = max(1, int(np.ceil(busiest_round(ids, sender, dest, sizes, world_size, 1) / round_bytes)))
    while rounds < len(ids) and busiest_round(ids, sender, dest, sizes, world_size, rounds) > round_bytes:
        rounds = min(len(ids), rounds + max(1, rounds // 4))
    return rounds


def exchange_epoch(store: ImageStore, assignment: np.ndarray) -> ExchangePlan:
    """Collective over all ranks: fetch this rank's foreign samples for the epoch into the store's cache."""
    plan = make_plan(store, assignment, settings.exchange_round_bytes())
    world = store.world
    store.install_epoch_cache(None, 0)   # free the last epoch's before checking room for this one
    if plan.total_bytes == 0:
        return plan
    if world is None or world.comm is None:
        raise RuntimeError("this epoch needs samples held by other hosts, but there is no MPI to fetch them; "
                           "open the store with partition='full' or use shuffle_mode='local'")
    me = store.layout.rank
    host_of_rank = np.asarray(store.layout.host_of_rank)
    rounds = plan.ids % plan.rounds
    send = np.nonzero(plan.sender == me)[0]
    send = send[np.lexsort((plan.ids[send], plan.dest[send], rounds[send]))]
    recv = np.nonzero(plan.dest == me)[0]
    recv = recv[np.lexsort((plan.ids[recv], plan.sender[recv], rounds[recv]))]
    error, segment = None, None
    try:
        on_host = host_of_rank == store.layout.host
        incoming = plan.sizes[on_host[plan.dest]].sum()
        # and each of the host's ranks holds one round of what it sends at a time, outside the cache
        per_round = np.bincount(plan.sender * plan.rounds + rounds, plan.sizes, len(host_of_rank) * plan.rounds)
        sending = per_round.reshape(len(host_of_rank), plan.rounds)[on_host].max(axis=1).sum()
        check_memory_budget(int(incoming + sending), f"this epoch's exchange (samples held by other hosts, for "
                            f"host {store.layout.host}'s ranks, and their send buffers)",
                            "Use shuffle_mode='local' or a smaller exchange fraction, or more hosts.")
        segment, cache_ids, cache_positions, cache = store.new_epoch_cache(len(recv), int(plan.sizes[recv].sum()))
    except (MemoryError, OSError) as exc:   # the budget, no room in /dev/shm, a failed mapping: every rank raises
        error = exc
    errors = [e for e in world.comm.allgather(error) if e is not None]
    if errors:
        if segment is not None:
            segment.close()
        raise errors[0]
    positions = np.concatenate([[0], np.cumsum(plan.sizes[recv])[:-1]]).astype(np.int64)

    from mpi4py import MPI
    world_size = store.layout.num_replicas
    base = 0
    for k in range(plan.rounds):
        s = send[rounds[send] == k]
        r = recv[rounds[recv] == k]
        send_counts = np.bincount(plan.dest[s], plan.sizes[s], world_size).astype(np.int64)
        recv_counts = np.bincount(plan.sender[r], plan.sizes[r], world_size).astype(np.int64)
        sendbuf = np.empty(int(send_counts.sum()), dtype=np.uint8)
        at = 0
        for i, size in zip(plan.ids[s], plan.sizes[s]):
            sendbuf[at:at + size] = store.sample_bytes(int(i))
            at += size
        recvbuf = cache[base:base + int(recv_counts.sum())]
        world.comm.Alltoallv([sendbuf, (send_counts, _displs(send_counts)), MPI.BYTE],
                             [recvbuf, (recv_counts, _displs(recv_counts)), MPI.BYTE])
        base += len(recvbuf)
    order = np.argsort(plan.ids[recv])
    cache_ids[:], cache_positions[:] = plan.ids[recv][order], positions[order]
    store.install_epoch_cache(segment, len(recv))
    return plan


def _displs(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
