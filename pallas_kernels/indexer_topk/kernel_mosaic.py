"""Paged lightning-indexer scores on Pallas' Mosaic GPU backend (sm_90), and the top-k over them.

Same contract as `reference.indexer_topk_reference` (`indexer_topk(..., backend="mosaic")`). The scores are
what the keys' bytes go into, so they are the kernel: one CUDA block (one warpgroup) per (row b, block of
PAGES_PER_BLOCK pages of its block table), which

    start      copies the row's queries [Ip, T * dI] (T 16-bit parts, `query_terms`; heads padded to a multiple of
               64 with zero weight) into swizzled tiles and its weights [Ip] into shared memory;
    per page   of the block below seq_len (pages past it are not read: unused pages may hold anything):
               one TMA copy of the page's 64 keys [64, dI] (bf16 or e4m3, by its block-table entry; the next
               page's copy is issued before this page's math, into the other of two buffers; MXFP4: the codes
               [64, dI / 2] uint8) and, for e4m3, of its 64 scales (MXFP4: each key's dI / 32 UE8M0 bytes as one
               8-, 16- or 32-bit word, [64] words); the keys converted to swizzled 16-bit tiles (bf16, or f16
               for e4m3: exact, and a native conversion on sm_90, where e4m3 -> bf16 goes through f32; MXFP4:
               per block of 32 values two bf16 tiles [64, 16], its even values (the low nibbles of its 16
               bytes) and its odd ones (the high nibbles), each E2M1 code decoded from its bits times its key's
               2^(scale - 127), exact in bf16: 16-column tiles with a 32-byte swizzle, q's alike, so that each
               tile has one scale per key); one warpgroup MMA, keys [64, dI] x q^T [dI, Ip] -> f32
               [64 keys, Ip heads] (q in the same 16-bit type, its columns in the tiles' order); relu, times
               the head weights, summed over the heads (a row reduction), times the key scales (fp8); each
               score becomes the int32 key of `common.float_to_key` (its signed order is the float order),
               INT32_MIN past seq_len, written to keys[b, page * 64 : + 64].

The selection is `lax.top_k` over the int32 keys [B, Sp] (XLA's own GPU top-k: exact, the lower position
first among equal keys, which is the reference's rule), -1 where the position is past seq_len. Pallas'
Mosaic GPU backend has no gather, scatter, sort or prefix scan at vector indices, so the Triton kernel's
radix selection and compaction cannot be written there; XLA's top-k keeps this path free of the deprecated
Triton backend.

Numerics: 16-bit MMA operands with f32 accumulation. Every product is exact: e4m3 q and keys are exact in f16
(the FP8 path), bf16 q and keys are bf16, an f32 query is split into three bf16 parts whose sum it is exactly
(`query_terms`; three MMAs per page instead of one, the MMA is not what bounds this kernel), and MXFP4 keys and
the MXFP4 query (Hadamard-rotated and quantized in the wrapper as `reference.index_scores_int4` does, then
dequantized) are E2M1 values times powers of two, exact in bf16 (f32's exponent range). The sums run in another
order than the reference's, so a score may differ in its last bits, as the Triton kernel's f32 dots do.

With `layer=` the wrapper reads the store's stacked pool [L, P, 64, dI] in place (MXFP4: codes [L, P, 64, dI / 2]
and scales [L, P, 64, dI / 32], the scales as words by a bitcast): the block table is offset by layer * P into the
flattened [L * P] pages, whose rows are int32 TMA coordinates (L * P * 64 < 2^31, checked; byte offsets are
64-bit).

Limits (ValueError): dI a multiple of 32 and at most 256, heads at most 256, page 64, bf16, e4m3 or MXFP4 (uint8)
keys; MXFP4 keys of dI 32, 64 or 128 only (a key's scale bytes must fit one word: dI 256's 8 would need a strided
shared-memory load, which Mosaic GPU does not lower; dI is a power of two for the Hadamard rotation anyway).
Needs jax >= 0.11; on a CPU it runs in Mosaic GPU's interpret mode (`interpret=True`, or the caller's
`plgpu.force_gpu_interpret_mode(...)`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.backends import mosaic_gpu
from pallas_kernels.common import MXFP4_BLOCK, PAGE, e2m1_to_f32, float_to_key, ue8m0_to_f32

INT_MIN = -(2**31)
HEADS = 64  # heads are padded to a multiple of this (the N of the MMA)
PAGES_PER_BLOCK = 8  # pages per CUDA block (q loaded once per block)
MAX_DIM = 256  # a TMA copy moves at most 256 elements along a dimension; the MMA's N is at most 256
MAX_DIM_INT4 = 128  # MXFP4 keys: a key's dI / 32 scale bytes are read as one word of 8, 16 or 32 bits
WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}  # MXFP4 scale bytes per key -> the word that holds them


def _tile_cols(fmt) -> int:
    """Columns of a 16-bit MMA operand tile (its swizzle is 2 x this, in bytes): 32, or 16 for MXFP4 keys (one
    tile per nibble plane and scale block: 16 values of one block, so one scale per key row)."""
    return 16 if fmt == "int4" else 32


def _mxfp4_tiles(codes, words, bi: int):
    """Block `bi` of a page of MXFP4 keys as two f32 [64, 16] planes (WGMMA layout), its even then its odd values,
    exactly: codes uint8 [64, 16] (bytes 16 bi .. 16 bi + 15 of each key: value 2 j in the low nibble of byte j),
    words [64] (rows layout) holding each key's scale bytes, byte bi the block's UE8M0 exponent."""
    exp = (lax.convert_element_type(words, jnp.int32) >> (8 * bi)) & 255
    scale = lax.broadcast_in_dim(ue8m0_to_f32(exp), codes.shape, [0])
    codes = lax.convert_element_type(codes, jnp.int32)
    return [e2m1_to_f32(plane) * scale for plane in (codes & 15, codes >> 4)]


def _body(seq_ref, q_ref, w_ref, bt_ref, k_ref, *rest, ppb: int, fmt, plgpu):
    # seq_ref [B] int32; q_ref [B, Ip, T * D] 16-bit (MXFP4: the columns in the key tiles' order, `query_terms`);
    # w_ref [B, Ip] f32; bt_ref [B, NB, ppb] int32 (pages per block); k_ref [P * 64, D] keys (MXFP4: codes
    # [P * 64, D / 2] uint8); for e4m3 ks_ref [P, 64] f32 scales, for MXFP4 [P, 64] words of the keys' scale bytes;
    # out_ref [B, Sp] int32; then the scratch
    if fmt is not None:
        ks_ref, out_ref, scratch = rest
    else:
        ks_ref, (out_ref, scratch) = None, rest
    q_smem, w_smem, bt_smem, raw, raw_s, tile, q_bar, loaded = scratch
    cdt = tile.dtype  # the MMA operands' dtype: f16 for e4m3 keys (exact, and converted natively), else bf16
    tw = _tile_cols(fmt)
    b, j = lax.axis_index("b"), lax.axis_index("j")
    seq = seq_ref[b]
    first = j * ppb  # this block's first page (of the row's block table)
    ip = q_ref.shape[1]
    nct = tile.shape[0]  # column tiles of a key tile
    terms = q_smem.shape[0] // nct  # q as a sum of `terms` 16-bit parts (3 for f32 queries, else 1)

    plgpu.copy_gmem_to_smem(bt_ref.at[b, j], bt_smem, q_bar)
    for c in range(terms * nct):
        plgpu.copy_gmem_to_smem(q_ref.at[b, :, pl.ds(c * tw, tw)], q_smem.at[c], q_bar)
    plgpu.copy_gmem_to_smem(w_ref.at[b], w_smem, q_bar)
    plgpu.barrier_wait(q_bar)

    def live(i):  # page i of the block holds a position < seq_len
        return (first + i) * PAGE < seq

    def issue(i):  # the keys (and their scales) of page i into buffer i % 2
        slot = lax.rem(i, 2)
        pg = jnp.maximum(bt_smem[i], 0)
        plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(pg * PAGE, PAGE)], raw.at[slot], loaded.at[slot])
        if fmt is not None:
            plgpu.copy_gmem_to_smem(ks_ref.at[pg], raw_s.at[slot], loaded.at[slot])

    pl.when(live(0))(lambda: issue(0))
    rows = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector over the keys (MMA rows)
    cols = plgpu.Layout.WGMMA.reduce(0)  # a [Ip] vector over the heads (MMA columns)
    w = plgpu.load(w_smem, layout=cols, optimized=False)
    copy_layout = plgpu.Layout.SMEM_GMEM_COPY((PAGE, tw), cdt, 2 * tw)

    def page(i, carry):
        slot = lax.rem(i, 2)
        pos = (first + i) * PAGE + plgpu.broadcasted_iota(jnp.int32, (PAGE,), 0, layout=rows)

        @pl.when(live(i))
        def _compute():
            plgpu.barrier_wait(loaded.at[slot])
            if fmt == "int4":  # codes -> two swizzled bf16 tiles per scale block: its even values, its odd ones
                words = plgpu.load(raw_s.at[slot], layout=rows, optimized=False)  # [64] keys' scale bytes
                for bi in range(nct // 2):
                    codes = plgpu.load(raw.at[slot, :, pl.ds(bi * 16, 16)], layout=plgpu.Layout.WGMMA,
                                       optimized=False)
                    for h, plane in enumerate(_mxfp4_tiles(codes, words, bi)):
                        tile[2 * bi + h] = plane.astype(cdt)
            else:
                for c in range(nct):  # keys -> swizzled 16-bit tile, per 32-column tile
                    tile[c] = plgpu.load(raw.at[slot, :, pl.ds(c * tw, tw)], layout=copy_layout,
                                         optimized=False).astype(cdt)
            plgpu.commit_smem()
            scale = plgpu.load(raw_s.at[slot], layout=rows, optimized=False) if fmt == "fp8" else None

            @pl.when(jnp.logical_and(i + 1 < ppb, live(i + 1)))
            def _next():  # buffer 1 - slot was last read by page i - 1, whose math is done
                issue(i + 1)

            def mma(acc_ref):
                for t in range(terms):
                    for c in range(nct):
                        plgpu.wgmma(acc_ref, tile.at[c], q_smem.at[t * nct + c].T)
                return acc_ref[...]

            dots = pl.run_scoped(mma, plgpu.ACC((PAGE, ip), jnp.float32))  # [64 keys, Ip heads]
            s = jnp.sum(jnp.maximum(dots, 0.0) * lax.broadcast_in_dim(w, dots.shape, [1]), axis=1)  # [64]
            if fmt == "fp8":
                s = s * scale
            out_ref[b, pl.ds((first + i) * PAGE, PAGE)] = jnp.where(pos < seq, float_to_key(s), INT_MIN)

        @pl.when(jnp.logical_not(live(i)))
        def _past():
            out_ref[b, pl.ds((first + i) * PAGE, PAGE)] = plgpu.layout_cast(jnp.full((PAGE,), INT_MIN, jnp.int32), rows)

        return carry

    lax.fori_loop(0, ppb, page, 0)


def indexer_keys_mosaic(seq, q, w, bt, k_pages, k_scale, *, interpret: bool = False):
    """int32 score keys [B, Sp] (Sp = bt.shape[1] * 64, a multiple of PAGES_PER_BLOCK pages) of the prepared
    operands: q [B, Ip, T * dI] (`query_terms`: T 16-bit parts whose sum is the query; Ip a multiple of 64),
    w f32[B, Ip], bt int32[B, Sp / 64] (-1 unused), seq int32[B] (<= Sp), k_pages bf16/e4m3[P, 64, dI] (+ k_scale
    f32[P, 64] for e4m3), or MXFP4 codes uint8[P, 64, dI / 2] with their scales uint8[P, 64, dI / 32]."""
    plgpu = mosaic_gpu()
    B, ip, TD = q.shape
    P = k_pages.shape[0]
    fmt = None if k_scale is None else "int4" if k_pages.dtype == jnp.uint8 else "fp8"
    D = k_pages.shape[2] * (2 if fmt == "int4" else 1)
    mp = bt.shape[1]
    ppb = PAGES_PER_BLOCK
    nb = mp // ppb
    tw = _tile_cols(fmt)
    if fmt == "int4":  # each key's dI / 32 scale bytes as one word (a bitcast: nothing is copied)
        nblk = D // MXFP4_BLOCK
        k_scale = k_scale.reshape(P, PAGE) if nblk == 1 else lax.bitcast_convert_type(k_scale, WORDS[nblk])
    swz = (plgpu.TilingTransform((8, tw)), plgpu.SwizzleTransform(2 * tw))
    scratch = [
        plgpu.SMEM((TD // tw, ip, tw), q.dtype, transforms=swz),  # q's terms, per column tile
        plgpu.SMEM((ip,), jnp.float32),  # head weights
        plgpu.SMEM((ppb,), jnp.int32),  # this block's pages
        plgpu.SMEM((2, PAGE, k_pages.shape[2]), k_pages.dtype),  # raw keys, two buffers
        plgpu.SMEM((2, PAGE), jnp.float32 if k_scale is None else k_scale.dtype),  # raw scales (fp8, MXFP4 words)
        plgpu.SMEM((D // tw, PAGE, tw), q.dtype, transforms=swz),  # keys as swizzled 16-bit tiles
        plgpu.Barrier(num_arrivals=2 + TD // tw),  # block table slice, q tiles, w
        plgpu.Barrier(num_arrivals=1 + (fmt is not None), num_barriers=2),  # page copies, one per buffer
    ]
    body = functools.partial(_body, ppb=ppb, fmt=fmt, plgpu=plgpu)
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((B, mp * PAGE), jnp.int32), scratch_types=[scratch],
                          grid=(B, nb), grid_names=("b", "j"))
    args = [seq, q, w, bt.reshape(B, nb, ppb), k_pages.reshape(P * PAGE, -1)] + ([k_scale] if fmt else [])
    if interpret:
        with plgpu.force_gpu_interpret_mode():
            return kernel(*args)
    return kernel(*args)


def operand_dtype(key_dtype):
    """The MMA operands' dtype for keys of `key_dtype`: float16 for e4m3 (exact; sm_90 converts e4m3 to f16, not
    to bf16, natively), else bfloat16 (MXFP4 values times their power-of-two scales are exact in it)."""
    return jnp.float16 if jnp.dtype(key_dtype) == jnp.float8_e4m3fn else jnp.bfloat16


def query_terms(q, key_dtype):
    """q [B, Ip, dI] -> [B, Ip, T * dI] in `operand_dtype(key_dtype)`: T 16-bit parts, concatenated along dI, whose
    sum is q exactly. float32 q with bf16 keys: 3 bf16 parts (8 mantissa bits each), so every product with a
    bf16 key is exact in the f32 accumulator, as in the reference's f32 dots (only the summation order differs);
    16-bit q (and the e4m3 values of the FP8 path): itself. MXFP4 keys (uint8 codes; q is the dequantized MXFP4
    query, exact in bf16): one part, its columns in the key tiles' order: per block of 32 its 16 even values,
    then its 16 odd ones."""
    dt = operand_dtype(key_dtype)
    if jnp.dtype(key_dtype) == jnp.uint8:
        B, ip, D = q.shape
        return q.astype(dt).reshape(B, ip, D // MXFP4_BLOCK, MXFP4_BLOCK // 2, 2).swapaxes(3, 4).reshape(B, ip, D)
    if q.dtype != jnp.float32:
        return q.astype(dt)
    parts, rest = [], q
    for _ in range(3):
        part = rest.astype(dt)
        parts.append(part)
        rest = rest - part.astype(jnp.float32)
    return jnp.concatenate(parts, axis=-1)


def check_mosaic_shapes(q, k_pages, k_scale):
    """ValueError naming the limit, for shapes the Mosaic scores kernel cannot take (k_pages one layer's [P, 64,
    dI], or [P, 64, dI / 2] MXFP4 codes)."""
    B, I, D = q.shape
    if k_pages.shape[1] != PAGE:
        raise ValueError(f"the Mosaic indexer kernel reads pages of {PAGE} keys, got {k_pages.shape[1]}")
    if D % 32 or D > MAX_DIM:
        raise ValueError(f"the Mosaic indexer kernel needs dI a multiple of 32 and <= {MAX_DIM}, got {D}")
    if -(-I // HEADS) * HEADS > MAX_DIM:
        raise ValueError(f"the Mosaic indexer kernel takes at most {MAX_DIM} heads, got {I}")
    if k_pages.dtype not in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.uint8):
        raise ValueError(f"the Mosaic indexer kernel reads bfloat16, float8_e4m3fn or uint8 (MXFP4) keys, got "
                         f"{k_pages.dtype}")
    if k_pages.dtype == jnp.uint8 and D not in (32, 64, MAX_DIM_INT4):
        raise ValueError(f"the Mosaic indexer kernel reads MXFP4 keys of dI 32, 64 or {MAX_DIM_INT4} (a key's scale "
                         f"bytes as one word of 8, 16 or 32 bits), got {D}")


def topk_from_keys(keys, seq, topk: int):
    """The first `topk` positions of int32 keys [B, Sp] by (key desc, position asc), -1 at or past seq_len."""
    B, Sp = keys.shape
    if Sp < topk:
        keys = jnp.pad(keys, ((0, 0), (0, topk - Sp)), constant_values=INT_MIN)
    _, pos = lax.top_k(keys, topk)
    return jnp.where(pos < seq[:, None], pos, -1).astype(jnp.int32)
