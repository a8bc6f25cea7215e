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
                               each dimension's min / max of the scored keys written to it (`codec.scored_keys`,
                               rounded outward to `SUMMARY_DTYPE`), the summary `index_scores_host` bounds the
                               page's scores with (index_summary="box")
    index_codes uint8[LI, PI, 64, m]  index_summary="rvq" in place of index_lo / index_hi: each key's m codes (m =
    index_radius e4m3[LI, PI, 64]     `StoreSpec.index_stages`) and residual radius (`reference.rvq_encode` of the
                               scored key in the model's frame, `codec.model_frame_keys`), from
    index_codebooks bf16[LI, m, 256, dI]  the index layer's codebooks and the rope frequencies the key is un-rotated
    index_rope_freq f32[R/2]   with (given to the store when it is made, `kv.device.new_store`; zeros in an empty
                               store: true bounds, none tight)

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

from hisparse_jax.memory import abstract

from hisparse_jax.kv.account import check_store_memory, store_layout
from hisparse_jax.kv.spec import StoreSpec


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
    index_codes: jax.Array | None = None
    index_radius: jax.Array | None = None
    index_codebooks: jax.Array | None = None
    index_rope_freq: jax.Array | None = None
    spec: StoreSpec | None = dataclasses.field(default=None, metadata={"static": True})

    def replace(self, **fields) -> "KVStore":
        """This store with `fields` replaced (a new pytree; the arrays not named are shared)."""
        return dataclasses.replace(self, **fields)

    def device_pools(self) -> tuple:
        """The device KV pools that exist, in one order: (latent, rope[, latent_scale])."""
        return tuple(p for p in (self.latent, self.rope, self.latent_scale) if p is not None)

    def host_pools(self) -> tuple:
        """The pinned-host KV pools that exist, in `device_pools`' order: (h_latent, h_rope[, h_latent_scale])."""
        return tuple(p for p in (self.h_latent, self.h_rope, self.h_latent_scale) if p is not None)

    def with_device_pools(self, pools) -> "KVStore":
        """This store with its device KV pools replaced by `pools` (`device_pools`' order)."""
        return self.replace(**dict(zip(("latent", "rope", "latent_scale"), pools)))

    def with_host_pools(self, hosts) -> "KVStore":
        """This store with its pinned-host KV pools replaced by `hosts` (`host_pools`' order)."""
        return self.replace(**dict(zip(("h_latent", "h_rope", "h_latent_scale"), hosts)))


def host_sharding(device=None) -> SingleDeviceSharding:
    device = device or jax.devices()[0]
    return SingleDeviceSharding(device, memory_kind="pinned_host")


def device_sharding(device=None) -> SingleDeviceSharding:
    device = device or jax.devices()[0]
    return SingleDeviceSharding(device, memory_kind="device")


def store_shardings(spec: StoreSpec, device=None) -> KVStore:
    """A KVStore of shardings: host pools (and with index_tier="host" the indexer keys) in pinned_host memory,
    everything else on the device (`kv.account.store_layout`)."""
    by_kind = {"device": device_sharding(device), "host": host_sharding(device)}
    return KVStore(spec=spec, **{k: by_kind[where] for k, (_, _, where) in store_layout(spec).items()})


def init_store(spec: StoreSpec, device=None) -> KVStore:
    """An empty store of `kv.account.store_layout(spec)`: zeroed pools (host pools in pinned_host memory, as their
    values' bits), tables of -1; refused before any array exists when its account does not fit the memory."""
    if not abstract():
        check_store_memory(spec, device=device)
    shardings = store_shardings(spec, device)
    return KVStore(spec=spec, **{name: filled(shape, fill, dt, getattr(shardings, name))
                                 for name, (shape, fill, dt) in empty_arrays(spec).items()})


def filled(shape: tuple[int, ...], fill, dtype, sharding) -> jax.Array:
    """jnp.full(shape, fill, dtype) made where `sharding` places it, never whole anywhere else first (each device
    makes only its own part): a host-memory array is copied from NumPy (zeros take no RAM until written), a device
    one is filled by a program whose output is placed. A host pool filled on the device and then moved would hold
    its size twice while it moves: in device memory (on a GPU, where the host pool is the large tier) and on the
    host."""
    if sharding.memory_kind != "pinned_host":
        return jnp.full(shape, fill, dtype, device=sharding)
    if abstract():  # traced (`jax.eval_shape`: GLM-5's shapes on any machine): its type, nothing allocated
        return jax.device_put(jnp.full(shape, fill, dtype), sharding)
    return jax.device_put(np.full(shape, fill, dtype) if fill else np.zeros(shape, dtype), sharding)


def empty_arrays(spec: StoreSpec) -> dict[str, tuple[tuple[int, ...], float, np.dtype]]:
    """name -> (shape, fill value, stored dtype) of each array of an empty store (`kv.account.store_layout`):
    tables and hot buffers -1, pools 0 (a host pool's bits: 0 too), score EMAs NaN, empty summaries (+inf, -inf)."""
    minus_one = {"block_table", "host_table", "index_table", "hot_pages", "hot_token", "hot_stamp", "page_stamp"}
    out = {}
    for name, (shape, dt, where) in store_layout(spec).items():
        fill = (-1 if name in minus_one else np.nan if name == "index_ema" else
                np.inf if name == "index_lo" else -np.inf if name == "index_hi" else 0)
        out[name] = (shape, fill, host_dtype(dt) if where == "host" else dt)
    return out


def store_nbytes(store: KVStore) -> dict[str, int]:
    """Bytes held per memory kind."""
    out: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(store):
        kind = leaf.sharding.memory_kind if hasattr(leaf, "sharding") else "device"
        out[kind] = out.get(kind, 0) + leaf.nbytes
    return out
