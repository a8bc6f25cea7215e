"""Checkpoint I/O: Hugging Face safetensors <-> SparseMLAModel, FP8 block dequantization, Orbax.

Everything is CPU / float32 / tiny: the models are tests/tiny.py's, at its DEEPSEEK_MICRO / HF_MICRO sizes.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import hisparse_jax
from hisparse_jax import ModelConfig, RopeConfig, SparseMLAModel
from hisparse_jax.hf_config import from_hf_config
from hisparse_jax.model.weights import (FP8_BLOCK, dequantize_fp8, model_to_hf_tensors, quantize_fp8,
                                        read_checkpoint_tensors)
from tiny import DEEPSEEK_MICRO, HF_MICRO, hf_model, model_cfg

F8 = ml_dtypes.float8_e4m3fn


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------

def build_hf_model(arch: str, seed: int = 0):
    """A tiny random transformers model of HF_MICRO's size: 'deepseek_v32' (YaRN, group routing) or
    'glm_moe_dsa' (shared layers). Returns (its class, the model)."""
    if arch == "deepseek_v32":
        model = hf_model("deepseek", seed, **HF_MICRO, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    else:
        model = hf_model("glm", seed, **HF_MICRO)
        assert list(model.config.indexer_types) == ["full", "shared", "full"]
    return type(model), model


def random_model(cfg: ModelConfig, seed: int = 0, **model_kwargs) -> SparseMLAModel:
    """A model with random numpy-drawn parameters (norms included), built without eager jax.random per shape."""
    model = nnx.eval_shape(lambda: SparseMLAModel(cfg, rngs=nnx.Rngs(0), **model_kwargs))
    rng = np.random.default_rng(seed)
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    for p, v in flat.items():
        sds = v.get_value()
        flat[p] = v.replace(jnp.asarray((0.05 * rng.standard_normal(sds.shape)).astype(np.float32), sds.dtype))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids):
    return nnx.merge(graphdef, state)(ids)


def logits_of(model, ids) -> np.ndarray:
    """Jitted full forward; models with the same structure share one compilation (numpy leaves)."""
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(graphdef, jax.tree.map(np.asarray, state), jnp.asarray(ids)))


def params_of(model) -> dict[str, np.ndarray]:
    """Every nnx.Param of the model as numpy, keyed by its dotted path."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(str(k) for k in path): np.asarray(var[...]) for path, var in flat}


def assert_same_params(a, b):
    pa, pb = params_of(a), params_of(b)
    assert sorted(pa) == sorted(pb)
    for k in pa:
        assert pa[k].dtype == pb[k].dtype, k
        assert pa[k].shape == pb[k].shape, k
        assert np.array_equal(pa[k], pb[k]), k


def shapes(tensors) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in tensors.items()}


def copy_tensors(path) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as in-memory arrays (not memmaps, so the files may be rewritten)."""
    return {k: np.array(v) for k, v in read_checkpoint_tensors(path).items()}


def write_checkpoint(dst, config_src, tensors: dict, files: int = 1) -> str:
    """A checkpoint directory: config.json copied from `config_src`, `tensors` in `files` shards (no index)."""
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(config_src, "config.json"), os.path.join(dst, "config.json"))
    names = sorted(tensors)
    for k in range(files):
        part = {n: np.ascontiguousarray(tensors[n]) for n in names[k::files]}
        save_file(part, os.path.join(dst, f"part-{k}.safetensors"), metadata={"format": "pt"})
    return str(dst)


def ids_for(cfg, B=2, T=10, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)


# ----------------------------------------------------------------------------------------------------------
# 1. round trip through transformers' checkpoints
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def hf_ckpt(request, tmp_path_factory):
    """(arch, transformers class, torch model, its saved directory, our model loaded from it)."""
    cls, torch_model = build_hf_model(request.param)
    path = str(tmp_path_factory.mktemp(request.param))
    torch_model.save_pretrained(path)
    ours = hisparse_jax.load_pretrained(path, dtype=jnp.float32)
    return request.param, cls, torch_model, path, ours


def test_load_reads_config(hf_ckpt):
    arch, _, torch_model, _, ours = hf_ckpt
    cfg = ours.cfg
    hc = torch_model.config
    assert cfg.model_type == arch and cfg.dtype == "float32" and ours.dtype == jnp.float32
    assert cfg.num_hidden_layers == hc.num_hidden_layers and cfg.hidden_size == hc.hidden_size
    assert cfg.mlp_layer_types == tuple(hc.mlp_layer_types) == ("dense", "sparse", "sparse")
    if arch == "glm_moe_dsa":
        assert cfg.indexer_types == ("full", "shared", "full") and cfg.indexer_rope_interleaved
        assert ours.layer(1).self_attn.indexer is None
    else:
        assert cfg.indexer_types == ("full",) * 3 and cfg.rope.rope_type == "yarn"


def test_save_load_round_trip_is_exact(hf_ckpt, tmp_path):
    _, _, _, _, ours = hf_ckpt
    out = tmp_path / "ours"
    hisparse_jax.save_pretrained(ours, out)
    again = hisparse_jax.load_pretrained(out, dtype=jnp.float32)
    assert again.cfg == ours.cfg
    assert_same_params(ours, again)
    # the config.json we write is read back to the same config, and loads to the same model without dtype=
    assert from_hf_config(out) == ours.cfg
    assert_same_params(ours, hisparse_jax.load_pretrained(out))


def test_saved_tensor_names_and_shapes_match_transformers(hf_ckpt, tmp_path):
    _, _, _, hf_dir, ours = hf_ckpt
    out = tmp_path / "ours"
    hisparse_jax.save_pretrained(ours, out)
    theirs, mine = read_checkpoint_tensors(hf_dir), read_checkpoint_tensors(str(out))
    assert shapes(mine) == shapes(theirs)
    for name, t in theirs.items():  # and the values are the very same numbers
        assert mine[name].dtype == t.dtype, name
        assert np.array_equal(mine[name], t), name
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_transformers_loads_our_checkpoint(hf_ckpt, tmp_path):
    torch = pytest.importorskip("torch")
    _, cls, torch_model, _, ours = hf_ckpt
    out = tmp_path / "ours"
    hisparse_jax.save_pretrained(ours, out)
    reloaded = cls.from_pretrained(out).eval()
    assert reloaded.config.model_type == torch_model.config.model_type
    assert list(reloaded.config.mlp_layer_types) == list(torch_model.config.mlp_layer_types)
    if hasattr(torch_model.config, "indexer_types"):
        assert list(reloaded.config.indexer_types) == list(torch_model.config.indexer_types)
    assert dict(reloaded.config.rope_parameters) == dict(torch_model.config.rope_parameters)
    ids = torch.randint(0, torch_model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = torch_model(ids).logits, reloaded(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cfg", [
    model_cfg(DEEPSEEK_MICRO, tie_word_embeddings=True, eos_token_id=(1, 2), bos_token_id=None,
              rope=RopeConfig(theta=5e4, rope_type="yarn", factor=8.0, original_max_position_embeddings=16,
                              beta_fast=16.0, beta_slow=2.0, mscale=0.707, mscale_all_dim=1.0, attention_factor=1.1)),
    model_cfg(DEEPSEEK_MICRO, model_type="glm_moe_dsa", num_hidden_layers=4,
              mlp_layer_types=("dense", "sparse", "dense", "sparse"),
              indexer_types=("full", "shared", "shared", "full"), n_group=1, topk_group=1, n_shared_experts=0,
              indexer_rope_interleaved=True, norm_topk_prob=False, routed_scaling_factor=1.5, rms_norm_eps=1e-5),
], ids=["deepseek-tied-yarn", "glm-shared"])
def test_round_trip_of_our_own_models(cfg, tmp_path):
    """Configs transformers' tiny defaults do not reach: tied embeddings, several EOS ids, full YaRN parameters,
    an irregular dense/sparse and full/shared pattern, no shared expert."""
    model = random_model(cfg, 1)
    hisparse_jax.save_pretrained(model, tmp_path)
    names = set(read_checkpoint_tensors(str(tmp_path)))
    assert ("lm_head.weight" in names) == (not cfg.tie_word_embeddings)
    for i, t in enumerate(cfg.indexer_types):
        assert (f"model.layers.{i}.self_attn.indexer.wk.weight" in names) == (t == "full")
    again = hisparse_jax.load_pretrained(tmp_path)
    assert again.cfg == cfg
    assert_same_params(model, again)


def test_round_trip_keeps_yarn_truncate(tmp_path):
    cfg = model_cfg(DEEPSEEK_MICRO, rope=RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                                    mscale=1.0, mscale_all_dim=1.0, truncate=False))
    hisparse_jax.save_pretrained(random_model(cfg), tmp_path)
    assert from_hf_config(tmp_path).rope == cfg.rope


def test_bfloat16_round_trip(tmp_path):
    """Default dtype bf16: the checkpoint stores BF16 (router / indexer weights_proj stay F32) and reloads exactly."""
    cfg = model_cfg(DEEPSEEK_MICRO, dtype="bfloat16")
    model = random_model(cfg)
    hisparse_jax.save_pretrained(model, tmp_path)
    t = read_checkpoint_tensors(str(tmp_path))
    assert t["model.layers.0.self_attn.q_a_proj.weight"].dtype == ml_dtypes.bfloat16
    assert t["model.layers.1.mlp.gate.weight"].dtype == np.float32
    assert t["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == np.float32
    again = hisparse_jax.load_pretrained(tmp_path)
    assert again.dtype == jnp.bfloat16 and again.cfg == cfg
    assert_same_params(model, again)


# ----------------------------------------------------------------------------------------------------------
# 2. sharded checkpoints
# ----------------------------------------------------------------------------------------------------------

def test_sharded_checkpoint(hf_ckpt, tmp_path):
    arch, cls, torch_model, hf_dir, ours = hf_ckpt
    full = tmp_path / "full"
    hisparse_jax.save_pretrained(ours, full)
    total = os.path.getsize(full / "model.safetensors")
    d = tmp_path / "sharded"
    hisparse_jax.save_pretrained(ours, d, max_shard_bytes=8 * 1024)
    shards = sorted(glob.glob(str(d / "*.safetensors")))
    assert len(shards) >= 3, total
    assert not (d / "model.safetensors").exists()
    n = len(shards)
    assert [os.path.basename(s) for s in shards] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    with open(d / "model.safetensors.index.json") as f:
        index = json.load(f)
    tensors = read_checkpoint_tensors(str(d))
    assert set(index["weight_map"]) == set(tensors) == set(read_checkpoint_tensors(str(full)))
    assert set(index["weight_map"].values()) == {os.path.basename(s) for s in shards}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for s in shards:  # every shard holds exactly the tensors the index says, and stays within the limit
        part = load_file(s)
        assert {k for k, v in index["weight_map"].items() if v == os.path.basename(s)} == set(part)
        if len(part) > 1:
            assert sum(v.nbytes for v in part.values()) <= 8 * 1024
    again = hisparse_jax.load_pretrained(d, dtype=jnp.float32)
    assert again.cfg == ours.cfg
    assert_same_params(ours, again)
    if arch == "deepseek_v32":  # transformers reads the sharded layout too
        torch = pytest.importorskip("torch")
        ids = torch.arange(10)[None] % torch_model.config.vocab_size
        with torch.no_grad():
            assert torch.allclose(cls.from_pretrained(d)(ids).logits, torch_model(ids).logits, atol=1e-5, rtol=0)


def test_resharding_into_the_same_directory(tmp_path):
    """Saving a sharded checkpoint over a single-file one (and back) leaves one consistent checkpoint."""
    model = random_model(model_cfg(DEEPSEEK_MICRO))
    hisparse_jax.save_pretrained(model, tmp_path)
    hisparse_jax.save_pretrained(model, tmp_path, max_shard_bytes=8 * 1024)
    assert not (tmp_path / "model.safetensors").exists()
    assert_same_params(model, hisparse_jax.load_pretrained(tmp_path))


def test_unsharded_save_over_sharded_directory(tmp_path):
    model = random_model(model_cfg(DEEPSEEK_MICRO))
    hisparse_jax.save_pretrained(model, tmp_path, max_shard_bytes=8 * 1024)
    hisparse_jax.save_pretrained(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert_same_params(model, hisparse_jax.load_pretrained(tmp_path))


# ----------------------------------------------------------------------------------------------------------
# 3. fused expert layout
# ----------------------------------------------------------------------------------------------------------

def fuse_experts(tensors: dict, cfg: ModelConfig) -> dict:
    """Per-expert gate/up/down [F, D] / [D, F] -> transformers' fused gate_up_proj [E, 2F, D], down_proj [E, D, F]."""
    out = dict(tensors)
    E = cfg.n_routed_experts
    for i, kind in enumerate(cfg.mlp_layer_types):
        if kind != "sparse":
            continue
        p = f"model.layers.{i}.mlp.experts"
        gate = [out.pop(f"{p}.{j}.gate_proj.weight") for j in range(E)]
        up = [out.pop(f"{p}.{j}.up_proj.weight") for j in range(E)]
        down = [out.pop(f"{p}.{j}.down_proj.weight") for j in range(E)]
        out[f"{p}.gate_up_proj"] = np.stack([np.concatenate([g, u], 0) for g, u in zip(gate, up)])
        out[f"{p}.down_proj"] = np.stack(down)
    return out


def test_fused_expert_layout_loads_the_same(hf_ckpt, tmp_path):
    _, _, _, hf_dir, ours = hf_ckpt
    cfg = ours.cfg
    fused = fuse_experts(copy_tensors(hf_dir), cfg)
    F, D, E = cfg.moe_intermediate_size, cfg.hidden_size, cfg.n_routed_experts
    assert fused["model.layers.1.mlp.experts.gate_up_proj"].shape == (E, 2 * F, D)
    assert fused["model.layers.1.mlp.experts.down_proj"].shape == (E, D, F)
    assert not any(".experts.0." in k for k in fused)
    d = write_checkpoint(tmp_path / "fused", hf_dir, fused, files=2)
    assert_same_params(ours, hisparse_jax.load_pretrained(d, dtype=jnp.float32))


def test_fused_expert_halves_are_gate_then_up(tmp_path):
    """gate_up_proj[e, :F] is the gate, [F:] the up projection: hand-made values, checked element-wise."""
    cfg = model_cfg(DEEPSEEK_MICRO)
    src = tmp_path / "src"
    hisparse_jax.save_pretrained(random_model(cfg), src)
    E, F, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    t = fuse_experts(copy_tensors(str(src)), cfg)
    e, f, dd = np.meshgrid(np.arange(E), np.arange(2 * F), np.arange(D), indexing="ij")
    t["model.layers.1.mlp.experts.gate_up_proj"] = (1000 * e + f + dd / 100).astype(np.float32)
    e, dd, f = np.meshgrid(np.arange(E), np.arange(D), np.arange(F), indexing="ij")
    t["model.layers.1.mlp.experts.down_proj"] = -(1000 * e + dd + f / 100).astype(np.float32)
    m = hisparse_jax.load_pretrained(write_checkpoint(tmp_path / "fused", src, t))
    ex = m.layer(1).mlp.experts
    gate, up, down = np.asarray(ex.gate[...]), np.asarray(ex.up[...]), np.asarray(ex.down[...])
    assert gate.shape == up.shape == (E, D, F) and down.shape == (E, F, D)
    for j, fi, di in [(0, 0, 0), (3, F - 1, D - 1), (2, 5, 17)]:
        assert gate[j, di, fi] == np.float32(1000 * j + fi + di / 100)
        assert up[j, di, fi] == np.float32(1000 * j + F + fi + di / 100)
        assert down[j, fi, di] == np.float32(-(1000 * j + di + fi / 100))


# ----------------------------------------------------------------------------------------------------------
# 4. FP8 block-quantized checkpoints
# ----------------------------------------------------------------------------------------------------------

def test_dequantize_fp8_by_hand_rows():
    """130 x 3: two row blocks (128 rows, then a partial block of 2), one partial column block."""
    w = np.ones((130, 3), np.float32)
    w[0, 0], w[127, 2], w[128, 1], w[129, 2] = 0.5, -3.0, 1.5, -2.0
    s = np.array([[2.0], [0.25]], np.float32)
    want = np.full((130, 3), 2.0, np.float32)
    want[128:] = 0.25
    want[0, 0], want[127, 2], want[128, 1], want[129, 2] = 1.0, -6.0, 0.375, -0.5
    got = dequantize_fp8(w.astype(F8), s)
    assert got.dtype == np.float32 and got.shape == (130, 3)
    np.testing.assert_array_equal(got, want)


def test_dequantize_fp8_by_hand_columns_and_corners():
    """3 x 130 (column blocks) and 130 x 130 (four blocks, three of them partial)."""
    q = np.ones((3, 130), np.float32).astype(F8)
    got = dequantize_fp8(q, np.array([[3.0, -1.0]], np.float32))
    want = np.ones((3, 130), np.float32) * 3.0
    want[:, 128:] = -1.0
    np.testing.assert_array_equal(got, want)

    q = np.full((130, 130), 2.0, np.float32).astype(F8)
    got = dequantize_fp8(q, np.array([[1.0, 2.0], [4.0, 8.0]], np.float32))
    assert got[0, 0] == got[127, 127] == 2.0
    assert got[0, 128] == got[127, 129] == 4.0
    assert got[128, 0] == got[129, 127] == 8.0
    assert got[128, 128] == got[129, 129] == 16.0
    assert np.unique(got).tolist() == [2.0, 4.0, 8.0, 16.0]


def test_dequantize_fp8_small_block_exhaustive():
    """block=2 on a 5 x 3 matrix: scale[i // 2, j // 2] for every element, written out by hand."""
    vals = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [13, 14, 15]], np.float32)  # exact in e4m3
    s = np.array([[1, 10], [100, 1000], [0.5, 0.25]], np.float32)
    want = np.array([[1, 2, 30], [4, 5, 60], [700, 800, 9000], [1000, 1100, 12000], [6.5, 7, 3.75]], np.float32)
    np.testing.assert_array_equal(dequantize_fp8(vals.astype(F8), s, block=2), want)


def test_quantize_fp8_blocks():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(300, 130)).astype(np.float32)
    w[256:, 128:] *= 1000.0  # the corner block (44 x 2) gets its own large scale
    q, s = quantize_fp8(w)
    assert q.dtype == F8 and q.shape == w.shape
    assert s.dtype == np.float32 and s.shape == (3, 2)
    # each block's largest |value| maps to the top of the e4m3 range, 448
    qf = q.astype(np.float32)
    for bi in range(3):
        for bj in range(2):
            blk = np.s_[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            assert np.abs(qf[blk]).max() == 448.0
            np.testing.assert_allclose(s[bi, bj], np.abs(w[blk]).max() / 448.0, rtol=1e-6)
    assert s[2, 1] > 100 * s[0, 0]
    deq = dequantize_fp8(q, s)
    assert np.all(np.abs(deq - w) <= 2.0 ** -4 * np.abs(w) + 2.0 ** -9 * np.repeat(np.repeat(s, 128, 0), 128, 1)[
        :300, :130] + 1e-6)


def fp8_names(tensors) -> list[str]:
    """The projection matrices a released FP8 checkpoint stores in e4m3 (not norms, embeddings, lm_head, router,
    the indexer's float32 weights_proj)."""
    out = []
    for name, t in tensors.items():
        if t.ndim != 2 or not name.endswith(".weight") or not name.startswith("model.layers."):
            continue
        if name.endswith(("mlp.gate.weight", "weights_proj.weight")) or "norm" in name:
            continue
        out.append(name)
    return sorted(out)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    """(float32 original tensors, fp8 checkpoint dir, {name: (q, scale_inv)}) for a model with hidden 160."""
    cfg = model_cfg(DEEPSEEK_MICRO, hidden_size=160, intermediate_size=136, moe_intermediate_size=128,
                    q_lora_rank=136, num_attention_heads=2)
    model = random_model(cfg)
    orig = {k: np.array(v) for k, v in model_to_hf_tensors(model).items()}
    rng = np.random.default_rng(0)
    quant = {}
    for name in fp8_names(orig):
        o, i = orig[name].shape
        # very different magnitudes per 128 x 128 block, so a block mapped to the wrong scale cannot pass
        f = np.exp2(rng.integers(-6, 7, size=(-(-o // 128), -(-i // 128)))).astype(np.float32)
        orig[name] = orig[name] * np.repeat(np.repeat(f, 128, 0), 128, 1)[:o, :i]
        quant[name] = quantize_fp8(orig[name])
    shapes_seen = {orig[n].shape for n in quant}
    assert any(o > 128 and i > 128 and (o % 128 and i % 128) for o, i in shapes_seen)  # partial blocks both ways
    assert any(o % 128 == 0 or i % 128 == 0 for o, i in shapes_seen)  # and whole blocks
    assert any(o < 128 for o, i in shapes_seen)  # and a single partial row block
    src = tmp_path_factory.mktemp("fp8src")
    hisparse_jax.save_pretrained(model, src)
    ckpt = {k: v for k, v in orig.items() if k not in quant}
    for name, (q, s) in quant.items():
        ckpt[name], ckpt[name + "_scale_inv"] = q, s
    d = write_checkpoint(tmp_path_factory.mktemp("fp8"), src, ckpt, files=2)
    return orig, d, quant


def test_fp8_checkpoint_is_stored_as_e4m3(fp8_ckpt):
    orig, d, quant = fp8_ckpt
    t = read_checkpoint_tensors(d)
    for name, (q, s) in quant.items():
        assert t[name].dtype == F8 and t[name + "_scale_inv"].dtype == np.float32
        assert t[name + "_scale_inv"].shape == (-(-q.shape[0] // 128), -(-q.shape[1] // 128))
        assert np.array_equal(t[name].view(np.uint8), q.view(np.uint8))


def test_fp8_checkpoint_dequantizes_exactly(fp8_ckpt):
    orig, d, quant = fp8_ckpt
    model = hisparse_jax.load_pretrained(d, dtype=jnp.float32)
    got = model_to_hf_tensors(model)
    assert set(got) == set(orig)
    for name, want in orig.items():
        if name in quant:
            q, s = quant[name]
            deq = dequantize_fp8(q, s)
            assert np.array_equal(got[name], deq), name
            scale = np.repeat(np.repeat(s, FP8_BLOCK, 0), FP8_BLOCK, 1)[:q.shape[0], :q.shape[1]]
            err = np.abs(got[name] - want)
            assert np.all(err <= 2.0 ** -4 * np.abs(want) + 2.0 ** -9 * scale + 1e-12), name
            assert err.max() > 0, name  # it really was quantized
        else:  # unquantized tensors pass through untouched
            assert np.array_equal(got[name], want), name


def test_fp8_checkpoint_equals_dequantized_float32_checkpoint(fp8_ckpt, tmp_path):
    orig, d, quant = fp8_ckpt
    deq = {k: v for k, v in orig.items()}
    for name, (q, s) in quant.items():
        deq[name] = dequantize_fp8(q, s)
    ref = hisparse_jax.load_pretrained(write_checkpoint(tmp_path, d, deq), dtype=jnp.float32)
    fp8 = hisparse_jax.load_pretrained(d, dtype=jnp.float32)
    assert_same_params(ref, fp8)


# ----------------------------------------------------------------------------------------------------------
# 5. Orbax
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [model_cfg(DEEPSEEK_MICRO),
                                 model_cfg(DEEPSEEK_MICRO, dtype="bfloat16", model_type="glm_moe_dsa", n_group=1,
                                           indexer_types=("full", "shared"), tie_word_embeddings=True)],
                         ids=["deepseek-f32", "glm-bf16-tied"])
def test_orbax_save_restore(cfg, tmp_path):
    model = random_model(cfg, 7)
    path = tmp_path / "ckpt"
    hisparse_jax.save_params(model, path)
    restored = hisparse_jax.restore_params(path, model.cfg)
    assert isinstance(restored, SparseMLAModel) and restored.cfg == cfg and restored.dtype == model.dtype
    assert_same_params(model, restored)
    ids = ids_for(cfg, T=8)
    assert np.array_equal(logits_of(model, ids), logits_of(restored, ids))


def test_orbax_restore_passes_model_options(tmp_path):
    model = random_model(model_cfg(DEEPSEEK_MICRO), 3, moe_impl="dense")
    hisparse_jax.save_params(model, tmp_path / "ckpt")
    restored = hisparse_jax.restore_params(str(tmp_path / "ckpt"), model.cfg, moe_impl="dense")
    assert restored.moe_impl == "dense"
    assert_same_params(model, restored)


# ----------------------------------------------------------------------------------------------------------
# 6. MTP layer tensors are ignored
# ----------------------------------------------------------------------------------------------------------

def test_mtp_layer_tensors_are_ignored(hf_ckpt, tmp_path):
    _, _, _, hf_dir, ours = hf_ckpt
    cfg = ours.cfg
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    t = copy_tensors(hf_dir)
    last = f"model.layers.{L - 1}."
    mtp = {f"model.layers.{L}." + k[len(last):]: v * 3 for k, v in t.items() if k.startswith(last)}
    mtp.update({
        f"model.layers.{L}.eh_proj.weight": np.ones((D, 2 * D), np.float32),
        f"model.layers.{L}.enorm.weight": np.ones(D, np.float32),
        f"model.layers.{L}.hnorm.weight": np.ones(D, np.float32),
        f"model.layers.{L}.shared_head.norm.weight": np.ones(D, np.float32),
        f"model.layers.{L}.shared_head.head.weight": np.ones((cfg.vocab_size, D), np.float32),
        f"model.layers.{L}.embed_tokens.weight": np.ones((cfg.vocab_size + 1, D), np.float32),  # any shape
        # a second MTP layer, with an FP8 weight and no scale: still never looked at
        f"model.layers.{L + 1}.self_attn.q_a_proj.weight": np.ones((5, 7), np.float32).astype(F8),
    })
    assert len(mtp) > 20
    d = write_checkpoint(tmp_path / "mtp", hf_dir, {**t, **mtp}, files=3)
    assert_same_params(ours, hisparse_jax.load_pretrained(d, dtype=jnp.float32))
