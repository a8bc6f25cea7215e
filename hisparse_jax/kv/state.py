"""The tiered paged KV store: a pytree of device pools, pinned-host pools, tables and hot buffers.

Layout (P device pages, PI indexer pages, PH host pages, all of 64 tokens; Rq request slots,
MP pages per request, G indexer groups, HR hot rows):

    latent   [L, P, 64, C]     device KV pool: MLA latent c (bf16 / f32, or e4m3 + latent_scale [L, P, 64, C/128])
    rope     [L, P, 64, R]     device KV pool: rope key kR (bf16 / f32)
    index_k  [LI, PI, 64, dI]  device indexer keys (`StoreSpec.index_dtype`: bf16 / f32; e4m3 + index_scale
                               f32[LI, PI, 64] for fp8; int4: uint8 [LI, PI, 64, dI/2] MXFP4 codes + index_scale
                               uint8 [LI, PI, 64, dI/32] UE8M0); never evicted
    h_latent [L, PH, 64, C]    pinned-host KV pool (+ h_latent_scale), same page shape, stored as the bits of
    h_rope   [L, PH, 64, R]    the device pool's values: uint16 for bf16, uint8 for e4m3, float32 as is
                               (`host_dtype`; convert with `to_host_bits` / `from_host_bits`)
    block_table int32[Rq, MP]  device page of each logical page, -1 when not resident
    host_table  int32[Rq, MP]  host page of each logical page, -1 when it has none
    index_table int32[Rq, MP]  indexer page of each logical page (always present for written tokens)
    seq_lens    int32[Rq]      tokens stored per request
    hot_pages   int32[Rq, NH]  device pages lent to the request's hot buffer (NH = ceil(HR / 64)), -1 = none
    hot_token   int32[Rq, G, HR] the position each hot slot holds (-1 empty), per indexer group
    hot_stamp   int32[Rq, G, HR] the step that last filled (2 * clock) or hit (2 * clock + 1) each slot, -1
                               never: the LRU order is (stamp, slot), pallas_kernels/sparse_gather/reference.py
    clock       int32[]        the step counter hot_stamp and page_stamp refer to
    page_stamp  int32[Rq, MP]  last step the indexer selected a position of each logical page (-1 never):
                               per-page access recency, for free, for the coldness policies
    index_ema   f32[LI, PI, 64] hot_policy="score_ema" only (else None): beside each indexer key, the moving
                               average of the indexer's scores of that position (NaN: not scored yet, set when
                               the key is written); the hot buffer's victims are its slots' lowest averages
    index_lo    bf16[LI, PI, dI] index_tier="host" only (else None): index_k / index_scale then live in pinned-host
    index_hi    bf16[LI, PI, dI] memory (as host-pool bits, `host_dtype`), and the device keeps per indexer page
                               each dimension's min / max of the scored keys written to it (`ops.scored_keys`,
                               rounded outward to `SUMMARY_DTYPE`), the summary `index_scores_host` bounds the
                               page's scores with

One page id means the same page in every layer. A hot page serves every indexer group at once: layer l
stores the rows of *its* group's slots in it, so G groups cost one set of pages. Hot slot j of a request
lives at (hot_pages[j // 64], j % 64). Layers of a group (a full indexer layer and the shared layers
after it) share their leader's top-k and hence its hot-slot plan.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from hisparse_jax.memory import Cost, abstract, check_account
from hisparse_jax.units import PAGE_SIZE

from hisparse_jax.kv.pool import POOL_BYTES_PER_PAGE
from hisparse_jax.kv.spec import FP8_BLOCK, MXFP4_BLOCK, SUMMARY_DTYPE, StoreSpec  # noqa: F401  (re-exported)


# ----- host pool storage: floats narrower than 32 bits are kept as their bit patterns ------------------------
# XLA:CPU's bf16 normalization runs an in-place dynamic_update_slice / scatter / gather on a bf16 (or f16 / fp8)
# operand as convert-to-f32 + f32 op + convert back, over the WHOLE operand: on a host pool, O(host pool) per row
# written or fetched. The host pools therefore hold unsigned integers of the same width (exact bit patterns, NaN
# payloads included); values become bits on the device right before they are put in host memory, and bits
# become values right after a row / page is copied out of it. float32 (and wider) pools are stored as they are.
def host_dtype(dtype) -> jnp.dtype:
    """The storage dtype of a host pool holding values of `dtype`: uintN for an N-bit float with N < 32,
    `dtype` itself otherwise."""
    dt = jnp.dtype(dtype)
    if jnp.issubdtype(dt, jnp.floating) and dt.itemsize < 4:
        return jnp.dtype(f"uint{8 * dt.itemsize}")
    return dt


def to_host_bits(x):
    """Values -> what a host pool stores (`host_dtype(x.dtype)`): a bitcast, or `x` itself for float32."""
    dt = host_dtype(x.dtype)
    if dt == x.dtype:
        return x
    return x.view(dt) if isinstance(x, np.ndarray) else jax.lax.bitcast_convert_type(x, dt)


def from_host_bits(bits, dtype):
    """What a host pool stores -> values of `dtype` (the device pool's dtype): the inverse of `to_host_bits`.
    Accepts jax arrays (inside or outside jit) and numpy arrays."""
    dt = jnp.dtype(dtype)
    if bits.dtype != host_dtype(dt):
        raise TypeError(f"host pool bits of dtype {bits.dtype} cannot hold {dt} values (want {host_dtype(dt)})")
    if bits.dtype == dt:
        return bits
    return bits.view(dt) if isinstance(bits, np.ndarray) else jax.lax.bitcast_convert_type(bits, dt)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVStore:
    latent: jax.Array
    rope: jax.Array
    index_k: jax.Array
    h_latent: jax.Array
    h_rope: jax.Array
    block_table: jax.Array
    host_table: jax.Array
    index_table: jax.Array
    seq_lens: jax.Array
    hot_pages: jax.Array
    hot_token: jax.Array
    hot_stamp: jax.Array
    clock: jax.Array
    page_stamp: jax.Array
    latent_scale: jax.Array | None = None
    index_scale: jax.Array | None = None
    h_latent_scale: jax.Array | None = None
    index_ema: jax.Array | None = None
    index_lo: jax.Array | None = None
    index_hi: jax.Array | None = None
    spec: StoreSpec | None = dataclasses.field(default=None, metadata={"static": True})


def host_sharding(device=None) -> SingleDeviceSharding:
    device = device or jax.devices()[0]
    return SingleDeviceSharding(device, memory_kind="pinned_host")


def device_sharding(device=None) -> SingleDeviceSharding:
    device = device or jax.devices()[0]
    return SingleDeviceSharding(device, memory_kind="device")


def store_shardings(spec: StoreSpec, device=None) -> KVStore:
    """A KVStore of shardings: host pools (and with index_tier="host" the indexer keys) in pinned_host memory,
    everything else on the device (`store_memory_kinds`)."""
    by_kind = {"device": device_sharding(device), "host": host_sharding(device)}
    return jax.tree.map(by_kind.get, store_memory_kinds(spec))


def store_shapes(spec: StoreSpec) -> KVStore:
    """A KVStore of (shape, dtype) pairs (None where the spec has no such array): what `init_store` allocates."""
    L, LI, P, PI = spec.num_layers, spec.num_index_layers, spec.device_pages, spec.index_pages
    # a host tier of no pages (preempt never offloads) still has one physical page, never lent: the step's miss
    # path gathers from the host pools whatever the policy, and a gather from an empty axis cannot be traced
    PH = max(1, spec.host_pages)
    C, R, dI, Rq, MP = spec.latent_dim, spec.rope_dim, spec.index_dim, spec.max_seqs, spec.max_pages
    G, HR = len(spec.groups), spec.hot_rows
    vdt = spec.value_dtype
    kdt = jnp.float8_e4m3fn if spec.fp8 else vdt
    kvals, svals = spec.index_dtypes  # the indexer keys' layout (`StoreSpec.index_dtype`)
    host_keys = spec.index_tier == "host"
    as_stored = host_dtype if host_keys else jnp.dtype  # a pinned-host pool holds the keys' bits
    key_shape, scale_shape = {
        "fp8": ((LI, PI, PAGE_SIZE, dI), (LI, PI, PAGE_SIZE)),
        "int4": ((LI, PI, PAGE_SIZE, dI // 2), (LI, PI, PAGE_SIZE, dI // MXFP4_BLOCK)),
    }.get(spec.index_dtype, ((LI, PI, PAGE_SIZE, dI), None))
    index_k = (key_shape, as_stored(kvals))
    index_scale = None if svals is None else (scale_shape, as_stored(svals))
    return KVStore(
        spec=spec, latent=((L, P, PAGE_SIZE, C), kdt), rope=((L, P, PAGE_SIZE, R), vdt),
        index_k=index_k, h_latent=((L, PH, PAGE_SIZE, C), host_dtype(kdt)),
        h_rope=((L, PH, PAGE_SIZE, R), host_dtype(vdt)), block_table=((Rq, spec.max_pages), jnp.int32),
        host_table=((Rq, MP), jnp.int32), index_table=((Rq, MP), jnp.int32), seq_lens=((Rq,), jnp.int32),
        hot_pages=((Rq, spec.hot_pages), jnp.int32), hot_token=((Rq, G, HR), jnp.int32),
        hot_stamp=((Rq, G, HR), jnp.int32), clock=((), jnp.int32), page_stamp=((Rq, MP), jnp.int32),
        latent_scale=((L, P, PAGE_SIZE, C // FP8_BLOCK), jnp.float32) if spec.fp8 else None,
        index_scale=index_scale,
        h_latent_scale=((L, PH, PAGE_SIZE, C // FP8_BLOCK), host_dtype(jnp.float32)) if spec.fp8 else None,
        index_ema=((LI, PI, PAGE_SIZE), jnp.float32) if spec.hot_policy == "score_ema" else None,
        index_lo=((LI, PI, dI), SUMMARY_DTYPE) if host_keys else None,
        index_hi=((LI, PI, dI), SUMMARY_DTYPE) if host_keys else None,
    )


def init_store(spec: StoreSpec, device=None) -> KVStore:
    """An empty store: zeroed pools (host pools in pinned_host memory), tables of -1."""
    shapes = store_shapes(spec)
    shardings = store_shardings(spec, device)
    if not abstract():
        check_store_memory(spec, device=device)
    minus_one = {"block_table", "host_table", "index_table", "hot_pages", "hot_token", "hot_stamp", "page_stamp"}
    out = {}
    for f in dataclasses.fields(KVStore):
        if f.name == "spec":
            continue
        sd = getattr(shapes, f.name)
        if sd is None:
            out[f.name] = None
            continue
        shape, dt = sd
        fill = (-1 if f.name in minus_one else jnp.nan if f.name == "index_ema" else
                jnp.inf if f.name == "index_lo" else -jnp.inf if f.name == "index_hi" else 0)
        out[f.name] = jax.device_put(jnp.full(shape, fill, dt), getattr(shardings, f.name))
    return KVStore(spec=spec, **out)


# the CacheConfig fields each array's size follows (named when an account does not fit)
_SIZED_BY = {"latent": ("device_pages",), "rope": ("device_pages",), "latent_scale": ("device_pages",),
             "index_k": ("index_pages",), "index_scale": ("index_pages",), "index_ema": ("index_pages",),
             "index_lo": ("index_pages",), "index_hi": ("index_pages",),
             "h_latent": ("host_pages",), "h_rope": ("host_pages",), "h_latent_scale": ("host_pages",),
             "hot_token": ("hot_rows", "max_seqs"), "hot_stamp": ("hot_rows", "max_seqs"),
             "hot_pages": ("hot_rows", "max_seqs")}

# Temporaries of the step's hot-buffer resolve per (step row x hot slot): each row resolves against its request's
# whole hot buffer (`pallas_kernels/sparse_gather/reference.py`: the slots' tags and stamps gathered per row,
# sorted twice, ranked), so the step's temporaries grow as step rows x hot_rows. XLA's memory analysis (CPU) of
# the resolver alone gives 41.1 bytes per row and slot (B 16-256, hot_rows 4096-65536); of the compiled engine
# step, 39-59 (demo-glm, two indexer groups, B 8-32, hot_rows 4096-131072) and 40.1 (a one-layer model,
# `tests/test_red_team.py::test_step_temporaries_formula`, which keeps the bound honest).
RESOLVE_BYTES_PER_ROW_SLOT = 64


def _sizes(spec: StoreSpec, names: tuple[str, ...]) -> str:
    values = {"max_seqs": spec.max_seqs, "max_seq_len": spec.max_pages * PAGE_SIZE}
    return " x ".join(f"{n}={values.get(n, getattr(spec, n, None)):,}" for n in names)


def store_costs(spec: StoreSpec, *, step_rows: int = 0) -> list[Cost]:
    """The memory account of a store of geometry `spec`, pure arithmetic (nothing is allocated): its arrays
    (`store_shapes`: device pools, tables and hot-buffer state on the device; pinned-host pools in RAM), the host
    bookkeeping `kv.manager.TieredCache` keeps (`PagePool`'s per-page counts, the per-page recency stamps), and
    with `step_rows` > 0 the temporaries a step of that many batch rows makes in resolving them against the hot
    buffers (`RESOLVE_BYTES_PER_ROW_SLOT`)."""
    shapes, kinds = store_shapes(spec), store_memory_kinds(spec)
    out = []
    for f in dataclasses.fields(KVStore):
        sd = None if f.name == "spec" else getattr(shapes, f.name)
        if sd is None:
            continue
        n = int(np.prod(sd[0], dtype=object)) * np.dtype(sd[1]).itemsize
        out.append(Cost(f"the store's {f.name}", n, getattr(kinds, f.name),
                        _sizes(spec, _SIZED_BY.get(f.name, ("max_seqs", "max_seq_len")))))
    pages = spec.device_pages + spec.index_pages + spec.host_pages
    out.append(Cost("the page pools' bookkeeping", POOL_BYTES_PER_PAGE * pages, "host",
                    _sizes(spec, ("device_pages", "index_pages", "host_pages")).replace(" x ", " + ")))
    out.append(Cost("the per-page recency stamps", 4 * spec.max_seqs * spec.max_pages, "host",
                    _sizes(spec, ("max_seqs", "max_seq_len"))))
    if step_rows:
        n = RESOLVE_BYTES_PER_ROW_SLOT * step_rows * spec.hot_rows
        out.append(Cost("the step's hot-buffer resolve temporaries", n, "device",
                        f"{_sizes(spec, ('hot_rows',))} x {step_rows} step rows"))
    return out


def store_memory_kinds(spec: StoreSpec) -> KVStore:
    """Where each store array lives, without a device: a KVStore of "device" / "host" (None where the spec has no
    such array): host pools (and with index_tier="host" the indexer keys) in pinned-host memory."""
    d, h = "device", "host"
    k = h if spec.index_tier == "host" else d
    summary = d if spec.index_tier == "host" else None
    return KVStore(spec=spec, latent=d, rope=d, index_k=k, h_latent=h, h_rope=h, block_table=d, host_table=d,
                   index_table=d, seq_lens=d, hot_pages=d, hot_token=d, hot_stamp=d, clock=d, page_stamp=d,
                   latent_scale=d if spec.fp8 else None, index_scale=k if spec.index_scaled else None,
                   h_latent_scale=h if spec.fp8 else None, index_ema=d if spec.hot_policy == "score_ema" else None,
                   index_lo=summary, index_hi=summary)


def check_store_memory(spec: StoreSpec, *, step_rows: int = 0, ranks: int = 1, also: tuple[Cost, ...] = (),
                       device=None) -> None:
    """Refuse (ValueError), before any of it exists, a store whose account (`store_costs`, plus `also`: e.g. the
    model's replicas on a mesh) does not fit: per device against the device's memory, `ranks` stores' host
    parts against this machine's RAM (`memory.check_account`), naming the bytes, the limit, the largest part and
    the CacheConfig sizes it follows."""
    check_account("the KV store", store_costs(spec, step_rows=step_rows) + list(also), device=device, ranks=ranks)


def store_nbytes(store: KVStore) -> dict[str, int]:
    """Bytes held per memory kind."""
    out: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(store):
        kind = leaf.sharding.memory_kind if hasattr(leaf, "sharding") else "device"
        out[kind] = out.get(kind, 0) + leaf.nbytes
    return out
