"""How an experiment leaves its results: the run's stamp, one JSON file, one figure, a benchmark's command.

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


def finish_axes(ax, *, xlabel: str | None = None, ylabel: str | None = None, title: str | None = None,
                **legend) -> None:
    """The experiments' axes finish: the labels and title given, a light grid and a legend (`legend`: its keywords,
    e.g. fontsize=8)."""
    for set_text, text in ((ax.set_xlabel, xlabel), (ax.set_ylabel, ylabel), (ax.set_title, title)):
        if text is not None:
            set_text(text)
    ax.grid(alpha=0.3)
    ax.legend(**legend)


def run_to_json(parse_args, run, argv=None) -> int:
    """A benchmark's command: `run(parse_args(argv))`, its result written to the parsed `--out`; exit status 0."""
    args = parse_args(argv)
    save_json(args.out, run(args))
    return 0


def save_results(folder: str, name: str, out: dict, plot=None, *, quick: bool = False,
                 started: float | None = None) -> str:
    """The usual ending: `out` as `<folder>/<name>.json` and `plot(out, <folder>/<name>.png)` when given, with the
    name tagged `_quick` for a --quick run (so a smoke run never overwrites the results); with `started` (a
    `time.perf_counter()` reading) the run's wall time goes into `out["wall_s"]` first and a closing line says it
    and where the files are. Returns the path without its extension."""
    base = os.path.join(folder, f"{name}{'_quick' if quick else ''}")
    if started is not None:
        out["wall_s"] = time.perf_counter() - started
    save_json(base + ".json", out)
    if plot is not None:
        plot(out, base + ".png")
    if started is not None:
        print(f"wall {out['wall_s']:.1f} s -> {base}.json{'/.png' if plot is not None else ''}")
    return base


def save_figure(fig, path: str, dpi: int = 120) -> str:
    """Lay `fig` out tightly, write it to `path` and release it; returns `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
