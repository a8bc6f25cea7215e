"""Codebooks for the host key tier's "rvq" summary (`CacheConfig(index_tier="host", index_summary="rvq")`), fitted
to a model's indexer keys on calibration text:

    books = fit_index_codebooks(model, calibration_ids)      # int[n, T] token ids, e.g. 32 windows of 2048
    engine = Engine(model, CacheConfig(index_tier="host", index_summary="rvq"), index_codebooks=books)

Any codebooks give exact top-k (each key's radius is measured from its own reconstruction); codebooks fitted to the
model's keys make the bounds tight enough to skip pages (`experiments/index_tier.py` measures how many)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from hisparse_jax.formats import rvq_stages
from hisparse_jax.kv.summary import IndexCodebooks, rope_tables
from hisparse_jax.model.decoder import SparseMLAModel
from hisparse_jax.model.rope import rope_frequencies
from pallas_kernels.indexer_topk.reference import rope_unrotate, rvq_fit


def fit_index_codebooks(model: SparseMLAModel, calibration_ids, *, iters: int = 10, seed: int = 0) -> IndexCodebooks:
    """Per full indexer layer, `reference.rvq_fit` (rvq_stages(index_head_dim) stages of 256 centroids, `iters` Lloyd
    iterations each, k-means++ seeded by `seed`) of the layer's keys over `calibration_ids` int[n, T] (one causal
    forward), each key turned back by its RoPE (`rope_tables`). Keys of shorter calibration text code as well at
    any position: the codes are of the un-rotated key, which does not depend on where the token sits."""
    cfg = model.cfg
    try:
        ids = np.asarray(calibration_ids)
    except ValueError:
        raise ValueError("calibration_ids must be a non-empty int array [n, T], got rows of different lengths") \
            from None
    if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"calibration_ids must be a non-empty int array [n, T], got {ids.dtype}{list(ids.shape)}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"calibration_ids must be token ids in [0, {cfg.vocab_size}), got [{ids.min()}, {ids.max()}]")
    m = rvq_stages(cfg.index_head_dim)
    if m < 1 or cfg.qk_rope_head_dim > cfg.index_head_dim:
        raise ValueError(f"rvq codebooks need index_head_dim >= 32 holding the rope dimensions (got "
                         f"{cfg.index_head_dim}, rope {cfg.qk_rope_head_dim})")
    freq, _ = rope_frequencies(cfg.rope, cfg.qk_rope_head_dim)
    keys = model.forward(jnp.asarray(ids, jnp.int32))[1]["index_k"]  # [LI, n, T, dI]
    return fit_codebooks(keys, freq, m, iters=iters, seed=seed)


def fit_codebooks(keys, rope_freq, stages: int, *, iters: int = 10, seed: int = 0) -> IndexCodebooks:
    """`fit_index_codebooks` from the keys themselves: keys [LI, n, T, dI] as the model writes them (rotated by RoPE
    at positions 0..T-1 over their first 2 x len(rope_freq) dimensions, frequencies rope_freq f32[R/2])."""
    keys = jnp.asarray(keys, jnp.float32)
    freq = np.asarray(rope_freq, np.float32)
    cos, sin = rope_tables(jnp.asarray(freq), jnp.arange(keys.shape[2], dtype=jnp.int32))
    books = [rvq_fit(rope_unrotate(k, cos, sin).reshape(-1, keys.shape[-1]), stages, iters=iters, seed=seed)
             for k in keys]
    return IndexCodebooks(books=np.asarray(jnp.stack(books)), rope_freq=freq)
