"""Names the library and the pure-Python capacity calculator share, stated once (this module imports nothing, so
`hisparse_jax.calc` uses it where numpy and jax are not installed; `config` imports numpy through its checks).

The indexer keys' quantized storage formats and where the keys live (`CacheConfig.index_dtype` / `index_tier`, the
calculator's `--index-dtype` / `--index-tier`), and GLM-5's IndexShare pattern of "full" and "shared" indexer
layers (the `glm-5` preset, a GLM `config.json` without per-layer types, the calculator's GLM-5.3 KV shape).
"""

from __future__ import annotations

# Quantized indexer-key formats: "fp8" (e4m3 of the Hadamard-rotated key + one fp32 scale: 132 bytes per key of
# 128) and "int4" (MXFP4: E2M1 codes two per byte + one UE8M0 scale per 32 values: 68 bytes per key of 128).
# `CacheConfig.index_dtype` also takes "auto" (as its kv_dtype stores the keys).
QUANTIZED_INDEX_DTYPES = ("fp8", "int4")

# Where the indexer-key history lives: "device" (every published HiSparse) or "host" (the pinned-host tier beside
# the KV, the device keeping a min / max summary per key page and reading the keys each step needs).
INDEX_TIERS = ("device", "host")

# How the host tier's budgeted mode ranks the key pages it reads: "bound" (each page's upper bound of its scores,
# from the min / max summary) or "centre" (the score of the summary's midpoint, (min + max) / 2: no more bytes, and
# on the trained models a far better guess of where the top-k is; `experiments/index_tier.py`).
INDEX_RANKS = ("bound", "centre")

# What the device keeps of the host tier's key pages to bound their scores: "box" (per page and dimension the
# min / max of its keys, bf16: dI / 16 bytes per token) or "rvq" (per key, the key before its RoPE coded by
# residual vector quantization, m = dI / 16 - 1 one-byte codes and an e4m3 residual radius: the same dI / 16 bytes
# per token, plus m codebooks of RVQ_SIZE centroids per index layer, bf16; pruned pages on the trained models,
# `experiments/index_tier.py`).
INDEX_SUMMARIES = ("box", "rvq")
RVQ_SIZE = 256  # centroids per stage: one byte per code (`reference.RVQ_SIZE`, which imports only jax)


def rvq_stages(index_dim: int) -> int:
    """The "rvq" summary's stages (codes per key) at the box's bytes per token: index_dim / 16 - 1 (7 at 128)."""
    return max(index_dim // 16 - 1, 0)


def glm_indexer_types(num_layers: int, freq: int = 4, offset: int = 3) -> tuple[str, ...]:
    """GLM-5's IndexShare pattern (`index_topk_freq`, `index_skip_topk_offset`): layer i has a "full" indexer iff
    max(i - offset + 1, 0) % freq == 0, else "shared" (it reuses the last full layer's top-k); default: GLM-5's
    4 and 3 (78 layers: 21 full)."""
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))
