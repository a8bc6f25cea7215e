"""The device's summaries of the host tier's indexer-key pages (index_tier="host"), from which each page's scores
are bounded without its keys: written as keys are written, read to rank the pages a step reads
(`kv.scoring.index_scores_host`).

`StoreSpec.index_summary` picks the kind (`pallas_kernels.indexer_topk.reference.SUMMARY_KINDS` has the math):
  "box"  per page and dimension the min / max of its scored keys, bf16 rounded outward (`index_lo` / `index_hi`);
         a page first written (row 0, or a prompt page from its start) starts a new box, one only widened otherwise;
  "rvq"  per key, the scored key in the model's frame (`model_frame`) un-rotated by its RoPE and coded by residual
         vector quantization against the index layer's codebooks (`index_codes`: one byte per stage) with an e4m3
         radius of what the codes leave (`index_radius`, NaN for a radius past e4m3's range: that key bounds
         nothing). A row's codes are its own: nothing is reset when a page is lent again, and a row past a
         request's length (another owner's, or never written) takes no part in its page's bound.

* `append_summaries` / `prefill_summaries`  the summary fields a decode step's keys / a prompt's keys change
* `summary_bounds`                          "box": keys rounded outward to the summaries' dtype
* `page_ranks`                              each row's pages ranked for reading (bound, or budgeted mode's centre)
* `model_frame` / `rope_tables`             the frame "rvq" codes keys in, and the pure RoPE rotation tables
* `IndexCodebooks` / `with_index_codebooks` "rvq"'s codebooks, given to a store when it is made
* `rvq_residuals`                           how far keys lie from their codes' reconstructions (the restore audit)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.kv.codec import drop_unless, set_rows
from hisparse_jax.kv.spec import SUMMARY_DTYPE
from hisparse_jax.kv.state import KVStore
from hisparse_jax.units import PAGE_SIZE
from pallas_kernels.common import hadamard
from pallas_kernels.indexer_topk.reference import rvq_decode, rvq_encode, summary_centre_score, summary_score_bound


class IndexCodebooks(NamedTuple):
    """index_summary="rvq"'s codebooks: books f32[LI, m, 256, dI] (per index layer, `reference.rvq_fit` of its keys
    in the model's frame un-rotated by `rope_tables`; stored as bf16, so give bf16-exact values to code with exactly
    these) and rope_freq f32[R/2], the frequencies of the model's RoPE over the keys' first R dimensions."""

    books: object
    rope_freq: object


def with_index_codebooks(store: KVStore, codebooks: IndexCodebooks) -> KVStore:
    """`store` (an empty one: codes written against other codebooks would no longer bound their keys) holding
    `codebooks`, checked against its geometry (ValueError naming what differs)."""
    if not isinstance(codebooks, IndexCodebooks):
        raise TypeError(f"index_codebooks must be an IndexCodebooks (`index_codebooks.fit_index_codebooks`), got "
                        f"{type(codebooks).__name__}")
    books, freq = np.asarray(codebooks.books, np.float32), np.asarray(codebooks.rope_freq, np.float32)
    for name, got, want in (("books", books.shape, store.index_codebooks.shape),
                            ("rope_freq", freq.shape, store.index_rope_freq.shape)):
        if got != want:
            raise ValueError(f"index_codebooks.{name} has shape {got}; this store's is {want} (index layers, stages "
                             f"= index_head_dim / 16 - 1, 256 centroids, index_head_dim; rope dimensions / 2)")
    if not (np.isfinite(books).all() and np.isfinite(freq).all()):
        raise ValueError("index_codebooks hold a value that is not finite")
    if np.asarray(jax.device_get(store.seq_lens)).any():
        raise ValueError("index_codebooks are given to an empty store: this one holds keys coded with its own")
    return store.replace(
        index_codebooks=jax.device_put(books.astype(store.index_codebooks.dtype), store.index_codebooks.sharding),
        index_rope_freq=jax.device_put(freq, store.index_rope_freq.sharding))


def rvq_residuals(store: KVStore, index_layer: int, keys, positions, codes):
    """|key - reconstruction| f32[N] of scored keys f32[N, dI] at `positions` int[N] with "rvq" codes uint8[N, m]
    in index layer `index_layer` (each radius the store holds must be at least its key's)."""
    cos, sin = rope_tables(store.index_rope_freq, jnp.asarray(positions))
    e = model_frame(store.spec, jnp.asarray(keys, jnp.float32)) - rvq_decode(
        jnp.asarray(codes), store.index_codebooks[index_layer].astype(jnp.float32), cos, sin)
    return jnp.sqrt((e * e).sum(-1))


def model_frame(spec, x):
    """Scored keys (`codec.scored_keys`) or scored queries (`scoring.scored_query`), f32[..., dI] -> the same vectors
    in the frame the model's RoPE turns: fp8 and int4 score in the Hadamard-rotated frame (`hadamard` is its own
    inverse, and an orthonormal turn keeps every dot and norm), the other formats in the model's."""
    return hadamard(x) if spec.index_dtype in ("fp8", "int4") else x


def rope_tables(freq, positions):
    """RoPE's rotation at `positions` int[S] for frequencies f32[R/2] -> (cos, sin) f32[S, R/2]: the pure turn (no
    attention factor: a model that scales its rotated dimensions scales its un-rotated keys alike, and the
    codebooks are fitted to those, `index_codebooks.fit_index_codebooks`)."""
    a = positions.astype(jnp.float32)[:, None] * freq.astype(jnp.float32)[None]
    return jnp.cos(a), jnp.sin(a)


def rvq_codes(store: KVStore, books, keys, positions):
    """"rvq" codes of scored keys f32[..., S, dI] at `positions` int[S] with codebooks f32[m, 256, dI] -> (codes
    uint8[..., S, m], radius e4m3[..., S]: NaN where it is past e4m3's range)."""
    cos, sin = rope_tables(store.index_rope_freq, positions)
    codes, radius = rvq_encode(model_frame(store.spec, keys), books, cos, sin)
    return codes.astype(jnp.uint8), jnp.where(jnp.isinf(radius), jnp.nan, radius).astype(jnp.float8_e4m3fn)


def summary_bounds(k):
    """f32 keys -> (lo, hi) in the summaries' dtype (`SUMMARY_DTYPE`), rounded outward (lo <= k <= hi exactly), so
    a page's summary still bounds every key written to it."""
    lo, hi = k.astype(SUMMARY_DTYPE), k.astype(SUMMARY_DTYPE)
    lo = jnp.where(lo.astype(jnp.float32) > k, jnp.nextafter(lo, jnp.asarray(-jnp.inf, SUMMARY_DTYPE)), lo)
    hi = jnp.where(hi.astype(jnp.float32) < k, jnp.nextafter(hi, jnp.asarray(jnp.inf, SUMMARY_DTYPE)), hi)
    return lo, hi


def append_summaries(store: KVStore, index_layer, ipage, row, ok, keys, positions) -> dict:
    """The summary fields after a decode step's keys f32[B, dI] (scored) are written at `positions` [B] to rows `row`
    of indexer pages `ipage` (rows `ok` only)."""
    spec = store.spec
    page = drop_unless(ipage, ok, spec.index_pages)
    if spec.index_summary == "rvq":
        codes, radius = rvq_codes(store, store.index_codebooks[index_layer].astype(jnp.float32), keys,
                                  jnp.maximum(positions, 0))
        return {"index_codes": store.index_codes.at[index_layer, page, row].set(codes, mode="drop"),
                "index_radius": set_rows(store.index_radius, (index_layer, page, row), radius)}
    lo_k, hi_k = summary_bounds(keys)
    fresh = drop_unless(ipage, ok & (row == 0), spec.index_pages)
    lo = store.index_lo.at[index_layer, fresh].set(jnp.inf, mode="drop")
    hi = store.index_hi.at[index_layer, fresh].set(-jnp.inf, mode="drop")
    return {"index_lo": lo.at[index_layer, page].min(lo_k, mode="drop"),
            "index_hi": hi.at[index_layer, page].max(hi_k, mode="drop")}


def prefill_summaries(store: KVStore, req, keys, pos, ok, start) -> dict:
    """The summary fields after a prompt's keys f32[LI, T, dI] (scored) at positions `pos` [T] (page-aligned: row t
    is pos[0] + t) are written for request slot `req`, rows `ok` only. "box": a page whose first position is at or
    past `start` is summarized anew from its written rows; the page of `start` (a shared prefix ends inside it) is
    widened."""
    spec = store.spec
    LI, T, dI = keys.shape
    lp = jnp.minimum(pos // PAGE_SIZE, spec.max_pages - 1)
    if spec.index_summary == "rvq":
        ip = drop_unless(store.index_table[req, lp], ok & (store.index_table[req, lp] >= 0), spec.index_pages)
        codes, radius = jax.vmap(lambda k, b: rvq_codes(store, b, k, pos))(
            keys, store.index_codebooks.astype(jnp.float32))
        row = pos % PAGE_SIZE
        return {"index_codes": store.index_codes.at[:, ip, row].set(codes, mode="drop"),
                "index_radius": set_rows(store.index_radius, (slice(None), ip, row), radius)}
    NP = -(-T // PAGE_SIZE)
    pad = NP * PAGE_SIZE - T
    kb = jnp.pad(keys, ((0, 0), (0, pad), (0, 0))).reshape(LI, NP, PAGE_SIZE, dI)
    okb = jnp.pad(ok, (0, pad)).reshape(NP, PAGE_SIZE)[None, :, :, None]
    lo, hi = summary_bounds(kb)
    lo = jnp.where(okb, lo, jnp.inf).min(axis=2)  # [LI, NP, dI]
    hi = jnp.where(okb, hi, -jnp.inf).max(axis=2)
    first = jnp.pad(pos, (0, pad)).reshape(NP, PAGE_SIZE)[:, 0]  # each block's first position (page-aligned)
    ipage = store.index_table[req, jnp.minimum(first // PAGE_SIZE, spec.max_pages - 1)]
    any_ok = okb[0, :, :, 0].any(-1) & (ipage >= 0)
    page = drop_unless(ipage, any_ok, spec.index_pages)
    anew = drop_unless(ipage, any_ok & (first >= start), spec.index_pages)
    idx_lo = store.index_lo.at[:, anew].set(jnp.inf, mode="drop")
    idx_hi = store.index_hi.at[:, anew].set(-jnp.inf, mode="drop")
    return {"index_lo": idx_lo.at[:, page].min(lo, mode="drop"), "index_hi": idx_hi.at[:, page].max(hi, mode="drop")}


def page_ranks(store: KVStore, index_layer: int, pages, valid, q, w, *, centre: bool = False):
    """Each row's pages ranked for reading: pages int32[B, P] (the request's indexer pages, each >= 0), valid
    bool[B, P * 64] (the row's positions), q f32[B, I, dI] / w f32[B, I] the scored query (`scoring.scored_query`)
    -> f32[B, P]: an upper bound of every valid position's score in the page (`summary_score_bound`), or with
    `centre` budgeted mode's guess (`summary_centre_score`). Pages with no valid position come back arbitrary: the
    caller masks them."""
    spec = store.spec
    if spec.index_summary == "rvq":
        B, P = pages.shape
        radius = store.index_radius[index_layer, pages].astype(jnp.float32)  # [B, P, 64]
        radius = jnp.where(valid.reshape(B, P, PAGE_SIZE), jnp.where(jnp.isnan(radius), jnp.inf, radius), -1.0)
        summary = (store.index_codes[index_layer, pages], radius)
        cos, sin = rope_tables(store.index_rope_freq, jnp.arange(P * PAGE_SIZE, dtype=jnp.int32))
        basis = (store.index_codebooks[index_layer].astype(jnp.float32), cos, sin)
        q = model_frame(spec, q)
    else:
        # one gather at (layer, page) each: no copy of the layer's summaries
        summary = (store.index_lo[index_layer, pages].astype(jnp.float32),
                   store.index_hi[index_layer, pages].astype(jnp.float32))
        basis = None
    rank = summary_centre_score if centre else summary_score_bound
    return rank(q[:, None], w[:, None], spec.index_summary, summary, basis)[:, 0]
