"""A store saved in one process resumes in another: `load_tiered`'s arrays are typed and placed as a new store's
(memory kinds in their types), so docs/store.md's path (`load_tiered`, `kv_device.reserve_next`,
`runner.store_decode_step`) and the engine's decode-and-sample program (`Runner.step`) continue from it in a fresh
process with exactly the uninterrupted run's tokens: float32, bf16 and fp8 KV, int4 indexer keys, host-tier keys.

(A whole engine — requests, queues, store — is saved and resumed by `engine.snapshot`, tested in
tests/e2e/test_engine_resume.py.) The pytest process saves every format and continues; one subprocess restores them
all and continues the same way."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.engine.runner import Runner, store_decode_step
from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv import tiered
from hisparse_jax.kv.manager import PageManager
from hisparse_jax.kv.persist import load_tiered, save_tiered
from limit_harness import fresh_process
from tiny import BIG, model_cfg

# name -> (model config overrides, CacheConfig): every KV dtype, both key tiers, every quantized key format
FORMATS = {
    "float32": ({}, BIG.replace(device_pages=7)),
    "bf16-host-keys": ({}, BIG.replace(kv_dtype="bf16", index_tier="host", device_pages=7)),
    "fp8-int4-host-keys": ({"kv_lora_rank": 128, "index_head_dim": 128},
                           BIG.replace(kv_dtype="fp8", index_dtype="int4", index_tier="host", device_pages=7)),
}
PROMPTS = [np.random.default_rng(4).integers(0, 97, n).tolist() for n in (300, 170)]
BEFORE, DECODE, ENGINE = 4, 5, 5  # steps before the save; after it, through store_decode_step, then through Runner.step


def build(name):
    """The format's model (seeded: the same weights in every process) and its cache config."""
    over, cc = FORMATS[name]
    return hj.SparseMLAModel(model_cfg(**over), rngs=nnx.Rngs(0)), cc


def continue_decoding(model, tc, store, slots, tok, n_decode, n_engine):
    """Greedy steps from (store, last tokens): `n_decode` through docs/store.md's path, then `n_engine` through the
    engine's program (`Runner.step`: its batch and sampling rows, one device read). Returns (store, the last
    tokens, the tokens of every step [steps][B], the rows store_decode_step read from the host pools)."""
    req = jnp.asarray(slots, jnp.int32)
    out, misses = [], 0
    for _ in range(n_decode):
        store = kv_device.reserve_next(store, tc, slots)
        logits, store, stats = store_decode_step(model, store, {"tokens": tok, "req": req})
        misses += int(np.sum(stats["misses"]))
        tc.advance(slots)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        out.append(np.asarray(tok).tolist())
    runner, B = Runner(model), len(slots)
    for _ in range(n_engine):
        store = kv_device.reserve_next(store, tc, slots)
        pos = [tc.lengths[s] for s in slots]  # the row each request writes (reserved above)
        sampling = {"rows": np.arange(B, dtype=np.int32), "seed": np.zeros(B, np.uint32),
                    "pos": np.asarray(pos, np.int32) + 1, "temperature": np.zeros(B, np.float32),
                    "top_p": np.ones(B, np.float32)}
        batch = {"tokens": np.asarray(tok, np.int32), "req": np.asarray(slots, np.int32),
                 "pos": np.asarray(pos, np.int32), "index_span": tiered.index_span(tc.spec, max(pos) + 1)}
        step = runner.step(tc.spec, store, batch, sampling, B)
        store = step.store
        tc.advance(slots)
        tok = jnp.asarray(step.tokens, jnp.int32)
        out.append(list(step.tokens))
    return store, tok, out, misses


def resume(path):
    """In a fresh process: restore every format saved under `path`, check each array's type and sharding against a
    new store's, continue decoding; {name: tokens}."""
    got = {}
    for name in FORMATS:
        model, cc = build(name)
        with open(os.path.join(path, name + ".json")) as f:
            slots, tok = json.load(f)
        tc, store = load_tiered(os.path.join(path, name))
        store, _, got[name], _ = continue_decoding(model, tc, store, slots, jnp.asarray(tok, jnp.int32), DECODE, ENGINE)
        fresh = kv_device.new_store(PageManager(model.cfg, cc))
        restored = load_tiered(os.path.join(path, name))[1]
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(fresh)):
            assert str(jax.typeof(a)) == str(jax.typeof(b)) and a.sharding == b.sharding, (name, a, b)
    return got


@pytest.mark.slow
def test_a_saved_store_resumes_in_a_fresh_process(tmp_path):
    want = {}
    for name in FORMATS:
        model, cc = build(name)
        tc = PageManager(model.cfg, cc)
        store, slots, logits = Runner(model).admit_prompts(kv_device.new_store(tc), tc, PROMPTS)
        tok = jnp.asarray([int(np.argmax(x)) for x in logits], jnp.int32)
        store, tok, _, _ = continue_decoding(model, tc, store, slots, tok, BEFORE, 0)
        store = kv_device.apply_updates(store, tc)
        save_tiered(tc, store, tmp_path / name)
        with open(tmp_path / (name + ".json"), "w") as f:
            json.dump([slots, np.asarray(tok).tolist()], f)
        _, _, want[name], misses = continue_decoding(model, tc, store, slots, tok, DECODE, ENGINE)
        assert misses > 0, name  # the continuation reads the host pools
    got = fresh_process("test_resume", f"resume({str(tmp_path)!r})")
    for name in FORMATS:
        assert got[name] == want[name], name
