"""The lightning indexer's pieces: scores, causal top-k with -1 padding, ties, and the FP8 emulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import fp8_quantize, hadamard
from pallas_kernels.indexer_topk.reference import index_scores, select_topk


def test_scores_match_numpy():
    k = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k[0], (2, 5, 4, 32))  # [B, T, I, dI]
    w = jax.random.normal(k[1], (2, 5, 4))
    keys = jax.random.normal(k[2], (2, 9, 32))  # [B, S, dI]
    got = np.asarray(index_scores(q, w, keys))
    ref = np.einsum("btis,bti->bts", np.maximum(np.einsum("btid,bsd->btis", np.asarray(q), np.asarray(keys)), 0),
                    np.asarray(w))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_select_topk_causal_padding_and_ties():
    scores = jnp.array([[3.0, 1.0, 3.0, 7.0, 0.5, 9.0]])
    valid = jnp.array([[True, True, True, True, False, False]])  # position 3 is the query: s <= 3
    got = np.asarray(select_topk(scores, valid, 3))[0]
    assert got.tolist() == [3, 0, 2]  # 7, then the tie 3.0 / 3.0 resolved to the lower position first
    # fewer valid keys than k: valid ones first, -1 after, never a masked position
    got = np.asarray(select_topk(scores, jnp.array([[True, True, False, False, False, False]]), 4))[0]
    assert got.tolist() == [0, 1, -1, -1]
    # k larger than the number of keys: min(k, S) slots
    assert select_topk(scores, valid, 100).shape == (1, 6)


def test_hadamard_is_orthogonal():
    x = jax.random.normal(jax.random.key(1), (3, 128))
    y = jax.random.normal(jax.random.key(2), (3, 128))
    np.testing.assert_allclose(np.asarray(jnp.sum(hadamard(x) * hadamard(y), -1)), np.asarray(jnp.sum(x * y, -1)),
                               rtol=1e-4, atol=1e-4)


def test_fp8_quantize_power_of_two_scales_and_error():
    x = jax.random.normal(jax.random.key(3), (4, 128)) * jnp.array([[1e-3], [1.0], [30.0], [1e3]])
    q, s = fp8_quantize(x, block=128)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (4,)
    assert np.all(np.log2(np.asarray(s)) == np.round(np.log2(np.asarray(s))))
    deq = q.astype(jnp.float32) * s[:, None]
    assert np.max(np.abs(np.asarray(deq - x)) / np.max(np.abs(np.asarray(x)), axis=1, keepdims=True)) < 0.07


def test_fp8_scores_track_exact_scores():
    """The FP8 + Hadamard emulation is a precision change only: scores close, top-k sets mostly shared."""
    k = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(k[0], (1, 1, 16, 128))
    w = jnp.abs(jax.random.normal(k[1], (1, 1, 16)))
    keys = jax.random.normal(k[2], (1, 512, 128))
    exact = np.asarray(index_scores(q, w, keys))[0, 0]
    fp8 = np.asarray(index_scores(q, w, keys, fp8=True))[0, 0]
    assert np.linalg.norm(fp8 - exact) / np.linalg.norm(exact) < 0.05
    top_exact = set(np.argsort(-exact)[:64].tolist())
    top_fp8 = set(np.argsort(-fp8)[:64].tolist())
    assert len(top_exact & top_fp8) >= 56
