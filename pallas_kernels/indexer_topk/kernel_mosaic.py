"""Paged lightning-indexer scores on Pallas' Mosaic GPU backend (sm_90), and the top-k over them.

Same contract as `reference.indexer_topk_reference` (`indexer_topk(..., backend="mosaic")`). The scores are
what the keys' bytes go into, so they are the kernel: one CUDA block (one warpgroup) per (row b, block of
PAGES_PER_BLOCK pages of its block table), which

    start      copies the row's queries [Ip, T * dI] (T 16-bit parts, `query_terms`; heads padded to a multiple of
               64 with zero weight) into swizzled tiles and its weights [Ip] into shared memory;
    per page   of the block below seq_len (pages past it are not read: unused pages may hold anything):
               one TMA copy of the page's 64 keys [64, dI] (bf16 or e4m3, by its block-table entry; the next
               page's copy is issued before this page's math, into the other of two buffers) and, for e4m3,
               of its 64 scales; the keys converted to a swizzled 16-bit tile (bf16, or f16 for e4m3: exact,
               and a native conversion on sm_90, where e4m3 -> bf16 goes through f32); one warpgroup MMA, keys
               [64, dI] x q^T [dI, Ip] -> f32 [64 keys, Ip heads] (q in the same 16-bit type); relu, times the
               head weights, summed over the heads (a row reduction), times the key scales (fp8); each
               score becomes the int32 key of `common.float_to_key` (its signed order is the float order),
               INT32_MIN past seq_len, written to keys[b, page * 64 : + 64].

The selection is `lax.top_k` over the int32 keys [B, Sp] (XLA's own GPU top-k: exact, the lower position
first among equal keys, which is the reference's rule), -1 where the position is past seq_len. Pallas'
Mosaic GPU backend has no gather, scatter, sort or prefix scan at vector indices, so the Triton kernel's
radix selection and compaction cannot be written there; XLA's top-k keeps this path free of the deprecated
Triton backend.

Numerics: 16-bit MMA operands with f32 accumulation. Every product is exact: e4m3 q and keys are exact in f16
(the FP8 path), bf16 q and keys are bf16, and an f32 query is split into three bf16 parts whose sum it is exactly
(`query_terms`; three MMAs per page instead of one, the MMA is not what bounds this kernel). The sums run in
another order than the reference's, so a score may differ in its last bits, as the Triton kernel's f32 dots do.

With `layer=` the wrapper reads the store's stacked pool [L, P, 64, dI] in place: the block table is offset by
layer * P into the flattened [L * P] pages, whose rows are int32 TMA coordinates (L * P * 64 < 2^31, checked;
byte offsets are 64-bit).

Limits (ValueError): dI a multiple of 32 and at most 256, heads at most 256, page 64, bf16 or e4m3 keys.
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
from pallas_kernels.common import PAGE, float_to_key

INT_MIN = -(2**31)
HEADS = 64  # heads are padded to a multiple of this (the N of the MMA)
PAGES_PER_BLOCK = 8  # pages per CUDA block (q loaded once per block)
SWIZZLE = 64  # bytes; both MMA operands alike
MAX_DIM = 256  # a TMA copy moves at most 256 elements along a dimension; the MMA's N is at most 256


def _body(seq_ref, q_ref, w_ref, bt_ref, k_ref, *rest, ppb: int, fp8: bool, plgpu):
    # seq_ref [B] int32; q_ref [B, Ip, T * D] 16-bit; w_ref [B, Ip] f32; bt_ref [B, NB, ppb] int32 (pages per block);
    # k_ref [P * 64, D] keys (+ ks_ref [P, 64] f32 for e4m3); out_ref [B, Sp] int32; then the scratch
    if fp8:
        ks_ref, out_ref, scratch = rest
    else:
        ks_ref, (out_ref, scratch) = None, rest
    q_smem, w_smem, bt_smem, raw, raw_s, tile, q_bar, loaded = scratch
    cdt = tile.dtype  # the MMA operands' dtype: f16 for e4m3 keys (exact, and converted natively), else bf16
    b, j = lax.axis_index("b"), lax.axis_index("j")
    seq = seq_ref[b]
    first = j * ppb  # this block's first page (of the row's block table)
    ip = q_ref.shape[1]
    nct = tile.shape[0]  # column tiles of a key tile
    terms = q_smem.shape[0] // nct  # q as a sum of `terms` 16-bit parts (3 for f32 queries, else 1)

    plgpu.copy_gmem_to_smem(bt_ref.at[b, j], bt_smem, q_bar)
    for c in range(terms * nct):
        plgpu.copy_gmem_to_smem(q_ref.at[b, :, pl.ds(c * 32, 32)], q_smem.at[c], q_bar)
    plgpu.copy_gmem_to_smem(w_ref.at[b], w_smem, q_bar)
    plgpu.barrier_wait(q_bar)

    def live(i):  # page i of the block holds a position < seq_len
        return (first + i) * PAGE < seq

    def issue(i):  # the keys (and fp8 scales) of page i into buffer i % 2
        slot = lax.rem(i, 2)
        pg = jnp.maximum(bt_smem[i], 0)
        plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(pg * PAGE, PAGE)], raw.at[slot], loaded.at[slot])
        if fp8:
            plgpu.copy_gmem_to_smem(ks_ref.at[pg], raw_s.at[slot], loaded.at[slot])

    pl.when(live(0))(lambda: issue(0))
    rows = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector over the keys (MMA rows)
    cols = plgpu.Layout.WGMMA.reduce(0)  # a [Ip] vector over the heads (MMA columns)
    w = plgpu.load(w_smem, layout=cols, optimized=False)
    copy_layout = plgpu.Layout.SMEM_GMEM_COPY((PAGE, 32), cdt, SWIZZLE)

    def page(i, carry):
        slot = lax.rem(i, 2)
        pos = (first + i) * PAGE + plgpu.broadcasted_iota(jnp.int32, (PAGE,), 0, layout=rows)

        @pl.when(live(i))
        def _compute():
            plgpu.barrier_wait(loaded.at[slot])
            for c in range(nct):  # keys -> swizzled 16-bit tile, per 32-column tile
                tile[c] = plgpu.load(raw.at[slot, :, pl.ds(c * 32, 32)], layout=copy_layout,
                                     optimized=False).astype(cdt)
            plgpu.commit_smem()
            scale = plgpu.load(raw_s.at[slot], layout=rows, optimized=False) if fp8 else None

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
            if fp8:
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
    f32[P, 64] for e4m3)."""
    plgpu = mosaic_gpu()
    B, ip, TD = q.shape
    D = k_pages.shape[2]
    P = k_pages.shape[0]
    mp = bt.shape[1]
    ppb = PAGES_PER_BLOCK
    nb = mp // ppb
    fp8 = k_scale is not None
    swz = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    scratch = [
        plgpu.SMEM((TD // 32, ip, 32), q.dtype, transforms=swz),  # q's terms, per 32-column tile
        plgpu.SMEM((ip,), jnp.float32),  # head weights
        plgpu.SMEM((ppb,), jnp.int32),  # this block's pages
        plgpu.SMEM((2, PAGE, D), k_pages.dtype),  # raw keys, two buffers
        plgpu.SMEM((2, PAGE), jnp.float32),  # raw fp8 scales (unused for bf16 keys)
        plgpu.SMEM((D // 32, PAGE, 32), q.dtype, transforms=swz),  # keys as a swizzled 16-bit tile
        plgpu.Barrier(num_arrivals=2 + TD // 32),  # block table slice, q tiles, w
        plgpu.Barrier(num_arrivals=1 + fp8, num_barriers=2),  # page copies, one per buffer
    ]
    body = functools.partial(_body, ppb=ppb, fp8=fp8, plgpu=plgpu)
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((B, mp * PAGE), jnp.int32), scratch_types=[scratch],
                          grid=(B, nb), grid_names=("b", "j"))
    args = [seq, q, w, bt.reshape(B, nb, ppb), k_pages.reshape(P * PAGE, D)] + ([k_scale] if fp8 else [])
    if interpret:
        with plgpu.force_gpu_interpret_mode():
            return kernel(*args)
    return kernel(*args)


def operand_dtype(key_dtype):
    """The MMA operands' dtype for keys of `key_dtype`: float16 for e4m3 (exact; sm_90 converts e4m3 to f16, not
    to bf16, natively), else bfloat16."""
    return jnp.float16 if jnp.dtype(key_dtype) == jnp.float8_e4m3fn else jnp.bfloat16


def query_terms(q, key_dtype):
    """q [B, Ip, dI] -> [B, Ip, T * dI] in `operand_dtype(key_dtype)`: T 16-bit parts, concatenated along dI, whose
    sum is q exactly. float32 q with bf16 keys: 3 bf16 parts (8 mantissa bits each), so every product with a
    bf16 key is exact in the f32 accumulator, as in the reference's f32 dots (only the summation order differs);
    16-bit q (and the e4m3 values of the FP8 path): itself."""
    dt = operand_dtype(key_dtype)
    if q.dtype != jnp.float32:
        return q.astype(dt)
    parts, rest = [], q
    for _ in range(3):
        part = rest.astype(dt)
        parts.append(part)
        rest = rest - part.astype(jnp.float32)
    return jnp.concatenate(parts, axis=-1)


def check_mosaic_shapes(q, k_pages, k_scale):
    """ValueError naming the limit, for shapes the Mosaic scores kernel cannot take."""
    B, I, D = q.shape
    if k_pages.shape[1] != PAGE:
        raise ValueError(f"the Mosaic indexer kernel reads pages of {PAGE} keys, got {k_pages.shape[1]}")
    if D % 32 or D > MAX_DIM:
        raise ValueError(f"the Mosaic indexer kernel needs dI a multiple of 32 and <= {MAX_DIM}, got {D}")
    if -(-I // HEADS) * HEADS > MAX_DIM:
        raise ValueError(f"the Mosaic indexer kernel takes at most {MAX_DIM} heads, got {I}")
    if k_pages.dtype not in (jnp.bfloat16, jnp.float8_e4m3fn):
        raise ValueError(f"the Mosaic indexer kernel reads bfloat16 or float8_e4m3fn keys, got {k_pages.dtype}")


def topk_from_keys(keys, seq, topk: int):
    """The first `topk` positions of int32 keys [B, Sp] by (key desc, position asc), -1 at or past seq_len."""
    B, Sp = keys.shape
    if Sp < topk:
        keys = jnp.pad(keys, ((0, 0), (0, topk - Sp)), constant_values=INT_MIN)
    _, pos = lax.top_k(keys, topk)
    return jnp.where(pos < seq[:, None], pos, -1).astype(jnp.int32)
