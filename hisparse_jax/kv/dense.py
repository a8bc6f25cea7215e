"""A contiguous, all-resident KV cache: the simplest `KVBackend` and the reference the paged,
tiered store is compared against (bit for bit).

Cache pytree (dict):
    latent   [L, B, S, C]    the MLA latent c of every layer and cached position
    rope     [L, B, S, R]    the rope key kR
    index_k  [L_I, B, S, dI] the indexer keys of every full-indexer layer
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from hisparse_jax.config import ModelConfig
from pallas_kernels.indexer_topk.reference import index_scores, select_topk
from pallas_kernels.sparse_mla_decode.reference import sparse_mla_decode_rows


def index_select_reference(index_k, positions, q_index, w, topk: int, *, fp8: bool = False):
    """Top-k over a contiguous key cache: index_k [B, S, dI], positions int32[B] -> int32[B, min(topk, S)].

    Keys 0..positions[b] are valid; -1 pads the tail; an idle slot (position -1) gets all -1.
    """
    S = index_k.shape[1]
    scores = index_scores(q_index[:, None], w[:, None], index_k, fp8=fp8)[:, 0]  # [B, S]
    valid = jnp.arange(S, dtype=jnp.int32)[None] <= positions[:, None]
    return select_topk(scores, valid, topk)


def init_dense_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *, extra_layers: int = 0) -> dict:
    """An empty cache for `batch` sequences of up to `max_len` positions. `extra_layers`: layers (each with its own
    indexer) kept after the main ones — the MTP layers, `model.mtp[i]` being layer L + i and indexer layer
    L_I + i."""
    L, LI = cfg.num_hidden_layers + extra_layers, cfg.num_indexer_layers + extra_layers
    return {
        "latent": jnp.zeros((L, batch, max_len, cfg.kv_lora_rank), dtype),
        "rope": jnp.zeros((L, batch, max_len, cfg.qk_rope_head_dim), dtype),
        "index_k": jnp.zeros((LI, batch, max_len, cfg.index_head_dim), dtype),
    }


def _write(cache, index, positions, value):
    """Store one row per sequence: cache [N, B, S, X] (N layers or indexer slots), positions
    int32[B] (-1: drop), value [B, X].

    One scatter of B rows at [index, b, positions[b]] into the whole stacked cache — never a slice of a layer
    modified and written back — so with the cache donated (`generate` donates it) XLA updates it in place and a
    step moves B rows per layer, whatever the context."""
    _, B, S = cache.shape[:3]
    pos = jnp.where(positions < 0, S, positions)  # out of bounds -> dropped
    return cache.at[index, jnp.arange(B), pos].set(value.astype(cache.dtype), mode="drop")


def _rows(cache, index, topk):
    """cache [N, B, S, X], topk int32[B, K] (>= 0) -> rows [B, K, X] of `index`: one gather from the whole stacked
    cache (the layer is not sliced out first)."""
    B = cache.shape[1]
    return cache[index, jnp.arange(B)[:, None], topk]


@dataclasses.dataclass(frozen=True)
class DenseKV:
    """`KVBackend` over `init_dense_cache`'s contiguous cache (jnp references throughout). Every method reads and
    writes the stacked cache arrays directly (rows at [layer, b, pos]), so a jitted step with the cache donated
    updates it in place."""

    topk: int
    indexer_fp8: bool = False

    def append(self, cache, ids, positions, c, k_rope, k_index):
        cache = dict(cache)
        cache["latent"] = _write(cache["latent"], ids.layer, positions, c)
        cache["rope"] = _write(cache["rope"], ids.layer, positions, k_rope)
        if ids.owns_index:
            cache["index_k"] = _write(cache["index_k"], ids.index, positions, k_index)
        return cache

    def select(self, cache, ids, positions, q_index, w):
        keys = cache["index_k"][ids.index]
        return index_select_reference(keys, positions, q_index, w, self.topk, fp8=self.indexer_fp8), cache

    def attend(self, cache, ids, topk, q_lat, q_rope, tau):
        valid = topk >= 0
        safe = jnp.where(valid, topk, 0)
        rows_c = _rows(cache["latent"], ids.layer, safe)
        rows_r = _rows(cache["rope"], ids.layer, safe)
        return sparse_mla_decode_rows(q_lat, q_rope, rows_c, rows_r, valid, tau), cache
