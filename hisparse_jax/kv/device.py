"""The device half of the tiered store: the host's table decisions (`kv.updates`, recorded by `PageManager`) carried
out on a `KVStore`, and the checked row-level writes and reads that need both (prompt writes, appends, gathers:
trace replays, tests, benchmarks).

    manager = PageManager(model_cfg, cache)             # host bookkeeping (NumPy)
    store = new_store(manager)                          # its KVStore (device pools + pinned-host pools)
    store, slot = admit_prefilled(store, manager, latent, rope, index_k, length)
    manager.reserve(slot, length + 1)                   # host decisions ...
    store = apply_updates(store, manager)               # ... applied before the next device call

The table programs: a request slot's tables replaced (`set_tables`), device pages released (`evict_pages`, written
back first when there is no eager mirror) and host pages loaded back into device pages (`load_pages`, a swap-in).
The records stay in `kv.updates`, which imports no jax: the bookkeeping that writes them runs without it.

Every function takes the store (donated: use the returned one) and returns the new one. The updates are small
jitted calls, each compiled once per size bucket. This module builds the store's own jitted programs (the table
updates and prompt writes in `STORE_PROGRAMS`, the checked append and gather): the kv package imports no model
and no engine, so `engine.runner`, which builds every program that runs the model, reaches these through here;
`hisparse_jax.parallel` builds their per-rank form over a mesh.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.kv import writes
from hisparse_jax.kv.audit import check_manager, check_table_copies
from hisparse_jax.kv.codec import from_host_memory, set_rows, to_host_memory
from hisparse_jax.kv.manager import PageManager
from hisparse_jax.kv.resolve import fetch_misses, gather_rows, resolve
from hisparse_jax.kv.state import KVStore, init_store
from hisparse_jax.kv.summary import IndexCodebooks, with_index_codebooks
from hisparse_jax.kv.updates import ClearStamps, EvictPages, LoadPages, SetTables
from hisparse_jax.units import PAGE_SIZE
from pallas_kernels.sparse_gather.reference import UNUSED_STAMP


def new_store(manager: PageManager, device=None, index_codebooks: IndexCodebooks | None = None) -> KVStore:
    """An empty `KVStore` for `manager` (host pools in pinned_host memory), with its pending updates applied.
    index_codebooks: the codebooks of index_summary="rvq" (needed there, refused otherwise)."""
    spec = manager.spec
    store = init_store(spec, device)
    if spec.index_summary == "rvq":
        if index_codebooks is None:
            raise ValueError("index_summary='rvq' needs the store's codebooks: index_codebooks="
                             "index_codebooks.fit_index_codebooks(model, calibration_ids)")
        store = with_index_codebooks(store, index_codebooks)
    elif index_codebooks is not None:
        raise ValueError(f"index_codebooks are index_summary='rvq''s; this store's summary is "
                         f"{spec.index_summary!r} (index_tier {spec.index_tier!r})")
    return apply_updates(store, manager)


# ----- table updates: the host's decisions on the device ------------------------------------------
def set_tables(store: KVStore, req: int, block_row, host_row, index_row, seq_len: int, hot_row, hot_rows):
    """Replace one request slot's tables (host-decided: admission, growth, release). Rows are int32[MP] / [NH].

    The hot buffer's tags are cleared; its first `hot_rows` slots (the budget, a traced number: budgets inside one
    capacity share this program) become never-used (stamp -1, the least recent), the others `UNUSED_STAMP`, newer
    than any step's stamp: with hot_rows >= K a step always finds its victims among the first, so the others are
    never claimed (and, holding no position, never hit)."""
    HR = store.hot_stamp.shape[-1]
    stamps = jnp.where(jnp.arange(HR, dtype=jnp.int32) < hot_rows, -1, UNUSED_STAMP).astype(jnp.int32)
    return store.replace(
        block_table=store.block_table.at[req].set(block_row), host_table=store.host_table.at[req].set(host_row),
        index_table=store.index_table.at[req].set(index_row), seq_lens=store.seq_lens.at[req].set(seq_len),
        hot_pages=store.hot_pages.at[req].set(hot_row),
        hot_token=store.hot_token.at[req].set(-1), hot_stamp=store.hot_stamp.at[req].set(stamps))


def evict_pages(store: KVStore, req, page_idx):
    """Release device pages: req / page_idx int32[N] (-1 padded) name logical pages whose host copy is current.

    Without the eager mirror the page is first written back (all layers). Returns (store, d2h_rows);
    the caller returns the freed device pages to its `PagePool`.
    """
    spec = store.spec
    ok = (req >= 0) & (page_idx >= 0)
    r, i = jnp.maximum(req, 0), jnp.maximum(page_idx, 0)
    d2h = jnp.zeros((), jnp.int32)
    if not spec.mirror_to_host:
        store, d2h = _write_back(store, jnp.where(ok, store.block_table[r, i], -1),
                                 jnp.where(ok, store.host_table[r, i], -1))
    bt = store.block_table.at[jnp.where(ok, r, spec.max_seqs), i].set(-1, mode="drop")
    return store.replace(block_table=bt), d2h


def _write_back(store, dpages, hpages):
    """Copy whole device pages to host pages (all layers): each page a [L, 1, 64, X] device slice put in host
    memory and written with `dynamic_update_slice` into the pinned-host pool (in place; pairs with a -1 are
    skipped, not written)."""
    spec = store.spec
    ok = (dpages >= 0) & (hpages >= 0)
    order = jnp.argsort(~ok, stable=True)  # the pages to write first, in their order
    n = jnp.sum(ok).astype(jnp.int32)

    def body(j, hosts):
        k = order[j]
        out = []
        for host, dev in zip(hosts, store.device_pools()):
            blk = jax.lax.dynamic_slice(dev, (0, dpages[k]) + (0,) * (dev.ndim - 2), (dev.shape[0], 1) + dev.shape[2:])
            out.append(jax.lax.dynamic_update_slice(host, to_host_memory(blk), (0, hpages[k]) + (0,) * (host.ndim - 2)))
        return tuple(out)

    hosts = jax.lax.fori_loop(0, n, body, store.host_pools())
    return store.with_host_pools(hosts), n * spec.num_layers * PAGE_SIZE


def load_pages(store: KVStore, hpages, dpages):
    """Copy whole host pages into device pages (all layers), one H2D slice per page: hpages / dpages int32[N]
    (-1 padded). Used to swap a request back in. Returns (store, h2d_rows)."""
    spec = store.spec
    n = hpages.shape[0]

    def body(j, pools):
        ok = (hpages[j] >= 0) & (dpages[j] >= 0)
        hp = jnp.maximum(hpages[j], 0)
        dp = jnp.where(ok, dpages[j], spec.device_pages)  # out of range: the update is skipped below
        out = []
        for pool, host in zip(pools, store.host_pools()):
            blk = jax.lax.dynamic_slice(host, (0, hp) + (0,) * (host.ndim - 2), (host.shape[0], 1) + host.shape[2:])
            out.append(set_rows(pool, (slice(None), dp), from_host_memory(blk, pool.dtype)[:, 0]))
        return tuple(out)

    pools = jax.lax.fori_loop(0, n, body, store.device_pools())
    rows = jnp.sum((hpages >= 0) & (dpages >= 0)).astype(jnp.int32) * spec.num_layers * PAGE_SIZE
    return store.with_device_pools(pools), rows



@functools.partial(jax.jit, donate_argnums=(0,))
def _set_tables(store, req, block_row, host_row, index_row, seq_len, hot_row, hot_rows):
    return set_tables(store, req, block_row, host_row, index_row, seq_len, hot_row, hot_rows)


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_rows(store, slot, block_row, host_row, index_row, seq_len):
    return store.replace(block_table=store.block_table.at[slot].set(block_row),
                         host_table=store.host_table.at[slot].set(host_row),
                         index_table=store.index_table.at[slot].set(index_row),
                         seq_lens=store.seq_lens.at[slot].set(seq_len))


@functools.partial(jax.jit, donate_argnums=(0,))
def _clear_page_stamps(store, req):
    return store.replace(page_stamp=store.page_stamp.at[req].set(-1))


@functools.partial(jax.jit, donate_argnums=(0,))
def _evict(store, req, page_idx):
    return evict_pages(store, req, page_idx)[0]


@functools.partial(jax.jit, donate_argnums=(0,))
def _load_pages(store, hpages, dpages):
    return load_pages(store, hpages, dpages)[0]


def update_call(u) -> tuple[str, list]:
    """One recorded update (`kv.updates`) as (the kind of its store program in `STORE_PROGRAMS`, its arguments as
    NumPy): `STORE_PROGRAMS[kind](store, *args)` applies it. Whoever holds stores — one, or a mesh's ranks
    (`hisparse_jax.parallel`) — applies updates through this one mapping."""
    if isinstance(u, SetTables):
        rows = [np.int32(u.slot), np.asarray(u.block_row), np.asarray(u.host_row), np.asarray(u.index_row),
                np.int32(u.seq_len)]
        return ("rows", rows) if u.hot_row is None else ("tables", rows + [np.asarray(u.hot_row), np.int32(u.hot_rows)])
    if isinstance(u, ClearStamps):
        return "stamps", [np.int32(u.slot)]
    if isinstance(u, EvictPages):
        return "evict", [np.asarray(u.req), np.asarray(u.page_idx)]
    if isinstance(u, LoadPages):
        return "load", [np.asarray(u.host_pages), np.asarray(u.device_pages)]
    raise TypeError(f"unknown store update {u!r}")


def apply_updates(store: KVStore, manager: PageManager) -> KVStore:
    """Apply (and clear) `manager`'s pending device-table updates to `store`, in the order they were decided."""
    for u in manager.take_updates():
        kind, args = update_call(u)
        store = STORE_PROGRAMS[kind](store, *map(jnp.asarray, args))
    return store


def reserve_next(store: KVStore, manager: PageManager, slots, n: int = 1) -> KVStore:
    """Before a decode call that appends `n` tokens to each of `slots` (-1: padding): reserve their pages (releasing
    cold pages if needed) and apply the resulting table updates."""
    for s in slots:
        if s >= 0:
            manager.reserve(s, manager.lengths[s] + n)
    return apply_updates(store, manager)


# ----- prompt rows ------------------------------------------------------------------------------
@functools.partial(jax.jit, donate_argnums=(0,))
def _write_prefill(store, req, latent, rope, index_k, length, start, offset):
    return writes.write_prefill(store, req, latent, rope, index_k, length, start, offset)[0]


# The jitted one-store programs (store donated) by kind: the table updates (`update_call`) and "prefill"
# (store, slot, latent, rope, index_k, length, start, offset), the rows of a prompt (`writes.write_prefill`).
STORE_PROGRAMS = {"rows": _set_rows, "tables": _set_tables, "stamps": _clear_page_stamps, "evict": _evict,
                  "load": _load_pages, "prefill": _write_prefill}


def write_prefill(store: KVStore, manager: PageManager, slot: int, latent, rope, index_k, length: int,
                  start: int = 0, offset: int = 0) -> KVStore:
    """Write a prompt's rows (latent [L, T, C], rope [L, T, R], index_k [LI, T, dI]; row t is position
    offset + t, `offset` a multiple of 64) for positions start..length-1 into `slot` (admitted for `length`
    tokens). `start` must not be below the slot's shared prefix (`manager.cached_tokens[slot]`): shared pages are
    never written."""
    if offset % 64 or offset < 0:
        raise ValueError(f"offset must be a non-negative multiple of 64 (a page boundary), got {offset}")
    manager.record_prefill(slot, length, start, rows=latent.shape[1], offset=offset)
    store = apply_updates(store, manager)
    return _write_prefill(store, jnp.int32(slot), latent, rope, index_k, jnp.int32(length), jnp.int32(start),
                          jnp.int32(offset))


def admit_prefilled(store: KVStore, manager: PageManager, latent, rope, index_k, length: int, *,
                    tokens=None) -> tuple[KVStore, int]:
    """`manager.admit` a prompt of `length` tokens and write its rows computed outside the store (e.g. by
    `generate.prefill_rows`); with `tokens` (and `prefix_caching` on) its full pages are registered for later
    requests. Returns (store, slot)."""
    slot = manager.admit(length)
    store = write_prefill(store, manager, slot, latent, rope, index_k, length)
    if tokens is not None:
        manager.register_prefix(slot, tokens)
    return store, slot


# ----- decode rows (checked; the model's decode step has its own fused path) ----------------------
def _indexer_kinds(spec):
    """1 for the leader (full indexer) layer of each group, else 0."""
    leaders = {g[0] for g in spec.groups}
    return [int(layer in leaders) for layer in range(spec.num_layers)]


@functools.partial(jax.jit, donate_argnums=(0,))
def _append_all(store, req, latent, rope, index_k):
    spec = store.spec
    positions = jnp.where(req >= 0, store.seq_lens[jnp.maximum(req, 0)], -1)
    index_layer = 0
    for layer, kind in enumerate(_indexer_kinds(spec)):
        k = index_k[index_layer] if kind else None
        store, _ = writes.append_rows(store, layer, index_layer if kind else None, req, positions, latent[layer],
                                      rope[layer], k)
        index_layer += kind
    if spec.mirror_to_host:
        store, _ = writes.mirror_rows(store, req, positions)
    seq_lens = store.seq_lens.at[jnp.where(req >= 0, req, spec.max_seqs)].add(1, mode="drop")
    return store.replace(seq_lens=seq_lens)


def append(store: KVStore, manager: PageManager, slots, latent, rope, index_k) -> KVStore:
    """Append one token to each of `slots` (-1: padding) in every layer: latent [L, B, C], rope [L, B, R],
    index_k [LI, B, dI]. Reserves tail pages (releasing cold pages if needed), writes the device pages and the
    host mirror."""
    slots = manager.check_live_slots(slots)
    store = reserve_next(store, manager, slots)
    store = _append_all(store, jnp.asarray(slots, jnp.int32), latent, rope, index_k)
    manager.advance([s for s in slots if s >= 0])
    return store


@functools.partial(jax.jit, donate_argnums=(0,))
def _gather_all(store, req, topk):
    spec = store.spec
    lats, ropes, valid, total = [None] * spec.num_layers, [None] * spec.num_layers, None, 0
    for g, layers in enumerate(spec.groups):
        plan, store = resolve(store, g, req, topk)
        store, payload, _ = fetch_misses(store, layers[0], len(layers), plan)
        total = total + payload
        for layer in layers:
            lats[layer], ropes[layer] = gather_rows(store, layer, plan)
        # the next group's fetch updates the pools in place: its reads must come first, or XLA copies the pools
        store, lats, ropes = jax.lax.optimization_barrier((store, lats, ropes))
        valid = plan.valid
    store = store.replace(clock=store.clock + 1)
    return store, jnp.stack(lats), jnp.stack(ropes), valid, total


def gather(store: KVStore, manager: PageManager, slots, topk):
    """Resolve `topk` (int32[B, K]: positions, -1 padding) for each slot in every indexer group — resident
    reads, hot hits, misses fetched from host — and return the rows of every layer:
    (store, latent f32[L, B, K, C], rope f32[L, B, K, R], valid bool[B, K], payload_h2d_bytes).
    Advances the LRU clock like a decode step and refreshes `manager.page_stamps`. Raises ValueError on positions
    outside [0, seq_len)."""
    if manager.spec.hot_policy != "lru":
        raise ValueError(f"gather replays top-k without the indexer's scores, which hot_policy="
                         f"{manager.spec.hot_policy!r} orders the hot slots by: use a store with hot_policy='lru'")
    slots = manager.check_live_slots(slots)
    swapped = [x for x in slots if x in manager.swapped]
    if swapped:
        raise ValueError(f"slots {swapped} are swapped out (no device pages, no hot buffer): swap_in first")
    topk = np.asarray(topk, np.int32)
    if topk.ndim != 2 or topk.shape[0] != len(slots):
        raise ValueError(f"topk must be int32[{len(slots)}, K], got shape {topk.shape}")
    if topk.shape[1] > manager.spec.hot_rows:
        raise ValueError(f"K={topk.shape[1]} exceeds hot_rows={manager.spec.hot_rows}")
    for b, s in enumerate(slots):
        row = topk[b][topk[b] != -1]
        bad = row[(row < 0) | (row >= (manager.lengths[s] if s >= 0 else 0))]
        if bad.size:
            raise ValueError(f"slot {s}: top-k positions {bad[:8].tolist()} are outside [0, "
                             f"{manager.lengths.get(s, 0)})")
        if len(set(row.tolist())) != row.size:
            raise ValueError(f"slot {s}: repeated top-k positions")
    store = apply_updates(store, manager)
    store, lat, rope, valid, rows = _gather_all(store, jnp.asarray(slots, jnp.int32), jnp.asarray(topk))
    rows, stamps = jax.device_get((rows, store.page_stamp))
    manager.observe_page_stamps(stamps)
    return store, lat, rope, valid, int(rows) * manager.spec.row_bytes


def check_tables(store: KVStore, manager: PageManager) -> None:
    """`kv.audit.check_manager`, and the store's tables equal the manager's view (`kv.audit.check_table_copies`;
    pending updates must have been applied). Reads the tables back: tests and debugging."""
    if manager.updates:
        raise RuntimeError(f"{len(manager.updates)} table updates are not applied yet: apply_updates first")
    check_manager(manager)
    check_table_copies(manager, *jax.device_get((store.block_table, store.host_table, store.index_table,
                                                 store.hot_pages, store.seq_lens)))
