"""The checkpoints' multi-token-prediction (MTP) layers: a draft model for speculative decoding.

DeepSeek-V3.2 and GLM-5 checkpoints carry `num_nextn_predict_layers` (1) MTP layers after the main layers, as
`model.layers.{L + i}.*` (L = num_hidden_layers). What one layer computes, checked against vLLM's
`vllm/model_executor/models/deepseek_mtp.py` (`DeepSeekMultiTokenPredictorLayer.forward`,
`DeepSeekMultiTokenPredictor.compute_logits`) and `deepseek_v2.py` (`DeepseekV2DecoderLayer`,
`DeepseekV2MLAAttention`), for the row at position t (the main model's hidden state h_t, the token t_{t+1}):

    e = Emb(t_{t+1}), zeroed where the position is 0      vLLM: `torch.where(positions == 0, 0, inputs_embeds)`
                                                          ("masking inputs at position 0, as not needed by MTP")
    x = eh_proj(concat([enorm(e), hnorm(h_t)], -1))       the embedding first, the hidden state second;
                                                          eh_proj: Linear 2D -> D, no bias
    y = block(x)                                          one full decoder layer (`mtp_block`), run at position t
                                                          (its KV row is the row of position t); y = residual +
                                                          the layer's output, i.e. the decoder layer's output
    logits = shared_head.head(shared_head.norm(y))        `compute_logits`: the layer's own head and norm

* `h_t` is the main model's final hidden state AFTER its final norm: vLLM's target hidden states
  (`DeepseekV2Model.forward` ends with `hidden_states, _ = self.norm(hidden_states, residual)`), which
  `SparseMLAModel.forward` returns as `aux["hidden"]` and `decode_step(..., return_hidden=True)` as its last
  value.
* Drafting k tokens applies the same layer recursively (vLLM: `spec_step_idx % num_mtp_layers`, one layer in
  these checkpoints): step j + 1 takes step j's output hidden state `y` (before `shared_head.norm`: vLLM's
  layer returns `residual + hidden_states` and only `compute_logits` applies the norm) and its draft token,
  one position further. (SGLang's `deepseek_nextn.py` differs on two points: it hands on `shared_head.norm(y)`
  and does not zero the position-0 embedding; we follow vLLM.)
* The block: `DeepseekV2DecoderLayer` built with the MTP layer's number L + i. Its MLP is an MoE whenever
  `layer_idx >= first_k_dense_replace` (always true past the main layers of these checkpoints), so here it is
  the sparse MoE when the main model has sparse layers (else the dense MLP). Its attention is MLA with its own
  lightning indexer: vLLM's `DeepseekV2MLAAttention` builds a full indexer for every layer with
  `layer_id >= num_hidden_layers` whatever GLM's IndexShare pattern says ("MTP/nextn layers always build a full
  indexer"). So the block is a `DecoderLayer` with `indexer_type="full"`; in a KV store it is layer
  `num_hidden_layers + i` and indexer layer `num_indexer_layers + i`, after the main layers.
* The embedding: vLLM loads the checkpoint's `model.layers.{L}.embed_tokens.weight` as the predictor's
  (shared: "MTP modules shares embedding layer", only the first MTP layer's copy is loaded); in the released
  checkpoints it is a copy of `model.embed_tokens.weight`. We use the main model's `embed_tokens` and the loader
  checks that the copy, when present, equals it. The head (`shared_head.head`) is the layer's own parameter.
* vLLM's loader (`_rewrite_spec_layer_name`) maps `model.layers.{L+i}.{enorm,hnorm,eh_proj,shared_head}.*` to the
  layer itself and every other tensor of `model.layers.{L+i}` to its `mtp_block`; ours maps
  `mtp.{i}.block.X` <-> `model.layers.{L+i}.X`, `mtp.{i}.shared_head` <-> `...shared_head.head`,
  `mtp.{i}.shared_head_norm` <-> `...shared_head.norm` (see `weights.hf_names`).

Entry points: `mtp_forward` (causal, over a whole sequence, as a prefill) and `mtp_decode_step` (one row per
sequence through a `KVBackend`), both on the per-layer bodies the main model uses (`block.prefill_layer`,
`block.decode_layer`).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from hisparse_jax.config import ModelConfig
from hisparse_jax.model.block import DecoderLayer, KVBackend, LayerIds, decode_layer, prefill_layer
from hisparse_jax.model.layers import Linear, RMSNorm


def mtp_mlp_type(cfg: ModelConfig) -> str:
    """The MTP block's MLP: an MoE ("sparse") like the main model's sparse layers, dense if the model has none."""
    return "sparse" if "sparse" in cfg.mlp_layer_types else "dense"


class MTPLayer(nnx.Module):
    """One MTP layer (the checkpoint's `model.layers.{num_hidden_layers + index}`)."""

    def __init__(self, cfg: ModelConfig, index: int, *, dtype, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.eh_proj = Linear(2 * D, D, dtype=dtype, rngs=rngs)
        self.block = DecoderLayer(cfg, cfg.num_hidden_layers + index, dtype=dtype, rngs=rngs, indexer_type="full",
                                  mlp_type=mtp_mlp_type(cfg))
        self.shared_head_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.shared_head = Linear(D, cfg.vocab_size, dtype=dtype, rngs=rngs)


def mtp_input(layer: MTPLayer, emb, hidden, positions):
    """The block's input: emb [..., D] (the next tokens' embeddings), hidden [..., D] (the previous hidden states),
    positions int[...] -> eh_proj(concat([enorm(emb masked at position 0), hnorm(hidden)])) [..., D]."""
    emb = jnp.where((positions == 0)[..., None], jnp.zeros((), emb.dtype), emb)
    hidden = hidden.astype(emb.dtype)
    return layer.eh_proj(jnp.concatenate([layer.enorm(emb), layer.hnorm(hidden)], axis=-1))


def mtp_logits(layer: MTPLayer, y):
    """The layer's output hidden states y [..., D] -> logits f32[..., V] (shared_head.norm, shared_head.head)."""
    return layer.shared_head(layer.shared_head_norm(y)).astype(jnp.float32)


def _layer(model, depth: int) -> MTPLayer:
    mtp = getattr(model, "mtp", None)
    if mtp is None or len(mtp) == 0:
        raise ValueError("this model has no MTP layers: build it with SparseMLAModel(..., mtp=True) or "
                         "load_pretrained(..., mtp=True) from a config with num_nextn_predict_layers >= 1")
    if not 0 <= depth < len(mtp):
        raise ValueError(f"depth {depth} out of range: the model has {len(mtp)} MTP layer(s)")
    return mtp[depth]


def mtp_forward(model, hidden, next_ids, *, depth: int = 0):
    """The MTP layer `model.mtp[depth]` over whole sequences, causally, as a prefill.

    hidden [B, T, D]: the main forward's `aux["hidden"]` (final hidden states after the final norm) at positions
    0..T-1; next_ids int32[B, T]: for row t the token at position t + 1. Returns (logits f32[B, T, V], aux):
    aux = {"latent": [B, T, C], "rope": [B, T, R], "index_k": [B, T, dI], "topk": int32[B, T, K] (the block's own
    indexer, as the main forward's full-indexer layers), "hidden": [B, T, D] (the block's output, before
    shared_head.norm: the next draft step's previous hidden state)}.
    """
    layer = _layer(model, depth)
    B, T = next_ids.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cos, sin = model.rope(pos)
    causal = jnp.tril(jnp.ones((T, T), bool))[None]
    x = mtp_input(layer, model.embed(next_ids), hidden, pos)
    y, rows, _ = prefill_layer(model, layer.block, x, cos, sin, causal, None)
    return mtp_logits(layer, y), {**rows, "hidden": y}


def mtp_decode_step(model, tokens, positions, hidden, kv, backend: KVBackend, *, depth: int = 0):
    """One row per sequence through the MTP layer `model.mtp[depth]`, its KV through `backend`.

    tokens int32[B]: the next tokens (the token at positions[b] + 1); positions int32[B] (-1: an idle slot);
    hidden [B, D]: the previous hidden state (the main model's final hidden state after its final norm at
    positions[b], or for a recursive draft the previous MTP step's `hidden_out`). The block's rows are layer
    `num_hidden_layers + depth`, indexer layer `num_indexer_layers + depth` of the backend's store.
    Returns (logits f32[B, V], hidden_out [B, D] (before shared_head.norm), kv).
    """
    cfg = model.cfg
    layer = _layer(model, depth)
    cos, sin = model.rope(jnp.maximum(positions, 0)[:, None])
    x = mtp_input(layer, model.embed(tokens[:, None]), hidden[:, None], positions[:, None])
    ids = LayerIds(layer=cfg.num_hidden_layers + depth, index=cfg.num_indexer_layers + depth, owns_index=True,
                   group_size=1)
    y, kv, _ = decode_layer(model, layer.block, ids, x, cos, sin, positions, kv, backend, None)
    return mtp_logits(layer, y)[:, 0], y[:, 0], kv
