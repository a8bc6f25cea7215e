"""The Pallas GPU backends a kernel can be built with, and whether this jax has the Mosaic GPU one.

* "triton"  Pallas' Triton lowering: every supported jax (deprecated from jax 0.11 on, still shipped).
* "mosaic"  Pallas' Mosaic GPU lowering (TMA, warpgroup MMA, barriers; sm_90): jax >= 0.11, which also has its
            GPU interpret mode (`plgpu.force_gpu_interpret_mode`) to run the kernels on a CPU.

Mosaic GPU's interpret mode runs each simulated warpgroup of a cluster as its own XLA:CPU program, and each
blocks a thread of XLA:CPU's intra-op pool while it waits at a barrier: with fewer pool threads than
warpgroups running at once it hangs. XLA sizes that pool when jax's CPU client starts, from the environment
variable PJRT_NPROC (or NPROC), else the schedulable CPUs (2 on a 2-core machine, and a Mosaic kernel with a
cluster of 2 blocks has 4 warpgroups). `cpu_pool_threads` reads that size; `request_interpret_threads`
sets PJRT_NPROC before the client exists.
"""

from __future__ import annotations

import os

import jax

BACKENDS = ("triton", "mosaic")


def check_pallas_backend(backend: str) -> str:
    """`backend` if it is one of BACKENDS, else ValueError."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def mosaic_unavailable_reason() -> str | None:
    """None where this jax has the Mosaic GPU Pallas API and its interpret mode, else why not."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as e:  # pragma: no cover - jax without Mosaic GPU
        return f"backend 'mosaic' needs jax's Mosaic GPU Pallas API: {e}"
    if not hasattr(plgpu, "kernel") or not hasattr(plgpu, "force_gpu_interpret_mode"):
        return (f"backend 'mosaic' needs jax >= 0.11 (Mosaic GPU's plgpu.kernel and GPU interpret mode); this is jax "
                f"{jax.__version__}: use backend 'triton'")
    return None


def mosaic_gpu():
    """`jax.experimental.pallas.mosaic_gpu`, or NotImplementedError saying why this jax cannot build Mosaic kernels."""
    if (why := mosaic_unavailable_reason()) is not None:
        raise NotImplementedError(why)
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


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
            f"environment before jax starts (or call pallas_kernels.backends.request_interpret_threads() first)")
