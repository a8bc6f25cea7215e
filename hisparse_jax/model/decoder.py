"""The DSA decoder: embeddings, layers (MLA + indexer, dense MLP or MoE), final norm, LM head.

Two entry points:

* `SparseMLAModel.__call__(input_ids [B, T]) -> logits [B, T, V]` — the full causal forward in which
  every layer attends only to its indexer's top-k (shared-index layers reuse their leader's), as
  transformers does. `forward(...)` also returns what a cache needs (per-layer latent rows, indexer
  keys) and the per-layer top-k.
* `decode_step(model, tokens [B], positions [B], cache, backend)` — one new token per sequence in
  the absorbed MLA form. Where the rows come from is the *backend's* business (see `KVBackend`):
  a contiguous cache here, the tiered paged store and the Pallas kernels elsewhere, without touching
  the model.

The per-layer bodies (`prefill_layer`, `decode_layer`) are shared with the multi-token-prediction layers
(`hisparse_jax.model.mtp`, built with `SparseMLAModel(..., mtp=True)`), whose block is one more decoder layer.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from hisparse_jax.config import ModelConfig
from hisparse_jax.model.indexer import index_scores, indexer_project, select_topk
from hisparse_jax.model.layers import MLP, Linear, RMSNorm, _normal
from hisparse_jax.model.mla import MLA, mla_prefill_output, mla_prefill_probs, mla_project, split_kv_b
from hisparse_jax.model.moe import MoE
from hisparse_jax.model.rope import rope_cos_sin, rope_frequencies

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class DecoderLayer(nnx.Module):
    """One decoder layer: MLA (+ its indexer when "full") and a dense MLP or an MoE. `indexer_type` ("full" |
    "shared") and `mlp_type` ("dense" | "sparse") override `cfg.indexer_types[layer]` / `cfg.mlp_layer_types[layer]`
    (for an MTP layer, whose number is past the main layers)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs, indexer_type: str | None = None,
                 mlp_type: str | None = None):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = MLA(cfg, layer, dtype=dtype, rngs=rngs, indexer_type=indexer_type)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        mlp_type = cfg.mlp_layer_types[layer] if mlp_type is None else mlp_type
        if mlp_type not in ("dense", "sparse"):
            raise ValueError(f"mlp_type must be 'dense' or 'sparse', got {mlp_type!r}")
        if mlp_type == "sparse":
            self.mlp = MoE(cfg, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)


class SparseMLAModel(nnx.Module):
    """A DeepSeek-V3.2 / GLM-5 style decoder. Parameters mirror the Hugging Face names
    (`model.layers.{i}.self_attn.q_a_proj.weight` -> `layers[i].self_attn.q_a_proj.kernel`, transposed).

    Options (static, not parameters): `moe_impl` ("ragged" | "dense"), `indexer_fp8` (emulate DeepSeek's
    FP8 + Hadamard indexer instead of the exact float32 scores transformers computes). `mtp=True` also builds the
    config's `num_nextn_predict_layers` multi-token-prediction layers as `self.mtp` (`hisparse_jax.model.mtp`;
    an empty `nnx.List` otherwise).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None, dtype=None, moe_impl: str = "ragged",
                 indexer_fp8: bool = False, mtp: bool = False):
        if mtp and cfg.num_nextn_predict_layers < 1:
            raise ValueError("mtp=True needs a config with num_nextn_predict_layers >= 1 (the checkpoint's "
                             "multi-token-prediction layers); this one has 0")
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        dtype = jnp.dtype(dtype or DTYPES[cfg.dtype])
        self.cfg = cfg
        self.dtype = dtype
        self.moe_impl = moe_impl
        self.indexer_fp8 = indexer_fp8
        self.embed_tokens = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype,
                                                                    rngs=rngs)
        from hisparse_jax.model.mtp import MTPLayer  # mtp.py builds on DecoderLayer, defined above

        # the multi-token-prediction layers (`hisparse_jax.model.mtp`), empty unless asked for
        self.mtp = nnx.List([MTPLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_nextn_predict_layers)]
                            if mtp else [])

    # ----- pieces shared by prefill and decode ---------------------------------------------------
    def rope(self, positions):
        """positions int[...] -> (cos, sin) f32[..., R/2]."""
        return rope_cos_sin(positions, *rope_frequencies(self.cfg.rope, self.cfg.qk_rope_head_dim))

    def embed(self, ids):
        return jnp.take(self.embed_tokens[...], ids, axis=0)

    def logits(self, h):
        """Un-normed final hidden states -> logits (final norm, then the LM head)."""
        return self.head(self.norm(h))

    def head(self, h):
        """The LM head alone, on hidden states already through the final norm."""
        if self.lm_head is None:
            return jnp.einsum("...d,vd->...v", h, self.embed_tokens[...])
        return self.lm_head(h)

    def mlp(self, layer: DecoderLayer, h):
        if isinstance(layer.mlp, MoE):
            return layer.mlp(h, impl=self.moe_impl)
        return layer.mlp(h)

    # ----- full causal forward -------------------------------------------------------------------
    def __call__(self, input_ids):
        return self.forward(input_ids)[0]

    def forward(self, input_ids, *, topk_override=None):
        """input_ids int32[B, T] (positions 0..T-1) -> (logits [B, T, V], aux).

        aux = {"latent": [L x [B, T, C]], "rope": [L x [B, T, R]], "index_k": [L_I x [B, T, dI]],
               "topk": [L_I x int32[B, T, K]], "hidden": [B, T, D]}; top-k rows are -1 padded (K = min(index_topk, T));
        "hidden" is the final hidden state after the final norm (what the MTP layers read).
        topk_override: optional list (one per full indexer) of int32[B, T, K] index sets to use instead of
        the indexer's — to test the attention math separately from the selection.
        """
        B, T = input_ids.shape
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        cos, sin = self.rope(pos)
        causal = jnp.tril(jnp.ones((T, T), bool))[None]
        x = self.embed(input_ids)
        aux = {"latent": [], "rope": [], "index_k": [], "topk": []}
        attend = None
        for layer in self.layers:
            override = None
            if topk_override is not None and layer.self_attn.indexer is not None:
                override = topk_override[len(aux["topk"])]
            x, rows, attend = prefill_layer(self, layer, x, cos, sin, causal, attend, topk_override=override)
            for k, v in rows.items():
                if v is not None:
                    aux[k].append(v)
        aux["hidden"] = self.norm(x)
        return self.head(aux["hidden"]), aux


INDEXER_MODES = ("select", "score", "off")


def prefill_layer(model: SparseMLAModel, layer: DecoderLayer, x, cos, sin, causal, attend, *, topk_override=None,
                  indexer: str = "select", with_probs: bool = False):
    """One decoder layer of the causal forward (the main layers', the MTP block's and training's).

    x [B, T, D]; cos/sin of positions 0..T-1; causal bool[1, T, T]; attend bool[B, T, T]: the mask a shared-index
    layer reuses (its leader's; ignored by a layer with its own indexer, which selects its top-k — or takes
    `topk_override` int32[B, T, K]). Returns (x, rows, attend): rows = {"latent": c [B, T, C], "rope": kR [B, T, R],
    "index_k": kI [B, T, dI] or None, "topk": int32[B, T, K] or None} (None for a shared-index layer).

    `indexer` (what a layer with its own indexer does; training's stages): "select" attends over its top-k (the
    model), "score" computes its scores but attends densely (the indexer warm-up), "off" neither runs it nor
    selects (dense language modelling). `with_probs` adds rows["probs"], the attention distribution
    [B, H, T, S], and rows["scores"], the indexer's [B, T, S] (None where not computed). The indexer's inputs are
    detached, as DeepSeek trains it: its own loss does not reach the main model (its top-k is integer, so the LM
    loss never reaches the indexer); values are unchanged.
    """
    if indexer not in INDEXER_MODES:
        raise ValueError(f"indexer must be one of {', '.join(INDEXER_MODES)}, got {indexer!r}")
    cfg = model.cfg
    B, T, _ = x.shape
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    q_nope, q_rope, cq, c, k_rope = mla_project(attn, cfg, h, cos, sin)
    rows = {"latent": c, "rope": k_rope, "index_k": None, "topk": None}
    scores = None
    if attn.indexer is not None:
        attend = causal
        if indexer != "off":
            qI, kI, w = indexer_project(attn.indexer, cfg, jax.lax.stop_gradient(h), jax.lax.stop_gradient(cq),
                                        cos, sin)
            rows["index_k"] = kI
            if topk_override is None or with_probs:
                scores = index_scores(qI, w, kI, fp8=model.indexer_fp8)
        if indexer == "select":
            if topk_override is not None:
                topk = topk_override
            else:
                topk = select_topk(scores, jnp.broadcast_to(causal, scores.shape), cfg.index_topk)
            rows["topk"] = topk
            attend = topk_to_mask(topk, T) & causal
    w_uk, w_uv = split_kv_b(attn, cfg)
    p = mla_prefill_probs(q_nope, q_rope, c, k_rope, attend, w_uk, cfg.softmax_scale)
    o = mla_prefill_output(p, c, w_uv)
    if with_probs:
        rows.update(probs=p, scores=scores)
    x = x + attn.o_proj(o.reshape(B, T, -1))
    x = x + model.mlp(layer, layer.post_attention_layernorm(x))
    return x, rows, attend


def topk_to_mask(topk, S: int):
    """int32[..., K] positions (-1 = none) -> bool[..., S]. A scatter, O(K + S) per row (comparing every slot
    with every position would build [..., K, S], 0.5 G elements per sequence at T = 2048, K = 128)."""
    rows = topk.reshape(-1, topk.shape[-1])
    cols = jnp.where(rows >= 0, rows, S)  # -1 -> out of range, dropped
    mask = jnp.zeros((rows.shape[0], S), bool).at[jnp.arange(rows.shape[0])[:, None], cols].set(True, mode="drop")
    return mask.reshape(*topk.shape[:-1], S)


class KVBackend(Protocol):
    """Where decode reads and writes KV rows. Methods are pure: they take and return the cache pytree.

    positions int32[B]: the position of the token being decoded (-1 for an idle batch slot, whose
    writes must be dropped and whose top-k is all -1). Layer numbers and indexer-layer numbers are static.
    """

    def append(self, cache: Any, layer: int, index_layer: int | None, positions, c, k_rope, k_index) -> Any:
        """Store this token's rows of `layer`: c [B, C], k_rope [B, R]; k_index [B, dI] when the layer has a full
        indexer, `index_layer` being its number among the full-indexer layers (else None)."""

    def select(self, cache: Any, index_layer: int, positions, q_index, w) -> tuple[jnp.ndarray, Any]:
        """Indexer top-k over keys 0..positions[b]: q_index f32[B, I, dI], w f32[B, I] -> (int32[B, K], cache)."""

    def attend(self, cache: Any, layer: int, topk, q_lat, q_rope, tau: float) -> tuple[jnp.ndarray, Any]:
        """Absorbed sparse MLA over the rows at `topk` (int32[B, K], -1 padded): q_lat [B, H, C],
        q_rope [B, H, R] -> (o_lat f32[B, H, C], cache)."""


def decode_step(model: SparseMLAModel, tokens, positions, cache, backend: KVBackend, *, return_hidden: bool = False):
    """One decode step: tokens int32[B] at positions int32[B] -> (logits f32[B, V], cache, topk per indexer), or
    with `return_hidden` (logits, cache, topk per indexer, hidden [B, D]): the final hidden state after the final
    norm, what `model.mtp` reads."""
    pos = jnp.maximum(positions, 0)[:, None]  # [B, 1]
    cos, sin = model.rope(pos)
    x = model.embed(tokens[:, None])  # [B, 1, D]
    topk, index_layer, all_topk = None, -1, []
    for i, layer in enumerate(model.layers):
        full = layer.self_attn.indexer is not None
        index_layer += full
        x, cache, own = decode_layer(model, layer, i, index_layer if full else None, x, cos, sin, positions, cache,
                                     backend, topk)
        if own is not None:
            topk = own
            all_topk.append(own)
    h = model.norm(x)
    logits = model.head(h)[:, 0].astype(jnp.float32)
    if return_hidden:
        return logits, cache, all_topk, h[:, 0]
    return logits, cache, all_topk


def decode_layer(model: SparseMLAModel, layer: DecoderLayer, layer_no: int, index_layer: int | None, x, cos, sin,
                 positions, cache, backend: KVBackend, topk):
    """One decoder layer of a decode step (the main layers' and the MTP block's), rows through `backend`.

    x [B, 1, D]; `layer_no` / `index_layer` are the layer's numbers in the store (`index_layer` None for a
    shared-index layer, which attends over `topk` int32[B, K], its leader's). Returns (x, cache, the layer's own
    top-k, or None for a shared-index layer).
    """
    cfg = model.cfg
    B = x.shape[0]
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    q_nope, q_rope, cq, c, k_rope = mla_project(attn, cfg, h, cos, sin)
    own = None
    if attn.indexer is not None:
        qI, kI, w = indexer_project(attn.indexer, cfg, h, cq, cos, sin)
        cache = backend.append(cache, layer_no, index_layer, positions, c[:, 0], k_rope[:, 0], kI[:, 0])
        own, cache = backend.select(cache, index_layer, positions, qI[:, 0], w[:, 0])
        topk = own
    else:
        cache = backend.append(cache, layer_no, None, positions, c[:, 0], k_rope[:, 0], None)
    w_uk, w_uv = split_kv_b(attn, cfg)
    q_lat = jnp.einsum("bhn,chn->bhc", q_nope[:, 0], w_uk)
    o_lat, cache = backend.attend(cache, layer_no, topk, q_lat, q_rope[:, 0], cfg.softmax_scale)
    o = jnp.einsum("bhc,chv->bhv", o_lat.astype(w_uv.dtype), w_uv)
    x = x + attn.o_proj(o.reshape(B, 1, -1).astype(x.dtype))
    x = x + model.mlp(layer, layer.post_attention_layernorm(x))
    return x, cache, own
