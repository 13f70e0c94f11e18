"""What the benchmarks write: JSON and PNG files, each atomically (a reader never sees half of one)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

_SOURCE_ROOT = Path(__file__).resolve().parents[2]   # the directory that holds mcallreduce/


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_png(fig, path, dpi: int = 110) -> None:
    """Write ``fig`` to ``path`` (PNG) through a temporary file, so a reader never sees half of it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(f"{path}.tmp.png", dpi=dpi)
    os.replace(f"{path}.tmp.png", path)
    pyplot().close(fig)


def write_text(path, text: str, mode: Optional[int] = None) -> None:
    """``text`` at ``path`` (a str or a Path) through a temporary file; ``mode``: its permissions."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"   # two writers of one path never share a temporary file
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())   # on disk before the name: a crash leaves the old file or the new
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)


BENCH_COMMAND = ("python", "-m", "mcallreduce.bench")   # how a record names the benchmark's entry point


def command(argv: Optional[Sequence[str]] = None) -> List[str]:
    """The command line that ran, as a user types it (``python -m mcallreduce.bench ...``): what a
    record keeps, free of this machine's paths."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    try:
        parts = script.relative_to(_SOURCE_ROOT).with_suffix("").parts
    except ValueError:
        parts = ()
    if script.suffix == ".py" and parts[:1] == ("mcallreduce",):
        parts = parts[:-1] if parts[-1] == "__main__" else parts
        return ["python", "-m", ".".join(parts), *argv[1:]]
    if script.name == "mcallreduce-bench":      # setup.py's console script
        return [*BENCH_COMMAND, *argv[1:]]
    return (["python"] if script.suffix == ".py" else []) + [script.name, *argv[1:]]


def subcommand_command(name: str, argv: Optional[Sequence[str]]) -> List[str]:
    """What a record keeps for ``python -m mcallreduce.bench NAME ...``: ``argv`` as the
    dispatcher passed it, or this process's own arguments after the subcommand."""
    return [*BENCH_COMMAND, name, *(sys.argv[2:] if argv is None else argv)]


def write_json(path, payload, indent: Optional[int] = 1) -> None:
    """``payload`` as JSON at ``path`` (a str or a Path), through a temporary file."""
    write_text(path, json.dumps(payload, indent=indent))


def write_table_json(path, payload: dict) -> None:
    """A tuning table as JSON whose rows take a line each, so that a reader (and a diff) sees
    one size per line: ``{"key": value, ..., "section": {"layout": [row, ...]}}``."""
    def rows(layouts: dict) -> str:
        return "{\n" + ",\n".join(f"  {json.dumps(layout)}: [\n" + ",\n".join(f"   {json.dumps(row)}" for row in table)
                                  + "\n  ]" for layout, table in layouts.items()) + "\n }"
    parts = [f" {json.dumps(key)}: " + (rows(value) if isinstance(value, dict) and value and
                                        all(isinstance(v, list) for v in value.values()) else json.dumps(value))
             for key, value in payload.items()]
    write_text(path, "{\n" + ",\n".join(parts) + "\n}\n")
