"""The checkpoints' multi-token-prediction (MTP) layers: the model side (`hisparse_jax.model.mtp`).

Decode-mode MTP (through the contiguous `DenseKV`) equals the causal MTP forward at every position, recursive
drafts included; the layer's input follows vLLM (enorm / hnorm / concat order / eh_proj / position-0 mask);
checkpoints round-trip (and transformers still reads ours); a damaged MTP layer is refused. CPU, float32, tiny.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import hisparse_jax as hj
from hisparse_jax.config import ModelConfig, get_preset
from hisparse_jax.hf_config import from_hf_config, to_hf_config
from hisparse_jax.kv.dense import DenseKV, init_dense_kv
from hisparse_jax.model.decoder import SparseMLAModel, decode_step
from hisparse_jax.model.mtp import MTPLayer, mtp_decode_step, mtp_forward, mtp_input
from hisparse_jax.model.weights import CheckpointError, read_checkpoint_tensors
from tiny import model_cfg

TOL = dict(rtol=2e-5, atol=2e-5)  # as tests/unit/test_decode.py's decode-vs-prefill checks


def mtp_cfg(preset: str, **over) -> ModelConfig:
    # index_topk 8 < the sequences below, so every indexer (the MTP block's too) selects sparsely
    return get_preset(preset).replace(num_nextn_predict_layers=1, index_topk=8, **over)


def params_of(model) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(str(k) for k in path): np.asarray(var[...]) for path, var in flat}


@functools.partial(jax.jit, static_argnums=0)
def _mtp_logits(graphdef, state, ids, next_ids):
    model = nnx.merge(graphdef, state)
    _, aux = model.forward(ids)
    return mtp_forward(model, aux["hidden"], next_ids)[0]


def mtp_logits_of(model, ids, next_ids):
    graphdef, state = nnx.split(model)
    return np.asarray(_mtp_logits(graphdef, state, jnp.asarray(ids), jnp.asarray(next_ids)))


# ----------------------------------------------------------------------------------------------------------
# config and construction
# ----------------------------------------------------------------------------------------------------------

def test_config_field_reads_writes_and_validates():
    for name in ("tiny-glm", "tiny-deepseek", "deepseek-v3.2", "glm-5"):
        assert get_preset(name).num_nextn_predict_layers == 0
    cfg = mtp_cfg("tiny-deepseek")
    d = to_hf_config(cfg)
    assert d["num_nextn_predict_layers"] == 1
    assert from_hf_config(d) == cfg
    assert from_hf_config({**d, "num_nextn_predict_layers": None}).num_nextn_predict_layers == 0
    absent = {k: v for k, v in d.items() if k != "num_nextn_predict_layers"}
    assert from_hf_config(absent).num_nextn_predict_layers == 0
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="num_nextn_predict_layers"):
            from_hf_config({**d, "num_nextn_predict_layers": bad})


def test_mtp_layers_are_built_only_when_asked():
    cfg = mtp_cfg("tiny-glm")
    plain = nnx.eval_shape(lambda: SparseMLAModel(cfg, rngs=nnx.Rngs(0)))
    names = [".".join(str(k) for k in path) for path, _ in nnx.to_flat_state(nnx.state(plain, nnx.Param))]
    assert len(plain.mtp) == 0 and names and not any(k.startswith("mtp") for k in names)
    model = nnx.eval_shape(lambda: SparseMLAModel(cfg, rngs=nnx.Rngs(0), mtp=True))
    [layer] = model.mtp
    assert isinstance(layer, MTPLayer)
    # the block: its own (full) indexer although layer L's number is past tiny-glm's shared pattern; an MoE
    assert layer.block.self_attn.indexer is not None
    assert type(layer.block.mlp).__name__ == "MoE"
    D, V = cfg.hidden_size, cfg.vocab_size
    assert layer.eh_proj.kernel.shape == (2 * D, D) and layer.shared_head.kernel.shape == (D, V)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        SparseMLAModel(get_preset("tiny-glm"), mtp=True)


# ----------------------------------------------------------------------------------------------------------
# the layer's input follows vLLM's DeepSeekMultiTokenPredictorLayer.forward
# ----------------------------------------------------------------------------------------------------------

def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def test_combine_follows_vllm():
    """eh_proj(concat([enorm(embedding, zeroed at position 0), hnorm(previous hidden)])), on explicit arrays."""
    cfg = model_cfg(model_type="deepseek_v32", vocab_size=32, hidden_size=8, intermediate_size=16,
                    num_hidden_layers=1, num_attention_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                    qk_rope_head_dim=4, v_head_dim=4, mlp_layer_types=("dense",), index_n_heads=2,
                    index_head_dim=8, index_topk=4, max_position_embeddings=64, rms_norm_eps=1e-5,
                    num_nextn_predict_layers=1, indexer_types=(), indexer_rope_interleaved=False)
    layer = SparseMLAModel(cfg, rngs=nnx.Rngs(0), mtp=True).mtp[0]
    rng = np.random.default_rng(0)
    D = cfg.hidden_size
    we, wh = rng.uniform(0.5, 1.5, D).astype(np.float32), rng.uniform(0.5, 1.5, D).astype(np.float32)
    W_hf = rng.standard_normal((D, 2 * D)).astype(np.float32)  # the checkpoint's eh_proj.weight [out, in]
    layer.enorm.weight.set_value(jnp.asarray(we))
    layer.hnorm.weight.set_value(jnp.asarray(wh))
    layer.eh_proj.kernel.set_value(jnp.asarray(W_hf.T))
    emb = rng.standard_normal((3, D)).astype(np.float32)
    hid = rng.standard_normal((3, D)).astype(np.float32)
    pos = np.array([0, 1, 7], np.int32)
    got = np.asarray(mtp_input(layer, jnp.asarray(emb), jnp.asarray(hid), jnp.asarray(pos)))
    e = np.where(pos[:, None] == 0, 0.0, emb.astype(np.float64))
    # the embedding half of eh_proj's input comes first, the hidden state's second
    h = hid.astype(np.float64)
    want = _rms(e, we, cfg.rms_norm_eps) @ W_hf[:, :D].T + _rms(h, wh, cfg.rms_norm_eps) @ W_hf[:, D:].T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # position 0: only the hidden state counts
    np.testing.assert_allclose(got[0], _rms(h[0], wh, cfg.rms_norm_eps) @ W_hf[:, D:].T, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# decode-mode MTP == causal MTP
# ----------------------------------------------------------------------------------------------------------

@nnx.jit
def _prefill(model, ids, next_ids):
    logits, aux = model.forward(ids)
    mlogits, maux = mtp_forward(model, aux["hidden"], next_ids)
    return logits, aux["hidden"], mlogits, maux


@nnx.jit(static_argnums=(5,))
def _step(model, tokens, positions, next_tokens, kv, backend):
    """A main decode step, then the MTP layer on its hidden state (the MTP layer's KV at the same position)."""
    logits, kv, _, hidden = decode_step(model, tokens, positions, kv, backend, return_hidden=True)
    mlogits, mhidden, kv = mtp_decode_step(model, next_tokens, positions, hidden, kv, backend)
    return logits, hidden, mlogits, mhidden, kv


@nnx.jit
def _mtp_forward(model, hidden, next_ids):
    return mtp_forward(model, hidden, next_ids)


@nnx.jit(static_argnums=(5,))
def _draft(model, tokens, positions, hidden, kv, backend):
    return mtp_decode_step(model, tokens, positions, hidden, kv, backend)


@pytest.mark.parametrize("preset", ["tiny-glm", "tiny-deepseek"])
def test_decode_mtp_equals_causal_mtp(preset):
    """Token by token from empty KV arrays (main layers + the MTP layer after them): the main step's logits and
    final hidden state, and the MTP step's logits and hidden state, equal the causal forwards at every position
    (T = 20 > index_topk = 8: the late positions select sparsely). Then a recursive draft — the MTP layer again,
    on its own hidden state and greedy token, one position further — equals the causal MTP forward over that
    extended sequence."""
    cfg = mtp_cfg(preset)
    model = SparseMLAModel(cfg, rngs=nnx.Rngs(1), mtp=True)
    B, T = 2, 20
    ids = jax.random.randint(jax.random.key(2), (B, T + 1), 0, cfg.vocab_size, dtype=jnp.int32)
    logits, hidden, mlogits, maux = _prefill(model, ids[:, :T], ids[:, 1:])
    assert hidden.shape == (B, T, cfg.hidden_size) and maux["hidden"].shape == (B, T, cfg.hidden_size)
    assert mlogits.dtype == jnp.float32 and mlogits.shape == (B, T, cfg.vocab_size)
    assert maux["topk"].shape == (B, T, cfg.index_topk) and maux["latent"].shape == (B, T, cfg.kv_lora_rank)
    assert bool(jnp.all(maux["topk"][:, -1] >= 0))  # a full top-k of 8 out of 20 keys

    backend = DenseKV(topk=cfg.index_topk)
    kv = init_dense_kv(cfg, B, 64, jnp.float32, extra_layers=1)
    assert kv["latent"].shape[0] == cfg.num_hidden_layers + 1
    assert kv["index_k"].shape[0] == cfg.num_indexer_layers + 1
    for t in range(T):
        pos = jnp.full((B,), t, jnp.int32)
        lg, h, ml, mh, kv = _step(model, ids[:, t], pos, ids[:, t + 1], kv, backend)
        np.testing.assert_allclose(np.asarray(lg), np.asarray(logits[:, t]), **TOL)
        np.testing.assert_allclose(np.asarray(h), np.asarray(hidden[:, t]), **TOL)
        np.testing.assert_allclose(np.asarray(ml), np.asarray(mlogits[:, t]), **TOL)
        np.testing.assert_allclose(np.asarray(mh), np.asarray(maux["hidden"][:, t]), **TOL)
    # the MTP block's rows went to layer L / indexer layer L_I of `kv`, as the causal forward computed them
    np.testing.assert_allclose(np.asarray(kv["latent"][-1, :, :T]), np.asarray(maux["latent"]), **TOL)
    np.testing.assert_allclose(np.asarray(kv["index_k"][-1, :, :T]), np.asarray(maux["index_k"]), **TOL)

    # recursive draft: the second MTP application at position T on the first's hidden_out and argmax token
    draft = jnp.argmax(ml, axis=-1).astype(jnp.int32)
    ml2, mh2, kv = _draft(model, draft, jnp.full((B,), T, jnp.int32), mh, kv, backend)
    assert np.isfinite(np.asarray(ml2)).all() and ml2.shape == (B, cfg.vocab_size)
    assert not np.allclose(np.asarray(ml2), np.asarray(ml))
    ext_hidden = jnp.concatenate([hidden, mh[:, None]], axis=1)
    ext_next = jnp.concatenate([ids[:, 1:], draft[:, None]], axis=1)
    want, want_aux = _mtp_forward(model, ext_hidden, ext_next)
    np.testing.assert_allclose(np.asarray(ml2), np.asarray(want[:, T]), **TOL)
    np.testing.assert_allclose(np.asarray(mh2), np.asarray(want_aux["hidden"][:, T]), **TOL)


# ----------------------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    """(our tiny-deepseek model with an MTP layer and non-trivial norms, its save_pretrained directory)."""
    cfg = mtp_cfg("tiny-deepseek")
    model = SparseMLAModel(cfg, rngs=nnx.Rngs(3), mtp=True)
    rng = np.random.default_rng(3)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "weight" and var.get_value().ndim == 1:  # norms: not all ones, so a swap would show
            var.set_value(jnp.asarray(rng.uniform(0.5, 1.5, var.get_value().shape), var.get_value().dtype))
    path = str(tmp_path_factory.mktemp("mtp_ckpt"))
    hj.save_pretrained(model, path)
    return model, path


def rewrite(src: str, dst, tensors: dict) -> str:
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = f.read()
    with open(os.path.join(dst, "config.json"), "w") as f:
        f.write(config)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    return str(dst)


def test_save_load_round_trip(mtp_ckpt, tmp_path):
    model, path = mtp_ckpt
    cfg, L, D = model.cfg, model.cfg.num_hidden_layers, model.cfg.hidden_size
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    tensors = read_checkpoint_tensors(path)
    p = f"model.layers.{L}."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "embed_tokens.weight", "self_attn.indexer.wk.weight",
                 "self_attn.q_a_proj.weight", "mlp.gate.weight", "mlp.experts.0.gate_proj.weight",
                 "mlp.shared_experts.down_proj.weight"):
        assert p + name in tensors, p + name
    assert np.array_equal(tensors[p + "embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    # the checkpoint's eh_proj.weight [D, 2D]: its first D input columns take the embedding
    assert np.array_equal(tensors[p + "eh_proj.weight"][:, :D], np.asarray(model.mtp[0].eh_proj.kernel[...])[:D].T)

    again = hj.load_pretrained(path, mtp=True)
    assert again.cfg == cfg and len(again.mtp) == 1
    want = params_of(model)
    got = params_of(again)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 13)).astype(np.int32)
    np.testing.assert_array_equal(mtp_logits_of(again, ids[:, :-1], ids[:, 1:]),
                                  mtp_logits_of(model, ids[:, :-1], ids[:, 1:]))

    plain = hj.load_pretrained(path)  # mtp=False: the MTP tensors are ignored
    assert len(plain.mtp) == 0
    got = params_of(plain)
    assert sorted(got) == sorted(k for k in want if not k.startswith("mtp."))
    assert all(np.array_equal(v, want[k]) for k, v in got.items())
    # ... and saving it writes no MTP layer (config.json says so)
    hj.save_pretrained(plain, tmp_path / "plain")
    with open(tmp_path / "plain" / "config.json") as f:
        assert json.load(f)["num_nextn_predict_layers"] == 0
    assert not any(n.startswith(p) for n in read_checkpoint_tensors(str(tmp_path / "plain")))

    # Orbax
    hj.save_params(again, tmp_path / "orbax")
    restored = hj.restore_params(tmp_path / "orbax", cfg, mtp=True)
    assert len(restored.mtp) == 1
    got = params_of(restored)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_transformers_loads_our_mtp_checkpoint(mtp_ckpt):
    torch = pytest.importorskip("torch", reason="needs torch + transformers (the numerical references)")
    transformers = pytest.importorskip("transformers", reason="needs torch + transformers (the numerical references)")
    model, path = mtp_ckpt
    theirs = transformers.DeepseekV32ForCausalLM.from_pretrained(path).eval()  # MTP tensors: unexpected, ignored
    ids = np.random.default_rng(1).integers(0, model.cfg.vocab_size, (2, 12)).astype(np.int32)
    with torch.no_grad():
        want = theirs(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model.forward(jnp.asarray(ids))[0]), want, rtol=1e-4, atol=1e-4)


def test_damaged_mtp_layer_is_refused(mtp_ckpt, tmp_path):
    model, path = mtp_ckpt
    L = model.cfg.num_hidden_layers
    tensors = {k: np.array(v) for k, v in read_checkpoint_tensors(path).items()}
    copy = f"model.layers.{L}.embed_tokens.weight"

    bad = dict(tensors)
    bad[copy] = bad[copy].copy()
    bad[copy][5, 3] += 1.0
    d = rewrite(path, tmp_path / "embed", bad)
    with pytest.raises(CheckpointError, match=f"{copy} differs from model.embed_tokens.weight"):
        hj.load_pretrained(d, mtp=True)
    assert len(hj.load_pretrained(d).mtp) == 0  # without MTP the copy is never read

    for name in (f"model.layers.{L}.eh_proj.weight", f"model.layers.{L}.self_attn.indexer.wk.weight",
                 f"model.layers.{L}.mlp.experts.1.up_proj.weight"):
        d = rewrite(path, tmp_path / name.split(".")[-2], {k: v for k, v in tensors.items() if k != name})
        with pytest.raises(CheckpointError, match=f"missing tensor.*{name}"):
            hj.load_pretrained(d, mtp=True)

    # the copy is optional: without it the main embedding is used
    d = rewrite(path, tmp_path / "no_copy", {k: v for k, v in tensors.items() if k != copy})
    assert np.array_equal(params_of(hj.load_pretrained(d, mtp=True))["mtp.0.eh_proj.kernel"],
                          params_of(model)["mtp.0.eh_proj.kernel"])

    # asking for MTP layers a checkpoint does not declare
    plain_dir = tmp_path / "plain"
    hj.save_pretrained(hj.load_pretrained(path), plain_dir)
    with pytest.raises(CheckpointError, match="no MTP layers"):
        hj.load_pretrained(plain_dir, mtp=True)


def test_fp8_and_fused_expert_mtp_tensors_load(mtp_ckpt, tmp_path):
    """The MTP layer's tensors are read like the main layers': FP8 block-quantized weights are dequantized, and
    fused experts (`mlp.experts.gate_up_proj` / `down_proj`) load as the per-expert ones."""
    from hisparse_jax.model.weights import dequantize_fp8, quantize_fp8

    model, path = mtp_ckpt
    L, E = model.cfg.num_hidden_layers, model.cfg.n_routed_experts
    tensors = {k: np.array(v) for k, v in read_checkpoint_tensors(path).items()}
    p = f"model.layers.{L}."
    for name in ("eh_proj.weight", "self_attn.q_a_proj.weight", "shared_head.head.weight"):
        q, s = quantize_fp8(tensors[p + name])
        tensors[p + name], tensors[p + name + "_scale_inv"] = q, s
    per = lambda part: [tensors.pop(f"{p}mlp.experts.{j}.{part}.weight") for j in range(E)]  # noqa: E731
    gate, up, down = per("gate_proj"), per("up_proj"), per("down_proj")
    tensors[p + "mlp.experts.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
    tensors[p + "mlp.experts.down_proj"] = np.stack(down)
    got = params_of(hj.load_pretrained(rewrite(path, tmp_path / "fp8", tensors), mtp=True))
    want = params_of(model)
    quantized = {"mtp.0.eh_proj.kernel": "eh_proj.weight",
                 "mtp.0.block.self_attn.q_a_proj.kernel": "self_attn.q_a_proj.weight",
                 "mtp.0.shared_head.kernel": "shared_head.head.weight"}
    for ours, name in quantized.items():
        np.testing.assert_array_equal(got[ours], dequantize_fp8(tensors[p + name], tensors[p + name + "_scale_inv"]).T)
        np.testing.assert_allclose(got[ours], want[ours], rtol=0.07, atol=1e-3)  # e4m3: 3 mantissa bits
    assert sorted(got) == sorted(want)
    for k in want:  # the rest, the fused experts included, exactly
        if k not in quantized:
            assert np.array_equal(got[k], want[k]), k
