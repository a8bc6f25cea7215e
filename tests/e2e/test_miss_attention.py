"""Hiding the miss copy: attention over the rows already on the device and over the fetched misses, computed
apart and merged by their log-sum-exp (`CacheConfig(miss_attention="split")`), equals the single pass."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.engine import Engine, EngineConfig, SamplingParams
from hisparse_jax.generate import generate
from pallas_kernels.sparse_mla_decode.reference import (merge_partial_attention, sparse_mla_decode_rows,
                                                         sparse_mla_decode_rows_lse)
from tiny import BIG, model_cfg


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_merged_parts_equal_the_single_pass(dtype, seed):
    """Random queries and rows (rows in `dtype`; scores, softmax and sums accumulate in float32 either way), a
    random split of the valid rows, some sequences with one part empty or no valid row at all, NaN in the rows
    no part selects: the merge equals the single pass within 1e-6 relative (of the output's scale)."""
    rng = np.random.default_rng(seed)
    B, H, K, C, R = 6, 4, 48, 64, 16
    q_lat = jnp.asarray(rng.normal(size=(B, H, C)), jnp.float32)
    q_rope = jnp.asarray(rng.normal(size=(B, H, R)), jnp.float32)
    rows_c = rng.normal(size=(B, K, C)) * rng.uniform(0.5, 3.0)
    rows_r = rng.normal(size=(B, K, R))
    valid = rng.random((B, K)) < 0.7
    valid[4] = False  # no valid row
    first = rng.random((B, K)) < 0.5
    first[2] = True   # every valid row in the first part
    first[3] = False  # every valid row in the second part
    rows_c[~valid] = np.nan  # never read
    rows_c, rows_r = jnp.asarray(rows_c, dtype), jnp.asarray(rows_r, dtype)
    tau = 1.0 / np.sqrt(C + R)
    want = sparse_mla_decode_rows(q_lat, q_rope, rows_c, rows_r, jnp.asarray(valid), tau)
    a = sparse_mla_decode_rows_lse(q_lat, q_rope, rows_c, rows_r, jnp.asarray(valid & first), tau)
    b = sparse_mla_decode_rows_lse(q_lat, q_rope, rows_c, rows_r, jnp.asarray(valid & ~first), tau)
    got = np.asarray(merge_partial_attention(*a, *b))
    want = np.asarray(want)
    assert np.all(np.isfinite(got)) and np.all(got[4] == 0)
    scale = np.max(np.abs(want), axis=-1, keepdims=True) + 1e-30
    assert np.max(np.abs(got - want) / scale) <= 1e-6
    np.testing.assert_array_equal(np.asarray(a[1])[4], -np.inf)


@pytest.fixture(scope="module")
def model():
    return hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(5))


PROMPTS = [[(11 * i + 5 * j * j) % 97 for j in range(n)] for i, n in enumerate((260, 140, 200))]


def test_split_generate_gives_the_same_tokens_under_pressure(model):
    tight = BIG.replace(device_pages=9)
    a, sa, la = generate(model, PROMPTS, 20, cache=tight, return_stats=True, return_logits=True)
    b, sb, lb = generate(model, PROMPTS, 20, cache=tight.replace(miss_attention="split"), return_stats=True,
                         return_logits=True)
    assert sa.misses > 0 and sa.hits > 0  # both parts are exercised
    assert a == b and (sa.misses, sa.hits, sa.h2d_bytes) == (sb.misses, sb.hits, sb.h2d_bytes)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_split_engine_gives_generates_tokens(model):
    eng = Engine(model, BIG.replace(device_pages=9, miss_attention="split"),
                 EngineConfig(policy="hisparse", max_running=4, prefill="whole"))
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    assert outs == generate(model, PROMPTS, 12) and eng.metrics().misses > 0


def test_split_with_pallas_kernels_is_refused(model):
    with pytest.raises(ValueError, match="miss_attention='split' needs kernels='reference'"):
        generate(model, PROMPTS[:1], 4, cache=BIG.replace(miss_attention="split"), kernels="pallas_interpret")
    with pytest.raises(ValueError, match="miss_attention must be one of"):
        hj.CacheConfig(miss_attention="overlap")


def test_demo_takes_the_choice_and_refuses_it_with_pallas():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "hisparse_jax.cli", "demo", "--miss-attention", "split", "--kernels",
                          "pallas_interpret"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--miss-attention: split needs --kernels reference" in out.stderr
