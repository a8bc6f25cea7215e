"""Argument checks shared by the `hisparse` subcommands (pure Python; no jax).

Each type function parses one option value or raises `argparse.ArgumentTypeError`, which argparse turns into a
usage error naming the option: `error: argument --requests: must be >= 1, got '0'` (exit 2). The `check_*`
helpers cover what needs the filesystem and end in `parser.error` the same way, before any work starts.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from typing import Callable, Iterable


def _subject(name: str) -> str:
    return f"{name} " if name else ""


def int_at_least(low: int, name: str = "", *, high: int | None = None) -> Callable[[str], int]:
    """A type: a whole number >= `low` (and <= `high` when given). `name` (optional) prefixes the message, e.g. a
    config field."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_subject(name)}must be a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{_subject(name)}must be >= {low}, got {text!r}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{_subject(name)}must be <= {high}, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def bounded_float(low: float | None = None, high: float | None = None, *, low_inclusive: bool = True,
                  allow_inf: bool = False, name: str = "") -> Callable[[str], float]:
    """A type: a number in [low, high] ((low, high] with low_inclusive=False); never nan, never +-inf unless
    `allow_inf` (and then only where the low bound allows it: +inf, "unlimited", is above any `high`)."""
    lo = "" if low is None else f"{'>=' if low_inclusive else '>'} {low:g}"
    hi = "" if high is None else f"<= {high:g}"
    bounds = " and ".join(filter(None, (lo, hi)))
    need = ("a number" if allow_inf else "a finite number") + (f" {bounds}" if bounds else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_subject(name)}must be a number, got {text!r}") from None
        ok = not math.isnan(value) and (allow_inf or math.isfinite(value))
        ok = ok and (low is None or (value >= low if low_inclusive else value > low))
        ok = ok and (high is None or value <= high or (allow_inf and value == math.inf))
        if not ok:
            raise argparse.ArgumentTypeError(f"{_subject(name)}must be {need}, got {text!r}")
        return value

    return parse


def choice(names: Iterable[str], what: str) -> Callable[[str], str]:
    """A type: one of `names` (`what` names the kind in the message: 'unknown preset ...')."""
    known = tuple(names)

    def parse(text: str) -> str:
        if text not in known:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; choose from {', '.join(known)}")
        return text

    return parse


def name_list(names: Iterable[str], what: str) -> Callable[[str], tuple[str, ...]]:
    """A type: a comma-separated, non-empty list of distinct `names` -> a tuple in the order given."""
    known = tuple(names)

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(s.strip() for s in text.split(","))
        if not any(items):
            raise argparse.ArgumentTypeError(f"needs at least one {what} ({','.join(known)}), got {text!r}")
        if "" in items:
            raise argparse.ArgumentTypeError(f"empty {what} in {text!r}")
        unknown = [s for s in items if s not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, unknown))} in {text!r}; "
                                             f"choose from {', '.join(known)}")
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"repeated {what} in {text!r}")
        return items

    return parse


def check_output_file(parser: argparse.ArgumentParser, option: str, path: str) -> None:
    """`parser.error` unless `path` can be written as a file: not a directory, and its directory exists and
    takes a new file (probed with a temporary file, which os.access misses for root and special filesystems)."""
    if os.path.isdir(path):
        parser.error(f"argument {option}: {path!r} is a directory")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        parser.error(f"argument {option}: no directory {parent!r} for {path!r}")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        parser.error(f"argument {option}: cannot write in directory {parent!r} of {path!r} ({e.strerror or e})")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        parser.error(f"argument {option}: {path!r} is not writable")


def check_output_dir(parser: argparse.ArgumentParser, option: str, path: str) -> None:
    """Create directory `path` (and its parents) or `parser.error`; also when it takes no new file."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        parser.error(f"argument {option}: cannot create or write directory {path!r} ({e.strerror or e})")
