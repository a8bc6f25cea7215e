"""The Pallas GPU backends a kernel can be built with, and whether this jax has the Mosaic GPU one.

* "triton"  Pallas' Triton lowering: every supported jax (deprecated from jax 0.11 on, still shipped).
* "mosaic"  Pallas' Mosaic GPU lowering (TMA, warpgroup MMA, barriers; sm_90): jax >= 0.11, which also has its
            GPU interpret mode (`plgpu.force_gpu_interpret_mode`) to run the kernels on a CPU.

Mosaic GPU's interpret mode needs an XLA:CPU thread pool of at least the warpgroups it simulates at once
(`hisparse_jax.cpu_pool`).
"""

from __future__ import annotations

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
