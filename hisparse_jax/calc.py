"""Running-request capacity per data-parallel replica: all-GPU KV (baseline) vs Hybrid HiSparse.

A re-derivation of vLLM's published HiSparse concurrency calculator
(vllm-project.github.io `assets/interactive_pages/hisparse_concurrency_calculator.html`, the
"Concurrency vs. sequence length" version the GLM-5.3 blog embeds). Pure Python; no jax.

Per replica, with pages of 64 tokens, `n = ceil(seq/64)` and KV HBM `kv` GiB per GPU:
  kv        = round1(gpu_GB*1e9/2^30*util - shared/TP - routed/(DP*TP if EP else TP) - reserve)
  baseline  = min(max_seqs, floor(floor(kv*2^30/B_base) / n))
  gpu_limit = floor(floor(kv*2^30/B_gpu) / (n + G*ceil(hot_rows/64) + G*retained + other))
  host_lim  = floor(floor(host_gib*2^30/B_host) / n)
  hisparse  = max(baseline, min(max_seqs, gpu_limit, host_lim))
`round1` is the calculator's 0.1-GiB slider step (17.8 GiB for GLM-5.3, H200, DP1 TP8 EP).
The `n` term of `gpu_limit` is right: the indexer group stays GPU-resident and one shared-pool
block holds 64 tokens of *all* full-indexer layers' keys. Each of the G hot groups leases
ceil(hot_rows/64) blocks per request and keeps `retained` = 2 active tail pages resident.
The minimum non-limiting host pool is `min(max_seqs, gpu_limit) * n * B_host` bytes (0 when that
does not beat the baseline); the calculator shows it rounded up to whole GiB (134 at 80K) and
uses that, clamped to [16, 4096] GiB, as its default host pool.

Block bytes (one 64-token block; L = 78 layers, F = 21 "full" indexer layers for GLM-5.3):

  quantity                                   FP8         BF16
  MLA row / token / layer (c 512 + kR 64)    576 B       1,152 B   (1 or 2 B per element)
  indexer key / token / full layer           132 B       132 B     (128 e4m3 + fp32 scale; stays FP8)
  host      = 64*L*row                       2,875,392   5,750,784 (44,928 = 78*576 B per token)
  baseline  = host + 64*F*132                3,052,800   5,928,192 (+177,408 = 21*132*64)
  indexer-group page 64*F*132                177,408     177,408
  largest hot group (4 layers * 64*row)      147,456     294,912
  HiSparse GPU = max(the two) rounded up     184,320     294,912   (5*36,864 / 4*73,728)
                 to whole per-layer pages

Hot groups follow vLLM's `hisparse/layout.py`: each index-share unit (a full layer plus the shared
layers after it: {0}, {1}, {2..5}, ..., {74..77}) is packed greedily into groups whose summed
page stays <= the indexer-group page, giving [0,1] + 19 groups of 4 = 20 groups, and the shared
pool's block is the largest group page. That gives 177,408 for FP8, not the published 184,320;
the round-up to whole per-layer MLA pages (5 * 36,864) is inferred from the constants (some block
stride alignment in vLLM's allocator, not located in the source read), exact for BF16 too.
Two departures from FACTS.md: the published FP8 row is 576 B, not FlashMLA's 656-B "ds_mla" row
(78*656*64 = 3,274,752 != 2,875,392; pass `mla_fp8_layout="ds_mla"` for it), and the BF16
constants keep the 132-B FP8 indexer key (pass `indexer_dtype="bf16"` for 256 B).

Indexer key dtype (`index_dtype`, CLI `--index-dtype {fp8,int4}`; fp8 is the default and gives the numbers above).
"int4" stores the indexer key in 4 bits with the accounting of the peers' MXFP4 indexer caches: vLLM PR #48558
("MXFP4 indexer cache for GLM-5.2 / DSA": E2M1 values + UE8M0 block-32 scales, 132 -> 68 B per token and head,
~1.94x) and SGLang PR #30546 (`--enable-dsa-fp4-indexer`, a port of DeepSeek-V4's: E2M1 elements + packed UE8M0
group-32 scales = 68 B per token and layer, "~48%" smaller). Per token and full layer that is d/2 bytes of packed
4-bit values plus one 1-byte scale per 32 elements: 64 + 4 = 68 B for d = index_head_dim = 128 (FP8: 128 + 4).
The block bytes are then derived from the preset's KV shape as above (the FP8 derivation reproduces the published
constants exactly): GLM-5.3 int4 has an indexer page of 64*21*68 = 91,392 B, below the largest hot group's
4*36,864 = 147,456 B, so the shared pool's block becomes that hot-group page (147,456, a 1.25x smaller block than
184,320) and the baseline block loses 64*21*64 = 86,016 B (3,052,800 -> 2,966,784). The hot groups stay 20: an
index-share unit is never split, and the ones of 4 layers already overflow the smaller indexer page.

The cost of the capacity: HiSparse copies each hot-buffer miss from the host pool every decode step. Per running
request and step the expected H2D bytes are (1 - hit_rate) * min(top_k, seq) rows * L layers * MLA row bytes
(= (1 - hit_rate) * min(top_k, seq) * host/64, since one host block holds 64 tokens of all L layers' rows); per
replica, times the HiSparse running requests (0 when HiSparse runs everything resident, limiting = "baseline").
Indexer keys in the host tier (`index_tier="host"`, CLI `--index-tier host`; no published system does this): the
keys of every full layer move to the host pool beside the KV rows (a host block grows by the indexer page); the GPU
keeps a summary per token and full layer (default a bf16 min and max per dimension per 64-token page,
`index_summary_bytes`: 8 B at d = 128, 168 B per token for GLM-5.3's 21 full layers against 2,772 for the fp8
keys, as the store keeps them: `CacheConfig(index_tier="host")`) and a request's hot and tail KV pages; with the
"unified" layout HiSparse's GPU blocks are then host blocks, the summaries of a request counted in them rounded up;
with "split" (this project's store: the summaries in the indexer pool) the blocks are one page's summaries.
`index_summary="rvq"` (CLI `--index-summary rvq`, the store's `CacheConfig(index_summary="rvq")`) keeps per key
m = d / 16 - 1 one-byte residual-VQ codes and an e4m3 radius instead (the same 8 B at d = 128), plus m codebooks of
256 bf16 centroids of d per full layer on every GPU, like the rest of the pool: 448 KiB at d = 128, 9,633,792 B for
GLM-5.3, taken off HiSparse's GPU pool (`index_codebook_bytes`). Each step reads `index_read_fraction` of every full
layer's keys of each request from the host (default 1: on the trained model an exact top-k from min / max page bounds
read every page, and ranking pages by their mean key still needs ~60 % of them for recall 0.9; with "rvq" the store's
exact mode read 60 % of the pages on the 8K model, `--index-read-fraction 0.6`; `experiments/index_tier.py`), added to
the H2D bytes. At 1M tokens that gives 51 running requests per replica (10x the device tier's 5, GPU-limited) with
2,376 GiB of host pool, but 2.9 GB of keys to read per request and step: 3 s per step at 50 GB/s; the read fraction
would have to fall to ~3 % for 100 ms.

Every TP rank holds the whole latent KV (the calculator's per-GPU pool is the replica's), so each rank copies all of
it over its own host link: copy time per step = bytes / link_gb_per_s (1 GB = 1e9 B), ranks in parallel. The
default hit rate is the project's measured one (`experiments/results/demo.json`, policy "hisparse": 0.734 on the
tiny stdlib-dsa model, a CPU run; `DEFAULT_HIT_RATE` when that file is absent); the default link is 50 GB/s, about
what a pinned-host copy reaches on PCIe Gen5 x16 (64 GB/s per direction on paper). Not modelled: contention for
host DRAM bandwidth when all ranks of a node copy at once, and overlap of the copy with compute.
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field, replace
from decimal import ROUND_HALF_UP, Decimal
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

from hisparse_jax.formats import (INDEX_SUMMARIES, INDEX_TIERS, QUANTIZED_INDEX_DTYPES, RVQ_SIZE, glm_indexer_types,
                                  rvq_stages)
from hisparse_jax.units import PAGE_SIZE
GPU_MEMORY_GB = {"h200": 141, "b200": 180, "b300": 288}  # decimal GB per GPU, as published
HOST_SLIDER_GIB = (16, 4096)  # the calculator's host-pool slider range (GiB per DP replica)
# Sweep points: powers of two 8K..1M plus the blog's 74,160-token first turn, the ~86K context
# after 12 more turns of 753 + 220 tokens (74,160 + 12*973 = 85,836), and the 142,000 admission limit.
SWEEP_SEQS = tuple(sorted({2 ** k for k in range(13, 21)} | {74_160, 85_836, 142_000}))
# "unified": one GPU block size for indexer pages and hot pages (vLLM's shared pool, the published calculator);
# "split": the indexer keys in a pool of their own and the hot / tail KV pages (all layers) in another, as this
# project's store keeps them (`index_pages` apart from `device_pages`)
LAYOUTS = ("unified", "split")
DEFAULT_TOP_K = 2048            # DSA / GLM-5.x index_topk
DEFAULT_LINK_GB_PER_S = 50.0    # host -> GPU link per GPU (GB/s, 1e9 B): ~ a pinned copy on PCIe Gen5 x16
# The hot-buffer hit rate `hisparse demo` measured (experiments/results/demo.json, policies.hisparse.hit_rate,
# 0.7341 on the stdlib-dsa model); used when that file is not there to read (an installed package).
DEFAULT_HIT_RATE = 0.734
DEMO_RESULTS = Path(__file__).resolve().parent.parent / "experiments" / "results" / "demo.json"


class CalcError(ValueError):
    """Invalid calculator input (the CLI prints it and exits 2)."""


@dataclass(frozen=True)
class BlockBytes:
    """Bytes of one 64-token block: baseline GPU pool, HiSparse shared GPU pool, HiSparse host pool."""
    baseline: int
    hisparse_gpu: int
    host: int


def indexer_row_bytes(index_head_dim: int, index_dtype: str = "fp8") -> int:
    """Bytes of one token's indexer key in one full layer: fp8 = d e4m3 + one fp32 scale per 128 (132 for d=128);
    int4 = d/2 packed 4-bit values + one UE8M0 byte per 32 (68 for d=128, the MXFP4 layout of vLLM #48558 and
    SGLang #30546); bf16 = 2d."""
    d = index_head_dim
    if index_dtype == "fp8":
        return d + 4 * (-(-d // 128))
    if index_dtype == "int4":
        return -(-d // 2) + -(-d // 32)
    if index_dtype == "bf16":
        return 2 * d
    raise CalcError(f"index dtype must be one of fp8, int4, bf16, got {index_dtype!r}")


@dataclass(frozen=True)
class BlockLayout:
    """How one 64-token block is made up for a model config (all sizes in bytes)."""
    layers: int            # L, sparse-MLA layers (host rows per token)
    full_layers: int       # F, layers with their own indexer keys
    mla_row: int           # bytes per token per layer of c + kR
    indexer_row: int       # bytes per token per full layer of the indexer key
    hot_group_layers: tuple[int, ...]  # layers in each HiSparse hot/resident group
    index_dim: int = 128   # d, the indexer head dim

    @property
    def host(self) -> int:
        return PAGE_SIZE * self.layers * self.mla_row

    @property
    def indexer_page(self) -> int:
        return PAGE_SIZE * self.full_layers * self.indexer_row

    @property
    def baseline(self) -> int:
        return self.host + self.indexer_page

    @property
    def hisparse_gpu_unpadded(self) -> int:
        return max(self.indexer_page, PAGE_SIZE * self.mla_row * max(self.hot_group_layers))

    @property
    def hisparse_gpu(self) -> int:
        layer_page = PAGE_SIZE * self.mla_row
        return -(-self.hisparse_gpu_unpadded // layer_page) * layer_page

    @property
    def hot_groups(self) -> int:
        return len(self.hot_group_layers)

    @property
    def block_bytes(self) -> BlockBytes:
        return BlockBytes(self.baseline, self.hisparse_gpu, self.host)


def block_layout(cfg: Any, kv_dtype: str = "fp8", *, mla_fp8_layout: str = "fp8",
                 indexer_dtype: str = "fp8") -> BlockLayout:
    """Derive the block layout from a config exposing num_hidden_layers, kv_lora_rank,
    qk_rope_head_dim, index_head_dim and indexer_types ("full"/"shared" per layer)."""
    c, r, d = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    rows = {"bf16": 2 * (c + r), "fp8": c + r, "ds_mla": c + 4 * (-(-c // 128)) + 2 * r}  # ds_mla: 656 B
    if (kv_dtype not in ("fp8", "bf16") or indexer_dtype not in ("fp8", "int4", "bf16")
            or mla_fp8_layout not in ("fp8", "ds_mla")):
        raise CalcError(f"bad dtype/layout: {kv_dtype!r}, {mla_fp8_layout!r}, indexer {indexer_dtype!r}")
    mla_row = rows["bf16"] if kv_dtype == "bf16" else rows[mla_fp8_layout]
    idx_row = indexer_row_bytes(d, indexer_dtype)  # FP8: 128 e4m3 + fp32 scale; int4: 64 + 4 UE8M0
    types = tuple(cfg.indexer_types) or ("full",) * cfg.num_hidden_layers
    if len(types) != cfg.num_hidden_layers:
        raise CalcError(f"indexer_types has {len(types)} entries for {cfg.num_hidden_layers} layers")
    full = sum(t == "full" for t in types)
    units: list[int] = []  # layers per index-share unit (a full layer and the shared ones after it)
    for i, t in enumerate(types):
        if t == "full" or i == 0:
            units.append(0)
        units[-1] += 1
    limit = PAGE_SIZE * full * idx_row  # vLLM packs units while the group page <= indexer page
    groups: list[int] = []
    for u in units:
        if groups and (groups[-1] + u) * PAGE_SIZE * mla_row <= limit:
            groups[-1] += u
        else:
            groups.append(u)
    return BlockLayout(cfg.num_hidden_layers, full, mla_row, idx_row, tuple(groups), d)


def block_bytes(cfg: Any, kv_dtype: str = "fp8", **kw: str) -> BlockBytes:
    """BlockBytes(baseline, hisparse_gpu, host) for a model config; see `block_layout`."""
    return block_layout(cfg, kv_dtype, **kw).block_bytes


# KV shape of GLM-5.3 as the published constants imply it (78 layers, 21 full indexers).
GLM53_KV_SHAPE = SimpleNamespace(num_hidden_layers=78, kv_lora_rank=512, qk_rope_head_dim=64,
                                 index_head_dim=128, indexer_types=glm_indexer_types(78))


def explain_block_bytes(cfg: Any = GLM53_KV_SHAPE) -> str:
    """A text table of the block-byte derivation for `cfg` in FP8 and BF16."""
    out = [f"{'per 64-token block (bytes)':34}{'fp8':>12}{'bf16':>12}"]
    lay = {dt: block_layout(cfg, dt) for dt in ("fp8", "bf16")}
    for label, key in [("MLA row / token / layer", "mla_row"), ("indexer row / token / layer", "indexer_row"),
                       ("layers L / full indexers F", None), ("host = 64*L*row", "host"),
                       ("indexer page = 64*F*idx_row", "indexer_page"), ("baseline = host + indexer", "baseline"),
                       ("hot groups", "hot_groups"), ("GPU block before page round-up", "hisparse_gpu_unpadded"),
                       ("HiSparse GPU block", "hisparse_gpu")]:
        vals = [f"{lay[dt].layers}/{lay[dt].full_layers}" if key is None else f"{getattr(lay[dt], key):,}"
                for dt in ("fp8", "bf16")]
        out.append(f"{label:34}{vals[0]:>12}{vals[1]:>12}")
    return "\n".join(out)


@dataclass(frozen=True)
class ModelPreset:
    """Model constants: weights in GiB (shared ones split over TP, routed experts over DP*TP with EP)."""
    name: str
    shared_weights_gib: float
    routed_expert_weights_gib: float
    fp8: BlockBytes
    bf16: BlockBytes
    hot_groups: int
    num_attention_heads: int
    # The KV shape (as `block_layout` takes it) the block bytes come from; needed for index_dtype="int4".
    kv_shape: Any = field(default=None, compare=False, repr=False)
    # The FP8 MLA row the block bytes count: "fp8" (c + r bytes, the published constants) or "ds_mla" (FlashMLA's
    # and this project's store: c e4m3 + an fp32 scale per 128 + r bf16 = 656 B)
    mla_fp8_layout: str = "fp8"

    def blocks(self, kv_dtype: str, index_dtype: str = "fp8") -> BlockBytes:
        """The block bytes; fp8 indexer keys: the preset's constants, int4: derived from `kv_shape`."""
        return self.layout(kv_dtype, index_dtype)[0]

    def layout(self, kv_dtype: str, index_dtype: str = "fp8") -> tuple[BlockBytes, int, BlockLayout | None]:
        """(block bytes, hot groups, the derived layout or None for the fp8 constants of a shapeless preset)."""
        if kv_dtype not in ("fp8", "bf16"):
            raise CalcError(f"kv_dtype must be 'fp8' or 'bf16', got {kv_dtype!r}")
        if index_dtype not in QUANTIZED_INDEX_DTYPES:
            raise CalcError(f"index_dtype must be one of {', '.join(QUANTIZED_INDEX_DTYPES)}, got {index_dtype!r}")
        if index_dtype == "fp8":
            lay = None if self.kv_shape is None else block_layout(self.kv_shape, kv_dtype,
                                                                  mla_fp8_layout=self.mla_fp8_layout)
            return (self.fp8 if kv_dtype == "fp8" else self.bf16), self.hot_groups, lay
        if self.kv_shape is None:
            raise CalcError(f"preset {self.name!r} has no KV shape to derive int4 indexer block bytes from")
        lay = block_layout(self.kv_shape, kv_dtype, mla_fp8_layout=self.mla_fp8_layout, indexer_dtype=index_dtype)
        return lay.block_bytes, lay.hot_groups, lay


def preset_from_config(cfg: Any, name: str, shared_weights_gib: float, routed_expert_weights_gib: float,
                       mla_fp8_layout: str = "fp8") -> ModelPreset:
    """A preset whose block bytes and hot-group count are derived from `cfg`; its FP8 row is `mla_fp8_layout`'s
    ("fp8": c + r bytes, as the published constants count it; "ds_mla": 656 B, as this project's store keeps it)."""
    fp8 = block_layout(cfg, "fp8", mla_fp8_layout=mla_fp8_layout)
    bf16 = block_layout(cfg, "bf16")
    return ModelPreset(name, shared_weights_gib, routed_expert_weights_gib, fp8.block_bytes,
                       bf16.block_bytes, fp8.hot_groups, int(getattr(cfg, "num_attention_heads", 1)), kv_shape=cfg,
                       mla_fp8_layout=mla_fp8_layout)


PRESETS: dict[str, ModelPreset] = {
    "glm-5.3-blog": ModelPreset("glm-5.3-blog", 19.556, 684.167, BlockBytes(3_052_800, 184_320, 2_875_392),
                                BlockBytes(5_928_192, 294_912, 5_750_784), hot_groups=20, num_attention_heads=64,
                                kv_shape=GLM53_KV_SHAPE),
}


@cache
def _demo_hit_rate(path: str) -> float | None:
    try:
        with open(path, encoding="utf-8") as f:
            rate = json.load(f)["policies"]["hisparse"]["hit_rate"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(rate) if isinstance(rate, (int, float)) and 0 <= rate <= 1 else None


def default_hit_rate() -> tuple[float, str]:
    """(hit rate, where it came from): the HiSparse hot-buffer hit rate measured in `experiments/results/demo.json`
    when that file is there, else DEFAULT_HIT_RATE."""
    rate = _demo_hit_rate(str(DEMO_RESULTS))
    if rate is None:
        return DEFAULT_HIT_RATE, "default"
    return rate, "experiments/results/demo.json"


@dataclass(frozen=True)
class CalcInput:
    """Calculator inputs; defaults are the published calculator's (GLM-5.3, H200, DP1 TP8 EP, 80K).

    host_gib: host pool per DP replica; None = the calculator's default (minimum non-limiting pool
    rounded up to whole GiB, clamped to [16, 4096]); math.inf = unlimited (the calculator's chart).
    A finite pool is capped at system_ram_gib / (DP, times TP unless TP ranks share one pool).
    groups: hot/resident groups; None = the preset's. kv_hbm_gib: override of the HBM estimate.
    index_dtype: indexer key storage, "fp8" (132 B/token/layer, the published constants) or "int4" (68 B).
    hit_rate (None = `default_hit_rate()`), top_k and link_gb_per_s: the H2D copy cost per decode step.
    """
    preset: str | ModelPreset = "glm-5.3-blog"
    gpu: str = "h200"
    dp: int = 1
    tp: int = 8
    ep: bool = True
    kv_dtype: str = "fp8"
    seq: int = 81_920
    hot_rows: int = 4096
    groups: int | None = None
    retained: int = 2
    other: int = 0
    host_gib: float | None = None
    max_seqs: int = 1024
    gpu_memory_utilization: float = 0.92
    reserve_gib: float = 15.0
    kv_hbm_gib: float | None = None
    round_kv_hbm: bool = True
    system_ram_gib: float = 4096.0
    share_host_across_tp: bool = True
    index_dtype: str = "fp8"
    hit_rate: float | None = None
    top_k: int = DEFAULT_TOP_K
    link_gb_per_s: float = DEFAULT_LINK_GB_PER_S
    layout: str = "unified"
    index_tier: str = "device"
    index_read_fraction: float = 1.0
    index_summary_bytes: float | None = None
    index_summary: str = "box"  # index_tier "host": the GPU's summary, "box" (min / max per page) or "rvq" (codes)


@dataclass(frozen=True)
class CalcResult:
    """Capacity per DP replica (requests) and the quantities behind it (GiB, blocks, bytes)."""
    baseline_running: int
    hisparse_running: int
    hisparse_gpu_limit: int
    hisparse_host_limit: int | None  # None: unlimited host pool
    min_host_gib: float              # exact minimum non-limiting host pool per replica
    min_host_gib_published: int      # the same rounded up to whole GiB, as the calculator shows it
    host_gib: float                  # host pool actually applied
    kv_hbm_gib: float
    weights_per_gpu_gib: float
    limiting: str                    # "gpu" | "host" | "max_seqs" | "baseline"
    block_bytes: BlockBytes
    groups: int
    baseline_pool_blocks: int
    hisparse_pool_blocks: int
    baseline_blocks_per_request: int
    hisparse_gpu_blocks_per_request: int
    host_blocks_per_request: int
    baseline_total: int              # x DP
    hisparse_total: int
    index_dtype: str                 # "fp8" | "int4"
    indexer_bytes_per_token_layer: int | None  # one token's key in one full layer (None: preset without a shape)
    indexer_bytes_per_token: int     # all full layers: (baseline - host block) / 64
    hit_rate: float                  # hot-buffer hit rate the H2D figures assume
    hit_rate_source: str             # "input" | "experiments/results/demo.json" | "default"
    top_k: int
    link_gb_per_s: float
    h2d_bytes_per_request_step: float  # (1 - hit) * min(top_k, seq) * host/64 (expected; fractional)
    h2d_bytes_per_step: float        # x HiSparse running requests (0 when limiting == "baseline"); per GPU
    h2d_ms_per_step: float           # h2d_bytes_per_step / link
    inputs: CalcInput = field(repr=False)
    layout: str = "unified"          # "split": HiSparse's GPU blocks are indexer pages (block_bytes.hisparse_gpu),
    # a request's hot and tail KV pages (all layers, host-block sized) counted in them, rounded up
    index_tier: str = "device"       # "host": the keys in the host tier; HiSparse's GPU blocks are host blocks
    index_read_fraction: float = 1.0  # index_tier "host": the part of a request's key history read per step
    index_summary_bytes_per_token: float = 0.0  # index_tier "host": the GPU's summary, all full layers
    index_h2d_bytes_per_request_step: float = 0.0  # index_tier "host": the keys read per request and step
    index_codebook_bytes: int = 0    # index_summary "rvq": the codebooks of every full layer per GPU, off the GPU pool

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        inp = d.pop("inputs")
        if isinstance(self.inputs.preset, ModelPreset):
            inp["preset"] = self.inputs.preset.name
        d["inputs"] = inp
        return d


def get_preset(preset: str | ModelPreset) -> ModelPreset:
    if isinstance(preset, ModelPreset):
        return preset
    if preset not in PRESETS:
        raise CalcError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    return PRESETS[preset]


# The largest value each count and size of a `CalcInput` may take (the command's options are bounded alike): far
# above any deployment the calculator describes (GLM-5's 202752 positions, 8-GPU nodes, 4096 hot rows), low enough
# that every result is a meaningful number (`--seq 1e30` used to be accepted and reported as 0 requests fitting).
# reserve_gib and kv_hbm_gib need none: each is bounded by the GPU's memory (`_check`).
LIMITS = {"seq": 2 ** 30, "dp": 1 << 16, "tp": 1 << 10, "hot_rows": 2 ** 31 - 1, "max_seqs": 1 << 24,
          "groups": 1 << 10, "retained": 1 << 20, "other": 1 << 20, "top_k": 1 << 24,
          "host_gib": float(1 << 30), "link_gb_per_s": 1e6,
          "index_summary_bytes": float(1 << 20)}
COUNTS = ("seq", "dp", "tp", "hot_rows", "max_seqs", "groups", "retained", "other", "top_k")


def _check(inp: CalcInput, model: ModelPreset) -> None:
    if inp.gpu not in GPU_MEMORY_GB:
        raise CalcError(f"unknown gpu {inp.gpu!r}; known: {', '.join(GPU_MEMORY_GB)}")
    for name in COUNTS:  # whole numbers (a count of 2.5 GPUs means nothing), never a bool
        v = getattr(inp, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
            raise CalcError(f"{name} must be a whole number, got {v!r}")
    for name in ("seq", "dp", "tp", "hot_rows", "max_seqs"):
        if getattr(inp, name) < 1:
            raise CalcError(f"{name} must be positive, got {getattr(inp, name)}")
    for name in ("retained", "other"):
        if getattr(inp, name) < 0:
            raise CalcError(f"{name} must be >= 0, got {getattr(inp, name)}")
    for name, hi in LIMITS.items():
        v = getattr(inp, name)
        if v is not None and v > hi and not (name == "host_gib" and v == math.inf):
            raise CalcError(f"{name} must be <= {hi:g} (hisparse_jax.calc.LIMITS), got {v:g}")
    if inp.top_k > inp.hot_rows:
        raise CalcError(f"top_k ({inp.top_k}) must be <= hot_rows ({inp.hot_rows}): one step can miss every row it "
                        f"selects, and each miss needs a hot-buffer row (as the store requires)")
    if not 0 <= inp.reserve_gib < math.inf:
        raise CalcError(f"reserve_gib must be finite and >= 0, got {inp.reserve_gib}")
    hbm = GPU_MEMORY_GB[inp.gpu] * 1e9 / 2 ** 30
    if inp.kv_hbm_gib is not None and not 0 < inp.kv_hbm_gib <= hbm:
        raise CalcError(f"kv_hbm_gib must be > 0 and at most the {inp.gpu}'s {hbm:.1f} GiB, got {inp.kv_hbm_gib}")
    if inp.groups is not None and inp.groups < 1:
        raise CalcError(f"groups must be positive, got {inp.groups}")
    if inp.host_gib is not None and not inp.host_gib >= 0:
        raise CalcError(f"host_gib must be >= 0, got {inp.host_gib}")
    if not 0 < inp.gpu_memory_utilization <= 1:
        raise CalcError(f"gpu_memory_utilization must be in (0, 1], got {inp.gpu_memory_utilization}")
    if model.num_attention_heads % inp.tp:
        raise CalcError(f"tp={inp.tp} does not divide the {model.num_attention_heads} attention heads")
    if inp.index_dtype not in QUANTIZED_INDEX_DTYPES:
        raise CalcError(f"index_dtype must be one of {', '.join(QUANTIZED_INDEX_DTYPES)}, got {inp.index_dtype!r}")
    if inp.hit_rate is not None and not 0 <= inp.hit_rate <= 1:
        raise CalcError(f"hit_rate must be in [0, 1], got {inp.hit_rate}")
    if inp.top_k < 1:
        raise CalcError(f"top_k must be positive, got {inp.top_k}")
    if not 0 < inp.link_gb_per_s < math.inf:
        raise CalcError(f"link_gb_per_s must be finite and > 0, got {inp.link_gb_per_s}")
    if inp.layout not in LAYOUTS:
        raise CalcError(f"layout must be one of {', '.join(LAYOUTS)}, got {inp.layout!r}")
    if inp.layout == "split" and model.kv_shape is None:
        raise CalcError(f"layout='split' needs a preset with a KV shape; {model.name!r} has none")
    if inp.index_tier not in INDEX_TIERS:
        raise CalcError(f"index_tier must be one of {', '.join(INDEX_TIERS)}, got {inp.index_tier!r}")
    if inp.index_tier == "host" and model.kv_shape is None:
        raise CalcError(f"index_tier='host' needs a preset with a KV shape; {model.name!r} has none")
    if not 0 <= inp.index_read_fraction <= 1:
        raise CalcError(f"index_read_fraction must be in [0, 1], got {inp.index_read_fraction}")
    if inp.index_summary_bytes is not None and not 0 <= inp.index_summary_bytes < math.inf:
        raise CalcError(f"index_summary_bytes must be finite and >= 0, got {inp.index_summary_bytes}")
    if inp.index_summary not in INDEX_SUMMARIES:
        raise CalcError(f"index_summary must be one of {', '.join(INDEX_SUMMARIES)}, got {inp.index_summary!r}")
    if inp.index_summary != "box" and inp.index_tier != "host":
        raise CalcError(f"index_summary={inp.index_summary!r} is what the GPU keeps of index_tier='host''s keys; with "
                        f"index_tier={inp.index_tier!r} leave it 'box'")


def weights_per_gpu_gib(model: ModelPreset, dp: int, tp: int, ep: bool) -> float:
    """Model weights per GPU (GiB): shared / TP + routed experts / (DP*TP with EP, else TP)."""
    return model.shared_weights_gib / tp + model.routed_expert_weights_gib / (dp * tp if ep else tp)


def max_requests(inp: CalcInput) -> CalcResult:
    """Baseline and HiSparse running requests per DP replica; raises CalcError on bad input."""
    model = get_preset(inp.preset)
    _check(inp, model)
    bb, preset_groups, lay = model.layout(inp.kv_dtype, inp.index_dtype)
    groups = preset_groups if inp.groups is None else inp.groups
    weights = weights_per_gpu_gib(model, inp.dp, inp.tp, inp.ep)
    budget = GPU_MEMORY_GB[inp.gpu] * 1e9 / 2 ** 30 * inp.gpu_memory_utilization
    kv = budget - weights - inp.reserve_gib if inp.kv_hbm_gib is None else inp.kv_hbm_gib
    if inp.kv_hbm_gib is None and inp.round_kv_hbm and kv > 0:  # (a huge negative kv would overflow Decimal)
        kv = float(Decimal(kv).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))
    if kv <= 0:
        raise CalcError(f"no HBM left for KV: {inp.gpu} x{inp.gpu_memory_utilization} gives {budget:.1f} GiB/GPU, "
                        f"weights need {weights:.1f} GiB/GPU and the reserve {inp.reserve_gib:g} GiB "
                        f"(raise TP, enable EP or pick a larger GPU)")
    n = -(-inp.seq // PAGE_SIZE)
    base_pool = math.floor(kv * 2 ** 30 / bb.baseline)
    baseline = min(inp.max_seqs, base_pool // n)
    summary = idx_h2d = 0.0
    host_block, codebooks = bb.host, 0
    if inp.index_tier == "host":  # the keys move to the host tier; the GPU holds their summaries
        summary = lay.full_layers * (index_summary_bytes(lay, inp.index_summary) if inp.index_summary_bytes is None
                                     else inp.index_summary_bytes)  # per token, all full layers
        codebooks = index_codebook_bytes(lay, inp.index_summary)
        kv_pages = -(-inp.hot_rows // PAGE_SIZE) + inp.retained + inp.other
        if inp.layout == "split":  # blocks = summary pages (one 64-token page's summaries) beside the KV pages
            page = max(1, round(PAGE_SIZE * summary))
            bb = BlockBytes(bb.baseline, page, bb.host)
            per_req = n + -(-kv_pages * bb.host // page)
        else:  # blocks = host blocks (a KV page of all layers), a request's summaries rounded up to whole blocks
            bb = BlockBytes(bb.baseline, bb.host, bb.host)
            per_req = kv_pages + math.ceil(n * PAGE_SIZE * summary / bb.host)
        host_block = bb.host + lay.indexer_page  # a page of KV rows and of keys
        idx_h2d = inp.index_read_fraction * n * lay.indexer_page
    elif inp.layout == "split":  # blocks = indexer pages; a KV page of all layers is bb.host bytes of them
        bb = BlockBytes(bb.baseline, lay.indexer_page, bb.host)
        kv_pages = -(-inp.hot_rows // PAGE_SIZE) + inp.retained + inp.other
        per_req = n + -(-kv_pages * bb.host // lay.indexer_page)
    else:
        per_req = n + groups * -(-inp.hot_rows // PAGE_SIZE) + groups * inp.retained + inp.other
    gpu_pool = max(0, math.floor((kv * 2 ** 30 - codebooks) / bb.hisparse_gpu))  # the codebooks: HiSparse's alone
    gpu_limit = gpu_pool // per_req
    target = min(inp.max_seqs, gpu_limit)
    min_host = target * n * host_block / 2 ** 30 if target > baseline else 0.0
    host = inp.host_gib
    if host is None:
        host = float(min(HOST_SLIDER_GIB[1], max(HOST_SLIDER_GIB[0], math.ceil(min_host))))
    if not math.isinf(host):  # the calculator caps each replica's pool by the system RAM budget
        host = min(host, inp.system_ram_gib / (inp.dp * (1 if inp.share_host_across_tp else inp.tp)))
    host_limit = None if math.isinf(host) else math.floor(host * 2 ** 30 / host_block) // n
    offloaded = min(target, gpu_limit if host_limit is None else host_limit)
    hisparse = max(baseline, offloaded)
    if baseline > 0 and baseline >= offloaded:
        limiting = "baseline"
    elif host_limit is not None and host_limit < target:
        limiting = "host"
    else:
        limiting = "gpu" if gpu_limit < inp.max_seqs else "max_seqs"
    if inp.hit_rate is None:
        hit, hit_source = default_hit_rate()
    else:
        hit, hit_source = inp.hit_rate, "input"
    per_req_h2d = h2d_bytes_per_request_step(hit, min(inp.top_k, inp.seq), bb.host // PAGE_SIZE) + idx_h2d
    h2d = 0.0 if limiting == "baseline" else per_req_h2d * hisparse
    return CalcResult(baseline, hisparse, gpu_limit, host_limit, min_host, math.ceil(min_host), host, kv, weights,
                      limiting, bb, groups, base_pool, gpu_pool, n, per_req, n, baseline * inp.dp,
                      hisparse * inp.dp, index_dtype=inp.index_dtype,
                      indexer_bytes_per_token_layer=None if lay is None else lay.indexer_row,
                      indexer_bytes_per_token=(bb.baseline - bb.host) // PAGE_SIZE, hit_rate=hit,
                      hit_rate_source=hit_source, top_k=inp.top_k, link_gb_per_s=inp.link_gb_per_s,
                      h2d_bytes_per_request_step=per_req_h2d, h2d_bytes_per_step=h2d,
                      h2d_ms_per_step=h2d / (inp.link_gb_per_s * 1e9) * 1e3, inputs=inp, layout=inp.layout,
                      index_tier=inp.index_tier, index_read_fraction=inp.index_read_fraction,
                      index_summary_bytes_per_token=summary, index_h2d_bytes_per_request_step=idx_h2d,
                      index_codebook_bytes=codebooks)


def index_summary_bytes(lay: BlockLayout, summary: str = "box") -> float:
    """The GPU's summary of one token's indexer key in one full layer with the keys in the host tier: "box", a bf16
    min and max per dimension per 64-token page (`reference.key_block_bounds`), 2 * 2 * d / 64 bytes (8 at d = 128);
    "rvq", `rvq_stages(d)` one-byte codes and an e4m3 radius, d / 16 bytes (8 at d = 128)."""
    if summary == "rvq":
        return rvq_stages(lay.index_dim) + 1
    return 2 * 2 * lay.index_dim / PAGE_SIZE


def index_codebook_bytes(lay: BlockLayout, summary: str = "box") -> int:
    """The GPU's fixed bytes of the "rvq" summary per GPU: `rvq_stages(d)` codebooks of RVQ_SIZE bf16 centroids of d
    per full layer (448 KiB at d = 128), every full layer's on each GPU like the KV pool; 0 for "box"."""
    if summary != "rvq":
        return 0
    return lay.full_layers * rvq_stages(lay.index_dim) * RVQ_SIZE * lay.index_dim * 2


def h2d_bytes_per_request_step(hit_rate: float, rows: int, bytes_per_token: int) -> float:
    """Expected host->GPU bytes one request copies per decode step: the misses of `rows` selected tokens
    ((1 - hit_rate) of them) times one token's MLA rows over all layers (L * row = host block / 64)."""
    return (1.0 - hit_rate) * rows * bytes_per_token


def sweep(inp: CalcInput, seqs: Sequence[int] = SWEEP_SEQS) -> list[dict[str, Any]]:
    """Capacity at each sequence length (tokens), other inputs unchanged. With host_gib=None each
    point gets its own minimum non-limiting host pool, as the calculator's chart assumes."""
    keys = ("baseline_running", "hisparse_running", "hisparse_gpu_limit", "hisparse_host_limit",
            "min_host_gib", "limiting", "baseline_total", "hisparse_total", "index_dtype",
            "h2d_bytes_per_step", "h2d_ms_per_step")
    rows = []
    for s in seqs:
        d = max_requests(replace(inp, seq=int(s))).to_dict()
        rows.append({"seq": int(s), **{k: d[k] for k in keys}})
    return rows
