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
2. `_assign_kernel`, grid (B,), one program per decode row, owning row req[b] of the (aliased) hot state;
   steps b-d run only for a live row whose request has a hot buffer (other rows keep their stamps):
   a. count the misses m.
   b. previous order: prev[j] = the rank of slot j in the (stamp, slot) order, a permutation of 0..HR-1.
      Canonical rows — every stamp in [-1, HR) and the non-negative ones distinct (the ranks this rule
      writes, or the -1 of a fresh request) — in O(HR), no sort: scatter owner[stamp] := slot and check
      that every slot won its own stamp (a duplicate loses somewhere); then prefix counts over stamp
      values give n(-1) + #{stamps < s} for a stamped slot, and -1 slots take their place in slot order.
      Any other row (foreign stamps only; the resolver never writes one) is ranked by compare-and-count
      over [TS, TS] tiles, O(HR^2).
   c. by previous rank p, work[p] = 2 * #{untouched slots of rank < p} + untouched(p): fill 1, scatter 0
      at the previous rank of every hit slot, one running cumsum over the HR ranks (n_u = #untouched).
   d. per slot (rank p, ru = #untouched before it): untouched with ru < m -> it is the victim of the
      ru-th miss (order[ru] := slot) and takes rank n_u - m + ru; other untouched -> ru - m; hit ->
      n_u + (p - ru). That is the module's order [untouched | claimed, in claim order | hit], written
      straight into hot_stamp (every read of the old stamps happened in b).
   e. one pass over the K positions: miss rank q = running cumsum of the miss mask, slot = order[q];
      page = hot_pages[r, slot // 64] (hits and misses) or the resident page, row = slot % 64 or t % 64;
      scatter hot_token := t at the claimed slots; src_page = host_table[r, t // 64].
   Every table read here is an address: the load is masked to the lanes that need it, the index clamped
   into the table, and a page id is used only where it was checked >= 0 (else page 0, which the readers
   ignore because valid is False).
   Masked-off lanes of every scatter point one past the end of the row: never written on a GPU, and
   dropped (not clamped onto a real slot) by interpret mode's scatter. Global scratch (the hot rows,
   prev / work [B, HR], order [B, Kp]) is shared by the program's threads across phases; a block barrier
   (`debug_barrier`, i.e. __syncthreads, which orders global memory within a CTA) separates the phases on
   the GPU (interpret mode runs sequentially and needs none).

Cost (B=32, K=2048, HR=4096; estimates, not measured): the lookup is ~8.4M tag compares per row
(~0.27G compare-select-min triples per call, ~50 us of H200 integer throughput spread over B * K / 64 =
1024 programs); the assign pass is O(K + 8 HR) per canonical row (8 tiled passes over the HR slots or
ranks, 2 over the K positions), and O(HR^2) (~16.7M compares) for a row with foreign stamps. A position ->
slot inverse map per request (O(K + HR) per row, but a [Rq, max positions] array in the store) would
remove the O(K * HR) lookup term, at the price of a KVStore layout change.

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


def _assign_kernel(req_ref, hot_ok_ref, topk_ref, kind_ref, addr_ref, host_table_ref, hot_pages_ref,
                   hot_token_in, hot_stamp_in,  # inputs (the last two aliased to the outputs below)
                   page_ref, row_ref, src_ref, hot_token_ref, hot_stamp_ref, prev_ref, work_ref, order_ref,  # outputs
                   *, tk: int, ts: int, interpret: bool):
    # req_ref [B], hot_ok_ref [B], topk/kind/addr [B, Kp], host_table [Rq, MP], hot_pages [Rq, NH]
    # page/row/src [B, Kp]; hot_token/hot_stamp [Rq, HR] (in place); prev/work [B, HR], order [B, Kp] scratch
    del hot_token_in, hot_stamp_in  # same buffers as hot_token_ref / hot_stamp_ref
    b = pl.program_id(0)
    kp = topk_ref.shape[1]
    mp, hr = host_table_ref.shape[1], hot_stamp_ref.shape[1]
    r_raw = req_ref[b]
    live = r_raw >= 0
    r = jnp.maximum(r_raw, 0)
    k_tiles, s_tiles = kp // tk, hr // ts
    lanes_s = lax.broadcasted_iota(jnp.int32, (ts,), 0)
    i32 = lambda x: x.astype(jnp.int32)  # noqa: E731

    # a. count the misses
    m = lax.fori_loop(0, k_tiles, lambda t, c: c + jnp.sum(i32(kind_ref[b, pl.ds(t * tk, tk)] == 3)), jnp.int32(0))

    def stamps(j):
        return hot_stamp_ref[r, pl.ds(j * ts, ts)]  # [TS]

    def fill(ref, value):
        def body(j, c):
            ref[b, pl.ds(j * ts, ts)] = jnp.full((ts,), value, jnp.int32)
            return c

        lax.fori_loop(0, s_tiles, body, jnp.int32(0))

    def lru_update():
        # b. the previous order: prev[j] = rank of slot j in the (stamp, slot) order (a permutation of 0..HR-1).
        # Canonical rows (every stamp in [-1, HR), the non-negative ones distinct: ranks, or -1 = fresh) in
        # O(HR): work[v] := the slot stamped v, checked; then prefix counts over stamp values.
        fill(work_ref, -1)
        _barrier(interpret)

        def claim_value(j, c):
            st = stamps(j)
            inr = (st >= 0) & (st < hr)
            plgpu.store(work_ref.at[b, jnp.where(inr, st, hr)], j * ts + lanes_s, mask=inr)
            return c

        lax.fori_loop(0, s_tiles, claim_value, jnp.int32(0))
        _barrier(interpret)

        def check(j, c):
            bad, neg = c
            st = stamps(j)
            inr = (st >= 0) & (st < hr)
            owner = plgpu.load(work_ref.at[b, jnp.where(inr, st, 0)], mask=inr, other=-1)
            ok = (st == -1) | (inr & (owner == j * ts + lanes_s))  # a duplicate stamp loses the claim somewhere
            return bad + jnp.sum(i32(~ok)), neg + jnp.sum(i32(st == -1))

        bad, n_neg = lax.fori_loop(0, s_tiles, check, (jnp.int32(0), jnp.int32(0)))
        _barrier(interpret)

        def canonical():
            def below(j, seen):  # work[v] := n_neg + #{stamps in [0, v)}
                present = i32(work_ref[b, pl.ds(j * ts, ts)] >= 0)
                work_ref[b, pl.ds(j * ts, ts)] = n_neg + seen + jnp.cumsum(present) - present
                return seen + jnp.sum(present)

            lax.fori_loop(0, s_tiles, below, jnp.int32(0))
            _barrier(interpret)

            def slot_rank(j, seen):  # -1 slots first, in slot order; then by stamp
                st = stamps(j)
                neg = st == -1
                by_value = plgpu.load(work_ref.at[b, jnp.where(neg, 0, st)], mask=~neg, other=0)
                prev_ref[b, pl.ds(j * ts, ts)] = jnp.where(neg, seen + jnp.cumsum(i32(neg)) - 1, by_value)
                return seen + jnp.sum(i32(neg))

            lax.fori_loop(0, s_tiles, slot_rank, jnp.int32(0))

        def general():  # any other stamps (never produced by the resolver): O(HR^2) compare-and-count
            def rank_tile(i, c):
                s_i, v_i = stamps(i)[:, None], (i * ts + lanes_s)[:, None]

                def count_before(j, rank):
                    s_j, v_j = stamps(j)[None, :], (j * ts + lanes_s)[None, :]
                    before = (s_j < s_i) | ((s_j == s_i) & (v_j < v_i))  # [TS, TS]
                    return rank + jnp.sum(i32(before), axis=1)

                prev_ref[b, pl.ds(i * ts, ts)] = lax.fori_loop(0, s_tiles, count_before, jnp.zeros((ts,), jnp.int32))
                return c

            lax.fori_loop(0, s_tiles, rank_tile, jnp.int32(0))

        pl.when(bad == 0)(canonical)
        pl.when(bad > 0)(general)
        _barrier(interpret)

        # c. by previous rank p: work[p] := 2 * #{untouched slots of rank < p} + (1 if untouched else 0)
        fill(work_ref, 1)
        _barrier(interpret)

        def touch(t, c):
            hit = kind_ref[b, pl.ds(t * tk, tk)] == 2
            p = plgpu.load(prev_ref.at[b, jnp.where(hit, addr_ref[b, pl.ds(t * tk, tk)], 0)], mask=hit, other=0)
            plgpu.store(work_ref.at[b, jnp.where(hit, p, hr)], jnp.zeros((tk,), jnp.int32), mask=hit)
            return c

        lax.fori_loop(0, k_tiles, touch, jnp.int32(0))
        _barrier(interpret)

        def scan(j, seen):
            u = work_ref[b, pl.ds(j * ts, ts)]
            work_ref[b, pl.ds(j * ts, ts)] = 2 * (seen + jnp.cumsum(u) - u) + u
            return seen + jnp.sum(u)

        n_u = lax.fori_loop(0, s_tiles, scan, jnp.int32(0))
        _barrier(interpret)

        # d. the new ranks: [untouched, unclaimed | claimed, in claim order | hit]; the m least recent
        # untouched slots are the victims, order[q] = the slot the q-th miss claims
        def rerank(j, c):
            p = prev_ref[b, pl.ds(j * ts, ts)]
            e = plgpu.load(work_ref.at[b, p])
            untouched, ru = (e & 1) == 1, e >> 1
            victim = untouched & (ru < m)
            hot_stamp_ref[r, pl.ds(j * ts, ts)] = jnp.where(
                untouched, jnp.where(victim, n_u - m + ru, ru - m), n_u + p - ru)
            plgpu.store(order_ref.at[b, jnp.where(victim, ru, kp)], j * ts + lanes_s, mask=victim)
            return c

        lax.fori_loop(0, s_tiles, rerank, jnp.int32(0))

    pl.when(live & (hot_ok_ref[b] > 0))(lru_update)  # rows without a hot buffer keep their stamps
    _barrier(interpret)

    # e. addresses, host sources and the claimed slots' new tags
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
        return n_miss + jnp.sum(i32(miss))

    lax.fori_loop(0, k_tiles, assign, jnp.int32(0))


def _slot_tile(hr: int) -> int:
    return min(MAX_TILE, hr & -hr)  # the largest power of two dividing hr, capped


@functools.partial(jax.jit, static_argnames=("hot_rows", "interpret"))
def sparse_gather(topk, req, block_table, host_table, hot_pages, hot_token, hot_stamp, clock, *,
                  hot_rows: int, interpret: bool = False):
    """Pallas (Triton) version of `sparse_gather_reference`; same arguments and results, bit for bit."""
    del clock  # the LRU ranks need no clock
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

    hr_scratch = jax.ShapeDtypeStruct((B, HR), jnp.int32)
    page, row, src_page, hot_token, hot_stamp, _, _, _ = pl.pallas_call(
        functools.partial(_assign_kernel, tk=tk, ts=ts, interpret=interpret), grid=(B,),
        out_shape=(bk, bk, bk, jax.ShapeDtypeStruct((Rq, HR), jnp.int32),
                   jax.ShapeDtypeStruct((Rq, HR), jnp.int32), hr_scratch, hr_scratch, bk),
        input_output_aliases={7: 3, 8: 4}, compiler_params=params, interpret=interpret, name="hisparse_assign",
    )(req, hot_ok, topk_p, kind, addr, host_table, hot_pages, i32(hot_token), i32(hot_stamp))

    kind = kind[:, :K]
    valid = kind > 0
    src_row = jnp.maximum(i32(topk), 0) % PAGE
    return (page[:, :K], row[:, :K], valid, kind == 1, kind == 3, src_page[:, :K], src_row, hot_token, hot_stamp)
