"""The host's paging decisions carried out on the device: a request slot's tables replaced (`set_tables`), device
pages released (`evict_pages`, written back first when there is no eager mirror) and host pages loaded back into
device pages (`load_pages`, a swap-in). The host (`kv.manager.TieredCache`) decides; `kv.device` applies these as
jitted store programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hisparse_jax.kv.codec import from_host_memory, set_rows, to_host_memory
from hisparse_jax.kv.state import KVStore
from hisparse_jax.units import PAGE_SIZE
from pallas_kernels.sparse_gather.reference import UNUSED_STAMP


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
