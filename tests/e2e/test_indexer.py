"""The lightning indexer's pieces: scores, causal top-k with -1 padding, ties, and the FP8 and MXFP4 emulations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import E2M1_VALUES, fp8_quantize, hadamard, mxfp4_dequantize, mxfp4_quantize
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
    fp8 = np.asarray(index_scores(q, w, keys, index_dtype="fp8"))[0, 0]
    assert np.linalg.norm(fp8 - exact) / np.linalg.norm(exact) < 0.05
    top_exact = set(np.argsort(-exact)[:64].tolist())
    top_fp8 = set(np.argsort(-fp8)[:64].tolist())
    assert len(top_exact & top_fp8) >= 56


def _mxfp4_oracle(x: np.ndarray) -> np.ndarray:
    """MXFP4 by brute force: per 32 values the scale 2^ceil(log2(amax / 6)), each value the nearest E2M1 multiple of
    it (ties to the even code), as float64."""
    vals = np.array(E2M1_VALUES)
    out = np.zeros(x.shape)
    for idx in np.ndindex(*x.shape[:-1]):
        for b in range(0, x.shape[-1], 32):
            blk = x[idx][b:b + 32].astype(np.float64)
            amax = np.abs(blk).max()
            if amax == 0:
                continue
            sc = 2.0 ** np.ceil(np.log2(amax / 6))
            for j, v in enumerate(blk):
                dist = np.abs(vals - abs(v) / sc)
                near = np.flatnonzero(dist == dist.min())
                code = near[0] if len(near) == 1 else next(c for c in near if c % 2 == 0)
                out[idx + (b + j,)] = np.sign(v) * vals[code] * sc
    return out


def test_mxfp4_matches_a_brute_force_oracle():
    """Random blocks over 12 decades, exact grid points, the midpoints (ties to even), signs, an all-zero block."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 128)) * 10.0 ** rng.integers(-6, 6, size=(6, 4)).repeat(32, axis=1)
    grid = np.array(E2M1_VALUES + (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0))
    x[0, :30] = np.concatenate([grid, -grid])[:30]
    x[1, :32] = 0.0
    x = x.astype(np.float32)
    codes, scales = mxfp4_quantize(jnp.asarray(x))
    assert codes.shape == (6, 64) and codes.dtype == jnp.uint8 and scales.shape == (6, 4) and scales.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(mxfp4_dequantize(codes, scales)), _mxfp4_oracle(x).astype(np.float32))
    assert 68 == 128 // 2 + 128 // 32  # bytes per 128-value key: vLLM's and SGLang's MXFP4 indexer row
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_quantize(jnp.zeros((2, 48)))


def test_int4_scores_track_exact_scores():
    """MXFP4 keys and queries: a precision change only, coarser than FP8 (the measured cost on the trained model is
    in experiments/index_dtype_quality.py)."""
    k = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(k[0], (1, 1, 16, 128))
    w = jnp.abs(jax.random.normal(k[1], (1, 1, 16)))
    keys = jax.random.normal(k[2], (1, 512, 128))
    exact = np.asarray(index_scores(q, w, keys))[0, 0]
    int4 = np.asarray(index_scores(q, w, keys, index_dtype="int4"))[0, 0]
    assert np.linalg.norm(int4 - exact) / np.linalg.norm(exact) < 0.2
    assert len(set(np.argsort(-exact)[:64].tolist()) & set(np.argsort(-int4)[:64].tolist())) >= 40
    with pytest.raises(ValueError, match="index_dtype must be one of"):
        index_scores(q, w, keys, index_dtype="int8")
