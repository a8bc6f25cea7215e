"""Decoding through the tiered store: identical to the all-resident run under a tiny device budget, one
compile for 100+ steps, scan == separate calls bit for bit, persistence resumes exactly."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.generate import generate
from hisparse_jax.engine import runner
from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv.manager import PageManager
from hisparse_jax.kv.persist import load_tiered, save_tiered
from tiny import BIG, model_cfg


@pytest.fixture(scope="module")
def model():
    return hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 97, n).tolist() for n in (300, 200, 150)]


@pytest.fixture(scope="module")
def contiguous_run(model, prompts):
    """The contiguous, all-resident reference (tokens, logits): computed once for both fetch mechanisms."""
    return generate(model, prompts, 40, return_logits=True)


@pytest.mark.parametrize("fetch", ["row", "page"])
def test_tiny_budget_is_lossless(model, prompts, contiguous_run, fetch):
    ref, ref_logits = contiguous_run
    big, s_big, l_big = generate(model, prompts, 40, cache=BIG.replace(fetch=fetch), return_stats=True,
                                 return_logits=True)
    small, s_small, l_small = generate(model, prompts, 40, cache=BIG.replace(device_pages=12, fetch=fetch),
                                       return_stats=True, return_logits=True)
    assert small == big == ref
    for a, b in zip(l_big, l_small):
        np.testing.assert_array_equal(a, b)  # bit-identical logits
    for a, b in zip(ref_logits, l_big):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert s_big.evicted_pages == s_big.misses == s_big.h2d_bytes == 0
    assert s_small.evicted_pages > 0 and s_small.misses > 0 and s_small.hits > 0
    assert s_small.h2d_bytes == s_small.misses * (32 + 16) * 4
    assert s_small.append_dropped == 0


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_tiered_equals_all_resident_in_compressed_formats(kv_dtype):
    """Same tokens; logits equal up to XLA:CPU compiling the step differently for different pool sizes.

    The rows themselves are bit-exact (tests/e2e/test_store.py, and the attention inputs were compared directly);
    in float32 the logits are bit-identical too (test_tiny_budget_is_lossless)."""
    cfg = model_cfg(kv_lora_rank=128, index_head_dim=128)
    m = hj.SparseMLAModel(cfg, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(1)
    ps = [rng.integers(0, 97, n).tolist() for n in (260, 140)]
    cc = BIG.replace(kv_dtype=kv_dtype)
    a, la = generate(m, ps, 24, cache=cc, return_logits=True)
    b, sb, lb = generate(m, ps, 24, cache=cc.replace(device_pages=7), return_stats=True, return_logits=True)
    assert a == b and sb.misses > 0
    for x, y in zip(la, lb):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def _start(model, prompts, cc):
    """A PageManager and its store with `prompts` prefilled; returns (manager, store, slots, first tokens)."""
    from hisparse_jax.engine.runner import prefill_rows

    tc = PageManager(model.cfg, cc)
    store = kv_device.new_store(tc)
    slots, toks = [], []
    for p in prompts:
        last, latent, rope, index_k = prefill_rows(model, p)
        store, slot = kv_device.admit_prefilled(store, tc, latent, rope, index_k, len(p))
        slots.append(slot)
        toks.append(int(jnp.argmax(last)))
    return tc, store, slots, jnp.asarray(toks, jnp.int32)


def test_scan_equals_separate_steps_and_compiles_once(model):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, n).tolist() for n in (140, 90)]
    cc = BIG.replace(device_pages=12)
    n = 110
    # separate calls
    tc, store, slots, tok = _start(model, prompts, cc)
    before = runner.TRACE_COUNTS["store_decode_step"]
    req = jnp.asarray(slots, jnp.int32)
    seq_tokens, seq_logits = [], []
    for i in range(n):
        store = kv_device.reserve_next(store, tc, slots)
        logits, store, _ = runner.store_decode_step(model, store, {"tokens": tok, "req": req})
        tc.advance(slots)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        seq_tokens.append(tok)
        seq_logits.append(logits)
        if i % 25 == 0:
            kv_device.check_tables(store, tc)
    assert runner.TRACE_COUNTS["store_decode_step"] - before == 1  # no recompilation over 110 steps
    # one scan: the host reserves the tail pages of all n positions first
    tc2, store2, slots2, tok2 = _start(model, prompts, cc)
    store2 = kv_device.reserve_next(store2, tc2, slots2, n)
    toks, logits, store2, stats = runner.decode_loop(model, store2, {"tokens": tok2, "req": req}, n)
    tc2.advance(slots2, n)
    np.testing.assert_array_equal(np.asarray(toks), np.asarray(jnp.stack(seq_tokens)))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(jnp.stack(seq_logits)))
    assert stats["misses"].shape == (n, 4)
    kv_device.check_tables(store2, tc2)


def test_save_restore_resumes_exactly(model, tmp_path):
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 97, n).tolist() for n in (200, 120)]
    cc = BIG.replace(device_pages=10)

    def run(tc, store, slots, tok, steps):
        req = jnp.asarray(slots, jnp.int32)
        out = []
        for _ in range(steps):
            store = kv_device.reserve_next(store, tc, slots)
            logits, store, _ = runner.store_decode_step(model, store, {"tokens": tok, "req": req})
            tc.advance(slots)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            out.append(np.asarray(logits))
        return store, tok, out

    tc, store, slots, tok = _start(model, prompts, cc)
    store, tok, _ = run(tc, store, slots, tok, 10)
    store = kv_device.apply_updates(store, tc)
    save_tiered(tc, store, tmp_path / "ckpt")
    _, _, want = run(tc, store, slots, tok, 15)
    restored, restored_store = load_tiered(tmp_path / "ckpt")
    assert restored_store.h_latent.sharding.memory_kind == "pinned_host"
    _, _, got = run(restored, restored_store, slots, tok, 15)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


def test_default_kv_dtype_follows_the_model(model):
    """CacheConfig's default kv_dtype ("auto") is the model's: a float32 model through a small tiered store gives
    exactly the contiguous path's tokens."""
    assert CacheConfig().kv_dtype == "auto"
    assert CacheConfig().kv_dtype_for(model.cfg) == "float32"
    assert CacheConfig().kv_dtype_for(model.cfg.replace(dtype="bfloat16")) == "bf16"
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, n).tolist() for n in (300, 170)]
    tokens, stats = generate(model, prompts, 12, cache=CacheConfig(device_pages=7, host_pages=24, max_seqs=2,
                                                                     max_seq_len=384), return_stats=True)
    assert tokens == generate(model, prompts, 12)
    assert stats.evicted_pages > 0 and stats.misses > 0
