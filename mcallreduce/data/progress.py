"""Progress bars (tqdm) for packing, loading and training, on stderr, also when stderr is a pipe."""
from __future__ import annotations

import sys
from typing import Optional

from tqdm import tqdm

from .settings import data as settings

# Redraw interval in seconds: a terminal redraws often; a pipe (mpirun's stderr, a log) gets a line now and then.
TERMINAL_INTERVAL_S, PIPE_INTERVAL_S = 0.1, 10.0


def wanted(show: Optional[bool] = None) -> bool:
    """``show`` wins; then MCALLREDUCE_DATA_PROGRESS; then on (callers pass False on all ranks but one)."""
    if show is not None:
        return show
    setting = settings.flag("PROGRESS")
    return True if setting is None else setting


def bar(total: Optional[float] = None, desc: str = "", unit: str = "it", show: Optional[bool] = None,
        **options) -> tqdm:
    """A tqdm bar on stderr; disabled unless :func:`wanted`. ``unit='B'`` scales to kB/MB/GB."""
    terminal = sys.stderr is not None and sys.stderr.isatty()
    options.setdefault("mininterval", TERMINAL_INTERVAL_S if terminal else PIPE_INTERVAL_S)
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr,
                disable=not wanted(show), dynamic_ncols=terminal, **options)
