"""The indexer over the store's paged keys: each decode row's scores of its request's positions and their top-k.

Shapes: B decode rows (`req` int32[B], -1 = idle row), I indexer heads, dI indexer dim, P pages scored per row
(`num_pages`, at most MP), S = P * 64 positions, K = min(topk, MP * 64).

* `index_select` / `index_select_read`  top-k positions int32[B, K] (-1 padded), from either key tier
* `index_scores_paged`                   scores of keys on the device (index_tier="device")
* `index_scores_host`                    scores of keys in pinned-host memory (index_tier="host"), read best page
                                         summary bound first, exactly or within a page budget
* `topk_of_scores` / `pad_topk`          the step's fixed-width top-k of those scores
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hisparse_jax.compat import HOST, on_host
from hisparse_jax.kv.codec import from_host_memory
from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.kv.state import KVStore
from hisparse_jax.kv.summary import page_ranks
from hisparse_jax.units import PAGE_SIZE
from pallas_kernels.common import fp8_quantize, hadamard, mxfp4_dequantize, mxfp4_quantize
from pallas_kernels.indexer_topk.reference import index_scores, index_scores_fp8, index_scores_int4, select_topk


def index_select(store: KVStore, index_layer: int, req, positions, q_index, w, num_pages: int | None = None):
    """Top-k of the indexer over keys 0..positions[b] of request req[b] -> int32[B, K] (K = min(topk, MP*64)).

    q_index f32[B, I, dI], w f32[B, I]. fp8 stores score in DeepSeek's FP8 emulation. Idle rows: all -1.
    num_pages (static): score only each request's first `num_pages` pages — the caller's bound on the batch's
    longest live sequence, so a step costs O(context), not O(max_seq_len); None scores all MP.
    """
    return index_select_read(store, index_layer, req, positions, q_index, w, num_pages)[0]


def index_select_read(store: KVStore, index_layer: int, req, positions, q_index, w, num_pages: int | None = None):
    """`index_select` and the indexer key pages it read from the host (int32[]; 0 with device keys)."""
    spec = store.spec
    if spec.index_tier == "host":
        scores, valid, n = index_scores_host(store, index_layer, req, positions, q_index, w, num_pages)
        return topk_of_scores(spec, scores, valid), n
    scores, valid, _ = index_scores_paged(store, index_layer, req, positions, q_index, w, num_pages)
    return topk_of_scores(spec, scores, valid), jnp.zeros((), jnp.int32)


def topk_of_scores(spec: StoreSpec, scores, valid):
    """`index_select`'s top-k of `index_scores_paged`'s scores: int32[B, K], -1 padded."""
    return pad_topk(spec, select_topk(scores, valid, spec.topk))


def pad_topk(spec: StoreSpec, topk):
    """Top-k over fewer than the full MP pages, padded with -1 to the step's fixed K = min(topk, MP*64)."""
    K = min(spec.topk, spec.max_pages * PAGE_SIZE)
    return jnp.pad(topk, ((0, 0), (0, K - topk.shape[1])), constant_values=-1)


def index_scores_paged(store: KVStore, index_layer: int, req, positions, q_index, w, num_pages: int | None = None):
    """The indexer's scores of keys 0..positions[b] of request req[b] (`index_select`'s, before the top-k):
    (scores f32[B, S], valid bool[B, S], pages int32[B, P]: the indexer pages read, S = P * 64). Device keys only
    (index_tier="host" scores with `index_scores_host`)."""
    spec = store.spec
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
def index_scores_host(store: KVStore, index_layer: int, req, positions, q_index, w, num_pages: int | None = None):
    """`index_scores_paged` with index_tier="host": each row's pages ranked by their summary's bound
    (`summary.page_ranks`: an upper bound of every score in the page, from `StoreSpec.index_summary`'s kind) and
    read from the pinned-host pool best bound first, `spec.index_read_chunk` pages per round. Exact mode
    (index_budget_pages None) reads rounds until no unread page's bound reaches the row's k-th best score read so far:
    every position of the exact top-k has then been scored, with the same arithmetic as device keys (`_score_keys`), so
    `select_topk` of the result is the device tier's top-k. Budgeted mode reads the index_budget_pages best-ranked pages
    (rounds of the chunk, the last one cut), a fixed amount per step: best bound first, or with index_rank="centre" best
    score of the summary's centre first (the box's midpoint; "rvq": the page's best reconstructed key).

    Returns (scores f32[B, S], valid bool[B, S] (only positions read are valid), pages_read int32[] (summed over the
    rows: what crossed the host link)). A page with no valid position is never read. Exact mode's loop is a
    `while_loop` whose trip count depends on the scores (on a GPU: one small device -> host read per round)."""
    spec = store.spec
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
    # "centre" is no bound: budgeted mode only
    rank = page_ranks(store, index_layer, pages, valid, qb, wb,
                      centre=spec.index_budget_pages is not None and spec.index_rank == "centre")  # [B, P]
    rank = jnp.where(live, jnp.where(jnp.isnan(rank), jnp.inf, rank), -jnp.inf)
    order = jnp.argsort(-rank, axis=-1, stable=True).astype(jnp.int32)  # best first
    ranked = jnp.take_along_axis(rank, order, axis=-1)
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
        kb = from_host_memory(on_host(gather, store.index_k, hp), kdt)  # [B, C, 64, dI']
        sb = None if store.index_scale is None else from_host_memory(on_host(gather, store.index_scale, hp), sdt)
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


def _score_keys(spec: StoreSpec, q_index, w, keys, ks):
    """Scores f32[B, S] of keys [B, S, dI'] (stored format; ks their scales or None) for queries [B, I, dI]."""
    keys = jax.lax.optimization_barrier(keys)  # same scores bit for bit whatever the pool size (see tiered.py)
    if spec.index_dtype == "fp8":
        return index_scores_fp8(q_index[:, None], w[:, None], keys, jax.lax.optimization_barrier(ks))[:, 0]
    if spec.index_dtype == "int4":
        return index_scores_int4(q_index[:, None], w[:, None], keys, jax.lax.optimization_barrier(ks))[:, 0]
    return index_scores(q_index[:, None], w[:, None], keys)[:, 0]
