"""Configuration: every ``MCALLREDUCE_*`` variable is read here, and only here.

| variable                     | values                         | default    |
|------------------------------|--------------------------------|------------|
| MCALLREDUCE_ALGORITHM        | multicolor, ring, doubling, mpi | multicolor |
| MCALLREDUCE_COLORS           | auto, or an integer >= 1       | auto       |
| MCALLREDUCE_SEGMENT_BYTES    | auto, or a size (256K, 1M, 0)  | auto       |
| MCALLREDUCE_FANOUT           | auto, or an integer >= 2       | auto       |
| MCALLREDUCE_HIERARCHY        | auto, 1, 0                     | auto       |
| MCALLREDUCE_PIPELINE_DEPTH   | an integer >= 1                | 4          |
| MCALLREDUCE_CHECK            | 1, 0                           | 1          |
| MCALLREDUCE_VERBOSE          | 0, 1                           | 0          |
| MCALLREDUCE_RANKS_PER_HOST   | auto, or an integer >= 1       | auto       |
| MCALLREDUCE_TUNING_FILE      | a tuning table (JSON) or unset | unset      |

The Horovod plugin adds three, parsed in ``mcallreduce/horovod/state.py`` because
its startup hook must decide before anything heavy is imported:

| variable                     | values                         | default    |
|------------------------------|--------------------------------|------------|
| MCALLREDUCE_HOROVOD          | auto, 1, 0                     | auto       |
| MCALLREDUCE_BUCKET_BYTES     | a size (25M, 4M)               | 25M        |
| MCALLREDUCE_PROGRESS_THREAD  | auto, 1, 0                     | auto       |

and the data package its ``MCALLREDUCE_DATA_*`` variables (``mcallreduce/data/config.py``,
docs/data.md), kept apart so that loading data never imports the allreduce engine.

Variables are read once, at first use (like Horovod's); a process that changes
them later calls :func:`reload`. ``auto`` values are resolved per message size
by :func:`resolve` (the table is in the README and docs/algorithms.md). ``MCALLREDUCE_RANKS_PER_HOST`` groups
consecutive ranks into virtual hosts instead of asking MPI which ranks share
memory; it exists to exercise the hierarchical schedules on one machine.
``MCALLREDUCE_TUNING_FILE`` names a table written by ``python -m mcallreduce.bench
tune`` (the cost model's best colors/segment/hierarchy per size for a cluster);
its choices replace the built-in size table for every setting left on ``auto``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence, Tuple

from .algorithms import SCHEDULED, Params

__all__ = ["ALGORITHMS", "ConfigError", "Config", "current", "reload", "parse_size", "resolve"]

#: every algorithm the runtime accepts; "mpi" is MPI_Allreduce itself (stock Horovod's CPU path)
ALGORITHMS = SCHEDULED + ("mpi",)


class ConfigError(ValueError):
    """An invalid configuration value; the message names the variable and the allowed values."""


_SIZE = re.compile(r"^\s*(\d+)\s*([kmgKMG]?)(i?[bB])?\s*$")


def parse_size(text: str, what: str = "size") -> int:
    """'256K' -> 262144, '1M' -> 1048576, '4096' -> 4096 (binary units)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{what}: {text!r} is not a size (examples: 4096, 256K, 1M)")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]


@dataclass(frozen=True)
class Config:
    """User choices; None means "auto" (decided per message by :func:`resolve`)."""

    algorithm: str = "multicolor"
    colors: Optional[int] = None
    segment_bytes: Optional[int] = None
    fanout: Optional[int] = None
    hierarchy: Optional[bool] = None
    depth: int = 4
    check: bool = True
    verbose: bool = False
    ranks_per_host: Optional[int] = None
    tuning_file: Optional[str] = None

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Config":
        env = os.environ if environ is None else environ

        def get(name: str) -> Optional[str]:
            value = env.get("MCALLREDUCE_" + name)
            return None if value is None or value.strip() == "" else value.strip()

        def integer(name: str, low: int, auto: bool = True) -> Optional[int]:
            value = get(name)
            if value is None or (auto and value.lower() == "auto"):
                return None
            allowed = f"'auto' or an integer >= {low}" if auto else f"an integer >= {low}"
            try:
                number = int(value)
            except ValueError:
                number = low - 1
            if number < low:
                raise ConfigError(f"MCALLREDUCE_{name}={value!r}: allowed values are {allowed}")
            return number

        def boolean(name: str, auto: bool) -> Optional[bool]:
            value = get(name)
            if value is None or (auto and value.lower() == "auto"):
                return None
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            allowed = "'auto', 1, 0" if auto else "1, 0"
            raise ConfigError(f"MCALLREDUCE_{name}={value!r}: allowed values are {allowed}")

        algorithm = (get("ALGORITHM") or "multicolor").lower()
        if algorithm not in ALGORITHMS:
            raise ConfigError(f"MCALLREDUCE_ALGORITHM={algorithm!r}: allowed values are {', '.join(ALGORITHMS)}")
        segment = get("SEGMENT_BYTES")
        if segment is not None and segment.lower() != "auto":
            segment_bytes: Optional[int] = parse_size(segment, "MCALLREDUCE_SEGMENT_BYTES")
        else:
            segment_bytes = None
        return cls(
            algorithm=algorithm,
            colors=integer("COLORS", 1),
            segment_bytes=segment_bytes,
            fanout=integer("FANOUT", 2),
            hierarchy=boolean("HIERARCHY", auto=True),
            depth=integer("PIPELINE_DEPTH", 1, auto=False) or 4,
            check=bool(boolean("CHECK", auto=False) if get("CHECK") is not None else True),
            verbose=bool(boolean("VERBOSE", auto=False)),
            ranks_per_host=integer("RANKS_PER_HOST", 1),
            tuning_file=_existing_file(get("TUNING_FILE")),
        )

    def with_overrides(self, **kwargs) -> "Config":
        changes = {k: v for k, v in kwargs.items() if v is not None}
        if not changes:
            return self
        key = (self, tuple(sorted(changes.items())))
        hit = _overridden.get(key)
        if hit is None:
            if len(_overridden) > 1024:
                _overridden.clear()
            hit = _overridden[key] = replace(self, **changes)
        return hit


_overridden: dict = {}  # memo for with_overrides: allreduce calls repeat the same few overrides

def _existing_file(path: Optional[str]) -> Optional[str]:
    if path is not None and not os.path.isfile(path):
        raise ConfigError(f"MCALLREDUCE_TUNING_FILE={path!r}: no such file "
                          "(write one with: python -m mcallreduce.bench tune --out FILE)")
    return path


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


# Defaults by message size, in the spirit of Blue Gene/Q's colors-by-size table:
# small messages are latency-bound (one tree, one message per hop), large ones are
# bandwidth-bound (every host a root of some color, pipelined in segments).
SMALL_BYTES = 16 << 10     # <= this: one color, no pipelining
MEDIUM_BYTES = 256 << 10   # <= this: two colors, no pipelining
SEGMENT_BYTES = 256 << 10  # pipeline segment for large messages
PIPELINE_MIN_SEGMENTS = 4  # pipeline a color only if it gets at least this many segments:
                           # fewer adds messages without overlapping much (measured at 1 MiB)
STAR_MAX_HOSTS = 8         # up to this many hosts, one color per host (direct reduce-scatter)
# The latency regime of the multicolor family: log2(p) exchanges of the whole message
# (algorithms/doubling.py) instead of a reduce up a tree and a broadcast down it
# (2 log2(p) message latencies). Two ranks exchange n bytes each way either way, so
# for a pair doubling only saves a round trip and costs twice the reduction work.
DOUBLING_BYTES = SMALL_BYTES
DOUBLING_PAIR_BYTES = 1 << 20


def default_colors(nbytes: int, nhosts: int, max_local: int) -> int:
    if nbytes <= SMALL_BYTES:
        return 1
    if nbytes <= MEDIUM_BYTES:
        return max(1, min(2, nhosts * max_local))
    if nhosts <= STAR_MAX_HOSTS:
        return max(nhosts, max_local)
    return max(2, max_local)


def _tuned(config: Config, hosts: Sequence[Sequence[int]], nbytes: int,
           itemsize: int) -> Optional[Tuple[str, Params]]:
    """The tuning table's choice for this layout and size, if a table is configured and has one."""
    if not config.tuning_file or config.algorithm != "multicolor":
        return None
    from .sim.tuner import lookup   # pure Python (no MPI); imported only when a table is used
    return lookup(hosts, nbytes, itemsize, path=config.tuning_file)


def latency_bound(nbytes: int, nranks: int) -> bool:
    """Whether ``auto`` runs a multicolor call as recursive doubling (see DOUBLING_*_BYTES)."""
    return nranks > 1 and (nbytes <= DOUBLING_BYTES or (nranks == 2 and nbytes <= DOUBLING_PAIR_BYTES))


def _slices(config: Config, colors: int, hosts: Sequence[Sequence[int]]) -> int:
    """How many pieces the algorithm cuts a message into: ring chunks or color slices."""
    if config.algorithm == "ring":
        return sum(len(h) for h in hosts)
    return 1 if config.algorithm == "doubling" else colors


def resolve(config: Config, nbytes: int, itemsize: int,
            hosts: Sequence[Sequence[int]]) -> Tuple[str, Params]:
    """Concrete algorithm and schedule parameters for one message of ``nbytes``."""
    max_local = max(len(h) for h in hosts)
    nranks = sum(len(h) for h in hosts)
    hit = _tuned(config, hosts, nbytes, itemsize)
    if hit is not None and hit[0] == "doubling" and config.colors is None:
        return "doubling", Params(segment=0, depth=config.depth)
    tuned = hit[1] if hit is not None and hit[0] == "multicolor" else None
    knobs = (config.colors, config.segment_bytes, config.fanout, config.hierarchy)
    if (config.algorithm == "multicolor" and hit is None and knobs == (None,) * 4
            and latency_bound(nbytes, nranks)):
        return "doubling", Params(segment=0, depth=config.depth)
    if config.hierarchy is not None:
        hierarchical = config.hierarchy
    else:
        hierarchical = tuned.hierarchical if tuned else max_local > 1
    nodes = len(hosts) if hierarchical else sum(len(h) for h in hosts)
    colors = config.colors or (tuned.colors if tuned else
                               default_colors(nbytes, nodes, max_local if hierarchical else 1))
    if config.segment_bytes is not None:
        segment = max(1, config.segment_bytes // itemsize) if config.segment_bytes else 0
    elif tuned:
        segment = tuned.segment
    elif nbytes // _slices(config, colors, hosts) >= PIPELINE_MIN_SEGMENTS * SEGMENT_BYTES:
        segment = SEGMENT_BYTES // itemsize
    else:
        segment = 0
    if config.algorithm in ("ring", "doubling"):
        return config.algorithm, Params(segment=segment, depth=config.depth)
    return config.algorithm, Params(colors=colors, segment=segment, fanout=config.fanout,
                                    hierarchical=hierarchical, depth=config.depth)
