"""Typed results: `generate`'s stats, `Engine.step()` and `Engine.metrics()` are frozen dataclasses, read by
attribute, that convert to JSON with `to_json()`."""

from __future__ import annotations

import dataclasses
import json

import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.engine import Engine, EngineConfig, SamplingParams
from hisparse_jax.engine.scheduler import WAIT_REASONS
from hisparse_jax.generate import generate
from hisparse_jax.results import EngineMetrics, GenerateStats, StepMetrics
from tiny import BIG, model_cfg


@pytest.fixture(scope="module")
def model():
    return hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(2))


def test_generate_stats(model):
    prompts = [[(3 * i + 7 * j * j) % 97 for j in range(n)] for i, n in enumerate((260, 140))]
    toks, stats = generate(model, prompts, 12, cache=BIG.replace(device_pages=7), return_stats=True)
    assert isinstance(stats, GenerateStats)
    assert stats.steps == 11 and stats.misses > 0
    assert sum(stats.per_layer["misses"]) == stats.misses
    back = json.loads(json.dumps(stats.to_json()))
    assert set(back) == {f.name for f in dataclasses.fields(GenerateStats)}
    assert back == dataclasses.asdict(stats) and back["hits"] == stats.hits
    with pytest.raises(TypeError):  # not a dict: fields are attributes
        stats["steps"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.steps = 0


@pytest.mark.slow
def test_engine_step_and_metrics(model, tmp_path):
    log = tmp_path / "steps.jsonl"
    eng = Engine(model, CacheConfig(kv_dtype="float32", device_pages=12, host_pages=40, max_seq_len=256),
                 EngineConfig(max_running=4, log_path=str(log)))
    for i, n in enumerate((130, 70, 100)):
        eng.add_request(f"r{i}", [(i + j) % 97 for j in range(n)], SamplingParams(max_new_tokens=8))
    first = eng.step()
    assert isinstance(first, StepMetrics) and first.step == 0
    eng.run()
    eng.close()
    m = eng.metrics()
    assert isinstance(m, EngineMetrics) and all(isinstance(h, StepMetrics) for h in m.history)
    assert m.tokens == 24 and m.steps == len(m.history) == eng.step_count
    assert m.resident == sum(h.resident for h in m.history) > 0  # the rows the hit rate leaves out
    assert m.mean_running == pytest.approx(sum(h.running for h in m.history if h.running) /
                                           sum(1 for h in m.history if h.running))
    # 3 requests, max_running 4, 12 device pages: the first steps have requests waiting, each with its reason
    assert sum(m.wait_reasons.values()) == sum(sum(h.wait_reasons.values()) for h in m.history) > 0
    assert set(m.wait_reasons) <= set(WAIT_REASONS)
    data = json.loads(json.dumps(m.to_json()))
    assert data["history"][0] == first.to_json() and data["policy"] == "hisparse"
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert logged == data["history"]
