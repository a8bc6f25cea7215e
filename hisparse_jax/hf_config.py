"""Hugging Face `config.json` import and export of a `ModelConfig`.

`from_hf_config` reads DeepSeek-V3.2's and GLM-5's `config.json` (a dict, the file, or its folder) into a validated
`ModelConfig`, refusing what this package does not implement (attention bias, a non-SiLU activation, no q-LoRA) and
bounding the per-layer lists before it builds them; `to_hf_config` writes the dict transformers reads back.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from hisparse_jax.config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeConfig, check_count
from hisparse_jax.formats import glm_indexer_types
from hisparse_jax.validation import check_int, check_token_list


def from_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any], **overrides) -> ModelConfig:
    """Build from a Hugging Face `config.json` (a dict, the file, or its directory); `overrides` replace fields."""
    d = _read(path_or_dict)
    mt = _check_supported(d)
    L = check_count("num_hidden_layers", d["num_hidden_layers"], lo=1)  # bounded before the per-layer lists
    mlp_types, idx_types = _layer_types(d, mt, L)
    rope = _rope(d)
    eos = check_token_list("eos_token_id", d.get("eos_token_id", 1))
    dtype = d.get("dtype") or d.get("torch_dtype") or "bfloat16"
    kw = dict(
        model_type=mt, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], moe_intermediate_size=d.get("moe_intermediate_size", 0),
        num_hidden_layers=L, num_attention_heads=d["num_attention_heads"], q_lora_rank=d["q_lora_rank"],
        kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
        n_routed_experts=d.get("n_routed_experts") or d.get("num_experts") or 0,
        n_shared_experts=d.get("n_shared_experts") or 0, num_experts_per_tok=d.get("num_experts_per_tok", 0),
        n_group=d.get("n_group") or 1, topk_group=d.get("topk_group") or 1,
        norm_topk_prob=_json_bool(d, "norm_topk_prob", True),
        routed_scaling_factor=d.get("routed_scaling_factor", 1.0),
        mlp_layer_types=tuple(mlp_types), rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        max_position_embeddings=d["max_position_embeddings"], rope=rope,
        index_n_heads=d.get("index_n_heads", 64), index_head_dim=d.get("index_head_dim", 128),
        index_topk=d.get("index_topk", 2048), indexer_types=tuple(idx_types),
        indexer_rope_interleaved=(mt == "glm_moe_dsa"), tie_word_embeddings=_json_bool(d, "tie_word_embeddings", False),
        bos_token_id=d.get("bos_token_id"), eos_token_id=eos,
        dtype={"bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype),
        num_nextn_predict_layers=0 if d.get("num_nextn_predict_layers") is None else d["num_nextn_predict_layers"],
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def _read(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> dict:
    """The config as a dict: a copy of a mapping, or the JSON object in the file (or in the folder's config.json),
    refusing invalid JSON, a key given twice and anything but an object."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    p = os.fspath(path_or_dict)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    if not os.path.exists(p):
        raise FileNotFoundError(f"no config.json at {p}")
    with open(p) as f:
        try:
            d = json.load(f, object_pairs_hook=_unique_keys(p))
        except json.JSONDecodeError as e:
            raise ValueError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{p} must hold a JSON object (the model's config), got {type(d).__name__}")
    return d


def _check_supported(d: dict) -> str:
    """The model_type, after refusing what this package does not implement and a config lacking a required size."""
    mt = d.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unknown model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if d.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported (neither DeepSeek-V3.2 nor GLM-5 uses it)")
    if d.get("q_lora_rank") in (None, 0):
        raise ValueError("q_lora_rank is required (the indexer reads the q-LoRA latent)")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {d.get('hidden_act')!r} is not supported (only 'silu')")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings")
    absent = [k for k in required if k not in d]
    if absent:
        raise ValueError(f"config.json lacks required field(s): {', '.join(absent)}")
    return mt


def _layer_types(d: dict, mt: str, L: int) -> tuple[list | tuple, list | tuple]:
    """(MLP types, indexer types) of the L layers: the per-layer lists, else from first_k_dense_replace, and from
    index_topk_pattern ("FS..." or a list), GLM's IndexShare frequency and offset, or every layer full."""
    mlp_types = d.get("mlp_layer_types")
    if not mlp_types:
        n_dense = min(check_int("first_k_dense_replace", d.get("first_k_dense_replace", 3), lo=0), L)
        mlp_types = ["dense"] * n_dense + ["sparse"] * (L - n_dense)
    idx_types = d.get("indexer_types")
    if not idx_types:
        pattern = d.get("index_topk_pattern")
        if isinstance(pattern, str):
            unknown = sorted(set(pattern) - set("FS"))
            if unknown:
                raise ValueError(f"index_topk_pattern {pattern!r} has letters other than F (full) and S (shared): "
                                 f"{', '.join(map(repr, unknown))}")
            idx_types = [{"F": "full", "S": "shared"}[c] for c in pattern]
        elif pattern is not None:
            idx_types = pattern
        elif mt == "glm_moe_dsa":
            freq = check_int("index_topk_freq", d.get("index_topk_freq", 1), lo=1)
            offset = check_int("index_skip_topk_offset", d.get("index_skip_topk_offset", 2), lo=0)
            idx_types = glm_indexer_types(L, freq, offset)
        else:
            idx_types = ["full"] * L
    return mlp_types, idx_types


def _rope(d: dict) -> RopeConfig:
    """The RoPE parameters (`rope_parameters`, or the older `rope_scaling`): default, or YaRN."""
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rp, Mapping):
        raise ValueError(f"rope_parameters must be an object, got {rp!r}")
    rp = dict(rp)
    rope_type = rp.get("rope_type", rp.get("type", "default")) or "default"
    theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
    if rope_type == "yarn":
        orig = rp.get("original_max_position_embeddings", d.get("max_position_embeddings"))
        orig = check_int("rope_parameters.original_max_position_embeddings", orig, lo=1)
        factor = rp.get("factor")
        if factor is None:
            factor = check_int("max_position_embeddings", d["max_position_embeddings"], lo=1) / orig
        return RopeConfig(theta=theta, rope_type="yarn", factor=factor, original_max_position_embeddings=orig,
                          beta_fast=rp.get("beta_fast") or 32, beta_slow=rp.get("beta_slow") or 1,
                          mscale=rp.get("mscale"), mscale_all_dim=rp.get("mscale_all_dim"),
                          attention_factor=rp.get("attention_factor"), truncate=_json_bool(rp, "truncate", True))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, yarn")


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face `config.json` dict for `cfg` (readable by transformers)."""
    arch = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}[cfg.model_type]
    r = cfg.rope
    rope: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type == "yarn":
        rope.update(factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
                    beta_fast=r.beta_fast, beta_slow=r.beta_slow)
        if not r.truncate:
            rope["truncate"] = False
        for k in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(r, k) is not None:
                rope[k] = getattr(r, k)
    d = {
        "architectures": [arch], "model_type": cfg.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_group": cfg.n_group, "topk_group": cfg.topk_group, "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor, "mlp_layer_types": list(cfg.mlp_layer_types),
        "first_k_dense_replace": cfg.mlp_layer_types.index("sparse") if "sparse" in cfg.mlp_layer_types
        else cfg.num_hidden_layers,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": rope, "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk, "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id[0] if len(cfg.eos_token_id) == 1 else list(cfg.eos_token_id),
        "hidden_act": "silu", "attention_bias": False, "dtype": cfg.dtype,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
    }
    if cfg.model_type == "glm_moe_dsa":
        d["indexer_types"] = list(cfg.indexer_types)
    elif any(t != "full" for t in cfg.indexer_types):
        raise ValueError("deepseek_v32 has no shared-index layers; use model_type='glm_moe_dsa'")
    return d


def _json_bool(d: Mapping[str, Any], name: str, default: bool) -> bool:
    """A config.json flag: true/false (null or absent = the default); "false" or 0 are refused, not coerced."""
    v = d.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be true or false, got {v!r}")
    return v


def _unique_keys(where: str):
    """A `json.load` object_pairs_hook refusing a key given twice (JSON readers disagree on which one wins)."""
    def hook(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise ValueError(f"{where} gives {k!r} twice ({out[k]!r} and {v!r}); keep one")
            out[k] = v
        return out
    return hook

