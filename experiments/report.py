"""How an experiment leaves its results: the run's stamp, one JSON file, one figure.

Every script under experiments/ ends the same way (stamp the record with when and where it ran, write it as JSON
under experiments/results/, draw its figure off-screen); these helpers are that ending, written once.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time


def stamp() -> dict:
    """When and where the run happened: {"date": local "YYYY-mm-dd HH:MM:SS", "machine": platform string}."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform()}


def save_json(path: str, obj, *, indent: int = 1, default=None) -> str:
    """Write `obj` to `path` as JSON ending in a newline (its folder made if missing), say so on stderr; returns
    `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent, default=default)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)
    return path


def pyplot():
    """matplotlib.pyplot on the off-screen Agg backend (imported on first use: most runs draw nothing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grid_legend(ax, **legend) -> None:
    """The experiments' axes finish: a light grid and a legend (`legend`: its keywords, e.g. fontsize=8)."""
    ax.grid(alpha=0.3)
    ax.legend(**legend)


def save_figure(fig, path: str, dpi: int = 120) -> str:
    """Lay `fig` out tightly, write it to `path` and release it; returns `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
