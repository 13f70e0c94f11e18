"""Which ranks share a host: the one place the engine, the data package and the DDP layer ask MPI.

Hosts are numbered in the order of their lowest rank. ``ranks_per_host`` (the value of
``MCALLREDUCE_RANKS_PER_HOST``) groups consecutive ranks of COMM_WORLD into emulated hosts
instead, so that multi-host code runs on one machine. Every function here is collective over ``comm``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

__all__ = ["host_comm", "host_of_rank", "hosts", "all_on_one_host"]


def host_comm(comm, ranks_per_host: Optional[int] = None):
    """This rank's host communicator, ranks in ``comm``'s order; the caller frees it."""
    from mpi4py import MPI
    if ranks_per_host:   # emulated hosts hold consecutive ranks of the job, whatever comm's order
        return comm.Split(MPI.COMM_WORLD.Get_rank() // ranks_per_host, comm.Get_rank())
    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())


def host_of_rank(comm, node) -> Tuple[int, ...]:
    """Every rank's host number, given each rank's host communicator ``node``."""
    leaders = comm.allgather(node.bcast(comm.Get_rank(), root=0))   # each host's lowest rank
    number = {leader: h for h, leader in enumerate(sorted(set(leaders)))}
    return tuple(number[leader] for leader in leaders)


def hosts(comm, ranks_per_host: Optional[int] = None) -> List[List[int]]:
    """The ranks of each host, in host order."""
    node = host_comm(comm, ranks_per_host)
    try:
        of = host_of_rank(comm, node)
    finally:
        node.Free()
    return [[rank for rank, host in enumerate(of) if host == h] for h in range(max(of) + 1)]


def all_on_one_host(comm) -> bool:
    """Whether every rank of ``comm`` shares this machine's memory (real hosts, not emulated)."""
    node = host_comm(comm)
    together = node.Get_size() == comm.Get_size()
    node.Free()
    return together
