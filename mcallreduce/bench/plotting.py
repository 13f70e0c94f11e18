"""matplotlib without a display, and PNGs written atomically."""
from __future__ import annotations

import os


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: str, dpi: int = 110) -> None:
    """Write ``fig`` to ``path`` (PNG) through a temporary file, so a reader never sees half of it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=dpi)
    os.replace(path + ".tmp.png", path)
    pyplot().close(fig)
