"""Multi-head latent attention (MLA) with q-LoRA, and its sparse (DSA) forms.

Per token x:  cq = RMSNorm(W_qa x) [Q];  q = W_qb cq -> [H, N + R] split [nope | rope];
              W_kva x -> [C + R]: c = RMSNorm(first C) (the cached latent), kR = RoPE(last R).
Cached per token and layer: c [C] and kR [R].

Prefill (`mla_prefill_attention`) expands keys/values per head like transformers does and masks
everything outside the indexer's top-k. Decode is the absorbed form: one KV head with a 576-d key [c | kR] and the 512-d latent as value,

    q~_h = W_UK_h^T q_nope_h,   score_h(s) = tau (q~_h . c_s + q_rope_h . kR_s),
    o_h  = W_UV_h sum_s softmax(score_h)(s) c_s.

The decode math is specified once, in `pallas_kernels.sparse_mla_decode.reference` (`sparse_mla_decode_rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hisparse_jax.config import ModelConfig
from hisparse_jax.model.indexer import Indexer
from hisparse_jax.model.layers import Linear, RMSNorm
from hisparse_jax.model.rope import apply_rope

HIGHEST = jax.lax.Precision.HIGHEST


class MLA(nnx.Module):
    """Parameters of one layer's attention. `indexer_type` ("full" | "shared") overrides `cfg.indexer_types[layer]`
    (an MTP layer, numbered past the main layers, always has its own "full" indexer)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs, indexer_type: str | None = None):
        H, C, R = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype=dtype, rngs=rngs)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype=dtype)
        self.q_b_proj = Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, C + R, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(C, 1e-6, dtype=dtype)
        self.kv_b_proj = Linear(C, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(H * cfg.v_head_dim, cfg.hidden_size, dtype=dtype, rngs=rngs)
        indexer_type = cfg.indexer_types[layer] if indexer_type is None else indexer_type
        if indexer_type not in ("full", "shared"):
            raise ValueError(f"indexer_type must be 'full' or 'shared', got {indexer_type!r}")
        self.indexer = Indexer(cfg, dtype=dtype, rngs=rngs) if indexer_type == "full" else None


def mla_project(attn: MLA, cfg: ModelConfig, x, cos, sin):
    """x [B, T, D] -> q_nope [B, T, H, N], q_rope [B, T, H, R], cq [B, T, Q], c [B, T, C], kR [B, T, R]."""
    B, T, _ = x.shape
    H, N, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    cq = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(cq).reshape(B, T, H, cfg.qk_head_dim)
    q_nope = q[..., :N]
    q_rope = apply_rope(q[..., N:], cos[:, :, None], sin[:, :, None], interleaved=True)
    kv = attn.kv_a_proj_with_mqa(x)
    c = attn.kv_a_layernorm(kv[..., :C])
    k_rope = apply_rope(kv[..., C:], cos, sin, interleaved=True)
    return q_nope, q_rope, cq, c, k_rope


def split_kv_b(attn: MLA, cfg: ModelConfig):
    """W_kvb [C, H*(N+V)] -> (W_UK [C, H, N], W_UV [C, H, V])."""
    w = attn.kv_b_proj.kernel[...].reshape(cfg.kv_lora_rank, cfg.num_attention_heads, -1)
    return w[..., :cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim:]


def mla_prefill_attention(q_nope, q_rope, c, k_rope, attend, w_uk, w_uv, tau):
    """Causal sparse attention of T queries over S keys, keys/values expanded per head.

    q_nope [B, T, H, N], q_rope [B, T, H, R], c [B, S, C], k_rope [B, S, R], attend bool[B, T, S]
    (True where query t may attend key s: causal and selected) -> o [B, T, H, V].
    """
    return mla_prefill_output(mla_prefill_probs(q_nope, q_rope, c, k_rope, attend, w_uk, tau), c, w_uv)


def mla_prefill_output(p, c, w_uv):
    """Attention output from its distribution p [B, H, T, S] over the latents c [B, S, C]: o [B, T, H, V]."""
    v = jnp.einsum("bsc,chv->bshv", c, w_uv)
    return jnp.einsum("bhts,bshv->bthv", p, v)


def mla_prefill_probs(q_nope, q_rope, c, k_rope, attend, w_uk, tau):
    """The attention distribution of `mla_prefill_attention`: p [B, H, T, S] (in q's dtype), zero outside `attend`.
    Training reads it (the indexer learns to match its sum over heads)."""
    k_nope = jnp.einsum("bsc,chn->bshn", c, w_uk)
    s = jnp.einsum("bthn,bshn->bhts", q_nope, k_nope) + jnp.einsum("bthr,bsr->bhts", q_rope, k_rope)
    s = s.astype(jnp.float32) * tau
    s = jnp.where(attend[:, None], s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1).astype(q_nope.dtype)
