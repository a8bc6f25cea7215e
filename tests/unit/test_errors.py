"""Bad input gets a clear error that names the problem (configs, checkpoints, generate arguments).

No transformers / torch needed: checkpoints are written with our own `save_pretrained` and edited with
`safetensors.numpy`. Nothing here compiles a model (validation happens before any tracing).
"""

from __future__ import annotations

import glob
import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import hisparse_jax
from hisparse_jax import CheckpointError, RopeConfig, SparseMLAModel, get_preset
from hisparse_jax.generate import generate, validate_prompts
from hisparse_jax.hf_config import from_hf_config, to_hf_config
from hisparse_jax.model.weights import read_checkpoint_tensors
from tiny import DEEPSEEK_MICRO, model_cfg

SUPPORTED = ("deepseek_v32", "glm_moe_dsa")


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------

def tiny_model(**over) -> SparseMLAModel:
    """A model with zero parameters, built abstractly (no eager jax.random): enough for I/O and validation."""
    model = nnx.eval_shape(lambda: SparseMLAModel(model_cfg(DEEPSEEK_MICRO, **over), rngs=nnx.Rngs(0)))
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    for p, v in flat.items():
        sds = v.get_value()
        flat[p] = v.replace(jnp.zeros(sds.shape, sds.dtype))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


@pytest.fixture
def ckpt(tmp_path):
    """A valid tiny checkpoint directory and its tensors (in memory)."""
    d = tmp_path / "ckpt"
    hisparse_jax.save_pretrained(tiny_model(), d)
    return d, {k: np.array(v) for k, v in read_checkpoint_tensors(str(d)).items()}


def rewrite(d, tensors: dict) -> None:
    """Replace the checkpoint's tensors with `tensors` (one file)."""
    for f in glob.glob(os.path.join(d, "*.safetensors")):
        os.remove(f)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(d, "model.safetensors"))


def edit_config(d, **changes) -> None:
    p = os.path.join(d, "config.json")
    with open(p) as f:
        c = json.load(f)
    c.update(changes)
    with open(p, "w") as f:
        json.dump(c, f)


# ----------------------------------------------------------------------------------------------------------
# unknown model_type
# ----------------------------------------------------------------------------------------------------------

def assert_names_supported(msg: str):
    for t in SUPPORTED:
        assert t in msg


@pytest.mark.parametrize("bad", ["llama", "deepseek_v3", None])
def test_unknown_model_type_in_config_json(ckpt, bad):
    d, _ = ckpt
    edit_config(d, model_type=bad)
    with pytest.raises(ValueError, match="model_type") as e:
        hisparse_jax.load_pretrained(d)
    assert repr(bad) in str(e.value)
    assert_names_supported(str(e.value))
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        from_hf_config(d)
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        from_hf_config(os.path.join(d, "config.json"))


def test_missing_model_type_key():
    c = to_hf_config(model_cfg(DEEPSEEK_MICRO))
    del c["model_type"]
    with pytest.raises(ValueError, match="unknown model_type None") as e:
        from_hf_config(c)
    assert_names_supported(str(e.value))


def test_unknown_model_type_in_model_config():
    with pytest.raises(ValueError, match="'qwen3_moe'") as e:
        model_cfg(DEEPSEEK_MICRO, model_type="qwen3_moe")
    assert_names_supported(str(e.value))
    with pytest.raises(ValueError, match="'gpt2'"):
        model_cfg(DEEPSEEK_MICRO).replace(model_type="gpt2")


def test_unknown_preset():
    with pytest.raises(ValueError, match="'nope'") as e:
        get_preset("nope")
    assert "tiny-glm" in str(e.value) and "deepseek-v3.2" in str(e.value)


# ----------------------------------------------------------------------------------------------------------
# unsupported features in config.json
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, words", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "gelu"),
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}), "linear"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": -1.0, "factor": 2.0,
                           "original_max_position_embeddings": 64}), "theta"),
    (dict(mlp_layer_types=["dense", "moe"]), "mlp_layer_types"),
    (dict(model_type="glm_moe_dsa", indexer_types=["shared", "full"]), "first layer"),
    (dict(dtype="float64"), "dtype"),
])
def test_unsupported_config_json(change, words):
    c = to_hf_config(model_cfg(DEEPSEEK_MICRO))
    c.update(change)
    with pytest.raises(ValueError, match=words):
        from_hf_config(c)


def test_config_json_missing_required_field():
    c = to_hf_config(model_cfg(DEEPSEEK_MICRO))
    del c["hidden_size"]
    with pytest.raises((KeyError, ValueError), match="hidden_size"):
        from_hf_config(c)


def test_deepseek_cannot_save_shared_index_layers():
    cfg = model_cfg(DEEPSEEK_MICRO, indexer_types=("full", "shared"))  # a valid ModelConfig ...
    with pytest.raises(ValueError, match="glm_moe_dsa"):  # ... that config.json for deepseek_v32 cannot express
        to_hf_config(cfg)


# ----------------------------------------------------------------------------------------------------------
# checkpoint contents
# ----------------------------------------------------------------------------------------------------------

def test_missing_tensors_are_listed(ckpt):
    d, t = ckpt
    gone = ["model.layers.0.self_attn.q_a_proj.weight", "model.norm.weight"]
    rewrite(d, {k: v for k, v in t.items() if k not in gone})
    with pytest.raises(CheckpointError) as e:
        hisparse_jax.load_pretrained(d)
    msg = str(e.value)
    assert "2 missing" in msg
    for name in gone:
        assert name in msg
    assert str(d) in msg
    assert isinstance(e.value, ValueError)  # callers catching ValueError also see it


def test_missing_expert_tensor_is_named(ckpt):
    d, t = ckpt
    gone = "model.layers.1.mlp.experts.2.up_proj.weight"
    rewrite(d, {k: v for k, v in t.items() if k != gone})
    with pytest.raises(CheckpointError, match=re.escape(gone)):
        hisparse_jax.load_pretrained(d)


def test_missing_fused_expert_tensor_is_named(ckpt):
    d, t = ckpt
    t = {k: v for k, v in t.items() if ".mlp.experts." not in k}
    t["model.layers.1.mlp.experts.down_proj"] = np.zeros((4, 32, 16), np.float32)  # gate_up_proj absent
    rewrite(d, t)
    with pytest.raises(CheckpointError, match=re.escape("model.layers.1.mlp.experts.gate_up_proj")):
        hisparse_jax.load_pretrained(d)


def test_misshaped_tensor_names_parameter_and_shapes(ckpt):
    d, t = ckpt
    t["model.layers.0.self_attn.q_a_proj.weight"] = np.zeros((24, 33), np.float32)  # HF [Q, D]; D is 32
    rewrite(d, t)
    with pytest.raises(CheckpointError) as e:
        hisparse_jax.load_pretrained(d)
    msg = str(e.value)
    assert "1 mis-shaped" in msg
    assert "layers.0.self_attn.q_a_proj" in msg
    assert "expected (32, 24), got (33, 24)" in msg  # our [in, out] layout


def test_misshaped_fused_experts(ckpt):
    d, t = ckpt
    t = {k: v for k, v in t.items() if ".mlp.experts." not in k}
    t["model.layers.1.mlp.experts.gate_up_proj"] = np.zeros((3, 32, 32), np.float32)  # 3 experts, not 4
    t["model.layers.1.mlp.experts.down_proj"] = np.zeros((4, 32, 16), np.float32)
    rewrite(d, t)
    with pytest.raises(CheckpointError) as e:
        hisparse_jax.load_pretrained(d)
    msg = str(e.value)
    assert "layers.1.mlp.experts.gate: expected (4, 32, 16), got (3, 32, 16)" in msg
    assert "layers.1.mlp.experts.up" in msg and "layers.1.mlp.experts.down" not in msg


def test_every_problem_is_reported_at_once(ckpt):
    d, t = ckpt
    del t["lm_head.weight"]
    t["model.embed_tokens.weight"] = np.zeros((65, 32), np.float32)
    t["model.layers.1.mlp.gate.e_score_correction_bias"] = np.zeros(5, np.float32)
    rewrite(d, t)
    with pytest.raises(CheckpointError) as e:
        hisparse_jax.load_pretrained(d)
    msg = str(e.value)
    assert "1 missing" in msg and "lm_head.weight" in msg
    assert "2 mis-shaped" in msg and "embed_tokens: expected (64, 32), got (65, 32)" in msg
    assert "layers.1.mlp.gate.e_score_correction_bias: expected (4,), got (5,)" in msg


def test_config_disagreeing_with_tensors(ckpt):
    """A config.json edited to another size: the checkpoint error says which tensors disagree."""
    d, _ = ckpt
    edit_config(d, kv_lora_rank=12)
    with pytest.raises(CheckpointError, match=re.escape(
            "layers.0.self_attn.kv_a_proj_with_mqa.kernel: expected (32, 20), got (32, 24)")):
        hisparse_jax.load_pretrained(d)


def test_fp8_weight_without_scale(ckpt):
    d, t = ckpt
    name = "model.layers.0.self_attn.q_b_proj.weight"
    t[name] = t[name].astype(ml_dtypes.float8_e4m3fn)
    rewrite(d, t)
    with pytest.raises(CheckpointError, match=re.escape(name + "_scale_inv")):
        hisparse_jax.load_pretrained(d)


@pytest.mark.parametrize("scale_shape", [(1, 2), (2, 1)])
def test_fp8_scale_of_wrong_shape(ckpt, scale_shape):
    d, t = ckpt
    name = "model.layers.0.self_attn.q_b_proj.weight"  # [32, 24] -> scale_inv must be [1, 1]
    t[name] = t[name].astype(ml_dtypes.float8_e4m3fn)
    t[name + "_scale_inv"] = np.ones(scale_shape, np.float32)
    rewrite(d, t)
    with pytest.raises(CheckpointError, match=re.escape(name + "_scale_inv")):
        hisparse_jax.load_pretrained(d)


def test_unsupported_tensor_dtype(ckpt):
    d, t = ckpt
    t["model.norm.weight"] = np.zeros(32, np.uint16)
    rewrite(d, t)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*U16"):
        hisparse_jax.load_pretrained(d)


# ----------------------------------------------------------------------------------------------------------
# no checkpoint
# ----------------------------------------------------------------------------------------------------------

def test_empty_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        hisparse_jax.load_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        read_checkpoint_tensors(str(tmp_path))


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        hisparse_jax.load_pretrained(tmp_path / "does-not-exist")


def test_config_without_safetensors(ckpt):
    d, _ = ckpt
    for f in glob.glob(os.path.join(d, "*.safetensors")):
        os.remove(f)
    open(os.path.join(d, "pytorch_model.bin"), "wb").close()  # a torch checkpoint is not read
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files in " + re.escape(str(d))):
        hisparse_jax.load_pretrained(d)


# ----------------------------------------------------------------------------------------------------------
# generate
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gen_model():
    return tiny_model(max_position_embeddings=16)


def test_token_ids_out_of_range(gen_model):
    with pytest.raises(ValueError, match=r"prompt 1 has token ids out of range \[0, 64\): \[64, -1\]"):
        generate(gen_model, [[1, 2, 3], [5, 64, 7, -1]], 2)


def test_prompt_longer_than_max_position_embeddings(gen_model):
    with pytest.raises(ValueError, match="max_position_embeddings") as e:
        generate(gen_model, [list(range(20))], 1)
    assert "20 tokens" in str(e.value) and "16" in str(e.value)
    with pytest.raises(ValueError, match="max_position_embeddings"):  # the prompt fits, the generation does not
        generate(gen_model, [[1, 2], list(range(10))], 7)
    assert validate_prompts(gen_model, [[1, 2], list(range(10))], 6)[1] == list(range(10))  # exactly fills


@pytest.mark.parametrize("prompts, words", [
    ([[]], "prompt 0 is empty"),
    ([[1, 2], []], "prompt 1 is empty"),
    ([np.zeros(0, np.int32)], "prompt 0 is empty"),
    ([], "non-empty list"),
    ((), "non-empty list"),
    ("hello", "non-empty list"),
    (None, "non-empty list"),
])
def test_empty_prompts(gen_model, prompts, words):
    with pytest.raises(ValueError, match=words):
        generate(gen_model, prompts, 2)


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_below_one(gen_model, n):
    with pytest.raises(ValueError, match=rf"max_new_tokens must be >= 1, got {n}"):
        generate(gen_model, [[1, 2]], n)


def test_sampling_needs_a_key(gen_model):
    with pytest.raises(ValueError, match="key"):
        generate(gen_model, [[1, 2]], 2, temperature=0.7)
    with pytest.raises(ValueError, match="key"):
        generate(gen_model, [[1, 2]], 2, temperature=1.0, top_p=0.9)


@pytest.mark.parametrize("kw", [dict(temperature=-0.5, key=jax.random.key(0)), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_parameters(gen_model, kw):
    with pytest.raises(ValueError, match="temperature >= 0 and 0 < top_p <= 1"):
        generate(gen_model, [[1, 2]], 2, **kw)


def test_validate_prompts_accepts_arrays(gen_model):
    assert validate_prompts(gen_model, [np.array([3, 4]), (5,), jnp.array([6, 7])], 1) == [[3, 4], [5], [6, 7]]
    with pytest.raises(ValueError, match=r"prompt 0 must be a 1-D sequence of token ids, got shape \(1, 2\)"):
        validate_prompts(gen_model, [jnp.array([[6, 7]])], 1)  # a [1, T] batch is not a prompt: not flattened


# ----------------------------------------------------------------------------------------------------------
# ModelConfig validation
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, words", [
    (dict(n_routed_experts=6, n_group=4), r"n_routed_experts \(6\) must be divisible by n_group \(4\)"),
    (dict(n_routed_experts=4, n_group=4, topk_group=1), "at least 2 experts per group"),
    (dict(num_experts_per_tok=5), r"num_experts_per_tok \(5\) <= n_routed_experts \(4\)"),
    (dict(num_experts_per_tok=0), r"num_experts_per_tok \(0\)"),
    (dict(topk_group=3), r"topk_group \(3\) <= n_group \(2\)"),
    (dict(topk_group=0), r"topk_group \(0\)"),
    (dict(indexer_types=("shared", "full")), "first layer must have a 'full' indexer"),
    (dict(indexer_types=("full",)), "indexer_types must be 2 entries"),
    (dict(indexer_types=("full", "sparse")), "indexer_types must be 2 entries of 'full'/'shared'"),
    (dict(mlp_layer_types=("dense",)), "mlp_layer_types must be 2 entries"),
    (dict(mlp_layer_types=("dense", "sparse", "sparse")), "mlp_layer_types must be 2 entries"),
    (dict(mlp_layer_types=("dense", "moe")), "mlp_layer_types must be 2 entries of 'dense'/'sparse'"),
    (dict(qk_rope_head_dim=7), r"qk_rope_head_dim \(7\) must be even"),
    (dict(qk_rope_head_dim=32), r"qk_rope_head_dim \(32\) must be even and <= index_head_dim \(16\)"),
    (dict(vocab_size=0), "vocab_size must be >= 1, got 0"),
    (dict(kv_lora_rank=-1), "kv_lora_rank must be >= 1, got -1"),
    (dict(index_topk=0), "index_topk must be >= 1"),
    (dict(max_position_embeddings=0), "max_position_embeddings must be >= 1"),
    (dict(dtype="float64"), "dtype must be float32, bfloat16 or float16, got 'float64'"),
])
def test_invalid_model_config(change, words):
    with pytest.raises(ValueError, match="invalid ModelConfig") as e:
        model_cfg(DEEPSEEK_MICRO, **change)
    assert re.search(words, str(e.value)), str(e.value)


def test_invalid_model_config_lists_every_problem():
    with pytest.raises(ValueError) as e:
        model_cfg(DEEPSEEK_MICRO, n_routed_experts=6, n_group=4, mlp_layer_types=("dense",),
                  indexer_types=("shared", "full"), dtype="int8")
    msg = str(e.value)
    for words in ("mlp_layer_types", "first layer", "dtype"):
        assert words in msg
    # with mlp_layer_types invalid the MoE checks may or may not run; a valid pattern shows the expert problem
    with pytest.raises(ValueError) as e:
        model_cfg(DEEPSEEK_MICRO, n_routed_experts=6, n_group=4, indexer_types=("shared", "full"), dtype="int8")
    for words in ("n_routed_experts (6)", "first layer", "dtype"):
        assert words in str(e.value)


def test_moe_checks_only_apply_with_sparse_layers():
    # no MoE: nothing to check
    cfg = model_cfg(DEEPSEEK_MICRO, mlp_layer_types=("dense", "dense"), n_routed_experts=6, n_group=4)
    assert cfg.mlp_layer_types == ("dense", "dense")


@pytest.mark.parametrize("kw, words", [
    (dict(rope_type="dynamic"), "rope_type 'dynamic'"),
    (dict(theta=0.0), "theta must be > 0, got 0.0"),
    (dict(rope_type="yarn", factor=4.0), "original_max_position_embeddings"),
])
def test_invalid_rope_config(kw, words):
    with pytest.raises(ValueError, match=words):
        RopeConfig(**kw)


def test_unknown_moe_impl():
    model = tiny_model(mlp_layer_types=("dense", "sparse"))
    with pytest.raises(ValueError, match="unknown moe impl 'sorted'"):
        model.layer(1).mlp(jnp.zeros((1, 32), jnp.float32), impl="sorted")


def test_a_step_that_moves_nothing_stops_run_with_the_engines_report():
    """`engine.run_steps` (both engines' `run`) never loops on a step in which nothing moved: it raises, naming the
    step and the engine's own account of what waits on what; a step that moved goes on to the next."""
    import dataclasses

    from hisparse_jax.engine.engine import run_steps
    from hisparse_jax.results import StepMetrics

    zero = {f.name: 0 for f in dataclasses.fields(StepMetrics)} | {"wait_reasons": {"kv_pages": 2}}

    class Stuck:  # an engine whose second step moves nothing
        def __init__(self):
            self.steps, self.seen = 0, []

        def has_unfinished(self):
            return True

        def step(self):
            self.steps += 1
            return StepMetrics(**(zero | {"step": self.steps, "running": int(self.steps == 1)}))

        def stall_report(self, m):
            return f"2 waiting for {m.wait_reasons}"

    e = Stuck()
    with pytest.raises(RuntimeError, match=r"no progress at step 2: 2 waiting for \{'kv_pages': 2\}"):
        run_steps(e, progress=lambda eng: eng.seen.append(eng.steps))
    assert e.seen == [1]
