"""Sparse absorbed-MLA decode reading rows straight from the paged pools: Pallas, Mosaic GPU backend (sm_90).

Same signature and math as `reference.sparse_mla_decode_reference`. One CUDA block per (sequence, block of
64 heads, split of the top-k), two warpgroups (`wg` 0 and 1), each owning half of the 512 latent columns.
Neighbouring head blocks of one sequence and split form a cluster of 2 (`head_cluster`: H = 128 is one
cluster) that reads every selected row's latent from HBM once: each latent copy is issued by both blocks as one
multicast TMA copy (each block fetches half of the row and both receive all of it). The rope, the fp8 scales and
the addresses are copied by each block: a block's half of them would land off TMA's 128-byte shared-memory
alignment (`TMA_ALIGN`).

    start      WG 0 copies the block's 64 query heads (latent per 128-column chunk, rope per 32-column
               chunk) and the split's row addresses to shared memory, then issues the first
               row block's copies.
    per block of BK = 32 rows (by its address, one TMA copy per row of the latent, multicast, and of the rope;
    fp8: one copy of the row's C / 128 scales into a 128-byte row of its own, 16 bytes; an invalid slot's address
    is one past the pool, so TMA fills that row with zeros and reads nothing):
      convert  each WG moves its columns of the raw rows into swizzled bf16 tiles, one per 128-column
               chunk (fp8: times the row's scale of that chunk); WG 0 also the rope part. Both WGs of
               every block of the cluster arrive on `consumed` (a cluster barrier: the next copies land
               in all of them); WG 0 then issues the next block's row copies into the raw buffers (they
               overlap the math below).
      scores   s_w = q_w . c_w^T (+ q_rope . kR^T on WG 0): warpgroup MMA per chunk, bf16 operands,
               fp32 accumulator [64, BK]. The halves are swapped through shared memory (double-buffered
               by block parity, one `exchange` barrier per block) and summed: s = s_0 + s_1 on both WGs,
               the same bits (addition commutes), so both run the same online softmax.
      softmax  s = tau s, invalid slots -inf; running max m, sum l (fp32), p rounded to bf16.
      values   acc_w = alpha acc_w + p @ c_w: warpgroup MMA per 128-column chunk, fp32 [64, 256] per WG.
    end        each WG writes its accumulator half; WG 0 writes (m, l). More than one split: unnormalized,
               merged in jnp (`merge_splits`, log-sum-exp weights); one split: divided by l in the kernel,
               which is then the whole answer, written once in `out_dtype` (bf16: half the bytes, the
               rounding a bf16 model applies before W_UV anyway). The blocks of a cluster then meet at a
               cluster barrier, so none exits while its peer may still write into it.

So each selected row's latent is read once per 128 heads (per 64 when the head blocks do not pair up: H <= 64,
or an odd number of 64-head blocks), its rope and scales once per 64. Addresses are (row of the flattened [L * P * 64, *] pool) TMA
coordinates, so pools of any byte size are addressed with 64-bit offsets; the flattened row count (and
fp8 scale count) must stay below 2^31 (checked). A split holds at most MAX_STEPS row blocks (its
addresses live in shared memory); a long top-k gets more splits.

Shared memory at C = 512, R = 64 (bf16 pools): q 72 KB, raw rows 36 KB, bf16 tiles 36 KB, score exchange
32 KB, p 8 KB, addresses <= 16 KB, fp8 scales 4 KB (128-byte rows): <= 205 KB of the 227 KB. Every MMA operand is
64-byte swizzled (`SWIZZLE`): a warpgroup MMA needs both operands swizzled alike and p, [64, 32] bf16, has
64-byte rows.

Numerics: bf16 MMA operands with fp32 accumulation (q and, for p @ c, the probabilities rounded to bf16, as
FlashMLA does): ~1e-3 relative to the fp32 reference. Rows are exact (bf16 as stored; e4m3 times a
power-of-two scale is exact in bf16).

Interpret-mode constraints shape two choices: the value MMA reads p from shared memory (interpret mode's
wgmma takes no register operand) and accumulates into a fresh [64, 128] accumulator per column chunk that
is added to the rescaled running one (interpret mode cannot lower `pl.run_state` on a pre-initialized
accumulator), which also keeps the live registers per thread under the 255 limit. (Interpret mode runs a
cluster's blocks together with its cluster barriers, and a multicast copy as each block's own copy: the
same data in every block.) The sm_90 lowering shapes more: rows land in plain buffers (a TMA copy of one
row into a tiled buffer is refused) and are moved to the tiles through registers in the layout Mosaic uses
for swizzled copies; each 128-column latent chunk and 32-column rope chunk is its own tile (a column slice
of a swizzled tile is not contiguous; and a 64-column rope buffer is given one 128-byte swizzled tile per
row, which a multicast copy cannot split between two blocks); the fp8 scales of a row block are assembled
into per-chunk vectors from scalar loads (a strided column of a shared-memory buffer cannot be loaded as
a vector), and a row's scale copy moves at least SCALE_COPY values (TMA's 16-byte minimum; at C = 256 the
next row's two come along) and is not multicast (half of it would be under that minimum).

Status: equals the reference in GPU interpret mode with race detection (tests/e2e/test_kernel_mosaic.py) and
builds for sm_90 (tests/e2e/test_gpu_build.py: H = 128 / 16, bf16 / fp8, B = 1, top-k 16384, the stacked
78-layer fp8 pools with `layer=`). On an H200 (2026-12-04, experiments/results/gpu/) it was NOT correct: relative
error ~1 against the reference at H 16 and 128, bf16 and fp8 pools, and an illegal instruction with fp8 pools at
H 16 (the first run also faulted on misaligned TMA destinations, fixed since: `TMA_ALIGN`). The store refuses
kernels="pallas_mosaic" on a GPU until a GPU run shows it fixed.

Limits (ValueError): latent_pages bfloat16 or float8_e4m3fn and rope bfloat16; C a multiple of 256, R a
multiple of 64; out_dtype float32 or bfloat16. Needs jax >= 0.11 (NotImplementedError otherwise); on CPU it
runs in Mosaic GPU's interpret mode (`interpret=True`, or the caller's `plgpu.force_gpu_interpret_mode(...)`,
e.g. with race detection).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.backends import mosaic_gpu
from pallas_kernels.sparse_mla_decode.reference import FP8_BLOCK, check_out_dtype, checked_stacked_pools, merge_splits

HEADS = 64  # heads per CUDA block: the M of one warpgroup MMA
CHUNK = 128  # accumulator columns per value MMA
BLOCK_ROWS = 32  # rows per pipeline step (the N of the score MMA, the K of the value MMA)
TARGET_BLOCKS = 132  # one wave of ~200 KB-shared-memory blocks on a 132-SM H100 / H200
MAX_ROWS = 2**31 - 1  # TMA coordinates are int32
# row blocks per split: the split's addresses take MAX_STEPS * BLOCK_ROWS * 4 bytes of shared memory, and one TMA
# copy moves at most 256 elements along a dimension
MAX_STEPS = 128
# Every MMA operand's shared-memory swizzle, in bytes. A warpgroup MMA needs both operands swizzled alike, and p
# (the value MMA's A operand, [64, BLOCK_ROWS] bf16) has 64-byte rows.
SWIZZLE = 64
# rope columns per tile. A row's rope (R = 64 bf16) would be one tile of 128-byte swizzle, which a cluster's blocks
# cannot share a copy of (a multicast copy is split along a dimension above the swizzled one)
ROPE_CHUNK = SWIZZLE // 2
SCALE_COPY = 4  # f32 scales per row copy at least: a TMA copy moves at least 16 bytes
# A TMA copy's shared-memory destination must be 128-byte aligned (sm_90; interpret mode does not check it, an H200
# faults: CUDA_ERROR_MISALIGNED_ADDRESS / ILLEGAL_INSTRUCTION). So each row's fp8 scales land in a row of their own
# of TMA_ALIGN bytes, and the rope rows (R * 2 bytes) and the split's addresses are not multicast: a multicast copy
# gives each block of the cluster half of the slice, and half a rope row (64 bytes at R = 64) or of one row block's
# addresses (64 bytes) would land at an offset that is not aligned. `tma_destinations` lists every destination.
TMA_ALIGN = 128
MULTICAST = frozenset({"latent row"})  # the copies a cluster's blocks share (`tma_destinations`' names)


def _body(q_lat_ref, q_rope_ref, addr_ref, lat_ref, rope_ref, *rest, tau: float, steps: int, fp8: bool,
          nrows: int, final: bool, cluster: int, plgpu):
    # q_lat_ref [B, Hp, C], q_rope_ref [B, Hp, R] bf16; addr_ref [B, S, steps, BK] int32 (nrows = invalid);
    # lat_ref [nrows, C], rope_ref [nrows, R] (+ scale_ref [nrows * C / 128] f32 when fp8: the pool's scales, flat);
    # o_ref [S, B, Hp, C] (f32 unnormalized; normalized, in the output dtype, when `final`, S = 1), m_ref / l_ref
    # [S, B, Hp]; then the scratch. The grid is (B, Hp / 64 / cluster, S) clusters of `cluster` blocks ("c").
    if fp8:
        scale_ref, o_ref, m_ref, l_ref, scratch = rest
    else:
        scale_ref, (o_ref, m_ref, l_ref, scratch) = None, rest
    (q_smem, qr_smem, idx_smem, raw_c, raw_r, raw_s, tile_c, tile_r, s_x, p_smem,
     q_bar, idx_bar, loaded, consumed, exchange, *done) = scratch  # done: with a cluster only
    b, split = lax.axis_index("b"), lax.axis_index("s")
    hb = lax.axis_index("h") * cluster + lax.axis_index("c")  # this block's 64 heads
    # The blocks of a cluster (neighbouring head blocks of one sequence and split) read the same rows: each latent
    # copy is issued by all of them and multicast (each block fetches its share and every block receives the whole
    # row); the copies not in MULTICAST each block makes itself
    shared = "c" if cluster > 1 else None

    def multicast(name):  # the cluster axis for the copies in MULTICAST, else None (each block its own copy)
        return shared if name in MULTICAST else None
    wg = lax.axis_index("wg")
    bk = BLOCK_ROWS
    C = q_lat_ref.shape[-1]
    half = C // 2
    nrc = q_rope_ref.shape[-1] // ROPE_CHUNK  # rope column chunks, each its own tile (as the latent's)
    nch = half // CHUNK  # column chunks per warpgroup: q and the converted rows are kept per chunk (a column
    # slice of a swizzled tile is not contiguous, so each chunk is its own [.., 128] tile)
    heads = pl.ds(hb * HEADS, HEADS)

    def issue_rows(step):  # WG 0: one TMA copy per row and operand into the raw buffers
        def one(j, carry):
            r = idx_smem[step, j]
            zeros = plgpu.OOBFillMode.ZEROS
            plgpu.copy_gmem_to_smem(lat_ref.at[pl.ds(r, 1)], raw_c.at[pl.ds(j, 1)], loaded, oob_mode=zeros,
                                    collective_axes=multicast("latent row"))
            # the rope per block: half of a row (R bytes) would land at an unaligned offset (`TMA_ALIGN`)
            plgpu.copy_gmem_to_smem(rope_ref.at[pl.ds(r, 1)], raw_r.at[pl.ds(j, 1)], loaded, oob_mode=zeros,
                                    collective_axes=multicast("rope row"))
            if fp8:  # the row's C / 128 scales (16 bytes at C = 512; at least 16, a TMA copy's minimum, so
                # at smaller C the next row's come along) into row j of its own (aligned); per block
                w = scale_copy(C)
                plgpu.copy_gmem_to_smem(scale_ref.at[pl.ds(r * (C // FP8_BLOCK), w)], raw_s.at[j, pl.ds(0, w)],
                                        loaded, oob_mode=zeros)
            return carry
        lax.fori_loop(0, bk, one, 0)

    @pl.when(wg == 0)
    def _start():
        plgpu.copy_gmem_to_smem(addr_ref.at[b, split], idx_smem, idx_bar, collective_axes=multicast("addresses"))
        for g in range(2 * nch):
            plgpu.copy_gmem_to_smem(q_lat_ref.at[b, heads, pl.ds(g * CHUNK, CHUNK)], q_smem.at[g], q_bar)
        for g in range(nrc):
            plgpu.copy_gmem_to_smem(q_rope_ref.at[b, heads, pl.ds(g * ROPE_CHUNK, ROPE_CHUNK)], qr_smem.at[g], q_bar)
        plgpu.barrier_wait(idx_bar)
        issue_rows(0)

    def run(w: int):  # the whole main loop of warpgroup w (static column half)
        if w == 1:
            plgpu.barrier_wait(idx_bar)
        plgpu.barrier_wait(q_bar)

        def copy_layout(cols):  # registers that store efficiently into a swizzled bf16 [bk, cols] tile
            return plgpu.Layout.SMEM_GMEM_COPY((bk, cols), jnp.bfloat16, SWIZZLE)

        def row_scales(g):  # [bk] f32: column g of the rows' scales [bk, w] (a strided column of a shared-memory
            # buffer cannot be loaded as a vector: assembled from scalar loads instead)
            rows = plgpu.broadcasted_iota(jnp.int32, (bk,), 0, layout=copy_layout(CHUNK).reduce(1))
            sc = jnp.zeros((bk,), jnp.float32)
            for j in range(bk):
                sc = jnp.where(rows == j, raw_s[j, g], sc)
            return sc

        def convert():
            for g in range(w * nch, (w + 1) * nch):
                c = plgpu.load(raw_c.at[:, pl.ds(g * CHUNK, CHUNK)], layout=copy_layout(CHUNK), optimized=False)
                if fp8:  # times the row's scale of this 128-column block (exact in bf16: power-of-two scales)
                    sc = lax.broadcast_in_dim(row_scales(g), (bk, CHUNK), [0])
                    c = (c.astype(jnp.float32) * sc).astype(jnp.bfloat16)
                tile_c[g] = c
            if w == 0:
                for g in range(nrc):
                    tile_r[g] = plgpu.load(raw_r.at[:, pl.ds(g * ROPE_CHUNK, ROPE_CHUNK)],
                                           layout=copy_layout(ROPE_CHUNK), optimized=False)
            plgpu.commit_smem()

        def scores():
            def mma(acc_ref):
                for g in range(w * nch, (w + 1) * nch):
                    plgpu.wgmma(acc_ref, q_smem.at[g], tile_c.at[g].T)
                if w == 0:
                    for g in range(nrc):
                        plgpu.wgmma(acc_ref, qr_smem.at[g], tile_r.at[g].T)
                return acc_ref[...]
            return pl.run_scoped(mma, plgpu.ACC((HEADS, bk), jnp.float32))

        def step(i, carry):
            acc, m_prev, l_prev = carry
            plgpu.barrier_wait(loaded)
            convert()

            @pl.when(i + 1 < steps)
            def _release():  # both WGs of every block of the cluster have converted block i
                plgpu.barrier_arrive(consumed)

            @pl.when(jnp.logical_and(wg == 0, i + 1 < steps))
            def _next():
                plgpu.barrier_wait(consumed)
                issue_rows(i + 1)

            s_mine = scores()
            parity = lax.rem(i, 2)
            s_x[parity, w] = s_mine
            plgpu.commit_smem()
            plgpu.barrier_arrive(exchange)
            plgpu.barrier_wait(exchange)
            s = s_mine + plgpu.load(s_x.at[parity, 1 - w], layout=plgpu.Layout.WGMMA, optimized=False)
            addr = plgpu.load(idx_smem.at[i], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
            ok = lax.broadcast_in_dim(addr < nrows, (HEADS, bk), [1])
            s = jnp.where(ok, s * tau, -jnp.inf)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            alpha = jnp.exp(m_prev - m_safe)
            p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            l_next = alpha * l_prev + jnp.sum(p, axis=1)
            p_smem[w] = p.astype(jnp.bfloat16)  # the value MMA's A operand from shared memory
            plgpu.commit_smem()

            def pv(j):  # p @ c_w[:, chunk j] into a fresh accumulator (no pre-initialized one: see below)
                def mma(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem.at[w], tile_c.at[w * nch + j])
                    return acc_ref[...]
                return pl.run_scoped(mma, plgpu.ACC((HEADS, CHUNK), jnp.float32))
            acc = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [0]) + pv(j) for j, a in enumerate(acc))
            return acc, m_next, l_next

        acc0 = tuple(plgpu.layout_cast(jnp.zeros((HEADS, CHUNK), jnp.float32), plgpu.Layout.WGMMA)
                     for _ in range(nch))
        m0 = plgpu.layout_cast(jnp.full((HEADS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l0 = plgpu.layout_cast(jnp.zeros((HEADS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc, m, l = lax.fori_loop(0, steps, step, (acc0, m0, l0))
        if final:  # one split: the block's result is the answer, normalized here (no merge pass)
            inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
            acc = tuple(a * lax.broadcast_in_dim(inv, a.shape, [0]) for a in acc)
        for j, a in enumerate(acc):
            o_ref[split, b, heads, pl.ds(w * half + j * CHUNK, CHUNK)] = a.astype(o_ref.dtype)
        if w == 0:
            m_ref[split, b, heads] = m
            l_ref[split, b, heads] = l
        if cluster > 1:  # no block exits while a peer may still multicast into it or arrive on its barriers
            plgpu.barrier_arrive(done[0])
            plgpu.barrier_wait(done[0])

    for w in range(2):
        pl.when(wg == w)(functools.partial(run, w))


def scale_copy(latent_dim: int) -> int:
    """f32 scales one fp8 row copy moves: the row's C / 128, at least SCALE_COPY (TMA's 16-byte minimum)."""
    return max(latent_dim // FP8_BLOCK, SCALE_COPY)


def tma_destinations(latent_dim: int, rope_dim: int, fp8: bool, cluster: int, steps: int) -> dict[str, tuple]:
    """Every TMA copy of the kernel into shared memory, as name -> (bytes between consecutive destinations, bytes
    one block's share starts at within one): with a cluster, a multicast copy is split in `cluster` shares along
    its slice's leading divisible dimension. Each start (buffer bases are aligned) must be a multiple of
    TMA_ALIGN; tests/e2e/test_kernel_mosaic.py checks it for the shapes the kernel takes."""
    C, R = latent_dim, rope_dim
    # (bytes between destinations, bytes of the slice's leading divisible dimension's share when multicast): a row
    # slice [1, X] is split along X, one row block's addresses [steps, BK] along the steps when they divide
    copies = {"q latent chunk": (HEADS * CHUNK * 2, None), "q rope chunk": (HEADS * ROPE_CHUNK * 2, None),
              "addresses": (steps * BLOCK_ROWS * 4, BLOCK_ROWS * 4 * (steps // cluster) if steps % cluster == 0
                            else 4 * BLOCK_ROWS // cluster),
              "latent row": (C * (1 if fp8 else 2), C * (1 if fp8 else 2) // cluster),
              "rope row": (R * 2, R * 2 // cluster)}
    if fp8:
        copies["fp8 scales row"] = (_scale_row(C) * 4, None)
    return {name: (pitch, share if cluster > 1 and name in MULTICAST and share is not None else 0)
            for name, (pitch, share) in copies.items()}


def _scale_row(latent_dim: int) -> int:
    """f32 columns of a row of the scale buffer: scale_copy, rounded up to TMA_ALIGN bytes."""
    per = TMA_ALIGN // 4
    return -(-scale_copy(latent_dim) // per) * per


def head_cluster(hp: int) -> int:
    """CUDA blocks per cluster for Hp padded heads: 2 (neighbouring head blocks sharing every row copy) when the
    head blocks pair up, else 1."""
    return 2 if (hp // HEADS) % 2 == 0 else 1


def decode_grid(batch: int, heads: int, topk: int, splits: int | None = None) -> tuple[int, int, int]:
    """(padded heads Hp, splits S, row blocks per split) of a call; its CUDA blocks are (B, Hp / HEADS, S), launched
    as clusters of `head_cluster(Hp)` along the heads.

    `splits` None: TARGET_BLOCKS // (B * Hp / HEADS), at least 1 (one wave). Either way at least ceil(blocks / MAX_STEPS)
    (a split's addresses live in shared memory) and at most one split per row block."""
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    hp = -(-heads // HEADS) * HEADS
    blocks = -(-topk // BLOCK_ROWS)
    if splits is None:
        splits = max(1, TARGET_BLOCKS // (batch * (hp // HEADS)))  # no split when one wave is (nearly) full
    splits = min(blocks, max(splits, -(-blocks // MAX_STEPS)))
    return hp, splits, -(-blocks // splits)


@functools.partial(jax.jit, static_argnames=("tau", "interpret", "splits", "out_dtype", "cluster"))
def sparse_mla_decode_mosaic(q_lat, q_rope, latent_pages, rope_pages, page, row, valid, *, tau: float,
                             latent_scale=None, layer=None, interpret: bool = False, splits: int | None = None,
                             out_dtype=jnp.float32, cluster: int | None = None):
    """Mosaic GPU version of `sparse_mla_decode_reference`: same arguments, out_dtype[B, H, C].

    `splits` (static) is the number of split-K parts of the top-k; by default TARGET_BLOCKS // (B * Hp / 64)
    (one wave of ~TARGET_BLOCKS CUDA blocks; none when B * Hp / 64 alone nearly fills it), see `decode_grid`.

    `cluster` (static): CUDA blocks per cluster, 1 or 2 (default `head_cluster`: 2 when the 64-head blocks pair
    up); 2 needs an even number of head blocks.

    `interpret=True` runs it on the CPU in Mosaic GPU's interpret mode (race detection is the caller's
    choice: wrap the call in `plgpu.force_gpu_interpret_mode(...)` instead to pass parameters). Interpreted, a
    cluster's 2 x `cluster` warpgroups run at once, each holding a thread of XLA:CPU's pool: a pool smaller
    than that hangs (set PJRT_NPROC=8 before jax starts, `hisparse_jax.cpu_pool`, or pass cluster=1)."""
    plgpu = mosaic_gpu()
    latent_pages, rope_pages, latent_scale, layer = checked_stacked_pools(
        q_lat, q_rope, latent_pages, rope_pages, latent_scale, layer, page, row, valid)
    B, H, C = q_lat.shape
    L, P = latent_pages.shape[:2]
    R, K = q_rope.shape[-1], page.shape[1]
    fp8 = latent_scale is not None
    if latent_pages.dtype not in (jnp.bfloat16, jnp.float8_e4m3fn) or rope_pages.dtype != jnp.bfloat16:
        raise ValueError(f"the Mosaic kernel reads bfloat16 or float8_e4m3fn latent pools and a bfloat16 rope pool, "
                         f"got {latent_pages.dtype} and {rope_pages.dtype}")
    if C % (2 * CHUNK) or R % 64:
        raise ValueError(f"the Mosaic kernel needs C a multiple of {2 * CHUNK} and R a multiple of 64 (got C={C}, R={R})")
    nrows = L * P * 64
    nblk = C // FP8_BLOCK
    if nrows > MAX_ROWS or (fp8 and nrows * nblk + SCALE_COPY > MAX_ROWS):
        raise ValueError(f"the flattened pool has {nrows} rows" + (f" ({nrows * nblk} fp8 scales)" if fp8 else "")
                         + "; TMA coordinates are int32 (< 2^31)")
    out_dtype = check_out_dtype(out_dtype)
    hp, splits, steps = decode_grid(B, H, K, splits)
    cluster = head_cluster(hp) if cluster is None else cluster
    if cluster not in (1, 2) or (hp // HEADS) % cluster:
        raise ValueError(f"cluster must be 1 or 2 and divide the {hp // HEADS} head blocks of {HEADS}, got {cluster}")
    bk = BLOCK_ROWS
    kp = splits * steps * bk

    pad_h = ((0, 0), (0, hp - H), (0, 0))
    q_lat = jnp.pad(q_lat.astype(jnp.bfloat16), pad_h)
    q_rope = jnp.pad(q_rope.astype(jnp.bfloat16), pad_h)
    flat = (jnp.asarray(layer, jnp.int32) * P + page.astype(jnp.int32)) * 64 + row.astype(jnp.int32)
    addr = jnp.where(valid, flat, nrows)
    addr = jnp.pad(addr, ((0, 0), (0, kp - K)), constant_values=nrows).reshape(B, splits, steps, bk)
    pools = [latent_pages.reshape(nrows, C), rope_pages.reshape(nrows, R)]
    if fp8:  # flat, so that a row's scales are one copy of SCALE_COPY (>= C / 128) values at row * C / 128
        pools.append(latent_scale.reshape(nrows * nblk))

    swz = lambda cols, itemsize: (plgpu.TilingTransform((8, SWIZZLE // itemsize)),  # noqa: E731
                                  plgpu.SwizzleTransform(SWIZZLE))
    scratch = [
        plgpu.SMEM((C // CHUNK, HEADS, CHUNK), jnp.bfloat16, transforms=swz(CHUNK, 2)),  # q latent, per chunk
        plgpu.SMEM((R // ROPE_CHUNK, HEADS, ROPE_CHUNK), jnp.bfloat16, transforms=swz(R, 2)),  # q rope, per chunk
        plgpu.SMEM((steps, bk), jnp.int32),  # this block's row addresses
        plgpu.SMEM((bk, C), latent_pages.dtype),  # raw rows, as copied
        plgpu.SMEM((bk, R), jnp.bfloat16),
        plgpu.SMEM((bk, _scale_row(C) if fp8 else 1), jnp.float32),  # fp8: each row's scales, rows aligned
        plgpu.SMEM((C // CHUNK, bk, CHUNK), jnp.bfloat16, transforms=swz(CHUNK, 2)),  # converted rows, per chunk
        plgpu.SMEM((R // ROPE_CHUNK, bk, ROPE_CHUNK), jnp.bfloat16, transforms=swz(R, 2)),
        plgpu.SMEM((2, 2, HEADS, bk), jnp.float32),  # partial scores [parity, wg]
        plgpu.SMEM((2, HEADS, bk), jnp.bfloat16, transforms=swz(bk, 2)),  # probabilities, one copy per WG
        plgpu.Barrier(num_arrivals=C // CHUNK + R // ROPE_CHUNK),  # q
        plgpu.Barrier(),  # addresses
        plgpu.Barrier(num_arrivals=(2 + fp8) * bk),  # one arrival per row copy
        # raw rows converted by both WGs (of every block of the cluster: the next rows land in all of them)
        plgpu.ClusterBarrier(collective_axes=("c",), num_arrivals=2) if cluster > 1 else plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=2),  # partial scores written by both WGs
    ]
    if cluster > 1:  # the cluster's blocks all done
        scratch.append(plgpu.ClusterBarrier(collective_axes=("c",), num_arrivals=2))
    out_type = (jax.ShapeDtypeStruct((splits, B, hp, C), out_dtype if splits == 1 else jnp.float32),
                jax.ShapeDtypeStruct((splits, B, hp), jnp.float32),
                jax.ShapeDtypeStruct((splits, B, hp), jnp.float32))
    body = functools.partial(_body, tau=float(tau), steps=steps, fp8=fp8, nrows=nrows, final=splits == 1,
                             cluster=cluster, plgpu=plgpu)
    kernel = plgpu.kernel(body, out_type=out_type, scratch_types=[scratch],
                          grid=(B, hp // HEADS // cluster, splits), grid_names=("b", "h", "s"),
                          cluster=(cluster,), cluster_names=("c",), num_threads=2, thread_name="wg")
    call = lambda: kernel(q_lat, q_rope, addr, *pools)  # noqa: E731
    if interpret:
        with plgpu.force_gpu_interpret_mode():
            o, m, l = call()
    else:
        o, m, l = call()
    return (o[0] if splits == 1 else merge_splits(o, m, l).astype(out_dtype))[:, :H]
