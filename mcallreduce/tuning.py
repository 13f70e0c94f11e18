"""The tuning table: the file ``python -m mcallreduce.bench tune`` writes and the policy follows.

A table holds, per layout ("4h1r": hosts x the most ranks on one host), rows by message size,
each naming what ran fastest there: multicolor with its parameters (``shared`` for the one-host
stage), doubling, ring, halving, mpi (MPI's own allreduce) or mpi-ring (Open MPI's ring); a measured
row that names MPI also names, under "instead", the fastest of the others, for the calls that MPI's
allreduce cannot serve (float16, or a nonblocking call the row did not time). Rows
measured with blocking calls sit under "tables", those measured with nonblocking calls under
:data:`NONBLOCKING_SECTION`. ``tune --measure`` writes a measured table, ``tune`` a modelled one
(:mod:`mcallreduce.sim.tuner`); :data:`BUILTIN_TABLE` is the one measured on this project's
development machine. Pure Python, no MPI.
"""
from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

from .algorithms import Params
from .config import ALGORITHMS, MPI_ALGORITHMS, ROUTES
from .errors import ConfigError

__all__ = ["BUILTIN_TABLE", "NONBLOCKING_SECTION", "check_file", "layout_name", "has_nonblocking_rows", "lookup"]

#: measured with ``python -m mcallreduce.bench tune --measure`` (docs/benchmarks.md, "Commands")
BUILTIN_TABLE = str(Path(__file__).with_name("tuning-measured.json"))
#: a table's rows measured with nonblocking calls (``tune --measure --calls nonblocking``),
#: beside the blocking ones under "tables"
NONBLOCKING_SECTION = "nonblocking_tables"


def _tables(path: str, section: str = "tables") -> Dict:
    """A table file's section, read again once the file changes (``tune --measure --out`` the same
    path): plans made after that follow the new table."""
    try:   # gone or unreadable after start: an error, not a policy of its own on this rank
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"mcallreduce: tuning table {path} cannot be read ({exc.strerror})") from exc
    return _read_table(path, st.st_mtime_ns, st.st_size).get(section, {})


def check_file(path: str) -> None:
    """Read and check the table at ``path`` (ConfigError where it cannot be followed)."""
    _tables(path)


@lru_cache(maxsize=8)
def _read_table(path: str, mtime_ns: int, size: int) -> Dict:
    try:
        table = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"mcallreduce: tuning table {path} cannot be read ({exc.strerror})") from exc
    except ValueError as exc:
        raise ConfigError(f"mcallreduce: tuning table {path} is not JSON ({exc})") from exc
    _check_table(path, table)
    return table


_LAYOUT = re.compile(r"[1-9][0-9]*h[1-9][0-9]*r")
# what a row may say: its schedule, and what tune recorded of its timing (read by people, not here)
_SCHEDULE_KEYS = frozenset({"algorithm", "colors", "hierarchical", "route", "segment_bytes", "shared"})
_ROW_KEYS = _SCHEDULE_KEYS | {"size_bytes", "instead", "measured_s", "predicted_s", "ring_predicted_s",
                              "ring_segment_bytes", "speedup_vs_ring"}


def _check_table(path: str, table) -> None:
    """A table that would be misread raises, naming the file, rather than being followed in part."""
    def bad(what):
        return ConfigError(f"mcallreduce: tuning table {path}: {what} (python -m mcallreduce.bench tune writes one)")
    if not isinstance(table, dict):
        raise bad("not a JSON object")
    if "tables" not in table and NONBLOCKING_SECTION not in table:   # any other JSON file would be an empty table
        raise bad(f'neither "tables" nor "{NONBLOCKING_SECTION}" in it')
    for section in ("tables", NONBLOCKING_SECTION):
        layouts = table.get(section, {})
        if not isinstance(layouts, dict) or not all(isinstance(rows, list) for rows in layouts.values()):
            raise bad(f'"{section}" is not an object of row lists')
        for layout, rows in layouts.items():
            if not _LAYOUT.fullmatch(layout):
                raise bad(f'"{layout}" is not a layout (hosts x ranks on a host, as "4h1r")')
            sizes = set()
            for row in rows:
                size = row.get("size_bytes") if isinstance(row, dict) else None
                if type(size) is not int or size < 0 or size in sizes:
                    raise bad(f"{layout}: a row without a size_bytes of 0 or more that no other row has: {row!r}")
                sizes.add(size)
                for part, known in ((row, _ROW_KEYS), (row.get("instead", {}), _SCHEDULE_KEYS)):
                    unknown = sorted(set(part) - known) if isinstance(part, dict) else []
                    if unknown:
                        raise bad(f"{layout}: unknown keys {', '.join(unknown)} in {part!r}")
                    if not isinstance(part, dict) or part.get("algorithm", "multicolor") not in ALGORITHMS:
                        raise bad(f"{layout}: a row that names no algorithm of {', '.join(ALGORITHMS)}: {part!r}")
                    wrong = _wrong_parameter(part)
                    if wrong:
                        raise bad(f"{layout}: {wrong} in {part!r}")
                if "instead" in row and row["instead"].get("algorithm", "multicolor") in MPI_ALGORITHMS:
                    raise bad(f"{layout}: an instead that names MPI's allreduce, which it stands in for: {row!r}")


def _wrong_parameter(row: dict) -> Optional[str]:
    """What is wrong with a row's schedule parameters, if anything."""
    def whole(key, low):
        value = row.get(key, low)
        return isinstance(value, int) and not isinstance(value, bool) and value >= low
    if not whole("colors", 1):
        return "colors must be a whole number of 1 or more"
    if not whole("segment_bytes", 0):
        return "segment_bytes must be a whole number of 0 or more"
    if not all(isinstance(row.get(key, False), bool) for key in ("hierarchical", "shared")):
        return "hierarchical and shared must be true or false"
    if row.get("route", "tree") not in ROUTES:
        return f"route must be one of {', '.join(ROUTES)}"
    return None


def layout_name(hosts: Sequence[Sequence[int]]) -> str:
    """A table's key for a layout: hosts x the most ranks on one host, as "4h2r"."""
    return f"{len(hosts)}h{max(len(h) for h in hosts)}r"


def has_nonblocking_rows(hosts: Sequence[Sequence[int]], path: str) -> bool:
    """Whether the table holds rows measured with nonblocking calls for this layout."""
    return bool(_tables(path, NONBLOCKING_SECTION).get(layout_name(hosts)))


def lookup(hosts: Sequence[Sequence[int]], nbytes: int, itemsize: int,
           path: str, nonblocking: bool = False, mpi_ok: bool = True) -> Optional[Tuple[str, Params]]:
    """The table's choice for this layout (the first row of a size >= nbytes, else the last), or
    None where the table has no rows for the layout. ``nonblocking``: from the rows measured with
    nonblocking calls where the table has them, else from the blocking ones. ``mpi_ok`` False: the
    call cannot run MPI's allreduce, so a row that picked it gives its "instead", or None where it
    has none (a modelled table, or one written before rows had it)."""
    rows = _tables(path, NONBLOCKING_SECTION).get(layout_name(hosts)) if nonblocking else None
    rows = rows or _tables(path).get(layout_name(hosts))
    if not rows:
        return None
    rows = sorted(rows, key=lambda r: r["size_bytes"])
    row = next((r for r in rows if r["size_bytes"] >= nbytes), rows[-1])
    if not mpi_ok and row.get("algorithm") in MPI_ALGORITHMS:
        row = row.get("instead")
        if row is None:
            return None
    seg = row.get("segment_bytes", 0) // itemsize if row.get("segment_bytes") else 0
    algorithm = row.get("algorithm", "multicolor")
    if algorithm in MPI_ALGORITHMS:
        return algorithm, Params()
    if algorithm in ("doubling", "ring", "halving"):
        return algorithm, Params(segment=0 if algorithm == "doubling" else seg)
    return "multicolor", Params(colors=row.get("colors", 1), segment=seg, hierarchical=row.get("hierarchical", True),
                                route=row.get("route", "tree"), shared=bool(row.get("shared", False)))
