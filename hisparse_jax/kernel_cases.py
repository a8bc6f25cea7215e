"""Inputs for checking the Pallas kernels against their references: the cases the tests and the GPU check
(experiments/gpu_check.py) both run, built once here.

Every case is paged as the store pages it (64-row pages through a permuted block table) and poisoned where nothing
valid reads: pool rows no valid slot selects hold NaN (MXFP4 index keys: codes 0xFF with scale bytes 255, whose
products are NaN or inf), padding top-k slots point at junk addresses, unused block-table entries are -1. A kernel
that reads anything it should not returns NaN. Built with NumPy: eager jax ops would each compile a small program
(seconds on a CPU).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.units import PAGE_SIZE

# indexer case formats: name -> (query dtype, stored key dtype); fp8 and int4 (MXFP4 codes + UE8M0 scales) are
# `CacheConfig(index_dtype=...)`'s quantized keys
INDEX_FORMATS = {"bf16": (jnp.float32, jnp.bfloat16), "bf16q": (jnp.bfloat16, jnp.bfloat16),
                 "f32": (jnp.float32, jnp.float32), "fp8": (jnp.float32, jnp.float8_e4m3fn),
                 "int4": (jnp.float32, jnp.uint8)}


class IndexerCase(NamedTuple):
    """A paged indexer top-k case.

    args       (q [B, I, D], w [B, I], k_pages [P, 64, D'], block_table int32 [B, MP], seq_lens int32 [B]) for
               `indexer_topk` and its reference; D' = D / 2 for MXFP4 codes.
    k_scale    the keys' scales [P, 64(, D / 32)] (fp8: float32; MXFP4: UE8M0 bytes), None for bf16 / f32 keys.
    keys       the contiguous twin [B, S, D] for `index_scores`: keys as stored (bf16 / f32) or raw (fp8 / MXFP4:
               `index_scores(index_dtype=...)` quantizes them per key exactly as the pool does).
    index_dtype  "fp8", "int4" or None: `index_scores`' index_dtype for `keys`.
    """

    args: tuple
    k_scale: jax.Array | None
    keys: jax.Array
    index_dtype: str | None


def indexer_case(seed: int, seq_lens, fmt: str, *, heads: int, dim: int, pages_per_seq: int, pool: int,
                 integer: bool = True) -> IndexerCase:
    """Sequence b has seq_lens[b] keys in `pages_per_seq` pages of a permuted pool of `pool` pages (a length past
    them: the kernel must read no further); query and key dtypes by `fmt` (INDEX_FORMATS).

    integer: q and k small integers and w dyadic (every score exact in float32 whatever the summation order, ties
    frequent: orders compare slot by slot; for fp8 / MXFP4 keys both are Hadamard-rotated first, so the quantized
    operands come back as the exact integers); else standard normal. Pages past a sequence's end stay poisoned and
    every odd one of them is -1 in the block table.
    """
    if fmt not in INDEX_FORMATS:
        raise ValueError(f"format {fmt!r} not in {sorted(INDEX_FORMATS)}")
    q_dtype, key_dtype = INDEX_FORMATS[fmt]
    nb, s = len(seq_lens), pages_per_seq * PAGE_SIZE
    if nb * pages_per_seq > pool:
        raise ValueError(f"{nb} sequences of {pages_per_seq} pages do not fit {pool} pages")
    from pallas_kernels.common import hadamard
    from pallas_kernels.indexer_topk.reference import quantize_index_keys, quantize_index_keys_int4

    rng = np.random.default_rng(seed)
    quantized = fmt in ("fp8", "int4")
    if integer:
        q = rng.integers(-3, 4, (nb, heads, dim)).astype(np.float32)
        k = rng.integers(-3, 4, (nb, s, dim)).astype(np.float32)
        w = rng.integers(-4, 9, (nb, heads)).astype(np.float32) / 8  # some negative: negative scores too
        if quantized:  # the rotation is an involution: the quantized operands come back as exact small integers
            q, k = (np.asarray(x) for x in jax.jit(lambda a, b: (hadamard(a), hadamard(b)))(q, k))
    else:
        q = rng.standard_normal((nb, heads, dim)).astype(np.float32)
        k = rng.standard_normal((nb, s, dim)).astype(np.float32)
        w = rng.standard_normal((nb, heads)).astype(np.float32) / np.sqrt(heads * dim)
    if quantized:
        quantize = quantize_index_keys if fmt == "fp8" else quantize_index_keys_int4
        stored, scale = (np.asarray(x) for x in jax.jit(quantize)(k))
        keys = jnp.asarray(k)
    else:
        stored, scale = np.asarray(jnp.asarray(k, key_dtype)), None
        keys = jnp.asarray(stored)
    live = np.arange(s)[None, :] < np.asarray(seq_lens)[:, None]  # [B, S]
    poison = 0xFF if fmt == "int4" else np.nan
    stored = np.where(live[..., None], stored, np.array(poison, stored.dtype))
    pages = rng.permutation(pool)[:nb * pages_per_seq].reshape(nb, pages_per_seq)
    k_pages = np.full((pool, PAGE_SIZE, stored.shape[-1]), poison, stored.dtype)
    k_pages[pages.reshape(-1)] = stored.reshape(-1, PAGE_SIZE, stored.shape[-1])
    k_scale = None
    if quantized:
        scale = scale if fmt == "int4" else scale.astype(np.float32)
        scale = np.where(live.reshape(live.shape + (1,) * (scale.ndim - 2)), scale, np.array(poison, scale.dtype))
        k_scale = np.full((pool, PAGE_SIZE, *scale.shape[2:]), poison, scale.dtype)
        k_scale[pages.reshape(-1)] = scale.reshape(-1, PAGE_SIZE, *scale.shape[2:])
        k_scale = jnp.asarray(k_scale)
    block_table = pages.copy()
    for b, n in enumerate(seq_lens):
        for j in range(pages_per_seq):
            if j * PAGE_SIZE >= n and j % 2:
                block_table[b, j] = -1  # unused entries: -1, or a poisoned page
    args = (jnp.asarray(q, q_dtype), jnp.asarray(w), jnp.asarray(k_pages), jnp.asarray(block_table, jnp.int32),
            jnp.asarray(seq_lens, jnp.int32))
    return IndexerCase(args, k_scale, keys, fmt if quantized else None)


def mla_case(seed: int, *, B: int, H: int, C: int, R: int, K: int, seq_lens=None, pages: int | None = None,
             kv: str = "bfloat16", q_dtype=jnp.float32, invalid: float = 0.0) -> tuple[tuple, dict]:
    """A sparse MLA decode case: (args, kwargs) for `sparse_mla_decode` and its reference.

    args = (q_lat [B, H, C], q_rope [B, H, R], latent [P, 64, C], rope [P, 64, R], page int32 [B, K], row int32
    [B, K], valid bool [B, K]); kwargs {"latent_scale": float32 [P, 64, max(C / 128, 1)]} for an fp8 pool.
    Sequence b (seq_lens[b] positions, default 2K) owns its pages of a permuted pool of `pages` pages (default
    what they need + 8); its top-k selects min(K, seq_lens[b]) distinct positions into random slots, each dropped
    (invalid) with probability `invalid` except slot 0's; invalid slots point at junk addresses. Only selected
    rows hold values (standard normal; fp8 scales powers of two): every other pool row is NaN.
    kv: "float32", "bfloat16" (rope in the latent's dtype) or "fp8" (e4m3 latent + scales, bf16 rope).
    """
    if kv not in ("float32", "bfloat16", "fp8"):
        raise ValueError(f"kv {kv!r} not in float32, bfloat16, fp8")
    seq_lens = [2 * K] * B if seq_lens is None else list(seq_lens)
    own = [-(-n // PAGE_SIZE) for n in seq_lens]
    pages = sum(own) + 8 if pages is None else pages
    if sum(own) > pages:
        raise ValueError(f"sequences of {seq_lens} positions need {sum(own)} pages > {pages}")
    rng = np.random.default_rng(seed)
    perm = rng.permutation(pages)
    page = rng.integers(0, pages, (B, K)).astype(np.int32)  # junk addresses for the invalid slots
    row = rng.integers(0, PAGE_SIZE, (B, K)).astype(np.int32)
    valid = np.zeros((B, K), bool)
    first = 0
    for b, n in enumerate(seq_lens):
        table = perm[first:first + own[b]]  # sequence b's block table
        first += own[b]
        sel = rng.choice(n, min(n, K), replace=False)
        slots = rng.permutation(K)[:sel.size]  # valid slots scattered among the padding
        keep = (rng.random(sel.size) >= invalid) | (slots == 0)  # slot 0 stays valid when it is used
        slots, sel = slots[keep], sel[keep]
        page[b, slots], row[b, slots], valid[b, slots] = table[sel // PAGE_SIZE], sel % PAGE_SIZE, True
    vp, vr = page[valid], row[valid]
    n = int(valid.sum())
    lat_dtype = {"float32": np.float32, "bfloat16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[kv]
    rope_dtype = np.float32 if kv == "float32" else jnp.bfloat16
    latent = np.full((pages, PAGE_SIZE, C), np.nan, lat_dtype)
    latent[vp, vr] = rng.standard_normal((n, C), np.float32).astype(lat_dtype)
    rope = np.full((pages, PAGE_SIZE, R), np.nan, rope_dtype)
    rope[vp, vr] = rng.standard_normal((n, R), np.float32).astype(rope_dtype)
    kw = {}
    if kv == "fp8":
        scale = np.full((pages, PAGE_SIZE, max(C // 128, 1)), np.nan, np.float32)
        scale[vp, vr] = 2.0 ** rng.integers(-4, 2, (n, scale.shape[-1])).astype(np.float32)
        kw["latent_scale"] = jnp.asarray(scale)
    q_lat = rng.standard_normal((B, H, C), np.float32)
    q_rope = rng.standard_normal((B, H, R), np.float32)
    args = tuple(jnp.asarray(x) for x in (q_lat.astype(q_dtype), q_rope.astype(q_dtype), latent, rope, page, row,
                                          valid))
    return args, kw


def gather_case(seed: int, *, B: int, K: int, hot_rows: int, context: int, hit_frac: float = 0.5,
                resident_p: float = 0.25, fill: float = 0.75, clock: int = 1000) -> tuple:
    """Resolver inputs (topk, req, block_table, host_table, hot_pages, hot_token, hot_stamp, clock) for
    `sparse_gather`: B sequences of `context` positions (B + 2 request slots, two idle), their top-k K distinct
    positions, pages resident with probability `resident_p` (permuted tables), about `hit_frac` of the
    non-resident top-k positions held by the hot buffer, the buffers `fill` full (other tags random positions
    outside the top-k), LRU stamps random below `clock`, empty slots -1."""
    rng = np.random.default_rng(seed)
    HR, S = hot_rows, context
    MP, Rq, NH = S // PAGE_SIZE, B + 2, -(-HR // PAGE_SIZE)
    topk = np.stack([rng.choice(S, K, replace=False) for _ in range(B)]).astype(np.int32)
    req = rng.permutation(Rq)[:B].astype(np.int32)
    block_table = np.where(rng.random((Rq, MP)) < resident_p,
                           rng.permutation(4 * Rq * MP)[:Rq * MP].reshape(Rq, MP), -1).astype(np.int32)
    host_table = rng.permutation(4 * Rq * MP)[:Rq * MP].reshape(Rq, MP).astype(np.int32)
    hot_pages = rng.permutation(2 * Rq * NH)[:Rq * NH].reshape(Rq, NH).astype(np.int32)
    tok = np.full((Rq, HR), -1, np.int32)
    stamp = np.full((Rq, HR), -1, np.int32)
    owner = {int(r): b for b, r in enumerate(req)}
    for r in range(Rq):
        if r in owner:
            t = topk[owner[r]]
            nonres = t[block_table[r, t // PAGE_SIZE] < 0]
            held = nonres[rng.random(nonres.size) < hit_frac]
            others = np.setdiff1d(np.arange(S), t)
        else:
            held, others = np.zeros(0, np.int64), np.arange(S)
        n_other = max(int(fill * HR) - held.size, 0)
        tags = np.concatenate([held, rng.choice(others, n_other, replace=False)])[:HR]
        slots = rng.permutation(HR)[:tags.size]
        tok[r, slots], stamp[r, slots] = tags, rng.integers(0, clock, tags.size)
    case = (topk, req, block_table, host_table, hot_pages, tok, stamp, np.int32(clock))
    return tuple(jnp.asarray(x) for x in case)
