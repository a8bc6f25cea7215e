"""The spec of the lightning indexer's scores and top-k (plain jnp, HIGHEST precision); the model's indexer,
the store's paged selection and the Pallas kernel all compute these functions.

For a query token t and a cached key position s (one index set per layer and token, shared by all heads):

    I(t, s) = sum_h w[t, h] * relu(qI[t, h] . kI[s])        (float32 accumulation)

with `w` carrying the positive scale constants. Selection keeps min(topk, #keys) positions in descending
score order; the lower position wins a tie (`lax.top_k`'s rule); positions that are not valid come back -1.

Quantized keys (`index_dtype`): None scores the keys as they are. "fp8" emulates DeepSeek's inference path: q and
k are rotated by the Sylvester Hadamard matrix / sqrt(dI) and quantized to e4m3 with power-of-two scales per 128
values (`pallas_kernels.common.fp8_quantize`); the score multiplies q's scale inside the head sum and k's scale
after it. "int4" is MXFP4 as vLLM (#48558) and SGLang (#30546) store the keys: q and k Hadamard-rotated as for
FP8, then E2M1 values with one UE8M0 scale per 32 (`pallas_kernels.common.mxfp4_quantize`; 68 bytes per 128-value
key against FP8's 132); the dots are those of the dequantized values (exact products, float32 sums).

Shapes: B decode rows, T query tokens, I indexer heads, dI head dim, P pool pages of `page` (64) token rows,
MP pages per row in the block table, S key positions (MP * page when paged), K top-k slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import fp8_quantize, hadamard, mxfp4_dequantize, mxfp4_quantize

HIGHEST = jax.lax.Precision.HIGHEST
INDEX_DTYPES = (None, "fp8", "int4")  # how the keys are scored: as they are, or quantized (see the docstring)


def check_index_dtype(index_dtype):
    if index_dtype not in INDEX_DTYPES:
        raise ValueError(f"index_dtype must be one of {INDEX_DTYPES}, got {index_dtype!r}")
    return index_dtype


def index_scores(q, w, k, *, index_dtype=None):
    """q f32[..., T, I, dI], w f32[..., T, I], k [..., S, dI] -> f32[..., T, S] (unmasked), the keys scored as
    `index_dtype` stores them (None: as they are)."""
    if check_index_dtype(index_dtype) == "fp8":
        return index_scores_fp8(q, w, *quantize_index_keys(k))
    if index_dtype == "int4":
        return index_scores_int4(q, w, *quantize_index_keys_int4(k))
    dots = jnp.einsum("...tid,...sd->...tis", q, k.astype(jnp.float32), precision=HIGHEST)
    return jnp.einsum("...tis,...ti->...ts", jax.nn.relu(dots), w, precision=HIGHEST)


def quantize_index_keys(k):
    """Indexer keys as DeepSeek caches them: e4m3 of the Hadamard-rotated key + one fp32 scale per key.

    k [..., S, dI] -> (e4m3 [..., S, dI], f32 [..., S])."""
    return fp8_quantize(hadamard(k.astype(jnp.float32)), block=k.shape[-1])


def quantize_index_keys_int4(k):
    """Indexer keys as MXFP4 (vLLM / SGLang's 4-bit indexer cache): E2M1 codes of the Hadamard-rotated key, two per
    byte, and one UE8M0 scale per 32 values. k [..., S, dI] -> (uint8 [..., S, dI / 2], uint8 [..., S, dI / 32])."""
    return mxfp4_quantize(hadamard(k.astype(jnp.float32)))


def index_scores_int4(q, w, k_codes, k_scales):
    """MXFP4 emulation with pre-quantized keys: the query Hadamard-rotated and MXFP4-quantized per head as the keys
    are (vLLM #48558 quantizes the indexer query too), the dots those of the dequantized values (float32).
    q f32[..., T, I, dI], w f32[..., T, I], k_codes uint8[..., S, dI / 2], k_scales uint8[..., S, dI / 32]
    -> f32[..., T, S]."""
    qd = mxfp4_dequantize(*mxfp4_quantize(hadamard(q.astype(jnp.float32))))
    kd = mxfp4_dequantize(k_codes, k_scales)
    dots = jnp.einsum("...tid,...sd->...tis", qd, kd, precision=HIGHEST)
    return jnp.einsum("...tis,...ti->...ts", jax.nn.relu(dots), w, precision=HIGHEST)


def index_scores_fp8(q, w, k_fp8, k_scale):
    """FP8 emulation with pre-quantized keys: q f32[..., T, I, dI], w f32[..., T, I],
    k_fp8 e4m3[..., S, dI], k_scale f32[..., S] -> f32[..., T, S]."""
    qq, qs = fp8_quantize(hadamard(q), block=q.shape[-1])  # qs [..., T, I]
    dots = jnp.einsum("...tid,...sd->...tis", qq.astype(jnp.float32), k_fp8.astype(jnp.float32), precision=HIGHEST)
    s = jnp.einsum("...tis,...ti->...ts", jax.nn.relu(dots), w * qs, precision=HIGHEST)
    return s * k_scale[..., None, :]


def select_topk(scores, valid, k: int):
    """scores f32[..., S], valid bool[..., S] -> int32[..., min(k, S)] positions, -1 where not valid.

    Valid positions come first in descending score order; the lower position wins a tie.
    """
    k = min(k, scores.shape[-1])
    masked = jnp.where(valid, scores, -jnp.inf)
    _, pos = jax.lax.top_k(masked, k)
    ok = jnp.take_along_axis(valid, pos, axis=-1)
    return jnp.where(ok, pos, -1).astype(jnp.int32)


# ----- a device-side summary of the keys: blocks whose scores are bounded without their keys (index_tier="host") ----
BOUND_SLACK = 2.0 ** -16  # relative slack of `block_score_bound` over float32 rounding of the sums


def key_block_bounds(k, block: int):
    """Each block of `block` consecutive keys summarized by its per-dimension extremes.

    k [..., S, dI] (S a multiple of `block`) -> (kmin, kmax) f32[..., S / block, dI]. With the scored keys (as
    `index_scores` scores them: dequantized fp8 / int4 keys, rotated), `block_score_bound` bounds every score of
    the block from these 2 x dI numbers alone (8 bytes per token at dI 128 and blocks of 64, bf16, against 132 for
    the fp8 key itself)."""
    *lead, S, D = k.shape
    if S % block:
        raise ValueError(f"{S} keys do not split into blocks of {block}")
    kb = k.astype(jnp.float32).reshape(*lead, S // block, block, D)
    return kb.min(axis=-2), kb.max(axis=-2)


def block_score_bound(q, w, kmin, kmax):
    """An upper bound of every score I(t, s) = sum_h w_h relu(q_h . k_s) over each block of keys, from its extremes.

    q f32[..., T, I, dI], w f32[..., T, I], kmin / kmax f32[..., NB, dI] -> f32[..., T, NB]. For head h, q_h . k
    over the box [kmin, kmax] lies in [lo_h, hi_h] (per dimension the smaller / larger of q_hd kmin_d and
    q_hd kmax_d); relu is non-decreasing, so w_h relu(q_h . k) <= w_h relu(hi_h) where w_h >= 0 and
    <= w_h relu(lo_h) where w_h < 0 (a negative head weight is bounded by the smallest dot). Computed in float32
    and raised by BOUND_SLACK times the sum of the terms' magnitudes, so that float32 rounding of the exact
    scores' own sums never puts a score above its block's bound."""
    q = q.astype(jnp.float32)
    w = w.astype(jnp.float32)
    a = q[..., :, :, None, :] * kmin[..., None, None, :, :]  # [..., T, I, NB, dI]
    b = q[..., :, :, None, :] * kmax[..., None, None, :, :]
    hi = jnp.maximum(a, b).sum(-1)  # [..., T, I, NB]
    lo = jnp.minimum(a, b).sum(-1)
    mag = jnp.maximum(jnp.abs(a), jnp.abs(b)).sum(-1)
    wb = w[..., None]
    terms = jnp.where(wb >= 0, wb * jax.nn.relu(hi), wb * jax.nn.relu(lo))
    return terms.sum(-2) + BOUND_SLACK * (jnp.abs(wb) * mag).sum(-2)


HOST_INDEX_RANKS = ("bound", "mean")  # how budgeted mode ranks the blocks (`host_index_select_reference`)


def host_index_select_reference(q, w, k, valid, topk: int, block: int, budget: int | None = None,
                                rank: str = "bound"):
    """The top-k as an indexer with its key history on the host finds it, from block summaries on the device.

    q f32[B, I, dI], w f32[B, I], k [B, S, dI] (the scored keys), valid bool[B, S] -> (positions int32[B, K'],
    blocks_read int32[B], blocks_live int32[B]). A block with no valid position is never read.
      budget None (exact): every block whose bound (`block_score_bound`) reaches the k-th best exact score is
        read: what reading blocks in bound order until no unread bound exceeds the k-th best score read so far
        ends with. The positions are `select_topk` of all exact scores (recall 1 by construction).
      budget N (an int, or int32[B] per row, traced or not): the N best-ranked blocks are read and the top-k is
        taken among their positions only; `rank` "bound" ranks blocks by their bound, "mean" by the score of the
        block's mean key (HISA's coarse filter: no bound, one more dI-vector per block on the device).
    """
    if rank not in HOST_INDEX_RANKS:
        raise ValueError(f"rank must be one of {HOST_INDEX_RANKS}, got {rank!r}")
    B, S, _ = k.shape
    nb = S // block
    live = valid.reshape(B, nb, block).any(-1)
    if budget is not None and rank == "mean":
        kb = k.astype(jnp.float32).reshape(B, nb, block, -1)
        vb = valid.reshape(B, nb, block, 1)
        mean = (kb * vb).sum(-2) / jnp.maximum(vb.sum(-2), 1)
        bound = index_scores(q[:, None], w[:, None], mean)[:, 0]
    else:
        bound = block_score_bound(q[:, None], w[:, None], *key_block_bounds(k, block))[:, 0]  # [B, NB]
    bound = jnp.where(live, bound, -jnp.inf)
    scores = index_scores(q[:, None], w[:, None], k)[:, 0]  # [B, S]
    if budget is None:
        full = select_topk(scores, valid, topk)
        last = jnp.take_along_axis(scores, jnp.maximum(full[:, -1:], 0), axis=-1)  # the k-th best (or last) score
        kth = jnp.where((full >= 0).all(-1, keepdims=True), last, -jnp.inf)
        read = live & (bound >= kth)
        return full, read.sum(-1).astype(jnp.int32), live.sum(-1).astype(jnp.int32)
    order = jnp.argsort(-bound, axis=-1, stable=True)  # best first; the lower block wins a tie
    place = jnp.zeros((B, nb), jnp.int32).at[jnp.arange(B)[:, None], order].set(jnp.arange(nb, dtype=jnp.int32))
    read = (place < jnp.reshape(jnp.asarray(budget, jnp.int32), (-1, 1))) & live
    in_read = jnp.repeat(read, block, axis=-1)
    return (select_topk(scores, valid & in_read, topk), read.sum(-1).astype(jnp.int32),
            live.sum(-1).astype(jnp.int32))


def paged_index_scores(q, w, k_pages, block_table, *, k_scale=None):
    """Indexer scores of every block-table position (unmasked) -> f32[B, S].

    q f32/bf16[B, I, dI], w f32[B, I], k_pages [P, page, dI], block_table int32[B, MP] (-1 unused: read as
    page 0, the caller masks those positions), k_scale f32[P, page] for float8_e4m3fn keys (FP8 emulation:
    the query is Hadamard-rotated and quantized exactly as `index_scores_fp8` does), or for MXFP4 keys (k_pages
    uint8[P, page, dI / 2] codes of `quantize_index_keys_int4`) its uint8[P, page, dI / 32] scales (the query
    quantized as `index_scores_int4` does).
    """
    B, MP = block_table.shape
    pages = jnp.maximum(block_table, 0)  # [B, MP]
    keys = k_pages[pages].reshape(B, MP * k_pages.shape[1], k_pages.shape[2])  # [B, S, dI] (int4: dI / 2)
    q = q.astype(jnp.float32)[:, None]  # [B, T=1, I, dI]
    w = w.astype(jnp.float32)[:, None]  # [B, T=1, I]
    if k_scale is None:
        return index_scores(q, w, keys)[:, 0]
    if k_pages.dtype == jnp.uint8:
        ks = k_scale[pages].reshape(B, MP * k_pages.shape[1], k_scale.shape[-1])  # [B, S, dI / 32]
        return index_scores_int4(q, w, keys, ks)[:, 0]
    ks = k_scale[pages].reshape(B, -1)  # [B, S]
    return index_scores_fp8(q, w, keys, ks)[:, 0]


def indexer_topk_reference(q, w, k_pages, block_table, seq_lens, *, topk: int, k_scale=None, interpret=False):
    """Top-`topk` key positions of the lightning indexer over a paged key pool -> int32[B, topk].

    score(s) = sum_h w[b, h] * relu(q[b, h] . k[s]) over positions s < seq_lens[b] (s indexes the row's
    block table: page block_table[b, s // page], row s % page). Slots are ordered by descending score,
    the lower position wins a tie (`select_topk`'s rule); -1 pads the end when seq_len < topk; a row with
    seq_len 0 is all -1. `interpret` is accepted for signature parity with the kernel and ignored.
    """
    del interpret
    B, MP = block_table.shape
    S = MP * k_pages.shape[1]
    scores = paged_index_scores(q, w, k_pages, block_table, k_scale=k_scale)  # [B, S]
    valid = jnp.arange(S, dtype=jnp.int32)[None] < seq_lens.astype(jnp.int32)[:, None]  # [B, S]
    idx = select_topk(scores, valid, topk)  # [B, min(topk, S)]
    return jnp.pad(idx, ((0, 0), (0, topk - idx.shape[1])), constant_values=-1)
