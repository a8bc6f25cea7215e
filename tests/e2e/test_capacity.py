"""Budgets are host numbers: inside one capacity (`CacheConfig.capacity`, the store's shapes) every budget of device
pages, host pages, request slots and hot-buffer rows runs the same compiled programs, and gives the tokens of the
all-resident run. The sweep the project exists for (budgets x hot-buffer sizes) compiles once per batch bucket."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.engine import runner
from hisparse_jax.engine import Engine, EngineConfig
from hisparse_jax.engine.request import SamplingParams
from hisparse_jax.engine.scheduler import POLICIES, policy_cache
from hisparse_jax.generate import generate
from hisparse_jax.kv.manager import PageManager
from tiny import model_cfg

# the capacity: what the store's arrays are shaped by (index_topk 16: hot-row budgets from 16 up)
CAP = CacheConfig(kv_dtype="float32", device_pages=64, host_pages=64, max_seqs=4, max_seq_len=512, hot_rows=64)
# 3 prompts hold 12 pages at their longest: 9 device pages is the least HiSparse can run them in
DEVICE_BUDGETS = (9, 10, 11, 64)
HOT_BUDGETS = (16, 32)


@pytest.fixture(scope="module")
def model():
    return hj.SparseMLAModel(model_cfg(vocab_size=89), rngs=nnx.Rngs(4))  # its own vocabulary: its own programs


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 89, n).tolist() for n in (300, 200, 150)]


def budget(**kw) -> CacheConfig:
    return CAP.replace(capacity=CAP, **kw)


def test_generate_compiles_one_step_for_every_budget(model, prompts):
    ref = generate(model, prompts, 20)
    before = runner.TRACE_COUNTS["store_decode_step"]
    misses = {}
    for dp in DEVICE_BUDGETS:
        for hr in HOT_BUDGETS:
            out, stats = generate(model, prompts, 20, cache=budget(device_pages=dp, hot_rows=hr), return_stats=True)
            assert out == ref, (dp, hr)
            misses[dp, hr] = stats.misses
    assert runner.TRACE_COUNTS["store_decode_step"] - before == 1  # one batch bucket, one index span: one compile
    # the budgets are enforced, not only accepted: less device memory, more misses; a smaller hot buffer, more
    assert misses[9, 16] > misses[10, 16] > misses[11, 16] > misses[64, 16] == 0
    assert misses[9, 16] > misses[9, 32]


def test_engine_compiles_once_per_batch_shape_across_budgets(model, prompts):
    seen, traces = set(), 0
    for dp in DEVICE_BUDGETS:
        for hr in HOT_BUDGETS:
            eng = Engine(model, budget(device_pages=dp, hot_rows=hr, host_pages=48, max_seqs=3),
                         EngineConfig(policy="hisparse", max_running=3, prefill="whole", min_bucket=4))
            before = runner.TRACE_COUNTS["store_decode_step"]
            out = eng.generate(prompts, SamplingParams(max_new_tokens=12))
            traces += runner.TRACE_COUNTS["store_decode_step"] - before
            seen |= {(m.bucket, m.scored_pages) for m in eng.history if m.bucket}
            assert [len(o) for o in out] == [12, 12, 12]
    assert traces == len(seen), (traces, sorted(seen))  # one compile per step shape, whatever the budget


def test_budget_inside_capacity_is_enforced_and_checked():
    tc = PageManager(model_cfg(), budget(device_pages=10, host_pages=20, max_seqs=2, hot_rows=16))
    assert (tc.spec.device_pages, tc.spec.max_seqs, tc.spec.hot_rows) == (64, 4, 64)  # shapes: the capacity's
    assert (tc.budget_spec.device_pages, tc.budget_spec.max_seqs, tc.budget_spec.hot_rows) == (10, 2, 16)
    assert tc.pool.num_free(hj.kv.pool.Tier.DEVICE) == 10 and len(tc.free_slots()) == 2
    with pytest.raises(ValueError, match=r"device_pages \(65\) exceeds the capacity's \(64\)"):
        budget(device_pages=65)
    with pytest.raises(ValueError, match="kv_dtype must be the capacity's"):
        CacheConfig(kv_dtype="bf16", capacity=CAP)
    with pytest.raises(ValueError, match=r"hot_rows \(128\) exceeds the capacity's \(64\)"):
        PageManager(model_cfg(), budget(hot_rows=128))


def test_every_policy_runs_inside_one_capacity(model, prompts):
    """One capacity for the three policies: the engine imposes its formats (preempt keeps no host mirror,
    speculation its verified rows) on the budgets and the capacity together; it refused the capacity before."""
    for policy in POLICIES:
        eng = Engine(model, budget(device_pages=40, host_pages=48, max_seqs=3),
                     EngineConfig(policy=policy, max_running=3, prefill="whole", min_bucket=4))
        assert (eng.manager.spec.device_pages, eng.manager.budget_spec.device_pages) == (64, 40)
        assert eng.manager.cache.mirror_to_host == eng.manager.cache.capacity.mirror_to_host == (policy != "preempt")
    assert [len(o) for o in eng.generate(prompts, SamplingParams(max_new_tokens=3))] == [3, 3, 3]
    spec_cache = policy_cache(budget(), "hisparse", 2, speculative_tokens=2)
    assert spec_cache.speculative_tokens == spec_cache.capacity.speculative_tokens == 2
    assert spec_cache.max_seqs == 2 and spec_cache.capacity.max_seqs == 4
    with pytest.raises(ValueError, match="formats only"):
        CAP.with_formats(device_pages=3)
