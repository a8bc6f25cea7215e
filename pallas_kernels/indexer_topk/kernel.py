"""Paged lightning-indexer top-k as Pallas (Triton backend) kernels: exact, fixed shapes, no host sync.

    score(s) = sum_h w[b, h] * relu(q[b, h] . k[s])          s < seq_lens[b]
    indexer_topk(...)[b] = the `topk` positions of the largest scores in descending score order; among
                           equal scores the LOWER POSITION comes first (and wins the last slots), which is
                           `lax.top_k` / `select_topk`'s rule; -1 pads the end when seq_len < topk.

Shapes: B decode rows, I indexer heads (padded to Ip >= 16 with zero weight), dI head dim, P pool pages
of `page` rows, MP block-table pages per row, S = MP * page positions padded to Sp (a multiple of the
selection chunk C <= 2048), NC = Sp / C, K = topk, R = 2**RADIX_BITS radix candidates.

Algorithm (`lax.top_k` / `sort` do not lower on the Pallas GPU backends, so selection is done by hand):

1. `_score_kernel`, grid (B, Sp / (PPB * page)): a program loads q [Ip, dI] once and walks PPB pages of
   its block-table slice; per page one [Ip, dI] x [dI, page] dot, relu, the w-weighted head sum and, for
   FP8 keys, the per-key scale. It reads the store's stacked pool [L, P, page, dI] in place at the layer
   (an operand); FP8 keys as uint32 words of four, decoded in registers and dotted as four partial dots, so
   the 32-bit offsets jax's Triton lowering uses for operands up to 4 GiB never pass 2^31 (`common.fp8_words`).
   Each score becomes an int32 key whose signed order is the float order
   (negative floats get their magnitude bits flipped; -0.0 counts as +0.0). Positions >= seq_len get
   INT32_MIN, the lowest key; pages wholly past seq_len are not read, so unused pages may hold anything.
2. Radix select of the threshold T = the k_eff-th largest key, k_eff = min(K, Sp): 32 / RADIX_BITS rounds.
   `_count_kernel`, grid (B, NC), counts per chunk how many keys are >= each of the R candidates
   prefix + (d << shift) (compare-and-reduce: no atomics, so interpret mode is faithful); small jnp ops
   sum the chunks and append the largest digit d whose count is still >= k_eff to the prefix.
3. `_tie_count_kernel`, grid (B, NC): per chunk #(key > T) and #(key == T). Exclusive prefix sums over
   chunks give each chunk its first output slot and how many keys equal to T it may take
   (need = k_eff - #(key > T) in all, lowest positions first).
4. `_compact_kernel`, grid (B, NC): an in-chunk cumsum gives every selected key its slot; a masked scatter
   writes (key, position) into K-slot candidate buffers. They are aliased inputs pre-filled with INT32_MIN
   keys and distinct out-of-range positions (unfilled slots sort last and come out as -1), plus one spare
   slot per chunk lane as the target of unselected lanes (no repeated scatter index anywhere).
5. `_rank_kernel`, grid (B, K / 128): the rank of a candidate in the order (key desc, position asc) is the
   number of candidates that beat it (K x K compare-and-reduce); a scatter writes its position, or -1 when
   >= seq_len, to out[rank]. Ranks are a permutation of 0..K-1: each output slot is written exactly once.

Selecting over all Sp positions (invalid ones carry INT32_MIN and lose every tie to lower positions)
makes the first min(seq_len, K) slots the valid positions and the rest -1 with no special case.

Cost per call, B rows: step 1 reads each valid key page (dI bytes per row in FP8 + its scale, 2 dI in bf16)
once, q once per PPB pages, and does 2 * I * dI flops per valid position (tensor cores for bf16 q with
bf16/FP8 keys; IEEE f32 dots when q or the keys are f32). Steps 2-4 make 32 / RADIX_BITS + 2 passes over
the int32 key buffer (4 * Sp bytes per row each; 2 MB for B=4 at 128K, L2-resident) with R compares per
position per round. Step 5 does K^2 compares per row. Pallas launches: 1 + 32 / RADIX_BITS + 3, plus a few
small jnp fusions per round; no shape depends on data (CUDA-graph friendly).

Assumes finite scores at valid positions (a NaN would be ordered by its bits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.backends import check_pallas_backend
from pallas_kernels.common import (FP8_PER_WORD, MXFP4_BLOCK, MXFP4_PER_WORD, check_triton_offsets, e2m1_to_f32,
                                   float_to_key, fp8_quantize, fp8_words, hadamard, int4_words, mxfp4_dequantize,
                                   mxfp4_quantize, ue8m0_to_f32, word_planes)

INT_MIN = -(2**31)
RADIX_BITS = 4  # bits of the key decided per counting round (divides 32): 32 / RADIX_BITS rounds
PAGES_PER_BLOCK = 8  # pages per score program (q is loaded once per block)
MAX_CHUNK = 2048  # keys per selection program
COUNT_SUB = 128  # keys per step of the count loop: a [COUNT_SUB, 2**RADIX_BITS] compare
RANK_ROWS = 128  # candidates ranked per rank program
RANK_COLS = 128  # candidates compared per step of the rank loop
MIN_DOT = 16  # Triton dots need every dimension >= 16
MAX_TOPK = 8192  # the rank step is K^2 per row


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _u32_to_key(u):
    """Offset-binary uint32 -> the int32 key with the same rank."""
    return lax.bitcast_convert_type(u ^ jnp.uint32(0x80000000), jnp.int32)


# ----- 1. scores -> keys --------------------------------------------------------------------------
def _qk(q, k):
    """[Ip, d] x [page, d] -> f32 [Ip, page] (Triton dots need d >= 16; narrower ones are summed products)."""
    if q.shape[-1] >= MIN_DOT:
        return lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    return jnp.sum(q.astype(jnp.float32)[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=-1)


def _int4_keys(words, scale_ref, layer, pg, compute_dtype):
    """One page of MXFP4 keys, decoded: words uint32[page, dI / 8] -> 8 planes [page, dI / 8] (plane n holds
    values 8 j + n), each value times its block's scale (block j // 4 of the key: words 4 b .. 4 b + 3)."""
    nw = words.shape[-1]
    block = lax.broadcasted_iota(jnp.int32, (1, nw), 1) // (MXFP4_BLOCK // MXFP4_PER_WORD)  # [1, dI / 8]
    scales = 0.0
    for bi in range(nw * MXFP4_PER_WORD // MXFP4_BLOCK):  # the key's scale bytes, one column each
        scales = scales + jnp.where(block == bi, ue8m0_to_f32(scale_ref[layer, pg, :, bi])[:, None], 0.0)
    return [(e2m1_to_f32((words >> (4 * n)) & 15) * scales).astype(compute_dtype) for n in range(MXFP4_PER_WORD)]


def _score_kernel(seq_ref, layer_ref, q_ref, w_ref, bt_ref, k_ref, *rest, page, ppb, fmt, compute_dtype):
    # seq_ref: [B] int32 (whole array)      layer_ref: [1] int32 the layer read
    # q_ref: [Ip, dI]; for e4m3 keys [4, Ip, dI / 4] (q_ref[m][:, j] = q[:, 4 j + m]); for MXFP4 keys
    #   [8, Ip, dI / 8] (q_ref[n][:, j] = q[:, 8 j + n])      w_ref: [Ip] f32
    # bt_ref: [ppb] int32 block-table slice
    # k_ref: the stacked pool [L, P, page, dI], or its uint32 words: e4m3 [L, P, page, dI / 4], MXFP4 codes
    #   [L, P, page, dI / 8]
    # ks_ref: e4m3 [L, P, page] f32, MXFP4 [L, P, page, dI / 32] uint8 (UE8M0)   out_ref: [ppb * page] int32 keys
    if fmt is None:
        (out_ref,) = rest
    else:
        ks_ref, out_ref = rest
    b, j = pl.program_id(0), pl.program_id(1)
    seq_len, layer = seq_ref[b], layer_ref[0]
    # q once per program: [Ip, dI], or its parts matching the key words' planes
    parts = {None: 0, "fp8": FP8_PER_WORD, "int4": MXFP4_PER_WORD}[fmt]
    qs = [q_ref[m].astype(compute_dtype) for m in range(parts)] if parts else q_ref[...].astype(compute_dtype)
    w = w_ref[...]  # [Ip]

    def page_keys(i):
        start = (j * ppb + i) * page
        pos = start + lax.broadcasted_iota(jnp.int32, (page,), 0)  # [page]

        def compute():
            pg = jnp.maximum(bt_ref[i], 0)
            if fmt == "fp8":  # byte m of word j is key element 4 j + m (little-endian): four partial dots
                planes = word_planes(k_ref[layer, pg])  # 4 x [page, dI / 4] f32
                dots = sum(_qk(q, k.astype(compute_dtype)) for q, k in zip(qs, planes))  # [Ip, page]
            elif fmt == "int4":  # nibble n of word j is key element 8 j + n: eight partial dots, values scaled
                planes = _int4_keys(k_ref[layer, pg], ks_ref, layer, pg, compute_dtype)
                dots = sum(_qk(q, k) for q, k in zip(qs, planes))  # [Ip, page]
            else:
                dots = _qk(qs, k_ref[layer, pg].astype(compute_dtype))
            s = jnp.sum(jnp.maximum(dots, 0.0) * w[:, None], axis=0)  # [page]
            if fmt == "fp8":
                s = s * ks_ref[layer, pg]
            return jnp.where(pos < seq_len, float_to_key(s), INT_MIN)

        return lax.cond(start < seq_len, compute, lambda: jnp.full((page,), INT_MIN, jnp.int32))

    def body(i, carry):
        out_ref[pl.ds(pl.multiple_of(i * page, page), page)] = page_keys(i)
        return carry

    lax.fori_loop(0, ppb, body, 0)


def _scores_to_keys(seq, layer, q, w, bt, k_pages, k_scale, *, ppb, compute_dtype, interpret):
    """k_pages / k_scale: the stacked pools, read in place at `layer` (int32 [1])."""
    B, Ip, D = q.shape
    page = k_pages.shape[2]
    Sp = bt.shape[1] * page
    blk = ppb * page
    fmt = _key_format(k_pages, k_scale)
    if fmt is not None:  # keys as uint32 words; q split into the matching planes
        k_pages, per = (fp8_words(k_pages), FP8_PER_WORD) if fmt == "fp8" else (int4_words(k_pages), MXFP4_PER_WORD)
        q = q.reshape(B, Ip, D // per, per).transpose(0, 3, 1, 2)  # [B, per, Ip, dI / per]
        check_triton_offsets("k_scale", k_scale)
    check_triton_offsets("k_pages", k_pages)  # safe by construction (see `fp8_words`); kept as the proof
    in_specs = [
        pl.BlockSpec(seq.shape, lambda b, j: (0,)),
        pl.BlockSpec(layer.shape, lambda b, j: (0,)),
        pl.BlockSpec((None, *q.shape[1:]), lambda b, j: (b,) + (0,) * (q.ndim - 1)),
        pl.BlockSpec((None, Ip), lambda b, j: (b, 0)),
        pl.BlockSpec((None, ppb), lambda b, j: (b, j)),
        pl.BlockSpec(k_pages.shape, lambda b, j: (0, 0, 0, 0)),
    ]
    args = [seq, layer, q, w, bt, k_pages]
    if fmt is not None:
        in_specs.append(pl.BlockSpec(k_scale.shape, lambda b, j: (0,) * k_scale.ndim))
        args.append(k_scale)
    kernel = functools.partial(_score_kernel, page=page, ppb=ppb, fmt=fmt, compute_dtype=compute_dtype)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((B, Sp), jnp.int32),
        grid=(B, Sp // blk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, blk), lambda b, j: (b, j)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="indexer_scores",
    )(*args)


# ----- 2. radix select of the threshold ------------------------------------------------------------
def _count_kernel(keys_ref, cand_ref, out_ref, *, sub):
    # keys_ref: [C] int32   cand_ref: [NK] int32 candidates   out_ref: [NK] int32 #(key >= candidate)
    cand = cand_ref[...]

    def body(i, acc):
        k = keys_ref[pl.ds(pl.multiple_of(i * sub, sub), sub)]  # [sub]
        return acc + jnp.sum((k[:, None] >= cand[None, :]).astype(jnp.int32), axis=0)

    out_ref[...] = lax.fori_loop(0, keys_ref.shape[0] // sub, body, jnp.zeros(cand.shape, jnp.int32))


def _count_ge(keys, cands, *, chunk, interpret):
    """keys int32[B, Sp], cands int32[B, NK] -> int32[B, NC, NK] per-chunk #(key >= candidate)."""
    B, Sp = keys.shape
    NK = cands.shape[1]
    return pl.pallas_call(
        functools.partial(_count_kernel, sub=min(COUNT_SUB, chunk)),
        out_shape=jax.ShapeDtypeStruct((B, Sp // chunk, NK), jnp.int32),
        grid=(B, Sp // chunk),
        in_specs=[pl.BlockSpec((None, chunk), lambda b, c: (b, c)),
                  pl.BlockSpec((None, NK), lambda b, c: (b, 0))],
        out_specs=pl.BlockSpec((None, None, NK), lambda b, c: (b, c, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="indexer_topk_count",
    )(keys, cands)


def _threshold(keys, k_eff, *, chunk, interpret):
    """The k_eff-th largest key of each row -> int32[B] (k_eff <= Sp, so it exists)."""
    B = keys.shape[0]
    radix = 1 << RADIX_BITS
    digits = jnp.arange(radix, dtype=jnp.uint32)  # [R]
    prefix = jnp.zeros((B,), jnp.uint32)  # offset-binary bits decided so far
    for shift in range(32 - RADIX_BITS, -1, -RADIX_BITS):
        cands = _u32_to_key(prefix[:, None] + (digits[None] << shift))  # [B, R], increasing
        total = jnp.sum(_count_ge(keys, cands, chunk=chunk, interpret=interpret), axis=1)  # [B, R]
        d = jnp.sum(total[:, 1:] >= k_eff, axis=1).astype(jnp.uint32)  # count(>= cand) is non-increasing
        prefix = prefix + (d << shift)
    return _u32_to_key(prefix)


# ----- 3. per-chunk tie counts ---------------------------------------------------------------------
def _tie_count_kernel(thr_ref, keys_ref, gt_ref, eq_ref):
    # thr_ref: [B] int32 (whole array)  keys_ref: [C] int32  gt_ref, eq_ref: [1] int32
    t = thr_ref[pl.program_id(0)]
    k = keys_ref[...]
    gt_ref[...] = jnp.full((1,), jnp.sum((k > t).astype(jnp.int32)), jnp.int32)
    eq_ref[...] = jnp.full((1,), jnp.sum((k == t).astype(jnp.int32)), jnp.int32)


def _tie_counts(keys, thr, *, chunk, interpret):
    B, Sp = keys.shape
    nc = Sp // chunk
    spec = pl.BlockSpec((None, 1), lambda b, c: (b, c))
    return pl.pallas_call(
        _tie_count_kernel,
        out_shape=(jax.ShapeDtypeStruct((B, nc), jnp.int32),) * 2,
        grid=(B, nc),
        in_specs=[pl.BlockSpec(thr.shape, lambda b, c: (0,)), pl.BlockSpec((None, chunk), lambda b, c: (b, c))],
        out_specs=(spec, spec),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="indexer_topk_ties",
    )(thr, keys)


# ----- 4. compaction into K candidate slots ----------------------------------------------------------
def _compact_kernel(thr_ref, need_ref, sel_off_ref, eq_off_ref, keys_ref, _ck_in, _cp_in, ck_ref, cp_ref):
    # thr_ref, need_ref: [B] int32 (whole)   sel_off_ref, eq_off_ref: [B, NC] int32 (whole)
    # keys_ref: [C] int32   ck_ref, cp_ref: [K + C] int32 candidate keys / positions (aliased to _ck_in,
    # _cp_in); slots K.. are one spare per lane, the masked-off target (no repeated scatter index)
    b, c = pl.program_id(0), pl.program_id(1)
    C = keys_ref.shape[0]
    K = ck_ref.shape[0] - C
    t = thr_ref[b]
    k = keys_ref[...]  # [C]
    pos = c * C + lax.broadcasted_iota(jnp.int32, (C,), 0)
    eq = (k == t).astype(jnp.int32)
    eq_rank = eq_off_ref[b, c] + jnp.cumsum(eq) - eq  # ties before this one, in position order
    sel = (k > t) | ((eq == 1) & (eq_rank < need_ref[b]))
    sel_i = sel.astype(jnp.int32)
    slot = sel_off_ref[b, c] + jnp.cumsum(sel_i) - sel_i  # [C], < K where selected
    slot = jnp.where(sel, slot, K + lax.broadcasted_iota(jnp.int32, (C,), 0))  # unselected: own spare slot
    plgpu.store(ck_ref.at[slot], k, mask=sel)
    plgpu.store(cp_ref.at[slot], pos, mask=sel)


def _compact(keys, thr, need, sel_off, eq_off, cand_key, cand_pos, *, chunk, interpret):
    B, Sp = keys.shape
    KC = cand_key.shape[1]
    row = pl.BlockSpec((None, KC), lambda b, c: (b, 0))

    def whole(x):
        return pl.BlockSpec(x.shape, lambda b, c: (0,) * x.ndim)

    return pl.pallas_call(
        _compact_kernel,
        out_shape=(jax.ShapeDtypeStruct((B, KC), jnp.int32),) * 2,
        grid=(B, Sp // chunk),
        in_specs=[whole(thr), whole(need), whole(sel_off), whole(eq_off),
                  pl.BlockSpec((None, chunk), lambda b, c: (b, c)), row, row],
        out_specs=(row, row),
        input_output_aliases={5: 0, 6: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="indexer_topk_compact",
    )(thr, need, sel_off, eq_off, keys, cand_key, cand_pos)


# ----- 5. order by (key desc, position asc) ----------------------------------------------------------
def _rank_kernel(seq_ref, ck_ref, cp_ref, out_ref, *, k, rows, cols):
    # seq_ref: [B] int32 (whole)   ck_ref, cp_ref: [K + C] int32 candidates (slots < K used)
    # out_ref: [K] int32 positions
    b, r = pl.program_id(0), pl.program_id(1)
    mine = pl.ds(pl.multiple_of(r * rows, rows), rows)
    mk, mp = ck_ref[mine], cp_ref[mine]  # [rows]

    def body(i, rank):
        other = pl.ds(pl.multiple_of(i * cols, cols), cols)
        ok, op = ck_ref[other][:, None], cp_ref[other][:, None]  # [cols, 1]
        beats = (ok > mk[None, :]) | ((ok == mk[None, :]) & (op < mp[None, :]))  # [cols, rows]
        return rank + jnp.sum(beats.astype(jnp.int32), axis=0)

    rank = lax.fori_loop(0, k // cols, body, jnp.zeros((rows,), jnp.int32))
    plgpu.store(out_ref.at[rank], jnp.where(mp < seq_ref[b], mp, -1))


def _rank(seq, cand_key, cand_pos, *, k, interpret):
    B, KC = cand_key.shape
    rows, cols = min(RANK_ROWS, k), min(RANK_COLS, k)
    cand = pl.BlockSpec((None, KC), lambda b, r: (b, 0))
    return pl.pallas_call(
        functools.partial(_rank_kernel, k=k, rows=rows, cols=cols),
        out_shape=jax.ShapeDtypeStruct((B, k), jnp.int32),
        grid=(B, k // rows),
        in_specs=[pl.BlockSpec(seq.shape, lambda b, r: (0,)), cand, cand],
        out_specs=pl.BlockSpec((None, k), lambda b, r: (b, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="indexer_topk_rank",
    )(seq, cand_key, cand_pos)


# ----- public ------------------------------------------------------------------------------------
def _check(q, w, k_pages, block_table, seq_lens, topk, k_scale):
    """Operand shapes every backend needs (ValueError naming the problem)."""
    if q.ndim != 3 or w.shape != q.shape[:2]:
        raise ValueError(f"q must be [B, I, dI] and w [B, I]; got q {q.shape}, w {w.shape}")
    B, _, D = q.shape
    int4 = k_pages.dtype == jnp.uint8  # MXFP4 codes, two per byte
    if k_pages.ndim != 3 or k_pages.shape[2] != (D // 2 if int4 else D) or (int4 and D % MXFP4_BLOCK):
        raise ValueError(f"k_pages must be [P, page, dI={D}]" + (f" (uint8 MXFP4 codes: [P, page, dI / 2] with dI a "
                         f"multiple of {MXFP4_BLOCK})" if int4 else "") + f"; got {k_pages.shape}")
    if block_table.ndim != 2 or block_table.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError(f"block_table must be [B={B}, MP] and seq_lens [B]; got {block_table.shape}, "
                         f"{seq_lens.shape}")
    fp8 = k_pages.dtype == jnp.float8_e4m3fn
    if (fp8 or int4) != (k_scale is not None):
        raise ValueError("float8_e4m3fn keys need k_scale f32[P, page] and uint8 (MXFP4) keys k_scale uint8[P, "
                         "page, dI / 32]; only they take one")
    if fp8 and (k_scale.shape != k_pages.shape[:2] or k_scale.dtype != jnp.float32):
        raise ValueError(f"k_scale must be f32[P, page] = {k_pages.shape[:2]}; got {k_scale.dtype}{k_scale.shape}")
    if int4 and (k_scale.shape != (*k_pages.shape[:2], D // MXFP4_BLOCK) or k_scale.dtype != jnp.uint8):
        raise ValueError(f"k_scale must be uint8[P, page, dI / 32] = {(*k_pages.shape[:2], D // MXFP4_BLOCK)}; got "
                         f"{k_scale.dtype}{k_scale.shape}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1; got {topk}")


def _check_triton(q, k_pages, topk, max_chunk):
    """The Triton kernels' own limits."""
    D, page = q.shape[2], k_pages.shape[1]
    if not (_pow2(D) and D >= MIN_DOT):
        raise ValueError(f"indexer_topk needs a power-of-two head dim >= {MIN_DOT} (Triton); got dI={D}")
    if not (_pow2(page) and page >= MIN_DOT):
        raise ValueError(f"indexer_topk needs a power-of-two page size >= {MIN_DOT} (Triton); got {page}")
    if not (_pow2(max_chunk) and max_chunk >= page):
        raise ValueError(f"max_chunk must be a power of two >= the page size {page}; got {max_chunk}")
    if not (_pow2(topk) and topk <= MAX_TOPK):
        raise ValueError(f"indexer_topk needs topk a power of two <= MAX_TOPK={MAX_TOPK}; got {topk}")
    if k_pages.dtype not in (jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.uint8):
        raise ValueError(f"k_pages must be bfloat16, float32, float8_e4m3fn or uint8 (MXFP4); got {k_pages.dtype}")


@functools.partial(jax.jit, static_argnames=("topk", "interpret", "backend"))
def indexer_topk(q, w, k_pages, block_table, seq_lens, *, topk: int, k_scale=None, layer=None, interpret=False,
                 backend: str = "triton"):
    """Exact paged indexer top-k (Pallas kernels) -> int32[B, topk]; same contract as `indexer_topk_reference`.

    q f32/bf16[B, I, dI], w f32[B, I] (scale constants folded in), k_pages bf16/f32/e4m3[P, page, dI]
    (e4m3 keys are the rotated + quantized keys of `quantize_index_keys`, with k_scale f32[P, page]), or uint8
    MXFP4 codes [P, page, dI / 2] of `quantize_index_keys_int4` with k_scale uint8[P, page, dI / 32],
    block_table int32[B, MP] (-1 unused), seq_lens int32[B] (0 = idle row). With `layer` (an int32 scalar,
    traced or not) k_pages / k_scale are the store's stacked pools [L, P, page, ...] / [L, P, page(, dI / 32)] and
    layer `layer` is read in place (no copy of the layer's pages) by either backend.

    backend "triton" (default): scores and an exact radix selection, all Pallas Triton; raises ValueError for
    shapes the kernels cannot handle (non-power-of-two dI, page or topk, topk > MAX_TOPK). With q in bf16 and
    bf16 / FP8 keys the dots run on tensor cores (bf16 in, f32 accumulate); f32 operands use IEEE f32 dots.
    backend "mosaic": the scores on Mosaic GPU (`kernel_mosaic`: warpgroup MMA on bf16 operands, pages of 64,
    bf16 or e4m3 keys with dI a multiple of 32, or MXFP4 keys with dI 32, 64 or 128) and XLA's top-k over them;
    jax >= 0.11.
    """
    if check_pallas_backend(backend) == "mosaic":
        return _indexer_topk_mosaic(q, w, k_pages, block_table, seq_lens, topk=topk, k_scale=k_scale, layer=layer,
                                    interpret=interpret)
    return indexer_topk_chunked(q, w, k_pages, block_table, seq_lens, topk=topk, k_scale=k_scale, layer=layer,
                                interpret=interpret, max_chunk=MAX_CHUNK)


def _key_format(k_pages, k_scale):
    """None (bf16 / f32 keys), "fp8" (e4m3 keys + f32 scales) or "int4" (MXFP4 uint8 codes + UE8M0 scales)."""
    if k_scale is None:
        return None
    return "int4" if k_pages.dtype == jnp.uint8 else "fp8"


def _prepare_query(q, w, k_pages, k_scale):
    """(q, w, compute dtype) as the score kernels take them: for e4m3 keys the query side of
    `index_scores_fp8` (rotated, quantized; its scales folded into w), for MXFP4 keys that of `index_scores_int4`
    (rotated, quantized and dequantized: E2M1 values times powers of two, exact in bf16), same shapes so the same
    bits."""
    w = w.astype(jnp.float32)
    if _key_format(k_pages, k_scale) == "int4":
        return mxfp4_dequantize(*mxfp4_quantize(hadamard(q.astype(jnp.float32)))).astype(jnp.bfloat16), w, \
            jnp.bfloat16
    if k_scale is not None:
        qq, qs = fp8_quantize(hadamard(q.astype(jnp.float32)[:, None]), block=q.shape[-1])  # [B, 1, I, dI], [B, 1, I]
        return qq[:, 0].astype(jnp.bfloat16), w * qs[:, 0], jnp.bfloat16  # e4m3 values are exact in bf16
    return q, w, None


def _check_stacked(k_pages, k_scale):
    if k_pages.ndim != 4 or (k_scale is not None and k_scale.shape[:3] != k_pages.shape[:3]):
        raise ValueError(f"with layer=, k_pages must be the stacked [L, P, page, dI] pool (and k_scale [L, P, page], "
                         f"or [L, P, page, dI / 32] for MXFP4); got {k_pages.shape}"
                         + ("" if k_scale is None else f" and {k_scale.shape}"))


def _indexer_topk_mosaic(q, w, k_pages, block_table, seq_lens, *, topk, k_scale, layer, interpret):
    from pallas_kernels.indexer_topk import kernel_mosaic as km

    if layer is None:
        k_pages, k_scale, layer = k_pages[None], None if k_scale is None else k_scale[None], 0
    _check_stacked(k_pages, k_scale)
    L, P = k_pages.shape[:2]
    one_layer = jax.ShapeDtypeStruct(k_pages.shape[1:], k_pages.dtype)  # the checks need shapes only
    one_scale = None if k_scale is None else jax.ShapeDtypeStruct(k_scale.shape[1:], k_scale.dtype)
    _check(q, w, one_layer, block_table, seq_lens, topk, one_scale)
    km.check_mosaic_shapes(q, one_layer, k_scale)
    if L * P * k_pages.shape[2] >= 2**31:
        raise ValueError(f"the Mosaic indexer kernel addresses the {L} x {P} pages' rows with int32 TMA coordinates "
                         f"(< 2^31 rows); got {L * P * k_pages.shape[2]}")
    B, I, _ = q.shape
    MP = block_table.shape[1]
    # the layer's pages as pages of the flattened [L * P] pool (read in place, nothing copied)
    block_table = jnp.where(block_table >= 0, jnp.asarray(layer, jnp.int32) * P + block_table, -1)
    k_pages = k_pages.reshape(L * P, *k_pages.shape[2:])
    k_scale = None if k_scale is None else k_scale.reshape(L * P, *k_scale.shape[2:])
    q, w, _ = _prepare_query(q, w, k_pages, k_scale)
    ip = -(-I // km.HEADS) * km.HEADS  # zero heads with zero weight add nothing
    q = jnp.pad(km.query_terms(q, k_pages.dtype), ((0, 0), (0, ip - I), (0, 0)))
    w = jnp.pad(w, ((0, 0), (0, ip - I)))
    mpp = -(-MP // km.PAGES_PER_BLOCK) * km.PAGES_PER_BLOCK
    bt = jnp.pad(block_table.astype(jnp.int32), ((0, 0), (0, mpp - MP)), constant_values=-1)
    seq = jnp.clip(seq_lens.astype(jnp.int32), 0, MP * k_pages.shape[1])
    keys = km.indexer_keys_mosaic(seq, q, w, bt, k_pages, k_scale, interpret=interpret)  # [B, mpp * 64]
    return km.topk_from_keys(keys, seq, topk)


@functools.partial(jax.jit, static_argnames=("topk", "interpret", "max_chunk"))
def indexer_topk_chunked(q, w, k_pages, block_table, seq_lens, *, topk: int, k_scale=None, layer=None,
                         interpret=False, max_chunk: int = MAX_CHUNK):
    """`indexer_topk` (Triton backend) with the selection chunk (keys per selection program, a power of two
    >= page) as a knob; tests use small chunks to exercise the cross-chunk offsets on small pools."""
    if layer is None:
        k_pages, k_scale, layer = k_pages[None], None if k_scale is None else k_scale[None], 0
    _check_stacked(k_pages, k_scale)
    one_layer = jax.ShapeDtypeStruct(k_pages.shape[1:], k_pages.dtype)  # the checks need shapes only
    one_scale = None if k_scale is None else jax.ShapeDtypeStruct(k_scale.shape[1:], k_scale.dtype)
    _check(q, w, one_layer, block_table, seq_lens, topk, one_scale)
    _check_triton(q, one_layer, topk, max_chunk)
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    B, I, D = q.shape
    page = k_pages.shape[2]
    MP = block_table.shape[1]
    q, w, compute_dtype = _prepare_query(q, w, k_pages, k_scale)
    if k_scale is None:
        if q.dtype == jnp.bfloat16 and k_pages.dtype == jnp.bfloat16:
            compute_dtype = jnp.bfloat16
        else:
            q, compute_dtype = q.astype(jnp.float32), jnp.float32
    Ip = max(MIN_DOT, _next_pow2(I))  # zero heads with zero weight add nothing
    q = jnp.pad(q, ((0, 0), (0, Ip - I), (0, 0)))
    w = jnp.pad(w, ((0, 0), (0, Ip - I)))

    S = MP * page
    chunk = max(page, min(max_chunk, _next_pow2(S)))
    ppb = min(PAGES_PER_BLOCK, chunk // page)
    Sp = -(-S // chunk) * chunk
    bt = jnp.pad(block_table.astype(jnp.int32), ((0, 0), (0, Sp // page - MP)), constant_values=-1)
    seq = jnp.clip(seq_lens.astype(jnp.int32), 0, S)

    keys = _scores_to_keys(seq, layer, q, w, bt, k_pages, k_scale, ppb=ppb, compute_dtype=compute_dtype,
                           interpret=interpret)  # [B, Sp]
    k_eff = min(topk, Sp)
    thr = _threshold(keys, k_eff, chunk=chunk, interpret=interpret)  # [B]
    gt, eq = _tie_counts(keys, thr, chunk=chunk, interpret=interpret)  # [B, NC] each
    need = k_eff - jnp.sum(gt, axis=1)  # [B] ties to take, >= 1
    eq_off = jnp.cumsum(eq, axis=1) - eq
    take = jnp.clip(need[:, None] - eq_off, 0, eq)
    sel_off = jnp.cumsum(gt + take, axis=1) - (gt + take)
    # K slots + one spare per chunk lane; distinct positions >= seq_len so unfilled slots sort last as -1
    cand_key = jnp.full((B, topk + chunk), INT_MIN, jnp.int32)
    cand_pos = jnp.broadcast_to(Sp + jnp.arange(topk + chunk, dtype=jnp.int32), (B, topk + chunk))
    cand_key, cand_pos = _compact(keys, thr, need, sel_off, eq_off, cand_key, cand_pos, chunk=chunk,
                                  interpret=interpret)
    return _rank(seq, cand_key, cand_pos, k=topk, interpret=interpret)
