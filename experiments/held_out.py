"""The trained model and its held-out windows, as the studies on them take them from the command line
(`index_dtype_quality.py`, `index_tier.py`): the shared options, their checks, and the loading."""

from __future__ import annotations

import argparse
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --out, --sequences, --seq-len, --trace-start and --quick (each script sets what --quick means)."""
    p.add_argument("--model", default="stdlib-dsa", help="a shipped checkpoint's name or a checkpoint folder")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--sequences", type=int, default=4, help="held-out windows (default 4)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--trace-start", type=int, default=512, help="first decode position traced (default 512)")
    p.add_argument("--quick", action="store_true", help="2 short windows (tests / smoke)")


def check(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """A usage error (exit 2) unless --sequences >= 1, --seq-len >= 2 and 0 <= --trace-start < --seq-len."""
    if a.sequences < 1 or a.seq_len < 2 or not 0 <= a.trace_start < a.seq_len:
        p.error("need --sequences >= 1, --seq-len >= 2 and 0 <= --trace-start < --seq-len")


def load(p: argparse.ArgumentParser, a: argparse.Namespace):
    """(checkpoint folder, held-out windows int32[sequences, seq_len + 1], corpus info); a bad --model is a usage
    error."""
    from hisparse_jax.train import data

    folder = resolve(p, a.model)
    _, held, info = data.load_corpus()
    return folder, data.fixed_windows(held, a.seq_len + 1, a.sequences), info


def resolve(p: argparse.ArgumentParser, name: str, option: str = "--model") -> str:
    """The checkpoint folder of a shipped checkpoint's name or a checkpoint folder; otherwise a usage error (exit 2)
    that names `option`."""
    from hisparse_jax import checkpoints

    try:
        return checkpoints.resolve(name)
    except (ValueError, FileNotFoundError) as e:
        p.error(f"{option}: {e}")


def model_name(a: argparse.Namespace | str, folder) -> str:
    """The shipped checkpoint's name, or the folder relative to the working directory (`a`: the parsed --model,
    or the name or folder given)."""
    from hisparse_jax import checkpoints

    name = a if isinstance(a, str) else a.model
    return name if name in checkpoints.SHIPPED else os.path.relpath(folder)
