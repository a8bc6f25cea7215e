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


# ----- tighter page summaries: a ball, a box in a per-layer basis, and both (index_tier="host") ------------------
# Each kind summarizes a page of keys with at most 2 x dI bf16 numbers (the box's cost, 512 bytes per 64-key page at
# dI 128), bf16-exact (every value rounded outward, so a bf16 copy on the device is the summary itself), and bounds
# every score of the page with `summary_score_bound`. Per page (dI 128, m the basis' rank):
#   "box"      kmin, kmax [dI]                                     2 dI           = 256 bf16 (512 B)
#   "ball"     centre c [dI], radius r                             dI + 1         = 129 bf16 (258 B)
#   "pca_box"  box of U^T k [m] x 2, residual radius rp            2 m + 1        = 255 bf16 at m = 127 (510 B)
#   "ball_pca" c [dI], r, box of U^T (k - c) [m] x 2, residual rp  dI + 2 m + 2   = 256 bf16 at m = 63 (512 B)
#   "rvq"      per key: m one-byte codes, an e4m3 residual radius   64 (m + 1) B  = 256 bf16 at m = 7 (512 B)
# plus, for "pca_box" / "ball_pca", one basis U f32[dI, m] per layer (shared by every page: dI m 4 bytes, 65 KB at
# m = 127), and for "rvq" m codebooks of RVQ_SIZE centroids per layer (m x 256 x dI bf16: 448 KB at m = 7, dI 128)
# with the rope tables of the keys' positions (`rvq_fit`, `rvq_encode`: the key is coded before its RoPE).
SUMMARY_KINDS = ("box", "ball", "pca_box", "ball_pca", "rvq")
SUMMARY_SLACK = 2.0 ** -12  # relative slack of the non-box bounds over float32 rounding (see `summary_score_bound`)
JOINT_HEADS_MAX = 10  # the ball's bound over all heads at once enumerates 2^I head subsets up to this many heads


def summary_rank(kind: str, index_dim: int, page_values: int | None = None) -> int:
    """The largest basis rank m whose per-page summary of `kind` fits in `page_values` bf16 numbers (default the
    box's 2 x index_dim): "pca_box" 2 m + 1, "ball_pca" index_dim + 2 m + 2; 0 for the kinds without a basis."""
    check_summary_kind(kind)
    budget = 2 * index_dim if page_values is None else page_values
    if kind == "rvq":  # per 64-key page: 64 (m + 1) bytes = 32 (m + 1) bf16 numbers' worth
        return max(budget // 32 - 1, 0)
    m = {"pca_box": (budget - 1) // 2, "ball_pca": (budget - index_dim - 2) // 2}.get(kind, 0)
    return max(min(m, index_dim), 0)


def summary_page_values(kind: str, index_dim: int, m: int = 0) -> int:
    """bf16 numbers per 64-key page of a summary of `kind` (basis rank, or for "rvq" stages, m): the table above
    ("rvq" in bytes / 2)."""
    check_summary_kind(kind)
    return {"box": 2 * index_dim, "ball": index_dim + 1, "pca_box": 2 * m + 1, "ball_pca": index_dim + 2 * m + 2,
            "rvq": 32 * (m + 1)}[kind]


def check_summary_kind(kind):
    if kind not in SUMMARY_KINDS:
        raise ValueError(f"summary must be one of {SUMMARY_KINDS}, got {kind!r}")
    return kind


def round_bf16(x, up: bool):
    """x f32 rounded to the nearest bfloat16 value above (up) or below it, as f32 (exact in bf16)."""
    x = jnp.asarray(x, jnp.float32)
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    t = b & jnp.uint32(0xFFFF0000)  # bf16 truncation: rounds toward zero
    away = (x > 0) if up else (x < 0)
    r = jnp.where((t != b) & away, t + jnp.uint32(0x10000), t)
    return jax.lax.bitcast_convert_type(r, jnp.float32)


def pca_basis(x, m: int):
    """A rank-m orthonormal basis of the directions x varies most in: the top-m eigenvectors of x^T x (uncentered:
    pass keys for "pca_box", keys minus their page's centre for "ball_pca"). x [..., N, dI] (the leading axes, e.g.
    layers, each get their own basis) -> U f32[..., dI, m]. Orthonormal to float32 rounding; `summary_score_bound`
    accounts for the rest."""
    x = jnp.asarray(x, jnp.float32)
    gram = jnp.einsum("...nd,...ne->...de", x, x, precision=HIGHEST)
    _, vecs = jnp.linalg.eigh(gram)  # ascending eigenvalues
    return vecs[..., ::-1][..., :m]


def _pages(k, valid, block: int):
    *lead, S, D = k.shape
    if S % block:
        raise ValueError(f"{S} keys do not split into blocks of {block}")
    kb = k.astype(jnp.float32).reshape(*lead, S // block, block, D)
    if valid is None:
        vb = jnp.ones((*lead, S // block, block), bool)
    else:
        vb = jnp.broadcast_to(valid, (*lead, S)).reshape(*lead, S // block, block)
    return kb, vb


def _masked_max(x, vb):
    """max over a page's valid rows (0 for a page without one); x [..., NB, block], vb bool[..., NB, block]."""
    return jnp.where(vb.any(-1), jnp.where(vb, x, -jnp.inf).max(-1), 0.0)


def _centre(kb, vb):
    n = vb.sum(-1, keepdims=True)
    mean = (kb * vb[..., None]).sum(-2) / jnp.maximum(n, 1)
    return mean.astype(jnp.bfloat16).astype(jnp.float32)  # the centre is whatever bf16 holds: r is measured from it


def _coeff_box(a, vb):
    """Outward-rounded extremes of coefficients a [..., NB, block, m] over valid rows (0 for an empty page)."""
    any_ = vb.any(-1)[..., None]
    lo = jnp.where(any_, jnp.where(vb[..., None], a, jnp.inf).min(-2), 0.0)
    hi = jnp.where(any_, jnp.where(vb[..., None], a, -jnp.inf).max(-2), 0.0)
    return round_bf16(lo, up=False), round_bf16(hi, up=True)


def _residual_radius(x, a, basis, vb, kn):
    """The largest |x - U a| over valid rows, raised by SUMMARY_SLACK |k|max (float32 rounding of x - U a: at most
    (m + 2) eps |k| with |U a| <= |k| (1 + eps), far below it) and rounded up to bf16."""
    e = x - jnp.einsum("...jm,dm->...jd", a, basis, precision=HIGHEST)
    return round_bf16(_masked_max(jnp.sqrt((e * e).sum(-1)), vb) + SUMMARY_SLACK * kn, up=True)


# ----- "rvq": each key coded before its RoPE by residual vector quantization ------------------------------------
# An indexer key is a LayerNorm output that RoPE turns by its position, so no page-level shape holds a page of them
# tightly. Before RoPE the trained models' keys cluster: m stages of RVQ_SIZE centroids code a key in m bytes to a
# small residual. The bound rotates each key's reconstruction back by its position and widens every dot
# by |q_h| times the key's residual radius, so it is a bound key by key; a page's bound is its keys' largest.
RVQ_SIZE = 256  # centroids per stage: one byte per code


def rope_unrotate(k, cos, sin):
    """A key as it was before RoPE: k [..., S, dI] whose first R = 2 x cos.shape[-1] dimensions hold the rotated
    pairs as the model lays them out, [a cos - b sin | b cos + a sin] (either pairing: the output layout is the
    same), cos / sin f32[S, R/2] of the keys' positions -> f32[..., S, dI] with [a | b] there, the rest unchanged."""
    k = k.astype(jnp.float32)
    h = cos.shape[-1]
    y1, y2 = k[..., :h], k[..., h:2 * h]
    return jnp.concatenate([y1 * cos + y2 * sin, y2 * cos - y1 * sin, k[..., 2 * h:]], axis=-1)


def rope_rotate(u, cos, sin):
    """`rope_unrotate`'s inverse: [a | b | rest] -> [a cos - b sin | b cos + a sin | rest]."""
    h = cos.shape[-1]
    a, b = u[..., :h], u[..., h:2 * h]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin, u[..., 2 * h:]], axis=-1)


def _nearest(x, centroids):
    """Index of the nearest centroid of each row: x f32[..., dI], centroids f32[C, dI] -> int32[...]."""
    d = (centroids * centroids).sum(-1) - 2 * jnp.einsum("...d,cd->...c", x, centroids, precision=HIGHEST)
    return jnp.argmin(d, axis=-1).astype(jnp.int32)


def _kmeans_init(key, x, size: int):
    """k-means++ seeding: the first centroid a random row, each next one a row drawn with probability proportional
    to its squared distance from the nearest centroid so far (uniformly once every row is a centroid)."""
    k0, key = jax.random.split(key)
    first = x[jax.random.randint(k0, (), 0, x.shape[0])]
    c = jnp.zeros((size, x.shape[1]), jnp.float32).at[0].set(first)

    def pick(i, carry):
        c, d, key = carry
        key, sub = jax.random.split(key)
        j = jax.random.categorical(sub, jnp.log(jnp.maximum(d, 1e-30)))
        return c.at[i].set(x[j]), jnp.minimum(d, ((x - x[j]) ** 2).sum(-1)), key

    return jax.lax.fori_loop(1, size, pick, (c, ((x - first) ** 2).sum(-1), key))[0]


def rvq_fit(x, stages: int, size: int = RVQ_SIZE, iters: int = 10, seed: int = 0):
    """Codebooks of `stages`-stage residual vector quantization of the rows x f32[N, dI] (un-rotated keys,
    `rope_unrotate`): each stage is `iters` Lloyd (k-means) iterations on what the earlier stages left, seeded by
    k-means++ (`seed`); a centroid that loses every row stays where it was. -> f32[stages, size, dI], each value
    exact in bf16 (the device's bf16 copy is the codebook itself). Any codebook gives true bounds (the radius is
    measured from it); a good one gives tight ones."""
    x = jnp.asarray(x, jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(seed), stages)
    books = []
    for g in range(stages):
        c = _kmeans_init(keys[g], x, size)

        def lloyd(_, c):
            one = jax.nn.one_hot(_nearest(x, c), size, dtype=jnp.float32)  # [N, C]
            count = one.sum(0)[:, None]
            mean = jnp.einsum("nc,nd->cd", one, x, precision=HIGHEST) / jnp.maximum(count, 1)
            return jnp.where(count > 0, mean, c)

        c = jax.lax.fori_loop(0, iters, lloyd, c).astype(jnp.bfloat16).astype(jnp.float32)
        x = x - c[_nearest(x, c)]
        books.append(c)
    return jnp.stack(books)


def rvq_decode(codes, codebooks, cos, sin):
    """The keys' reconstructions: codes int[..., S, m] (stage g's centroid of each key), codebooks f32[m, C, dI],
    cos / sin of the keys' positions [S, R/2] -> f32[..., S, dI], the sum of the codes' centroids rotated by RoPE."""
    codes = jnp.asarray(codes).astype(jnp.int32)
    u = jnp.zeros((*codes.shape[:-1], codebooks.shape[-1]), jnp.float32)
    for g in range(codebooks.shape[0]):
        u = u + codebooks[g][codes[..., g]]
    return rope_rotate(u, cos, sin)


def round_e4m3_up(x):
    """x f32 (>= 0) rounded up to a float8_e4m3fn value, as f32 (exact in e4m3 and bf16); above e4m3's largest
    (448) +inf, which bounds nothing (the page is read)."""
    x = jnp.asarray(x, jnp.float32)
    f = x.astype(jnp.float8_e4m3fn)
    up = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(f, jnp.uint8) + jnp.uint8(1), jnp.float8_e4m3fn)
    y = jnp.where(f.astype(jnp.float32) < x, up.astype(jnp.float32), f.astype(jnp.float32))
    return jnp.where(x > 448.0, jnp.inf, y)


def rvq_encode(k, codebooks, cos, sin):
    """Each key's codes and residual radius: k [..., S, dI] (the scored keys, rotated), codebooks f32[m, C, dI]
    (`rvq_fit` of un-rotated keys), cos / sin [S, R/2] of their positions -> (codes int32[..., S, m], radius
    f32[..., S]): greedily the nearest centroid of what each stage leaves of the un-rotated key; radius >=
    |k - rvq_decode(codes)| (raised by SUMMARY_SLACK |k| for float32 rounding, then rounded up to e4m3)."""
    k = k.astype(jnp.float32)
    x = rope_unrotate(k, cos, sin)
    codes = []
    for g in range(codebooks.shape[0]):
        c = _nearest(x, codebooks[g])
        x = x - codebooks[g][c]
        codes.append(c)
    codes = jnp.stack(codes, -1) if codes else jnp.zeros((*k.shape[:-1], 0), jnp.int32)
    e = k - rvq_decode(codes, codebooks, cos, sin)
    norm = jnp.sqrt((k * k).sum(-1))
    return codes, round_e4m3_up(jnp.sqrt((e * e).sum(-1)) + SUMMARY_SLACK * norm)


def _rvq_codec(basis):
    if basis is None or len(basis) != 3:
        raise ValueError('summary "rvq" needs basis=(codebooks, cos, sin) (`rvq_fit`; the rope tables of the keys)')
    return tuple(jnp.asarray(b, jnp.float32) for b in basis)


def _rvq_keys(summary, basis):
    """For "rvq": the page keys' reconstructions f32[..., NB x block, dI] (`rvq_decode` of the summary's codes)."""
    codes = summary[0]
    books, cos, sin = _rvq_codec(basis)
    return rvq_decode(codes.reshape(*codes.shape[:-3], -1, codes.shape[-1]), books, cos, sin)


def _rvq_page_max(each, radius):
    """Each page's largest of its valid keys' values: each [..., T, NB x block], radius [..., NB, block] (-1: the
    row is not valid) -> [..., T, NB] (0 for a page without a valid key)."""
    nb, block = radius.shape[-2:]
    each = each.reshape(*each.shape[:-1], nb, block)
    return _masked_max(each, jnp.broadcast_to((radius >= 0)[..., None, :, :], each.shape))


def key_block_summary(kind: str, k, block: int, valid=None, basis=None):
    """The page summary of `kind` (`SUMMARY_KINDS`) of each block of `block` keys, from the block's valid rows only
    (valid bool[..., S], None: all; a row not valid, e.g. the store's padding or a page's unwritten rows, takes no
    part; a page without a valid row gets zeros and is never read).

    k [..., S, dI] (the scored keys) -> a tuple of f32 arrays, each value exact in bf16:
      "box":      (kmin, kmax) [..., NB, dI]: `key_block_bounds` over the valid rows;
      "ball":     (c [..., NB, dI], r [..., NB]): c the rows' mean rounded to bf16, r >= max |k - c| (rounded up);
      "pca_box":  (amin, amax [..., NB, m], rp [..., NB]): the extremes of a = U^T k (rounded outward) and
                  rp >= max |k - U a| (rounded up), U = basis f32[dI, m] (`pca_basis` of keys);
      "ball_pca": (c, r, amin, amax, rp): the ball, and the extremes of a = U^T (k - c) with rp >= max |k - c - U a|
                  (U from `pca_basis` of keys minus their page's centre);
      "rvq":      (codes [..., NB, block, m], radius [..., NB, block]): each key's `rvq_encode` (basis = (codebooks,
                  cos, sin), the rope tables [S, R/2] of the keys' positions); a row not valid has codes 0 and
                  radius -1.
    Appending a key to a page or reusing the page for other keys is this function of the page's new valid rows."""
    check_summary_kind(kind)
    kb, vb = _pages(k, valid, block)
    if kind == "rvq":
        books, cos, sin = _rvq_codec(basis)
        codes, radius = rvq_encode(k, books, cos, sin)
        codes = jnp.where(vb[..., None], codes.reshape(*vb.shape, -1), 0).astype(jnp.float32)
        return codes, jnp.where(vb, radius.reshape(vb.shape), -1.0)
    if kind == "box":
        return (round_bf16(jnp.where(vb.any(-1)[..., None], jnp.where(vb[..., None], kb, jnp.inf).min(-2), 0.0),
                           up=False),
                round_bf16(jnp.where(vb.any(-1)[..., None], jnp.where(vb[..., None], kb, -jnp.inf).max(-2), 0.0),
                           up=True))
    if kind in ("pca_box", "ball_pca") and basis is None:
        raise ValueError(f"summary {kind!r} needs a basis (`pca_basis`)")
    kn = _masked_max(jnp.sqrt((kb * kb).sum(-1)), vb)  # the largest key norm [..., NB]
    if kind == "pca_box":
        basis = jnp.asarray(basis, jnp.float32)
        a = jnp.einsum("...jd,dm->...jm", kb, basis, precision=HIGHEST)
        return (*_coeff_box(a, vb), _residual_radius(kb, a, basis, vb, kn))
    c = _centre(kb, vb)
    x = kb - c[..., None, :]
    r = round_bf16(_masked_max(jnp.sqrt((x * x).sum(-1)), vb) * (1 + SUMMARY_SLACK), up=True)
    if kind == "ball":
        return c, r
    basis = jnp.asarray(basis, jnp.float32)
    a = jnp.einsum("...jd,dm->...jm", x, basis, precision=HIGHEST)
    return (c, r, *_coeff_box(a, vb), _residual_radius(x, a, basis, vb, kn))


def _box_interval(qp, lo, hi):
    """[min, max] of qp . a over the box lo <= a <= hi, and sum |qp_j| max(|lo_j|, |hi_j|) (a bound of |qp . a|).
    qp [..., T, I, m], lo / hi [..., NB, m] -> three [..., T, I, NB]."""
    a = qp[..., :, :, None, :] * lo[..., None, None, :, :]
    b = qp[..., :, :, None, :] * hi[..., None, None, :, :]
    return jnp.minimum(a, b).sum(-1), jnp.maximum(a, b).sum(-1), jnp.maximum(jnp.abs(a), jnp.abs(b)).sum(-1)


def _basis_parts(q, basis):
    """(U^T q [..., T, I, m], |q - U U^T q| [..., T, I], |U^T q| [..., T, I], delta = |U^T U - I|_F)."""
    basis = jnp.asarray(basis, jnp.float32)
    qp = jnp.einsum("...tid,dm->...tim", q, basis, precision=HIGHEST)
    qr = q - jnp.einsum("...tim,dm->...tid", qp, basis, precision=HIGHEST)
    gram = jnp.einsum("dm,dn->mn", basis, basis, precision=HIGHEST) - jnp.eye(basis.shape[-1])
    return qp, jnp.sqrt((qr * qr).sum(-1)), jnp.sqrt((qp * qp).sum(-1)), jnp.sqrt((gram * gram).sum())


def summary_score_bound(q, w, kind: str, summary, basis=None):
    """An upper bound of every score I(t, s) = sum_h w_h relu(q_h . k_s) over each page, from its summary.

    q f32[..., T, I, dI], w f32[..., T, I], summary = `key_block_summary(kind, ...)` (basis: the same U)
    -> f32[..., T, NB]. For each head an interval [lo_h, hi_h] holding q_h . k for every key k of the page; relu is
    non-decreasing, so w_h relu(q_h . k) <= w_h relu(hi_h) where w_h >= 0 and <= w_h relu(lo_h) where w_h < 0.
      "box": `block_score_bound`'s interval (per dimension the smaller / larger of q_d kmin_d, q_d kmax_d).
      "ball": q . k = q . c + q . (k - c) and |q . (k - c)| <= |q| |k - c| <= |q| r (Cauchy-Schwarz), so
        q . k lies in q . c -+ |q| r. With I <= JOINT_HEADS_MAX the heads are bounded together: for the heads
        P with w_h >= 0, sum_P w_h relu(q_h . k) = max over subsets A of P of v_A . k, v_A = sum_A w_h q_h (A the
        heads whose dot is positive), and the maximum of v_A . k over the ball is v_A . c + r |v_A|; so the positive
        heads' part is at most max_A (v_A . c + r |v_A|) (the exact maximum over the ball, never above the per-head
        sum since |v_A| <= sum_A w_h |q_h|), the negative heads' part at most sum w_h relu(lo_h) as above; the
        bound is the smaller of this and the per-head one.
      "pca_box": with a = U^T k as summarized and e = k - U a (exactly), q . k = (U^T q) . a + q . e; the first
        term lies in the box interval of U^T q over [amin, amax]; q . e = (q - U U^T q) . e + (U^T q) . (U^T e)
        where |(q - U U^T q) . e| <= |q - U U^T q| rp and U^T e = (U^T k - a) + (I - U^T U) a, the first part
        float32 rounding of a (covered by the slack below), the second at most delta |a| with
        delta = |U^T U - I|_F (0 for an exactly orthonormal U) and |a| <= |max(|amin|, |amax|)|: so q . k lies in
        the box interval -+ (|q - U U^T q| rp + |U^T q| delta |a|max).
      "ball_pca": the same with k - c for k and q . c added (a = U^T (k - c)), intersected with the ball's
        interval (both hold, so their intersection does: the per-head minimum of the upper ends, the maximum of
        the lower ends).
      "rvq": key by key, q_h . k = q_h . k_hat + q_h . (k - k_hat) with k_hat the key's `rvq_decode` and
        |k - k_hat| <= its radius, so q_h . k lies in q_h . k_hat -+ |q_h| radius (Cauchy-Schwarz); the page's bound
        is the largest of its valid keys' (0 for a page without one).
    Float32: the box's terms are raised by BOUND_SLACK as `block_score_bound` raises them; the others by
    SUMMARY_SLACK sum_h |w_h| |q_h| kmax, kmax >= every key's norm in the page (c's norm + r for the ball, the
    coefficients' largest norm (1 + delta) + rp otherwise): the float32 error of any dot of q_h with a key, a centre,
    a residual or the basis is at most n eps |q_h| |k| with n <= 2 dI terms, times sqrt(m) for the coefficient sums
    (2^-24 x 256 x sqrt(127) < 2^-12), so that neither the exact scores' rounding nor the bound's own puts a score
    above its page's bound."""
    check_summary_kind(kind)
    q = q.astype(jnp.float32)
    w = w.astype(jnp.float32)
    wb = w[..., None]
    if kind == "box":
        return block_score_bound(q, w, *summary)
    qn = jnp.sqrt((q * q).sum(-1))[..., None]  # [..., T, I, 1]
    if kind == "rvq":  # every key its own interval: [..., T, I, NB x block]
        kh = _rvq_keys(summary, basis)
        radius = summary[1].reshape(*summary[1].shape[:-2], -1)
        r = jnp.where(jnp.isinf(radius), 0.0, jnp.maximum(radius, 0))[..., None, None, :]  # inf: made +inf below
        dots = jnp.einsum("...tid,...sd->...tis", q, kh, precision=HIGHEST)
        lo, hi = dots - qn * r, dots + qn * r
        kn = jnp.sqrt((kh * kh).sum(-1)) + r[..., 0, 0, :]
    if kind in ("ball", "ball_pca"):
        c, r = summary[0], summary[1]
        qc = jnp.einsum("...tid,...nd->...tin", q, c, precision=HIGHEST)
        lo, hi = qc - qn * r[..., None, None, :], qc + qn * r[..., None, None, :]
        kn = jnp.sqrt((c * c).sum(-1)) + r  # [..., NB]
        joint = _ball_joint_bound(q, w, qc, lo, r)
    if kind in ("pca_box", "ball_pca"):
        amin, amax, rp = summary[-3:]
        qp, qr, qpn, delta = _basis_parts(q, basis)
        plo, phi, _ = _box_interval(qp, amin, amax)
        an = jnp.sqrt(jnp.maximum(amin * amin, amax * amax).sum(-1))  # [..., NB]
        slop = qr[..., None] * rp[..., None, None, :] + qpn[..., None] * delta * an[..., None, None, :]
        if kind == "pca_box":
            lo, hi = plo - slop, phi + slop
            kn = an * (1 + delta) + rp
        else:
            lo, hi = jnp.maximum(lo, qc + plo - slop), jnp.minimum(hi, qc + phi + slop)
    terms = jnp.where(wb >= 0, wb * jax.nn.relu(hi), wb * jax.nn.relu(lo)).sum(-2)
    if kind in ("ball", "ball_pca") and joint is not None:
        terms = jnp.minimum(terms, joint)
    bound = terms + SUMMARY_SLACK * (jnp.abs(wb) * qn * kn[..., None, None, :]).sum(-2)
    if kind != "rvq":
        return bound
    unbounded = jnp.isinf(summary[1]).reshape(*summary[1].shape[:-2], 1, -1)  # a residual beyond e4m3's range
    return _rvq_page_max(jnp.where(unbounded, jnp.inf, bound), summary[1])


def _ball_joint_bound(q, w, qc, lo, r):
    """`summary_score_bound`'s ball bound over all heads at once (None above JOINT_HEADS_MAX heads): q [..., T, I, dI],
    w [..., T, I], qc = q . c and lo (the per-head lower ends) [..., T, I, NB], r [..., NB] -> [..., T, NB]."""
    I = q.shape[-2]
    if I > JOINT_HEADS_MAX:
        return None
    subsets = ((jnp.arange(2 ** I)[:, None] >> jnp.arange(I)[None]) & 1).astype(jnp.float32)  # [2^I, I]
    wa = subsets * jnp.maximum(w, 0)[..., None, :]  # [..., T, 2^I, I]: the positive heads of each subset
    v = jnp.einsum("...ai,...id->...ad", wa, q, precision=HIGHEST)
    pos = jnp.einsum("...ai,...in->...an", wa, qc, precision=HIGHEST) + (
        jnp.sqrt((v * v).sum(-1))[..., None] * r[..., None, None, :])  # [..., T, 2^I, NB]
    neg = (jnp.minimum(w, 0)[..., None] * jax.nn.relu(lo)).sum(-2)
    return pos.max(-2) + neg


HOST_INDEX_RANKS = ("bound", "mean", "centre")  # how budgeted mode ranks the blocks (`host_index_select_reference`)


def summary_centre(kind: str, summary, basis=None):
    """The point a page summary of `kind` is centred on, f32[..., NB, dI]: the box's midpoint (kmin + kmax) / 2,
    the ball's centre c, for "pca_box" U (amin + amax) / 2, for "ball_pca" c + U (amin + amax) / 2. Scoring it
    ranks pages with no bytes beyond the summary's (budgeted mode's rank "centre")."""
    check_summary_kind(kind)
    if kind == "rvq":
        raise ValueError('summary "rvq" codes each key: it has no page centre (rank "centre" scores the keys\' '
                         'reconstructions, `host_block_ranks`)')
    if kind == "box":
        return (summary[0] + summary[1]) / 2
    if kind == "ball":
        return summary[0]
    mid = jnp.einsum("...m,dm->...d", (summary[-3] + summary[-2]) / 2, jnp.asarray(basis, jnp.float32),
                     precision=HIGHEST)
    return mid if kind == "pca_box" else summary[0] + mid


def summary_centre_score(q, w, kind: str, summary, basis=None):
    """What budgeted mode's rank "centre" orders pages by: q f32[..., T, I, dI], w f32[..., T, I], summary =
    `key_block_summary(kind, ...)` -> f32[..., T, NB], the score of the summary's centre (`summary_centre`), or for
    "rvq" (no page centre) the best score of the page's valid reconstructed keys (`rvq_decode`)."""
    if check_summary_kind(kind) == "rvq":
        return _rvq_page_max(index_scores(q, w, _rvq_keys(summary, basis)), summary[1])
    return index_scores(q, w, summary_centre(kind, summary, basis))


def host_block_ranks(q, w, k, valid, block: int, rank: str = "bound", summary: str = "box", basis=None):
    """What `host_index_select_reference` ranks the blocks by: q f32[B, I, dI], w f32[B, I], k [B, S, dI],
    valid bool[B, S] -> f32[B, S / block], -inf for a block without a valid position. rank "bound": the
    `summary_score_bound` of the `summary` kind's `key_block_summary` (basis: its U), an upper bound of every score
    of the block; "mean": the score of the block's mean valid key (one more dI-vector per block); "centre": the
    score of the summary's centre (`summary_centre`: for the box its midpoint, no more bytes; for "rvq" the best
    score of the block's reconstructed keys)."""
    if rank not in HOST_INDEX_RANKS:
        raise ValueError(f"rank must be one of {HOST_INDEX_RANKS}, got {rank!r}")
    check_summary_kind(summary)
    B, S, _ = k.shape
    nb = S // block
    live = valid.reshape(B, nb, block).any(-1)
    if rank == "mean":
        kb = k.astype(jnp.float32).reshape(B, nb, block, -1)
        vb = valid.reshape(B, nb, block, 1)
        mean = (kb * vb).sum(-2) / jnp.maximum(vb.sum(-2), 1)
        bound = index_scores(q[:, None], w[:, None], mean)[:, 0]
    else:
        summ = key_block_summary(summary, k, block, valid, basis)
        if rank == "centre":
            bound = summary_centre_score(q[:, None], w[:, None], summary, summ, basis)[:, 0]
        else:
            bound = summary_score_bound(q[:, None], w[:, None], summary, summ, basis)[:, 0]  # [B, NB]
    return jnp.where(live, bound, -jnp.inf)


def host_index_select_reference(q, w, k, valid, topk: int, block: int, budget: int | None = None,
                                rank: str = "bound", summary: str = "box", basis=None):
    """The top-k as an indexer with its key history on the host finds it, from block summaries on the device.

    q f32[B, I, dI], w f32[B, I], k [B, S, dI] (the scored keys), valid bool[B, S] -> (positions int32[B, K'],
    blocks_read int32[B], blocks_live int32[B]). A block with no valid position is never read.
      budget None (exact): every block whose bound (`host_block_ranks`) reaches the k-th best exact score is
        read: what reading blocks in bound order until no unread bound exceeds the k-th best score read so far
        ends with. The positions are `select_topk` of all exact scores (recall 1 by construction).
      budget N (an int, or int32[B] per row, traced or not): the N best-ranked blocks are read and the top-k is
        taken among their positions only; `rank` "bound" ranks blocks by their bound, "mean" by the score of the
        block's mean key (HISA's coarse filter: no bound, one more dI-vector per block on the device), "centre"
        by the score of the summary's centre (`summary_centre`).
    `summary` is the page summary the bounds come from (`SUMMARY_KINDS`, `key_block_summary` of the block's valid
    rows; basis: its U for "pca_box" / "ball_pca"), the box by default.
    """
    if rank not in HOST_INDEX_RANKS:
        raise ValueError(f"rank must be one of {HOST_INDEX_RANKS}, got {rank!r}")
    B, S, _ = k.shape
    nb = S // block
    live = valid.reshape(B, nb, block).any(-1)
    bound = host_block_ranks(q, w, k, valid, block, rank if budget is not None else "bound", summary, basis)
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
