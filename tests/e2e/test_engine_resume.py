"""An engine saved between steps resumes in a fresh process with the uninterrupted run's tokens (`engine.snapshot`):
float32 HiSparse with misses and evictions, bf16 KV with host-tier keys (bounded by the box, and by "rvq" codes: the
codebooks travel with the store), fp8 KV with int4 host-tier keys, and offload with a request swapped out at the
save. Each is saved mid-run with requests in every state (prefilling in chunks, running, waiting in the queue,
sampled at temperature > 0), continued here, and restored and run to the end in one subprocess. Plus the refusals: a
MeshEngine, a changed model, an edited description, a store restored under other limits than its engine's."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.engine import Engine, EngineConfig, SamplingParams
from hisparse_jax.engine.request import RequestState
from hisparse_jax.engine.snapshot import load_engine, save_engine
from hisparse_jax.index_codebooks import fit_index_codebooks
from hisparse_jax.integrity import CheckpointError
from hisparse_jax.kv.persist import load_tiered
from limit_harness import fresh_process
from tiny import model_cfg

# HiSparse under pressure (tests/e2e/test_engine.py's budget at four requests): three decode while the fourth waits and
# one is mid-prompt at the save; the continuation evicts and misses. Offload under vLLM's admission
# (tests/e2e/test_admission.py's budget): the save comes when a request is swapped out.
HISPARSE = CacheConfig(kv_dtype="float32", device_pages=29, index_pages=44, host_pages=96, max_seqs=4,
                       max_seq_len=704)
OFFLOAD = CacheConfig(kv_dtype="float32", device_pages=12, index_pages=12, host_pages=64, max_seqs=4, max_seq_len=320)
_rng = np.random.default_rng(11)
LONG = [_rng.integers(0, 97, n).tolist() for n in (600, 560, 500, 580)]
SHORT = [_rng.integers(0, 97, 130).tolist() for _ in range(3)]
SAMPLED = dict(temperature=0.8, top_p=0.9)
# name -> (model config overrides, CacheConfig, EngineConfig, prompts, new tokens)
RUNS = {
    "float32-hisparse": ({}, HISPARSE, EngineConfig(max_running=4), LONG, 12),
    "bf16-host-keys": ({}, HISPARSE.replace(kv_dtype="bf16", index_tier="host"), EngineConfig(max_running=4), LONG,
                       12),
    "bf16-rvq-host-keys": ({}, HISPARSE.replace(kv_dtype="bf16", index_tier="host", index_summary="rvq"),
                           EngineConfig(max_running=4), LONG, 12),
    "fp8-int4-host-keys": ({"kv_lora_rank": 128, "index_head_dim": 128},
                           HISPARSE.replace(kv_dtype="fp8", index_dtype="int4", index_tier="host"),
                           EngineConfig(max_running=4), LONG, 12),
    "float32-offload": ({}, OFFLOAD, EngineConfig(policy="offload", max_running=4), SHORT, 130),
}
SAVE_AFTER = 7  # HiSparse: steps before the save; offload saves after the first step that swaps a request out


def build(name):
    """The run's model (seeded: the same weights in every process) and its configs."""
    over, cc, ec, _, _ = RUNS[name]
    return hj.SparseMLAModel(model_cfg(**over), rngs=nnx.Rngs(0)), cc, ec


def started(name) -> Engine:
    model, cc, ec = build(name)
    # "rvq" codebooks fitted here only: the restored store carries them
    books = fit_index_codebooks(model, np.asarray(SHORT)) if cc.index_summary == "rvq" else None
    eng = Engine(model, cc, ec, index_codebooks=books)
    _, _, _, prompts, new = RUNS[name]
    for i, p in enumerate(prompts):  # every other request sampled (its draws follow (seed, position))
        eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=new, seed=i, **(SAMPLED if i % 2 else {})))
    return eng


def resume_all(path) -> dict:
    """In a fresh process: each saved engine, restored and run to the end; {name: (outputs, misses after)}."""
    out = {}
    for name in RUNS:
        model, _, _ = build(name)
        eng = load_engine(os.path.join(path, name), model)
        before = len(eng.history)
        eng.run()
        out[name] = [eng.outputs(), sum(m.misses for m in eng.history[before:])]
    return out


@pytest.mark.slow
def test_an_engine_resumes_in_a_fresh_process(tmp_path):
    want, states = {}, {}
    for name in RUNS:
        eng = started(name)
        while eng.has_unfinished():
            eng.step()
            swapped = any(r.state is RequestState.SWAPPED for r in eng.requests.values())
            if swapped if eng.config.policy == "offload" else eng.step_count >= SAVE_AFTER:
                break
        states[name] = sorted(r.state.value for r in eng.requests.values())
        save_engine(eng, tmp_path / name)
        before = len(eng.history)
        eng.run()
        want[name] = [eng.outputs(), sum(m.misses for m in eng.history[before:])]
    # the saves caught requests mid-prompt, decoding and queued; offload's caught one swapped out
    for name in ("float32-hisparse", "bf16-host-keys", "bf16-rvq-host-keys", "fp8-int4-host-keys"):
        assert "waiting" in states[name] and "prefilling" in states[name], states
    assert "swapped" in states["float32-offload"], states
    assert all(want[name][1] > 0 for name in RUNS if name != "float32-offload"), want  # the continuations miss
    got = fresh_process("test_engine_resume", f"resume_all({str(tmp_path)!r})")
    for name in RUNS:
        assert got[name] == want[name], name


def test_refusals(tmp_path):
    eng = started("float32-hisparse")
    eng.step()
    save_engine(eng, tmp_path / "e")
    with pytest.raises(FileExistsError, match="already holds"):  # a second save into the same folder
        save_engine(eng, tmp_path / "e")
    other = hj.SparseMLAModel(model_cfg(index_topk=8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="index_topk"):
        load_engine(tmp_path / "e", other)
    fn = tmp_path / "e" / "engine.json"
    meta = json.loads(fn.read_text())
    meta["step_count"] += 1
    fn.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="checksum"):
        load_engine(tmp_path / "e", build("float32-hisparse")[0])
    with pytest.raises(FileNotFoundError, match="no saved engine"):
        load_engine(tmp_path / "nothing", other)
    with pytest.raises(TypeError, match="one-device Engine"):
        save_engine(object(), tmp_path / "x")
    model, cc, ec = build("float32-hisparse")  # a store restored under other limits than its engine's
    manager, store = load_tiered(tmp_path / "e" / "store")
    with pytest.raises(ValueError, match="not made for this CacheConfig and EngineConfig"):
        Engine(model, cc.replace(host_pages=cc.host_pages + 1), ec, restored=(manager, store))
    with pytest.raises(ValueError, match="not made for this CacheConfig and EngineConfig"):
        Engine(model, cc, dataclasses.replace(ec, policy="offload"), restored=(manager, store))
