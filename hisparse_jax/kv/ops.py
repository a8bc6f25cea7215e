"""Pure functions over the `KVStore` (the jnp references; Pallas kernels replace the hot parts).

Shapes: B decode rows (a batch bucket; `req` int32[B] names each row's request slot, -1 = idle row),
K top-k slots (-1 padded), L layers, C latent, R rope, dI indexer dim, 64 tokens per page.

* `append_rows`       write one layer's new rows into the device pools (tail pages must be resident)
* `mirror_rows`       write the step's new rows of every layer into their host pages (the eager mirror)
* `finish_step`       a decode step's last writes to the store: the mirror (if any), the new lengths, the clock
* `index_select`      indexer top-k over a request's paged indexer keys
* `resolve`           top-k positions -> row addresses: resident page | hot hit (LRU touch) | miss (claims
                      the LRU slot; returns the fetch plan)
* `union_topk` / `group_req` / `row_plan`: several query rows per request (speculative verification) resolved
                      once, over the union of their top-k; each row's plan looked up in the union's
* `fetch_misses`      copy the missing rows host -> device hot slots; mechanism "row" (one packed gather and
                      one copy per group and step) or "page"
* `gather_rows`       read (and dequantize) the rows at the resolved addresses
* `evict_pages` / `write_prefill` / `set_tables`: host-decided table changes applied on the device

Host pools live in `pinned_host` memory. Inside `jit` ops may not mix memory kinds, so host reads are
`dynamic_slice` + `device_put(Device)` (page mechanism) or one gather placed on the host with
`compute_on("device_host")` (`compat.on_host`), packing every host pool's rows into one buffer, followed by one
`device_put(Device)` (row mechanism). Host writes are
a `device_put(Host)` row or page block `dynamic_update_slice`d into the pinned-host pool, which XLA does in place; a
host-side scatter under `compute_on` returns a new pool (on a GPU: a copy of the whole host pool per call, see
tests/test_gpu_build.py). On CPU these are semantic only; on a GPU they are the H2D / D2H copies being measured.
Host pools of bf16 / fp8 values hold their bit patterns (`state.host_dtype`): every write goes through `_to_host`
(values -> bits on the device, then to host memory) and every read through `_from_host` (to the device, then bits ->
values), so the host-memory ops are integer moves that XLA:CPU does not widen to f32 over the whole pool.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.compat import DEVICE, HOST, on_host
from hisparse_jax.units import PAGE_SIZE
from hisparse_jax.kv.state import FP8_BLOCK, SUMMARY_DTYPE, KVStore, StoreSpec, from_host_bits, to_host_bits
from pallas_kernels.common import fp8_quantize, hadamard, mxfp4_dequantize, mxfp4_quantize
from pallas_kernels.indexer_topk.reference import (block_score_bound, index_scores, index_scores_fp8,
                                                   index_scores_int4,
                                                   quantize_index_keys, quantize_index_keys_int4, select_topk)
from pallas_kernels.sparse_gather.reference import UNUSED_STAMP, resolve_positions

# ----- formats ----------------------------------------------------------------------------------
def encode_latent(spec: StoreSpec, c):
    """c [..., C] -> (stored values, scales [..., C/128] or None)."""
    if spec.fp8:
        q, scale = fp8_quantize(c.astype(jnp.float32), block=FP8_BLOCK)
        return q, scale.reshape(*c.shape[:-1], c.shape[-1] // FP8_BLOCK)
    return c.astype(spec.value_dtype), None


def decode_latent(spec: StoreSpec, values, scales):
    """Stored latent -> float32 [..., C]."""
    if spec.fp8:
        v = values.astype(jnp.float32).reshape(*values.shape[:-1], -1, FP8_BLOCK)
        return (v * scales[..., None]).reshape(values.shape)
    return values.astype(jnp.float32)


def encode_index(spec: StoreSpec, k):
    """k [..., dI] -> (stored keys, scales or None) in the store's index format (`StoreSpec.index_dtype`)."""
    if spec.index_dtype == "fp8":
        return quantize_index_keys(k)
    if spec.index_dtype == "int4":
        return quantize_index_keys_int4(k)
    return k.astype(jnp.float32 if spec.index_dtype == "float32" else jnp.bfloat16), None


def set_rows(pool, index, vals):
    """`pool.at[index].set(vals, mode="drop")`, written through an unsigned-integer view of the pool when its dtype
    is a float narrower than 32 bits (fp8, bf16): XLA:CPU scatters those by converting the whole pool to a wider
    float and back, a pool-sized copy per call, while the bits scatter in place. The values written are the same."""
    dt = pool.dtype
    if jnp.issubdtype(dt, jnp.floating) and dt.itemsize < 4:
        u = jnp.uint8 if dt.itemsize == 1 else jnp.uint16
        bits = jax.lax.bitcast_convert_type(pool, u).at[index].set(
            jax.lax.bitcast_convert_type(jnp.asarray(vals).astype(dt), u), mode="drop")
        return jax.lax.bitcast_convert_type(bits, dt)
    return pool.at[index].set(vals, mode="drop")


def _to_host(x):
    """Device values -> host-pool bits in host memory (what is `dynamic_update_slice`d into a host pool)."""
    return jax.device_put(to_host_bits(x), HOST)


def _from_host(bits, dtype):
    """Rows / pages read out of a host pool (host memory, bits) -> device values of `dtype`."""
    return from_host_bits(jax.device_put(bits, DEVICE), dtype)


def _drop(idx, ok, bound):
    """Replace indices of dropped writes by an out-of-bounds value (scatters use mode="drop")."""
    return jnp.where(ok, idx, bound)


# ----- writes -----------------------------------------------------------------------------------
def tail_address(spec: StoreSpec, store: KVStore, req, positions):
    """For each decode row: (device page, indexer page, host page, row in page, ok) of `positions`."""
    r = jnp.maximum(req, 0)
    lp = jnp.clip(positions // PAGE_SIZE, 0, spec.max_pages - 1)
    row = jnp.maximum(positions, 0) % PAGE_SIZE
    live = (req >= 0) & (positions >= 0) & (positions < spec.max_pages * PAGE_SIZE)
    dpage, ipage, hpage = store.block_table[r, lp], store.index_table[r, lp], store.host_table[r, lp]
    return dpage, ipage, hpage, row, live


def append_rows(spec: StoreSpec, store: KVStore, layer: int, index_layer: int | None, req, positions, c, k_rope,
                k_index):
    """Write layer `layer`'s rows of the new tokens: c [B, C], k_rope [B, R], k_index [B, dI] (when `index_layer`).

    Returns (store, dropped int32[]) where `dropped` counts live rows whose tail page was not resident (the
    host must reserve tail pages before a step; a non-zero count is a scheduling bug, surfaced in stats).
    """
    dpage, ipage, _, row, live = tail_address(spec, store, req, positions)
    ok = live & (dpage >= 0)
    dp = _drop(dpage, ok, spec.device_pages)
    vals, scales = encode_latent(spec, c)
    latent = set_rows(store.latent, (layer, dp, row), vals)
    rope = set_rows(store.rope, (layer, dp, row), k_rope.astype(store.rope.dtype))
    upd = dict(latent=latent, rope=rope)
    if scales is not None:
        upd["latent_scale"] = store.latent_scale.at[layer, dp, row].set(scales, mode="drop")
    dropped = jnp.sum(live & (dpage < 0))
    if index_layer is not None:
        iok = live & (ipage >= 0)
        ip = _drop(ipage, iok, spec.index_pages)
        kv, ks = encode_index(spec, k_index)
        if spec.index_tier == "host":
            upd.update(_append_host_keys(spec, store, index_layer, ipage, row, iok, kv, ks))
        else:
            upd["index_k"] = set_rows(store.index_k, (index_layer, ip, row), kv)
            if ks is not None:
                upd["index_scale"] = store.index_scale.at[index_layer, ip, row].set(ks, mode="drop")
        if store.index_ema is not None:  # a new key: its position is not scored yet
            upd["index_ema"] = store.index_ema.at[index_layer, ip, row].set(jnp.nan, mode="drop")
        dropped = dropped + jnp.sum(live & (ipage < 0))
    return _replace(store, **upd), dropped.astype(jnp.int32)


def mirror_rows(spec: StoreSpec, store: KVStore, req, positions):
    """Copy the rows just appended at `positions` (all layers) from the device pools to their host pages.

    Reads them back from the device pool so the host copy is bit-identical. Returns (store, d2h_rows).
    Each row is a `dynamic_update_slice` of a `device_put(HOST)` row into the pinned-host pool, which XLA
    does in place (a host-side scatter under `compute_on` returned a new pool: on a GPU that was a copy of
    every host pool per step, see tests/test_gpu_build.py).
    """
    dpage, _, hpage, row, live = tail_address(spec, store, req, positions)
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
    return _replace(store, **upd), n * spec.num_layers


def finish_step(spec: StoreSpec, store: KVStore, stats: dict, written: tuple, lengths: tuple):
    """The store's end of a decode step, once the model has written its rows (every decode step ends here).

    written = (req, pos) int32[R]: the rows the step wrote (every layer; req -1 = none), mirrored to their host
    pages when `spec.mirror_to_host` (counted in stats["d2h_rows"]); lengths = (req, new_len) int32[G]: each live
    request's seq_len becomes at least new_len (a request may appear in several rows: the largest wins; req -1 is
    dropped); the clock advances by one. Returns (store, stats)."""
    if spec.mirror_to_host:
        store, d2h = mirror_rows(spec, store, *written)
        stats = dict(stats, d2h_rows=stats["d2h_rows"] + d2h)
    req, new_len = lengths
    seq_lens = store.seq_lens.at[jnp.where(req >= 0, req, spec.max_seqs)].max(new_len, mode="drop")
    return _replace(store, seq_lens=seq_lens, clock=store.clock + 1), stats


def _write_host_rows(host, vals, pages, rows, order, n, first_layer=0):
    """host[first_layer:first_layer + L, pages[b], rows[b]] = vals[:, b] (vals [L, B, ...]) for b in order[:n], one
    row (all its layers) at a time, in place."""
    def body(j, host):
        b = order[j]
        upd = _to_host(jax.lax.dynamic_index_in_dim(vals, b, axis=1)[:, :, None])  # [L, 1, 1, X]
        return jax.lax.dynamic_update_slice(host, upd, (first_layer, pages[b], rows[b]) + (0,) * (host.ndim - 3))

    return jax.lax.fori_loop(0, n, body, host)


# ----- the indexer over paged keys --------------------------------------------------------------
def index_select(spec: StoreSpec, store: KVStore, index_layer: int, req, positions, q_index, w,
                 num_pages: int | None = None):
    """Top-k of the indexer over keys 0..positions[b] of request req[b] -> int32[B, K] (K = min(topk, MP*64)).

    q_index f32[B, I, dI], w f32[B, I]. fp8 stores score in DeepSeek's FP8 emulation. Idle rows: all -1.
    num_pages (static): score only each request's first `num_pages` pages — the caller's bound on the batch's
    longest live sequence, so a step costs O(context), not O(max_seq_len); None scores all MP.
    """
    return index_select_read(spec, store, index_layer, req, positions, q_index, w, num_pages)[0]


def index_select_read(spec: StoreSpec, store: KVStore, index_layer: int, req, positions, q_index, w,
                      num_pages: int | None = None):
    """`index_select` and the indexer key pages it read from the host (int32[]; 0 with device keys)."""
    if spec.index_tier == "host":
        scores, valid, n = index_scores_host(spec, store, index_layer, req, positions, q_index, w, num_pages)
        return topk_of_scores(spec, scores, valid), n
    scores, valid, _ = index_scores_paged(spec, store, index_layer, req, positions, q_index, w, num_pages)
    return topk_of_scores(spec, scores, valid), jnp.zeros((), jnp.int32)


def topk_of_scores(spec: StoreSpec, scores, valid):
    """`index_select`'s top-k of `index_scores_paged`'s scores: int32[B, K], -1 padded."""
    return pad_topk(spec, select_topk(scores, valid, spec.topk))


def index_scores_paged(spec: StoreSpec, store: KVStore, index_layer: int, req, positions, q_index, w,
                       num_pages: int | None = None):
    """The indexer's scores of keys 0..positions[b] of request req[b] (`index_select`'s, before the top-k):
    (scores f32[B, S], valid bool[B, S], pages int32[B, P]: the indexer pages read, S = P * 64). Device keys only
    (index_tier="host" scores with `index_scores_host`)."""
    r = jnp.maximum(req, 0)
    pages = jnp.maximum(store.index_table[r][:, :num_pages], 0)  # [B, P]
    B = req.shape[0]
    keys = store.index_k[index_layer][pages]
    keys = keys.reshape(B, -1, *keys.shape[3:])  # [B, S, dI] (int4: dI / 2 bytes of codes)
    ks = None
    if store.index_scale is not None:
        ks = store.index_scale[index_layer][pages]
        ks = ks.reshape(B, -1, *ks.shape[3:])  # fp8 [B, S]; int4 [B, S, dI / 32]
    scores = _score_keys(spec, q_index, w, keys, ks)
    S = keys.shape[1]
    valid = (jnp.arange(S, dtype=jnp.int32)[None] <= positions[:, None]) & (req >= 0)[:, None]
    return scores, valid, pages


# ----- index_tier="host": the keys in pinned-host memory, page summaries on the device --------------------------
def scored_keys(spec: StoreSpec, kv, ks):
    """Stored keys (`encode_index`'s) -> f32[..., dI], the keys as the indexer scores them: fp8 e4m3 x its scale
    (a power of two: exact), int4 MXFP4 dequantized, bf16 / f32 as they are. `index_lo` / `index_hi` summarize
    these."""
    if spec.index_dtype == "fp8":
        return kv.astype(jnp.float32) * ks[..., None]
    if spec.index_dtype == "int4":
        return mxfp4_dequantize(kv, ks)
    return kv.astype(jnp.float32)


def scored_query(spec: StoreSpec, q, w):
    """(q f32[..., I, dI], w f32[..., I]) -> (q', w') with score(k) = sum_h w'_h relu(q'_h . scored_keys(k)) the
    store's score of a stored key (up to float rounding): fp8 q' = the e4m3 values of the rotated query and w' = w x
    their scales (the key's power-of-two scale commutes with relu), int4 q' = the dequantized MXFP4 query, else
    q, w."""
    if spec.index_dtype == "fp8":
        qq, qs = fp8_quantize(hadamard(q.astype(jnp.float32)), block=q.shape[-1])
        return qq.astype(jnp.float32), w * qs
    if spec.index_dtype == "int4":
        return mxfp4_dequantize(*mxfp4_quantize(hadamard(q.astype(jnp.float32)))), w
    return q.astype(jnp.float32), w


def _append_host_keys(spec: StoreSpec, store: KVStore, index_layer, ipage, row, ok, kv, ks) -> dict:
    """`append_rows`' key writes with index_tier="host": each row's key (and scale) into its page of the pinned-host
    pool (in place, a row at a time) and its page's summary widened by it (a page's first row resets it: a page
    freed and lent again forgets its last owner). Returns the store fields to replace."""
    order = jnp.argsort(~ok, stable=True)
    n = jnp.sum(ok).astype(jnp.int32)
    ip = jnp.maximum(ipage, 0)
    upd = {"index_k": _write_host_rows(store.index_k, kv[None], ip, row, order, n, index_layer)}
    if ks is not None:
        upd["index_scale"] = _write_host_rows(store.index_scale, ks[None], ip, row, order, n, index_layer)
    lo_k, hi_k = summary_bounds(scored_keys(spec, kv, ks))
    page = _drop(ipage, ok, spec.index_pages)
    fresh = _drop(ipage, ok & (row == 0), spec.index_pages)
    lo = store.index_lo.at[index_layer, fresh].set(jnp.inf, mode="drop")
    hi = store.index_hi.at[index_layer, fresh].set(-jnp.inf, mode="drop")
    upd["index_lo"] = lo.at[index_layer, page].min(lo_k, mode="drop")
    upd["index_hi"] = hi.at[index_layer, page].max(hi_k, mode="drop")
    return upd


def summary_bounds(k):
    """f32 keys -> (lo, hi) in the summaries' dtype (`SUMMARY_DTYPE`), rounded outward (lo <= k <= hi exactly), so
    a page's summary still bounds every key written to it."""
    lo, hi = k.astype(SUMMARY_DTYPE), k.astype(SUMMARY_DTYPE)
    lo = jnp.where(lo.astype(jnp.float32) > k, jnp.nextafter(lo, jnp.asarray(-jnp.inf, SUMMARY_DTYPE)), lo)
    hi = jnp.where(hi.astype(jnp.float32) < k, jnp.nextafter(hi, jnp.asarray(jnp.inf, SUMMARY_DTYPE)), hi)
    return lo, hi


def _prefill_summaries(spec: StoreSpec, store: KVStore, req, keys, pos, ok, start) -> dict:
    """`write_prefill`'s summaries with index_tier="host": keys f32[LI, T, dI] (scored) at positions `pos` [T], rows
    `ok` written. A page whose first position is at or past `start` is summarized anew from its written rows; the
    page of `start` (a shared prefix ends inside it) is widened."""
    LI, T, dI = keys.shape
    NP = -(-T // PAGE_SIZE)
    pad = NP * PAGE_SIZE - T
    kb = jnp.pad(keys, ((0, 0), (0, pad), (0, 0))).reshape(LI, NP, PAGE_SIZE, dI)
    okb = jnp.pad(ok, (0, pad)).reshape(NP, PAGE_SIZE)[None, :, :, None]
    lo, hi = summary_bounds(kb)
    lo = jnp.where(okb, lo, jnp.inf).min(axis=2)  # [LI, NP, dI]
    hi = jnp.where(okb, hi, -jnp.inf).max(axis=2)
    first = jnp.pad(pos, (0, pad)).reshape(NP, PAGE_SIZE)[:, 0]  # each block's first position (page-aligned)
    lp = jnp.minimum(first // PAGE_SIZE, spec.max_pages - 1)
    ipage = store.index_table[req, lp]
    any_ok = okb[0, :, :, 0].any(-1) & (ipage >= 0)
    page = _drop(ipage, any_ok, spec.index_pages)
    anew = _drop(ipage, any_ok & (first >= start), spec.index_pages)
    idx_lo = store.index_lo.at[:, anew].set(jnp.inf, mode="drop")
    idx_hi = store.index_hi.at[:, anew].set(-jnp.inf, mode="drop")
    return {"index_lo": idx_lo.at[:, page].min(lo, mode="drop"), "index_hi": idx_hi.at[:, page].max(hi, mode="drop")}


def index_scores_host(spec: StoreSpec, store: KVStore, index_layer: int, req, positions, q_index, w,
                      num_pages: int | None = None):
    """`index_scores_paged` with index_tier="host": each row's pages ranked by their summary's bound
    (`block_score_bound` of `index_lo` / `index_hi`, an upper bound of every score in the page) and read from the
    pinned-host pool best bound first, `spec.index_read_chunk` pages per round. Exact mode (index_budget_pages None)
    reads rounds until no unread page's bound reaches the row's k-th best score read so far: every position of the
    exact top-k has then been scored, with the same arithmetic as device keys (`_score_keys`), so `select_topk` of the
    result is the device tier's top-k. Budgeted mode reads the index_budget_pages best-bounded pages (rounds of the
    chunk, the last one cut), a fixed amount per step.

    Returns (scores f32[B, S], valid bool[B, S] (only positions read are valid), pages_read int32[] (summed over the
    rows: what crossed the host link)). A page with no valid position is never read. Exact mode's loop is a
    `while_loop` whose trip count depends on the scores (on a GPU: one small device -> host read per round)."""
    B = req.shape[0]
    r = jnp.maximum(req, 0)
    table = store.index_table[r][:, :num_pages]  # [B, P]
    P = table.shape[1]
    S = P * PAGE_SIZE
    K = min(spec.topk, S)
    pos = jnp.arange(S, dtype=jnp.int32)
    valid = (pos[None] <= positions[:, None]) & (req >= 0)[:, None]
    live = valid.reshape(B, P, PAGE_SIZE).any(-1) & (table >= 0)
    qb, wb = scored_query(spec, q_index, w)
    pages = jnp.maximum(table, 0)
    # one gather at (layer, page) each: no copy of the layer's summaries
    bound = block_score_bound(qb[:, None], wb[:, None], store.index_lo[index_layer, pages].astype(jnp.float32),
                              store.index_hi[index_layer, pages].astype(jnp.float32))[:, 0]  # [B, P]
    bound = jnp.where(live, jnp.where(jnp.isnan(bound), jnp.inf, bound), -jnp.inf)
    order = jnp.argsort(-bound, axis=-1, stable=True).astype(jnp.int32)  # best bound first
    ranked = jnp.take_along_axis(bound, order, axis=-1)
    C = min(spec.index_read_chunk, P)
    limit = P if spec.index_budget_pages is None else min(spec.index_budget_pages, P)
    rounds = -(-limit // C)
    pad = rounds * C - P
    order = jnp.pad(order, ((0, 0), (0, max(pad, 0))), constant_values=P)  # past the pages: nothing
    ranked = jnp.pad(ranked, ((0, 0), (0, max(pad, 0))), constant_values=-jnp.inf)
    kdt, sdt = spec.index_dtypes

    def read(i, scores, seen, want):
        """Round i: score the rows' next C pages in bound order (a row that does not `want` reads none)."""
        j = i * C + jnp.arange(C, dtype=jnp.int32)
        lp = jnp.take_along_axis(order, jnp.broadcast_to(j, (B, C)), axis=-1)  # logical pages [B, C]
        take = want[:, None] & (lp < P) & (j < limit)[None] & jnp.take_along_axis(
            live, jnp.minimum(lp, P - 1), axis=-1)
        pp = jnp.where(take, jnp.take_along_axis(pages, jnp.minimum(lp, P - 1), axis=-1), 0)
        # one gather over (layer x page) rows of the pool: no slice of the whole layer on the host
        hp = jax.device_put(index_layer * spec.index_pages + pp, HOST)

        def gather(h, p):
            return h.reshape(-1, *h.shape[2:])[p]
        kb = _from_host(on_host(gather, store.index_k, hp), kdt)  # [B, C, 64, dI']
        sb = None if store.index_scale is None else _from_host(on_host(gather, store.index_scale, hp), sdt)
        got = _score_keys(spec, q_index, w, kb.reshape(B, C * PAGE_SIZE, *kb.shape[3:]),
                          None if sb is None else sb.reshape(B, C * PAGE_SIZE, *sb.shape[3:]))
        at = jnp.where(take[:, :, None], lp[:, :, None] * PAGE_SIZE + jnp.arange(PAGE_SIZE, dtype=jnp.int32),
                       S).reshape(B, C * PAGE_SIZE)
        rows = jnp.arange(B, dtype=jnp.int32)[:, None]
        return (scores.at[rows, at].set(got, mode="drop"), seen.at[rows, at].set(True, mode="drop"),
                jnp.sum(take).astype(jnp.int32))

    scores0 = jnp.full((B, S), -jnp.inf, jnp.float32)
    seen0 = jnp.zeros((B, S), bool)
    if spec.index_budget_pages is not None:
        def body(i, c):
            scores, seen, n = c
            scores, seen, m = read(i, scores, seen, req >= 0)
            return scores, seen, n + m
        scores, seen, n = jax.lax.fori_loop(0, rounds, body, (scores0, seen0, jnp.int32(0)))
        return scores, valid & seen, n

    def wanting(i, scores, seen):
        """Rows with an unread page whose bound reaches their k-th best score read so far (-inf: fewer than K)."""
        kth = jax.lax.top_k(jnp.where(valid & seen, scores, -jnp.inf), K)[0][:, K - 1]
        nxt = jax.lax.dynamic_index_in_dim(ranked, jnp.minimum(i * C, ranked.shape[1] - 1), axis=1,
                                           keepdims=False)
        return (req >= 0) & (i < rounds) & (nxt > -jnp.inf) & (nxt >= kth)

    def cond(c):
        return jnp.any(c[3])

    def loop(c):
        i, scores, seen, want, n = c
        scores, seen, m = read(i, scores, seen, want)
        return i + 1, scores, seen, wanting(i + 1, scores, seen), n + m

    c = (jnp.int32(0), scores0, seen0, wanting(0, scores0, seen0), jnp.int32(0))
    _, scores, seen, _, n = jax.lax.while_loop(cond, loop, c)
    return scores, valid & seen, n


def _score_keys(spec: StoreSpec, q_index, w, keys, ks):
    """Scores f32[B, S] of keys [B, S, dI'] (stored format; ks their scales or None) for queries [B, I, dI]."""
    keys = jax.lax.optimization_barrier(keys)  # same scores bit for bit whatever the pool size (see tiered.py)
    if spec.index_dtype == "fp8":
        return index_scores_fp8(q_index[:, None], w[:, None], keys, jax.lax.optimization_barrier(ks))[:, 0]
    if spec.index_dtype == "int4":
        return index_scores_int4(q_index[:, None], w[:, None], keys, jax.lax.optimization_barrier(ks))[:, 0]
    return index_scores(q_index[:, None], w[:, None], keys)[:, 0]


# ----- hot_policy="score_ema": a moving average of every position's scores, beside its key ----------------------
def update_index_ema(spec: StoreSpec, store: KVStore, index_layer: int, req, scores, valid, pages,
                     rows_per_request: int = 1):
    """Fold one step's scores (`index_scores_paged` of rows `req`: f32[B, S], valid [B, S], pages [B, P]) into
    `index_ema`: e := s the first time a position is scored (e NaN), else hot_ema_beta * e + (1 - hot_ema_beta) * s.

    With `rows_per_request` S > 1 (speculative verification) a request's S consecutive rows score its positions
    with S queries: its highest score counts, once. An indexer page two requests share (a prompt prefix) follows
    the first of them in the batch."""
    B, S_ = scores.shape
    if rows_per_request > 1:
        G = B // rows_per_request
        scores = jnp.max(jnp.where(valid, scores, -jnp.inf).reshape(G, rows_per_request, S_), axis=1)
        valid = jnp.any(valid.reshape(G, rows_per_request, S_), axis=1)
        r = jnp.maximum(group_req(req, rows_per_request), 0)  # a group's live rows are one request's
        pages = jnp.maximum(store.index_table[r][:, :pages.shape[1]], 0)
    old = store.index_ema[index_layer][pages].reshape(scores.shape)  # [B', S]
    b = spec.hot_ema_beta
    new = jnp.where(jnp.isnan(old), scores, b * old + (1 - b) * scores)
    # one writer per indexer page: the first row that scores it (a page two requests share would otherwise get two
    # values in one scatter, which a GPU resolves in no fixed order); one scatter, so XLA updates the pool in place
    scored = jnp.any(valid.reshape(pages.shape + (PAGE_SIZE,)), axis=-1)  # [B', P]
    flat = jnp.where(scored, pages, spec.index_pages).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    s_flat = flat[order]
    first = jnp.concatenate([jnp.ones((1,), bool), s_flat[1:] != s_flat[:-1]])
    writer = jnp.zeros(flat.shape, bool).at[order].set(first).reshape(pages.shape)
    ip = jnp.where(valid & jnp.repeat(writer, PAGE_SIZE, axis=1), jnp.repeat(pages, PAGE_SIZE, axis=1),
                   spec.index_pages)  # [B', S]; not scored, or another row's page: dropped
    row = jnp.broadcast_to(jnp.arange(S_, dtype=jnp.int32) % PAGE_SIZE, ip.shape)
    return _replace(store, index_ema=store.index_ema.at[index_layer, ip, row].set(new, mode="drop"))


SCORE_KEY_MAX = UNUSED_STAMP - 1  # the largest key of an average (+inf and NaN are clamped to it)


def encode_score(x):
    """f32 -> int32 in [0, SCORE_KEY_MAX], non-decreasing in x (-inf lowest): the float's bits in total order,
    less their lowest bit (averages a float32 ulp apart may tie; ties go by slot). The resolver's victims are the
    lowest (key, slot) for any int32 keys in [-1, STAMP_MARK) (`pallas_kernels.sparse_gather.reference`), so the
    averages, encoded, are its keys as they are."""
    i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    ordered = jnp.where(i >= 0, i, i ^ 0x7FFFFFFF)  # int32 order == float order (-0.0 just below +0.0)
    return jnp.minimum((ordered >> 1) + 2**30, SCORE_KEY_MAX)


def score_keys(store: KVStore, group: int, hot_token, hot_stamp):
    """score_ema's victim keys of group slices hot_token / hot_stamp int32[Rq, HR]: each held position's encoded
    average (group g's leader is index layer g), -1 for a slot holding nothing (the first victims), UNUSED_STAMP
    past the hot-row budget (never a victim)."""
    pos = jnp.maximum(hot_token, 0)
    pages = jnp.maximum(jnp.take_along_axis(store.index_table, pos // PAGE_SIZE, axis=1), 0)
    avg = store.index_ema[group, pages, pos % PAGE_SIZE]
    return jnp.where(hot_stamp == UNUSED_STAMP, UNUSED_STAMP, jnp.where(hot_token < 0, -1, encode_score(avg)))


def pad_topk(spec: StoreSpec, topk):
    """Top-k over fewer than the full MP pages, padded with -1 to the step's fixed K = min(topk, MP*64)."""
    K = min(spec.topk, spec.max_pages * PAGE_SIZE)
    return jnp.pad(topk, ((0, 0), (0, K - topk.shape[1])), constant_values=-1)


# ----- resolution: resident | hot hit | miss ----------------------------------------------------
class Plan(NamedTuple):
    """Where each top-k row is read from, and what must be fetched. All [B, K] unless noted."""

    page: jax.Array  # device page to read (resident page or hot page); 0 where invalid
    row: jax.Array  # row in that page (0 where invalid)
    valid: jax.Array  # bool: resident, hot hit or miss (not padding, an idle row, or a position with no copy)
    resident: jax.Array  # bool: read in place from a resident page
    miss: jax.Array  # bool: fetched from host this step
    src_page: jax.Array  # host page of a miss (-1 otherwise)
    src_row: jax.Array


def resolve(spec: StoreSpec, store: KVStore, group: int, req, topk, *, resolver=None):
    """Resolve the top-k positions of every decode row for indexer group `group`.

    The rule is `pallas_kernels.sparse_gather.reference` (its docstring is the spec): resident page | hot
    hit | miss (claims a slot not hit this step, the lowest in the victim order, and names the host row to copy
    into it) | invalid (padding, idle rows, non-resident positions of a request without a hot buffer, positions
    with no copy anywhere: never fetched, never read). Requires hot_rows >= K, so every miss finds a slot.
    The victim order is `spec.hot_policy`'s: "lru", the resolver's step stamps (a hit moves a slot to the
    most-recent end); "score_ema", the held positions' averaged indexer scores (`score_keys`, from `index_ema`,
    which the group leader's `update_index_ema` has advanced this step), lowest first.

    `resolver` computes the rule: None for the jnp spec (`resolve_positions`), or a function of the same
    signature such as the Pallas kernel `pallas_kernels.sparse_gather.sparse_gather` (bit-identical).
    Returns (plan, store) with the group's hot_token / hot_stamp and the requests' page_stamp updated.
    """
    resolver = resolve_positions if resolver is None else resolver
    tokens, stamps = store.hot_token[:, group], store.hot_stamp[:, group]
    keys = score_keys(store, group, tokens, stamps) if spec.hot_policy == "score_ema" else stamps
    out = resolver(topk, req, store.block_table, store.host_table, store.hot_pages, tokens, keys, store.clock,
                   hot_rows=spec.hot_rows)
    plan = Plan(*out[:7])
    # score_ema's hot_stamp only marks the slots past the budget (UNUSED_STAMP; the others stay -1): the keys the
    # resolver stamped over are this step's only
    new_stamps = out[8] if spec.hot_policy == "lru" else stamps
    rw = jnp.where(req >= 0, req, spec.max_seqs)  # idle rows write nowhere
    lp = jnp.where(plan.valid, jnp.maximum(topk, 0) // PAGE_SIZE, spec.max_pages)
    page_stamp = store.page_stamp.at[rw[:, None], lp].max(store.clock, mode="drop")
    return plan, _replace(store, hot_token=store.hot_token.at[:, group].set(out[7]),
                          hot_stamp=store.hot_stamp.at[:, group].set(new_stamps), page_stamp=page_stamp)


# ----- several query rows per request: one resolve over the union of their top-k -----------------
# Speculative (MTP) verification puts S = k + 1 rows of one request, at consecutive positions, in one step. The
# resolver rule needs distinct requests per row, and resolving each row on its own would let one row evict a hot
# slot another row of the step reads, and fetch a row missed by two rows twice. So the S rows of a group are
# resolved once, over the union of their top-k (`union_topk`, `group_req`), each distinct missing row fetched
# once, and each row then reads its own top-k through the union's plan (`row_plan`).
_NONE = jnp.iinfo(jnp.int32).max  # sorts after every position


def union_topk(topk, S: int):
    """Per group of S consecutive rows, the distinct positions of their top-k: int32[B, K] -> int32[B/S, S*K],
    ascending, -1 padded at the end (fixed shape: sort, then drop repeats). -1 entries of `topk` (padding, idle
    rows) are not positions. The union's order (ascending position) is the resolver's top-k order: misses claim
    their slots, and enter the LRU order, in position order."""
    B, K = topk.shape
    if S < 1 or B % S:
        raise ValueError(f"{B} rows are not groups of rows_per_request={S}")
    G, U = B // S, S * K
    x = jnp.sort(jnp.where(topk >= 0, topk, _NONE).reshape(G, U), axis=1)
    first = jnp.concatenate([jnp.ones((G, 1), bool), x[:, 1:] != x[:, :-1]], axis=1) & (x != _NONE)
    at = jnp.where(first, jnp.cumsum(first, axis=1) - 1, U)  # compacted column of each kept position
    return jnp.full((G, U), -1, jnp.int32).at[jnp.arange(G)[:, None], at].set(x.astype(jnp.int32), mode="drop")


def group_req(req, S: int):
    """The request of each group of S consecutive rows: int32[B] -> int32[B/S], that of its live rows (-1: every
    row idle). The rows of a group must name one request or be idle (-1); rows naming different live requests
    are a caller bug, not detected here (`check_groups` checks a batch on the host)."""
    return jnp.max(req.reshape(-1, S), axis=1)


def check_groups(req, S: int) -> None:
    """Host-side check of a batch's `req` (int32[B], NumPy or concrete) for `S` rows per request: B a multiple of
    S, the live rows of each group one request, and no request in two groups. ValueError naming the group."""
    req = np.asarray(req)
    if req.ndim != 1 or req.shape[0] % S:
        raise ValueError(f"req of shape {req.shape} is not groups of rows_per_request={S}")
    seen = {}
    for g, rows in enumerate(req.reshape(-1, S)):
        live = set(rows[rows >= 0].tolist())
        if len(live) > 1:
            raise ValueError(f"rows {g * S}..{g * S + S - 1} name different requests {sorted(live)}")
        for r in live:
            if r in seen:
                raise ValueError(f"request {r} is in row groups {seen[r]} and {g}")
            seen[r] = g


def row_plan(union_plan: Plan, union, topk, S: int) -> Plan:
    """Each row's own plan ([B, K], in its top-k order) from its group's union plan ([B/S, S*K], over `union`
    = `union_topk(topk, S)`): top-k position t of row b is looked up (searchsorted) in its group's sorted union,
    and reads that entry's address. Padding (-1) is invalid, page 0 row 0, as in the resolver; src_row = t % 64
    everywhere, src_page -1 where not a miss. Rows of one group that select the same missing position both
    carry miss=True at the same hot slot (it is fetched once, from the union plan)."""
    B, K = topk.shape
    G, U = union.shape
    key = jnp.where(union >= 0, union, _NONE)  # ascending
    t = topk.reshape(G, S * K)
    idx = jnp.minimum(jax.vmap(jnp.searchsorted)(key, jnp.where(t >= 0, t, _NONE)), U - 1)
    take = lambda a: jnp.take_along_axis(a, idx, axis=1).reshape(B, K)  # noqa: E731
    t = topk
    valid = (t >= 0) & (take(key) == t) & take(union_plan.valid)
    miss = valid & take(union_plan.miss)
    return Plan(page=jnp.where(valid, take(union_plan.page), 0), row=jnp.where(valid, take(union_plan.row), 0),
                valid=valid, resident=valid & take(union_plan.resident), miss=miss,
                src_page=jnp.where(miss, take(union_plan.src_page), -1),
                src_row=(jnp.maximum(t, 0) % PAGE_SIZE).astype(jnp.int32))


# ----- host -> device fetch of the misses -------------------------------------------------------
def fetch_misses(spec: StoreSpec, store: KVStore, first_layer, num_layers: int, plan: Plan):
    """Copy every miss's row (layers first_layer .. first_layer + num_layers - 1: an indexer group) from its host
    page into its hot slot. `first_layer` may be traced (the scan over layers); `num_layers` is static.

    Returns (store, payload_rows, transfer_rows) in layer-rows (one token's row in one layer; bytes =
    rows x `spec.row_bytes`, computed on the host so nothing overflows int32): payload = misses x layers;
    transfer = what
    the mechanism moved (row: the staging buffer's rows, `fetch_sizes`; page: each distinct host page once).
    """
    if spec.fetch == "row":
        return _fetch_rows(spec, store, first_layer, num_layers, plan)
    return _fetch_pages(spec, store, first_layer, num_layers, plan)


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


def _fetch_rows(spec, store, lo, nl, plan):
    """Row fetch: one host computation gathers every miss's row, all layers of the group and all host pools, into
    one packed staging buffer (`gather_packed`), one host -> device copy moves it, and the device unpacks it into
    its pools (one scatter per pool). The staging buffer has one of `fetch_sizes` static sizes, the smallest that
    holds the misses, picked by a `lax.switch` on the miss count (no misses: nothing runs); exactly one branch runs,
    so a step makes one host computation and one copy per group, with no loop."""
    n, sp, sr, dp, dr = _compact_misses(plan)
    sizes = fetch_sizes(spec.fetch_min_rows, sp.shape[0])
    hosts = _host_pools(store)
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
    pools = jax.lax.switch(pick, [lambda pools: pools] + [staged(s) for s in sizes], _device_pools(store))
    moved = jnp.asarray((0,) + sizes, jnp.int32)[pick]
    return _with_device_pools(store, pools), n * nl, moved * nl


def _fetch_pages(spec, store, lo, nl, plan):
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
        for host, pool in zip(_host_pools(store), pools):
            blk = jax.lax.dynamic_slice(host, (lo, hp) + (0,) * (host.ndim - 2), (nl, 1) + host.shape[2:])
            pages.append(jax.device_put(blk, DEVICE)[:, 0])  # [nl, 64, X] bits

        def row_body(m, pools):
            return tuple(jax.lax.dynamic_update_slice(
                pool, pg[:, sr[m]][:, None, None], (lo, dp[m], dr[m]) + (0,) * (pool.ndim - 3))
                for pool, pg in zip(pools, pages))

        return jax.lax.fori_loop(s, e, row_body, pools)

    pools = _device_pools(store)
    bits = jax.lax.fori_loop(0, n_pages, page_body, tuple(to_host_bits(p) for p in pools))
    pools = tuple(from_host_bits(b, p.dtype) for b, p in zip(bits, pools))
    return _with_device_pools(store, pools), n * nl, n_pages * nl * PAGE_SIZE


def _device_pools(store):
    return tuple(p for p in (store.latent, store.rope, store.latent_scale) if p is not None)


def _host_pools(store):
    return tuple(p for p in (store.h_latent, store.h_rope, store.h_latent_scale) if p is not None)


def _with_device_pools(store, pools):
    upd = dict(latent=pools[0], rope=pools[1])
    if len(pools) == 3:
        upd["latent_scale"] = pools[2]
    return _replace(store, **upd)


# ----- reads ------------------------------------------------------------------------------------
def gather_rows(spec: StoreSpec, store: KVStore, layer: int, plan: Plan):
    """Rows at the plan's addresses: (latent f32[B, K, C], rope f32[B, K, R]); invalid slots are zeros."""
    lat = store.latent[layer][plan.page, plan.row]
    sc = store.latent_scale[layer][plan.page, plan.row] if spec.fp8 else None
    c = decode_latent(spec, lat, sc)
    r = store.rope[layer][plan.page, plan.row].astype(jnp.float32)
    v = plan.valid[..., None]
    return jnp.where(v, c, 0.0), jnp.where(v, r, 0.0)


# ----- host-decided table updates ---------------------------------------------------------------
def evict_pages(spec: StoreSpec, store: KVStore, req, page_idx):
    """Release device pages: req / page_idx int32[N] (-1 padded) name logical pages whose host copy is current.

    Without the eager mirror the page is first written back (all layers). Returns (store, d2h_rows);
    the caller returns the freed device pages to its `PagePool`.
    """
    ok = (req >= 0) & (page_idx >= 0)
    r, i = jnp.maximum(req, 0), jnp.maximum(page_idx, 0)
    d2h = jnp.zeros((), jnp.int32)
    if not spec.mirror_to_host:
        store, d2h = _write_back(spec, store, jnp.where(ok, store.block_table[r, i], -1),
                                 jnp.where(ok, store.host_table[r, i], -1))
    bt = store.block_table.at[jnp.where(ok, r, spec.max_seqs), i].set(-1, mode="drop")
    return _replace(store, block_table=bt), d2h


def _write_back(spec, store, dpages, hpages):
    """Copy whole device pages to host pages (all layers): each page a [L, 1, 64, X] device slice put in host
    memory and written with `dynamic_update_slice` into the pinned-host pool (in place; pairs with a -1 are
    skipped, not written)."""
    ok = (dpages >= 0) & (hpages >= 0)
    order = jnp.argsort(~ok, stable=True)  # the pages to write first, in their order
    n = jnp.sum(ok).astype(jnp.int32)

    def body(j, hosts):
        k = order[j]
        out = []
        for host, dev in zip(hosts, _device_pools(store)):
            blk = jax.lax.dynamic_slice(dev, (0, dpages[k]) + (0,) * (dev.ndim - 2), (dev.shape[0], 1) + dev.shape[2:])
            out.append(jax.lax.dynamic_update_slice(host, _to_host(blk), (0, hpages[k]) + (0,) * (host.ndim - 2)))
        return tuple(out)

    hosts = jax.lax.fori_loop(0, n, body, _host_pools(store))
    return _with_host_pools(store, hosts), n * spec.num_layers * PAGE_SIZE


def load_pages(spec: StoreSpec, store: KVStore, hpages, dpages):
    """Copy whole host pages into device pages (all layers), one H2D slice per page: hpages / dpages int32[N]
    (-1 padded). Used to swap a request back in. Returns (store, h2d_rows)."""
    n = hpages.shape[0]

    def body(j, pools):
        ok = (hpages[j] >= 0) & (dpages[j] >= 0)
        hp = jnp.maximum(hpages[j], 0)
        dp = jnp.where(ok, dpages[j], spec.device_pages)  # out of range: the update is skipped below
        out = []
        for pool, host in zip(pools, _host_pools(store)):
            blk = jax.lax.dynamic_slice(host, (0, hp) + (0,) * (host.ndim - 2), (host.shape[0], 1) + host.shape[2:])
            out.append(set_rows(pool, (slice(None), dp), _from_host(blk, pool.dtype)[:, 0]))
        return tuple(out)

    pools = jax.lax.fori_loop(0, n, body, _device_pools(store))
    rows = jnp.sum((hpages >= 0) & (dpages >= 0)).astype(jnp.int32) * spec.num_layers * PAGE_SIZE
    return _with_device_pools(store, pools), rows


def set_tables(store: KVStore, req: int, block_row, host_row, index_row, seq_len: int, hot_row, hot_rows):
    """Replace one request slot's tables (host-decided: admission, growth, release). Rows are int32[MP] / [NH].

    The hot buffer's tags are cleared; its first `hot_rows` slots (the budget, a traced number: budgets inside one
    capacity share this program) become never-used (stamp -1, the least recent), the others `UNUSED_STAMP`, newer
    than any step's stamp: with hot_rows >= K a step always finds its victims among the first, so the others are
    never claimed (and, holding no position, never hit)."""
    HR = store.hot_stamp.shape[-1]
    stamps = jnp.where(jnp.arange(HR, dtype=jnp.int32) < hot_rows, -1, UNUSED_STAMP).astype(jnp.int32)
    return _replace(
        store,
        block_table=store.block_table.at[req].set(block_row), host_table=store.host_table.at[req].set(host_row),
        index_table=store.index_table.at[req].set(index_row), seq_lens=store.seq_lens.at[req].set(seq_len),
        hot_pages=store.hot_pages.at[req].set(hot_row),
        hot_token=store.hot_token.at[req].set(-1), hot_stamp=store.hot_stamp.at[req].set(stamps))


def write_prefill(spec: StoreSpec, store: KVStore, req, latent, rope, index_k, length, start=0, offset=0):
    """Write a prompt's rows: latent [L, T, C], rope [L, T, R], index_k [LI, T, dI] (row t = position
    offset + t; `offset` a multiple of PAGE_SIZE, so a long prompt can be written a bounded chunk at a time) of
    which positions start..length-1 are written (earlier ones, e.g. a shared prefix, are left alone), for
    request slot `req` (scalar). Every token goes to its indexer page, to its device page when resident and
    to its host page when it has one. Returns (store, d2h_rows)."""
    T = latent.shape[1]
    pos = offset + jnp.arange(T, dtype=jnp.int32)
    ok = (pos >= start) & (pos < length)
    lp = jnp.minimum(pos // PAGE_SIZE, spec.max_pages - 1)
    row = pos % PAGE_SIZE
    dpage, hpage, ipage = store.block_table[req, lp], store.host_table[req, lp], store.index_table[req, lp]
    dp = _drop(dpage, ok & (dpage >= 0), spec.device_pages)
    ip = _drop(ipage, ok & (ipage >= 0), spec.index_pages)
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
                   **_prefill_summaries(spec, store, req, scored_keys(spec, kv, ks), pos, ok, start))
    else:
        upd["index_k"] = set_rows(store.index_k, (slice(None), ip, row), kv)
        if ks is not None:
            upd["index_scale"] = store.index_scale.at[:, ip, row].set(ks, mode="drop")
    if spec.fp8:
        upd["latent_scale"] = store.latent_scale.at[:, dp, row].set(scales, mode="drop")
    if store.index_ema is not None:
        upd["index_ema"] = store.index_ema.at[:, ip, row].set(jnp.nan, mode="drop")
    hosts = _write_host_pages(spec, _host_pools(store), store.host_table[req], (vals, rope, scales), start, end,
                              offset)
    seq_lens = store.seq_lens.at[req].set(length)
    return (_replace(_with_host_pools(_replace(store, **upd), hosts), seq_lens=seq_lens),
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


def _with_host_pools(store, hosts):
    upd = dict(h_latent=hosts[0], h_rope=hosts[1])
    if len(hosts) == 3:
        upd["h_latent_scale"] = hosts[2]
    return _replace(store, **upd)


def _replace(store: KVStore, **kw) -> KVStore:
    import dataclasses

    return dataclasses.replace(store, **kw)
