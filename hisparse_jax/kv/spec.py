"""`StoreSpec`: the static geometry of a tiered store (pure Python + NumPy: the host bookkeeping needs it, and
it must not need jax), and what follows from its limits alone: `check_batch_fits` (whether requests can ever fit
them) and `min_device_pages`. The store's arrays themselves are `kv.state.KVStore`."""

from __future__ import annotations

import dataclasses
import functools

import ml_dtypes
import numpy as np

from hisparse_jax.config import CacheConfig, ModelConfig
from hisparse_jax.formats import rvq_stages
from hisparse_jax.units import PAGE_SIZE

FP8_BLOCK = 128  # latent values per fp8 scale
MXFP4_BLOCK = 32  # indexer-key values per UE8M0 scale of the int4 (MXFP4) layout
# index_tier="host": the device's per-page key summaries (`KVStore.index_lo` / `index_hi`), rounded outward
SUMMARY_DTYPE = np.dtype(ml_dtypes.bfloat16)


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """Static geometry of a store (hashable; passed to jitted functions as a static argument)."""

    num_layers: int
    num_indexer_layers: int
    groups: tuple[tuple[int, ...], ...]  # layers of each indexer group, leader first
    latent_dim: int
    rope_dim: int
    index_dim: int
    device_pages: int
    index_pages: int
    host_pages: int
    max_seqs: int
    max_pages: int
    hot_rows: int
    kv_dtype: str
    fetch: str
    fetch_min_rows: int
    mirror_to_host: bool
    topk: int
    miss_attention: str = "single"
    mtp_layers: int = 0  # MTP layers kept after the main layers (speculative decoding), each its own group
    index_dtype: str = "float32"  # the indexer keys' stored format: "fp8", "int4", "bf16" or "float32"
    hot_policy: str = "lru"  # which hot slot a miss claims: "lru" or "score_ema" (`CacheConfig.hot_policy`)
    hot_ema_beta: float = 0.9  # score_ema's weight of the past
    index_tier: str = "device"  # where the indexer keys live: "device" or "host" (`CacheConfig.index_tier`)
    index_budget_pages: int | None = None  # index_tier="host": pages read per step, request and layer (None: exact)
    index_rank: str = "bound"  # budgeted mode's page order: "bound" or "centre" (`CacheConfig.index_rank`)
    index_summary: str = "box"  # index_tier="host": the device's bound of a key page, "box" or "rvq" (`CacheConfig`)

    @classmethod
    def create(cls, model: ModelConfig, cache: CacheConfig) -> "StoreSpec":
        """The geometry of `cache`'s store for `model`: its capacity's when it has one (`CacheConfig.capacity`),
        else its own budgets'. `PageManager.budget_spec` is `create` of the budgets alone."""
        if cache.capacity is not None:
            hr, cap = cache.hot_rows_for(model), cache.capacity.hot_rows_for(model)
            if hr > cap:
                raise ValueError(f"invalid CacheConfig: hot_rows ({hr}) exceeds the capacity's ({cap})")
            return cls.create(model, cache.capacity)
        kv_dtype = cache.kv_dtype_for(model)
        if kv_dtype == "fp8" and (model.kv_lora_rank % FP8_BLOCK or model.index_head_dim != FP8_BLOCK):
            raise ValueError(f"the fp8 layout needs kv_lora_rank a multiple of {FP8_BLOCK} and index_head_dim == "
                             f"{FP8_BLOCK} (got {model.kv_lora_rank}, {model.index_head_dim})")
        index_dtype = cache.index_dtype_for(model)
        dI = model.index_head_dim
        if index_dtype in ("fp8", "int4") and (dI & (dI - 1) or (index_dtype == "int4" and dI % MXFP4_BLOCK)):
            raise ValueError(f"index_dtype={index_dtype!r} needs index_head_dim a power of two (the Hadamard "
                             f"rotation){f' and a multiple of {MXFP4_BLOCK}' if index_dtype == 'int4' else ''} "
                             f"(got {dI})")
        if cache.index_summary == "rvq" and (rvq_stages(dI) < 1 or model.qk_rope_head_dim > dI):
            raise ValueError(f"index_summary='rvq' needs index_head_dim >= 32 (one code per 16 dimensions, less one "
                             f"for the radius) holding the {model.qk_rope_head_dim} rope dimensions (got {dI})")
        groups, cur = [], []
        for i, t in enumerate(model.indexer_types):
            if t == "full" and cur:
                groups.append(tuple(cur))
                cur = []
            cur.append(i)
        groups.append(tuple(cur))
        # speculative decoding: the first MTP layer (a full-indexer layer, applied at every draft depth) is
        # stored after the main layers — store layer L, indexer layer LI — as a group of its own
        mtp = 1 if cache.speculative_tokens else 0
        if mtp and getattr(model, "num_nextn_predict_layers", 0) < 1:
            raise ValueError(f"speculative_tokens={cache.speculative_tokens} needs a model with MTP layers "
                             "(num_nextn_predict_layers >= 1 in its config); this one has none")
        L = model.num_hidden_layers
        groups += [(L + i,) for i in range(mtp)]
        return cls(num_layers=L + mtp, num_indexer_layers=model.num_indexer_layers + mtp,
                   groups=tuple(groups), latent_dim=model.kv_lora_rank, rope_dim=model.qk_rope_head_dim,
                   index_dim=model.index_head_dim, device_pages=cache.device_pages,
                   index_pages=cache.num_index_pages, host_pages=cache.host_pages, max_seqs=cache.max_seqs,
                   max_pages=cache.max_pages_per_seq, hot_rows=cache.hot_rows_for(model), kv_dtype=kv_dtype,
                   fetch=cache.fetch, fetch_min_rows=cache.fetch_min_rows, mirror_to_host=cache.mirror_to_host,
                   topk=model.index_topk, miss_attention=cache.miss_attention, mtp_layers=mtp,
                   index_dtype=index_dtype, hot_policy=cache.hot_policy, hot_ema_beta=cache.hot_ema_beta,
                   index_tier=cache.index_tier, index_budget_pages=cache.index_budget_pages,
                   index_rank=cache.index_rank, index_summary=cache.index_summary)

    @property
    def hot_pages(self) -> int:
        return -(-self.hot_rows // PAGE_SIZE)

    @property
    def fp8(self) -> bool:
        return self.kv_dtype == "fp8"

    @property
    def index_scaled(self) -> bool:
        """Whether the indexer keys carry scales (`index_scale`): the fp8 and int4 layouts."""
        return self.index_dtype in ("fp8", "int4")

    @property
    def index_key_bytes(self) -> int:
        """Bytes of one token's indexer key in one index layer: fp8 dI + a 4-byte scale, int4 dI / 2 + dI / 32 (68
        for dI = 128), else dI values of the value dtype. With index_tier="host" it is what a page read moves per
        token."""
        dI = self.index_dim
        if self.index_dtype == "fp8":
            return dI + 4
        if self.index_dtype == "int4":
            return dI // 2 + dI // MXFP4_BLOCK
        return dI * (4 if self.index_dtype == "float32" else 2)

    @property
    def index_row_bytes(self) -> float:
        """Device bytes of one token in one index layer: its indexer key (`index_key_bytes`) and with
        hot_policy="score_ema" the 4-byte average of its scores (`KVStore.index_ema`); with index_tier="host" only
        its summary: its share of its page's box (`KVStore.index_lo` / `index_hi`: 2 x dI bf16 per 64 tokens) or its
        "rvq" codes and radius (`KVStore.index_codes` / `index_radius`: one byte each), dI / 16 bytes either way (the
        "rvq" codebooks are a fixed cost per index layer, `kv.account.store_layout`)."""
        if self.index_tier == "host" and self.index_summary == "rvq":
            return self.index_stages + 1
        if self.index_tier == "host":
            return 2 * SUMMARY_DTYPE.itemsize * self.index_dim / PAGE_SIZE
        return self.index_key_bytes + (4 if self.hot_policy == "score_ema" else 0)

    @property
    def index_stages(self) -> int:
        """index_summary="rvq": the codes per key (`formats.rvq_stages`: dI / 16 - 1); 0 otherwise."""
        return rvq_stages(self.index_dim) if self.index_summary == "rvq" else 0

    @property
    def index_dtypes(self) -> tuple[np.dtype, np.dtype | None]:
        """(key dtype, scale dtype or None): the values the indexer pools hold — fp8: e4m3 keys + a float32 scale,
        int4: uint8 codes (two per byte) + uint8 UE8M0 scales, else float32 / bf16 keys (`state.init_store`'s
        layout; a host-tier pool holds their bits, `state.host_dtype`)."""
        if self.index_dtype == "fp8":
            return np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.float32)
        if self.index_dtype == "int4":
            return np.dtype(np.uint8), np.dtype(np.uint8)
        return np.dtype(np.float32 if self.index_dtype == "float32" else ml_dtypes.bfloat16), None

    @property
    def index_host_row_bytes(self) -> int:
        """Pinned-host bytes of one token in one index layer: its key with index_tier="host", else none."""
        return self.index_key_bytes if self.index_tier == "host" else 0

    @property
    def index_read_chunk(self) -> int:
        """index_tier="host": key pages read per round of a step's bound-ordered reads (and exact mode's first
        read): twice the pages one top-k fills, at least 1."""
        return max(1, 2 * -(-self.topk // PAGE_SIZE))

    @property
    def value_dtype(self):
        """dtype of the stored latent / rope / indexer values (before fp8 quantization)."""
        return np.dtype(np.float32) if self.kv_dtype == "float32" else np.dtype(ml_dtypes.bfloat16)

    @functools.cached_property
    def group_of_layer(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for g, layers in enumerate(self.groups):
            for layer in layers:
                out[layer] = g
        return tuple(out)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's KV row in one layer (what a miss moves per layer)."""
        if self.fp8:
            return self.latent_dim + 4 * (self.latent_dim // FP8_BLOCK) + 2 * self.rope_dim
        return self.value_dtype.itemsize * (self.latent_dim + self.rope_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page in one layer."""
        return PAGE_SIZE * self.row_bytes


TAIL_PAGES = 2  # a request's last pages (being written) are never evicted


class BudgetError(ValueError):
    """A request can never fit the configured budgets (raised before anything is changed)."""


def min_device_pages(limits: StoreSpec, num_pages: int, *, releasable: bool) -> int:
    """Device pages a request of `num_pages` logical pages needs at the least: all of them, or (when pages
    can be evicted to the host) its last `TAIL_PAGES` plus its hot buffer, whichever is fewer."""
    return min(num_pages, TAIL_PAGES + limits.hot_pages) if releasable else num_pages


def check_batch_fits(limits: StoreSpec, num_tokens: list[int], *, releasable: bool) -> None:
    """Raise BudgetError (naming the budget, what is needed and by how much it falls short) unless requests holding
    `num_tokens` KV positions each at their longest (prompt + new tokens - 1: the last sampled token is never
    written) fit at once the request slots, `max_seq_len`, the indexer pool, the host pool (every page mirrored) and
    the device pool (all pages, or tail pages + a hot buffer when pages are `releasable`). A pure function of the
    `limits` (`PageManager.budget_spec`), checked before anything changes. Exact: every smaller budget of that tier
    fails, and a batch that passes decodes to the end (pages are only ever added, and the cheapest way to hold a
    request never grows by more than the page it adds)."""
    n = [-(-t // PAGE_SIZE) for t in num_tokens]
    if len(n) > limits.max_seqs:
        raise BudgetError(f"max_seqs is too small: {len(n)} requests need {len(n)} request slots; max_seqs is "
                          f"{limits.max_seqs}, {len(n) - limits.max_seqs} short")
    if too_long := [t for t in num_tokens if t > limits.max_pages * PAGE_SIZE]:
        raise BudgetError(f"max_seq_len is too small: a request needs {too_long[0]} KV positions; the store "
                          f"holds {limits.max_pages * PAGE_SIZE} per request")
    dev = [min_device_pages(limits, k, releasable=releasable) for k in n]
    for name, have, need, how in (
            ("index_pages", limits.index_pages, n, "indexer pages (every page's keys are kept, " +
             ("in the host tier)" if limits.index_tier == "host" else "on the device)")),
            ("host_pages", limits.host_pages, n if limits.mirror_to_host else [],
             "host pages (every page is mirrored to the host)"),
            ("device_pages", limits.device_pages, dev,
             "device pages (no page can be released)" if dev == n and not releasable else
             f"device pages at the least (all pages, or {TAIL_PAGES} tail pages + {limits.hot_pages} hot-buffer "
             "pages, whichever is fewer)")):
        if sum(need) > have:
            what = (f"a {num_tokens[0]}-token request ({n[0]} pages)" if len(n) == 1 else
                    f"{len(n)} requests of {num_tokens} tokens ({n} pages)")
            parts = " + ".join(str(x) for x in need) + " = " if len(need) > 1 else ""
            raise BudgetError(f"{name} is too small: {what} need{'s' if len(n) == 1 else ''} {parts}{sum(need)} "
                              f"{how}; {name} is {have}, {sum(need) - have} short")
