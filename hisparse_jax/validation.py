"""Checks at the door for values that come from users: sizes, sampling parameters, token ids.

Each check returns the value in its canonical Python type or raises `ValueError` naming the field and the
value. Nothing is coerced silently: 3.7 is not a token id, "64" is not a size, True is not an integer, NaN is
not a temperature, and a [1, T] array is not a prompt.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    """An integer (Python or NumPy, never bool or float) with lo <= value <= hi."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    v = int(value)
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def check_float(name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False) -> float:
    """A finite real number with lo <= value (lo < value when `lo_open`) and value <= hi."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def check_optional_float(name: str, value: Any, **kw) -> float | None:
    return None if value is None else check_float(name, value, **kw)


def check_token_list(name: str, value: Any, *, allow_empty: bool = True) -> tuple[int, ...]:
    """Token ids given as None, one integer or a sequence of integers -> a tuple (e.g. `eos_token_id`)."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a token id or a list of token ids, got {value!r}")
    if isinstance(value, (int, np.integer)):
        return (check_int(name, value, lo=0),)
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"{name} must be a token id or a list of token ids, got {value!r}") from None
    if not items and not allow_empty:
        raise ValueError(f"{name} is empty")
    return tuple(check_int(f"{name}[{i}]", t, lo=0) for i, t in enumerate(items))


def check_prompt(name: str, tokens: Any, vocab_size: int) -> list[int]:
    """One prompt: a non-empty 1-D sequence (list, tuple or array) of integer token ids in [0, vocab_size)."""
    if isinstance(tokens, (str, bytes)) or tokens is None:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got {type(tokens).__name__}")
    if isinstance(tokens, (list, tuple)):
        for i, t in enumerate(tokens):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                what = "a sequence (prompts are 1-D)" if isinstance(t, (list, tuple, np.ndarray)) else repr(t)
                raise ValueError(f"{name}: token {i} must be an integer token id, got {what}")
        ids = [int(t) for t in tokens]
    else:
        try:
            a = np.asarray(tokens)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{name} must be a 1-D sequence of token ids ({e})") from None
        if a.ndim != 1:
            raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {a.shape}")
        if a.size and a.dtype.kind not in "iu":
            raise ValueError(f"{name} must hold integer token ids, got {a.dtype} values (e.g. {a[0]!r})")
        ids = a.tolist()
    if not ids:
        raise ValueError(f"{name} is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} has token ids out of range [0, {vocab_size}): {bad[:8]}")
    return ids


def check_eos(name: str, eos_ids, vocab_size: int) -> None:
    """EOS ids the model can emit: an id outside [0, vocab_size) is never sampled, so it would never stop a
    request (refused rather than silently ignored)."""
    bad = [t for t in eos_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} has ids outside the vocabulary [0, {vocab_size}): {sorted(bad)[:8]} (the model "
                         "never samples them, so they would never stop a request)")
