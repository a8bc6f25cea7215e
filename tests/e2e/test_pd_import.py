"""Prefill / decode disaggregation: a request exported by a prefill run and imported by a decode engine decodes
exactly the tokens of a locally prefilled one — landing resident or in the host tier, under every policy and
with prefix caching — with the bytes accounted, and a damaged or mismatched export is refused."""

from __future__ import annotations

import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.engine import Engine, EngineConfig, SamplingParams
from hisparse_jax.engine.pd import IMPORT_CHUNK, export_prefill, load_export
from hisparse_jax.generate import generate
from hisparse_jax.integrity import CheckpointError
from tiny import BIG, model_cfg

NEW = 10
SHORT = [(3 * j + 1) % 97 for j in range(90)]
LONG = [(7 * j * j + 2) % 97 for j in range(IMPORT_CHUNK + 300)]  # two staging chunks


@pytest.fixture(scope="module")
def model():
    return hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(4))


@pytest.fixture(scope="module")
def exports(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("pd")
    return {name: (export_prefill(model, p, d / f"{name}.safetensors"), str(d / f"{name}.safetensors"))
            for name, p in (("short", SHORT), ("long", LONG))}


@pytest.fixture(scope="module")
def want(model):
    return generate(model, [SHORT, LONG], NEW)


def engine(model, policy, device_pages, **kw):
    cc = BIG.replace(device_pages=device_pages, host_pages=64, max_seq_len=2048)
    return Engine(model, cc, EngineConfig(**{"policy": policy, "max_running": 4, "prefill": "whole",
                                             "check_invariants": True, **kw}))


@pytest.mark.slow
def test_import_lands_in_the_host_tier_and_decodes_the_local_tokens(model, exports, want):
    eng = engine(model, "hisparse", 16)
    eng.import_request("long", exports["long"][1], SamplingParams(max_new_tokens=NEW))
    eng.step()  # admission + import: 22 pages of KV into 16 device pages
    slot = eng.requests["long"].slot
    assert eng.manager.requests[slot].host_only_pages()  # older pages went straight to the host tier
    eng.run()
    assert eng.outputs()["long"] == want[1]
    m = eng.metrics()
    assert m.misses > 0 and m.import_bytes == exports["long"][0].nbytes
    assert m.d2h_bytes >= len(LONG) * eng.manager.spec.num_layers * eng.manager.spec.row_bytes  # every row mirrored


@pytest.mark.slow
def test_a_chunked_engine_imports_a_prompt_larger_than_its_device(model, exports, want):
    """Found by the fuzzer (pd case 144 of seed 2026): a chunked HiSparse engine refused an import whose prompt
    has more pages than the device, by the rule for prompts written through the store (resident meanwhile). An
    import arrives whole (its older pages land in the host tier) and HiSparse never preempts: it runs. The same
    prompt prefilled locally is still refused."""
    from hisparse_jax.kv.spec import BudgetError

    eng = engine(model, "hisparse", 16, prefill="chunked")
    eng.import_request("long", exports["long"][1], SamplingParams(max_new_tokens=NEW))
    with pytest.raises(BudgetError, match="written through the store and must be resident"):
        eng.add_request("local", LONG, SamplingParams(max_new_tokens=NEW))
    eng.run()
    assert eng.outputs()["long"] == want[1] and eng.metrics().misses > 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["preempt", "offload", "hisparse"])
def test_imported_and_local_requests_agree_under_every_policy(model, exports, want, policy):
    eng = engine(model, policy, 40)
    eng.import_request("short", exports["short"][0], SamplingParams(max_new_tokens=NEW))  # the object itself
    eng.import_request("long", exports["long"][1], SamplingParams(max_new_tokens=NEW))
    eng.run()
    assert [eng.outputs()["short"], eng.outputs()["long"]] == want
    local = engine(model, policy, 40)
    local.add_request("short", SHORT, SamplingParams(max_new_tokens=NEW))
    local.add_request("long", LONG, SamplingParams(max_new_tokens=NEW))
    local.run()
    assert local.outputs() == eng.outputs() and local.metrics().import_bytes == 0


@pytest.mark.slow
def test_an_import_feeds_the_prefix_cache(model, exports, want):
    eng = engine(model, "hisparse", 40)
    eng.import_request("long", exports["long"][1], SamplingParams(max_new_tokens=NEW))
    eng.run()
    follow = LONG[:640] + [5, 6, 7]
    eng.add_request("follow", follow, SamplingParams(max_new_tokens=NEW))
    eng.run()
    assert eng.requests["follow"].cached_tokens == 640
    assert eng.outputs()["follow"] == generate(model, [follow], NEW)[0]


def _flip(path):
    b = bytearray(open(path, "rb").read())
    b[-100] ^= 0x01
    open(path, "wb").write(bytes(b))


def test_damaged_or_mismatched_exports_are_refused(model, exports, tmp_path):
    import shutil

    good = exports["short"][1]
    bad = str(tmp_path / "bad.safetensors")
    shutil.copy(good, bad)
    _flip(bad)
    eng = engine(model, "hisparse", 40)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        eng.import_request("x", bad)
    from dataclasses import replace

    other = replace(model.cfg, rms_norm_eps=model.cfg.rms_norm_eps * 2)
    with pytest.raises(CheckpointError, match="different config .*rms_norm_eps"):
        load_export(good, other)
    with pytest.raises(CheckpointError, match="not a prefill export"):
        hj.save_pretrained(model, tmp_path / "ckpt")
        load_export(tmp_path / "ckpt" / "model.safetensors", model.cfg)
    with pytest.raises(FileNotFoundError):
        load_export(tmp_path / "missing.safetensors", model.cfg)
    ex = exports["short"][0]
    with pytest.raises(ValueError, match="does not fit this model"):
        eng.import_request("y", replace(ex, rope=ex.rope[:, :-1]))
    assert not eng.requests  # nothing was queued by a refused import
