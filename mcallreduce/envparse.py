"""Parsers for the values of environment variables: integers, switches, choices, seconds, sizes.

Each takes the variable's name and its text, and raises :class:`ConfigError` naming the
variable and the allowed values. Standard library only, as :mod:`mcallreduce.config`, which
reads every variable and parses it with these (sizes through :func:`mcallreduce.units.parse_size`).
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

from .errors import ConfigError
from .units import format_size, parse_size

__all__ = ["parse_integer", "parse_switch", "parse_choice", "parse_seconds", "parse_size_up_to"]


def parse_size_up_to(variable: str, value: Optional[str], default: int, most: Optional[int] = None) -> int:
    """A size (``value`` None: ``default``), 0 for off, at most ``most`` when given."""
    size = default if value is None else parse_size(value, variable)
    if most is not None and size > most:
        raise ConfigError(f"{variable}={value!r}: allowed values are 0 (off) or a size up to {format_size(most)}")
    return size


def parse_integer(variable: str, value: Optional[str], low: int, auto: bool = True) -> Optional[int]:
    """An integer >= ``low``; None when unset (or 'auto', where ``auto`` allows it)."""
    if not value or (auto and value.lower() == "auto"):
        return None
    allowed = f"'auto' or an integer >= {low}" if auto else f"an integer >= {low}"
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if number < low:
        raise ConfigError(f"{variable}={value!r}: allowed values are {allowed}")
    return number


def parse_switch(variable: str, value: Optional[str], auto: bool = True) -> Optional[bool]:
    """1/0 (yes/no, true/false, on/off) as True/False; None when unset (or 'auto', where allowed)."""
    if not value or (auto and value.lower() == "auto"):
        return None
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    allowed = "'auto', 1, 0" if auto else "1, 0"
    raise ConfigError(f"{variable}={value!r}: allowed values are {allowed}")


def parse_choice(variable: str, value: str, allowed: Sequence[str]) -> str:
    """``value`` (lower-cased) if it is one of ``allowed``."""
    value = value.lower()
    if value not in allowed:
        raise ConfigError(f"{variable}={value!r}: allowed values are {', '.join(allowed)}")
    return value


def parse_seconds(variable: str, value: str) -> float:
    """A number of seconds >= 0."""
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if number < 0:
        raise ConfigError(f"{variable}={value!r}: expected a number of seconds >= 0")
    return number


def leading_integer(text: str) -> int:
    """The integer ``text`` starts with, as C's strtol reads it (Horovod's own variables): "64MB" is 64,
    a text with none is 0."""
    leading = re.match(r"\s*[+-]?\d+", text)
    return int(leading.group()) if leading else 0
