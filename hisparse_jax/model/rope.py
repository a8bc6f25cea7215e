"""Rotary position embeddings: default and YaRN frequencies; interleaved and half-split pairings.

Frequencies are computed in float32 NumPy exactly as transformers computes them in torch, so the
two implementations agree to the last bit of `inv_freq`.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from hisparse_jax.config import RopeConfig, yarn_get_mscale


@functools.lru_cache(maxsize=None)
def rope_frequencies(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    """Returns (inv_freq float32[dim // 2], attention_factor) for a rotary dimension `dim`."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(rope.theta), exponents, dtype=np.float32)
    if rope.rope_type == "default":
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0

    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    base, orig = rope.theta, rope.original_max_position_embeddings

    def correction_dim(num_rotations):
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (np.float32(1) - ramp).astype(np.float32)
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = inv_inter * (np.float32(1) - extrapolation) + inv_extra * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(positions: jnp.ndarray, inv_freq: np.ndarray, attention_factor: float):
    """positions int[...] -> (cos, sin) float32[..., R/2], already multiplied by the attention factor."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(freqs) * attention_factor, jnp.sin(freqs) * attention_factor


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, *, interleaved: bool) -> jnp.ndarray:
    """Rotate the last axis of x [..., R] with cos/sin [..., R/2] (broadcast over the axes between).

    interleaved: pairs (x0, x1), (x2, x3), ... (DeepSeek MLA, GLM indexer); otherwise half-split
    pairs (x_i, x_{i+R/2}) (NeoX; DeepSeek-V3.2 indexer). Either way the output is laid out as
    [a*cos - b*sin | b*cos + a*sin] where (a, b) are the pair members, matching transformers (whose
    interleaved rotation de-interleaves its output); q and k share the layout, so dot products are
    those of the original pairing.
    """
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
    cos = cos.astype(x.dtype)
    sin = sin.astype(x.dtype)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
