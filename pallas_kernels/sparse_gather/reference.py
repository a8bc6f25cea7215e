"""The spec of the fused HiSparse resolver for one indexer group (pure jnp): the one resolver rule.

`resolve_positions` is the rule; `sparse_gather_reference` is it behind the kernel's checked, jitted
signature; the Pallas kernel reproduces it bit for bit; `hisparse_jax.kv.resolve.resolve` calls it (or the
kernel) and records the result in the store.

Shapes: B decode rows, K top-k slots, Rq request slots, MP pages per request, NH hot pages per request,
HR hot rows (slots) per request; 64 tokens per page.

A request has a hot buffer when every page its HR slots live on is lent: hot_pages[r, :ceil(HR / 64)] >= 0
(`has_hot_buffer`; the manager, `PageManager`, lends them all or none). Slot j lives at (hot_pages[r, j // 64], j % 64).

LRU state. hot_stamp[r, j] records the step that last touched slot j: 2 * clock when a miss of that step
claimed it, 2 * clock + 1 when the step hit it (-1 = never since the request was admitted: `init_store`,
`kv.device.set_tables`). The order a step reads (the "previous order", least recent first) is the (key, slot)
order with key = max(hot_stamp, -1): never-used slots first, then older steps, within a step the claimed
slots before the hit ones, ties in slot order. Only the touched slots are written, so a step writes O(K)
stamps whatever HR is, and the values never need renormalizing: the store's clock counts decode steps and
stays below 2**30 - 1, so stamps stay below 2**31 - 1 (a reserved value: the kernel marks hit slots with it
in place, so hot_stamp must be < 2**31 - 1 on entry; the store never writes anything else). "Never used" is
hot_token == -1; never-used slots hold stamp -1, the lowest key, so misses fill an empty buffer from slot 0 up.

For top-k position t of decode row b (request r = req[b]), with dpage = block_table[r, t // 64] and
hpage = host_table[r, t // 64] (a position at or beyond MP * 64 has neither):

* resident   dpage >= 0: read in place at (dpage, t % 64).
* hot hit    r has a hot buffer and it holds t (the lowest slot j with hot_token[r, j] == t, looked up in
             the buffer as it was *before* this step): read slot j.
* miss       r has a hot buffer that does not hold t, and hpage >= 0: the victims of row b are the m
             least recent slots (previous order) among the slots *not hit* this step, m = the row's
             number of misses; the q-th miss (q counted in top-k order) claims the q-th victim in *slot*
             order (which victim takes which row does not change what is hit later: every claimed slot gets
             the same stamp). The slot gets hot_token := t, and the plan names the host row to copy into it:
             (src_page, src_row) = (hpage, t % 64). (A hit slot is never a victim; hot_rows >= K leaves at
             least as many untouched slots as misses.)
* invalid    everything else: t == -1 (padding), r == -1 (idle row), a non-resident position of a request
             without a hot buffer (its hot page -1 is never an address), or a position with no copy at all
             (not resident, not in the hot buffer, no host page). Page 0, row 0, valid False, nothing
             changes, nothing is fetched; the readers ignore the address.

LRU order after the step: the claimed slots get hot_stamp := 2 * clock and the hit slots 2 * clock + 1, so
the order is [untouched, previous order | claimed, slot order | hit, slot order]; every other stamp is
unchanged. Rows of requests without a hot buffer, idle rows, and steps with no hits or misses write no
stamp. vLLM / SGLang HiSparse keep the same three groups in an LRU list, ordered within the claimed group
by claim order and within the hit group by previous order, which rewrites the whole list every step (O(HR)
writes per request); the stamps write O(K) and give the same hit rates on the project's traces
(experiments/hot_buffer_policies.py; ordering only the groups is what matters).

Other victim orders. The rule reads hot_stamp only as the key of the (key, slot) order and writes it only at the
touched slots, so a caller may pass any int32 keys in [-1, STAMP_MARK) instead of stamps (and discard the stamps
written): the victims are then the m lowest (key, slot) among the slots not hit, as above. The store's
hot_policy="score_ema" does this with the held positions' averaged indexer scores
(`hisparse_jax.kv.resolve.resolve`); the kernel's selection is exact for any such keys (radix passes beyond the
steady-state window).

Live rows must name distinct requests. hot_rows >= K, so every miss finds a slot.
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


STAMP_MARK = 2**31 - 1  # reserved stamp value (the kernel's in-place mark of a hit slot)
# the stamp of a slot past the hot-row budget (a store whose capacity has more slots than its budget lends): newer
# than every step's stamp, so never a victim while hot_rows >= K slots are usable; below STAMP_MARK
UNUSED_STAMP = STAMP_MARK - 1


def lru_key(stamps):
    """int32 key of the (key, slot) LRU order: the stamp, with anything below -1 read as -1 (never used)."""
    return jnp.maximum(stamps, -1)


def resolve_positions(topk, req, block_table, host_table, hot_pages, hot_token, hot_stamp, clock, *, hot_rows: int):
    """The resolver rule (module docstring), unchecked and un-jitted: what `sparse_gather_reference` returns."""
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
    was_hit = jnp.zeros((B, HR), bool).at[bidx, jnp.where(hit, hit_slot, HR)].set(True, mode="drop")
    # victims: the m least recent untouched slots in the (key, slot) order, m = the row's misses
    m = jnp.sum(miss, axis=1, dtype=jnp.int32)
    order = jnp.lexsort((jnp.broadcast_to(jnp.arange(HR), (B, HR)), lru_key(stamps), was_hit.astype(jnp.int32)), axis=1)
    rank = jnp.zeros((B, HR), jnp.int32).at[bidx, order].set(jnp.arange(HR, dtype=jnp.int32))
    victim = rank < m[:, None]  # never a hit slot: at least m slots are untouched
    victims = jnp.argsort(~victim, axis=1, stable=True)[:, :K]  # the victims in slot order first
    q = jnp.cumsum(miss, axis=1) - 1  # claim index of each miss
    miss_slot = jnp.take_along_axis(victims, jnp.maximum(q, 0), axis=1)
    dst = jnp.where(miss, miss_slot, HR)
    tokens = tokens.at[bidx, dst].set(pos, mode="drop")
    # the touched slots (only rows with a hot buffer have any): claimed 2 * clock, hit 2 * clock + 1
    stamps = jnp.where(was_hit, 2 * clock + 1, jnp.where(victim, 2 * clock, stamps))

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
    (this group's slice; hot_stamp holds LRU stamps < 2**31 - 1, see the module docstring), clock int32[] (this
    step: claimed slots are stamped 2 * clock, hit ones 2 * clock + 1).
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
