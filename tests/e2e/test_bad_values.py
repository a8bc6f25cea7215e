"""Bad values in well-formed bytes: a checkpoint or a prefill export whose files read cleanly (valid header, matching
checksums) but whose values mean nothing is refused naming the tensor, never loaded.

1. `load_pretrained`: a weight stored with an integer or bool dtype (an F32 weight's bytes declared as I32 would load
   reinterpreted, |w| ~ 1e9), an FP8 block scale that is not floating or holds NaN / Inf (NaN weights).
2. P/D exports: one check (`pd.check_export`, also run by `load_export`) for objects and files alike — integer KV
   rows, NaN / Inf in the KV rows or `last_logits`, tokens not int32 or outside the vocabulary, an export made by a
   model of another config (or carrying none).

No jitted code runs: checkpoints are read by `load_pretrained`, exports built by hand and checked directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import hisparse_jax as hj
from hisparse_jax import integrity
from hisparse_jax.engine import pd
from hisparse_jax.integrity import CheckpointError
from hisparse_jax.model.safetensors_io import CHECKSUM_KEY, read_checkpoint_tensors
from hisparse_jax.model.weights import dequantize_fp8, model_to_hf_tensors, quantize_fp8
from tiny import model_cfg

# ----------------------------------------------------------------------------------------------------------
# 1. checkpoints
# ----------------------------------------------------------------------------------------------------------

Q_A = "model.layers.0.self_attn.q_a_proj.weight"  # [40, 48]: one FP8 block
WQ_B = "model.layers.0.self_attn.indexer.wq_b.weight"  # [512, 40]: four FP8 blocks
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"  # read through the per-expert path
NORM = "model.layers.2.input_layernorm.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model, folder written by save_pretrained, its tensors as arrays)."""
    model = hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(0))
    d = tmp_path_factory.mktemp("ckpt")
    hj.save_pretrained(model, d)
    return model, str(d), {k: np.array(v) for k, v in read_checkpoint_tensors(str(d)).items()}


def rewrite(src: str, dst, tensors: dict) -> str:
    """A checkpoint folder holding `tensors` with src's config.json, written as save_pretrained writes (a checksum
    per tensor), so the file is consistent and reads back cleanly: only the values are wrong."""
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    meta = {"format": "pt", CHECKSUM_KEY: json.dumps({n: integrity.digest(t) for n, t in tensors.items()})}
    save_file({n: np.ascontiguousarray(t) for n, t in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata=meta)
    got = read_checkpoint_tensors(str(dst))  # header and checksums pass: the bytes are consistent
    assert {n: t.dtype for n, t in got.items()} == {n: t.dtype for n, t in tensors.items()}
    return str(dst)


def fp8(tensors: dict, *names: str) -> dict:
    out = dict(tensors)
    for n in names:
        out[n], out[n + "_scale_inv"] = quantize_fp8(tensors[n])
    return out


def refused(folder, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as e:
        hj.load_pretrained(folder)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


def test_integer_and_bool_weights_are_refused_naming_tensor_and_dtypes(saved, tmp_path):
    _, src, t = saved
    bad = dict(t)
    bad[Q_A] = t[Q_A].view(np.int32)  # the same bytes, declared I32: would load as |w| ~ 1e9
    bad[EXPERT] = t[EXPERT].view(np.int32)
    bad[NORM] = t[NORM] > 0
    msg = refused(rewrite(src, tmp_path / "c", bad), "3 tensor(s) with a non-floating dtype",
                  f"{Q_A}: stored as int32, but the model expects a floating weight (float32)",
                  f"{EXPERT}: stored as int32", f"{NORM}: stored as bool")
    assert "does not match its config" in msg


def test_valid_fp8_checkpoint_still_loads(saved, tmp_path):
    _, src, t = saved
    q = fp8(t, Q_A, WQ_B)
    model = hj.load_pretrained(rewrite(src, tmp_path / "c", q))
    got = model_to_hf_tensors(model)
    for n in (Q_A, WQ_B):
        np.testing.assert_array_equal(got[n], dequantize_fp8(q[n], q[n + "_scale_inv"]))


def test_non_finite_fp8_block_scales_are_refused_with_their_count(saved, tmp_path):
    _, src, t = saved
    q = fp8(t, Q_A, WQ_B)
    assert q[WQ_B + "_scale_inv"].shape == (4, 1)
    q[WQ_B + "_scale_inv"] = q[WQ_B + "_scale_inv"].copy()
    q[WQ_B + "_scale_inv"][[1, 3], 0] = [np.nan, np.inf]
    q[Q_A + "_scale_inv"] = np.full_like(q[Q_A + "_scale_inv"], np.nan)
    msg = refused(rewrite(src, tmp_path / "c", q), "2 non-finite FP8 scale tensor(s)",
                  f"{WQ_B}_scale_inv: 2 of 4 FP8 block scale(s) are not finite",
                  f"{Q_A}_scale_inv: 1 of 1 FP8 block scale(s) are not finite")
    assert "holds unusable values" in msg


@pytest.mark.parametrize("dtype", [np.int32, np.uint8])
def test_non_floating_fp8_block_scale_is_refused(saved, tmp_path, dtype):
    _, src, t = saved
    q = fp8(t, WQ_B)
    q[WQ_B + "_scale_inv"] = np.ones((4, 1), dtype)  # would dequantize as scale 1.0
    refused(rewrite(src, tmp_path / "c", q), f"{WQ_B}_scale_inv: FP8 block scale stored as {np.dtype(dtype).name}")


# ----------------------------------------------------------------------------------------------------------
# 2. prefill / decode exports
# ----------------------------------------------------------------------------------------------------------

CFG = model_cfg()
T = 5


def good_export(cfg=CFG) -> pd.PrefillExport:
    rng = np.random.default_rng(0)
    s = pd._shapes(cfg, T)
    arrays = {n: rng.standard_normal(s[n]).astype(np.float32) for n in ("latent", "rope", "index_k", "last_logits")}
    return pd.PrefillExport(tuple(range(3, 3 + T)), arrays["latent"], arrays["rope"], arrays["index_k"],
                            arrays["last_logits"], pd.export_config(cfg))


def write_export(path, tokens, arrays: dict, config: dict) -> str:
    """An export file as `save_export` writes it, but with the tensors as given (any dtype): the file is
    consistent (checksums match), only the values are wrong."""
    tensors = {"tokens": np.asarray(tokens), **{n: np.ascontiguousarray(a) for n, a in arrays.items()}}
    meta = {pd.META_KEY: json.dumps({"format": pd.FORMAT, "version": pd.VERSION, "model": config}),
            CHECKSUM_KEY: json.dumps({n: integrity.digest(t) for n, t in tensors.items()})}
    save_file(tensors, str(path), metadata=meta)
    return str(path)


def both_refuse(ex: pd.PrefillExport, tmp_path, *fragments: str, tokens=None) -> None:
    """The object is refused by check_export and the same export written to a file by load_export, both naming
    every fragment."""
    with pytest.raises(CheckpointError) as e:
        pd.check_export(ex, CFG)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))
    arrays = {n: getattr(ex, n) for n in ("latent", "rope", "index_k", "last_logits")}
    tokens = np.asarray(ex.tokens, np.int32) if tokens is None else tokens  # as save_export writes them
    fn = write_export(tmp_path / "ex.safetensors", tokens, arrays,
                      ex.config if isinstance(ex.config, dict) else pd.export_config(ex.config))
    with pytest.raises(CheckpointError) as e:
        pd.load_export(fn, CFG)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))
    assert str(e.value).startswith(fn)


def test_a_good_export_passes_both_paths_and_keeps_its_config(tmp_path):
    ex = good_export()
    pd.check_export(ex, CFG)
    pd.save_export(ex, CFG, tmp_path / "ok.safetensors")
    back = pd.load_export(tmp_path / "ok.safetensors", CFG)
    assert back.tokens == ex.tokens and back.config == pd.export_config(CFG)
    np.testing.assert_array_equal(back.latent, ex.latent)
    pd.check_export(back, CFG)


@pytest.mark.parametrize("kind", [np.int32, np.int8])
def test_integer_kv_rows_are_refused(tmp_path, kind):
    ex = good_export()
    ex = dataclasses.replace(ex, latent=(ex.latent * 100).astype(kind))  # would be truncated silently
    both_refuse(ex, tmp_path, "KV tensors must share one floating dtype", np.dtype(kind).name)


@pytest.mark.parametrize("name,value,at", [("latent", np.nan, (2, 4, 7)), ("rope", np.inf, (0, 1, 3)),
                                           ("index_k", -np.inf, (1, 0, 0)), ("last_logits", np.nan, (42,))])
def test_non_finite_values_are_refused_naming_the_tensor(tmp_path, name, value, at):
    ex = good_export()
    a = getattr(ex, name).copy()
    a[at] = value
    both_refuse(dataclasses.replace(ex, **{name: a}), tmp_path, f"tensor {name!r} holds 1 non-finite value(s)",
                f"first at index {list(at)}")


def test_non_finite_bfloat16_rows_are_refused(tmp_path):
    import ml_dtypes

    ex = good_export()
    kv = {n: getattr(ex, n).astype(ml_dtypes.bfloat16) for n in ("latent", "rope", "index_k")}
    pd.check_export(dataclasses.replace(ex, **kv), CFG)  # bf16 rows are fine
    kv["rope"][3, 2, 1] = np.nan
    both_refuse(dataclasses.replace(ex, **kv), tmp_path, "tensor 'rope' holds 1 non-finite", "[3, 2, 1]")


def test_tokens_must_be_int32_ids_in_the_vocabulary(tmp_path):
    ex = good_export()
    wide = np.asarray(ex.tokens, np.int64)
    with pytest.raises(CheckpointError, match="tokens must be int32"):
        pd.check_export(dataclasses.replace(ex, tokens=wide), CFG)
    fn = write_export(tmp_path / "wide.safetensors", wide, {n: getattr(ex, n) for n in
                                                            ("latent", "rope", "index_k", "last_logits")}, ex.config)
    with pytest.raises(CheckpointError, match="tokens must be int32"):
        pd.load_export(fn, CFG)
    out = (1, 2, CFG.vocab_size, 4, 5)
    both_refuse(dataclasses.replace(ex, tokens=out), tmp_path, "out of range [0, 97)", str(CFG.vocab_size),
                tokens=np.asarray(out, np.int32))
    with pytest.raises(CheckpointError, match="token 2 must be an integer"):
        pd.check_export(dataclasses.replace(ex, tokens=(1, 2, 3.0, 4, 5)), CFG)
    with pytest.raises(CheckpointError, match="token 0 must be an integer"):
        pd.check_export(dataclasses.replace(ex, tokens=(True, 2, 3, 4, 5)), CFG)


def test_an_export_of_another_model_config_is_refused_by_both_paths(tmp_path):
    other = dataclasses.replace(CFG, rms_norm_eps=CFG.rms_norm_eps * 2)  # same shapes, other model
    ex = good_export(other)
    both_refuse(ex, tmp_path, "exported by a model with a different config (differing: rms_norm_eps)")
    with pytest.raises(CheckpointError, match="differing: rms_norm_eps"):  # a ModelConfig in the field works too
        pd.check_export(dataclasses.replace(ex, config=other), CFG)
    with pytest.raises(CheckpointError, match="carries no model config"):
        pd.check_export(dataclasses.replace(ex, config=None), CFG)
    with pytest.raises(ValueError, match="config of another model"):  # nor written under the wrong config
        pd.save_export(ex, CFG, tmp_path / "mislabelled.safetensors")


def test_the_engine_import_path_uses_the_same_check():
    from hisparse_jax.engine import Engine, EngineConfig
    from tiny import BIG

    eng = Engine(hj.SparseMLAModel(CFG, rngs=nnx.Rngs(0)), BIG, EngineConfig(policy="hisparse", prefill="whole"))
    ex = good_export()
    lat = ex.latent.copy()
    lat[0, 0, 0] = np.nan
    with pytest.raises(CheckpointError, match="tensor 'latent' holds 1 non-finite"):
        eng.import_request("nan", dataclasses.replace(ex, latent=lat))
    with pytest.raises(CheckpointError, match="KV tensors must share one floating dtype"):
        eng.import_request("int", dataclasses.replace(ex, latent=ex.latent.astype(np.int32)))
    assert not eng.requests
