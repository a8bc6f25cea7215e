"""How the store holds its values: the latent and indexer-key formats, and the moves into and out of pinned-host
memory.

* `encode_latent` / `decode_latent`   the KV pools' latent (fp8 e4m3 + a scale per 128 values, or bf16 / f32)
* `encode_index` / `scored_keys`      the indexer keys' stored format (`StoreSpec.index_dtype`) and the f32 keys the
                                      indexer scores
* `set_rows`                          a pool write (a scatter with out-of-range rows dropped), in place
* `to_host_memory` / `from_host_memory`  values in and out of a host pool, as their bits

Host pools live in `pinned_host` memory. Inside `jit` ops may not mix memory kinds, so host reads are
`dynamic_slice` + `device_put(Device)` (the page fetch, swap-in) or one gather placed on the host with
`compute_on("device_host")` (`compat.on_host`: the row fetch, the host-tier indexer), followed by one
`device_put(Device)`. Host writes are a `device_put(Host)` row or page block `dynamic_update_slice`d into the
pinned-host pool, which XLA does in place; a host-side scatter under `compute_on` returns a new pool (on a GPU: a copy
of the whole host pool per call, see tests/e2e/test_gpu_build.py). On CPU these are semantic only; on a GPU they are the
H2D / D2H copies being measured. Host pools of bf16 / fp8 values hold their bit patterns (`state.host_dtype`): every
write goes through `to_host_memory` (values -> bits on the device, then to host memory) and every read through
`from_host_memory` (to the device, then bits -> values), so the host-memory ops are integer moves that XLA:CPU does
not widen to f32 over the whole pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hisparse_jax.compat import DEVICE, HOST
from hisparse_jax.kv.spec import FP8_BLOCK, StoreSpec
from hisparse_jax.kv.state import from_host_bits, to_host_bits
from pallas_kernels.common import fp8_quantize, mxfp4_dequantize
from pallas_kernels.indexer_topk.reference import quantize_index_keys, quantize_index_keys_int4


def encode_latent(spec: StoreSpec, c):
    """c [..., C] -> (stored values, scales [..., C/128] or None)."""
    if spec.fp8:
        q, scale = fp8_quantize(c.astype(jnp.float32), block=FP8_BLOCK)
        return q, scale.reshape(*c.shape[:-1], c.shape[-1] // FP8_BLOCK)
    return c.astype(spec.value_dtype), None


def decode_latent(spec: StoreSpec, values, scales):
    """Stored latent -> float32 [..., C]."""
    if spec.fp8:
        v = values.astype(jnp.float32).reshape(*values.shape[:-1], -1, FP8_BLOCK)
        return (v * scales[..., None]).reshape(values.shape)
    return values.astype(jnp.float32)


def encode_index(spec: StoreSpec, k):
    """k [..., dI] -> (stored keys, scales or None) in the store's index format (`StoreSpec.index_dtype`)."""
    if spec.index_dtype == "fp8":
        return quantize_index_keys(k)
    if spec.index_dtype == "int4":
        return quantize_index_keys_int4(k)
    return k.astype(jnp.float32 if spec.index_dtype == "float32" else jnp.bfloat16), None


def scored_keys(spec: StoreSpec, kv, ks):
    """Stored keys (`encode_index`'s) -> f32[..., dI], the keys as the indexer scores them: fp8 e4m3 x its scale
    (a power of two: exact), int4 MXFP4 dequantized, bf16 / f32 as they are. The page summaries
    (`kv.summary`) summarize these."""
    if spec.index_dtype == "fp8":
        return kv.astype(jnp.float32) * ks[..., None]
    if spec.index_dtype == "int4":
        return mxfp4_dequantize(kv, ks)
    return kv.astype(jnp.float32)


def set_rows(pool, index, vals):
    """`pool.at[index].set(vals, mode="drop")`, written through an unsigned-integer view of the pool when its dtype
    is a float narrower than 32 bits (fp8, bf16): XLA:CPU scatters those by converting the whole pool to a wider
    float and back, a pool-sized copy per call, while the bits scatter in place. The values written are the same."""
    dt = pool.dtype
    if jnp.issubdtype(dt, jnp.floating) and dt.itemsize < 4:
        u = jnp.uint8 if dt.itemsize == 1 else jnp.uint16
        bits = jax.lax.bitcast_convert_type(pool, u).at[index].set(
            jax.lax.bitcast_convert_type(jnp.asarray(vals).astype(dt), u), mode="drop")
        return jax.lax.bitcast_convert_type(bits, dt)
    return pool.at[index].set(vals, mode="drop")


def to_host_memory(x):
    """Device values -> host-pool bits in host memory (what is `dynamic_update_slice`d into a host pool)."""
    return jax.device_put(to_host_bits(x), HOST)


def from_host_memory(bits, dtype):
    """Rows / pages read out of a host pool (host memory, bits) -> device values of `dtype`."""
    return from_host_bits(jax.device_put(bits, DEVICE), dtype)


def drop_unless(idx, ok, bound):
    """Replace indices of dropped writes by an out-of-bounds value (scatters use mode="drop")."""
    return jnp.where(ok, idx, bound)
