"""Sparse absorbed-MLA decode reading rows straight from the paged pools: Pallas, Triton backend.

Same signature as `reference.sparse_mla_decode_reference` (read it for the math). FlashMLA-sparse style:
the K selected rows are gathered block by block from the pools by address inside the kernel, so the
gathered [B, K, 576] rows never go to memory.

Grid (B, ceil(H / BH), S) (`decode_blocks`): one program per sequence, block of BH heads (64 from H = 64 on: at
H = 128 every selected row is read, and an fp8 row converted, by two programs; FlashMLA's cluster of two CTAs reads
it once, Triton has no clusters) and split s of the K rows (split-K only while B x head blocks < MIN_PROGRAMS: the
f32 partials of a split cost [B, H, C] x 8 bytes of traffic, more than a row block at H = 128). A program walks
its K / S rows in blocks of BK:

    addresses  page / row [BK] (page -1 marks an invalid slot: its loads are masked, never read)
    q          its heads' q_lat / q_rope, gathered from the unpadded [B, H, *] arrays (heads >= H masked)
    rows       latent [BK, C] in chunks of CC = min(C, 128) columns (fp8: read as uint32 words of four,
               split into four e4m3 planes of CC / 4 columns (`common.e4m3_planes`: the GPU's e4m3
               conversion, not a bit decode), times the chunk's scale; plane m of a chunk holds
               columns c0 + 4 j + m, so its q columns are gathered with stride 4 and its output columns
               scattered back the same way: nothing is permuted outside the kernel),
               rope [BK, R], gathered with one (page, row, column) index per element
    scores     s [BH, BK] = tau (q_lat . c + q_rope . kR), fp32 accumulation; invalid -> -inf
    softmax    online (running max m, sum l, an fp32 accumulator [BH, C] kept as C / CC (bf16) or
               4 C / CC (fp8) column parts: at BH 64 it is 128 KB, spread over 8 warps' registers)

With one split the program normalizes and writes the answer [B, H, C] in out_dtype itself; with S > 1 it
writes its unnormalized accumulator with (m, l) and the splits are merged in jnp (log-sum-exp weights).
The pools may be the store's stacked [L, P, 64, *] arrays with a (traced) `layer`, read in place.

Numerics: the matrix products run in q_lat's dtype (q_rope is cast to it). float32 q (what the model
passes today) -> IEEE fp32 products (precision HIGHEST; ~1e-6 relative to the reference, but CUDA-core
speed on a GPU); bfloat16 q -> bf16 tensor-core products with the probabilities rounded to bf16 for p @ c,
as FlashMLA does (~1e-3 relative in the tests). Rows are converted exactly (bf16 -> f32; e4m3 times a
power-of-two scale -> bf16 or f32). BK 32, CC 128 and the warp counts are untuned.

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
from pallas_kernels.common import FP8_PER_WORD, check_triton_offsets, e4m3_planes, fp8_words
from pallas_kernels.sparse_mla_decode.reference import FP8_BLOCK, check_out_dtype, checked_stacked_pools, merge_splits

HEAD_BLOCK = 64  # the most heads a program covers (its accumulator [64, C] f32 is 128 KB at C = 512)
ROW_BLOCK = 32  # BK: selected rows per step
MIN_PROGRAMS = 64  # split K until B x head blocks reaches this (half of an H100 / H200's 132 SMs)


def decode_blocks(batch: int, heads: int, latent_dim: int, topk: int) -> dict:
    """The kernel's block sizes and split count: bh heads per program (the next power of two >= H, at least 16,
    at most HEAD_BLOCK), bk rows per step, cc latent columns per chunk, `splits` S of `steps` row blocks each
    (Kp = S x steps x bk addresses, padded with invalid ones), grid (B, ceil(H / bh), S), `warps` per program."""
    bh = min(HEAD_BLOCK, max(16, pl.next_power_of_2(heads)))
    hblocks = pl.cdiv(heads, bh)
    blocks = pl.cdiv(topk, ROW_BLOCK)
    splits = max(1, min(blocks, pl.next_power_of_2(pl.cdiv(MIN_PROGRAMS, batch * hblocks))))
    steps = pl.cdiv(blocks, splits)
    return {"bh": bh, "bk": ROW_BLOCK, "cc": min(latent_dim, 128), "hblocks": hblocks, "splits": splits,
            "steps": steps, "kp": splits * steps * ROW_BLOCK, "grid": (batch, hblocks, splits),
            "warps": 8 if bh == HEAD_BLOCK else 4}


def _kernel(layer_ref, q_lat_ref, q_rope_ref, page_ref, row_ref, lat_ref, rope_ref, *rest,
            tau: float, bh: int, bk: int, cc: int, steps: int, fp8: bool, partials: bool):
    # layer_ref [1], q_lat_ref [B, H, C], q_rope_ref [B, H, R], page_ref / row_ref [Kp] (page -1 = invalid)
    # lat_ref [L, P, 64, C] (fp8: uint32 words [L, P, 64, C / 4]), rope_ref [L, P, 64, R],
    # (scale_ref [L, P, 64, C / 128] when fp8)
    # partials: o_ref [S, B, H, C] f32 (unnormalized), m_ref / l_ref [S, B, H]; else o_ref [B, H, C] (the answer)
    scale_ref, outs = (rest[0], rest[1:]) if fp8 else (None, rest)
    b, split = pl.program_id(0), pl.program_id(2)
    layer = layer_ref[0]
    H, C = q_lat_ref.shape[1:]
    R = q_rope_ref.shape[2]
    mma = q_lat_ref.dtype
    prec = lax.Precision.HIGHEST if mma == jnp.float32 else None
    # heads past H (the last block's padding) are never read or written: their loads read head 0 masked, their
    # stores address row H, past the end (interpret mode drops such a scatter; a duplicate index would not be)
    out_heads = pl.program_id(1) * bh + lax.broadcasted_iota(jnp.int32, (bh, 1), 0)  # [BH, 1]
    live = out_heads < H
    heads = jnp.where(live, out_heads, 0)
    # fp8: each chunk's latent comes as FP8_PER_WORD planes of CC / 4 columns (`common.e4m3_planes`); plane m of
    # the chunk at c0 holds columns c0 + 4 j + m. parts[i]: the latent / output columns of accumulator part i
    part = cc // FP8_PER_WORD if fp8 else cc
    step = FP8_PER_WORD if fp8 else 1
    parts = [c0 + k + step * lax.broadcasted_iota(jnp.int32, (1, part), 1)
             for c0 in range(0, C, cc) for k in range(cc // part)]

    def head_cols(ref, cols, dtype=None):  # [BH, W] of q at this program's heads and columns `cols` [1, W]
        shape = (bh, cols.shape[1])
        v = plgpu.load(ref.at[b, jnp.broadcast_to(heads, shape), jnp.broadcast_to(cols, shape)],
                       mask=jnp.broadcast_to(live, shape), other=jnp.zeros((), ref.dtype))
        return v if dtype is None else v.astype(dtype)

    q_c = [head_cols(q_lat_ref, cols) for cols in parts]
    q_r = head_cols(q_rope_ref, lax.broadcasted_iota(jnp.int32, (1, R), 1), mma)  # [BH, R]

    def dot_t(a, b_):  # a [M, D] . b [N, D]^T -> f32 [M, N]
        return lax.dot_general(a, b_, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)

    def dot(a, b_):  # a [M, N] @ b [N, D] -> f32 [M, D]
        return lax.dot_general(a, b_, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)

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
        rows = []  # [BK, part] each, in parts' order
        for c0 in range(0, C, cc):
            if fp8:  # the chunk's uint32 words [BK, CC / 4], times the chunk's scale, as 4 planes
                shape = (bk, part)
                w = plgpu.load(lat_ref.at[layer, jnp.broadcast_to(pg, shape), jnp.broadcast_to(rw, shape),
                                          cols(part, c0 // FP8_PER_WORD)],
                               mask=jnp.broadcast_to(ok2, shape), other=jnp.zeros((), lat_ref.dtype))
                blk = jnp.full((bk,), c0 // FP8_BLOCK, jnp.int32)
                sc = plgpu.load(scale_ref.at[layer, pg[:, 0], rw[:, 0], blk], mask=ok, other=0.0)  # [BK]
                rows += [(c.astype(jnp.float32) * sc[:, None]).astype(mma) for c in e4m3_planes(w)]
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
    if partials:
        o_ref, m_ref, l_ref = outs
        lead = (split, b)
        plgpu.store(m_ref.at[split, b, out_heads[:, 0]], m, mask=live[:, 0])
        plgpu.store(l_ref.at[split, b, out_heads[:, 0]], l, mask=live[:, 0])
    else:  # the only split: normalize here (a sequence without a valid row keeps its zeros)
        (o_ref,) = outs
        lead = (b,)
        denom = jnp.where(l > 0, l, 1.0)[:, None]
        acc = tuple(a / denom for a in acc)  # divided, as `merge_splits` does with several splits
    for a, cols_ in zip(acc, parts):
        shape = a.shape
        plgpu.store(o_ref.at[(*lead, jnp.broadcast_to(out_heads, shape), jnp.broadcast_to(cols_, shape))],
                    a.astype(o_ref.dtype), mask=jnp.broadcast_to(live, shape))


def _is_pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def sparse_mla_decode(q_lat, q_rope, latent_pages, rope_pages, page, row, valid, *, tau: float,
                      latent_scale=None, layer=None, interpret: bool = False, backend: str = "triton",
                      out_dtype=jnp.float32):
    """Pallas version of `sparse_mla_decode_reference`: same arguments, out_dtype[B, H, C] (float32 or bfloat16;
    both kernels write bf16 themselves where they normalize in the kernel: half the output bytes).

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
    blk = decode_blocks(B, H, C, K)
    bh, bk, cc, S, steps, kp = (blk[k] for k in ("bh", "bk", "cc", "splits", "steps", "kp"))
    addr = jnp.pad(jnp.where(valid, page, -1).astype(jnp.int32), ((0, 0), (0, kp - K)), constant_values=-1)
    row = jnp.pad(row.astype(jnp.int32), ((0, 0), (0, kp - K)))
    fp8 = latent_scale is not None

    def whole(x):
        return pl.BlockSpec(x.shape, lambda b, h, s: (0,) * x.ndim)

    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    if fp8:  # read as uint32 words, so Pallas-Triton's 32-bit offsets never pass 2^31 (`common.fp8_words`)
        latent_pages = fp8_words(latent_pages)
    pools = [latent_pages, rope_pages] + ([latent_scale] if fp8 else [])
    for name, pool in zip(("latent_pages", "rope_pages", "latent_scale"), pools):
        check_triton_offsets(name, pool)
    if S == 1:
        out_shape = [jax.ShapeDtypeStruct((B, H, C), out_dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((S, B, H, C), jnp.float32), jax.ShapeDtypeStruct((S, B, H), jnp.float32),
                     jax.ShapeDtypeStruct((S, B, H), jnp.float32)]
    in_specs = [whole(layer), whole(q_lat), whole(q_rope),
                pl.BlockSpec((None, kp), lambda b, h, s: (b, 0)),
                pl.BlockSpec((None, kp), lambda b, h, s: (b, 0))] + [whole(x) for x in pools]
    # two stages (row loads of step i + 1 in flight during step i's products) fit sm_90's 227 KB of shared memory
    # with bf16 operands at BH 64, not with float32 ones (237 KB with fp8 pools: the sm_90 build refuses it)
    stages = 2 if q_lat.dtype == jnp.bfloat16 else 1
    outs = pl.pallas_call(
        functools.partial(_kernel, tau=float(tau), bh=bh, bk=bk, cc=cc, steps=steps, fp8=fp8, partials=S > 1),
        grid=blk["grid"], in_specs=in_specs, out_specs=[whole(o) for o in out_shape], out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blk["warps"], num_stages=stages),
        interpret=interpret, name="sparse_mla_decode",
    )(layer, q_lat, q_rope, addr, row, *pools)
    if S == 1:
        return outs[0]
    return merge_splits(*outs).astype(out_dtype)
