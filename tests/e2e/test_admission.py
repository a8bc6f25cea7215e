"""Admission under preempt / offload: "vllm" (on the prompt's pages, grown page by page, preempting or swapping out
the newest request when one cannot grow) against "reserve" (the indexer pages of the whole length up front); both
give the tokens of the contiguous path. HiSparse keeps its own rule under either."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.engine import Engine, EngineConfig, SamplingParams
from hisparse_jax.engine.fake_compute import FakeEngine, liveness_model, random_workload, run_workload
from hisparse_jax.engine.scheduler import ADMISSIONS, Scheduler
from hisparse_jax.generate import generate
from hisparse_jax.kv.manager import PageManager
from hisparse_jax.kv.pool import Tier
from hisparse_jax.kv.spec import BudgetError
from tiny import model_cfg

NEW = 130  # prompts of 3 pages (130 tokens) grow to 5 pages (259 positions): two pages added while decoding
# one capacity for every run here (the policies' budgets inside it share compiled programs); the device and
# indexer pools hold 12 pages: three prompts with a growth page each (4 pages) or two whole requests (5 pages)
CAPACITY = CacheConfig(kv_dtype="float32", device_pages=12, index_pages=64, host_pages=64, max_seqs=4,
                       max_seq_len=320)
BUDGET = CAPACITY.replace(index_pages=12, capacity=CAPACITY)
KV_PAGE = 4 * 64 * 48 * 4  # one KV page of the tiny model (4 layers, latent 32 + rope 16, float32)
KEY_PAGE = 2 * 64 * 32 * 4  # one indexer page (2 indexer layers, keys of 32, float32)


@pytest.fixture(scope="module")
def model():
    return hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 97, 130).tolist() for _ in range(3)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    return generate(model, prompts, NEW)


def _run(model, prompts, policy, admission):
    eng = Engine(model, BUDGET, EngineConfig(policy=policy, admission=admission, max_running=4, prefill_chunk=256,
                                             check_invariants=True))
    out = eng.generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert all(eng.manager.pool.num_used(t) == 0 for t in Tier)
    return out, eng.metrics()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["preempt", "offload"])
def test_vllm_admits_more_at_first_then_preempts_or_swaps(model, prompts, reference, policy):
    out_v, m_v = _run(model, prompts, policy, "vllm")
    out_r, m_r = _run(model, prompts, policy, "reserve")
    assert out_v == reference and out_r == reference
    # admitted at once before any preemption or swap: 3 x (3 + 1) pages against 2 x 5 in a pool of 12
    first = [h.admitted for h in m_v.history[:next(i for i, h in enumerate(m_v.history) if h.preemptions
                                                       or h.swaps_out)]]
    assert max(first) == 3 and max(h.admitted for h in m_r.history) == 2
    assert m_r.preemptions == m_r.swaps == m_r.recomputed_tokens == m_r.swap_out_bytes == 0
    assert m_v.admission == "vllm" and m_r.admission == "reserve"
    if policy == "preempt":
        assert m_v.preemptions > 0 and m_v.swaps == 0
        # every prompt token computed once, plus what readmissions computed again (prefix caching serves the
        # victim's registered prompt pages; the rest of its prompt and what it generated are recomputed)
        assert m_v.recomputed_tokens > 0 and m_v.prefill_tokens == 3 * 130 + m_v.recomputed_tokens
        assert m_v.preempted_steps > 0 and m_v.swap_out_pages == 0
    else:
        assert m_v.swaps > 0 and m_v.preemptions == 0 and m_v.recomputed_tokens == 0
        # every page of a victim leaves the device; those not still cached there come back in whole-page copies
        assert m_v.swap_out_pages >= 4 * m_v.swaps and 0 < m_v.swap_in_pages <= m_v.swap_out_pages
        assert m_v.h2d_bytes == m_v.swap_in_pages * KV_PAGE  # nothing else is loaded (no page ever released)
        keys = m_v.swap_out_bytes - m_v.swap_out_pages * KV_PAGE  # the keys leave and re-enter the budget whole
        assert keys == m_v.swap_in_bytes - m_v.swap_in_pages * KV_PAGE == m_v.swap_out_pages * KEY_PAGE
        assert m_v.swapped_steps > 0


def test_admission_is_checked():
    with pytest.raises(ValueError, match="unknown admission 'lazy'; choose one of vllm, reserve"):
        EngineConfig(policy="preempt", admission="lazy")
    manager = PageManager(liveness_model(), CacheConfig(kv_dtype="float32", device_pages=8, host_pages=8))
    with pytest.raises(ValueError, match="unknown admission"):
        Scheduler(manager, "offload", max_running=2, prefill_chunk=64, admission="")
    assert ADMISSIONS == ("vllm", "reserve") and EngineConfig().admission == "vllm"


def test_offload_refuses_a_request_whose_keys_never_fit_the_device():
    """Under "vllm" offload's key pool grows to hold the swapped requests' keys; the device's share stays the
    CacheConfig's index_pages, and a request longer than that is refused at the door, not left waiting."""
    cc = CacheConfig(kv_dtype="float32", device_pages=8, index_pages=3, host_pages=16, max_seq_len=512)
    eng = FakeEngine(liveness_model(), cc, EngineConfig(policy="offload", max_running=2, admission="vllm"))
    assert eng.manager.budget_spec.index_pages == 16 and eng.scheduler.device_keys == 3
    with pytest.raises(BudgetError, match="index_pages is too small.* 4 indexer pages .*index_pages is 3, 1 short"):
        eng.add_request("a", [1] * 200, SamplingParams(max_new_tokens=40))
    eng.add_request("b", [1] * 100, SamplingParams(max_new_tokens=40))


def _schedule(w):
    """Each step's plan of `w` on a FakeEngine, as comparable tuples, and the outputs."""
    eng = FakeEngine(liveness_model(), w.cache_config(), w.engine_config())
    for i, (_, p, n, _) in enumerate(w.requests):
        eng.add_request(f"r{i}", list(p), SamplingParams(max_new_tokens=n, seed=i))
    plans = []
    while eng.has_unfinished():
        s = eng.step_report()
        plans.append(([r.request_id for r in s.plan.decode], [(r.request_id, a, n) for r, a, n in s.plan.prefill],
                      [r.request_id for r in s.plan.whole], dict(s.plan.waits)))
    return plans, {rid: r.output for rid, r in eng.requests.items()}


def test_hisparse_schedules_the_same_under_either_admission():
    for seed in range(40):
        w = dataclasses.replace(random_workload(np.random.default_rng(seed)), policy="hisparse")
        w = dataclasses.replace(w, requests=tuple((0, p, n, e) for _, p, n, e in w.requests))
        a = _schedule(dataclasses.replace(w, admission="vllm"))
        assert a == _schedule(dataclasses.replace(w, admission="reserve")), seed


def test_both_rules_are_live_and_vllm_preempts_more():
    """The liveness properties (`run_workload`) for the same workloads under both rules; over them the vLLM rule
    admits on the prompt and so preempts / swaps more often than the reserve rule (which can still preempt when
    the device pool is smaller than the indexer pool)."""
    events = {a: 0 for a in ADMISSIONS}
    for seed in range(60):
        w = random_workload(np.random.default_rng(seed))
        if w.policy == "hisparse":
            continue
        w = dataclasses.replace(w, index_pages=w.device_pages)  # as `device_budget` splits preempt / offload
        for a in ADMISSIONS:
            rep = run_workload(dataclasses.replace(w, admission=a), check_every=4)
            assert not rep.failures, (seed, a, rep.failures)
            assert rep.steps <= rep.bound
            events[a] += rep.counts["preemptions"] + rep.counts["swaps"]
    assert events["vllm"] > events["reserve"], events
