"""The hot buffer's one job: each decode row's top-k positions -> the addresses its rows are read from (`Plan`) and
the hot buffer's victim order; then the misses brought in host -> device (`fetch_misses`) and every row read at its
plan's address (`gather_rows`).

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
* `fetch_misses`      the misses' rows copied into their hot slots. Mechanisms (`StoreSpec.fetch`): "row", one packed
                      host gather and one host -> device copy per indexer group and step (`gather_packed`, at one of
                      `fetch_sizes` static sizes); "page", each distinct host page of the misses copied on its own.
                      Counts are layer-rows (one token's row in one layer); bytes = rows x `StoreSpec.row_bytes`, on
                      the host
* `gather_rows`       the rows at a plan's addresses (resident pages and hot slots alike), decoded
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.compat import DEVICE, HOST, on_host
from hisparse_jax.kv.codec import decode_latent, set_rows
from hisparse_jax.kv.state import KVStore, from_host_bits, to_host_bits
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


# ----- the resolved rows' way to the attention: misses host -> hot slots, then every row read ------------
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
