"""How much memory this machine and its devices have, and the account sizes are checked against before anything of
them is allocated (`docs/bad_input.md`). jax is imported only where a device is asked about: the host bookkeeping
(`kv.pool`, `kv.manager`) checks its account without it."""

from __future__ import annotations

import dataclasses
import os


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
    import jax
    import jax.numpy as jnp

    return isinstance(jnp.zeros((), jnp.int8), jax.core.Tracer)


@dataclasses.dataclass(frozen=True)
class Cost:
    """One entry of a memory account: `nbytes` held in `where` ("device": the memory of each device that runs the
    work; "host": this machine's RAM), and the user's settings its size follows (`sized_by`, e.g.
    "hot_rows=10000000 x 256 step rows"), which a refusal names."""

    part: str
    nbytes: int
    where: str
    sized_by: str


def check_account(what: str, costs: list[Cost], *, device=None, ranks: int = 1) -> None:
    """Refuse (ValueError), before anything of these sizes exists, work whose account does not fit: the "device"
    costs on each of `ranks` devices against that device's memory, `ranks` times the "host" costs against this
    machine's RAM (on a CPU both are RAM, so everything counts there, `ranks` times). One message names the bytes,
    the limit, the largest entry and the settings behind it. Without a known limit nothing is refused."""
    per = {"device": [c for c in costs if c.where == "device"], "host": [c for c in costs if c.where == "host"]}
    dev = None
    if per["device"]:  # (host costs alone need no device: the NumPy bookkeeping never starts jax's backend)
        import jax

        dev = device if device is not None else jax.devices()[0]
        if dev.platform == "cpu":
            per = {"device": [], "host": per["device"] + per["host"]}
    on_each = f" on each of {ranks} devices" if ranks > 1 else ""
    checks = (("device", dev and device_memory_bytes(dev), dev and memory_name(dev), 1, on_each),
              ("host", host_memory_bytes(), "this machine's physical RAM", ranks,
               f" ({ranks} devices' share)" if ranks > 1 else ""))
    for where, limit, name, times, whose in checks:
        total = times * sum(c.nbytes for c in per[where])
        if limit is None or total <= limit:
            continue
        big = max(per[where], key=lambda c: c.nbytes)
        raise ValueError(f"{what} needs {total:,} bytes ({total / 2**30:,.1f} GiB){whose}, more than the {limit:,} "
                         f"bytes ({limit / 2**30:,.1f} GiB) of {name}; the largest part is {big.part} "
                         f"({big.nbytes:,} bytes{' per device' if times > 1 else ''}, sized by {big.sized_by})")


def account_bytes(costs: list[Cost], *, ranks: int = 1) -> dict[str, int]:
    """An account's totals: bytes per device ("device") and in this machine's RAM ("host", `ranks` times)."""
    return {"device": sum(c.nbytes for c in costs if c.where == "device"),
            "host": ranks * sum(c.nbytes for c in costs if c.where == "host")}
