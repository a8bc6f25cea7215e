"""The resolved rows' way to the attention: the misses copied host -> device into their hot slots
(`fetch_misses`), then every row read at its plan's address (`gather_rows`).

Mechanisms (`StoreSpec.fetch`): "row", one packed host gather and one host -> device copy per indexer group and step
(`gather_packed`, at one of `fetch_sizes` static sizes); "page", each distinct host page of the misses copied on its
own. Counts are layer-rows (one token's row in one layer); bytes = rows x `StoreSpec.row_bytes`, on the host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hisparse_jax.compat import DEVICE, HOST, on_host
from hisparse_jax.kv.codec import decode_latent, set_rows
from hisparse_jax.kv.resolve import Plan
from hisparse_jax.kv.state import KVStore, from_host_bits, to_host_bits
from hisparse_jax.units import PAGE_SIZE


def fetch_misses(store: KVStore, first_layer, num_layers: int, plan: Plan):
    """Copy every miss's row (layers first_layer .. first_layer + num_layers - 1: an indexer group) from its host
    page into its hot slot. `first_layer` may be traced (the scan over layers); `num_layers` is static.

    Returns (store, payload_rows, transfer_rows) in layer-rows (one token's row in one layer; bytes =
    rows x `spec.row_bytes`, computed on the host so nothing overflows int32): payload = misses x layers;
    transfer = what
    the mechanism moved (row: the staging buffer's rows, `fetch_sizes`; page: each distinct host page once).
    """
    spec = store.spec
    if spec.fetch == "row":
        return _fetch_rows(store, first_layer, num_layers, plan)
    return _fetch_pages(store, first_layer, num_layers, plan)


def _compact_misses(plan: Plan):
    """Flatten [B, K] and move the misses to the front (stable). Returns (n, src_page, src_row, dst_page,
    dst_row) as [B*K] arrays sorted by (not miss, src_page). The resolver only reports valid misses with a
    host page; this is the write into the device pools, so a miss without one is dropped here too."""
    miss = (plan.miss & plan.valid & (plan.src_page >= 0)).reshape(-1)
    src_page = plan.src_page.reshape(-1)
    key = jnp.where(miss, src_page, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(key, stable=True)
    take = lambda a: a.reshape(-1)[order]  # noqa: E731
    return jnp.sum(miss).astype(jnp.int32), take(plan.src_page), take(plan.src_row), take(plan.page), take(plan.row)


def fetch_sizes(min_rows: int, rows: int) -> tuple[int, ...]:
    """The row fetch's static staging sizes for a step of `rows` (B x K) top-k slots: `min_rows`, doubling,
    capped at (and ending with) `rows`. A step stages its misses at the smallest size that holds them, so it moves
    at most twice its payload (or `min_rows` rows) in one copy; `min_rows >= rows` leaves the one size B x K."""
    sizes, s = [], min(min_rows, rows)
    while s < rows:
        sizes.append(s)
        s *= 2
    return tuple(sizes) + (rows,)


def _row_words(host) -> int:
    """32-bit words of one row of a host pool (its last axis, as stored: the bits of the device values)."""
    nbytes = host.shape[-1] * host.dtype.itemsize
    if nbytes % 4:
        raise ValueError(f"a host pool row of {nbytes} bytes is not whole 32-bit words")
    return nbytes // 4


def gather_packed(nl: int, index, *hosts):
    """On the host: index = int32[nl + 2N], the layers, then N host pages, then N rows in page -> those rows of
    every host pool side by side in one buffer of 32-bit words: uint32 [nl, N, row bytes / 4] (fp8: 512 e4m3 +
    64 bf16 rope + 4 fp32 scales = 656 bytes; bf16: 1152). Words, not bytes: XLA:CPU moves a quarter as many
    elements (2.5x the rate measured on bf16 rows)."""
    n = (index.shape[0] - nl) // 2
    layers, page, row = index[:nl], index[nl:nl + n], index[nl + n:]
    parts = []
    for h in hosts:
        x = h[layers[:, None], page[None], row[None]]  # [nl, N, X]
        k = 4 // x.dtype.itemsize
        parts.append(jax.lax.bitcast_convert_type(x.reshape(*x.shape[:2], -1, k) if k > 1 else x, jnp.uint32))
    return jnp.concatenate(parts, axis=-1)


def _unpack(staged, hosts):
    """The device copy of `gather_packed`'s buffer -> each host pool's rows, in its stored dtype (bits)."""
    out, at = [], 0
    for h in hosts:
        w = _row_words(h)
        x = jax.lax.bitcast_convert_type(staged[..., at:at + w], h.dtype)  # [..., w, 4 / itemsize] or [..., w]
        out.append(x.reshape(*x.shape[:2], -1))
        at += w
    return out


def _fetch_rows(store, lo, nl, plan):
    """Row fetch: one host computation gathers every miss's row, all layers of the group and all host pools, into
    one packed staging buffer (`gather_packed`), one host -> device copy moves it, and the device unpacks it into
    its pools (one scatter per pool). The staging buffer has one of `fetch_sizes` static sizes, the smallest that
    holds the misses, picked by a `lax.switch` on the miss count (no misses: nothing runs); exactly one branch runs,
    so a step makes one host computation and one copy per group, with no loop."""
    spec = store.spec
    n, sp, sr, dp, dr = _compact_misses(plan)
    sizes = fetch_sizes(spec.fetch_min_rows, sp.shape[0])
    hosts = store.host_pools()
    layers = jnp.asarray(lo, jnp.int32) + jnp.arange(nl, dtype=jnp.int32)

    def staged(size):
        def branch(pools):
            ok = jnp.arange(size) < n
            index = jnp.concatenate([layers, jnp.where(ok, sp[:size], 0), sr[:size]])  # one copy to the host
            packed = on_host(functools.partial(gather_packed, nl), jax.device_put(index, HOST),
                             *hosts)  # uint32 [nl, size, row bytes / 4], in host memory
            rows = _unpack(jax.device_put(packed, DEVICE), hosts)
            dpage = jnp.where(ok, dp[:size], spec.device_pages)  # past the misses: dropped
            at = (layers[:, None], dpage[None], dr[:size][None])
            return tuple(set_rows(pool, at, from_host_bits(r, pool.dtype)) for pool, r in zip(pools, rows))
        return branch

    # branch 0: no misses; branch i: sizes[i - 1], the smallest size >= n
    pick = jnp.where(n > 0, 1 + jnp.sum(n > jnp.asarray(sizes[:-1], jnp.int32)), 0)
    pools = jax.lax.switch(pick, [lambda pools: pools] + [staged(s) for s in sizes], store.device_pools())
    moved = jnp.asarray((0,) + sizes, jnp.int32)[pick]
    return store.with_device_pools(pools), n * nl, moved * nl


def _fetch_pages(store, lo, nl, plan):
    """Page fetch: each distinct host page of the misses sliced (all layers of the group) and copied on its own, in
    a `fori_loop` over pages, its needed rows written one by one. The loop carries the device pools as the host
    pools' bits (`to_host_bits`: a bitcast), so a row write is an integer move (XLA:CPU widens a narrow-float pool
    to f32 around each in-loop write otherwise: a pool-sized copy per row)."""
    n, sp, sr, dp, dr = _compact_misses(plan)
    first = jnp.concatenate([jnp.ones((1,), bool), sp[1:] != sp[:-1]]) & (jnp.arange(sp.shape[0]) < n)
    n_pages = jnp.sum(first).astype(jnp.int32)
    starts = jnp.nonzero(first, size=sp.shape[0], fill_value=n)[0]  # [B*K] start of each distinct page run
    ends = jnp.concatenate([starts[1:], jnp.full((1,), n)])
    ends = jnp.minimum(jnp.where(jnp.arange(sp.shape[0]) + 1 < n_pages, ends, n), n)

    def page_body(j, pools):
        s, e = starts[j], ends[j]
        hp = sp[s]
        pages = []
        for host, pool in zip(store.host_pools(), pools):
            blk = jax.lax.dynamic_slice(host, (lo, hp) + (0,) * (host.ndim - 2), (nl, 1) + host.shape[2:])
            pages.append(jax.device_put(blk, DEVICE)[:, 0])  # [nl, 64, X] bits

        def row_body(m, pools):
            return tuple(jax.lax.dynamic_update_slice(
                pool, pg[:, sr[m]][:, None, None], (lo, dp[m], dr[m]) + (0,) * (pool.ndim - 3))
                for pool, pg in zip(pools, pages))

        return jax.lax.fori_loop(s, e, row_body, pools)

    pools = store.device_pools()
    bits = jax.lax.fori_loop(0, n_pages, page_body, tuple(to_host_bits(p) for p in pools))
    pools = tuple(from_host_bits(b, p.dtype) for b, p in zip(bits, pools))
    return store.with_device_pools(pools), n * nl, n_pages * nl * PAGE_SIZE


def gather_rows(store: KVStore, layer: int, plan: Plan):
    """Rows at the plan's addresses: (latent f32[B, K, C], rope f32[B, K, R]); invalid slots are zeros."""
    spec = store.spec
    lat = store.latent[layer][plan.page, plan.row]
    sc = store.latent_scale[layer][plan.page, plan.row] if spec.fp8 else None
    c = decode_latent(spec, lat, sc)
    r = store.rope[layer][plan.page, plan.row].astype(jnp.float32)
    v = plan.valid[..., None]
    return jnp.where(v, c, 0.0), jnp.where(v, r, 0.0)
