"""The selection policy: which algorithm and schedule parameters run one allreduce.

``resolve(config, nbytes, itemsize, hosts)`` turns the user's settings (``auto`` left
as None by :mod:`mcallreduce.config`) into a concrete algorithm and :class:`Params`. ``multicolor``
follows a tuning table (:mod:`mcallreduce.tuning`): ``MCALLREDUCE_TUNING_FILE`` when set, else the
built-in measured one, and none with ``MCALLREDUCE_TUNING_FILE=none``; its rows measured with
nonblocking calls decide ``allreduce_async``'s, where it has them. Where the table has no rows for
the layout, or is off, the size rules below decide. Pure Python, no MPI: tests check its choices directly.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence, Tuple

from .algorithms import Params
from .algorithms.doubling import fold
from .cgroups import usable_cores
from .config import ALGORITHMS, MPI_ALGORITHMS, ROUTES, Config, ConfigError, progress_thread_setting
from .tuning import BUILTIN_TABLE, check_file, has_nonblocking_rows, lookup

__all__ = ["ALGORITHMS", "ROUTES", "FUSED_MAX_BYTES", "fused_with_check", "resolve", "measured_nonblocking",
           "table_problem", "default_colors", "latency_bound", "fold_crosses_hosts", "progress_thread"]

#: a ``doubling`` or ``halving`` call up to this size travels with its metadata check
#: (native/check.c): its data is reduced along the check's own exchanges, one latency for both
FUSED_MAX_BYTES = 256 << 10
FUSED_ALGORITHMS = ("doubling", "halving")


def fused_with_check(algorithm: str, nbytes: int) -> bool:
    """Whether a call of ``algorithm`` on ``nbytes`` is reduced along its own metadata check."""
    return algorithm in FUSED_ALGORITHMS and nbytes <= FUSED_MAX_BYTES

# Defaults by message size, in the spirit of Blue Gene/Q's colors-by-size table:
# small messages are latency-bound (one tree, one message per hop), large ones are
# bandwidth-bound (every host a root of some color, pipelined in segments); the measurements
# behind each bound: docs/algorithms.md, "Defaults by message size".
SMALL_BYTES = 16 << 10     # <= this: one color, no pipelining
MEDIUM_BYTES = 256 << 10   # <= this: two colors, no pipelining
SEGMENT_BYTES = 256 << 10  # pipeline segment for large messages
PIPELINE_MIN_SEGMENTS = 4  # pipeline a color only if it gets at least this many segments: fewer adds
                           # messages without overlapping much (docs/algorithms.md, "Defaults by message size")
STAR_MAX_HOSTS = 8         # up to this many hosts, one color per host (direct reduce-scatter)
# From 256 KiB the colors cross hosts on rings, not trees (route "ring", one ring per local
# rank): the same bytes per NIC, but each host sends to one neighbour, one way, which kept
# shaped links busier; trees keep the small messages, where 2 log(N) hops beat the ring's
# 2(N-1) (measurements: docs/defaults-hosts.md, "Trees or rings across hosts").
RING_ROUTE_MIN_BYTES = 256 << 10
RING_ROUTE_MAX_HOSTS = 8   # measured up to 8 hosts; beyond, the ring's 2(N-1) hops are untested
# The latency regime of the multicolor family: log2(p) exchanges of the whole message
# (algorithms/doubling.py) instead of a reduce up a tree and a broadcast down it
# (2 log2(p) message latencies). Two ranks exchange n bytes each way either way, so
# for a pair doubling saves a round trip and costs twice the reduction work, which pays
# only for small messages (measured: docs/algorithms.md, "doubling").
DOUBLING_BYTES = SMALL_BYTES
DOUBLING_PAIR_BYTES = 256 << 10
# Across hosts, above the latency regime and up to the fused limit, halving fused with its check
# beat MPI's allreduce after the check and our trees on every power-of-two layout of more than two
# ranks measured, at both link speeds (docs/algorithms.md, "Halving along the check"); a pair across
# hosts keeps doubling up to PAIR_HALVING_ABOVE_BYTES, where halving's second round starts to pay.
HALVING_BETWEEN_BYTES = (DOUBLING_BYTES, FUSED_MAX_BYTES)
PAIR_HALVING_ABOVE_BYTES = 64 << 10
# A rank count that is not a power of two folds its extra ranks in and out of halving; where a
# folding pair sits on two hosts, its whole buffer crosses their link twice more, and from this size
# the ring was about as fast on 3 and 5 hosts at 10 Gbit/s and took 0.52-0.70 of halving's time at
# 200 Mbit/s (docs/defaults-hosts.md, "Three hosts: the rules against a measured table").
FOLDED_RING_FROM_BYTES = 128 << 10
# Eager-sized segments (inter_host_segment) keep a slow link busy from the first bytes; on a fast
# link their per-message CPU is what costs, and from FAST_LINK_LARGE_BYTES 256 KiB segments on the
# ring route were faster on 2, 3 and 4 hosts at 10 Gbit/s (docs/defaults-hosts.md, "Fast links:
# larger segments for large calls"). A link is fast from FAST_LINK_BYTES_PER_S one way as
# linkprobe.py measures it, far from the 200 Mbit/s links' reading and below the 10 Gbit/s ones'.
FAST_LINK_BYTES_PER_S = 500e6      # 4 Gbit/s
FAST_LINK_LARGE_BYTES = 16 << 20
FAST_LINK_SEGMENT_BYTES = 256 << 10
# Where Open MPI's ring exists, from 4 MiB on fast links it ran faster than those schedules after the
# check on 2-4 hosts (5-8 unmeasured); with several ranks per host only below FAST_LINK_LARGE_BYTES,
# where the hierarchical schedule's segments take over (docs/defaults-hosts.md, "Fast links: Open MPI's ring").
FAST_LINK_MPI_RING_FROM_BYTES = 4 << 20


def fold_crosses_hosts(hosts: Sequence[Sequence[int]]) -> bool:
    """Whether doubling's and halving's fold (algorithms/doubling.py) hands a buffer between hosts."""
    ranks, _, rem, _ = fold(hosts)
    host_of = {rank: i for i, host in enumerate(hosts) for rank in host}
    return any(host_of[ranks[2 * i]] != host_of[ranks[2 * i + 1]] for i in range(rem))


def default_colors(nbytes: int, nhosts: int, max_local: int) -> int:
    if nbytes <= SMALL_BYTES:
        return 1
    if nbytes <= MEDIUM_BYTES:
        return max(1, min(2, nhosts * max_local))
    if nhosts <= STAR_MAX_HOSTS:
        return max(nhosts, max_local)
    return max(2, max_local)


def _table_path(config: Config) -> Optional[str]:
    """The tuning table that multicolor's ``auto`` follows: the configured one, else the built-in
    measured one; None where no table applies."""
    if config.algorithm != "multicolor" or config.tuning_file == "none":
        return None
    return config.tuning_file or BUILTIN_TABLE


def table_problem(config: Config) -> Optional[str]:
    """Why the tuning table ``config`` follows cannot be followed (gone, unreadable, malformed), or None."""
    path = _table_path(config)
    try:
        if path is not None:
            check_file(path)
    except ConfigError as exc:
        return str(exc)
    return None


def _tuned(config: Config, hosts: Sequence[Sequence[int]], nbytes: int,
           itemsize: int, nonblocking: bool, mpi_ok: bool) -> Optional[Tuple[str, Params]]:
    """The tuning table's choice for this layout, size and call kind (one MPI's allreduce can serve
    or not); None where the table has no row for this layout, or no choice for such a call."""
    path = _table_path(config)
    if path is None:
        return None
    return lookup(hosts, nbytes, itemsize, path=path, nonblocking=nonblocking, mpi_ok=mpi_ok)


def measured_nonblocking(config: Config, hosts: Sequence[Sequence[int]]) -> bool:
    """Whether a nonblocking call's table pick comes from rows measured with nonblocking calls
    (so that a pick of MPI's allreduce was timed as ``MPI_Iallreduce``)."""
    path = _table_path(config)
    return path is not None and has_nonblocking_rows(hosts, path=path)


def latency_bound(nbytes: int, nranks: int) -> bool:
    """Whether ``auto`` runs a multicolor call as recursive doubling (see DOUBLING_*_BYTES)."""
    return nranks > 1 and (nbytes <= DOUBLING_BYTES or (nranks == 2 and nbytes <= DOUBLING_PAIR_BYTES))


def _slices(config: Config, colors: int, hosts: Sequence[Sequence[int]]) -> int:
    """How many pieces the algorithm cuts a message into at most: ring chunks, color slices,
    or halving's first round (half the buffer each way)."""
    if config.algorithm == "ring":
        return sum(len(h) for h in hosts)
    if config.algorithm == "halving":
        return 2
    return 1 if config.algorithm == "doubling" else colors


def _single_copy(config: Config, nbytes: int, available: bool) -> bool:
    """Whether a one-host stage of ``nbytes`` reads the peers' buffers directly (``available``:
    the kernel lets every rank do it, and the call has no prescale)."""
    return available and 0 < config.single_copy_bytes <= nbytes


def _mpi_arm(algorithm: str, mpi_ring: bool) -> str:
    """``mpi-ring`` where this communicator has Open MPI's ring, else MPI's default decision."""
    return "mpi" if algorithm == "mpi-ring" and not mpi_ring else algorithm


def resolve(config: Config, nbytes: int, itemsize: int,
            hosts: Sequence[Sequence[int]], shared_slot: int = 0, mpi_type: bool = True,
            single_copy_ok: bool = False, mpi_ring: bool = False, small_slot: int = 0,
            nonblocking: bool = False, fast_links: bool = False) -> Tuple[str, Params]:
    """Concrete algorithm and schedule parameters for one message of ``nbytes``.

    ``shared_slot``: bytes per slot of the caller's shared-memory window (0: none).
    ``single_copy_ok``: whether the one-host stage could read the peers' buffers directly for
    this call (the kernel allows it, no prescale); from ``config.single_copy_bytes`` on it
    does, and then needs no slot of the message's size.
    ``mpi_type``: whether MPI's allreduce can serve the call (MPI has the element type, which
    float16 lacks), so that a table that picked it for this size can be followed; where not,
    the row's measured "instead" runs (docs/algorithms.md, "mpi").
    ``mpi_ring``: whether every rank has a communicator running Open MPI's ring
    (:mod:`mcallreduce.mpit`); without it ``mpi-ring`` runs as ``mpi``.
    ``small_slot``: bytes of the window's small slots; up to ``config.one_sync_bytes`` and
    that size, the one-host stage synchronises once.
    ``nonblocking``: the call is ``allreduce_async``'s, which a table's nonblocking rows decide.
    ``fast_links``: the links between hosts run at FAST_LINK_BYTES_PER_S or more one way (with
    ``mpi_ring``, large calls then run Open MPI's ring).
    """
    if config.algorithm in MPI_ALGORITHMS:
        return _mpi_arm(config.algorithm, mpi_ring), Params(depth=config.depth)
    max_local = max(len(h) for h in hosts)
    nranks = sum(len(h) for h in hosts)
    # the shared-memory stage, the latency regime (doubling) and the tuning table apply
    # only while no multicolor knob is set
    knobs_unset = (config.colors, config.segment_bytes, config.fanout, config.hierarchy, config.route) == (None,) * 5
    single_copy = _single_copy(config, nbytes, single_copy_ok)
    shared_fits = (len(hosts) == 1 and nranks > 1 and shared_slot > 0 and config.shm_bytes > 0
                   and (nbytes <= min(config.shm_bytes, shared_slot) or single_copy))
    # a call MPI's allreduce cannot serve takes the row's fastest other candidate, else the rules
    hit = _tuned(config, hosts, nbytes, itemsize, nonblocking, mpi_type) if knobs_unset and nranks > 1 else None
    if hit is not None and hit[1].shared and not shared_fits:   # a row measured with the stage: the rules instead
        hit = None
    if hit is not None and hit[0] != "multicolor":      # the table picked another algorithm
        return _mpi_arm(hit[0], mpi_ring), Params(segment=hit[1].segment, depth=config.depth)
    if config.algorithm == "multicolor" and knobs_unset and shared_fits and (hit is None or hit[1].shared):
        one_sync = 0 < config.one_sync_bytes and nbytes <= min(config.one_sync_bytes, small_slot)   # 0: off
        return "multicolor", Params(colors=nranks, hierarchical=True, depth=config.depth, shared=True,
                                    single_copy=single_copy and not one_sync, one_sync=one_sync)
    # blocking, checked calls only: MPI's blocking call runs only where every rank waits for it alone
    # (native/executor.c), and elsewhere the rules' schedule would lose its data before the check
    if (config.algorithm == "multicolor" and knobs_unset and hit is None and fast_links and mpi_ring and mpi_type
            and config.check and not nonblocking and 1 < len(hosts) <= RING_ROUTE_MAX_HOSTS
            and FAST_LINK_MPI_RING_FROM_BYTES <= nbytes and (max_local == 1 or nbytes < FAST_LINK_LARGE_BYTES)):
        return "mpi-ring", Params(depth=config.depth)
    halving_above = PAIR_HALVING_ABOVE_BYTES if nranks == 2 else HALVING_BETWEEN_BYTES[0]
    if (config.algorithm == "multicolor" and knobs_unset and hit is None and len(hosts) > 1
            and halving_above < nbytes <= HALVING_BETWEEN_BYTES[1]):
        if nbytes >= FOLDED_RING_FROM_BYTES and fold_crosses_hosts(hosts):
            return resolve(config.with_overrides(algorithm="ring"), nbytes, itemsize, hosts, fast_links=fast_links)
        return "halving", Params(segment=0, depth=config.depth)
    if config.algorithm == "multicolor" and knobs_unset and hit is None and latency_bound(nbytes, nranks):
        return "doubling", Params(segment=0, depth=config.depth)
    tuned = hit[1] if hit is not None and hit[0] == "multicolor" else None
    if config.hierarchy is not None:
        hierarchical = config.hierarchy
    else:
        hierarchical = tuned.hierarchical if tuned else max_local > 1
    nodes = len(hosts) if hierarchical else nranks
    route = config.route or (tuned.route if tuned else
                             "ring" if 1 < len(hosts) <= RING_ROUTE_MAX_HOSTS and nbytes >= RING_ROUTE_MIN_BYTES
                             else "tree")
    if route == "ring" and not config.colors and not tuned:
        colors = max_local if hierarchical else 1    # one ring per local rank
    else:
        colors = config.colors or (tuned.colors if tuned else
                                   default_colors(nbytes, nodes, max_local if hierarchical else 1))
    if config.segment_bytes is not None:
        segment = max(1, config.segment_bytes // itemsize) if config.segment_bytes else 0
    elif tuned:
        segment = tuned.segment
    elif len(hosts) > 1 and fast_links and route == "ring" and nbytes >= FAST_LINK_LARGE_BYTES:
        segment = FAST_LINK_SEGMENT_BYTES // itemsize
    elif len(hosts) > 1 and nbytes // _slices(config, colors, hosts) > config.inter_host_segment:
        segment = config.inter_host_segment // itemsize
    elif nbytes // _slices(config, colors, hosts) >= PIPELINE_MIN_SEGMENTS * SEGMENT_BYTES:
        segment = SEGMENT_BYTES // itemsize
    else:
        segment = 0
    if config.algorithm in ("ring", "doubling", "halving"):
        return config.algorithm, Params(segment=segment, depth=config.depth)
    return config.algorithm, Params(colors=colors, segment=segment, fanout=config.fanout,
                                    hierarchical=hierarchical, depth=config.depth, route=route)


def progress_thread(hosts: Sequence[Sequence[int]], environ: Optional[Mapping[str, str]] = None,
                    cores: Optional[float] = None) -> bool:
    """Whether the Horovod plugin and the DDP hook start the progress thread on this layout: as
    ``MCALLREDUCE_PROGRESS_THREAD`` says, and on ``auto`` only where every host has a core to spare
    for it (more cores than ranks), since MPI's progress loop polls a core while allreduces are
    in flight (an idle thread sleeps). ``cores``: a host's usable cores (default: this process's,
    its affinity and cgroup quota counted, :func:`mcallreduce.cgroups.usable_cores`)."""
    forced = progress_thread_setting(environ)
    if forced is not None:
        return forced
    return (usable_cores() if cores is None else cores) > max(len(host) for host in hosts)
