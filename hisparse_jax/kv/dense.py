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
from hisparse_jax.model.decoder import index_select_reference
from hisparse_jax.model.mla import sparse_mla_decode_reference


def init_dense_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    L, LI = cfg.num_hidden_layers, cfg.num_indexer_layers
    return {
        "latent": jnp.zeros((L, batch, max_len, cfg.kv_lora_rank), dtype),
        "rope": jnp.zeros((L, batch, max_len, cfg.qk_rope_head_dim), dtype),
        "index_k": jnp.zeros((LI, batch, max_len, cfg.index_head_dim), dtype),
    }


def _write(pool, positions, value):
    """pool [B, S, X], positions int32[B] (-1: drop), value [B, X]."""
    B, S = pool.shape[:2]
    pos = jnp.where(positions < 0, S, positions)  # out of bounds -> dropped
    return pool.at[jnp.arange(B), pos].set(value.astype(pool.dtype), mode="drop")


@dataclasses.dataclass(frozen=True)
class DenseKV:
    """`KVBackend` over `init_dense_cache`'s contiguous cache (jnp references throughout)."""

    topk: int
    indexer_fp8: bool = False

    def append(self, cache, layer, slot, positions, c, k_rope, k_index):
        cache = dict(cache)
        cache["latent"] = cache["latent"].at[layer].set(_write(cache["latent"][layer], positions, c))
        cache["rope"] = cache["rope"].at[layer].set(_write(cache["rope"][layer], positions, k_rope))
        if slot is not None:
            cache["index_k"] = cache["index_k"].at[slot].set(_write(cache["index_k"][slot], positions, k_index))
        return cache

    def select(self, cache, slot, positions, q_index, w):
        keys = cache["index_k"][slot]
        return index_select_reference(keys, positions, q_index, w, self.topk, fp8=self.indexer_fp8), cache

    def attend(self, cache, layer, topk, q_lat, q_rope, tau):
        valid = topk >= 0
        safe = jnp.where(valid, topk, 0)
        rows_c = jnp.take_along_axis(cache["latent"][layer], safe[..., None], axis=1)
        rows_r = jnp.take_along_axis(cache["rope"][layer], safe[..., None], axis=1)
        return sparse_mla_decode_reference(q_lat, q_rope, rows_c, rows_r, valid, tau), cache
