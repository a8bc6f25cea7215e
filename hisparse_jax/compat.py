"""Differences between the supported jax versions (0.10.2 to the newest), in one place.

Everything version-dependent that the library and its experiments touch goes through here, so the rest of
the code reads as if there were one jax. Each shim says which versions differ and how.
"""

from __future__ import annotations

import inspect

import jax
from jax.experimental.compute_on import compute_on as _compute_on

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device

# jax <= 0.11.0: `with compute_on("device_host"): ...` (a context manager).
# jax >= 0.11.1: only the decorator form `compute_on(compute_type=..., out_memory_spaces=...)(fn)`.
_COMPUTE_ON_DECORATOR = "out_memory_spaces" in inspect.signature(_compute_on).parameters


def on_host(fn, *args):
    """`fn(*args)` computed on the host (XLA `compute_on("device_host")`), every output in host memory.

    The arguments must already live in host memory (`jax.device_put(x, HOST)` or a `pinned_host` array).
    Inside `jit` this is how a gather from, or a scatter into, a pinned-host pool stays on the host: ops may
    not mix memory kinds, and the host-side program moves only the rows it touches."""
    if _COMPUTE_ON_DECORATOR:
        return _compute_on(compute_type="device_host", out_memory_spaces=HOST)(fn)(*args)
    with _compute_on("device_host"):
        return fn(*args)


# The GPU a Pallas-Triton kernel is lowered for when no GPU is attached: the H100 / H200's sm_90.
GPU_TARGET_KIND = "NVIDIA H100"


def gpu_lowering_target(device_kind: str = GPU_TARGET_KIND):
    """Context manager: lower Pallas-Triton kernels for a GPU of this kind on a machine without one.

    `with gpu_lowering_target(): jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`.
    jax <= 0.10.x: the Triton lowering falls back to compute capability 9.0 when no GPU is attached.
    jax >= 0.11: it reads the target from the abstract mesh's `AbstractDevice` and, with neither a GPU nor one
    set, fails ("No supported GPU devices found, please specify an abstract GPU device"). Setting a one-device
    abstract mesh naming the GPU works on every supported version (0.10.2 ignores it), so this does not branch."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("_gpu",), abstract_device=device))
