"""Every ``MCALLREDUCE_DATA_*`` environment variable, read in this one place.

Names follow Horovod's ``HOROVOD_*`` style. Each function reads the variable
when called (not at import), so a test or a launcher can set it late.
docs/data.md lists them all.
"""
from __future__ import annotations

import os
from typing import Optional

PREFIX = "MCALLREDUCE_DATA_"

# name -> (default, meaning); docs/data.md mirrors this table.
VARIABLES = {
    "PROGRESS": ("auto", "progress bars on stderr: 1 always, 0 never, auto when stderr is a TTY"),
    "MEMORY_LIMIT": ("", "cap in bytes (suffixes K, M, G, T) on the memory the store may take on a host"),
    "MEMORY_FRACTION": ("0.9", "share of the host's available memory the store may take"),
    "VERIFY": ("1", "check each sample's CRC32 while loading a packed store (0 skips it)"),
    "PARTITION": ("split", "split: each host holds its share; full: every host holds everything; auto: full when it fits"),
    "RANKS_PER_HOST": ("", "emulate hosts of this many consecutive ranks instead of asking MPI which ranks share a node"),
    "MPI": ("auto", "use MPI: 1 yes, 0 no, auto when launched by mpirun or when mpi4py.MPI is already imported"),
    "EXCHANGE_ROUND_BYTES": ("1G", "the most bytes one rank sends or receives in one Alltoallv round"),
    "THREADS": ("4", "default decode threads of the threaded loader"),
    "DECODER": ("auto", "JPEG decoder: simplejpeg, pil, or auto (simplejpeg when it imports)"),
}


def raw(name: str) -> str:
    if name not in VARIABLES:
        raise KeyError(f"unknown setting {PREFIX}{name}")
    value = os.environ.get(PREFIX + name, "").strip()
    return value if value else VARIABLES[name][0]


def parse_bytes(text: str) -> int:
    """'1.5G' -> 1610612736; plain integers are bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if text and text[-1] in scale:
        return int(float(text[:-1]) * scale[text[-1]])
    return int(text)


def flag(name: str) -> Optional[bool]:
    """True/False for 1/0 (yes/no, true/false); None for 'auto'."""
    value = raw(name).lower()
    if value == "auto":
        return None
    if value in ("1", "yes", "true", "on"):
        return True
    if value in ("0", "no", "false", "off"):
        return False
    raise ValueError(f"{PREFIX}{name}={value!r}: expected 1, 0 or auto")


def memory_limit() -> Optional[int]:
    value = raw("MEMORY_LIMIT")
    return parse_bytes(value) if value else None


def memory_fraction() -> float:
    value = float(raw("MEMORY_FRACTION"))
    if not 0 < value <= 1:
        raise ValueError(f"{PREFIX}MEMORY_FRACTION={value}: expected a number in (0, 1]")
    return value


def verify() -> bool:
    return bool(flag("VERIFY"))


def partition() -> str:
    value = raw("PARTITION").lower()
    if value not in ("split", "full", "auto"):
        raise ValueError(f"{PREFIX}PARTITION={value!r}: expected split, full or auto")
    return value


def ranks_per_host() -> Optional[int]:
    value = raw("RANKS_PER_HOST")
    return int(value) if value else None


def use_mpi() -> Optional[bool]:
    return flag("MPI")


def exchange_round_bytes() -> int:
    return parse_bytes(raw("EXCHANGE_ROUND_BYTES"))


def threads() -> int:
    return int(raw("THREADS"))


def decoder() -> str:
    value = raw("DECODER").lower()
    if value not in ("auto", "simplejpeg", "pil"):
        raise ValueError(f"{PREFIX}DECODER={value!r}: expected auto, simplejpeg or pil")
    return value
