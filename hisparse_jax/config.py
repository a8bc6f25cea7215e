"""Frozen, validated model configuration for sparse-MLA (DSA) decoders.

`ModelConfig` covers the two architectures this project reproduces:

* DeepSeek-V3.2 (`model_type="deepseek_v32"`): every layer has its own lightning indexer, the
  indexer uses half-split (NeoX) RoPE, YaRN RoPE scaling with mscale.
* GLM-5 (`model_type="glm_moe_dsa"`): the indexer uses interleaved RoPE and layers may be
  "shared" (IndexShare): they reuse the most recent "full" layer's top-k.

Field names follow the Hugging Face `config.json` so a reader can map one onto the other (`hf_config` reads and
writes it). Derived sizes are properties; nothing writes back into a config. `PRESETS` names the reproduced
architectures and the tiny test models; `CacheConfig` is the tiered store's formats and budgets.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from hisparse_jax.formats import INDEX_RANKS, INDEX_SUMMARIES, INDEX_TIERS, QUANTIZED_INDEX_DTYPES, glm_indexer_types
from hisparse_jax.units import PAGE_SIZE
from hisparse_jax.validation import check_float, check_int, check_optional_float, check_token_list

SUPPORTED_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")

# This package's upper bounds on the counts a model multiplies into per-layer and per-expert structures (the
# layer-type tuples, one parameter set per layer, stacked expert weights), checked before anything of that size is
# built: a config.json with num_hidden_layers=10**9 is refused naming the field, not turned into 10**9-entry
# tuples. Far above the architectures reproduced here (DeepSeek-V3.2: 61 layers, 128 heads, 256 routed experts,
# 1 MTP layer; GLM-5: 78 layers, 64 heads, 256 experts). Sizes (hidden_size, vocab_size, ...) have no such bound:
# `SparseMLAModel` compares the parameter bytes they give (`ModelConfig.parameter_bytes`) with the memory of the
# device before it allocates them.
MAX_EXPERTS = 8192
SIZE_LIMITS: dict[str, int] = {
    "num_hidden_layers": 1024, "num_nextn_predict_layers": 16, "num_attention_heads": 1024, "index_n_heads": 1024,
    "n_routed_experts": MAX_EXPERTS, "n_shared_experts": MAX_EXPERTS, "num_experts_per_tok": MAX_EXPERTS,
    "n_group": MAX_EXPERTS, "topk_group": MAX_EXPERTS,
}


def check_count(name: str, value: Any, *, lo: int) -> int:
    """`check_int` with this package's upper bound `SIZE_LIMITS[name]` (the message names the field, value and
    bound)."""
    v = check_int(name, value, lo=lo)
    hi = SIZE_LIMITS[name]
    if v > hi:
        raise ValueError(f"{name} must be <= {hi} (this package's limit, hisparse_jax.config.SIZE_LIMITS), got {v}")
    return v


def _short(items: tuple) -> str:
    """A layer-type tuple for a message: in full when short, else its length and first entries."""
    return repr(items) if len(items) <= 16 else f"{len(items)} entries {items[:4]!r}..."


# bytes per value of the model dtypes (`ModelConfig.dtype`)
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters. `rope_type` is "default" or "yarn" (YaRN with DeepSeek's mscale)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ("default", "yarn"):
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: 'default', 'yarn'")
        problems: list[str] = []
        put = functools.partial(_checked, self, problems)
        put("theta", check_float, lo=0, lo_open=True)
        put("factor", check_float, lo=0, lo_open=True)
        put("beta_fast", check_float)
        put("beta_slow", check_float)
        for name in ("mscale", "mscale_all_dim"):
            put(name, check_optional_float)
        put("attention_factor", check_optional_float, lo=0, lo_open=True)
        if self.original_max_position_embeddings is not None:
            put("original_max_position_embeddings", check_int, lo=1)
        if not isinstance(self.truncate, bool):
            problems.append(f"truncate must be a bool, got {self.truncate!r}")
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            problems.append("yarn RoPE needs original_max_position_embeddings")
        if problems:
            raise ValueError("invalid RoPE parameters: " + "; ".join(problems))


def _checked(obj, problems: list[str], name: str, check, **kw) -> None:
    """Set frozen `obj.name` to `check(name, value, **kw)`, or record the problem (the field keeps its value)."""
    try:
        object.__setattr__(obj, name, check(name, getattr(obj, name), **kw))
    except ValueError as e:
        problems.append(str(e))


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a DSA decoder. Axis letters used across the code base:

    B batch, T query tokens, S key positions, D hidden, H attention heads, C latent rank (kv_lora_rank),
    R rope dim, N nope dim, V value dim, Q q_lora rank, I indexer heads, E experts, F ffn width,
    K top-k, L layers, P pages.
    """

    model_type: str = "deepseek_v32"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    mlp_layer_types: tuple[str, ...] = ()
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    rope: RopeConfig = RopeConfig()
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    indexer_types: tuple[str, ...] = ()
    indexer_rope_interleaved: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    dtype: str = "bfloat16"
    # multi-token-prediction layers the checkpoint stores after the main ones (`model.layers.{L + i}.*`); a model
    # builds them only when asked (`SparseMLAModel(..., mtp=True)`, `load_pretrained(..., mtp=True)`)
    num_nextn_predict_layers: int = 0

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unknown model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        problems: list[str] = []
        put = functools.partial(_checked, self, problems)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings"):
            put(name, check_count if name in SIZE_LIMITS else check_int, lo=1)
        for name in ("moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                     "n_group", "topk_group", "num_nextn_predict_layers"):
            put(name, check_count if name in SIZE_LIMITS else check_int, lo=0)
        put("rms_norm_eps", check_float, lo=0, lo_open=True)  # eps <= 0 divides by zero on a zero row
        put("routed_scaling_factor", check_float, lo=0, lo_open=True)
        put("eos_token_id", check_token_list)
        if self.bos_token_id is not None:
            put("bos_token_id", check_int, lo=0)
        for name in ("norm_topk_prob", "indexer_rope_interleaved", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.rope, RopeConfig):
            problems.append(f"rope must be a RopeConfig, got {type(self.rope).__name__}")
        if problems:  # the checks below assume the types are right
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))
        L = self.num_hidden_layers
        if not self.mlp_layer_types:
            object.__setattr__(self, "mlp_layer_types", tuple(["dense"] * min(3, L) + ["sparse"] * max(L - 3, 0)))
        if not self.indexer_types:
            object.__setattr__(self, "indexer_types", ("full",) * L)
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        if len(self.mlp_layer_types) != L or set(self.mlp_layer_types) - {"dense", "sparse"}:
            problems.append(f"mlp_layer_types must be {L} entries of 'dense'/'sparse', got "
                            f"{_short(self.mlp_layer_types)}")
        if len(self.indexer_types) != L or set(self.indexer_types) - {"full", "shared"}:
            problems.append(f"indexer_types must be {L} entries of 'full'/'shared', got {_short(self.indexer_types)}")
        elif self.indexer_types[0] != "full":
            problems.append("the first layer must have a 'full' indexer (shared layers reuse a previous full layer)")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            problems.append(
                f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and <= index_head_dim ({self.index_head_dim})")
        if "sparse" in self.mlp_layer_types:
            E = self.n_routed_experts
            if self.moe_intermediate_size <= 0 or self.n_shared_experts < 0:
                problems.append(f"MoE layers need moe_intermediate_size > 0 and n_shared_experts >= 0 (got "
                                f"{self.moe_intermediate_size}, {self.n_shared_experts})")
            if E <= 0 or self.num_experts_per_tok <= 0 or self.num_experts_per_tok > E:
                problems.append(f"need 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= n_routed_experts ({E})")
            if self.n_group <= 0 or E % self.n_group:
                problems.append(f"n_routed_experts ({E}) must be divisible by n_group ({self.n_group})")
            elif self.n_group > 1 and E // self.n_group < 2:
                problems.append("group-limited routing needs at least 2 experts per group")
            if not 0 < self.topk_group <= self.n_group:
                problems.append(f"need 0 < topk_group ({self.topk_group}) <= n_group ({self.n_group})")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            problems.append(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    # ----- derived sizes -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_dim(self) -> int:
        """Values cached per token and layer: latent c (C) + rope key kR (R)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """tau = qk_head_dim^-0.5, times mscale^2 under YaRN (as DeepSeek and transformers do)."""
        scale = self.qk_head_dim ** -0.5
        r = self.rope
        if r.rope_type != "default" and r.mscale_all_dim:
            m = yarn_get_mscale(r.factor, r.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def index_score_scale(self) -> float:
        """Positive constant of the indexer score: index_head_dim^-0.5 * index_n_heads^-0.5."""
        return self.index_head_dim ** -0.5 * self.index_n_heads ** -0.5

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def num_indexer_layers(self) -> int:
        return len(self.full_indexer_layers)

    @property
    def indexer_slot(self) -> tuple[int, ...]:
        """For every layer, the index (among full layers) of the indexer whose top-k it uses."""
        slots, cur = [], -1
        for t in self.indexer_types:
            cur += t == "full"
            slots.append(cur)
        return tuple(slots)

    # the config fields behind each part of `parameter_bytes` (what a refusal names)
    PARAMETER_FIELDS = {
        "embeddings": ("vocab_size", "hidden_size"), "LM head": ("vocab_size", "hidden_size"),
        "attention": ("num_attention_heads", "hidden_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                      "v_head_dim"),
        "indexers": ("index_n_heads", "index_head_dim", "q_lora_rank", "hidden_size"),
        "dense MLPs": ("intermediate_size", "hidden_size"),
        "routed experts": ("n_routed_experts", "moe_intermediate_size", "hidden_size"),
        "shared experts": ("n_shared_experts", "moe_intermediate_size", "hidden_size"),
        "norms": ("hidden_size",), "MTP heads": ("num_nextn_predict_layers", "vocab_size", "hidden_size"),
    }

    def parameter_bytes(self, *, mtp: bool = False, itemsize: int | None = None) -> dict[str, int]:
        """Bytes of the parameters `SparseMLAModel(self, mtp=mtp)` holds, by part (keys of `PARAMETER_FIELDS`;
        the layer parts count the MTP layers' blocks too). `itemsize`: bytes per value of the model's dtype
        (default: this config's `dtype`); the MoE routers and the indexers' head weights are float32 whatever it
        is. Pure arithmetic: nothing is built, so it sizes any config (GLM-5: about 1.5 TB in bf16)."""
        w = _ITEMSIZE[self.dtype] if itemsize is None else itemsize
        D, V, Q, H = self.hidden_size, self.vocab_size, self.q_lora_rank, self.num_attention_heads
        C, R, N, Vd = self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim
        I, dI, E, Fm = self.index_n_heads, self.index_head_dim, self.n_routed_experts, self.moe_intermediate_size
        n_mtp = self.num_nextn_predict_layers if mtp else 0
        # an MTP layer's block has its own indexer and the MoE when the model has MoE layers (`model.mtp`)
        kinds = (list(zip(self.indexer_types, self.mlp_layer_types))
                 + [("full", "sparse" if "sparse" in self.mlp_layer_types else "dense")] * n_mtp)
        layers = len(kinds)
        full = sum(t == "full" for t, _ in kinds)
        sparse = sum(m == "sparse" for _, m in kinds)
        attention = D * Q + Q + Q * H * (N + R) + D * (C + R) + C + C * H * (N + Vd) + H * Vd * D
        return {
            "embeddings": V * D * w,
            "LM head": 0 if self.tie_word_embeddings else D * V * w,
            "attention": layers * attention * w,
            "indexers": full * ((Q * I * dI + D * dI + 2 * dI) * w + D * I * 4),
            "dense MLPs": (layers - sparse) * 3 * D * self.intermediate_size * w,
            "routed experts": sparse * (3 * E * D * Fm * w + (D * E + E) * 4),
            "shared experts": sparse * 3 * D * Fm * self.n_shared_experts * w,
            "norms": (2 * layers + 1) * D * w,
            "MTP heads": n_mtp * (3 * D + 2 * D * D + D * V) * w,  # 3 norms, eh_proj, shared_head
        }

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


PRESETS: dict[str, ModelConfig] = {
    "deepseek-v3.2": ModelConfig(
        model_type="deepseek_v32",
        rope=RopeConfig(theta=10000.0, rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                        beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    ),
    "glm-5": ModelConfig(
        model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
        moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64, q_lora_rank=2048,
        kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, n_group=1, topk_group=1,
        rms_norm_eps=1e-5, max_position_embeddings=202752, rope=RopeConfig(theta=1e6), index_n_heads=32,
        index_head_dim=128, index_topk=2048, indexer_rope_interleaved=True,
        indexer_types=glm_indexer_types(78),
    ),
    # Tiny models with the real KV geometry (latent 512, rope 64, indexer 128) for demos and tests.
    "tiny-glm": ModelConfig(
        model_type="glm_moe_dsa", vocab_size=512, hidden_size=128, intermediate_size=256,
        moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=512,
        qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
        rms_norm_eps=1e-5, max_position_embeddings=65536, rope=RopeConfig(theta=1e6), index_n_heads=16,
        index_head_dim=128, index_topk=256, indexer_rope_interleaved=True,
        indexer_types=("full", "shared", "full", "shared"), dtype="float32",
    ),
    "tiny-deepseek": ModelConfig(
        model_type="deepseek_v32", vocab_size=512, hidden_size=128, intermediate_size=256,
        moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=512,
        qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, mlp_layer_types=("dense", "sparse", "sparse"),
        max_position_embeddings=65536,
        rope=RopeConfig(theta=10000.0, rope_type="yarn", factor=16.0, original_max_position_embeddings=4096,
                        mscale=1.0, mscale_all_dim=1.0),
        index_n_heads=16, index_head_dim=128, index_topk=256, dtype="float32",
    ),
}


# The demo's engine model: tiny-glm with a cheaper indexer (4 heads, top-k 64) so that 16 long requests under
# three policies run in minutes on two CPU cores.
PRESETS["demo-glm"] = PRESETS["tiny-glm"].replace(index_n_heads=4, index_topk=64)


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(sorted(PRESETS))}") from None


KV_DTYPES = ("auto", "bf16", "fp8", "float32")
INDEX_DTYPES = ("auto", *QUANTIZED_INDEX_DTYPES)
FETCH_MECHANISMS = ("row", "page")
MISS_ATTENTION = ("single", "split")
HOT_POLICIES = ("lru", "score_ema")
MAX_SPECULATIVE_TOKENS = 8
DEFAULT_HOT_EMA_BETA = 0.9  # score_ema's weight of the past, tuned on held-out traces (`experiments/locality.py`)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The tiered paged KV store: formats and budgets (in pages of 64 tokens).

    kv_dtype: "auto" (the default: the model's dtype — "float32" for float32 and float16 models (float32 holds
      float16 values exactly; there is no float16 pool format), "bf16" for bfloat16 models — so the tiered store
      gives the contiguous path's tokens), "bf16" (latent, rope and indexer keys in bf16), "fp8" (latent e4m3
      with one fp32 scale per 128 values, rope bf16, indexer keys e4m3 of the Hadamard-rotated key with one
      fp32 scale; the indexer then scores in DeepSeek's FP8 emulation), or "float32" (exact).
    index_dtype: how the indexer keys are stored and scored: "auto" (the default: as kv_dtype says), "fp8"
      (e4m3 of the Hadamard-rotated key with one fp32 scale: 132 bytes per key of 128) or "int4" (MXFP4: E2M1
      codes two per byte and one UE8M0 scale per 32 values, 68 bytes per key of 128, as vLLM's and SGLang's
      4-bit indexer caches; the query is quantized alike). The indexer pool shrinks with it; the scores (and so
      the selected rows) follow the format (`experiments/index_dtype_quality.py` measures what int4 costs).
      int4 runs with every kernels choice (the Mosaic indexer reads it for an indexer head dim of 32, 64 or 128).
    device_pages: device KV pool (latent + rope of every layer); hot buffers are lent from it.
    host_pages: pinned-host KV pool (the offloaded tier; every token is mirrored here when `mirror_to_host`).
    index_pages: indexer-key pool (on the device, or in pinned host memory with index_tier="host"; a token's key
      page is never released); default: device + host pages.
    hot_rows: hot-buffer rows per request and indexer group; default 2 * index_topk (must be >= index_topk). A
      request that tiers holds its tail pages and its hot buffer on the device; one larger than the device pool
      just never tiers (preempt and offload use none). The store's arrays, hot-buffer state included, are checked
      against the machine's memory when the store is made (`kv.state.init_store`).
    max_seqs: request slots in the store; max_seq_len: longest sequence a slot can hold.
    fetch: host -> device mechanism for misses: "row" (per indexer group and step, one host-side gather of every
      missing row of every host pool into one packed staging buffer and one H2D copy of it, at the smallest of
      the static sizes `fetch_min_rows`, 2x, 4x, ... B x K rows that holds the misses) or "page" (whole-page H2D
      slices, each needed page once, the needed rows kept).
    fetch_min_rows: the row fetch's smallest staging size (rows); a value >= B x K stages every step at B x K.
    mirror_to_host: write every new row to its host page as it is appended (eviction then needs no copy).
    miss_attention: "single" (one attention pass over every selected row, after the misses are fetched) or
      "split" (attention over the rows already on the device — resident pages and hot-buffer hits — and over
      the fetched misses computed apart and merged by their log-sum-exp, so the first part does not wait for
      the host→device copy; equal to "single" up to float rounding). Needs kernels="reference".
    hot_policy: which hot slot a miss claims (`kv.resolve.resolve`): "lru" (the default; the least recently filled or
      hit slot, as vLLM's and SGLang's HiSparse) or "score_ema" (the slot whose row the indexer has scored lowest
      of late: beside each indexer key the store keeps an exponential moving average e = hot_ema_beta * e +
      (1 - hot_ema_beta) * score of that position's scores, which each step's indexer updates for every position
      it ranks; never-used slots go first, then the lowest average; 4 bytes per token and index layer, counted in
      `StoreSpec.index_row_bytes`). A policy changes where rows are read from, never which rows: the tokens are the
      same under every policy. `experiments/hot_buffer_policies.py` compares them on recorded traces.
    hot_ema_beta: score_ema's weight of the past, in [0, 1) (default 0.9, tuned on held-out traces by
      `experiments/locality.py --tune`); with hot_policy="lru" another value is refused (lru keeps no averages).
    index_tier: where the indexer keys live: "device" (the default; every published HiSparse keeps them there) or
      "host" (the keys in a pinned-host pool, paged by `index_pages` like the device pool they replace, written as
      tokens are appended; the device keeps per page and index layer each dimension's min and max of the scored
      keys in bf16 rounded outward, 4 x index_head_dim bytes per page, from which every score of the page is
      bounded, and each step reads exact keys from the host in bound order, `kv.scoring.index_scores_host`). Exact
      mode (`index_budget_pages` None) reads pages until no unread page's bound reaches the k-th best score read:
      the same top-k as device keys, bit for bit. Needs kernels="reference" and hot_policy="lru".
    index_summary: with index_tier="host", what the device keeps to bound each key page's scores: "box" (the
      default: the per-dimension min / max above) or "rvq" (each key coded before its RoPE by residual vector
      quantization: index_head_dim / 16 - 1 one-byte codes per key and an e4m3 radius of what they leave, the box's
      bytes per token, plus per index layer the codebooks, bf16 [stages, 256, index_head_dim], that the store is
      given when it is made: `index_codebooks.fit_index_codebooks` on calibration text; `Engine(...,
      index_codebooks=...)`). A key's score is bounded by its reconstruction's score widened by |q| x its radius,
      so the bound holds for any codebook and is tight for one fitted to the model's keys: on the trained 8K model
      exact mode reads 60 % of the live pages where the box reads all of them (`experiments/index_tier.py`). Not
      with speculative_tokens (the MTP layer's keys have no codebooks).
    index_budget_pages: with index_tier="host", at most this many pages read per step, request and index layer
      (budgeted mode: the best-bounded pages; the top-k is taken among their positions, a fixed amount of work per
      step; at most index_pages); None (the default) is exact mode.
    index_rank: how budgeted mode ranks the pages it reads: "bound" (the default: best summary bound first) or
      "centre" (best score of the summary's midpoint, (min + max) / 2, first: no bound, no more bytes, a higher
      recall of the exact top-k per page read on the trained models, `experiments/index_tier.py`). Only with
      index_budget_pages set (exact mode reads in bound order: its exactness rests on the bounds).
    speculative_tokens: k, the draft tokens per request and step of multi-token-prediction (MTP) speculative
      decoding (0: none). The store then keeps the model's first MTP layer after its main layers (its own KV
      and indexer pages) and a step verifies k + 1 rows per request, resolved as one union of their top-k, so
      the hot buffer must hold (k + 1) * index_topk rows; the default hot_rows becomes (k + 2) * index_topk,
      the published HiSparse sizing (one top-k of slack for the LRU). An `Engine` takes k from its
      `EngineConfig.speculative_tokens` (which sets its store's); a CacheConfig with another k > 0 is refused there.
    capacity: the store's shapes, when they are to be larger than these budgets (None: the budgets are the
      shapes). The device and host pools, the request slots, the pages per request and the hot buffers are
      allocated at the capacity's sizes, and the budgets above are limits the host bookkeeping enforces inside
      them, so every budget within one capacity runs the same compiled programs: set one capacity for a process
      (or a sweep) and vary the budgets per experiment. Each budget must be at most the capacity's, and the
      formats (kv_dtype, index_dtype, fetch, fetch_min_rows, mirror_to_host, miss_attention, hot_policy, hot_ema_beta,
      index_tier, index_budget_pages, index_rank, index_summary, speculative_tokens) must match.
    """

    kv_dtype: str = "auto"
    index_dtype: str = "auto"
    device_pages: int = 256
    host_pages: int = 1024
    index_pages: int | None = None
    hot_rows: int | None = None
    max_seqs: int = 8
    max_seq_len: int = 8192
    fetch: str = "row"
    fetch_min_rows: int = 256
    mirror_to_host: bool = True
    miss_attention: str = "single"
    hot_policy: str = "lru"
    hot_ema_beta: float = DEFAULT_HOT_EMA_BETA
    index_tier: str = "device"
    index_budget_pages: int | None = None
    index_rank: str = "bound"
    index_summary: str = "box"
    speculative_tokens: int = 0
    capacity: "CacheConfig | None" = None

    # the fields that name one of a few choices, and those choices
    CHOICES = {"kv_dtype": KV_DTYPES, "index_dtype": INDEX_DTYPES, "fetch": FETCH_MECHANISMS,
               "miss_attention": MISS_ATTENTION, "hot_policy": HOT_POLICIES, "index_tier": INDEX_TIERS,
               "index_rank": INDEX_RANKS, "index_summary": INDEX_SUMMARIES}

    def __post_init__(self):
        problems = [f"{name} must be one of {allowed}, got {getattr(self, name)!r}"
                    for name, allowed in self.CHOICES.items() if getattr(self, name) not in allowed]
        if self.index_tier == "host" and self.hot_policy != "lru":
            problems.append(f"index_tier='host' needs hot_policy='lru' (score_ema keeps every position's average "
                            f"score, which needs every key scored each step), got {self.hot_policy!r}")
        elif self.index_tier == "device" and self.index_budget_pages is not None:
            problems.append("index_budget_pages is the read budget of index_tier='host'; with index_tier='device' "
                            f"leave it None, got {self.index_budget_pages!r}")
        if self.index_summary != "box" and self.index_tier != "host":
            problems.append(f"index_summary is what the device keeps of index_tier='host''s key pages; with "
                            f"index_tier={self.index_tier!r} leave it 'box', got {self.index_summary!r}")
        elif self.index_summary == "rvq" and self.speculative_tokens:
            problems.append("index_summary='rvq' does not run with speculative_tokens: the MTP layer's keys have no "
                            "codebooks (`index_codebooks.fit_index_codebooks` fits the main layers')")
        if self.index_rank != "bound" and self.index_budget_pages is None:
            problems.append(f"index_rank ranks the pages budgeted mode reads (index_tier='host' with "
                            f"index_budget_pages set); exact mode reads in bound order, so leave it 'bound', got "
                            f"{self.index_rank!r}")
        put = functools.partial(_checked, self, problems)
        put("hot_ema_beta", check_float, lo=0.0)
        if isinstance(self.hot_ema_beta, float) and self.hot_ema_beta >= 1:
            problems.append(f"hot_ema_beta must be < 1 (the weight of the past), got {self.hot_ema_beta}")
        elif self.hot_policy == "lru" and self.hot_ema_beta != DEFAULT_HOT_EMA_BETA:
            problems.append(f"hot_ema_beta is hot_policy='score_ema''s weight of the past; lru keeps no averages, so "
                            f"leave it at its default {DEFAULT_HOT_EMA_BETA} (got {self.hot_ema_beta})")
        for name in ("device_pages", "max_seqs", "max_seq_len", "fetch_min_rows"):
            put(name, check_int, lo=1)
        put("host_pages", check_int, lo=0)
        put("speculative_tokens", check_int, lo=0, hi=MAX_SPECULATIVE_TOKENS)
        for name in ("index_pages", "hot_rows", "index_budget_pages"):
            if getattr(self, name) is not None:
                put(name, check_int, lo=1)
        if not isinstance(self.mirror_to_host, bool):
            problems.append(f"mirror_to_host must be a bool, got {self.mirror_to_host!r}")
        if not problems and self.index_budget_pages is not None and self.index_budget_pages > self.num_index_pages:
            problems.append(f"index_budget_pages ({self.index_budget_pages}) must be <= index_pages "
                            f"({self.num_index_pages}): a step cannot read more key pages than the pool holds")
        if not problems and self.capacity is not None:
            problems += self._capacity_problems()
        if problems:
            raise ValueError("invalid CacheConfig: " + "; ".join(problems))

    # the fields a capacity fixes for its budgets (formats), and the budgets it bounds
    CAPACITY_FORMATS = ("kv_dtype", "index_dtype", "fetch", "fetch_min_rows", "mirror_to_host", "miss_attention",
                        "hot_policy", "hot_ema_beta", "index_tier", "index_budget_pages", "index_rank", "index_summary",
                        "speculative_tokens")
    CAPACITY_BUDGETS = ("device_pages", "host_pages", "index_pages", "max_seqs", "max_seq_len")  # and hot_rows:
    # its default depends on the model (`hot_rows_for`), so `kv.spec.StoreSpec.create` compares it

    def _capacity_problems(self) -> list[str]:
        cap = self.capacity
        if not isinstance(cap, CacheConfig):
            return [f"capacity must be a CacheConfig, got {type(cap).__name__}"]
        if cap.capacity is not None:
            return ["a capacity has no capacity of its own"]
        out = [f"{k} must be the capacity's ({getattr(cap, k)!r}), got {getattr(self, k)!r}"
               for k in self.CAPACITY_FORMATS if getattr(self, k) != getattr(cap, k)]
        for k in self.CAPACITY_BUDGETS:
            mine, theirs = getattr(self, k), getattr(cap, k)
            if k == "index_pages":
                mine, theirs = self.num_index_pages, cap.num_index_pages
            if mine > theirs:
                out.append(f"{k} ({mine}) exceeds the capacity's ({theirs})")
        return out

    @property
    def shape(self) -> "CacheConfig":
        """The configuration the store's arrays are shaped by: the capacity, or these budgets without one."""
        return self.capacity if self.capacity is not None else self

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_seq_len // PAGE_SIZE)

    @property
    def num_index_pages(self) -> int:
        return self.index_pages if self.index_pages is not None else self.device_pages + self.host_pages

    def kv_dtype_for(self, model: ModelConfig) -> str:
        """The store format for `model`: `kv_dtype`, with "auto" resolved from the model's dtype."""
        if self.kv_dtype != "auto":
            return self.kv_dtype
        return "bf16" if model.dtype == "bfloat16" else "float32"

    def index_dtype_for(self, model: ModelConfig) -> str:
        """The indexer keys' stored format for `model`: "fp8", "int4", or (unquantized) "bf16" / "float32";
        `index_dtype`, with "auto" following `kv_dtype_for`."""
        return self.kv_dtype_for(model) if self.index_dtype == "auto" else self.index_dtype

    def hot_rows_for(self, model: ModelConfig) -> int:
        """Hot-buffer rows per request and indexer group: `hot_rows`, or 2 * index_topk by default ((k + 2) *
        index_topk with k speculative tokens). One step can miss every row it selects — index_topk, or
        (k + 1) * index_topk for k + 1 verified rows — so fewer is refused."""
        k = self.speculative_tokens
        hr = self.hot_rows if self.hot_rows is not None else (k + 2 if k else 2) * model.index_topk
        need = (k + 1) * model.index_topk
        if hr < need:
            what = "one step can miss every selected row" if not k else (
                f"a step verifies {k + 1} rows per request and can miss every row of their union")
            raise ValueError(f"hot_rows ({hr}) must be >= {'' if not k else f'{k + 1} x '}index_topk ({need}): "
                             f"{what}")
        return hr

    def replace(self, **kw) -> "CacheConfig":
        return dataclasses.replace(self, **kw)

    def with_formats(self, **formats) -> "CacheConfig":
        """These budgets with the formats (`CAPACITY_FORMATS` fields) changed, their capacity's too: how an engine
        imposes a format on a user's cache (e.g. preempt keeps no host mirror) whether or not it has a capacity."""
        unknown = sorted(set(formats) - set(self.CAPACITY_FORMATS))
        if unknown:
            raise ValueError(f"with_formats changes formats only ({', '.join(self.CAPACITY_FORMATS)}), got {unknown}")
        capacity = None if self.capacity is None else self.capacity.replace(**formats)
        return dataclasses.replace(self, **formats, capacity=capacity)
