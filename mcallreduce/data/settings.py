"""The data package's ``MCALLREDUCE_DATA_*`` variables, parsed here and only here (the engine's
are in :mod:`mcallreduce.config`). Each is read when called, not at import, so a test or a launcher
can set them late. Hosts are grouped by the engine's ``MCALLREDUCE_RANKS_PER_HOST``, one variable
for both. Standard library only, like :mod:`mcallreduce.config`.
"""
from __future__ import annotations

import contextlib
from typing import Optional

from ..config import env_text, read_ranks_per_host
from ..envparse import parse_choice, parse_integer, parse_switch
from ..errors import ConfigError
from ..units import parse_size

__all__ = ["DATA_PREFIX", "DATA_VARIABLES", "data"]

DATA_PREFIX = "MCALLREDUCE_DATA_"

#: name -> (default, meaning); docs/data.md mirrors this table
DATA_VARIABLES = {
    "PROGRESS": ("auto", "progress bars (tqdm) on stderr of rank 0: 1 or auto on, 0 off; a pipe redraws every 10 s"),
    "MEMORY_LIMIT": ("", "cap in bytes (suffixes K, M, G, T) on the memory the store may take on a host"),
    "MEMORY_FRACTION": ("0.9", "share of the host's available memory the store may take"),
    "VERIFY": ("1", "check each sample's CRC32 while loading a packed store (0 skips it)"),
    "PARTITION": ("split", "split: each host holds its share; full: every host holds everything; auto: full when it fits"),
    "MPI": ("auto", "use MPI: 1 yes, 0 no, auto when launched by mpirun or when mpi4py.MPI is already imported"),
    "EXCHANGE_ROUND_BYTES": ("1G", "the most bytes one rank sends or receives in one Alltoallv round"),
    "THREADS": ("4", "default decode threads of the threaded loader"),
    "DECODER": ("auto", "JPEG decoder: turbo (decodes only the crop box; needs the built extension), "
                        "simplejpeg, pil, or auto (the first of these that imports)"),
}


class data:
    """The ``MCALLREDUCE_DATA_*`` settings (a namespace: ``settings.data.threads()``)."""

    @staticmethod
    def raw(name: str) -> str:
        if name not in DATA_VARIABLES:
            raise KeyError(f"unknown setting {DATA_PREFIX}{name}")
        return env_text(None, DATA_PREFIX + name) or DATA_VARIABLES[name][0]

    @staticmethod
    def flag(name: str) -> Optional[bool]:
        """True/False for 1/0 (yes/no, true/false); None for 'auto'."""
        return parse_switch(DATA_PREFIX + name, data.raw(name))

    @staticmethod
    def memory_limit() -> Optional[int]:
        value = data.raw("MEMORY_LIMIT")
        return parse_size(value, DATA_PREFIX + "MEMORY_LIMIT") if value else None

    @staticmethod
    def memory_fraction() -> float:
        text = data.raw("MEMORY_FRACTION")
        with contextlib.suppress(ValueError):
            if 0 < float(text) <= 1:
                return float(text)
        raise ConfigError(f"{DATA_PREFIX}MEMORY_FRACTION={text!r}: expected a number in (0, 1]")

    @staticmethod
    def verify() -> bool:
        return bool(data.flag("VERIFY"))

    @staticmethod
    def partition() -> str:
        return parse_choice(DATA_PREFIX + "PARTITION", data.raw("PARTITION"), ("split", "full", "auto"))

    @staticmethod
    def ranks_per_host() -> Optional[int]:
        """MCALLREDUCE_RANKS_PER_HOST (shared with the engine), read now."""
        return read_ranks_per_host()

    @staticmethod
    def use_mpi() -> Optional[bool]:
        return data.flag("MPI")

    @staticmethod
    def exchange_round_bytes() -> int:
        """At least a byte, and a count Alltoallv's C ints hold."""
        text = data.raw("EXCHANGE_ROUND_BYTES")
        size = parse_size(text, DATA_PREFIX + "EXCHANGE_ROUND_BYTES")
        if not 0 < size < 1 << 31:
            raise ConfigError(f"{DATA_PREFIX}EXCHANGE_ROUND_BYTES={text!r}: expected a size from 1 byte to 2G - 1")
        return size

    @staticmethod
    def threads() -> int:
        return parse_integer(DATA_PREFIX + "THREADS", data.raw("THREADS"), 1, auto=False)

    @staticmethod
    def decoder() -> str:
        return parse_choice(DATA_PREFIX + "DECODER", data.raw("DECODER"), ("auto", "turbo", "simplejpeg", "pil"))
