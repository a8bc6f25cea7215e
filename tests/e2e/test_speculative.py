"""MTP speculative decoding in the engine: the same tokens as without speculation (greedy and sampled) under
memory pressure and every policy; drafts verified through one union resolve per request (H2D bytes = distinct
missing rows); acceptance rate and tokens per step; clear refusals."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.engine import Engine, EngineConfig, SamplingParams
from hisparse_jax.engine.runner import TRACE_COUNTS
from hisparse_jax.kv.state import StoreSpec
from tiny import model_cfg

NEW = 20



@pytest.fixture(scope="module")
def model():
    return hj.SparseMLAModel(model_cfg(num_nextn_predict_layers=1), rngs=nnx.Rngs(0), mtp=True)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 97, n).tolist() for n in (400, 460, 330, 420)]


def cache_for(model, policy, k):
    """The same budgets for every run: 16 device KV pages for 4 requests of ~8 pages (MTP layer included), every
    indexer page, so HiSparse releases pages and misses while the others queue, preempt or swap."""
    return CacheConfig(kv_dtype="float32", device_pages=16, index_pages=40, host_pages=64, max_seq_len=576,
                       speculative_tokens=k)


def run(model, prompts, policy, k, params=SamplingParams(max_new_tokens=NEW), engine_cls=Engine):
    eng = engine_cls(model, cache_for(model, policy, k),
                     EngineConfig(policy=policy, max_running=4, prefill="whole", prefix_caching=False,
                                  check_invariants=True, speculative_tokens=k))
    out = eng.generate(prompts, params)
    return out, eng.metrics(), eng


@pytest.fixture(scope="module")
def baseline(model, prompts):
    return run(model, prompts, "hisparse", 0)


@pytest.mark.parametrize("k", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_greedy_tokens_identical_under_eviction(model, prompts, baseline, k):
    out, m, eng = run(model, prompts, "hisparse", k)
    assert out == baseline[0]
    assert m.evicted_pages > 0 and m.misses > 0  # the budget forced releases and host fetches
    assert m.speculative_tokens == k and m.acceptance_rate >= 0 and m.tokens_per_step >= 1
    row = eng.manager.spec.row_bytes
    for h in m.history:  # every step moved exactly its distinct missing rows
        assert h.h2d_bytes == h.misses * row


@pytest.mark.slow
def test_score_ema_hot_policy_gives_the_same_tokens(model, prompts, baseline):
    """hot_policy="score_ema" under speculation: a request's k + 1 rows score its slots (the union keeps the
    highest score), and the tokens stay those of the LRU run without speculation."""
    eng = Engine(model, cache_for(model, "hisparse", 1).replace(hot_policy="score_ema"),
                 EngineConfig(policy="hisparse", max_running=4, prefill="whole", prefix_caching=False,
                              check_invariants=True, speculative_tokens=1))
    assert eng.generate(prompts, SamplingParams(max_new_tokens=NEW)) == baseline[0]
    assert eng.metrics().misses > 0


class PerfectDrafts(Engine):
    """Drafts replaced by the true continuation (from a run without speculation), one of them wrong every few
    steps: exercises acceptance of 0..k drafts, multi-token commits and the lengths they set."""

    truth: dict = {}

    def _speculative_step(self, decode):
        for r in decode:
            full = self.truth[r.request_id]
            nxt = full[len(r.output):len(r.output) + self.k]
            d = nxt + [0] * (self.k - len(nxt))
            if self.step_count % 3 == 2 and len(d) > 1:
                d[len(d) // 2] = (d[len(d) // 2] + 1) % self.model.cfg.vocab_size  # a rejected draft mid-way
            r.drafts = d
        return super()._speculative_step(decode)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["preempt", "offload", "hisparse"])
def test_accepted_drafts_commit_several_tokens_per_step(model, prompts, baseline, policy):
    ref = baseline[0] if policy == "hisparse" else run(model, prompts, policy, 0)[0]
    PerfectDrafts.truth = {f"gen-{i}": o for i, o in enumerate(ref)}
    out, m, _ = run(model, prompts, policy, 3, engine_cls=PerfectDrafts)
    assert out == ref
    assert m.acceptance_rate > 0.5 and m.tokens_per_step > 2, (m.acceptance_rate, m.tokens_per_step)


@pytest.mark.slow
def test_sampled_tokens_identical(model, prompts):
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    ref = run(model, prompts[:2], "hisparse", 0, params)[0]
    assert run(model, prompts[:2], "hisparse", 2, params)[0] == ref


def test_steps_compile_once_per_bucket(model, prompts):
    before = TRACE_COUNTS["store_decode_step"]
    run(model, prompts, "hisparse", 1)
    run(model, prompts, "hisparse", 1)  # the same buckets: nothing new to trace
    compiles = TRACE_COUNTS["store_decode_step"] - before
    assert compiles <= 3, compiles  # one per batch bucket seen (at most 1, 2, 4 requests; min_bucket 8 -> one)


def test_refusals(model, prompts):
    plain = hj.SparseMLAModel(model_cfg(num_nextn_predict_layers=1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="MTP layer"):
        Engine(plain, cache_for(model, "hisparse", 1),
               EngineConfig(prefill="whole", prefix_caching=False, speculative_tokens=1))
    with pytest.raises(ValueError, match="prefill='whole'"):
        EngineConfig(speculative_tokens=1)
    with pytest.raises(ValueError, match="speculative_tokens must be <="):
        EngineConfig(prefill="whole", prefix_caching=False, speculative_tokens=99)
    with pytest.raises(ValueError, match=r"hot_rows \(31\) must be >= 2 x index_topk"):
        StoreSpec.create(model.cfg, CacheConfig(hot_rows=31, speculative_tokens=1))
    with pytest.raises(ValueError, match="needs a model with MTP layers"):
        StoreSpec.create(model_cfg(), CacheConfig(speculative_tokens=1))


def test_rejection_rule_keeps_the_target_distribution():
    import jax
    import jax.numpy as jnp

    from hisparse_jax.engine.speculative import verify_rows

    G, V = 6000, 5
    lg = jnp.log(jnp.asarray([0.1, 0.4, 0.2, 0.25, 0.05]))
    logits = jnp.broadcast_to(lg, (G, 2, V))
    drafts = jnp.full((G, 1), 1, jnp.int32)  # a deterministic draft of the token with p = 0.4
    seeds = jnp.arange(G, dtype=jnp.uint32)
    pos = jnp.broadcast_to(jnp.asarray([10, 11], jnp.int32), (G, 2))
    ones = jnp.ones(G, jnp.float32)
    toks, acc = jax.jit(verify_rows, static_argnames="rule")(logits, drafts, jnp.ones((G, 1), bool), seeds, pos,
                                                              ones, ones, rule="rejection")
    toks, acc = np.asarray(toks), np.asarray(acc)
    first = np.bincount(toks[:, 0], minlength=V) / G  # the token each request emits first: ~ p
    np.testing.assert_allclose(first, np.exp(np.asarray(lg)), atol=0.025)
    assert abs(acc.mean() - 0.4) < 0.025
    assert np.all(toks[acc == 0, 0] != 1) and np.all(toks[acc == 1, 0] == 1)
    # "match": the first token is the target's own (seed, position) draw whatever the draft
    toks_m, acc_m = verify_rows(logits, drafts, jnp.ones((G, 1), bool), seeds, pos, ones, ones, rule="match")
    base, _ = verify_rows(logits, drafts, jnp.zeros((G, 1), bool), seeds, pos, ones, ones, rule="match")
    np.testing.assert_array_equal(np.asarray(toks_m)[:, 0], np.asarray(base)[:, 0])
    np.testing.assert_array_equal(np.asarray(acc_m), (np.asarray(base)[:, 0] == 1).astype(int))


@pytest.mark.slow
def test_rejection_rule_in_the_engine(model, prompts, baseline):
    greedy = run(model, prompts[:2], "hisparse", 2, SamplingParams(max_new_tokens=NEW), engine_cls=Rejection)[0]
    assert greedy == baseline[0][:2]  # greedy rows accept exactly the argmax under either rule
    out, m, _ = run(model, prompts[:2], "hisparse", 2, SamplingParams(max_new_tokens=12, temperature=1.0, seed=3),
                    engine_cls=Rejection)
    assert [len(o) for o in out] == [12, 12] and 0 <= m.acceptance_rate <= 1


class Rejection(Engine):
    def __init__(self, model, cache, config):
        import dataclasses

        super().__init__(model, cache, dataclasses.replace(config, speculative_acceptance="rejection"))


@pytest.mark.slow
def test_demo_reports_acceptance_and_tokens_per_step():
    from hisparse_jax import demo

    out = demo.run(requests=2, prompt_len=96, new_tokens=4, speculative_tokens=2, policies=("offload", "hisparse"),
                   plot="", device_requests=2.0, preset="demo-glm")  # random weights: drafts rarely accepted
    assert out["speculative_tokens"] == 2 and out["outputs_identical"]
    for pol in ("offload", "hisparse"):
        r = out["policies"][pol]
        assert 0 <= r["acceptance_rate"] <= 1 and r["tokens_per_step"] >= 1 and r["duplicate_misses"] >= 0
        assert r["h2d_per_miss_bytes"] in (None, 1.0)
