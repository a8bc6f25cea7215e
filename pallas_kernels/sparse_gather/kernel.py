"""Fused HiSparse resolver for one indexer group: Pallas, Triton backend (NVIDIA GPUs).

Same signature and bit-identical results as `reference.sparse_gather_reference` (read its docstring for
the semantics). Two `pallas_call`s, no sort, no host sync, fixed shapes (CUDA-graph capturable):

1. `_lookup_kernel`, grid (B, K / TK), one program per tile of TK top-k positions:
   residency by gathering block_table[r, t // 64]; hit lookup by comparing the tile's positions with the
   request's HR slot tags, TS slots at a time ([TK, TS] equality, min over matching slot ids gives the
   lowest matching slot). Tiles without a position the hot buffer may serve skip the comparison. Writes a
   kind code (0 invalid, 1 resident, 2 hit, 3 miss) and an address (device page | hit slot | -1) per
   position. The reference's validity masks are applied here, once: a non-resident position is a hit or
   a miss only when the request has a hot buffer (`has_hot_buffer`, computed by the wrapper: its hot
   pages of -1 are never addresses), and a miss only when host_table[r, t // 64] >= 0 (else there is no
   copy anywhere: invalid). Every later phase acts on kinds 1-3 only.
   Work O(K * HR) compares per row, spread over K / TK programs.
2. `_assign_kernel`, grid (B,), one program per decode row, owning row req[b] of the (aliased) hot state:
   a. touch: scatter stamp := clock at every hit slot (duplicates write the same value); count misses m.
   b. victims = the m smallest (stamp, slot) pairs, found without a sort:
      - the stamp threshold s* = the smallest s with #{stamp <= s} >= m, by bisection over
        [min stamp, max stamp] (<= 32 counting passes over the HR stamps);
      - V = {stamp < s*} + the first (m - #{stamp < s*}) slots with stamp == s* (a running cumsum);
        V is compacted, in slot order, into a [Kp] scratch list;
      - the rank of each member of V inside V is counted by compare-and-count over V x V tiles
        (O(m^2), m <= K), and order[rank] := slot is scattered (ranks are distinct).
   c. one pass over the K positions: miss rank q = running cumsum of the miss mask, slot = order[q];
      page = hot_pages[r, slot // 64] (hits and misses) or the resident page, row = slot % 64 or t % 64;
      scatter hot_token := t, hot_stamp := clock at the claimed slots; src_page = host_table[r, t // 64].
   Every table read here is an address: the load is masked to the lanes that need it, the index clamped
   into the table, and a page id is used only where it was checked >= 0 (else page 0, which the readers
   ignore because valid is False).
   Masked-off lanes of every scatter point one past the end of the row: never written on a GPU, and
   dropped (not clamped onto a real slot) by interpret mode's scatter. Global scratch (the hot rows, the
   V list, order) is shared by the program's threads across phases; a block barrier (`debug_barrier`,
   i.e. __syncthreads, which orders global memory within a CTA) separates the phases on the GPU
   (interpret mode runs sequentially and needs none).

Cost (B=32, K=2048, HR=4096; estimates, not measured): the lookup is ~8.4M tag compares per row
(~0.27G compare-select-min triples per call, ~50 us of H200 integer throughput spread over B * K / 64 =
1024 programs); the assign pass is O(K + 32 HR + m^2) per row (m = misses; ~4M compares when everything
misses). A position -> slot inverse map per request (O(K + HR) per row, but a [Rq, max positions] array in
the store) would remove the O(K * HR) term, at the price of a KVStore layout change.

Padding: K is padded to a multiple of the tile with -1 (invalid) so that every tile load is in bounds
(interpret mode clamps out-of-bounds slices instead of masking them); the slot tile TS is the largest power
of two (<= 64) dividing HR, so HR needs no padding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_gather.reference import PAGE, check_shapes, has_hot_buffer

INT_MIN = -(2**31)
MAX_TILE = 64


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


def _assign_kernel(req_ref, clock_ref, topk_ref, kind_ref, addr_ref, host_table_ref, hot_pages_ref,
                   hot_token_in, hot_stamp_in,  # inputs (the last two aliased to the outputs below)
                   page_ref, row_ref, src_ref, hot_token_ref, hot_stamp_ref, vlist_ref, order_ref,  # outputs
                   *, tk: int, ts: int, interpret: bool):
    # req_ref [B], clock_ref [1], topk/kind/addr [B, Kp], host_table [Rq, MP], hot_pages [Rq, NH]
    # page/row/src [B, Kp]; hot_token/hot_stamp [Rq, HR] (in place); vlist/order [B, Kp] scratch
    del hot_token_in, hot_stamp_in  # same buffers as hot_token_ref / hot_stamp_ref
    b = pl.program_id(0)
    kp = topk_ref.shape[1]
    mp, hr = host_table_ref.shape[1], hot_stamp_ref.shape[1]
    r_raw = req_ref[b]
    live = r_raw >= 0
    r = jnp.maximum(r_raw, 0)
    clock = clock_ref[0]
    k_tiles, s_tiles = kp // tk, hr // ts
    lanes_k = lax.broadcasted_iota(jnp.int32, (tk,), 0)
    lanes_s = lax.broadcasted_iota(jnp.int32, (ts,), 0)

    # a. LRU touch of the hits; count the misses
    def touch(t, m):
        kind = kind_ref[b, pl.ds(t * tk, tk)]
        hit = (kind == 2) & live
        slot = jnp.where(hit, addr_ref[b, pl.ds(t * tk, tk)], hr)
        plgpu.store(hot_stamp_ref.at[r, slot], jnp.full((tk,), clock, jnp.int32), mask=hit)
        return m + jnp.sum((kind == 3).astype(jnp.int32))

    m = lax.fori_loop(0, k_tiles, touch, jnp.int32(0))
    _barrier(interpret)

    def stamps(j):
        return hot_stamp_ref[r, pl.ds(j * ts, ts)]  # [TS]

    def count(bound, inclusive):  # #{slots with stamp <= bound (inclusive) or < bound}
        def add(j, c):
            st = stamps(j)
            return c + jnp.sum(jnp.where(inclusive, st <= bound, st < bound).astype(jnp.int32))

        return lax.fori_loop(0, s_tiles, add, jnp.int32(0))

    # b. the m least recently used slots, in (stamp, slot) order -> order_ref[b, :m]
    def select_victims():
        lo, hi = lax.fori_loop(
            0, s_tiles, lambda j, c: (jnp.minimum(c[0], jnp.min(stamps(j))), jnp.maximum(c[1], jnp.max(stamps(j)))),
            (jnp.int32(2**31 - 1), jnp.int32(INT_MIN)))

        def bisect(c):
            lo, hi = c
            mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
            enough = count(mid, True) >= m
            return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

        thresh, _ = lax.while_loop(lambda c: c[0] < c[1], bisect, (lo, hi))
        need = m - count(thresh, False)  # slots to take among those stamped exactly `thresh`

        def compact(j, c):
            eq_seen, n_v = c
            st = stamps(j)
            eq = st == thresh
            eq_rank = jnp.cumsum(eq.astype(jnp.int32)) + eq_seen  # inclusive
            in_v = (st < thresh) | (eq & (eq_rank <= need))
            at = jnp.cumsum(in_v.astype(jnp.int32)) - 1 + n_v
            plgpu.store(vlist_ref.at[b, jnp.where(in_v, at, kp)], j * ts + lanes_s, mask=in_v)
            return eq_seen + jnp.sum(eq.astype(jnp.int32)), n_v + jnp.sum(in_v.astype(jnp.int32))

        lax.fori_loop(0, s_tiles, compact, (jnp.int32(0), jnp.int32(0)))
        _barrier(interpret)

        def members(i):
            ok = i * tk + lanes_k < m
            slot = jnp.where(ok, vlist_ref[b, pl.ds(i * tk, tk)], 0)
            return ok, slot, plgpu.load(hot_stamp_ref.at[r, slot], mask=ok, other=0)

        n_tiles = (m + tk - 1) // tk

        def rank_tile(i, carry):
            ok_i, v_i, s_i = members(i)

            def count_before(j, rank):  # rank [TK] += #{members of tile j ordered before each of tile i}
                ok_j, v_j, s_j = members(j)
                s_j, v_j = s_j[None, :], v_j[None, :]
                before = (s_j < s_i[:, None]) | ((s_j == s_i[:, None]) & (v_j < v_i[:, None]))  # [TK, TK]
                return rank + jnp.sum((before & ok_j[None, :]).astype(jnp.int32), axis=1)

            rank = lax.fori_loop(0, n_tiles, count_before, jnp.zeros((tk,), jnp.int32))
            plgpu.store(order_ref.at[b, jnp.where(ok_i, rank, kp)], v_i, mask=ok_i)
            return carry

        lax.fori_loop(0, n_tiles, rank_tile, jnp.int32(0))

    pl.when(m > 0)(select_victims)
    _barrier(interpret)

    # c. addresses, host sources and the claimed slots' new tags
    def assign(t, n_miss):
        sl = pl.ds(t * tk, tk)
        kind, addr = kind_ref[b, sl], addr_ref[b, sl]
        pos = jnp.maximum(topk_ref[b, sl], 0)
        resident, hit, miss = kind == 1, kind == 2, kind == 3
        want = hit | miss
        q = jnp.cumsum(miss.astype(jnp.int32)) - 1 + n_miss
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
        dst = jnp.where(claim, slot, hr)
        plgpu.store(hot_token_ref.at[r, dst], pos, mask=claim)
        plgpu.store(hot_stamp_ref.at[r, dst], jnp.full((tk,), clock, jnp.int32), mask=claim)
        return n_miss + jnp.sum(miss.astype(jnp.int32))

    lax.fori_loop(0, k_tiles, assign, jnp.int32(0))


def _slot_tile(hr: int) -> int:
    return min(MAX_TILE, hr & -hr)  # the largest power of two dividing hr, capped


@functools.partial(jax.jit, static_argnames=("hot_rows", "interpret"))
def sparse_gather(topk, req, block_table, host_table, hot_pages, hot_token, hot_stamp, clock, *,
                  hot_rows: int, interpret: bool = False):
    """Pallas (Triton) version of `sparse_gather_reference`; same arguments and results, bit for bit."""
    check_shapes(topk, req, block_table, host_table, hot_pages, hot_token, hot_stamp, hot_rows)
    B, K = topk.shape
    Rq, HR = hot_token.shape
    tk = min(MAX_TILE, pl.next_power_of_2(K))
    kp = pl.cdiv(K, tk) * tk
    ts = _slot_tile(HR)
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    topk_p = jnp.pad(i32(topk), ((0, 0), (0, kp - K)), constant_values=-1)
    req, block_table, host_table, hot_pages = i32(req), i32(block_table), i32(host_table), i32(hot_pages)
    params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    bk = jax.ShapeDtypeStruct((B, kp), jnp.int32)

    hot_ok = has_hot_buffer(req, hot_pages, HR).astype(jnp.int32)  # [B]

    kind, addr = pl.pallas_call(
        functools.partial(_lookup_kernel, tk=tk, ts=ts), grid=(B, kp // tk), out_shape=(bk, bk),
        compiler_params=params, interpret=interpret, name="hisparse_lookup",
    )(req, hot_ok, topk_p, block_table, host_table, i32(hot_token))

    page, row, src_page, hot_token, hot_stamp, _, _ = pl.pallas_call(
        functools.partial(_assign_kernel, tk=tk, ts=ts, interpret=interpret), grid=(B,),
        out_shape=(bk, bk, bk, jax.ShapeDtypeStruct((Rq, HR), jnp.int32),
                   jax.ShapeDtypeStruct((Rq, HR), jnp.int32), bk, bk),
        input_output_aliases={7: 3, 8: 4}, compiler_params=params, interpret=interpret, name="hisparse_assign",
    )(req, jnp.reshape(i32(clock), (1,)), topk_p, kind, addr, host_table, hot_pages, i32(hot_token),
      i32(hot_stamp))

    kind = kind[:, :K]
    valid = kind > 0
    src_row = jnp.maximum(i32(topk), 0) % PAGE
    return (page[:, :K], row[:, :K], valid, kind == 1, kind == 3, src_page[:, :K], src_row, hot_token, hot_stamp)
