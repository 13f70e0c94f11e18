"""Configuration: the library's ``MCALLREDUCE_*`` variables are parsed here, and only here (the
emulated cluster's own two, for its tools, are in docs/cluster.md).

| variable                     | values                         | default    |
|------------------------------|--------------------------------|------------|
| MCALLREDUCE_ALGORITHM        | multicolor, ring, doubling, halving, mpi, mpi-ring | multicolor |
| MCALLREDUCE_COLORS           | auto, or an integer >= 1       | auto       |
| MCALLREDUCE_SEGMENT_BYTES    | auto, or a size (256K, 1M, 0)  | auto       |
| MCALLREDUCE_FANOUT           | auto, or an integer >= 2       | auto       |
| MCALLREDUCE_HIERARCHY        | auto, 1, 0                     | auto       |
| MCALLREDUCE_ROUTE            | auto, tree, ring               | auto       |
| MCALLREDUCE_PIPELINE_DEPTH   | an integer >= 1                | 4          |
| MCALLREDUCE_SHM_BYTES        | a size (8M), 0 = off           | 8M         |
| MCALLREDUCE_SINGLE_COPY_BYTES| a size (64K), 0 = off          | 64K        |
| MCALLREDUCE_ONE_SYNC_BYTES   | a size (32K), 0 = off          | 32K        |
| MCALLREDUCE_CHECK            | 1, 0                           | 1          |
| MCALLREDUCE_VERBOSE          | 0, 1                           | 0          |
| MCALLREDUCE_RANKS_PER_HOST   | auto, or an integer >= 1       | auto       |
| MCALLREDUCE_TUNING_FILE      | a tuning table (JSON), none    | built-in   |
| MCALLREDUCE_POLL_US          | microseconds a wait polls      | 1000       |
| MCALLREDUCE_FAST_LINKS       | auto, 1, 0                     | auto       |

The Horovod plugin's (functions at the end of this module, read when asked: the startup hook's
.pth file decides from ``MCALLREDUCE_HOROVOD`` and ``MCALLREDUCE_ALGORITHM`` before anything heavy
is imported, so this module and its parsers import only the standard library):

| variable                     | values                         | default    |
|------------------------------|--------------------------------|------------|
| MCALLREDUCE_HOROVOD          | auto, 1, 0                     | auto       |
| MCALLREDUCE_BUCKET_BYTES     | a size (25M, 4M)               | 25M        |
| MCALLREDUCE_PROGRESS_THREAD  | auto, 1, 0                     | auto       |
| MCALLREDUCE_GRADIENT_AS_BUCKET_VIEW | 1, 0                    | 0          |
| MCALLREDUCE_TIMELINE         | a file (Chrome trace)          | HOROVOD_TIMELINE |

the stall inspector's ``MCALLREDUCE_STALL_CHECK_TIME_SECONDS`` (60), ``MCALLREDUCE_STALL_CHECK_DISABLE``
and ``MCALLREDUCE_STALL_SHUTDOWN_TIME_SECONDS`` (each falling back to Horovod's ``HOROVOD_*``
of the same name). The data package's ``MCALLREDUCE_DATA_*`` variables are parsed in
:mod:`mcallreduce.data.settings` (docs/data.md lists them). Read once, at first use (like Horovod's); a
process that changes them later calls :func:`reload`. ``auto`` values are resolved per message size by
:func:`mcallreduce.policy.resolve` (this module only parses). ``MCALLREDUCE_RANKS_PER_HOST`` groups
consecutive ranks into virtual hosts, to exercise the hierarchical schedules on one machine.
``MCALLREDUCE_TUNING_FILE`` names a table written by ``python -m mcallreduce.bench tune`` (:mod:`mcallreduce.tuning`).
"""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, replace
from typing import Mapping, Optional

from .envparse import leading_integer, parse_choice, parse_integer, parse_seconds, parse_size_up_to, parse_switch
from .errors import ConfigError
from .units import parse_size

__all__ = ["ALGORITHMS", "MPI_ALGORITHMS", "ConfigError", "Config", "current", "reload", "parse_size",
           "horovod_switch", "horovod_requested_by_startup_hook", "horovod_requested_by_import",
           "bucket_bytes", "progress_thread_setting", "gradient_as_bucket_view", "stall_check_seconds",
           "stall_shutdown_seconds", "stall_shutdown_is_horovods", "timeline_file", "env_text", "read_ranks_per_host",
           "horovod_mpi_threads_disabled"]

#: MPI's own allreduce: "mpi" is MPI_Allreduce itself (stock Horovod's CPU path), "mpi-ring"
#: Open MPI's ring allreduce (as "mpi" where it cannot be forced: mcallreduce/mpit.py)
MPI_ALGORITHMS = ("mpi", "mpi-ring")
#: every algorithm the runtime accepts: the schedules (``algorithms.SCHEDULED``, checked equal
#: by the tests), then MPI's own
ALGORITHMS = ("multicolor", "ring", "doubling", "halving") + MPI_ALGORITHMS


# Across hosts, pipeline segments stay under Open MPI's TCP eager limit: a larger message waits
# for the receiver's clear-to-send, which queues behind whatever the receiver's NIC is sending
# (measured: docs/defaults-hosts.md, "Two-way connections" and "A ring's clear-to-send").
EAGER_LIMIT_VARIABLE = "OMPI_MCA_btl_tcp_eager_limit"
EAGER_LIMIT_BYTES = 64 << 10     # Open MPI's default btl_tcp_eager_limit (headers included)
EAGER_HEADER_BYTES = 1 << 10     # room for the PML and BTL headers


def inter_host_segment_bytes(environ: Optional[Mapping[str, str]] = None) -> int:
    """The largest segment that crosses hosts eagerly: the TCP eager limit less its headers,
    in whole 4 KiB (``OMPI_MCA_btl_tcp_eager_limit`` when set, as mpirun --mca sets it)."""
    value = (os.environ if environ is None else environ).get(EAGER_LIMIT_VARIABLE, "").strip()
    try:   # Open MPI reads it with strtoull(..., 0): 0x10000 and 0200000 too
        limit = int(value, 0) if value else EAGER_LIMIT_BYTES
    except ValueError:
        limit = parse_size(value, EAGER_LIMIT_VARIABLE)
    return max(4096, (limit - EAGER_HEADER_BYTES) // 4096 * 4096)


# On one host, multicolor reduces messages up to this size through a shared-memory window
# (native/shared_stage.c) instead of point-to-point messages; the window holds p + 1 areas
# of this size per communicator, which the limit bounds (measured against messages:
# docs/benchmarks-history.md, "Single host: 2 ranks, multicolor vs ring vs MPI_Allreduce").
SHM_BYTES = 8 << 20

# From this size the one-host stage reads and writes the peers' buffers directly (Linux CMA,
# where the kernel allows it) instead of copying through the window, and has no size limit
# (measured: docs/defaults.md, "One host: the single-copy stage").
SINGLE_COPY_BYTES = 64 << 10

# Up to this size the one-host stage synchronises once: every rank reduces the whole buffer
# from double-buffered slots of this size, 2p of them after the window's areas
# (measured: docs/defaults.md, "One host: one synchronisation for small calls").
ONE_SYNC_BYTES = 32 << 10

# A blocking wait polls MPI for this long after the last completion, then sleeps between polls
# (docs/benchmarks-limits.md, "How long a wait polls").
POLL_US = 1000

ROUTES = ("tree", "ring")


def _route(value: Optional[str]) -> Optional[str]:
    if value is None or value.lower() == "auto":
        return None
    return parse_choice("MCALLREDUCE_ROUTE", value, ROUTES + ("auto",))


@dataclass(frozen=True)
class Config:
    """User choices; None means "auto" (decided per message by :func:`resolve`)."""

    algorithm: str = "multicolor"
    colors: Optional[int] = None
    segment_bytes: Optional[int] = None
    fanout: Optional[int] = None
    hierarchy: Optional[bool] = None
    route: Optional[str] = None         # multicolor across hosts: "tree" or "ring"
    depth: int = 4
    check: bool = True
    verbose: bool = False
    ranks_per_host: Optional[int] = None
    tuning_file: Optional[str] = None
    inter_host_segment: int = inter_host_segment_bytes({})   # Open MPI's default eager limit
    shm_bytes: int = SHM_BYTES
    single_copy_bytes: int = SINGLE_COPY_BYTES
    one_sync_bytes: int = ONE_SYNC_BYTES
    poll_us: int = POLL_US
    fast_links: Optional[bool] = None   # None: measured once per communicator

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Config":
        env = os.environ if environ is None else environ

        def get(name: str) -> Optional[str]:
            value = env.get("MCALLREDUCE_" + name)
            return None if value is None or value.strip() == "" else value.strip()

        def integer(name: str, low: int, auto: bool = True) -> Optional[int]:
            return parse_integer("MCALLREDUCE_" + name, get(name), low, auto)

        def boolean(name: str, auto: bool) -> Optional[bool]:
            return parse_switch("MCALLREDUCE_" + name, get(name), auto)

        algorithm = parse_choice("MCALLREDUCE_ALGORITHM", get("ALGORITHM") or "multicolor", ALGORITHMS)
        segment = get("SEGMENT_BYTES")
        auto_segment = segment is None or segment.lower() == "auto"
        return cls(
            algorithm=algorithm,
            colors=integer("COLORS", 1),
            segment_bytes=None if auto_segment else parse_size(segment, "MCALLREDUCE_SEGMENT_BYTES"),
            fanout=integer("FANOUT", 2),
            hierarchy=boolean("HIERARCHY", auto=True),
            route=_route(get("ROUTE")),
            depth=integer("PIPELINE_DEPTH", 1, auto=False) or 4,
            check=bool(boolean("CHECK", auto=False) if get("CHECK") is not None else True),
            verbose=bool(boolean("VERBOSE", auto=False)),
            ranks_per_host=read_ranks_per_host(env),
            tuning_file=_existing_file(get("TUNING_FILE")),
            inter_host_segment=inter_host_segment_bytes(env),
            shm_bytes=parse_size_up_to("MCALLREDUCE_SHM_BYTES", get("SHM_BYTES"), SHM_BYTES, 1 << 30),
            single_copy_bytes=parse_size_up_to("MCALLREDUCE_SINGLE_COPY_BYTES", get("SINGLE_COPY_BYTES"),
                                               SINGLE_COPY_BYTES),
            one_sync_bytes=parse_size_up_to("MCALLREDUCE_ONE_SYNC_BYTES", get("ONE_SYNC_BYTES"), ONE_SYNC_BYTES,
                                            64 << 20),
            poll_us=POLL_US if get("POLL_US") is None else integer("POLL_US", 0, auto=False),
            fast_links=boolean("FAST_LINKS", auto=True),
        )

    def with_overrides(self, **kwargs) -> "Config":
        changes = {k: v for k, v in kwargs.items() if v is not None}
        if not changes:
            return self
        for name in ("algorithm", "route"):   # as their variables are read: any case
            if isinstance(changes.get(name), str):
                changes[name] = changes[name].lower()
        key = (self, tuple(sorted(changes.items())))
        hit = _overridden.get(key)
        if hit is None:
            unknown = sorted(set(changes) - set(self.__dataclass_fields__))
            if unknown:
                raise ConfigError(f"mcallreduce: unknown allreduce option(s) {unknown}; the options: mcallreduce.Config")
            if changes.get("route") not in (None,) + ROUTES:
                raise ConfigError(f"route={changes['route']!r}: allowed values are {', '.join(ROUTES)}")
            for name, low in (("colors", 1), ("fanout", 2), ("segment_bytes", 0), ("depth", 1)):
                value = changes.get(name, low)   # 0 colors once meant auto, and turned the one-host stage off
                if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
                    raise ConfigError(f"{name}={value!r}: allowed values are whole numbers >= {low}")
            if len(_overridden) > 1024:
                _overridden.clear()
            hit = _overridden[key] = replace(self, **changes)
        return hit


_overridden: dict = {}  # memo for with_overrides: allreduce calls repeat the same few overrides


def _existing_file(path: Optional[str]) -> Optional[str]:
    if path is not None and path.lower() == "none":   # no table at all, not even the built-in one
        return "none"
    if path is not None and not os.path.isfile(path):
        raise ConfigError(f"MCALLREDUCE_TUNING_FILE={path!r}: no such file "
                          "(write one with: python -m mcallreduce.bench tune --out FILE)")
    return None if path is None else os.path.abspath(path)   # the same file after a chdir


_current: Optional[Config] = None


def current() -> Config:
    """The configuration from the environment, parsed on first use."""
    global _current
    if _current is None:
        _current = Config.from_env()
    return _current


def reload() -> Config:
    """Re-read the ``MCALLREDUCE_*`` variables (after changing them in-process)."""
    global _current
    _current = None
    return current()


# ---------------------------------------------------------------- Horovod plugin
# Read when asked (not cached), so tests and launchers can change them late. The startup
# hook calls horovod_requested_by_startup_hook() in every interpreter where a variable is
# set, which is why this module imports nothing beyond the standard library.

HOROVOD_SWITCH = "MCALLREDUCE_HOROVOD"
BUCKET_VARIABLE = "MCALLREDUCE_BUCKET_BYTES"
PROGRESS_VARIABLE = "MCALLREDUCE_PROGRESS_THREAD"
DEFAULT_BUCKET_BYTES = 25 << 20   # as DDP's default bucket: a few buckets for a ResNet-50


def env_text(environ: Optional[Mapping[str, str]], name: str) -> str:
    """The variable's value, stripped ("" when unset)."""
    return (os.environ if environ is None else environ).get(name, "").strip()


def horovod_integer(environ: Optional[Mapping[str, str]], name: str) -> Optional[int]:
    """One of Horovod's own integer variables as Horovod reads it: None when unset, else C's strtol
    of its text (set but empty, or with no leading digits, is 0)."""
    value = (os.environ if environ is None else environ).get(name)
    return None if value is None else leading_integer(value)


def read_ranks_per_host(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """MCALLREDUCE_RANKS_PER_HOST: consecutive ranks per emulated host, None for the real hosts."""
    return parse_integer("MCALLREDUCE_RANKS_PER_HOST", env_text(environ, "MCALLREDUCE_RANKS_PER_HOST"), 1)


def horovod_switch(environ: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    """MCALLREDUCE_HOROVOD as True, False or None (unset/auto)."""
    return parse_switch(HOROVOD_SWITCH, env_text(environ, HOROVOD_SWITCH))


def horovod_requested_by_startup_hook(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the startup hook patches horovod.torch (no code change in the user's script):
    MCALLREDUCE_HOROVOD decides when set, else a non-empty MCALLREDUCE_ALGORITHM asks for it."""
    forced = horovod_switch(environ)
    if forced is not None:
        return forced
    return bool(env_text(environ, "MCALLREDUCE_ALGORITHM"))


def horovod_requested_by_import(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``import mcallreduce.horovod.torch`` patches horovod.torch (unless MCALLREDUCE_HOROVOD=0)."""
    return horovod_switch(environ) is not False


FUSION_VARIABLE = "HOROVOD_FUSION_THRESHOLD"


def bucket_bytes(environ: Optional[Mapping[str, str]] = None) -> int:
    """Gradient bucket capacity of DistributedOptimizer: MCALLREDUCE_BUCKET_BYTES, else Horovod's
    HOROVOD_FUSION_THRESHOLD (bytes; 0, no fusion: every gradient its own bucket), else 25M."""
    value = env_text(environ, BUCKET_VARIABLE)
    if not value:
        fusion = horovod_integer(environ, FUSION_VARIABLE)
        return DEFAULT_BUCKET_BYTES if fusion is None else max(1, fusion)
    size = parse_size(value, BUCKET_VARIABLE)
    if size <= 0:
        raise ConfigError(f"{BUCKET_VARIABLE}={value!r}: expected a size > 0 such as 4M or 262144")
    return size


def progress_thread_setting(environ: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    """MCALLREDUCE_PROGRESS_THREAD: on or off, or None for auto (:func:`mcallreduce.policy.progress_thread`)."""
    return parse_switch(PROGRESS_VARIABLE, env_text(environ, PROGRESS_VARIABLE))


def gradient_as_bucket_view(environ: Optional[Mapping[str, str]] = None) -> bool:
    """MCALLREDUCE_GRADIENT_AS_BUCKET_VIEW=1: gradients stay views of their bucket after
    synchronize() (no copy back), with DDP's caveat: a gradient tensor kept across steps changes."""
    name = "MCALLREDUCE_GRADIENT_AS_BUCKET_VIEW"
    return bool(parse_switch(name, env_text(environ, name), auto=False))


def horovod_mpi_threads_disabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    """HOROVOD_MPI_THREADS_DISABLE as Horovod reads it (strtol > 0): MPI starts without thread support."""
    return (horovod_integer(environ, "HOROVOD_MPI_THREADS_DISABLE") or 0) > 0


def timeline_file(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """MCALLREDUCE_TIMELINE, else HOROVOD_TIMELINE unless DYNAMIC: the routed calls' Chrome trace."""
    path = env_text(environ, "MCALLREDUCE_TIMELINE") or env_text(environ, "HOROVOD_TIMELINE") or None
    return None if path == "DYNAMIC" else path


# ---------------------------------------------------------------- stalls
# A call that waits this long is reported on stderr; past the shutdown time it fails. Both as
# Horovod's stall inspector: MCALLREDUCE_* first, else Horovod's own variables.

STALL_CHECK_SECONDS = 60.0


def _seconds(environ: Optional[Mapping[str, str]], suffix: str) -> Optional[float]:
    """MCALLREDUCE_<suffix> (seconds >= 0), else HOROVOD_<suffix> read as Horovod's strtol reads it."""
    ours = env_text(environ, "MCALLREDUCE_" + suffix)
    if ours:
        return parse_seconds("MCALLREDUCE_" + suffix, ours)
    theirs = horovod_integer(environ, "HOROVOD_" + suffix)
    return None if theirs is None else float(max(0, theirs))


def stall_check_seconds(environ: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """Seconds a call may wait before it is reported (*_STALL_CHECK_TIME_SECONDS, default 60);
    None when *_STALL_CHECK_DISABLE says so (the MCALLREDUCE_ variable decides where it is set)."""
    ours = env_text(environ, "MCALLREDUCE_STALL_CHECK_DISABLE")
    if ours:
        disabled = parse_switch("MCALLREDUCE_STALL_CHECK_DISABLE", ours, auto=False)
    else:   # Horovod disables its check for any value whose leading integer is above 0
        disabled = (horovod_integer(environ, "HOROVOD_STALL_CHECK_DISABLE") or 0) > 0
    if disabled:
        return None
    seconds = _seconds(environ, "STALL_CHECK_TIME_SECONDS")
    return STALL_CHECK_SECONDS if seconds is None else seconds


def stall_shutdown_seconds(environ: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """Seconds after which a waiting call fails (*_STALL_SHUTDOWN_TIME_SECONDS); None: never (0 too).
    The stall inspector ignores Horovod's below the check time, as Horovod does."""
    seconds = _seconds(environ, "STALL_SHUTDOWN_TIME_SECONDS")
    return seconds or None


def stall_shutdown_is_horovods(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the stall shutdown time comes from HOROVOD_STALL_SHUTDOWN_TIME_SECONDS."""
    return (not env_text(environ, "MCALLREDUCE_STALL_SHUTDOWN_TIME_SECONDS")
            and horovod_integer(environ, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS") is not None)


def __getattr__(name: str):
    if name == "data":   # the data package's settings, once here (importing them imports torch)
        from .data.settings import data
        return data
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
