"""The spec of the paged indexer top-k: plain jnp, HIGHEST precision, same signature as the kernel.

Shapes: B decode rows, I indexer heads, dI head dim, P pool pages of `page` (64) token rows, MP pages
per row in the block table, S = MP * page key positions, K top-k slots.
"""

from __future__ import annotations

import jax.numpy as jnp

from hisparse_jax.model.indexer import index_scores, index_scores_fp8, select_topk


def paged_index_scores(q, w, k_pages, block_table, *, k_scale=None):
    """Indexer scores of every block-table position (unmasked) -> f32[B, S].

    q f32/bf16[B, I, dI], w f32[B, I], k_pages [P, page, dI], block_table int32[B, MP] (-1 unused: read as
    page 0, the caller masks those positions), k_scale f32[P, page] for float8_e4m3fn keys (FP8 emulation:
    the query is Hadamard-rotated and quantized exactly as `index_scores_fp8` does).
    """
    B, MP = block_table.shape
    pages = jnp.maximum(block_table, 0)  # [B, MP]
    keys = k_pages[pages].reshape(B, MP * k_pages.shape[1], k_pages.shape[2])  # [B, S, dI]
    q = q.astype(jnp.float32)[:, None]  # [B, T=1, I, dI]
    w = w.astype(jnp.float32)[:, None]  # [B, T=1, I]
    if k_scale is None:
        return index_scores(q, w, keys)[:, 0]
    ks = k_scale[pages].reshape(B, -1)  # [B, S]
    return index_scores_fp8(q, w, keys, ks)[:, 0]


def indexer_topk_reference(q, w, k_pages, block_table, seq_lens, *, topk: int, k_scale=None, interpret=False):
    """Top-`topk` key positions of the lightning indexer over a paged key pool -> int32[B, topk].

    score(s) = sum_h w[b, h] * relu(q[b, h] . k[s]) over positions s < seq_lens[b] (s indexes the row's
    block table: page block_table[b, s // page], row s % page). Slots are ordered by descending score,
    the lower position wins a tie (`select_topk`'s rule); -1 pads the end when seq_len < topk; a row with
    seq_len 0 is all -1. `interpret` is accepted for signature parity with the kernel and ignored.
    """
    del interpret
    B, MP = block_table.shape
    S = MP * k_pages.shape[1]
    scores = paged_index_scores(q, w, k_pages, block_table, k_scale=k_scale)  # [B, S]
    valid = jnp.arange(S, dtype=jnp.int32)[None] < seq_lens.astype(jnp.int32)[:, None]  # [B, S]
    idx = select_topk(scores, valid, topk)  # [B, min(topk, S)]
    return jnp.pad(idx, ((0, 0), (0, topk - idx.shape[1])), constant_values=-1)
