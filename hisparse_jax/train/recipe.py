"""The model the project trains on the standard library's sources, and its three-stage recipes.

`STDLIB_DSA` is a GLM-5-style DSA decoder with the real KV geometry of the tiny presets (latent 512, rope 64,
indexer keys 128, so the store's bytes per token are the production ones) and a byte vocabulary: 4 layers,
full / shared / full / shared indexers (IndexShare), dense MLPs, top-k 128 (1/16 of a 2048-token context), and
one multi-token-prediction layer (the draft model of speculative decoding, trained last with the main model frozen).

`RECIPES["default"]` is what the shipped checkpoint was trained with; `RECIPES["smoke"]` is a few steps at a
tiny context, for tests.
"""

from __future__ import annotations

import dataclasses

from hisparse_jax.config import ModelConfig, RopeConfig
from hisparse_jax.train.data import BOS_ID, VOCAB_SIZE
from hisparse_jax.train.dsa import StageConfig

STDLIB_DSA = ModelConfig(
    model_type="glm_moe_dsa", vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, q_lora_rank=96, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
    v_head_dim=32, mlp_layer_types=("dense",) * 4, n_routed_experts=0, n_shared_experts=0, num_experts_per_tok=0,
    n_group=1, topk_group=1, rms_norm_eps=1e-5, max_position_embeddings=8192, rope=RopeConfig(theta=10000.0),
    index_n_heads=4, index_head_dim=128, index_topk=128, indexer_rope_interleaved=True,
    indexer_types=("full", "shared", "full", "shared"), tie_word_embeddings=False, bos_token_id=BOS_ID,
    eos_token_id=(BOS_ID,), dtype="float32", num_nextn_predict_layers=1,
)

_DEFAULT = (
    StageConfig("dense", steps=600, lr=2e-3, batch=8, seq_len=512, warmup_steps=60),
    StageConfig("dense", steps=100, lr=1e-3, batch=2, seq_len=2048, warmup_steps=10),
    StageConfig("warmup", steps=100, lr=3e-3, batch=2, seq_len=2048, warmup_steps=10),
    StageConfig("sparse", steps=60, lr=3e-4, batch=2, seq_len=2048, warmup_steps=5),
    StageConfig("mtp_dense", steps=800, lr=2e-3, batch=8, seq_len=512, warmup_steps=50),
    StageConfig("mtp_sparse", steps=100, lr=5e-4, batch=2, seq_len=2048, warmup_steps=10),
)
# The long-context model (`stdlib-dsa-8k`): the shipped model's weights (`--init`) taught an 8K-byte context, top-k
# 128 = 1.6 % of it (GLM-5's 2048 of 128K): the same three stages at 8192 tokens, one window per step (each holds
# two of the 2K stages' batches of 2), fewer steps as it starts trained. Each step takes about a minute on 2 cores
# with the blocks recomputed in the backward pass (`--remat`; 10.7 GB at 8K). No MTP stages: the model has no MTP
# layer. The sparse training comes in three stages, each added and run on with `--resume` (held-out sparse / dense
# perplexity at 8K after each: 1.071, 1.038, 1.013). Sparse steps at 8K left it at 1.038 however long or slow they
# ran; the fifth stage takes its steps on four 2K windows (the same bytes as one 8K window at a sixth of the time:
# 11 s a step), and its sparse model is the best of every try at every position. The tries that were not kept are
# in experiments/results/training_stdlib-dsa-8k-tries.json.
_LONG8K = (
    StageConfig("dense", steps=30, lr=5e-4, batch=1, seq_len=8192, warmup_steps=3),
    StageConfig("warmup", steps=40, lr=1e-3, batch=1, seq_len=8192, warmup_steps=4),
    StageConfig("sparse", steps=20, lr=2e-4, batch=1, seq_len=8192, warmup_steps=2),
    StageConfig("sparse", steps=40, lr=3e-4, batch=1, seq_len=8192, warmup_steps=4),
    StageConfig("sparse", steps=150, lr=3e-4, batch=4, seq_len=2048, warmup_steps=4),
)
# The smoke recipe: the default's stages but its second (long-context) dense one, with their learning rates, a few
# steps each at a 256-token context: stage -> (steps, batch).
_SMOKE = {"dense": (4, 2), "warmup": (3, 1), "sparse": (3, 1), "mtp_dense": (3, 2), "mtp_sparse": (2, 1)}

RECIPES: dict[str, tuple[StageConfig, ...]] = {
    "default": _DEFAULT,
    "long8k": _LONG8K,
    "smoke": tuple(dataclasses.replace(s, steps=_SMOKE[s.stage][0], batch=_SMOKE[s.stage][1], seq_len=256,
                                       warmup_steps=1) for i, s in enumerate(_DEFAULT) if i != 1),
}
