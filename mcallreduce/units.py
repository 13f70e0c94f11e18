"""Sizes and rates: the forms users write (``64K``, ``200mbit``) parsed, and sizes printed back.

Standard library only: :mod:`mcallreduce.config` parses every variable with these.
"""
from __future__ import annotations

import re

from .errors import ConfigError

__all__ = ["parse_size", "parse_sizes", "parse_rate", "format_size", "format_bytes"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(i?[bB])?\s*$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)


def parse_size(text: str, what: str = "size") -> int:
    """'256K' -> 262144, '1M' -> 1048576, '1.5G', '4096' -> 4096 (binary units)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{what}: {text!r} is not a size (examples: 4096, 256K, 1M, 1.5G)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale) if "." in m.group(1) else int(m.group(1)) * scale


def parse_sizes(text: str, what: str = "sizes") -> list:
    """A comma-separated list of sizes, as the command lines take it ('4K,1M'); empty items skipped."""
    return [parse_size(s, what) for s in text.split(",") if s]


def parse_rate(text: str, what: str = "rate") -> int:
    """'200mbit' -> 200_000_000 bits/s (tc's units: k = 1000; 'bps' means bytes/s)."""
    match = _RATE.match(str(text))
    if not match:
        raise ConfigError(f"{what}: bad rate {text!r}: use e.g. 200mbit, 1gbit, 500kbit")
    number, scale, unit = match.groups()
    bits = float(number) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[scale.lower()]
    if (unit or "bit").lower() == "bps":
        bits *= 8
    if bits < 8_000:
        raise ConfigError(f"{what}: rate {text!r} is below 8 kbit/s")
    return int(bits)


def format_size(nbytes: int) -> str:
    """A size in the form :func:`parse_size` reads back exactly: 65536 -> '64K', 1000 -> '1000'."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def format_bytes(n: float) -> str:
    """An amount for people, rounded: 1153433 -> '1.1 MiB', 512 -> '512 B'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
