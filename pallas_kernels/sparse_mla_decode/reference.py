"""The spec of sparse absorbed-MLA decode over paged rows (pure jnp, precision HIGHEST).

Shapes: B sequences (one query token each), H heads, C latent (512), R rope (64), K selected rows,
P device pages of 64 rows (one layer's pool).

    o[b, h] = sum_k softmax_k(tau * (q_lat[b, h] . c_k + q_rope[b, h] . kR_k)) c_k

over the K rows k with valid[b, k], where row k of sequence b lives at (page[b, k], row[b, k]) of the
pools: c_k = latent_pages[page, row] (times its per-128 scale for fp8), kR_k = rope_pages[page, row].
Invalid slots are ignored whatever their address holds (NaN included); a sequence without a valid row
returns zeros. Optionally the pools are the store's stacked [L, P, 64, *] arrays and `layer` picks one.
`sparse_mla_decode_rows` is the same math over rows already gathered (what the model's jnp path calls).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import FP8_BLOCK

HIGHEST = jax.lax.Precision.HIGHEST


def sparse_mla_decode_rows(q_lat, q_rope, rows_c, rows_r, valid, tau):
    """Absorbed MLA of one query token per sequence over its K already-gathered rows (the math).

    q_lat [B, H, C] (= W_UK^T q_nope), q_rope [B, H, R], rows_c [B, K, C], rows_r [B, K, R],
    valid bool[B, K] (False for -1 padded top-k slots; their row contents are ignored, even NaN)
    -> o_lat f32[B, H, C] = sum_s softmax_s(tau (q_lat . c_s + q_rope . kR_s)) c_s.
    A sequence with no valid row returns zeros.
    """
    return sparse_mla_decode_rows_lse(q_lat, q_rope, rows_c, rows_r, valid, tau)[0]


def sparse_mla_decode_rows_lse(q_lat, q_rope, rows_c, rows_r, valid, tau):
    """`sparse_mla_decode_rows` over a subset of a sequence's rows, with what merging needs: (o_lat f32[B, H, C]
    normalized over the rows in `valid`, lse f32[B, H] = log sum_s exp(score_s); -inf and zeros when the subset
    is empty). Two disjoint subsets merge exactly (`merge_partial_attention`) into the pass over their union."""
    rows_c = jnp.where(valid[..., None], rows_c, 0)
    rows_r = jnp.where(valid[..., None], rows_r, 0)
    s = (jnp.einsum("bhc,bkc->bhk", q_lat, rows_c, precision=HIGHEST, preferred_element_type=jnp.float32)
         + jnp.einsum("bhr,bkr->bhk", q_rope, rows_r, precision=HIGHEST, preferred_element_type=jnp.float32))
    s = jnp.where(valid[:, None, :], s * tau, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhk,bkc->bhc", p, rows_c.astype(jnp.float32), precision=HIGHEST)
    o = o / jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(denom[..., 0] > 0, denom[..., 0], 1.0)),
                    -jnp.inf)
    return o, lse


def merge_partial_attention(o_a, lse_a, o_b, lse_b):
    """The attention over the union of two disjoint row subsets from each one's (o [B, H, C], lse [B, H]):
    o = w_a o_a + w_b o_b with w_x = exp(lse_x - logaddexp(lse_a, lse_b)); zeros when both are empty."""
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w_a = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe), 0.0)[..., None]
    w_b = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)[..., None]
    return w_a * o_a + w_b * o_b


def merge_splits(o, m, l):
    """Merge split-K partials: o f32[S, B, H, C] unnormalized, m / l f32[S, B, H] (running max, sum of
    exp(s - m)) -> f32[B, H, C] = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s (zeros where no split saw a row)."""
    m_all = jnp.max(m, axis=0)
    w = jnp.exp(m - jnp.where(m_all == -jnp.inf, 0.0, m_all))  # [S, B, H]; 0 for empty splits
    denom = jnp.sum(w * l, axis=0)
    return jnp.sum(w[..., None] * o, axis=0) / jnp.where(denom > 0, denom, 1.0)[..., None]


def gather_rows(latent_pages, rope_pages, page, row, valid, latent_scale=None):
    """Rows at (page, row) [B, K] -> (latent f32[B, K, C], rope f32[B, K, R]); invalid slots read page 0."""
    page = jnp.where(valid, page, 0)
    row = jnp.where(valid, row, 0)
    c = latent_pages[page, row].astype(jnp.float32)  # [B, K, C]
    if latent_scale is not None:
        scale = latent_scale[page, row]  # [B, K, C / 128]
        c = (c.reshape(*c.shape[:-1], -1, FP8_BLOCK) * scale[..., None]).reshape(c.shape)
    return c, rope_pages[page, row].astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("tau", "interpret", "out_dtype"))
def sparse_mla_decode_reference(q_lat, q_rope, latent_pages, rope_pages, page, row, valid, *, tau: float,
                                latent_scale=None, layer=None, interpret: bool = False, out_dtype=jnp.float32):
    """q_lat [B, H, C], q_rope [B, H, R], latent_pages [P, 64, C] (bf16 / f32, or float8_e4m3fn with
    latent_scale f32[P, 64, C / 128]), rope_pages [P, 64, R], page / row int32[B, K], valid bool[B, K]
    -> out_dtype[B, H, C] (float32, or bfloat16: the f32 result rounded, as a bf16 model rounds it before
    W_UV). With `layer` (int or int32 scalar) the pools carry a leading layer axis [L, ...] and layer
    `layer` is used. `interpret` is accepted for signature parity and ignored."""
    del interpret
    out_dtype = check_out_dtype(out_dtype)
    check_shapes(q_lat, q_rope, *per_layer(latent_pages, rope_pages, latent_scale, layer), page, row, valid)
    if layer is not None:
        latent_pages, rope_pages = latent_pages[layer], rope_pages[layer]
        latent_scale = None if latent_scale is None else latent_scale[layer]
    rows_c, rows_r = gather_rows(latent_pages, rope_pages, page, row, valid, latent_scale)
    return sparse_mla_decode_rows(q_lat, q_rope, rows_c, rows_r, valid, tau).astype(out_dtype)


def check_out_dtype(out_dtype):
    """The decode's output dtype, float32 or bfloat16 (ValueError otherwise)."""
    dt = jnp.dtype(out_dtype)
    if dt not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {dt}")
    return dt


def per_layer(latent_pages, rope_pages, latent_scale, layer):
    """Shape/dtype views of one layer's pools (drops the leading layer axis when `layer` is given)."""
    def view(x):
        if x is None or layer is None:
            return x
        if x.ndim != 4:
            raise ValueError(f"with `layer` the pools must be [L, P, 64, *], got {x.shape}")
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)

    return view(latent_pages), view(rope_pages), view(latent_scale)


def checked_stacked_pools(q_lat, q_rope, latent_pages, rope_pages, latent_scale, layer, page, row, valid):
    """The kernels' common prologue: `check_shapes`, then the pools as [L, P, 64, *] with a layer index
    (a single layer's pools get a leading axis of 1 and layer 0)."""
    check_shapes(q_lat, q_rope, *per_layer(latent_pages, rope_pages, latent_scale, layer), page, row, valid)
    if layer is None:
        latent_pages, rope_pages = latent_pages[None], rope_pages[None]
        latent_scale = None if latent_scale is None else latent_scale[None]
        layer = 0
    return latent_pages, rope_pages, latent_scale, layer


def check_shapes(q_lat, q_rope, latent_pages, rope_pages, latent_scale, page, row, valid):
    """Shared input checks of the reference and the kernel (ValueError naming the problem)."""
    B, H, C = q_lat.shape
    P, page_size, _ = latent_pages.shape
    R = q_rope.shape[-1]
    if q_rope.shape != (B, H, R):
        raise ValueError(f"q_rope must be [B={B}, H={H}, R], got {q_rope.shape}")
    if latent_pages.shape[-1] != C or rope_pages.shape != (P, page_size, R):
        raise ValueError(f"pools must be [P, 64, C={C}] and [P, 64, R={R}], got {latent_pages.shape} and "
                         f"{rope_pages.shape}")
    if page.shape != row.shape or valid.shape != page.shape or page.shape[0] != B:
        raise ValueError(f"page / row / valid must all be [B={B}, K], got {page.shape}, {row.shape}, {valid.shape}")
    fp8 = latent_pages.dtype == jnp.float8_e4m3fn
    if fp8 != (latent_scale is not None):
        raise ValueError("latent_scale is required exactly when latent_pages is float8_e4m3fn")
    if fp8 and (C % FP8_BLOCK or latent_scale.shape != (P, page_size, C // FP8_BLOCK)):
        raise ValueError(f"fp8 needs C a multiple of {FP8_BLOCK} and latent_scale [P, 64, C / {FP8_BLOCK}], got "
                         f"C={C}, {latent_scale.shape}")
