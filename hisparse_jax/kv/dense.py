"""Contiguous, all-resident KV arrays: the simplest `KVBackend` and the reference the paged,
tiered store is compared against (bit for bit).

The carry `kv` (dict):
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


def index_select_reference(index_k, positions, q_index, w, topk: int, *, index_dtype=None):
    """Top-k over contiguous keys: index_k [B, S, dI], positions int32[B] -> int32[B, min(topk, S)].

    Keys 0..positions[b] are valid; -1 pads the tail; an idle slot (position -1) gets all -1.
    """
    S = index_k.shape[1]
    scores = index_scores(q_index[:, None], w[:, None], index_k, index_dtype=index_dtype)[:, 0]  # [B, S]
    valid = jnp.arange(S, dtype=jnp.int32)[None] <= positions[:, None]
    return select_topk(scores, valid, topk)


def init_dense_kv(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *, extra_layers: int = 0) -> dict:
    """Empty KV arrays (the carry `kv`) for `batch` sequences of up to `max_len` positions. `extra_layers`: layers
    (each with its own indexer) kept after the main ones — the MTP layers, `model.mtp[i]` being layer L + i and
    indexer layer L_I + i."""
    L, LI = cfg.num_hidden_layers + extra_layers, cfg.num_indexer_layers + extra_layers
    return {
        "latent": jnp.zeros((L, batch, max_len, cfg.kv_lora_rank), dtype),
        "rope": jnp.zeros((L, batch, max_len, cfg.qk_rope_head_dim), dtype),
        "index_k": jnp.zeros((LI, batch, max_len, cfg.index_head_dim), dtype),
    }


def _write(arr, index, positions, value):
    """Store one row per sequence: arr [N, B, S, X] (N layers or indexer slots), positions
    int32[B] (-1: drop), value [B, X].

    One scatter of B rows at [index, b, positions[b]] into the whole stacked array — never a slice of a layer
    modified and written back — so with the arrays donated (`generate` donates them) XLA updates them in place and a
    step moves B rows per layer, whatever the context."""
    _, B, S = arr.shape[:3]
    pos = jnp.where(positions < 0, S, positions)  # out of bounds -> dropped
    return arr.at[index, jnp.arange(B), pos].set(value.astype(arr.dtype), mode="drop")


def _rows(arr, index, topk):
    """arr [N, B, S, X], topk int32[B, K] (>= 0) -> rows [B, K, X] of `index`: one gather from the whole stacked
    array (the layer is not sliced out first)."""
    B = arr.shape[1]
    return arr[index, jnp.arange(B)[:, None], topk]


@dataclasses.dataclass(frozen=True)
class DenseKV:
    """`KVBackend` over `init_dense_kv`'s contiguous arrays (jnp references throughout). Every method reads and
    writes the stacked arrays directly (rows at [layer, b, pos]), so a jitted step with `kv` donated
    updates it in place."""

    topk: int
    index_dtype: str | None = None  # how the indexer scores its keys (`indexer_topk.reference.INDEX_DTYPES`)

    def append(self, kv, ids, positions, c, k_rope, k_index):
        kv = dict(kv)
        kv["latent"] = _write(kv["latent"], ids.layer, positions, c)
        kv["rope"] = _write(kv["rope"], ids.layer, positions, k_rope)
        if ids.owns_index:
            kv["index_k"] = _write(kv["index_k"], ids.index, positions, k_index)
        return kv

    def select(self, kv, ids, positions, q_index, w):
        keys = kv["index_k"][ids.index]
        return index_select_reference(keys, positions, q_index, w, self.topk, index_dtype=self.index_dtype), kv

    def attend(self, kv, ids, topk, q_lat, q_rope, tau):
        valid = topk >= 0
        safe = jnp.where(valid, topk, 0)
        rows_c = _rows(kv["latent"], ids.layer, safe)
        rows_r = _rows(kv["rope"], ids.layer, safe)
        return sparse_mla_decode_rows(q_lat, q_rope, rows_c, rows_r, valid, tau), kv
