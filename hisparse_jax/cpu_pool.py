"""XLA:CPU's intra-op thread pool, and what Mosaic GPU's interpret mode needs of it.

Mosaic GPU's interpret mode runs each simulated warpgroup of a cluster as its own XLA:CPU program, and each
holds a thread of XLA:CPU's intra-op pool while it waits at a barrier: with fewer pool threads than
warpgroups running at once it hangs (seen on 2 cores: a kernel with a cluster of 2 blocks has 4 warpgroups,
and the decode step's host callback around the interpreted kernel holds one more). XLA sizes that pool when
jax's CPU client starts, from the environment variable PJRT_NPROC (or NPROC), else the schedulable CPUs.
`cpu_pool_threads` reads that size; `request_interpret_threads` sets PJRT_NPROC before the client exists.
(The Pallas kernels import only jax, so this lives here.)
"""

from __future__ import annotations

import os

INTERPRET_POOL_THREADS = 8  # what `request_interpret_threads` asks for: any kernel here, plus the caller's callback


def cpu_pool_threads() -> int:
    """The size of XLA:CPU's intra-op thread pool as XLA sizes it when jax's CPU client starts: PJRT_NPROC or NPROC
    when set, else the CPUs this process may run on. (Set after the client exists, the variables change nothing.)"""
    for name in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def request_interpret_threads(threads: int = INTERPRET_POOL_THREADS) -> None:
    """Ask for an XLA:CPU pool of at least `threads` threads (sets PJRT_NPROC unless the pool is already that
    large). Effective only before jax's CPU client exists, i.e. before jax first runs anything."""
    if cpu_pool_threads() < threads:
        os.environ["PJRT_NPROC"] = str(threads)


def interpret_pool_short_reason(warpgroups: int) -> str | None:
    """None if the XLA:CPU pool can run `warpgroups` simulated warpgroups at once, else what to set."""
    have = cpu_pool_threads()
    if have >= warpgroups:
        return None
    return (f"Mosaic GPU's interpret mode runs {warpgroups} warpgroups at once here, each holding an XLA:CPU pool "
            f"thread while it waits, and this pool has {have}: set PJRT_NPROC={INTERPRET_POOL_THREADS} in the "
            f"environment before jax starts (or call hisparse_jax.cpu_pool.request_interpret_threads() first)")
