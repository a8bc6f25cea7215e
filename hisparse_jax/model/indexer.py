"""The lightning indexer of DeepSeek Sparse Attention (DSA).

For a query token t and a cached key position s (one index set per layer and token, shared by
all attention heads):

    I(t, s) = sum_h w[t, h] * relu(qI[t, h] . kI[s])        (float32 accumulation)

with qI = W_Iq cq ([I, dI], RoPE on its first R dims), kI = LayerNorm(W_Ik x) ([dI], same RoPE),
w = W_Iw x * I^-0.5 * dI^-0.5 (the positive scale constants are folded into w). Positions s > t
are masked to -inf *before* the top-k; the selection keeps min(index_topk, #keys) positions.

Tie-break: `lax.top_k` keeps the lower position among equal scores. Padding: positions that are
not valid (causally masked, or beyond the cache) come back as -1.

Optional FP8 emulation (DeepSeek's inference path, `fp8=True`): q and k are rotated by the
Sylvester Hadamard matrix / sqrt(dI) and quantized to e4m3 with power-of-two scales
2^ceil(log2(max(amax, 1e-4) / 448)) per 128 values; the score multiplies q's scale inside the
head sum and k's scale after it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax.config import ModelConfig
from hisparse_jax.model.layers import LayerNorm, Linear
from hisparse_jax.model.rope import apply_rope

FP8_MAX = 448.0


class Indexer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, dtype=dtype, rngs=rngs)
        self.wk = Linear(cfg.hidden_size, cfg.index_head_dim, dtype=dtype, rngs=rngs)
        self.k_norm = LayerNorm(cfg.index_head_dim, 1e-6, dtype=dtype)
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, dtype=jnp.float32, rngs=rngs)


def indexer_project(idx: Indexer, cfg: ModelConfig, x, cq, cos, sin):
    """x [B, T, D], cq [B, T, Q] -> (qI f32[B, T, I, dI], kI [B, T, dI], w f32[B, T, I]).

    `w` already carries the constants I^-0.5 * dI^-0.5, so the score is sum_h w_h relu(qI_h . kI).
    """
    B, T, _ = x.shape
    R = cfg.qk_rope_head_dim
    q = idx.wq_b(cq).reshape(B, T, cfg.index_n_heads, cfg.index_head_dim)
    q = jnp.concatenate([apply_rope(q[..., :R], cos[:, :, None], sin[:, :, None],
                                    interleaved=cfg.indexer_rope_interleaved), q[..., R:]], axis=-1)
    k = idx.k_norm(idx.wk(x))
    k = jnp.concatenate([apply_rope(k[..., :R], cos, sin, interleaved=cfg.indexer_rope_interleaved), k[..., R:]],
                        axis=-1)
    w = idx.weights_proj(x.astype(jnp.float32)).astype(jnp.float32) * cfg.index_score_scale
    return q.astype(jnp.float32), k, w


def index_scores(q, w, k, *, fp8: bool = False):
    """q f32[..., T, I, dI], w f32[..., T, I], k [..., S, dI] -> f32[..., T, S] (unmasked)."""
    if fp8:
        return index_scores_fp8(q, w, *quantize_index_keys(k))
    dots = jnp.einsum("...tid,...sd->...tis", q, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum("...tis,...ti->...ts", jax.nn.relu(dots), w, precision=jax.lax.Precision.HIGHEST)


def quantize_index_keys(k):
    """Indexer keys as DeepSeek caches them: e4m3 of the Hadamard-rotated key + one fp32 scale per key.

    k [..., S, dI] -> (e4m3 [..., S, dI], f32 [..., S])."""
    return fp8_quantize(hadamard(k.astype(jnp.float32)), block=k.shape[-1])


def index_scores_fp8(q, w, k_fp8, k_scale):
    """FP8 emulation with pre-quantized keys: q f32[..., T, I, dI], w f32[..., T, I],
    k_fp8 e4m3[..., S, dI], k_scale f32[..., S] -> f32[..., T, S]."""
    qq, qs = fp8_quantize(hadamard(q), block=q.shape[-1])  # qs [..., T, I]
    dots = jnp.einsum("...tid,...sd->...tis", qq.astype(jnp.float32), k_fp8.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    s = jnp.einsum("...tis,...ti->...ts", jax.nn.relu(dots), w * qs, precision=jax.lax.Precision.HIGHEST)
    return s * k_scale[..., None, :]


def select_topk(scores, valid, k: int):
    """scores f32[..., S], valid bool[..., S] -> int32[..., min(k, S)] positions, -1 where not valid.

    Valid positions come first in descending score order; the lower position wins a tie.
    """
    k = min(k, scores.shape[-1])
    masked = jnp.where(valid, scores, -jnp.inf)
    _, pos = jax.lax.top_k(masked, k)
    ok = jnp.take_along_axis(valid, pos, axis=-1)
    return jnp.where(ok, pos, -1).astype(jnp.int32)


def hadamard(x):
    """x [..., d] @ H_d / sqrt(d), H_d the Sylvester Hadamard matrix (d a power of two)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two dimension, got {d}")
    h = np.array([[1.0]], np.float32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return x @ jnp.asarray(h / math.sqrt(d), x.dtype)


def fp8_quantize(x, block: int = 128):
    """Per-`block` e4m3 quantization with power-of-two scales.

    x f32[..., d] -> (e4m3[..., d], f32[...] scale when d == block, else f32[..., d // block]).
    """
    d = x.shape[-1]
    b = min(block, d)
    xb = x.reshape(*x.shape[:-1], d // b, b)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    scale = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-4) / FP8_MAX)))
    q = (xb / scale).astype(jnp.float8_e4m3fn).reshape(x.shape)
    scale = scale[..., 0]
    return q, (scale[..., 0] if d == b else scale)
