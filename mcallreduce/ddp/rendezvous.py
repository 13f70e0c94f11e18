"""torch.distributed from the MPI world: ``mpirun -np N python train.py`` needs no MASTER_ADDR.

Rank and size come from MPI. Rank 0 starts torch's TCPStore on a port the kernel picks and
sends its address and port to the others over MPI; the address is the one rank 0 reaches
the other hosts from (the source address of a route to a peer's interface), or loopback
when the whole job is on one host. ``MASTER_ADDR`` / ``MASTER_PORT``, when set, win.

Three ways in: :func:`init_process_group`; ``init_method="mcallreduce://"``; and, once
:mod:`mcallreduce.ddp` is imported, torch's default ``env://`` in a process that an MPI
launcher started without ``MASTER_ADDR`` (where torch itself would raise).
"""
from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct
from typing import Callable, List, Optional, Tuple
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

from ..hostlayout import all_on_one_host
from ..launch import launched_by_mpirun

__all__ = ["init_process_group", "store_from_mpi", "mpi_rendezvous", "env_or_mpi_rendezvous", "check_matches_mpi",
           "require_mpi_ranks", "interface_addresses"]

_SIOCGIFADDR = 0x8915   # Linux ioctl: an interface's IPv4 address


def interface_addresses() -> List[Tuple[str, str]]:
    """(interface, IPv4 address) of every interface that has one, loopback excluded."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:      # no IPv4 address
                continue
            address = socket.inet_ntoa(reply[20:24])
            if not address.startswith("127."):
                out.append((name, address))
    return out


def _source_address(peer: str) -> str:
    """This host's address on the route to ``peer`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((peer, 9))
        return sock.getsockname()[0]


def _interface_of(address: str) -> Optional[str]:
    return next((name for name, addr in interface_addresses() if addr == address), None)


def _rank0_address(comm) -> str:
    """The address the other ranks reach rank 0 at (collective)."""
    if all_on_one_host(comm):
        return "127.0.0.1"
    mine = [addr for _, addr in interface_addresses()]
    everyone = comm.gather(mine, root=0)
    address = None
    if comm.Get_rank() == 0:
        own = set(everyone[0])
        for addresses in everyone[1:]:
            remote = [a for a in addresses if a not in own]
            if remote:
                address = _source_address(remote[0])
                break
        address = address or (everyone[0][0] if everyone[0] else socket.gethostname())
    return comm.bcast(address, root=0)


def store_from_mpi(comm=None, timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> dist.TCPStore:
    """torch's key-value store for the ranks of ``comm`` (default COMM_WORLD), rendezvous over MPI.

    Sets ``GLOO_SOCKET_IFNAME`` (when unset) to the interface this rank reaches rank 0 from,
    so gloo does not bind the address its host name resolves to (absent in a network namespace).
    """
    from mpi4py import MPI
    comm = comm or MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    address = os.environ.get("MASTER_ADDR") or _rank0_address(comm)
    port = int(os.environ.get("MASTER_PORT") or 0)
    store = None
    if rank == 0:
        store = dist.TCPStore(address, port, size, True, timeout=timeout, wait_for_workers=False)
        port = store.port
    port = comm.bcast(port, root=0)
    if rank != 0:
        store = dist.TCPStore(address, port, size, False, timeout=timeout)
    if "GLOO_SOCKET_IFNAME" not in os.environ and not address.startswith("127."):
        nic = _interface_of(_source_address(address))
        if nic:
            os.environ["GLOO_SOCKET_IFNAME"] = nic
    return store


def mpi_rendezvous(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30), environ=None, **kwargs):
    """A torch rendezvous handler: rank, size and torch's store from the MPI world.

    A rank or world size that torch put into ``url`` (from ``init_process_group``'s arguments),
    or that ``environ`` sets as ``RANK`` / ``WORLD_SIZE`` (``env://``, where torch leaves them out
    of the url), must be MPI's; every rank raises where one differs."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    claimed = {key: int(values[0]) for key, values in parse_qs(urlparse(url).query).items()
               if key in ("rank", "world_size") and int(values[0]) != -1}
    for key, var in (("rank", "RANK"), ("world_size", "WORLD_SIZE")):
        value = (environ or {}).get(var, "").strip()
        if key not in claimed and value.lstrip("-").isdigit() and int(value) != -1:
            claimed[key] = int(value)
    mine = (claimed.get("rank", comm.Get_rank()), claimed.get("world_size", comm.Get_size()))
    # all at once: a rank that raised alone would leave the others in the store's collective
    if not comm.allreduce(mine == (comm.Get_rank(), comm.Get_size()), op=MPI.LAND):
        require_mpi_ranks(*mine, comm, "torch.distributed over the MPI world")
        raise RuntimeError("torch.distributed over the MPI world: another rank's rank or world size is not "
                           "MPI's (its error says which)")
    yield store_from_mpi(comm, timeout), comm.Get_rank(), comm.Get_size()


def env_or_mpi_rendezvous(env_handler: Callable) -> Callable:
    """torch's ``env://`` handler, or :func:`mpi_rendezvous` where an MPI launcher started the
    process and ``MASTER_ADDR`` is unset (where ``env://`` would raise)."""
    def handler(url: str, **kwargs):
        if "MASTER_ADDR" not in os.environ and launched_by_mpirun():
            return mpi_rendezvous(url, environ=os.environ, **kwargs)
        return env_handler(url, **kwargs)
    handler.env_handler = env_handler
    return handler


def init_process_group(backend: str = "gloo", comm=None, timeout: Optional[datetime.timedelta] = None,
                       **kwargs) -> None:
    """``torch.distributed.init_process_group`` over the MPI world (default COMM_WORLD).

    ``backend`` is any torch backend: ``"gloo"`` for a DDP job using :func:`multicolor_hook`,
    ``"mcallreduce"`` for the backend of :mod:`mcallreduce.ddp.backend`. Collective.
    """
    from mpi4py import MPI
    comm = comm or MPI.COMM_WORLD
    timeout = timeout or datetime.timedelta(minutes=30)
    store = store_from_mpi(comm, timeout)
    dist.init_process_group(backend, store=store, rank=comm.Get_rank(), world_size=comm.Get_size(),
                            timeout=timeout, **kwargs)


def check_matches_mpi(group=None, comm=None, what: str = "mcallreduce") -> None:
    """Raise unless torch.distributed's ``group`` has the ranks of the MPI communicator, in order."""
    if not dist.is_initialized():
        raise RuntimeError(f"{what}: torch.distributed is not initialised; call "
                           "mcallreduce.ddp.init_process_group() (under mpirun) first")
    require_mpi_ranks(dist.get_rank(group), dist.get_world_size(group), comm, what)


def require_mpi_ranks(torch_rank: int, torch_size: int, comm=None, what: str = "mcallreduce",
                      advice: str = "") -> None:
    """Raise unless torch's (rank, size) are the MPI communicator's (default COMM_WORLD).

    A torchrun launch without mpirun makes every process an MPI world of one: reducing over
    it would "average" each rank with itself and nobody would notice. Where the sizes agree the
    check is collective over ``comm``: every rank raises where one rank differs (a rank that
    matched would wait alone in the collectives that follow). A size that differs raises at once:
    a subgroup's ranks call this without the others.
    """
    from mpi4py import MPI
    comm = comm or MPI.COMM_WORLD
    mine = (torch_rank, torch_size) == (comm.Get_rank(), comm.Get_size())
    if torch_size == comm.Get_size() and comm.allreduce(mine, op=MPI.LAND):
        return
    if mine:
        raise RuntimeError(f"{what}: another rank's torch.distributed rank or world size is not its MPI rank "
                           f"or size; the allreduce runs over MPI, so the two must be the same ranks in the "
                           f"same order{advice}")
    hint = (" (each process is an MPI world of one: was the job started without mpirun, e.g. by "
            "torchrun? launch it with mpirun or horovodrun)" if comm.Get_size() == 1 and torch_size > 1 else "")
    raise RuntimeError(f"{what}: torch.distributed has rank {torch_rank} of {torch_size} but the MPI "
                       f"communicator has rank {comm.Get_rank()} of {comm.Get_size()}{hint}; the allreduce "
                       f"runs over MPI, so the two must be the same ranks in the same order{advice}")
