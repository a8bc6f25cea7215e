"""The spec of the fused HiSparse resolver for one indexer group (pure jnp): the one resolver rule.

`resolve_positions` is the rule; `sparse_gather_reference` is it behind the kernel's checked, jitted
signature; the Pallas kernel reproduces it bit for bit; `hisparse_jax.kv.ops.resolve` calls it (or the
kernel) and records the result in the store.

Shapes: B decode rows, K top-k slots, Rq request slots, MP pages per request, NH hot pages per request,
HR hot rows (slots) per request; 64 tokens per page.

A request has a hot buffer when every page its HR slots live on is lent: hot_pages[r, :ceil(HR / 64)] >= 0
(`has_hot_buffer`; the cache manager lends them all or none). Slot j lives at (hot_pages[r, j // 64], j % 64).

LRU state. hot_stamp[r, j] is slot j's LRU *rank* (0 = least recently used, HR - 1 = most recent): after
every step in which r is live and has a hot buffer, hot_stamp[r] is a permutation of 0..HR-1, so the
order is total and the values never grow (no clock, no int32 overflow however long a request runs). The
order a step reads (the "previous order") is the (hot_stamp, slot) order, least recent first; it is
defined for any stamps. A fresh or re-admitted request holds -1 everywhere (`init_store`,
`ops.set_tables`), which this order reads exactly as ranks = slot index. "Never used" is hot_token == -1;
starting from -1 stamps, never-used slots always hold the lowest ranks, in slot order (they start there,
are never hit, and are the first victims), so misses fill an empty buffer from slot 0 up.

For top-k position t of decode row b (request r = req[b]), with dpage = block_table[r, t // 64] and
hpage = host_table[r, t // 64] (a position at or beyond MP * 64 has neither):

* resident   dpage >= 0: read in place at (dpage, t % 64).
* hot hit    r has a hot buffer and it holds t (the lowest slot j with hot_token[r, j] == t, looked up in
             the buffer as it was *before* this step): read slot j.
* miss       r has a hot buffer that does not hold t, and hpage >= 0: the q-th miss of the row (q counted
             in top-k order) claims the q-th slot, in the previous order, among the slots *not hit* this
             step — i.e. the least recently used untouched slot (never-used slots first, lower slot first
             among them). The slot gets hot_token := t, and the plan names the host row to copy into it:
             (src_page, src_row) = (hpage, t % 64). (A hit slot is never a victim; hot_rows >= K leaves at
             least as many untouched slots as misses.)
* invalid    everything else: t == -1 (padding), r == -1 (idle row), a non-resident position of a request
             without a hot buffer (its hot page -1 is never an address), or a position with no copy at all
             (not resident, not in the hot buffer, no host page). Page 0, row 0, valid False, nothing
             changes, nothing is fetched; the readers ignore the address.

LRU order after the step (vLLM / SGLang HiSparse's order), from least to most recently used, written as
ranks 0..HR-1 into hot_stamp[r] of every live row whose request has a hot buffer (rows of requests without
one keep their stamps):
  1. the slots untouched this step (neither hit nor claimed), in their previous order;
  2. then the slots claimed by this step's misses, in claim order (= top-k order of the misses);
  3. then the slots hit this step, in their previous order (a slot hit twice counts once).
I.e. new rank = position of the slot when sorted by (group: untouched 0 / missed 1 / hit 2, then previous
rank in groups 0 and 2, claim index in group 1). A step with no hits and no misses keeps the order (and
turns -1 stamps into slot-index ranks).

Live rows must name distinct requests. hot_rows >= K, so every miss finds a slot. `clock` is accepted for
signature compatibility and not used (the ranks need no clock; page_stamp, outside the resolver, does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import INVALID, PAGE


def has_hot_buffer(req, hot_pages, hot_rows: int):
    """bool[B]: decode row b's request has a hot buffer (every page of its `hot_rows` slots lent; idle: False).

    req int32[B] (-1 idle), hot_pages int32[Rq, NH] (-1 = not lent)."""
    used = -(-hot_rows // PAGE)
    lent = jnp.all(hot_pages[jnp.maximum(req, 0), :used] >= 0, axis=1)  # [B]
    return (req >= 0) & lent


def previous_rank(stamps):
    """int32[B, HR]: each slot's rank in the (stamp, slot) order (0 = least recent): a permutation per row."""
    order = jnp.argsort(stamps, axis=1, stable=True)  # slots, least recent first; equal stamps in slot order
    return jnp.argsort(order, axis=1).astype(jnp.int32)  # the inverse permutation


def resolve_positions(topk, req, block_table, host_table, hot_pages, hot_token, hot_stamp, clock, *, hot_rows: int):
    """The resolver rule (module docstring), unchecked and un-jitted: what `sparse_gather_reference` returns."""
    del clock  # the LRU ranks need no clock
    B, K = topk.shape
    HR = hot_rows
    r = jnp.maximum(req, 0)
    live = (topk >= 0) & (req >= 0)[:, None]
    pos = jnp.maximum(topk, 0)
    lp = pos // PAGE
    dpage = jnp.take_along_axis(block_table[r], lp, axis=1)  # [B, K]; out of range -> INT_MIN
    hpage = jnp.take_along_axis(host_table[r], lp, axis=1)  # [B, K]; out of range -> INT_MIN
    resident = live & (dpage >= 0)
    hot_ok = has_hot_buffer(req, hot_pages, HR)  # [B]
    want = live & ~resident & hot_ok[:, None]  # may be served by the hot buffer

    tokens, stamps = hot_token[r], hot_stamp[r]  # [B, HR]
    # hit lookup: the stable sort keeps equal tags in slot order, so searchsorted finds the lowest slot
    order = jnp.argsort(tokens, axis=1, stable=True)
    sorted_tok = jnp.take_along_axis(tokens, order, axis=1)
    at = jnp.minimum(jax.vmap(jnp.searchsorted)(sorted_tok, pos), HR - 1)  # [B, K]
    found = jnp.take_along_axis(sorted_tok, at, axis=1) == pos
    hit = want & found
    miss = want & ~found & (hpage >= 0)  # no host copy either: invalid, claims nothing
    hit_slot = jnp.take_along_axis(order, at, axis=1)

    bidx = jnp.arange(B)[:, None]
    prev = previous_rank(stamps)  # [B, HR]
    was_hit = jnp.zeros((B, HR), bool).at[bidx, jnp.where(hit, hit_slot, HR)].set(True, mode="drop")
    # victims: the untouched slots in the previous order (keys distinct, so lax.top_k's order is the order)
    _, victims = jax.lax.top_k(-jnp.where(was_hit, HR + prev, prev), K)  # [B, K]
    q = jnp.cumsum(miss, axis=1) - 1  # claim index of each miss
    miss_slot = jnp.take_along_axis(victims, jnp.maximum(q, 0), axis=1)
    dst = jnp.where(miss, miss_slot, HR)
    tokens = tokens.at[bidx, dst].set(pos, mode="drop")
    claim = jnp.full((B, HR), -1, jnp.int32).at[bidx, dst].set(q, mode="drop")  # claim index, -1 unclaimed
    # the order after the step: (group, previous rank | claim index), written as ranks
    key = jnp.where(was_hit, 2 * HR + prev, jnp.where(claim >= 0, HR + claim, prev))
    ranks = previous_rank(key)
    stamps = jnp.where(hot_ok[:, None], ranks, stamps)  # requests without a hot buffer keep their stamps

    served = hit | miss
    slot = jnp.where(hit, hit_slot, miss_slot)
    hot_page = jnp.take_along_axis(hot_pages[r], slot // PAGE, axis=1)  # >= 0 wherever `served`
    page = jnp.where(resident, dpage, jnp.where(served, hot_page, 0))
    row = jnp.where(resident, pos % PAGE, jnp.where(served, slot % PAGE, 0))
    src_page = jnp.where(miss, hpage, INVALID)
    rw = jnp.where(req >= 0, req, hot_token.shape[0])  # idle rows write nowhere
    hot_token = hot_token.at[rw].set(tokens, mode="drop")
    hot_stamp = hot_stamp.at[rw].set(stamps, mode="drop")
    valid = resident | served
    return (jnp.maximum(page, 0), row, valid, resident, miss, src_page, pos % PAGE, hot_token, hot_stamp)


@functools.partial(jax.jit, static_argnames=("hot_rows", "interpret"))
def sparse_gather_reference(topk, req, block_table, host_table, hot_pages, hot_token, hot_stamp, clock, *,
                            hot_rows: int, interpret: bool = False):
    """Resolve int32[B, K] top-k positions (-1 padded) of decode rows `req` int32[B] (-1 idle).

    block_table / host_table int32[Rq, MP], hot_pages int32[Rq, NH], hot_token / hot_stamp int32[Rq, HR]
    (this group's slice; hot_stamp holds LRU ranks, see the module docstring), clock int32[] (unused).
    Returns (page, row, valid, resident, miss, src_page, src_row) [B, K] (int32 / bool; page 0 and row 0
    where not valid; src_page -1 where not a miss; src_row = t % 64 everywhere) and the updated
    (hot_token, hot_stamp) int32[Rq, HR]. `interpret` is accepted for signature parity and ignored.
    """
    del interpret
    check_shapes(topk, req, block_table, host_table, hot_pages, hot_token, hot_stamp, hot_rows)
    return resolve_positions(topk, req, block_table, host_table, hot_pages, hot_token, hot_stamp, clock,
                             hot_rows=hot_rows)


def check_shapes(topk, req, block_table, host_table, hot_pages, hot_token, hot_stamp, hot_rows):
    """Shared input checks of the reference and the kernel (ValueError naming the limit)."""
    B, K = topk.shape
    Rq, HR = hot_token.shape
    if req.shape != (B,):
        raise ValueError(f"req must be int32[{B}], got {req.shape}")
    if HR != hot_rows or hot_stamp.shape != (Rq, HR):
        raise ValueError(f"hot_token / hot_stamp must be int32[Rq, hot_rows={hot_rows}], got "
                         f"{hot_token.shape} / {hot_stamp.shape}")
    if block_table.shape[0] != Rq or host_table.shape != block_table.shape or hot_pages.shape[0] != Rq:
        raise ValueError(f"tables must have Rq={Rq} rows: block_table {block_table.shape}, host_table "
                         f"{host_table.shape}, hot_pages {hot_pages.shape}")
    if hot_pages.shape[1] * PAGE < HR:
        raise ValueError(f"hot_pages holds {hot_pages.shape[1]} pages, too few for hot_rows={HR}")
    if HR < K:
        raise ValueError(f"hot_rows={HR} must be >= K={K} so that every miss finds a slot")
