"""Fused HiSparse resolver for one indexer group: Pallas, Triton backend (NVIDIA GPUs).

Same signature and bit-identical results as `reference.sparse_gather_reference` (read its docstring for
the semantics). Two `pallas_call`s, no sort, no host sync, fixed shapes (CUDA-graph capturable):

1. `_lookup_kernel`, grid (B, Kp / TK), one program per tile of TK (<= TOPK_TILE) top-k positions:
   residency by gathering block_table[r, t // 64]; hit lookup by comparing the tile's positions with the
   request's HR slot tags, TL slots at a time ([TK, TL] equality, min over matching slot ids gives the
   lowest matching slot). Tiles without a position the hot buffer may serve skip the comparison. Writes a
   kind code (0 invalid, 1 resident, 2 hit, 3 miss) and an address (device page | hit slot | -1) per
   position. The reference's validity masks are applied here, once: a non-resident position is a hit or
   a miss only when the request has a hot buffer (`has_hot_buffer`, computed by the wrapper: its hot
   pages of -1 are never addresses), and a miss only when host_table[r, t // 64] >= 0 (else there is no
   copy anywhere: invalid). Every later phase acts on kinds 1-3 only.
   Work O(K * HR) compares per row, spread over Kp / TK programs; the tag row is read once per program.
2. `_assign_kernel`, grid (B,), one program per decode row, owning row req[b] of the (aliased) hot state;
   steps b and c run only for a live row whose request has a hot buffer and that has a miss:
   a. count the misses m; on a hot row mark every hit slot in place, hot_stamp := STAMP_MARK (a reserved
      value: the slots not hit are those with any other stamp).
   b. the threshold of the m least recent untouched slots, (key, slot) order, key = max(stamp, -1): the
      m-th smallest key v and e = how many slots keyed v are victims. One histogram pass over the NB
      (= 2**SELECT_BITS) exact keys of the window [2 clock - NB + 2, 2 clock + 1] (plus counts below it)
      finds v when it lies there: the steady state, where the victims were touched within the last
      NB / 2 - 1 steps; it also counts the never-used slots (key -1), where a buffer still filling up takes
      all its victims. Otherwise (stamps older than the window or newer than the clock) one pass for the
      extremes (smallest key; smallest above the window; largest), then exact radix passes of NB buckets
      over the remaining range, SELECT_BITS bits each (at most 6 for 31 bits), ending early when the
      m-th key equals a pass's base (e.g. never-used slots at -1).
   c. one pass in slot order: victims are the untouched slots with key < v, then the first e keyed v; the
      q-th victim (slot order) goes to order[q]. The stamps are only read: O(HR) reads, no O(HR) write.
   d. one pass over the K positions: miss rank q = running cumsum of the miss mask, slot = order[q];
      page = hot_pages[r, slot // 64] (hits and misses) or the resident page, row = slot % 64 or t % 64;
      scatter hot_token := t at the claimed slots, hot_stamp := 2 clock at the claimed slots and 2 clock + 1
      at the hit ones (which replaces the marks); src_page = host_table[r, t // 64].
   Every table read here is an address: the load is masked to the lanes that need it, the index clamped
   into the table, and a page id is used only where it was checked >= 0 (else page 0, which the readers
   ignore because valid is False).
   Masked-off lanes of every scatter point one past the end of the row: never written on a GPU, and
   dropped (not clamped onto a real slot) by interpret mode's scatter. Global state and scratch (the hot
   rows, order [B, Kp]) are shared by the program's threads across phases; a block barrier (`debug_barrier`,
   i.e. __syncthreads, which orders global memory within a CTA) separates the phases on the GPU (interpret
   mode runs sequentially and needs none).

Cost (B=64, K=2048, HR=4096; estimates, not measured): the lookup is ~8.4M tag compares per row (~0.5G
compare-select-min triples per call, spread over B * K / 256 = 512 programs) and reads a hot row's tags
K / 256 = 8 times (32 B per slot); victim selection reads the stamps twice in the steady state (8 B per slot)
and writes O(K). `pallas_kernels.traffic.sparse_gather_traffic` counts the bytes exactly. What is left above
one read of the state (8 B per slot) is the tag comparison: a hash of the top-k in shared memory (vLLM's
design) would make it O(K + HR) with one read of the tags, but neither Pallas GPU backend can express it
(Triton: no shared-memory scratch; Mosaic GPU: no gather / scatter at vector indices); a position -> slot
map per request in the store would too, at the price of a KVStore layout change.

Padding: K is padded to a multiple of the tile with -1 (invalid) so that every tile load is in bounds
(interpret mode clamps out-of-bounds slices instead of masking them); the slot tile TS is the largest power
of two (<= SLOT_TILE) dividing HR, so HR needs no padding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_gather.reference import PAGE, STAMP_MARK, check_shapes, has_hot_buffer, lru_key

INT_MIN = -(2**31)
TOPK_TILE = 256  # top-k positions per lookup program (and per step of the assign program's loops over K)
SLOT_TILE = 64  # hot slots per step of the loops over a request's HR slots
LOOKUP_COMPARE = 4096  # elements of the lookup's [TK, TS] tag comparison (TS = min(slot tile, this / TK))
SELECT_BITS = 6  # key bits decided per selection pass
SELECT_BUCKETS = 2**SELECT_BITS


def _barrier(interpret: bool):
    if not interpret:
        plgpu.debug_barrier()


def _lookup_kernel(req_ref, hot_ok_ref, topk_ref, block_table_ref, host_table_ref, hot_token_ref,  # inputs
                   kind_ref, addr_ref,  # outputs
                   *, tk: int, ts: int):
    # req_ref [B], hot_ok_ref [B] (1: the row's request has a hot buffer), topk_ref [B, Kp],
    # block_table_ref / host_table_ref [Rq, MP], hot_token_ref [Rq, HR]; kind_ref / addr_ref [B, Kp]
    b, t = pl.program_id(0), pl.program_id(1)
    mp, hr = block_table_ref.shape[1], hot_token_ref.shape[1]
    r_raw = req_ref[b]
    r = jnp.maximum(r_raw, 0)
    tok = topk_ref[b, pl.ds(t * tk, tk)]  # [TK]
    valid = (tok >= 0) & (r_raw >= 0)
    pos = jnp.maximum(tok, 0)
    lp = pos >> 6
    in_range = lp < mp
    lp_in = jnp.where(in_range, lp, 0)
    dpage = plgpu.load(block_table_ref.at[r, lp_in], mask=in_range, other=INT_MIN)
    resident = valid & (dpage >= 0)
    want = valid & ~resident & (hot_ok_ref[b] > 0)  # the hot buffer may serve it (hot pages all lent)
    hpage = plgpu.load(host_table_ref.at[r, lp_in], mask=want & in_range, other=INT_MIN)
    lanes = lax.broadcasted_iota(jnp.int32, (1, ts), 1)

    def scan_slots(j, best):  # best [TK]: lowest matching slot so far (hr = none)
        tags = hot_token_ref[r, pl.ds(j * ts, ts)]  # [TS]
        cand = jnp.where(pos[:, None] == tags[None, :], j * ts + lanes, hr)  # [TK, TS]
        return jnp.minimum(best, jnp.min(cand, axis=1))

    none = jnp.full((tk,), hr, jnp.int32)
    n_want = jnp.sum(want.astype(jnp.int32))
    best = lax.cond(n_want > 0, lambda: lax.fori_loop(0, hr // ts, scan_slots, none), lambda: none)
    hit = want & (best < hr)
    miss = want & ~hit & (hpage >= 0)  # no device, hot or host copy: invalid (kind 0)
    kind = jnp.where(resident, 1, jnp.where(hit, 2, jnp.where(miss, 3, 0)))
    kind_ref[b, pl.ds(t * tk, tk)] = kind.astype(jnp.int32)
    addr_ref[b, pl.ds(t * tk, tk)] = jnp.where(resident, dpage, jnp.where(hit, best, -1))


def _assign_kernel(req_ref, hot_ok_ref, clock_ref, topk_ref, kind_ref, addr_ref, host_table_ref, hot_pages_ref,
                   hot_token_in, hot_stamp_in,  # inputs (the last two aliased to the outputs below)
                   page_ref, row_ref, src_ref, hot_token_ref, hot_stamp_ref, order_ref,  # outputs
                   *, tk: int, ts: int, interpret: bool):
    # req_ref [B], hot_ok_ref [B], clock_ref [1], topk/kind/addr [B, Kp], host_table [Rq, MP], hot_pages [Rq, NH]
    # page/row/src [B, Kp]; hot_token/hot_stamp [Rq, HR] (in place); order [B, Kp] scratch (victims, slot order)
    del hot_token_in, hot_stamp_in  # same buffers as hot_token_ref / hot_stamp_ref
    b = pl.program_id(0)
    kp = topk_ref.shape[1]
    mp, hr = host_table_ref.shape[1], hot_stamp_ref.shape[1]
    r_raw = req_ref[b]
    live = r_raw >= 0
    r = jnp.maximum(r_raw, 0)
    now = 2 * clock_ref[0]  # this step's stamp of a claimed slot (a hit one gets now + 1)
    k_tiles, s_tiles = kp // tk, hr // ts
    lanes_s = lax.broadcasted_iota(jnp.int32, (ts,), 0)
    lanes_nb = lax.broadcasted_iota(jnp.int32, (SELECT_BUCKETS,), 0)
    i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    hot_row = live & (hot_ok_ref[b] > 0)

    # a. count the misses; mark the hit slots in place (stamp := STAMP_MARK) on a hot row
    def count_and_mark(t, m):
        sl = pl.ds(t * tk, tk)
        kind = kind_ref[b, sl]
        hit = (kind == 2) & hot_row

        def mark():
            plgpu.store(hot_stamp_ref.at[r, jnp.where(hit, addr_ref[b, sl], hr)],
                        jnp.full((tk,), STAMP_MARK, jnp.int32), mask=hit)

        pl.when(hot_row)(mark)
        return m + jnp.sum(i32(kind == 3))

    m = lax.fori_loop(0, k_tiles, count_and_mark, jnp.int32(0))
    _barrier(interpret)

    def keys(j):  # [TS] LRU keys of slot tile j (hit slots read STAMP_MARK)
        return lru_key(hot_stamp_ref[r, pl.ds(j * ts, ts)])

    def histogram(base, shift):
        """Over the untouched slots: #(key < base), #(key == base), #(key == -1: never used), and per bucket
        d < NB #((key - base) >> shift == d) for key >= base (a key - base that wraps past 2**31 is negative:
        above every bucket)."""
        def body(j, c):
            below, at_base, fresh, counts = c
            k = keys(j)
            untouched = k != STAMP_MARK
            d = (k - base) >> shift
            bucket = untouched & (k >= base) & (d >= 0) & (d < SELECT_BUCKETS)
            onehot = (d[:, None] == lanes_nb[None, :]) & bucket[:, None]  # [TS, NB]
            return (below + jnp.sum(i32(untouched & (k < base))), at_base + jnp.sum(i32(untouched & (k == base))),
                    fresh + jnp.sum(i32(k == -1)), counts + jnp.sum(i32(onehot), axis=0))

        zero = jnp.int32(0)
        return lax.fori_loop(0, s_tiles, body, (zero, zero, zero, jnp.zeros((SELECT_BUCKETS,), jnp.int32)))

    def bucket_of_mth(below, counts):
        """The bucket holding the m-th smallest key (below < m <= below + sum(counts)) and #keys before it."""
        d = jnp.sum(i32(below + jnp.cumsum(counts) < m))
        return d, below + jnp.sum(jnp.where(lanes_nb < d, counts, 0))

    def extremes():
        """One pass over the untouched keys: the smallest, the largest, and the smallest above the window."""
        above = now + 2  # the first key past the window [now - NB + 2, now + 1]

        def body(j, c):
            lo, hi, lo_above = c
            k = keys(j)
            untouched = k != STAMP_MARK
            big = jnp.int32(STAMP_MARK)
            return (jnp.minimum(lo, jnp.min(jnp.where(untouched, k, big))),
                    jnp.maximum(hi, jnp.max(jnp.where(untouched, k, -1))),
                    jnp.minimum(lo_above, jnp.min(jnp.where(untouched & (k >= above), k, big))))

        return lax.fori_loop(0, s_tiles, body, (jnp.int32(STAMP_MARK), jnp.int32(-1), jnp.int32(STAMP_MARK)))

    def radix_select(lo, hi):
        """(v, e): the m-th smallest key v and how many slots keyed v are victims, given lo <= v <= hi."""
        nbits = 32 - lax.clz(hi - lo)  # hi - lo < 2**nbits (0 <= hi - lo < 2**31)
        shift0 = jnp.maximum(nbits - SELECT_BITS, 0)

        def body(c):
            base, shift, _, v, e = c
            below, at_base, _, counts = histogram(base, shift)
            d, before = bucket_of_mth(below, counts)
            exact = below + at_base >= m  # the m-th smallest is `base` itself
            nxt = base + (d << shift)
            done = exact | (shift == 0)
            return (nxt, jnp.maximum(shift - SELECT_BITS, 0), done,
                    jnp.where(exact, base, nxt), jnp.where(exact, m - below, m - before))

        z = jnp.int32(0)
        _, _, _, v, e = lax.while_loop(lambda c: ~c[2], body, (lo, shift0, False, z, z))
        return v, e

    def select_victims():
        # b. the threshold: the m-th smallest untouched key v, and e = how many slots keyed v are victims (the
        # lowest ones). First one pass over a window of NB exact keys ending just past this step's stamps (a
        # steady hot buffer's victims were touched within the last NB / 2 - 1 steps) that also counts the
        # never-used slots (a buffer still filling up takes its victims there); else exact radix passes.
        base = now - (SELECT_BUCKETS - 2)
        below, _, fresh, counts = histogram(base, 0)
        d, before = bucket_of_mth(below, counts)
        in_window = (below < m) & (below + jnp.sum(counts) >= m)

        def refine():
            lo, hi, lo_above = extremes()
            older = below >= m
            return radix_select(jnp.where(older, lo, lo_above), jnp.where(older, base - 1, hi))

        use_fresh = ~in_window & (fresh >= m)
        v_r, e_r = lax.cond(~in_window & ~use_fresh, refine, lambda: (base, m))  # (traced values in both branches)
        v = jnp.where(in_window, base + d, jnp.where(use_fresh, -1, v_r))
        e = jnp.where(in_window, m - before, jnp.where(use_fresh, m, e_r))

        # c. one pass in slot order: the victims are key < v, then the first e slots keyed v; the q-th of them
        # (slot order) is the q-th miss's slot
        def pick(j, c):
            eq_seen, q0 = c
            k = keys(j)
            untouched = k != STAMP_MARK
            eq = i32(untouched & (k == v))
            victim = (untouched & (k < v)) | ((eq > 0) & (eq_seen + jnp.cumsum(eq) - eq < e))
            q = q0 + jnp.cumsum(i32(victim)) - i32(victim)
            plgpu.store(order_ref.at[b, jnp.where(victim, q, kp)], j * ts + lanes_s, mask=victim)
            return eq_seen + jnp.sum(eq), q0 + jnp.sum(i32(victim))

        lax.fori_loop(0, s_tiles, pick, (jnp.int32(0), jnp.int32(0)))

    pl.when(hot_row & (m > 0))(select_victims)  # m > 0 only on a hot row; no miss: no pass over the slots
    _barrier(interpret)

    # d. addresses, host sources; the claimed slots' new tags; stamps 2 clock (claimed) and 2 clock + 1 (hit,
    # which replaces the mark)
    def assign(t, n_miss):
        sl = pl.ds(t * tk, tk)
        kind, addr = kind_ref[b, sl], addr_ref[b, sl]
        pos = jnp.maximum(topk_ref[b, sl], 0)
        resident, hit, miss = kind == 1, kind == 2, kind == 3
        want = hit | miss
        q = jnp.cumsum(i32(miss)) - 1 + n_miss
        victim = plgpu.load(order_ref.at[b, jnp.where(miss, q, 0)], mask=miss, other=0)
        slot = jnp.where(hit, addr, jnp.where(miss, victim, 0))
        hot_page = plgpu.load(hot_pages_ref.at[r, slot >> 6], mask=want, other=-1)  # slot < HR: in the row
        page_ref[b, sl] = jnp.where(resident, addr, jnp.where(want & (hot_page >= 0), hot_page, 0))
        row_ref[b, sl] = jnp.where(resident, pos & (PAGE - 1), jnp.where(want, slot & (PAGE - 1), 0))
        lp = pos >> 6
        in_range = lp < mp
        src = plgpu.load(host_table_ref.at[r, jnp.where(in_range, lp, 0)], mask=miss & in_range, other=INT_MIN)
        src_ref[b, sl] = jnp.where(miss, src, -1)
        claim = miss & live
        plgpu.store(hot_token_ref.at[r, jnp.where(claim, slot, hr)], pos, mask=claim)
        touch = want & hot_row
        plgpu.store(hot_stamp_ref.at[r, jnp.where(touch, slot, hr)], jnp.where(hit, now + 1, now), mask=touch)
        return n_miss + jnp.sum(i32(miss))

    lax.fori_loop(0, k_tiles, assign, jnp.int32(0))


def tiles(K: int, HR: int) -> tuple[int, int, int, int]:
    """(TK, Kp, TS, TL): top-k tile, K padded to it, slot tile (the largest power of two <= SLOT_TILE dividing
    HR, so HR needs no padding), and the lookup's slot tile."""
    tk = min(TOPK_TILE, pl.next_power_of_2(K))
    ts = min(SLOT_TILE, HR & -HR)
    return tk, pl.cdiv(K, tk) * tk, ts, max(1, min(ts, LOOKUP_COMPARE // tk))


@functools.partial(jax.jit, static_argnames=("hot_rows", "interpret"))
def sparse_gather(topk, req, block_table, host_table, hot_pages, hot_token, hot_stamp, clock, *,
                  hot_rows: int, interpret: bool = False):
    """Pallas (Triton) version of `sparse_gather_reference`; same arguments and results, bit for bit."""
    check_shapes(topk, req, block_table, host_table, hot_pages, hot_token, hot_stamp, hot_rows)
    B, K = topk.shape
    Rq, HR = hot_token.shape
    tk, kp, ts, tl = tiles(K, HR)
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    topk_p = jnp.pad(i32(topk), ((0, 0), (0, kp - K)), constant_values=-1)
    req, block_table, host_table, hot_pages = i32(req), i32(block_table), i32(host_table), i32(hot_pages)
    params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    bk = jax.ShapeDtypeStruct((B, kp), jnp.int32)

    hot_ok = has_hot_buffer(req, hot_pages, HR).astype(jnp.int32)  # [B]

    kind, addr = pl.pallas_call(
        functools.partial(_lookup_kernel, tk=tk, ts=tl), grid=(B, kp // tk), out_shape=(bk, bk),
        compiler_params=params, interpret=interpret, name="hisparse_lookup",
    )(req, hot_ok, topk_p, block_table, host_table, i32(hot_token))

    state = jax.ShapeDtypeStruct((Rq, HR), jnp.int32)
    page, row, src_page, hot_token, hot_stamp, _ = pl.pallas_call(
        functools.partial(_assign_kernel, tk=tk, ts=ts, interpret=interpret), grid=(B,),
        out_shape=(bk, bk, bk, state, state, bk),
        input_output_aliases={8: 3, 9: 4}, compiler_params=params, interpret=interpret, name="hisparse_assign",
    )(req, hot_ok, jnp.reshape(i32(clock), (1,)), topk_p, kind, addr, host_table, hot_pages, i32(hot_token),
      i32(hot_stamp))

    kind = kind[:, :K]
    valid = kind > 0
    src_row = jnp.maximum(i32(topk), 0) % PAGE
    return (page[:, :K], row[:, :K], valid, kind == 1, kind == 3, src_page[:, :K], src_row, hot_token, hot_stamp)
