"""Who runs where: the world layout (which rank is on which host) and MPI access.

The data package works with or without MPI. Under mpirun it asks MPI which
ranks share a node (``COMM_WORLD.Split_type(COMM_TYPE_SHARED)``); without MPI
the caller states ``num_replicas``/``rank`` (and optionally ``ranks_per_host``),
or, as torch's DistributedSampler does, they come from an initialised torch.distributed
(torchrun; ``LOCAL_WORLD_SIZE`` ranks a host). MCALLREDUCE_RANKS_PER_HOST makes
consecutive ranks emulate hosts, to exercise multi-host code on one machine.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from .. import hostlayout
from .settings import data as settings
from ..launch import launched_by_mpirun


def mpi():
    """The mpi4py MPI module when this process should use MPI, else None.

    'auto' means: launched by mpirun, or MPI already imported by the program
    (Horovod scripts import it first). A plain ``python`` run never calls MPI_Init.
    """
    wanted = settings.use_mpi()
    if wanted is False:
        return None
    if wanted is None and "mpi4py.MPI" not in sys.modules and not launched_by_mpirun():
        return None
    from mpi4py import MPI
    return MPI


@dataclass(frozen=True)
class Layout:
    """The host of every rank (hosts numbered in the order of their lowest rank) and this rank."""
    host_of_rank: Tuple[int, ...]
    rank: int

    def __post_init__(self):
        if not 0 <= self.rank < len(self.host_of_rank):
            raise ValueError(f"rank {self.rank} is outside [0, {len(self.host_of_rank)})")
        seen = []
        for h in self.host_of_rank:
            if h not in seen:
                seen.append(h)
        if seen != list(range(len(seen))):
            raise ValueError(f"hosts must be numbered 0.. in order of their first rank: {self.host_of_rank}")

    @classmethod
    def uniform(cls, num_replicas: int, rank: int, ranks_per_host: Optional[int] = None) -> "Layout":
        """``num_replicas`` ranks, ``ranks_per_host`` consecutive ranks a host (default: one host)."""
        per = ranks_per_host or num_replicas
        if per < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {per}")
        return cls(tuple(r // per for r in range(num_replicas)), rank)

    @property
    def num_replicas(self) -> int:
        return len(self.host_of_rank)

    @property
    def num_hosts(self) -> int:
        return max(self.host_of_rank) + 1

    @property
    def host(self) -> int:
        return self.host_of_rank[self.rank]

    def ranks_of(self, host: int) -> Sequence[int]:
        return [r for r, h in enumerate(self.host_of_rank) if h == host]

    @property
    def local_rank(self) -> int:
        return self.ranks_of(self.host).index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.ranks_of(self.host))

    def ranks_per_host_array(self) -> np.ndarray:
        return np.bincount(np.asarray(self.host_of_rank), minlength=self.num_hosts)


@dataclass
class World:
    """A layout plus, under MPI, the world and host communicators (None without MPI)."""
    layout: Layout
    comm: object = None
    host_comm: object = None

    @property
    def is_leader(self) -> bool:
        return self.layout.local_rank == 0

    def host_bcast(self, value):
        return self.host_comm.bcast(value, root=0) if self.host_comm is not None else value

    def host_barrier(self) -> None:
        """Wait for the host's ranks in short naps, outside MPI, so that a signal's Python
        handler can run meanwhile (shm.py)."""
        if self.host_comm is not None:
            request = self.host_comm.Ibarrier()
            while not request.Test():
                time.sleep(0.001)

    def host_any(self, flag: bool) -> bool:
        """True on every local rank when ``flag`` is true on any (a collective over the host)."""
        if self.host_comm is None:
            return flag
        return bool(self.host_comm.allreduce(int(flag), op=self._mpi.MAX))

    def world_any(self, flag: bool) -> bool:
        if self.comm is None:
            return flag
        return bool(self.comm.allreduce(int(flag), op=self._mpi.MAX))

    def world_bcast(self, value):
        return self.comm.bcast(value, root=0) if self.comm is not None else value

    @property
    def _mpi(self):
        from mpi4py import MPI
        return MPI


def _torch_world() -> Tuple[int, int]:
    """(size, rank) without MPI: torch.distributed's when it is initialised (torchrun), as
    DistributedSampler takes it; a plain ``python`` run is a world of one."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
    launched = int(os.environ.get("WORLD_SIZE") or 1)
    if launched > 1:
        raise RuntimeError(f"mcallreduce.data: WORLD_SIZE={launched} (a torchrun-style launch) but neither MPI nor "
                           "torch.distributed is initialised; call torch.distributed.init_process_group() first, "
                           "or pass num_replicas and rank")
    return 1, 0


def current(num_replicas: Optional[int] = None, rank: Optional[int] = None,
            ranks_per_host: Optional[int] = None) -> World:
    """The world this process is in: from MPI when it is used, else from the arguments."""
    ranks_per_host = ranks_per_host or settings.ranks_per_host()
    MPI = mpi() if num_replicas is None or rank is None else None
    if MPI is None:
        if num_replicas is None or rank is None:   # the missing one from the world, as DistributedSampler
            size, me = _torch_world()
            num_replicas, rank = (size if num_replicas is None else num_replicas), (me if rank is None else rank)
            ranks_per_host = ranks_per_host or int(os.environ.get("LOCAL_WORLD_SIZE") or 0) or None
        if not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        return World(Layout.uniform(num_replicas, rank, ranks_per_host))
    comm = MPI.COMM_WORLD
    if num_replicas not in (None, comm.size) or rank not in (None, comm.rank):
        raise ValueError(f"num_replicas={num_replicas}, rank={rank} differ from MPI's world "
                         f"({comm.size} ranks, this is rank {comm.rank}); pass both to state another world")
    node = hostlayout.host_comm(comm, ranks_per_host)
    return World(Layout(hostlayout.host_of_rank(comm, node), comm.rank), comm, node)
