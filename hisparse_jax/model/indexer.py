"""The lightning indexer of DeepSeek Sparse Attention (DSA).

For a query token t and a cached key position s (one index set per layer and token, shared by
all attention heads):

    I(t, s) = sum_h w[t, h] * relu(qI[t, h] . kI[s])        (float32 accumulation)

with qI = W_Iq cq ([I, dI], RoPE on its first R dims), kI = LayerNorm(W_Ik x) ([dI], same RoPE),
w = W_Iw x * I^-0.5 * dI^-0.5 (the positive scale constants are folded into w). Positions s > t
are masked to -inf *before* the top-k; the selection keeps min(index_topk, #keys) positions.

Tie-break: `lax.top_k` keeps the lower position among equal scores. Padding: positions that are
not valid (causally masked, or beyond the last key) come back as -1.

Optional FP8 emulation (DeepSeek's inference path, `index_dtype="fp8"`; or MXFP4, `"int4"`): q and k are rotated by the
Sylvester Hadamard matrix / sqrt(dI) and quantized to e4m3 with power-of-two scales
2^ceil(log2(max(amax, 1e-4) / 448)) per 128 values; the score multiplies q's scale inside the
head sum and k's scale after it.

The math (scores, FP8 emulation, top-k) is specified once, in `pallas_kernels.indexer_topk.reference` and
`pallas_kernels.common`; this module holds the parameters and the projections.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from hisparse_jax.config import ModelConfig
from hisparse_jax.model.layers import LayerNorm, Linear
from hisparse_jax.model.rope import apply_rope


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
