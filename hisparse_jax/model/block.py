"""One decoder layer: its parameters (`DecoderLayer`), its bodies for the causal forward (`prefill_layer`) and for a
decode step (`decode_layer`), and the seam through which a decode step reads and writes KV rows (`KVBackend`).

The main model (`hisparse_jax.model.decoder`) scans these bodies over stacked layers; the multi-token-prediction
layers (`hisparse_jax.model.mtp`) and training (`hisparse_jax.train.dsa`) run the same bodies. Inside the scan a
layer's numbers are traced (`LayerIds`): a backend indexes its stacked pools with them and never branches on
their values; what it must know statically (whether the layer runs its own indexer, how many layers share that
indexer's top-k) is static in `LayerIds`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from hisparse_jax.config import ModelConfig
from hisparse_jax.model.indexer import indexer_project
from pallas_kernels.indexer_topk.reference import index_scores, select_topk
from hisparse_jax.model.layers import MLP, RMSNorm
from hisparse_jax.model.mla import MLA, mla_prefill_output, mla_prefill_probs, mla_project, split_kv_b
from hisparse_jax.model.moe import MoE


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


def layer_mlp(model, layer: DecoderLayer, h):
    """The layer's MLP or MoE on h [..., D] (the MoE with the model's `moe_impl`)."""
    if isinstance(layer.mlp, MoE):
        return layer.mlp(h, impl=model.moe_impl)
    return layer.mlp(h)


class LayerIds(NamedTuple):
    """Where a layer's rows live in the KV arrays. `layer` and `index` are ints, or int32 scalars traced inside the scan
    over a run of layers; `owns_index` and `group_size` are static.

    layer:      the layer's number (its slot in the stacked KV pools)
    index:      the number, among the full-indexer layers, of the indexer whose top-k the layer attends over: its
                own (a "full" layer) or its leader's (a "shared" layer); also its indexer group's number
    owns_index: the layer runs that indexer (it leads its group), so it appends indexer keys and selects
    group_size: the layers that attend over that top-k: the leader and the shared layers right after it
    """

    layer: Any
    index: Any
    owns_index: bool
    group_size: int


INDEXER_MODES = ("select", "score", "off")


def prefill_layer(model, layer: DecoderLayer, x, cos, sin, causal, attend, *, topk_override=None,
                  indexer: str = "select", with_probs: bool = False):
    """One decoder layer of the causal forward (the main layers', the MTP block's and training's).

    `model` is the `SparseMLAModel` the layer belongs to (its config, MoE implementation and indexer precision).
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
                scores = index_scores(qI, w, kI, index_dtype=model.index_dtype)
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
    x = x + layer_mlp(model, layer, layer.post_attention_layernorm(x))
    return x, rows, attend


def topk_to_mask(topk, S: int):
    """int32[..., K] positions (-1 = none) -> bool[..., S]. A scatter, O(K + S) per row (comparing every slot
    with every position would build [..., K, S], 0.5 G elements per sequence at T = 2048, K = 128)."""
    rows = topk.reshape(-1, topk.shape[-1])
    cols = jnp.where(rows >= 0, rows, S)  # -1 -> out of range, dropped
    mask = jnp.zeros((rows.shape[0], S), bool).at[jnp.arange(rows.shape[0])[:, None], cols].set(True, mode="drop")
    return mask.reshape(*topk.shape[:-1], S)


class KVBackend(Protocol):
    """Where decode reads and writes KV rows. Methods are pure: they take and return the pytree `kv`, whose
    structure they keep (it is the carry of the scan over layers: `kv.dense.init_dense_kv` or `TieredKV.init_kv`
    builds it whole).

    positions int32[B]: the position of the token being decoded (-1 for an idle batch slot, whose
    writes must be dropped and whose top-k is all -1). `ids` says which layer (`LayerIds`; its numbers may be
    traced).
    """

    def append(self, kv: Any, ids: LayerIds, positions, c, k_rope, k_index) -> Any:
        """Store this token's rows of layer `ids.layer`: c [B, C], k_rope [B, R]; k_index [B, dI] (indexer keys of
        indexer `ids.index`) when `ids.owns_index`, else None."""

    def select(self, kv: Any, ids: LayerIds, positions, q_index, w) -> tuple[jnp.ndarray, Any]:
        """Indexer `ids.index`'s top-k over keys 0..positions[b]: q_index f32[B, I, dI], w f32[B, I] ->
        (int32[B, K], kv)."""

    def attend(self, kv: Any, ids: LayerIds, topk, q_lat, q_rope, tau: float) -> tuple[jnp.ndarray, Any]:
        """Absorbed sparse MLA of layer `ids.layer` over the rows at `topk` (int32[B, K], -1 padded): q_lat [B, H, C],
        q_rope [B, H, R] -> (o_lat f32[B, H, C], kv)."""


def decode_layer(model, layer: DecoderLayer, ids: LayerIds, x, cos, sin, positions, kv, backend: KVBackend, topk):
    """One decoder layer of a decode step (the main layers' and the MTP block's), rows through `backend`.

    x [B, 1, D]; `ids` the layer's numbers in `kv`; `topk` int32[B, K]: the leader's top-k, which a shared-index
    layer attends over (ignored by a layer that owns its indexer). Returns (x, kv, topk: the layer's own top-k,
    or `topk` unchanged for a shared-index layer).
    """
    cfg = model.cfg
    B = x.shape[0]
    attn = layer.self_attn
    if (attn.indexer is not None) != ids.owns_index:
        raise ValueError(f"layer ids {ids} do not match the layer (it has {'an' if attn.indexer else 'no'} indexer)")
    h = layer.input_layernorm(x)
    q_nope, q_rope, cq, c, k_rope = mla_project(attn, cfg, h, cos, sin)
    if ids.owns_index:
        qI, kI, w = indexer_project(attn.indexer, cfg, h, cq, cos, sin)
        kv = backend.append(kv, ids, positions, c[:, 0], k_rope[:, 0], kI[:, 0])
        topk, kv = backend.select(kv, ids, positions, qI[:, 0], w[:, 0])
    else:
        kv = backend.append(kv, ids, positions, c[:, 0], k_rope[:, 0], None)
    w_uk, w_uv = split_kv_b(attn, cfg)
    q_lat = jnp.einsum("bhn,chn->bhc", q_nope[:, 0], w_uk)
    o_lat, kv = backend.attend(kv, ids, topk, q_lat, q_rope[:, 0], cfg.softmax_scale)
    o = jnp.einsum("bhc,chv->bhv", o_lat.astype(w_uv.dtype), w_uv)
    x = x + attn.o_proj(o.reshape(B, 1, -1).astype(x.dtype))
    x = x + layer_mlp(model, layer, layer.post_attention_layernorm(x))
    return x, kv, topk
