"""A tiny progress bar on stderr, shown when stderr is a TTY or when asked."""
from __future__ import annotations

import sys
import time
from typing import Optional

from ..config import data as config


def wanted(show: Optional[bool] = None) -> bool:
    """``show`` wins; then MCALLREDUCE_DATA_PROGRESS; then 'is stderr a TTY'."""
    if show is not None:
        return show
    setting = config.flag("PROGRESS")
    if setting is not None:
        return setting
    return sys.stderr.isatty()


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    return str(n)


class Progress:
    """``with Progress(total, 'packing') as bar: bar.update(n)``; redraws at most 10 times a second."""

    def __init__(self, total: float, label: str, unit: str = "", show: Optional[bool] = None):
        self.total, self.label, self.unit = total, label, unit
        self.done = 0.0
        self.show = wanted(show)
        self.start = time.monotonic()
        self._last_draw = 0.0

    def update(self, n: float = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.show and (now - self._last_draw > 0.1 or self.done >= self.total):
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        width = 30
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        rate = self.done / max(now - self.start, 1e-9)
        sys.stderr.write(f"\r{self.label} [{bar}] {frac * 100:5.1f}% "
                         f"{_human(self.done)}/{_human(self.total)}{self.unit} {_human(rate)}{self.unit}/s")
        sys.stderr.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.show:
            self._draw(time.monotonic())
            sys.stderr.write("\n")
            sys.stderr.flush()
