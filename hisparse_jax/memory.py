"""How much memory this machine and its devices have: the bound the model, the store and the demo refuse sizes
against before allocating them (`docs/bad_input.md`)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp


def host_memory_bytes() -> int | None:
    """This machine's physical RAM in bytes (None where the OS does not say)."""
    try:
        n = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return n if n > 0 else None


def device_memory_bytes(device) -> int | None:
    """The memory arrays made on `device` can use: the machine's physical RAM for a CPU device, else the device's
    `memory_stats()['bytes_limit']` (None when the backend does not report it: no check is possible)."""
    if device.platform == "cpu":
        return host_memory_bytes()
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend without memory statistics
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def memory_name(device) -> str:
    """What `device_memory_bytes(device)` measured, in words."""
    if device.platform == "cpu":
        return "this machine's physical RAM (the CPU device's memory)"
    return f"the memory of {device.device_kind} {device.id} (memory_stats bytes_limit)"


def abstract() -> bool:
    """Whether jax is tracing here (`jax.eval_shape`, `nnx.eval_shape`, `jit`): a fresh array is then a
    `jax.core.Tracer` (the public test flax uses too) and nothing is allocated, so no size is refused: shapes of
    GLM-5 stay computable on any machine (deviceless builds, `load_pretrained`'s shape pass)."""
    return isinstance(jnp.zeros((), jnp.int8), jax.core.Tracer)
