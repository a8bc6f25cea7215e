"""The runner: the model split once, one jitted decode-and-sample call per step, one device→host read per step,
one compile per batch bucket."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.engine import Engine, EngineConfig, SamplingParams, runner as runner_mod
from hisparse_jax.engine.sampling import prompt_seeds
from hisparse_jax.generate import generate
from tiny import model_cfg

PROMPTS = [[(5 * i + 3 * j) % 97 for j in range(n)] for i, n in enumerate((90, 150, 70, 120, 60))]
NEW = 10


@pytest.fixture(scope="module")
def model():
    return hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(1))


CACHE = CacheConfig(kv_dtype="float32", device_pages=40, host_pages=40, max_seq_len=256)


def make_engine(model, **over):
    kw = dict(policy="hisparse", max_running=8, prefill="whole")
    kw.update(over)
    return Engine(model, CACHE, EngineConfig(**kw))


def test_model_split_once_per_runner(model, monkeypatch):
    calls = []
    real = nnx.split
    # splits of the whole model (the scan over layers splits each run's stacked layer while tracing: not counted)
    monkeypatch.setattr(runner_mod.nnx, "split",
                        lambda *a, **k: (isinstance(a[0], hj.SparseMLAModel) and calls.append(1)) or real(*a, **k))
    eng = make_engine(model)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW))
    eng.run()
    assert len(calls) == 1 and eng.step_count >= NEW  # every split of the run: the runner's one


@pytest.mark.parametrize("coldness", ["oldest", "recency"])
def test_one_device_to_host_read_per_decode_step(model, monkeypatch, coldness):
    """Steady decode steps: no implicit device→host transfer anywhere in the step (the guard raises on one), and
    exactly one explicit read, the runner's (tokens and counters together; with "recency" coldness the page
    stamps the host's release order needs come back in the same read)."""
    eng = make_engine(model, coldness=coldness)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW))
    eng.step()  # admissions and whole-prompt prefills (their first tokens are read there)
    eng.step()  # the first decode step compiles
    reads = []
    real = jax.device_get
    monkeypatch.setattr(runner_mod.jax, "device_get", lambda x: reads.append(1) or real(x))
    steps = 0
    with jax.transfer_guard_device_to_host("disallow"):
        while eng.has_unfinished():
            before = len(reads)
            m = eng.step()
            assert m.running > 0 and len(reads) - before == 1, m
            steps += 1
    assert steps >= NEW - 3


@pytest.mark.slow
def test_compiles_per_run_equal_the_batch_buckets_used():
    """Sampling runs inside the step: a run compiles the step once per bucket it uses (batch rows x indexer pages,
    both powers of two), and no sampler or logits gather of its own during decoding."""
    fresh = hj.SparseMLAModel(model_cfg(index_topk=24), rngs=nnx.Rngs(2))  # nothing compiled for it yet
    eng = make_engine(fresh, min_bucket=2, prefill="chunked", prefill_chunk=64)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW, seed=i, temperature=0.7 if i % 2 else 0.0))
    before = dict(runner_mod.COUNTS)
    buckets = set()
    while eng.has_unfinished():
        m = eng.step()
        if m.running or m.prefill_tokens:
            buckets.add((m.bucket, m.scored_pages))
    compiled = runner_mod.COUNTS["step"] - before.get("step", 0)
    assert compiled == len(buckets), (compiled, buckets)
    assert runner_mod.COUNTS["sampler"] == before.get("sampler", 0)  # chunked prefill: no separate sampler


@pytest.mark.slow  # an engine scenario over the programs the unmarked tests prove (CI: first leg)
def test_sampled_generate_equals_the_engine_at_each_prompts_seed(model):
    """One sampler: generate's prompt i draws its tokens with the seed `prompt_seeds(key, n)[i]` at the engine's
    positions, so its tokens are the Engine's for that prompt and seed, batched with others or alone."""
    kw = dict(temperature=0.9, top_p=0.8)
    key = jax.random.key(3)
    tokens = generate(model, PROMPTS, NEW, cache=CACHE, key=key, **kw)
    assert tokens != generate(model, PROMPTS, NEW, cache=CACHE)  # sampled, not greedy
    seeds = prompt_seeds(key, len(PROMPTS))
    assert prompt_seeds(key, 2) == seeds[:2] and len(set(seeds)) == len(seeds)
    eng = make_engine(model)
    for i, (p, s) in enumerate(zip(PROMPTS, seeds)):
        eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW, seed=s, **kw))
    eng.run()
    assert [eng.outputs()[f"r{i}"] for i in range(len(PROMPTS))] == tokens
    # alone: prompt 0 in its own generate call (its seed is the same), prompt 3 alone in an engine
    assert generate(model, PROMPTS[:1], NEW, cache=CACHE, key=key, **kw) == tokens[:1]
    alone = make_engine(model)
    assert alone.generate([PROMPTS[3]], SamplingParams(max_new_tokens=NEW, seed=seeds[3], **kw)) == [tokens[3]]


def test_engine_tokens_equal_generate(model):
    eng = make_engine(model)
    assert eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW)) == generate(model, PROMPTS, NEW)
    assert np.all([m.compiled is False for m in eng.history[-3:]])
