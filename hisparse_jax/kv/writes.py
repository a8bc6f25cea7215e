"""The store's row writes: a decode step's new rows and a prompt's rows, into the device pools, the host pages and
the indexer keys.

Shapes: B decode rows (`req` int32[B] names each row's request slot, -1 = idle row), L layers, LI indexer layers,
T prompt rows, C latent, R rope, dI indexer dim, 64 tokens per page.

* `append_rows`    one layer's new rows into the device pools (tail pages must be resident) and, for an indexer
                   layer, its keys (with index_tier="host": into pinned-host memory, and into the page summaries)
* `mirror_rows`    the step's new rows of every layer into their host pages (the eager mirror)
* `end_step`       a decode step's last writes to the store: the mirror (if any), the new lengths, the clock
* `write_prefill`  a prompt's rows (a chunk at a time), to every page they have: device, host, indexer
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hisparse_jax.compat import DEVICE, HOST
from hisparse_jax.kv.codec import drop_unless, encode_index, encode_latent, scored_keys, set_rows, to_host_memory
from hisparse_jax.kv.state import KVStore, to_host_bits
from hisparse_jax.kv.summary import append_summaries, prefill_summaries
from hisparse_jax.units import PAGE_SIZE


def tail_address(store: KVStore, req, positions):
    """For each decode row: (device page, indexer page, host page, row in page, ok) of `positions`."""
    spec = store.spec
    r = jnp.maximum(req, 0)
    lp = jnp.clip(positions // PAGE_SIZE, 0, spec.max_pages - 1)
    row = jnp.maximum(positions, 0) % PAGE_SIZE
    live = (req >= 0) & (positions >= 0) & (positions < spec.max_pages * PAGE_SIZE)
    dpage, ipage, hpage = store.block_table[r, lp], store.index_table[r, lp], store.host_table[r, lp]
    return dpage, ipage, hpage, row, live


def append_rows(store: KVStore, layer: int, index_layer: int | None, req, positions, c, k_rope, k_index):
    """Write layer `layer`'s rows of the new tokens: c [B, C], k_rope [B, R], k_index [B, dI] (when `index_layer`).

    Returns (store, dropped int32[]) where `dropped` counts live rows whose tail page was not resident (the
    host must reserve tail pages before a step; a non-zero count is a scheduling bug, surfaced in stats).
    """
    spec = store.spec
    dpage, ipage, _, row, live = tail_address(store, req, positions)
    ok = live & (dpage >= 0)
    dp = drop_unless(dpage, ok, spec.device_pages)
    vals, scales = encode_latent(spec, c)
    latent = set_rows(store.latent, (layer, dp, row), vals)
    rope = set_rows(store.rope, (layer, dp, row), k_rope.astype(store.rope.dtype))
    upd = dict(latent=latent, rope=rope)
    if scales is not None:
        upd["latent_scale"] = store.latent_scale.at[layer, dp, row].set(scales, mode="drop")
    dropped = jnp.sum(live & (dpage < 0))
    if index_layer is not None:
        iok = live & (ipage >= 0)
        ip = drop_unless(ipage, iok, spec.index_pages)
        kv, ks = encode_index(spec, k_index)
        if spec.index_tier == "host":
            upd.update(_append_host_keys(store, index_layer, ipage, row, iok, kv, ks, positions))
        else:
            upd["index_k"] = set_rows(store.index_k, (index_layer, ip, row), kv)
            if ks is not None:
                upd["index_scale"] = store.index_scale.at[index_layer, ip, row].set(ks, mode="drop")
        if store.index_ema is not None:  # a new key: its position is not scored yet
            upd["index_ema"] = store.index_ema.at[index_layer, ip, row].set(jnp.nan, mode="drop")
        dropped = dropped + jnp.sum(live & (ipage < 0))
    return store.replace(**upd), dropped.astype(jnp.int32)


def _append_host_keys(store: KVStore, index_layer, ipage, row, ok, kv, ks, positions) -> dict:
    """`append_rows`' key writes with index_tier="host": each row's key (and scale) into its page of the pinned-host
    pool (in place, a row at a time) and into its page's summary (`summary.append_summaries`). Returns the store
    fields to replace."""
    spec = store.spec
    order = jnp.argsort(~ok, stable=True)
    n = jnp.sum(ok).astype(jnp.int32)
    ip = jnp.maximum(ipage, 0)
    upd = {"index_k": _write_host_rows(store.index_k, kv[None], ip, row, order, n, index_layer)}
    if ks is not None:
        upd["index_scale"] = _write_host_rows(store.index_scale, ks[None], ip, row, order, n, index_layer)
    upd.update(append_summaries(store, index_layer, ipage, row, ok, scored_keys(spec, kv, ks), positions))
    return upd


def mirror_rows(store: KVStore, req, positions):
    """Copy the rows just appended at `positions` (all layers) from the device pools to their host pages.

    Reads them back from the device pool so the host copy is bit-identical. Returns (store, d2h_rows).
    Each row is a `dynamic_update_slice` of a `device_put(HOST)` row into the pinned-host pool, which XLA
    does in place (a host-side scatter under `compute_on` returned a new pool: on a GPU that was a copy of
    every host pool per step, see tests/e2e/test_gpu_build.py).
    """
    spec = store.spec
    dpage, _, hpage, row, live = tail_address(store, req, positions)
    ok = live & (dpage >= 0) & (hpage >= 0)
    src = jnp.maximum(dpage, 0)
    order = jnp.argsort(~ok, stable=True)  # the rows to write first
    n = jnp.sum(ok).astype(jnp.int32)
    hp = jnp.maximum(hpage, 0)
    upd = dict(h_latent=_write_host_rows(store.h_latent, store.latent[:, src, row], hp, row, order, n),
               h_rope=_write_host_rows(store.h_rope, store.rope[:, src, row], hp, row, order, n))
    if spec.fp8:
        upd["h_latent_scale"] = _write_host_rows(store.h_latent_scale, store.latent_scale[:, src, row], hp, row,
                                                 order, n)
    return store.replace(**upd), n * spec.num_layers


def end_step(store: KVStore, stats: dict, written: tuple, lengths: tuple):
    """The store's end of a decode step, once the model has written its rows (every decode step ends here).

    written = (req, pos) int32[R]: the rows the step wrote (every layer; req -1 = none), mirrored to their host
    pages when `spec.mirror_to_host` (counted in stats["d2h_rows"]); lengths = (req, new_len) int32[G]: each live
    request's seq_len becomes at least new_len (a request may appear in several rows: the largest wins; req -1 is
    dropped); the clock advances by one. Returns (store, stats)."""
    spec = store.spec
    if spec.mirror_to_host:
        store, d2h = mirror_rows(store, *written)
        stats = dict(stats, d2h_rows=stats["d2h_rows"] + d2h)
    req, new_len = lengths
    seq_lens = store.seq_lens.at[jnp.where(req >= 0, req, spec.max_seqs)].max(new_len, mode="drop")
    return store.replace(seq_lens=seq_lens, clock=store.clock + 1), stats


def _write_host_rows(host, vals, pages, rows, order, n, first_layer=0):
    """host[first_layer:first_layer + L, pages[b], rows[b]] = vals[:, b] (vals [L, B, ...]) for b in order[:n], one
    row (all its layers) at a time, in place."""
    def body(j, host):
        b = order[j]
        upd = to_host_memory(jax.lax.dynamic_index_in_dim(vals, b, axis=1)[:, :, None])  # [L, 1, 1, X]
        return jax.lax.dynamic_update_slice(host, upd, (first_layer, pages[b], rows[b]) + (0,) * (host.ndim - 3))

    return jax.lax.fori_loop(0, n, body, host)


def write_prefill(store: KVStore, req, latent, rope, index_k, length, start=0, offset=0):
    """Write a prompt's rows: latent [L, T, C], rope [L, T, R], index_k [LI, T, dI] (row t = position
    offset + t; `offset` a multiple of PAGE_SIZE, so a long prompt can be written a bounded chunk at a time) of
    which positions start..length-1 are written (earlier ones, e.g. a shared prefix, are left alone), for
    request slot `req` (scalar). Every token goes to its indexer page, to its device page when resident and
    to its host page when it has one. Returns (store, d2h_rows)."""
    spec = store.spec
    T = latent.shape[1]
    pos = offset + jnp.arange(T, dtype=jnp.int32)
    ok = (pos >= start) & (pos < length)
    lp = jnp.minimum(pos // PAGE_SIZE, spec.max_pages - 1)
    row = pos % PAGE_SIZE
    dpage, hpage, ipage = store.block_table[req, lp], store.host_table[req, lp], store.index_table[req, lp]
    dp = drop_unless(dpage, ok & (dpage >= 0), spec.device_pages)
    ip = drop_unless(ipage, ok & (ipage >= 0), spec.index_pages)
    vals, scales = encode_latent(spec, latent)
    rope = rope.astype(store.rope.dtype)
    kv, ks = encode_index(spec, index_k)
    upd = dict(latent=set_rows(store.latent, (slice(None), dp, row), vals),
               rope=set_rows(store.rope, (slice(None), dp, row), rope))
    end = jnp.minimum(length, offset + T)
    if spec.index_tier == "host":
        keys = _write_host_pages(spec, (store.index_k, store.index_scale), store.index_table[req], (kv, ks), start,
                                 end, offset)
        upd.update(index_k=keys[0], index_scale=keys[1] if ks is not None else None,
                   **prefill_summaries(store, req, scored_keys(spec, kv, ks), pos, ok, start))
    else:
        upd["index_k"] = set_rows(store.index_k, (slice(None), ip, row), kv)
        if ks is not None:
            upd["index_scale"] = store.index_scale.at[:, ip, row].set(ks, mode="drop")
    if spec.fp8:
        upd["latent_scale"] = store.latent_scale.at[:, dp, row].set(scales, mode="drop")
    if store.index_ema is not None:
        upd["index_ema"] = store.index_ema.at[:, ip, row].set(jnp.nan, mode="drop")
    hosts = _write_host_pages(spec, store.host_pools(), store.host_table[req], (vals, rope, scales), start, end,
                              offset)
    seq_lens = store.seq_lens.at[req].set(length)
    return (store.replace(**upd).with_host_pools(hosts).replace(seq_lens=seq_lens),
            jnp.sum(ok & (hpage >= 0)).astype(jnp.int32) * spec.num_layers)


def _write_host_pages(spec, pools, host_row, values, start, end, offset=0):
    """Write positions start..end-1 of `values` ([L, T, X] each, or None: e.g. latent, rope, latent scale; row t is
    position offset + t, `offset` a multiple of PAGE_SIZE) into their pages of the pinned-host `pools` (one per
    value that is not None; `host_row` int32[MP]: logical page -> pool page, -1 none), a whole [L, 1, 64, X] page
    block at a time with `dynamic_update_slice` (in place). A page only partly in [start, end) is read from the
    host first and merged on the device (as bits), so its other rows are kept. Returns the pools."""
    T = values[0].shape[1]
    NP = -(-T // PAGE_SIZE)
    q = offset // PAGE_SIZE + jnp.arange(NP, dtype=jnp.int32)  # the logical pages of the rows
    hp = jnp.where(q < spec.max_pages, host_row[jnp.minimum(q, spec.max_pages - 1)], -1)
    lo, hi = q * PAGE_SIZE, (q + 1) * PAGE_SIZE
    touched = (hp >= 0) & (lo < end) & (hi > start) & (start < end)  # pages with a row to write
    full = touched & (lo >= start) & (hi <= end)
    partial = touched & ~full  # at most two: the pages of start and of end
    pos = lo[:, None] + jnp.arange(PAGE_SIZE, dtype=jnp.int32)[None]
    keep_new = (pos >= start) & (pos < end)  # [NP, 64]
    blocks = [None if v is None else
              jnp.pad(v, ((0, 0), (0, NP * PAGE_SIZE - T)) + ((0, 0),) * (v.ndim - 2)).reshape(
                  v.shape[0], NP, PAGE_SIZE, *v.shape[2:]) for v in values]  # [L, NP, 64, X]
    blocks = [to_host_bits(b) for b in blocks if b is not None]  # host-pool bits, still on the device

    def page_loop(sel, merge, hosts):
        order = jnp.argsort(~sel, stable=True)  # the selected pages first, in page order
        n = jnp.sum(sel).astype(jnp.int32)

        def body(j, hosts):
            k = order[j]
            out = []
            for host, blk in zip(hosts, blocks):
                at = (0, hp[k]) + (0,) * (host.ndim - 2)
                new = jax.lax.dynamic_slice_in_dim(blk, k, 1, axis=1)  # [L, 1, 64, X]
                if merge:
                    cur = jax.device_put(jax.lax.dynamic_slice(host, at, new.shape), DEVICE)
                    m = keep_new[k].reshape((1, 1, PAGE_SIZE) + (1,) * (host.ndim - 3))
                    new = jnp.where(m, new, cur)
                out.append(jax.lax.dynamic_update_slice(host, jax.device_put(new, HOST), at))  # `new`: bits
            return tuple(out)

        return jax.lax.fori_loop(0, n, body, hosts)

    hosts = page_loop(full, False, tuple(p for p in pools if p is not None))
    return page_loop(partial, True, hosts)
