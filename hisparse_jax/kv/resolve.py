"""Resolution: each decode row's top-k positions -> the addresses its rows are read from (`Plan`), and the hot
buffer's victim order.

Shapes: B decode rows (`req` int32[B], -1 = idle row), K top-k slots (-1 padded), HR hot rows, 64 tokens per page.

* `resolve`           top-k positions -> resident page | hot hit | miss (claims the lowest slot of the victim order;
                      the plan names the host row to fetch) | invalid; the rule is
                      `pallas_kernels.sparse_gather.reference`
* the victim order    hot_policy="lru": the resolver's step stamps; hot_policy="score_ema": the held positions'
                      moving averages of the indexer's scores (`update_index_ema` folds a step's scores in,
                      `score_keys` / `encode_score` make them the resolver's keys)
* `union_topk` / `group_req` / `row_plan` / `check_groups`: several query rows per request (speculative
                      verification) resolved once, over the union of their top-k; each row's plan looked up in the
                      union's
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.kv.state import KVStore
from hisparse_jax.units import PAGE_SIZE
from pallas_kernels.sparse_gather.reference import UNUSED_STAMP, resolve_positions


class Plan(NamedTuple):
    """Where each top-k row is read from, and what must be fetched. All [B, K] unless noted."""

    page: jax.Array  # device page to read (resident page or hot page); 0 where invalid
    row: jax.Array  # row in that page (0 where invalid)
    valid: jax.Array  # bool: resident, hot hit or miss (not padding, an idle row, or a position with no copy)
    resident: jax.Array  # bool: read in place from a resident page
    miss: jax.Array  # bool: fetched from host this step
    src_page: jax.Array  # host page of a miss (-1 otherwise)
    src_row: jax.Array


def resolve(store: KVStore, group: int, req, topk, *, resolver=None):
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
    spec = store.spec
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
    return plan, store.replace(hot_token=store.hot_token.at[:, group].set(out[7]),
                               hot_stamp=store.hot_stamp.at[:, group].set(new_stamps), page_stamp=page_stamp)


# ----- hot_policy="score_ema": a moving average of every position's scores, beside its key ----------------------
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


def update_index_ema(store: KVStore, index_layer: int, req, scores, valid, pages, rows_per_request: int = 1):
    """Fold one step's scores (`index_scores_paged` of rows `req`: f32[B, S], valid [B, S], pages [B, P]) into
    `index_ema`: e := s the first time a position is scored (e NaN), else hot_ema_beta * e + (1 - hot_ema_beta) * s.

    With `rows_per_request` S > 1 (speculative verification) a request's S consecutive rows score its positions
    with S queries: its highest score counts, once. An indexer page two requests share (a prompt prefix) follows
    the first of them in the batch."""
    spec = store.spec
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
    return store.replace(index_ema=store.index_ema.at[index_layer, ip, row].set(new, mode="drop"))


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
