"""Sparse absorbed-MLA decode reading rows straight from the paged pools: Pallas, Triton backend.

Same signature as `reference.sparse_mla_decode_reference` (read it for the math). FlashMLA-sparse style:
the K selected rows are gathered block by block from the pools by address inside the kernel, so the
gathered [B, K, 576] rows never go to memory.

Grid (B, H / BH, S): one program per sequence, block of BH heads and split s of the K rows (split-K
so that small batches still fill the GPU). A program walks its K / S rows in blocks of BK:

    addresses  page / row [BK] (page -1 marks an invalid slot: its loads are masked, never read)
    rows       latent [BK, C] in chunks of CC = min(C, 128) columns (fp8: read as uint32 words of four,
               decoded into four planes of CC / 4 columns, times the chunk's scale; q_lat and the output are
               permuted to that plane-major column order outside the kernel, `_plane_major`),
               rope [BK, R], gathered with one (page, row, column) index per element
    scores     s [BH, BK] = tau (q_lat . c + q_rope . kR), fp32 accumulation; invalid -> -inf
    softmax    online (running max m, sum l, rescaled fp32 accumulator [BH, C])

and writes its unnormalized accumulator with (m, l); the splits are merged in jnp (log-sum-exp weights).
The pools may be the store's stacked [L, P, 64, *] arrays with a (traced) `layer`, read in place.

Numerics: the matrix products run in q_lat's dtype (q_rope is cast to it). float32 q (what the model
passes today) -> IEEE fp32 products (precision HIGHEST; ~1e-6 relative to the reference, but CUDA-core
speed on a GPU); bfloat16 q -> bf16 tensor-core products with the probabilities rounded to bf16 for p @ c,
as FlashMLA does (~1e-3 relative in the tests). Rows are converted exactly (bf16 -> f32; e4m3 times a
power-of-two scale -> bf16 or f32). Block sizes (BH 16/32, BK 32, CC 128, 4/8 warps) are untuned.

Limits (ValueError): C and R powers of two >= 16 (Triton block sizes); fp8 needs C % 128 == 0;
q_lat float32 or bfloat16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.backends import check_pallas_backend
from pallas_kernels.common import FP8_PER_WORD, check_triton_offsets, fp8_words, word_planes
from pallas_kernels.sparse_mla_decode.reference import FP8_BLOCK, check_out_dtype, checked_stacked_pools, merge_splits

TARGET_PROGRAMS = 264  # ~2 waves of programs on a 132-SM H100 / H200


def _kernel(layer_ref, q_lat_ref, q_rope_ref, page_ref, row_ref, lat_ref, rope_ref, *rest,
            tau: float, bk: int, cc: int, steps: int, fp8: bool):
    # layer_ref [1], q_lat_ref [BH, C], q_rope_ref [BH, R], page_ref / row_ref [Kp] (page -1 = invalid)
    # lat_ref [L, P, 64, C] (fp8: uint32 words [L, P, 64, C / 4]), rope_ref [L, P, 64, R],
    # (scale_ref [L, P, 64, C / 128] when fp8)
    # o_ref [BH, C] (unnormalized), m_ref / l_ref [BH]
    if fp8:
        scale_ref, o_ref, m_ref, l_ref = rest
    else:
        scale_ref, (o_ref, m_ref, l_ref) = None, rest
    split = pl.program_id(2)
    layer = layer_ref[0]
    bh, C = q_lat_ref.shape
    R = q_rope_ref.shape[1]
    mma = q_lat_ref.dtype
    prec = lax.Precision.HIGHEST if mma == jnp.float32 else None
    chunks = range(0, C, cc)
    # fp8: each chunk's latent comes as FP8_PER_WORD planes of CC / 4 columns (`common.word_planes`), and q_lat's
    # chunk is permuted to match (plane-major, see `_plane_major`): one [BH, CC / 4] query part per plane
    part = cc // FP8_PER_WORD if fp8 else cc
    q_c = [q_lat_ref[:, pl.ds(c0 + k * part, part)] for c0 in chunks for k in range(cc // part)]
    q_r = q_rope_ref[...].astype(mma)  # [BH, R]

    def dot_t(a, b):  # a [M, D] . b [N, D]^T -> f32 [M, N]
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)

    def dot(a, b):  # a [M, N] @ b [N, D] -> f32 [M, D]
        return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)

    def cols(width, start=0):
        return lax.broadcasted_iota(jnp.int32, (bk, width), 1) + start

    def body(i, carry):
        acc, m_prev, l_prev = carry
        k0 = (split * steps + i) * bk
        pg = page_ref[pl.ds(k0, bk)]  # [BK]
        ok = pg >= 0
        pg = jnp.where(ok, pg, 0)[:, None]
        rw = jnp.where(ok, row_ref[pl.ds(k0, bk)], 0)[:, None]
        ok2 = ok[:, None]
        k_r = plgpu.load(rope_ref.at[layer, jnp.broadcast_to(pg, (bk, R)), jnp.broadcast_to(rw, (bk, R)), cols(R)],
                         mask=jnp.broadcast_to(ok2, (bk, R)), other=jnp.zeros((), rope_ref.dtype))  # [BK, R]
        s = dot_t(q_r, k_r.astype(mma))  # [BH, BK]
        rows = []  # [BK, part] each, in q_c's order
        for c0 in chunks:
            if fp8:  # the chunk's uint32 words [BK, CC / 4], times the chunk's scale, as 4 planes
                shape = (bk, part)
                w = plgpu.load(lat_ref.at[layer, jnp.broadcast_to(pg, shape), jnp.broadcast_to(rw, shape),
                                          cols(part, c0 // FP8_PER_WORD)],
                               mask=jnp.broadcast_to(ok2, shape), other=jnp.zeros((), lat_ref.dtype))
                blk = jnp.full((bk,), c0 // FP8_BLOCK, jnp.int32)
                sc = plgpu.load(scale_ref.at[layer, pg[:, 0], rw[:, 0], blk], mask=ok, other=0.0)  # [BK]
                rows += [(c * sc[:, None]).astype(mma) for c in word_planes(w)]
            else:
                shape = (bk, cc)
                c = plgpu.load(lat_ref.at[layer, jnp.broadcast_to(pg, shape), jnp.broadcast_to(rw, shape),
                                          cols(cc, c0)],
                               mask=jnp.broadcast_to(ok2, shape), other=jnp.zeros((), lat_ref.dtype))  # [BK, CC]
                rows.append(c.astype(mma))
        for q, c in zip(q_c, rows):
            s = s + dot_t(q, c)
        s = jnp.where(ok[None, :], s * tau, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))  # [BH]
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # all -inf so far: keep exp() finite
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe[:, None])  # [BH, BK]
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        acc = tuple(alpha[:, None] * a + dot(p.astype(mma), c) for a, c in zip(acc, rows))
        return acc, m_next, l_next

    acc0 = tuple(jnp.zeros((bh, part), jnp.float32) for _ in q_c)
    init = (acc0, jnp.full((bh,), -jnp.inf, jnp.float32), jnp.zeros((bh,), jnp.float32))
    acc, m, l = lax.fori_loop(0, steps, body, init)
    for k, a in enumerate(acc):
        o_ref[:, pl.ds(k * part, part)] = a
    m_ref[...] = m
    l_ref[...] = l


def _is_pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def sparse_mla_decode(q_lat, q_rope, latent_pages, rope_pages, page, row, valid, *, tau: float,
                      latent_scale=None, layer=None, interpret: bool = False, backend: str = "triton",
                      out_dtype=jnp.float32):
    """Pallas version of `sparse_mla_decode_reference`: same arguments, out_dtype[B, H, C] (float32 or bfloat16:
    the Mosaic kernel writes bf16 itself, half the output bytes; the Triton one rounds its f32 result).

    With `layer` (int or int32 scalar) the pools are the store's [L, P, 64, *] arrays and layer `layer`
    is read in place (no per-layer slice copy before the custom call). `backend` picks the Pallas GPU
    backend: "triton" (this module; every supported jax) or "mosaic" (`kernel_mosaic`: warpgroup MMA on
    bf16 operands, TMA row copies; jax >= 0.11, bf16 / fp8 pools).
    """
    if check_pallas_backend(backend) == "mosaic":
        from pallas_kernels.sparse_mla_decode.kernel_mosaic import sparse_mla_decode_mosaic
        return sparse_mla_decode_mosaic(q_lat, q_rope, latent_pages, rope_pages, page, row, valid, tau=tau,
                                        latent_scale=latent_scale, layer=layer, interpret=interpret,
                                        out_dtype=out_dtype)
    return _sparse_mla_decode_triton(q_lat, q_rope, latent_pages, rope_pages, page, row, valid, tau=tau,
                                     latent_scale=latent_scale, layer=layer, interpret=interpret,
                                     out_dtype=out_dtype)


@functools.partial(jax.jit, static_argnames=("tau", "interpret", "out_dtype"))
def _sparse_mla_decode_triton(q_lat, q_rope, latent_pages, rope_pages, page, row, valid, *, tau: float,
                              latent_scale=None, layer=None, interpret: bool = False, out_dtype=jnp.float32):
    out_dtype = check_out_dtype(out_dtype)
    latent_pages, rope_pages, latent_scale, layer = checked_stacked_pools(
        q_lat, q_rope, latent_pages, rope_pages, latent_scale, layer, page, row, valid)
    B, H, C = q_lat.shape
    R, K = q_rope.shape[-1], page.shape[1]
    if not (_is_pow2(C) and _is_pow2(R)):
        raise ValueError(f"the Triton kernel needs C and R powers of two >= 16 (got C={C}, R={R})")
    if q_lat.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q_lat must be float32 or bfloat16 (it sets the matmul precision), got {q_lat.dtype}")
    bh = 16 if H <= 16 else 32
    bk = 32
    cc = min(C, 128)
    hp = pl.cdiv(H, bh) * bh
    blocks = pl.cdiv(K, bk)
    splits = max(1, min(blocks, pl.next_power_of_2(pl.cdiv(TARGET_PROGRAMS, B * (hp // bh)))))
    steps = pl.cdiv(blocks, splits)
    kp = splits * steps * bk

    pad_h = ((0, 0), (0, hp - H), (0, 0))
    q_rope = jnp.pad(q_rope.astype(q_lat.dtype), pad_h)
    q_lat = jnp.pad(q_lat, pad_h)
    addr = jnp.pad(jnp.where(valid, page, -1).astype(jnp.int32), ((0, 0), (0, kp - K)), constant_values=-1)
    row = jnp.pad(row.astype(jnp.int32), ((0, 0), (0, kp - K)))
    fp8 = latent_scale is not None

    def whole(x):
        return pl.BlockSpec(x.shape, lambda b, h, s: (0,) * x.ndim)

    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    if fp8:  # read as uint32 words, so Pallas-Triton's 32-bit offsets never pass 2^31 (`common.fp8_words`)
        latent_pages, q_lat = fp8_words(latent_pages), _plane_major(q_lat, cc)
    pools = [latent_pages, rope_pages] + ([latent_scale] if fp8 else [])
    for name, pool in zip(("latent_pages", "rope_pages", "latent_scale"), pools):
        check_triton_offsets(name, pool)
    in_specs = [whole(layer),
                pl.BlockSpec((None, bh, C), lambda b, h, s: (b, h, 0)),
                pl.BlockSpec((None, bh, R), lambda b, h, s: (b, h, 0)),
                pl.BlockSpec((None, kp), lambda b, h, s: (b, 0)),
                pl.BlockSpec((None, kp), lambda b, h, s: (b, 0))] + [whole(x) for x in pools]
    out_specs = [pl.BlockSpec((None, None, bh, C), lambda b, h, s: (s, b, h, 0)),
                 pl.BlockSpec((None, None, bh), lambda b, h, s: (s, b, h)),
                 pl.BlockSpec((None, None, bh), lambda b, h, s: (s, b, h))]
    out_shape = [jax.ShapeDtypeStruct((splits, B, hp, C), jnp.float32),
                 jax.ShapeDtypeStruct((splits, B, hp), jnp.float32),
                 jax.ShapeDtypeStruct((splits, B, hp), jnp.float32)]
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, tau=float(tau), bk=bk, cc=cc, steps=steps, fp8=fp8),
        grid=(B, hp // bh, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4 if bh == 16 else 8, num_stages=2),
        interpret=interpret, name="sparse_mla_decode",
    )(layer, q_lat, q_rope, addr, row, *pools)

    out = merge_splits(o, m, l)[:, :H]
    return (_plane_major(out, cc, inverse=True) if fp8 else out).astype(out_dtype)


def _plane_major(x, cc: int, inverse: bool = False):
    """Columns [..., C] -> in each chunk of `cc`, the FP8_PER_WORD planes one after the other (column c0 + 4 j + m
    moves to c0 + m * cc / 4 + j), the order in which the fp8 kernel reads a chunk's words; `inverse` undoes it."""
    *lead, C = x.shape
    n = cc // FP8_PER_WORD
    shape = (C // cc, FP8_PER_WORD, n) if inverse else (C // cc, n, FP8_PER_WORD)
    return jnp.swapaxes(x.reshape(*lead, *shape), -1, -2).reshape(*lead, C)
