"""What the benchmarks write: JSON and PNG files, each atomically (a reader never sees half of one)."""
from __future__ import annotations

import json
import os


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


def write_json(path, payload) -> None:
    """``payload`` as indented JSON at ``path`` (a str or a Path), through a temporary file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(f"{path}.tmp", path)
