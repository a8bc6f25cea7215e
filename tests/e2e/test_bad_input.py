"""Bad input never gives a wrong answer: configs, saved tiered stores and params, sampling parameters, requests, and a
failure inside an engine step (checkpoint files: test_checkpoint_files.py; the CLI: test_cli_errors.py)."""

from __future__ import annotations

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax import integrity
from hisparse_jax.config import CacheConfig, RopeConfig
from hisparse_jax.engine import Engine, EngineConfig, RequestState, SamplingParams
from hisparse_jax.engine.engine import UnknownRequest
from hisparse_jax.generate import generate, validate_prompts
from hisparse_jax.hf_config import from_hf_config, to_hf_config
from hisparse_jax.integrity import CheckpointError
from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv.manager import PageManager
from hisparse_jax.kv.persist import load_tiered, save_tiered
from hisparse_jax.kv.spec import BudgetError
from hisparse_jax.model.weights import restore_params, save_params
from tiny import model_cfg


@pytest.fixture(scope="module")
def model():
    return hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------------------------------------
# configs: values that would make NaN, or are of the wrong type, are refused naming the field
# ----------------------------------------------------------------------------------------------------------

def hf_config(**change):
    d = to_hf_config(model_cfg())
    d.update(change)
    return d


@pytest.mark.parametrize("change, words", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 0,
                           "original_max_position_embeddings": 64}), "factor must be > 0, got 0"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": "4",
                           "original_max_position_embeddings": 64}), "factor must be a number, got '4'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": float("nan")}), "theta must be finite"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4,
                           "original_max_position_embeddings": 0}), "original_max_position_embeddings must be >= 1"),
    (dict(rope_parameters=[1, 2]), "rope_parameters must be an object"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps must be > 0, got -1e-06"),
    (dict(rms_norm_eps=0), "rms_norm_eps must be > 0"),
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps must be a number"),
    (dict(routed_scaling_factor=float("inf")), "routed_scaling_factor must be finite"),
    (dict(eos_token_id="</s>"), "eos_token_id must be a token id or a list of token ids, got '</s>'"),
    (dict(eos_token_id=[1, "x"]), r"eos_token_id\[1\] must be an integer"),
    (dict(eos_token_id=-2), "eos_token_id must be >= 0"),
    (dict(hidden_size="48"), "hidden_size must be an integer, got '48'"),
    (dict(hidden_size=48.0), "hidden_size must be an integer, got 48.0"),
    (dict(vocab_size=97.5), "vocab_size must be an integer"),
    (dict(num_attention_heads=True), "num_attention_heads must be an integer, got True"),
    (dict(num_hidden_layers="4"), "num_hidden_layers must be an integer, got '4'"),
    (dict(index_topk=0), "index_topk must be >= 1, got 0"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
    (dict(bos_token_id=-1), "bos_token_id must be >= 0"),
])
def test_bad_config_json_values_are_refused_naming_the_field(change, words):
    with pytest.raises(ValueError) as e:
        from_hf_config(hf_config(**change))
    assert re.search(words, str(e.value)), str(e.value)


@pytest.mark.parametrize("text, words", [
    ("null", "must hold a JSON object .*, got NoneType"),
    ("[1, 2]", "must hold a JSON object .*, got list"),
    ('{"model_type": "glm_moe_dsa", "vocab_size": 97, "vocab_size": 98}', "gives 'vocab_size' twice"),
    ('{"model_type": ', "is not valid JSON"),
])
def test_config_json_that_is_no_object_or_repeats_a_key_is_refused(tmp_path, text, words):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=words):
        from_hf_config(tmp_path)


def test_eos_ids_the_model_never_samples_are_refused(model):
    vocab = model.cfg.vocab_size
    with pytest.raises(ValueError, match=rf"eos_token_id has ids outside the vocabulary \[0, {vocab}\): \[{vocab}\]"):
        generate(model, [[1, 2, 3]], 2, eos_token_id=[5, vocab])
    eng = Engine(model, CacheConfig(kv_dtype="float32", device_pages=8, host_pages=8, max_seq_len=256))
    with pytest.raises(ValueError, match=r"request 'a': eos_token_id has ids outside the vocabulary"):
        eng.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=2, eos_token_id=10**9))
    assert not eng.requests


def test_an_export_that_is_neither_an_export_nor_a_path_is_refused(model):
    eng = Engine(model, CacheConfig(kv_dtype="float32", device_pages=8, host_pages=8, max_seq_len=256))
    with pytest.raises(ValueError, match="export must be a pd.PrefillExport or the path of one, got NoneType"):
        eng.import_request("x", None)
    from hisparse_jax import checkpoints
    with pytest.raises(ValueError, match="shipped checkpoint's name .* or a checkpoint folder, got NoneType"):
        checkpoints.resolve(None)


def test_unknown_letter_in_index_topk_pattern():
    d = hf_config(index_topk_pattern="FSXS")
    del d["indexer_types"]
    with pytest.raises(ValueError, match=r"index_topk_pattern 'FSXS' has letters other than F .* 'X'"):
        from_hf_config(d)
    d["index_topk_pattern"] = "FSFS"
    assert from_hf_config(d).indexer_types == ("full", "shared", "full", "shared")


@pytest.mark.parametrize("change, words", [
    (dict(rms_norm_eps=-1.0), "rms_norm_eps must be > 0"),
    (dict(eos_token_id="</s>"), "eos_token_id must be a token id"),
    (dict(kv_lora_rank=32.0), "kv_lora_rank must be an integer"),
    (dict(rope={"theta": 1.0}), "rope must be a RopeConfig"),
])
def test_bad_model_config_values(change, words):
    with pytest.raises(ValueError, match=words):
        model_cfg(**change)


def test_bad_rope_config():
    with pytest.raises(ValueError, match="invalid RoPE parameters: factor must be > 0, got 0.0"):
        RopeConfig(theta=1e4, rope_type="yarn", factor=0.0, original_max_position_embeddings=64)


def test_config_values_keep_their_canonical_types():
    cfg = model_cfg(eos_token_id=np.int64(5), hidden_size=np.int32(48))
    assert cfg.eos_token_id == (5,) and type(cfg.hidden_size) is int
    assert model_cfg(eos_token_id=[3, 4]).eos_token_id == (3, 4)


# ----------------------------------------------------------------------------------------------------------
# saved state: a checksum per array, dtype/shape checked against the description
# ----------------------------------------------------------------------------------------------------------

def flip_byte(directory: str, rel_from: float = 0.5) -> str:
    """Flip one bit in the middle of the largest data file under `directory` (Orbax keeps no checksums)."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs if not f.endswith(".json")]
    big = max(files, key=os.path.getsize)
    b = bytearray(open(big, "rb").read())
    b[int(len(b) * rel_from)] ^= 0x10
    open(big, "wb").write(bytes(b))
    return big


@pytest.fixture(scope="module")
def saved_tiered(tmp_path_factory, model):
    cfg = model.cfg
    tc = PageManager(cfg, CacheConfig(kv_dtype="float32", device_pages=8, host_pages=16, max_seqs=2, max_seq_len=512))
    rng = np.random.default_rng(0)
    store = kv_device.new_store(tc)
    slot = tc.admit(150)
    n = 150
    store = kv_device.write_prefill(store, tc, slot, jnp.asarray(rng.normal(size=(cfg.num_hidden_layers, n, cfg.kv_lora_rank)), jnp.float32),
                     jnp.asarray(rng.normal(size=(cfg.num_hidden_layers, n, cfg.qk_rope_head_dim)), jnp.float32),
                                    jnp.asarray(rng.normal(size=(tc.spec.num_indexer_layers, n, cfg.index_head_dim)),
                                                jnp.float32), n)
    path = str(tmp_path_factory.mktemp("saved") / "c")
    save_tiered(tc, store, path)
    return tc, store, path


def copy_of(path, tmp_path):
    import shutil

    dst = str(tmp_path / "copy")
    shutil.copytree(path, dst)
    return dst


def test_saved_tiered_round_trip_is_verified(saved_tiered, tmp_path):
    tc, store, path = saved_tiered
    back, back_store = load_tiered(copy_of(path, tmp_path))
    assert back.lengths == tc.lengths
    for a, b in zip(jax.tree.leaves(back_store), jax.tree.leaves(store)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_flipped_byte_in_a_saved_tiered_store_is_refused_naming_the_array(saved_tiered, tmp_path):
    path = copy_of(saved_tiered[2], tmp_path)
    flip_byte(os.path.join(path, "store"))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in 1 array\(s\): \w+ .*damaged") as e:
        load_tiered(path)
    assert os.path.join(path, "store") in str(e.value)


def test_edited_manager_description_is_refused(saved_tiered, tmp_path):
    path = copy_of(saved_tiered[2], tmp_path)
    fn = os.path.join(path, "manager.json")
    meta = json.load(open(fn))
    slot = next(iter(meta["lengths"]))
    meta["lengths"][slot] += 1  # a length that no longer matches the store
    json.dump(meta, open(fn, "w"))
    with pytest.raises(CheckpointError, match="manager.json: checksum mismatch .* edited or damaged"):
        load_tiered(path)


def test_store_saved_as_float32_described_as_bf16_is_refused(saved_tiered, tmp_path):
    """Even with a consistent checksum over the edited description, the arrays' saved dtypes give it away."""
    path = copy_of(saved_tiered[2], tmp_path)
    fn = os.path.join(path, "manager.json")
    meta = json.load(open(fn))
    meta["cache"]["kv_dtype"] = "bf16"
    meta.pop("meta_sha256")
    meta["meta_sha256"] = integrity.json_digest(meta)
    json.dump(meta, open(fn, "w"))
    with pytest.raises(CheckpointError, match=r"array \w+ was saved as float32\[.*\], expected bfloat16\[.*\] "
                                              r"from manager.json's configs"):
        load_tiered(path)


@pytest.mark.parametrize("damage, words", [
    (lambda fn: open(fn, "w").write("{not json"), "not readable JSON"),
    (lambda fn: open(fn, "w").write('{"format": "x"}'), "is not a saved PageManager"),
    (lambda fn: json.dump({**json.load(open(fn)), "version": 1}, open(fn + ".tmp", "w")) or os.replace(fn + ".tmp", fn),
     "format version 1"),
])
def test_unreadable_manager_description(saved_tiered, tmp_path, damage, words):
    path = copy_of(saved_tiered[2], tmp_path)
    damage(os.path.join(path, "manager.json"))
    with pytest.raises(CheckpointError, match=words):
        load_tiered(path)


def test_missing_saved_tiered_store(tmp_path):
    with pytest.raises(FileNotFoundError, match="no manager.json"):
        load_tiered(tmp_path / "nothing")


@pytest.fixture(scope="module")
def saved_params(tmp_path_factory, model):
    path = str(tmp_path_factory.mktemp("params") / "p")
    save_params(model, path)
    return path


def test_saved_params_round_trip(saved_params, model, tmp_path):
    back = restore_params(copy_of(saved_params, tmp_path), model.cfg)
    for a, b in zip(jax.tree.leaves(nnx.state(back, nnx.Param)), jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_flipped_byte_in_saved_params_is_refused_naming_the_parameter(saved_params, model, tmp_path):
    path = copy_of(saved_params, tmp_path)
    flip_byte(path)
    with pytest.raises(CheckpointError, match=r"(checksum mismatch in 1 array\(s\): |parameter )(stacks|embed_tokens|lm_head|norm)[\w.]* .*damaged"):
        restore_params(path, model.cfg)
    # Without the check the damage is silent (why it exists), unless the flipped bit broke a compressed chunk,
    # which TensorStore then cannot decode: that is refused too, naming the parameter. Where the bit lands
    # depends on the layout Orbax chose for this save.
    try:
        restore_params(path, model.cfg, verify=False)
    except CheckpointError as e:
        assert re.search(r"parameter (stacks|embed_tokens|lm_head|norm)[\w.]* could not be read", str(e)), e


def test_params_restored_for_another_config_are_refused_before_reading(saved_params, tmp_path):
    with pytest.raises(CheckpointError, match=r"array embed_tokens was saved as float32\[97, 48\], expected "
                                              r"float32\[97, 64\] from the model config"):
        restore_params(copy_of(saved_params, tmp_path), model_cfg(hidden_size=64))


def test_params_without_a_manifest(saved_params, model, tmp_path):
    path = copy_of(saved_params, tmp_path)
    os.remove(os.path.join(path, "hisparse_manifest.json"))
    with pytest.raises(CheckpointError, match="cannot be verified .* verify=False"):
        restore_params(path, model.cfg)
    restore_params(path, model.cfg, verify=False)


def test_flipped_byte_in_an_exported_checkpoint_is_refused_naming_the_tensor(model, tmp_path):
    hj.save_pretrained(model, tmp_path / "export")
    fn = str(tmp_path / "export" / "model.safetensors")
    assert np.array_equal(np.asarray(hj.load_pretrained(tmp_path / "export").embed_tokens.get_value()),
                          np.asarray(model.embed_tokens.get_value()))
    b = bytearray(open(fn, "rb").read())
    b[-5] ^= 0x01  # inside the last tensor's bytes; the header still describes the file exactly
    open(fn, "wb").write(bytes(b))
    with pytest.raises(CheckpointError, match=re.escape(fn) + r": checksum mismatch in 1 tensor\(s\): '[\w.]+' "
                                                             r"— the file is damaged"):
        hj.load_pretrained(tmp_path / "export")


@pytest.mark.parametrize("what", ["save_params", "save_tiered", "save_pretrained", "save_export"])
def test_a_write_error_names_the_destination_not_a_temporary_file(model, saved_tiered, tmp_path, what):
    """Saving where a file stands in for a folder: the error is the OS's, of its class, and names the path the
    caller gave (Orbax's said '<path>.orbax-checkpoint-tmp', a folder the caller never named)."""
    from hisparse_jax.engine.pd import export_prefill

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    dest = str(blocker / "out")
    save = {"save_params": lambda: save_params(model, dest),
            "save_tiered": lambda: save_tiered(saved_tiered[0], saved_tiered[1], dest),
            "save_pretrained": lambda: hj.save_pretrained(model, dest),
            "save_export": lambda: export_prefill(model, [1, 2, 3], dest)}[what]
    with pytest.raises(NotADirectoryError) as e:
        save()
    assert str(e.value).endswith(f"at {dest}: {blocker} is not a folder"), str(e.value)


# ----------------------------------------------------------------------------------------------------------
# sampling parameters and requests: checked at the door, nothing coerced
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, words", [
    (dict(seed=-1), "seed must be >= 0, got -1"),
    (dict(seed=2 ** 40), "seed must be <= 4294967295"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(temperature=math.nan), "temperature must be finite"),
    (dict(temperature=math.inf), "temperature must be finite"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=math.nan), "top_p must be finite"),
    (dict(top_p=0.0), "top_p must be > 0"),
    (dict(top_p=1.5), "top_p must be <= 1"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=3.0), "max_new_tokens must be an integer, got 3.0"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer, got True"),
    (dict(eos_token_id="</s>"), "eos_token_id must be a token id or a list"),
    (dict(eos_token_id=[1.0]), r"eos_token_id\[0\] must be an integer"),
])
def test_bad_sampling_params(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


def test_sampling_params_accept_one_eos_id():
    assert SamplingParams(eos_token_id=1).eos_token_id == (1,)
    assert SamplingParams(eos_token_id=np.int64(3), seed=np.uint32(7)).eos_token_id == (3,)


@pytest.mark.parametrize("prompt, words", [
    ([3.7, 4], "token 0 must be an integer token id, got 3.7"),
    ([1, True], "token 1 must be an integer token id, got True"),
    ([[1, 2], [3, 4]], "token 0 must be an integer token id, got a sequence"),
    (np.array([[1, 2]]), r"must be a 1-D sequence of token ids, got shape \(1, 2\)"),
    (np.array([1.0, 2.0]), "must hold integer token ids, got float64"),
    ("hello", "must be a 1-D sequence of token ids, got str"),
    ([], "is empty"),
    ([5, 97], r"out of range \[0, 97\): \[97\]"),
])
def test_bad_prompts_are_refused_by_generate_and_the_engine(model, prompt, words):
    with pytest.raises(ValueError, match=words):
        generate(model, [[1, 2], prompt], 2)
    eng = Engine(model, CacheConfig(kv_dtype="float32", device_pages=8, host_pages=8, max_seq_len=256))
    with pytest.raises(ValueError, match=words):
        eng.add_request("r", prompt, SamplingParams(max_new_tokens=2))
    assert not eng.requests and not eng.scheduler.waiting


def test_prompts_may_be_integer_arrays(model):
    assert validate_prompts(model, [np.array([3, 4]), (5,), jnp.array([6, 7], jnp.int32)], 1) == [[3, 4], [5], [6, 7]]


@pytest.mark.parametrize("kw, words", [
    (dict(temperature=math.nan, key=jax.random.key(0)), "temperature must be finite"),
    (dict(top_p=math.nan), "top_p must be finite"),
    (dict(eos_token_id="</s>"), "eos_token_id must be a token id"),
])
def test_generate_refuses_bad_sampling(model, kw, words):
    with pytest.raises(ValueError, match=words):
        generate(model, [[1, 2]], 2, **kw)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
        generate(model, [[1, 2]], 2.0)


def test_engine_refuses_bad_request_ids_and_params(model):
    eng = Engine(model, CacheConfig(kv_dtype="float32", device_pages=8, host_pages=8, max_seq_len=256))
    with pytest.raises(ValueError, match="request_id must be a non-empty string, got 3"):
        eng.add_request(3, [1, 2])
    with pytest.raises(ValueError, match="params must be SamplingParams, got dict"):
        eng.add_request("a", [1, 2], {"max_new_tokens": 2})
    with pytest.raises(UnknownRequest, match=r"no request 'nope' in this engine \(known: none\)"):
        eng.abort("nope")
    assert isinstance(UnknownRequest("x"), KeyError)


def test_tiered_generate_without_host_pages_is_refused_up_front(model):
    with pytest.raises(BudgetError, match=r"host_pages is too small: .* host_pages is 0, \d+ short"):
        generate(model, [list(range(90))], 4, cache=CacheConfig(kv_dtype="float32", device_pages=8, host_pages=0,
                                                                 max_seq_len=256))


@pytest.mark.slow
def test_preempt_without_host_pages_runs_like_generate(model):
    """preempt never offloads, so a cache with no host pages is a configuration every check accepts; its store
    still has the host pools the step's miss path reads (one physical page, never lent). It used to fail every
    step (a gather from an empty host axis), and with it every later request."""
    prompts = [[(3 * i + j) % 97 for j in range(n)] for i, n in enumerate((300, 100))]
    eng = Engine(model, CacheConfig(kv_dtype="float32", device_pages=16, host_pages=0, max_seq_len=512),
                 EngineConfig(policy="preempt", check_invariants=True))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=4))
    eng.run()
    assert [eng.requests[f"r{i}"].output for i in range(2)] == generate(model, prompts, 4)
    assert eng.manager.pool.num_used("device") == 0 and eng.metrics().failed == 0


# ----------------------------------------------------------------------------------------------------------
# a failure inside a step: the failing request fails, the others go on; the batch is all-or-nothing
# ----------------------------------------------------------------------------------------------------------

PROMPTS = [[(7 * i + j) % 97 for j in range(n)] for i, n in enumerate((70, 130, 100))]
NEW = 6


@pytest.fixture(scope="module")
def reference(model):
    return generate(model, PROMPTS, NEW)


def engine(model, **over):
    kw = dict(policy="hisparse", max_running=4, prefill_chunk=96, check_invariants=True)
    kw.update(over)
    return Engine(model, CacheConfig(kv_dtype="float32", device_pages=24, host_pages=24, max_seq_len=256),
                  EngineConfig(**kw))


def add_all(eng, eos=()):
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW, eos_token_id=eos))


@pytest.mark.slow
def test_int_eos_token_id_runs(model, reference):
    eng = engine(model)
    eos = reference[1][2]
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW, eos_token_id=eos))
    eng.run()
    for i, ref in enumerate(reference):
        out = eng.requests[f"r{i}"].output
        assert out == ref[:ref.index(eos) + 1] if eos in ref else out == ref


@pytest.mark.slow
def test_bad_seed_in_one_request_the_others_complete_like_generate(model, reference):
    """seed=-1 is refused at the door; one that slips past it (here: forced into the frozen params) fails only its
    own request, inside the step, and the other requests finish with generate's tokens."""
    with pytest.raises(ValueError, match="seed must be >= 0"):
        SamplingParams(max_new_tokens=NEW, seed=-1)
    eng = engine(model)
    add_all(eng)
    object.__setattr__(eng.requests["r1"].params, "seed", -1)
    eng.run()
    bad = eng.requests["r1"]
    assert bad.state is RequestState.FAILED and "OverflowError" in bad.error and "-1" in bad.error
    assert eng.requests["r0"].output == reference[0] and eng.requests["r2"].output == reference[2]
    assert eng.metrics().failed == 1
    assert eng.manager.pool.num_used("device") == 0 and not eng.manager.requests


@pytest.mark.slow
@pytest.mark.parametrize("prefill", ["whole", "chunked"])
def test_a_failing_prefill_fails_only_its_request(model, reference, monkeypatch, prefill):
    eng = engine(model, prefill=prefill)
    add_all(eng)
    if prefill == "whole":
        real = Engine._prefill_whole

        def prefill_whole(self, r):
            if r.request_id == "r2":
                raise RuntimeError("injected prefill fault")
            return real(self, r)

        monkeypatch.setattr(Engine, "_prefill_whole", prefill_whole)
    else:
        real = Engine._sampling_row

        def sampling_row(r):
            if r.request_id == "r2":
                raise RuntimeError("injected prefill fault")
            return real(r)

        monkeypatch.setattr(Engine, "_sampling_row", staticmethod(sampling_row))
    eng.run()
    assert eng.requests["r2"].state is RequestState.FAILED and "injected prefill fault" in eng.requests["r2"].error
    assert [eng.requests[f"r{i}"].output for i in (0, 1)] == reference[:2]


@pytest.mark.slow  # an engine scenario over the programs the unmarked tests prove (CI: first leg)
def test_a_failed_batch_commits_nothing_and_the_engine_goes_on(model, reference, monkeypatch):
    eng = engine(model)
    add_all(eng)
    real, calls = eng.runner.step, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected device fault")
        return real(*a, **k)

    monkeypatch.setattr(eng.runner, "step", flaky)
    for _ in range(2):
        eng.step()
    before = ({k: list(r.output) for k, r in eng.requests.items()}, dict(eng.manager.lengths),
              {k: r.computed for k, r in eng.requests.items()})
    with pytest.raises(RuntimeError, match="injected device fault"):
        eng.step()
    assert before == ({k: list(r.output) for k, r in eng.requests.items()}, dict(eng.manager.lengths),
                      {k: r.computed for k, r in eng.requests.items()})
    kv_device.check_tables(eng.store, eng.manager)
    eng.run()
    assert [eng.requests[f"r{i}"].output for i in range(3)] == reference


def test_a_batch_that_consumed_the_store_stops_the_engine(model, monkeypatch):
    eng = engine(model)
    add_all(eng)

    def consume(spec, store, *a, **k):
        for x in jax.tree.leaves(store):
            x.delete()
        raise RuntimeError("injected failure after donation")

    monkeypatch.setattr(eng.runner, "step", consume)
    with pytest.raises(RuntimeError, match="after donation"):
        eng.step()
    with pytest.raises(RuntimeError, match="consumed the KV store"):
        eng.step()
