"""Decode (absorbed MLA over the gathered top-k rows) == the full forward at the same position."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import RopeConfig
from hisparse_jax.engine.runner import TRACE_COUNTS
from hisparse_jax.generate import _kv_from_prefill, generate
from hisparse_jax.kv.dense import DenseKV
from hisparse_jax.model.decoder import decode_step
from pallas_kernels.sparse_mla_decode.reference import sparse_mla_decode_rows as sparse_mla_decode_reference
from tiny import model_cfg


# tiny.py's base at 5 layers (an irregular full / shared indexer pattern) and top-8
FIVE = dict(num_hidden_layers=5, mlp_layer_types=("dense", "sparse", "dense", "sparse", "sparse"),
            max_position_embeddings=512, index_topk=8, indexer_types=("full", "shared", "shared", "full", "shared"))


CONFIGS = {
    # dense MLP and MoE layers, full and shared indexers, interleaved indexer RoPE
    "glm-mixed": model_cfg(FIVE),
    # every layer its own indexer, half-split indexer RoPE, YaRN, group-limited routing
    "deepseek-yarn": model_cfg(FIVE, model_type="deepseek_v32", indexer_types=("full",) * 5,
                               indexer_rope_interleaved=False, n_group=3, topk_group=2,
                               rope=RopeConfig(theta=10000.0, rope_type="yarn", factor=8.0,
                                               original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0)),
}


@nnx.jit
def forward(model, ids):
    return model.forward(ids)


@nnx.jit(static_argnums=(4,))
def decode(model, tokens, positions, kv, backend):
    return decode_step(model, tokens, positions, kv, backend)


def prefill_then_decode(model, ids, positions):
    """Prefill ids[:, :p] for each row's p = positions[b], then decode token ids[b, p] at position p."""
    B, T = ids.shape
    _, aux = forward(model, ids)
    kv = _kv_from_prefill(model.cfg, aux, B, 64, T, jnp.float32)
    # rows at and beyond each row's position are stale prefill content: poison them
    S = kv["latent"].shape[2]
    stale = jnp.arange(S)[None, :] >= positions[:, None]  # [B, S]
    kv = {k: jnp.where(stale[None, :, :, None], jnp.nan, v) for k, v in kv.items()}
    tokens = ids[jnp.arange(B), positions]
    return decode(model, tokens, positions, kv, DenseKV(topk=model.cfg.index_topk))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_equals_prefill_every_layer_type(name):
    cfg = CONFIGS[name]
    model = hj.SparseMLAModel(cfg, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(1), (3, 30), 0, cfg.vocab_size, dtype=jnp.int32)
    positions = jnp.array([29, 7, 16], jnp.int32)  # beyond top-k, below top-k (dense), in between
    logits, _, topk = prefill_then_decode(model, ids, positions)
    assert np.isfinite(np.asarray(logits)).all()
    full, aux = forward(model, ids)  # causal: position p of the full forward sees exactly tokens 0..p
    for b, p in enumerate(np.asarray(positions)):
        np.testing.assert_allclose(np.asarray(logits[b]), np.asarray(full[b, p]), rtol=2e-5, atol=2e-5)
        # the decode step's top-k (every full indexer) is the prefill's top-k at that position, as a set
        for mine, ref in zip(topk, aux["topk"]):
            assert set(np.asarray(mine[b]).tolist()) - {-1} == set(np.asarray(ref[b, p]).tolist()) - {-1}


def test_sparse_mla_decode_reference_matches_dense_softmax():
    """The absorbed decode equals softmax attention written out directly; -1 slots may hold NaN rows."""
    k = jax.random.split(jax.random.key(2), 4)
    B, H, K, C, R = 2, 3, 7, 16, 8
    q_lat = jax.random.normal(k[0], (B, H, C))
    q_rope = jax.random.normal(k[1], (B, H, R))
    rows_c = jax.random.normal(k[2], (B, K, C))
    rows_r = jax.random.normal(k[3], (B, K, R))
    valid = jnp.array([[1, 1, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0]], bool)
    poisoned_c = jnp.where(valid[..., None], rows_c, jnp.nan)
    poisoned_r = jnp.where(valid[..., None], rows_r, jnp.nan)
    got = sparse_mla_decode_reference(q_lat, q_rope, poisoned_c, poisoned_r, valid, 0.3)
    for b in range(B):
        sel = np.asarray(valid[b])
        c, r = np.asarray(rows_c[b])[sel], np.asarray(rows_r[b])[sel]
        s = 0.3 * (np.asarray(q_lat[b]) @ c.T + np.asarray(q_rope[b]) @ r.T)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(got[b]), p @ c, rtol=1e-5, atol=1e-6)
    # a sequence with no valid row attends to nothing
    none = sparse_mla_decode_reference(q_lat, q_rope, rows_c, rows_r, jnp.zeros_like(valid), 0.3)
    assert np.all(np.asarray(none) == 0)


def test_moe_ragged_equals_dense():
    cfg = CONFIGS["deepseek-yarn"]
    m1 = hj.SparseMLAModel(cfg, rngs=nnx.Rngs(4), moe_impl="ragged")
    m2 = hj.SparseMLAModel(cfg, rngs=nnx.Rngs(4), moe_impl="dense")
    ids = jax.random.randint(jax.random.key(3), (2, 12), 0, cfg.vocab_size, dtype=jnp.int32)
    np.testing.assert_allclose(np.asarray(forward(m1, ids)[0]), np.asarray(forward(m2, ids)[0]), rtol=1e-5, atol=1e-5)


def test_no_recompilation_across_decode_steps():
    model = hj.SparseMLAModel(CONFIGS["glm-mixed"], rngs=nnx.Rngs(0))
    before = TRACE_COUNTS["decode"]
    generate(model, [[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=120)
    assert TRACE_COUNTS["decode"] - before == 1
    # a second call with the same shape buckets reuses the compiled step
    generate(model, [[9, 10], [11, 12, 13]], max_new_tokens=100)
    assert TRACE_COUNTS["decode"] - before == 1


def test_sampling_needs_key_and_is_reproducible():
    model = hj.SparseMLAModel(CONFIGS["glm-mixed"], rngs=nnx.Rngs(0))
    prompts = [[1, 2, 3, 4]]
    a = generate(model, prompts, 12, temperature=1.0, top_p=0.9, key=jax.random.key(7))
    b = generate(model, prompts, 12, temperature=1.0, top_p=0.9, key=jax.random.key(7))
    c = generate(model, prompts, 12, temperature=1.0, key=jax.random.key(8))
    assert a == b
    assert len(c[0]) == 12
    with pytest.raises(ValueError, match="PRNG key"):
        generate(model, prompts, 4, temperature=0.7)


def test_top_p_keeps_only_the_nucleus():
    from hisparse_jax.engine.sampling import sample_rows
    n = 200  # 200 draws: one row per seed (every row the same distribution)
    logits = jnp.log(jnp.tile(jnp.array([[0.5, 0.3, 0.15, 0.05]]), (n, 1)))
    draws = sample_rows(logits, jnp.arange(n, dtype=jnp.uint32), jnp.full(n, 3, jnp.int32), jnp.ones(n),
                        jnp.full(n, 0.7))
    assert set(np.asarray(draws).tolist()) == {0, 1}


def test_eos_truncates_output():
    model = hj.SparseMLAModel(CONFIGS["glm-mixed"], rngs=nnx.Rngs(0))
    full = generate(model, [[1, 2, 3]], 20)[0]
    eos = full[5]
    cut = generate(model, [[1, 2, 3]], 20, eos_token_id=eos)[0]
    assert cut == full[:full.index(eos) + 1]
