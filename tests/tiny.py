"""The suite's shared tiny configurations: one GLM-style model (4 layers: full / shared indexers, dense / MoE MLPs)
and one store capacity. Tests vary budgets inside `BIG` (`CacheConfig.capacity`) and model fields they need, so
they share compiled programs rather than each compiling its own."""

from __future__ import annotations

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig, RopeConfig


def model_cfg(**over):
    kw = dict(model_type="glm_moe_dsa", vocab_size=97, hidden_size=48, intermediate_size=64,
              moe_intermediate_size=24, num_hidden_layers=4, num_attention_heads=3, q_lora_rank=40,
              kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=12, n_routed_experts=6,
              n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
              mlp_layer_types=("dense", "sparse", "dense", "sparse"), max_position_embeddings=4096,
              rope=RopeConfig(theta=10000.0), index_n_heads=16, index_head_dim=32, index_topk=16,
              indexer_rope_interleaved=True, indexer_types=("full", "shared", "full", "shared"), dtype="float32")
    kw.update(over)
    return hj.ModelConfig(**kw)


BIG = CacheConfig(kv_dtype="float32", device_pages=64, host_pages=64, max_seqs=4, max_seq_len=512)
