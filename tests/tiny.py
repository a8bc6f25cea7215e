"""The suite's one tiny-model builder: every test's model configuration is `model_cfg` (ours) or `hf_model` (a
transformers reference), each a fixed small base plus the overrides a test needs, and `BIG`, one store capacity.

Tests vary budgets inside `BIG` (`CacheConfig.capacity`) and the model fields they need, so they share compiled
programs rather than each compiling its own. A test whose expected figures depend on other sizes passes them as
overrides (`DEEPSEEK_MICRO`, `HF_MICRO` are the two such sets several files share); `MICRO` is the smallest
model, for child processes."""

from __future__ import annotations

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig, RopeConfig


def model_cfg(size: dict | None = None, **over) -> hj.ModelConfig:
    """The base: GLM-style, 4 layers (full / shared indexers, dense / MoE MLPs), float32. `size` (a shared set
    such as DEEPSEEK_MICRO) then `over` replace fields."""
    kw = dict(model_type="glm_moe_dsa", vocab_size=97, hidden_size=48, intermediate_size=64,
              moe_intermediate_size=24, num_hidden_layers=4, num_attention_heads=3, q_lora_rank=40,
              kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=12, n_routed_experts=6,
              n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
              mlp_layer_types=("dense", "sparse", "dense", "sparse"), max_position_embeddings=4096,
              rope=RopeConfig(theta=10000.0), index_n_heads=16, index_head_dim=32, index_topk=16,
              indexer_rope_interleaved=True, indexer_types=("full", "shared", "full", "shared"), dtype="float32")
    kw.update(size or {})
    kw.update(over)
    return hj.ModelConfig(**kw)


# A 2-layer DeepSeek model (one dense, one MoE layer, every layer its own indexer): the checkpoint and error tests.
DEEPSEEK_MICRO = dict(model_type="deepseek_v32", vocab_size=64, hidden_size=32, intermediate_size=48,
                      moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=24,
                      kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                      n_group=2, mlp_layer_types=("dense", "sparse"), index_topk=4, index_head_dim=16,
                      index_n_heads=2, max_position_embeddings=128, rope=RopeConfig(), indexer_types=(),
                      indexer_rope_interleaved=False)

# A 1-layer GLM model, the smallest the library builds: complete ModelConfig keywords, not overrides, because child
# processes (run under memory limits, without tests/ on their path) build it from this dict's repr.
MICRO = dict(model_type="glm_moe_dsa", vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
             num_attention_heads=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
             v_head_dim=8, index_n_heads=1, index_head_dim=8, index_topk=8, mlp_layer_types=("dense",),
             dtype="float32")

BIG = CacheConfig(kv_dtype="float32", device_pages=64, host_pages=64, max_seqs=4, max_seq_len=512)


# The transformers config of HF_MICRO's size (the checkpoint tests); `hf_model`'s own base is larger.
HF_MICRO = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, index_topk=4, index_head_dim=16,
                index_n_heads=2, max_position_embeddings=128)


def hf_model(kind: str, seed: int = 0, **over):
    """A tiny random transformers model, eval mode, float32. kind: 'deepseek' (YaRN, group-limited routing, 3
    layers) or 'glm' (shared-index layers, 5 layers). The router correction bias is randomized so that a mis-mapped
    bias would show. `over` replaces transformers config fields (after the kind's own)."""
    from conftest import need_reference

    torch, transformers = need_reference("torch"), need_reference("transformers")
    torch.manual_seed(seed)
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
              q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16, num_experts_per_tok=2,
              first_k_dense_replace=1, index_topk=8, index_head_dim=32, index_n_heads=16,
              max_position_embeddings=256)
    if kind == "deepseek":
        kw.update(n_group=2, topk_group=1, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
        cls, config = transformers.DeepseekV32ForCausalLM, transformers.DeepseekV32Config
    elif kind == "glm":
        kw.update(num_hidden_layers=5, n_group=1, topk_group=1, index_topk_freq=2, index_skip_topk_offset=1,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls, config = transformers.GlmMoeDsaForCausalLM, transformers.GlmMoeDsaConfig
    else:
        raise ValueError(f"kind must be 'deepseek' or 'glm', not {kind!r}")
    kw.update(over)
    model = cls(config(**kw))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                buf.normal_(0, 0.1)
    return model.eval()
