"""The engine: three policies, same tokens; allocator invariants after every step incl. aborts; clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.engine import Engine, EngineConfig, RequestState, SamplingParams, device_budget
from hisparse_jax.generate import generate
from hisparse_jax.kv.audit import check_manager
from hisparse_jax.kv.pool import Tier
from hisparse_jax.kv.spec import BudgetError
from tiny import model_cfg

NEW = 24


@pytest.fixture(scope="module")
def model():
    return hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(0, 97, n).tolist() for n in (600, 560, 500, 580, 450, 620)]


PAGE_BYTES = 64 * 4 * 48 * 4 + 64 * 2 * 32 * 4  # one KV page (4 layers) + one indexer page (2 indexer layers)


def cache_for(policy, model):
    """The same device bytes for every policy: three whole longest requests (11 pages each); the policies' budgets
    lie inside one capacity, so they share compiled programs where their formats agree (offload and hisparse)."""
    capacity = CacheConfig(kv_dtype="float32", device_pages=48, index_pages=48, host_pages=96, max_seqs=6,
                           max_seq_len=704)
    base = capacity.replace(capacity=capacity)
    return device_budget(model.cfg, base, 3 * 11 * PAGE_BYTES, policy, max_running=6, max_len=644)


@pytest.fixture(scope="module")
def runs(model, prompts):
    out = {}
    for pol in ("preempt", "offload", "hisparse"):
        eng = Engine(model, cache_for(pol, model), EngineConfig(policy=pol, max_running=6, prefill_chunk=160,
                                                                 check_invariants=True))
        res = eng.generate(prompts, SamplingParams(max_new_tokens=NEW))
        out[pol] = (res, eng.metrics(), eng)
    return out


@pytest.mark.slow
def test_policies_produce_identical_tokens_equal_to_generate(model, prompts, runs):
    ref = generate(model, prompts, NEW)  # batched: one compile (== one by one, which test_parity checks)
    for pol, (res, _, _) in runs.items():
        assert res == ref, pol


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["offload", "hisparse"])
def test_whole_prompt_prefill_gives_the_same_tokens(model, prompts, runs, policy):
    eng = Engine(model, cache_for(policy, model), EngineConfig(policy=policy, max_running=6, prefill="whole",
                                                                check_invariants=True))
    res = eng.generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert res == runs[policy][0]
    assert eng.metrics().preemptions == 0


@pytest.mark.slow
def test_hisparse_runs_more_requests_without_preemption(runs):
    h, o = runs["hisparse"][1], runs["offload"][1]
    assert h.preemptions == 0 and h.swaps == 0
    assert h.mean_running > o.mean_running
    assert h.evicted_pages > 0 and h.misses > 0


@pytest.mark.slow
def test_the_fake_engine_schedules_as_the_engine(model, prompts, runs):
    """`FakeEngine` (the engine with its model call replaced, no eos: lengths do not depend on the tokens) steps
    through the same schedule as the real engine under each policy: per step the same rows, bucket, indexer pages,
    admissions, preemptions and swaps."""
    from hisparse_jax.engine.fake_compute import FakeEngine

    def schedule(history):
        return [(m.running, m.admitted, m.waiting, m.preemptions, m.swaps_out, m.swaps_in, m.prefill_tokens,
                 m.tokens, m.bucket, m.scored_pages, m.swap_out_pages, m.swap_in_pages) for m in history]

    for pol, (_, metrics, eng) in runs.items():
        fake = FakeEngine(model.cfg, cache_for(pol, model), eng.config)
        fake.generate(prompts, SamplingParams(max_new_tokens=NEW))
        assert schedule(fake.history) == schedule(metrics.history), pol
        assert any(m.waiting for m in metrics.history)  # (under pressure: the device holds three of the six)


@pytest.mark.slow
def test_pools_empty_after_the_run(runs):
    for pol, (_, _, eng) in runs.items():
        assert all(eng.manager.pool.num_used(t) == 0 for t in Tier), pol
        check_manager(eng.manager)


@pytest.mark.slow
def test_aborts_mid_prefill_and_mid_decode_leave_no_leak(model, prompts):
    eng = Engine(model, cache_for("hisparse", model), EngineConfig(policy="hisparse", max_running=6,
                                                                   prefill_chunk=64, check_invariants=True))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW))
    eng.step()  # r0 is prefilling (600 tokens, 64 per step)
    assert eng.requests["r0"].state is RequestState.PREFILLING
    eng.abort("r0")
    while eng.requests["r1"].state is not RequestState.RUNNING:
        eng.step()
    eng.step()
    eng.abort("r1")  # mid-decode
    eng.abort("r5")  # still waiting
    eng.run()
    assert eng.requests["r0"].state is RequestState.ABORTED and eng.requests["r1"].state is RequestState.ABORTED
    assert all(len(eng.requests[f"r{i}"].output) == NEW for i in (2, 3, 4))
    assert all(eng.manager.pool.num_used(t) == 0 for t in Tier)


@pytest.mark.slow
def test_metrics_and_log(model, prompts, tmp_path):
    log = tmp_path / "m.jsonl"
    eng = Engine(model, cache_for("hisparse", model), EngineConfig(policy="hisparse", max_running=6,
                                                                   log_path=str(log)))
    eng.generate(prompts[:2], SamplingParams(max_new_tokens=4))
    eng.close()
    m = eng.metrics()
    assert {"mean_running", "max_running", "preemptions", "swaps", "tokens_per_s", "hit_rate", "h2d_bytes",
            "d2h_bytes", "history"} <= set(m.to_json())
    assert m.tokens == 8
    reqs = list(eng.requests.values())  # steps from arrival to the first / last token
    assert m.mean_ttft_steps == np.mean([r.first_token_step - r.arrival for r in reqs])
    assert m.mean_latency_steps == np.mean([r.finished_at - r.arrival for r in reqs]) >= m.mean_ttft_steps + 3
    lines = log.read_text().splitlines()
    assert len(lines) == m.steps


def test_bad_input(model):
    eng = Engine(model, cache_for("hisparse", model), EngineConfig(policy="hisparse", max_running=2))
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("a", [])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        eng.add_request("b", [1] * 4090, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="out of range"):
        eng.add_request("c", [1, 500])
    with pytest.raises(BudgetError):
        eng.add_request("d", [1] * 1000)  # longer than the store's max_seq_len
    with pytest.raises(ValueError, match="unknown policy"):
        EngineConfig(policy="lru")
    small = CacheConfig(kv_dtype="float32", device_pages=4, index_pages=8, host_pages=64, max_seq_len=384)
    with pytest.raises(BudgetError, match="offload"):
        Engine(model, small, EngineConfig(policy="offload", max_running=2)).add_request("e", [1] * 300)
    eng.add_request("ok", [1, 2, 3])
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("ok", [1, 2, 3])


@pytest.mark.slow
def test_full_host_pool_makes_requests_wait(model, prompts):
    """A host pool that holds one request at a time: the others wait, nothing fails, outputs unchanged."""
    cc = cache_for("hisparse", model).replace(host_pages=11)
    eng = Engine(model, cc, EngineConfig(policy="hisparse", max_running=6, check_invariants=True))
    res = eng.generate(prompts[:3], SamplingParams(max_new_tokens=8))
    assert max(m.admitted for m in eng.history) == 1
    assert res == generate(model, prompts[:3], 8)


@pytest.mark.slow
def test_demo_cli_json(capsys, tmp_path):
    """`hisparse demo --json` prints one JSON object with the per-policy figures (tiny options)."""
    import json

    from hisparse_jax.cli import main

    rc = main(["demo", "--json", "--requests", "4", "--prompt-len", "320", "--new-tokens", "6",
               "--device-requests", "1.5", "--plot", str(tmp_path / "p.png")])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == {"preempt", "offload", "hisparse"}
    for r in out["policies"].values():
        for k in ("mean_running", "max_running", "preemptions", "tokens_per_s", "hit_rate", "h2d_bytes"):
            assert k in r
    assert out["outputs_identical"] is True
    assert (tmp_path / "p.png").exists()
    assert main(["demo", "--policies", "lru"]) == 2
