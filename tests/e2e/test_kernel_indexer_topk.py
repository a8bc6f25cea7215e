"""Paged indexer top-k: Pallas kernel (interpret mode on CPU) == jnp reference == select_topk(index_scores).

Exact comparisons use integer-valued data (q, k small integers, w dyadic), so every score is exact in
f32 whatever the summation order and ties are frequent: order is compared slot by slot under the
documented tie-break (lower position first). Random continuous data is compared per slot up to a
near-tie tolerance. Pools are NaN-poisoned wherever no valid position reads, block tables are permuted.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse_jax.compat import gpu_lowering_target
from hisparse_jax.kernel_cases import INDEX_FORMATS, indexer_case
from pallas_kernels.common import hadamard
from pallas_kernels.indexer_topk.reference import index_scores, select_topk
from pallas_kernels.indexer_topk import MAX_TOPK, indexer_topk, indexer_topk_reference, paged_index_scores
from pallas_kernels.common import float_to_key as _float_to_key
from pallas_kernels.indexer_topk.kernel import RADIX_BITS, indexer_topk_chunked

PAGE = 64
B, I, D, MP, P = 4, 8, 32, 6, 30  # S = MP * PAGE = 384 positions per row; P >= B * MP pool pages
S = MP * PAGE
TOPK = 128
CHUNK = 128  # small selection chunks: 3 per row, so the cross-chunk offsets are exercised


def make_case(seed, seq_lens, dtype, *, integer=True, topk=TOPK, mp=MP, pool=P, heads=I, dim=D):
    """A paged case (`kernel_cases.indexer_case`, format `dtype`) and its contiguous twin.

    Returns (args, kwargs) for the kernel / reference, and (q, w, keys, index_dtype) for the contiguous
    `index_scores` path: keys [B, S, dI] as stored (bf16 / f32) or raw (FP8 / MXFP4: `index_scores(index_dtype=...)`
    quantizes them per key exactly as the pool does). Unread pool rows are NaN; for MXFP4, codes 0xFF with scale
    bytes 255 (inf: every product NaN or inf).
    """
    c = indexer_case(seed, seq_lens, dtype, heads=heads, dim=dim, pages_per_seq=mp, pool=pool, integer=integer)
    return c.args, dict(topk=topk, k_scale=c.k_scale), (c.args[0], c.args[1], c.keys, c.index_dtype)


def contiguous_topk(q, w, keys, index_dtype, seq_lens, topk):
    """select_topk(index_scores(...)) over unpaged keys, -1 padded to topk columns."""
    scores = index_scores(q.astype(jnp.float32)[:, None], w[:, None], keys, index_dtype=index_dtype)[:, 0]
    valid = jnp.arange(keys.shape[1])[None] < jnp.asarray(seq_lens)[:, None]
    idx = np.asarray(select_topk(scores, valid, topk))
    return np.pad(idx, ((0, 0), (0, topk - idx.shape[1])), constant_values=-1)


def kernel(*args, max_chunk=CHUNK, **kwargs):
    return np.asarray(indexer_topk_chunked(*args, interpret=True, max_chunk=max_chunk, **kwargs))


def check_well_formed(got, seq_lens, topk):
    for row, n in zip(got, seq_lens):
        m = min(n, topk)
        assert (row[m:] == -1).all(), row
        assert ((row[:m] >= 0) & (row[:m] < n)).all() and len(set(row[:m].tolist())) == m, row


def assert_same_up_to_near_ties(got, want, scores, seq_lens, rtol=1e-5):
    """Same -1 padding, and slot by slot the same score up to a near tie (so the same order and set
    wherever the scores are separated by more than the tolerance)."""
    scores = np.asarray(scores)
    for b, n in enumerate(seq_lens):
        m = min(n, got.shape[1])
        assert (got[b, m:] == -1).all() and (want[b, m:] == -1).all()
        np.testing.assert_allclose(scores[b, got[b, :m]], scores[b, want[b, :m]], rtol=rtol, atol=1e-6)


def test_float_keys_preserve_order_and_merge_signed_zeros():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096)).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45])])
    keys = np.asarray(_float_to_key(jnp.asarray(x)))
    order = np.argsort(x, kind="stable")
    assert (np.diff(keys[order]) >= 0).all()
    assert ((np.diff(x[order]) == 0) == (np.diff(keys[order]) == 0)).all()  # equal keys iff equal floats
    assert keys[-6] == keys[-5] == 0


SWEEP = [  # each a batch; seq_len 0 is an idle row
    [1, 63, 64, 0],
    [65, TOPK - 1, TOPK, TOPK + 1],
    [S, 200, 0, 255],
]


@pytest.mark.parametrize("dtype", list(INDEX_FORMATS))
def test_kernel_equals_reference_equals_select_topk(dtype):
    for i, seq_lens in enumerate(SWEEP):
        args, kw, contig = make_case(i, seq_lens, dtype)
        got = kernel(*args, **kw)
        ref = np.asarray(indexer_topk_reference(*args, **kw))
        want = contiguous_topk(*contig, seq_lens, TOPK)
        np.testing.assert_array_equal(ref, want)
        np.testing.assert_array_equal(got, ref)  # order included
        for g, r in zip(got, ref):
            assert set(g.tolist()) == set(r.tolist())
        check_well_formed(got, seq_lens, TOPK)


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "int4"])
def test_random_scores_match_up_to_near_ties(dtype):
    seq_lens = [S, 130, 0, 64]
    args, kw, _ = make_case(7, seq_lens, dtype, integer=False)
    got = kernel(*args, **kw)
    ref = np.asarray(indexer_topk_reference(*args, **kw))
    scores = paged_index_scores(*args[:4], k_scale=kw["k_scale"])
    assert_same_up_to_near_ties(got, ref, scores, seq_lens)
    check_well_formed(got, seq_lens, TOPK)


def test_default_chunk_and_public_entry():
    """The public function (one chunk per row here) agrees with the small-chunk path."""
    seq_lens = [S, 65, 0, 129]
    args, kw, _ = make_case(3, seq_lens, "bf16")
    got = np.asarray(indexer_topk(*args, interpret=True, **kw))
    np.testing.assert_array_equal(got, kernel(*args, **kw))
    np.testing.assert_array_equal(got, np.asarray(indexer_topk_reference(*args, **kw)))


@pytest.mark.parametrize("topk", [16, 512])
def test_topk_smaller_than_a_page_and_larger_than_the_table(topk):
    seq_lens = [S, 10, 0, 200]
    args, kw, contig = make_case(4, seq_lens, "bf16", topk=topk)
    got = kernel(*args, **kw)
    np.testing.assert_array_equal(got, contiguous_topk(*contig, seq_lens, topk))
    check_well_formed(got, seq_lens, topk)


def with_huge_keys_past_seq_len(args, seed=0):
    """The case's arguments with huge keys at every position >= seq_len of every row (in the row's pages) and
    across the rest of the pool: an indexer that looks past seq_len would select them."""
    q, w, k_pages, block_table, seq_lens = args
    rng = np.random.default_rng(seed)
    kp = np.array(k_pages.astype(jnp.float32))
    bt = np.asarray(block_table)
    for b, n in enumerate(np.asarray(seq_lens)):
        for j in range(bt.shape[1]):
            lo = max(n - j * PAGE, 0)
            if bt[b, j] >= 0 and lo < PAGE:
                kp[bt[b, j], lo:] = 100.0 * rng.integers(1, 4, (PAGE - lo, kp.shape[2]))
    kp[np.isnan(kp)] = 1000.0
    return q, w, jnp.asarray(kp, jnp.bfloat16), block_table, seq_lens


def test_causality_keys_past_seq_len_never_matter():
    seq_lens = [100, 1, 64, 250]
    args, kw, _ = make_case(5, seq_lens, "bf16")
    base = kernel(*args, **kw)
    changed = with_huge_keys_past_seq_len(args)
    np.testing.assert_array_equal(kernel(*changed, **kw), base)
    np.testing.assert_array_equal(np.asarray(indexer_topk_reference(*changed, **kw)), base)


def test_ties_lower_position_wins():
    seq_lens = [S, 300, 0, 129]
    args, kw, _ = make_case(6, seq_lens, "bf16")
    q, w, k_pages, block_table, sl = args
    zero_q = (jnp.zeros_like(q), w, k_pages, block_table, sl)  # every valid score is 0.0
    got = kernel(*zero_q, **kw)
    for row, n in zip(got, seq_lens):
        m = min(n, TOPK)
        assert row[:m].tolist() == list(range(m))
    # three score levels: position p scores 2 if p % 3 == 0, 1 if p % 3 == 1, else 0
    kp = np.array(k_pages.astype(jnp.float32))
    bt = np.asarray(block_table)
    for b, n in enumerate(seq_lens):
        for j in range(MP):
            rows = min(max(n - j * PAGE, 0), PAGE)
            if rows:
                pos = j * PAGE + np.arange(rows)
                kp[bt[b, j], :rows] = 0.0
                kp[bt[b, j], :rows, 0] = np.select([pos % 3 == 0, pos % 3 == 1], [2.0, 1.0], 0.0)
    ones = jnp.zeros_like(q).at[:, :, 0].set(1.0)
    tied = (ones, jnp.ones_like(w), jnp.asarray(kp, jnp.bfloat16), block_table, sl)
    got = kernel(*tied, **kw)
    for row, n in zip(got, seq_lens):
        pos = np.arange(n)
        order = np.concatenate([pos[pos % 3 == 0], pos[pos % 3 == 1], pos[pos % 3 == 2]])[:TOPK]
        assert row[: len(order)].tolist() == order.tolist()
    np.testing.assert_array_equal(got, np.asarray(indexer_topk_reference(*tied, **kw)))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), seq_lens=st.lists(st.integers(0, S + 70), min_size=B, max_size=B))
def test_property_random_lengths(seed, seq_lens):
    args, kw, contig = make_case(seed, seq_lens, "bf16")
    got = kernel(*args, **kw)
    np.testing.assert_array_equal(got, contiguous_topk(*contig, seq_lens, TOPK))


@pytest.mark.parametrize("bad, match", [
    (dict(D=48), "power-of-two head dim"),
    (dict(topk=100), "topk a power of two"),
    (dict(topk=2 * MAX_TOPK), "MAX_TOPK"),
    (dict(fp8_no_scale=True), "k_scale"),
])
def test_unsupported_shapes_raise(bad, match):
    d = bad.get("D", D)
    q = jax.ShapeDtypeStruct((2, I, d), jnp.float32)
    w = jax.ShapeDtypeStruct((2, I), jnp.float32)
    kd = jnp.float8_e4m3fn if bad.get("fp8_no_scale") else jnp.bfloat16
    k_pages = jax.ShapeDtypeStruct((P, PAGE, d), kd)
    bt = jax.ShapeDtypeStruct((2, MP), jnp.int32)
    sl = jax.ShapeDtypeStruct((2,), jnp.int32)
    with pytest.raises(ValueError, match=match):
        jax.jit(partial(indexer_topk, topk=bad.get("topk", TOPK))).trace(q, w, k_pages, bt, sl)


@pytest.mark.parametrize("q_dtype, k_dtype", [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.bfloat16),
                                              (jnp.float32, jnp.float8_e4m3fn), (jnp.float32, jnp.uint8)])
def test_lowers_for_cuda_at_realistic_shapes(q_dtype, k_dtype):
    """B=4, 64 heads x 128, 128K context (2048 pages of 64), top-2048: Pallas -> Triton lowering (uint8: MXFP4)."""
    Bg, Hg, Dg, MPg, Pg = 4, 64, 128, 2048, 9001  # any pool size
    sds = jax.ShapeDtypeStruct
    int4 = k_dtype == jnp.uint8
    args = (sds((Bg, Hg, Dg), q_dtype), sds((Bg, Hg), jnp.float32), sds((Pg, PAGE, Dg // 2 if int4 else Dg), k_dtype),
            sds((Bg, MPg), jnp.int32), sds((Bg,), jnp.int32))
    kw = dict(k_scale=sds((Pg, PAGE), jnp.float32)) if k_dtype == jnp.float8_e4m3fn else {}
    if int4:
        kw = dict(k_scale=sds((Pg, PAGE, Dg // 32), jnp.uint8))
    with gpu_lowering_target():  # jax >= 0.11 needs the target GPU named
        lowered = jax.jit(partial(indexer_topk, topk=2048)).trace(*args, **kw).lower(
            lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 4 + 32 // RADIX_BITS  # scores, radix rounds, ties, compact, rank


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", ["bf16q", "fp8", "f32"])
def test_gpu_compiled_kernel_equals_reference(dtype):
    """The compiled Triton kernels at 64 heads x 128, 16K context, top-2048 (integer data: exact scores)."""
    seq_lens = [256 * PAGE, 1, 0, 5000]
    args, kw, _ = make_case(11, seq_lens, dtype, topk=2048, mp=256, pool=1100, heads=64, dim=128)
    got = np.asarray(indexer_topk(*args, **kw))
    np.testing.assert_array_equal(got, np.asarray(indexer_topk_reference(*args, **kw)))
    check_well_formed(got, seq_lens, 2048)


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (pallas_call bodies excluded: those are the kernel)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call":
            continue
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "int4"])
def test_stacked_keys_are_read_in_place_at_a_traced_layer(dtype):
    """With `layer=`, the kernel reads the stacked [L, P, page, dI] pool itself (e4m3 keys as uint32 words): no
    layer's pages (or scales) are sliced out into a buffer of their own, and it picks the right layer (the
    others are NaN) with the layer traced."""
    seq_lens = [S, 130, 0, 64]
    args, kw, _ = make_case(3, seq_lens, dtype)
    L, layer = 3, 1
    k, ks = args[2], kw["k_scale"]
    poison = lambda x: jnp.full_like(x, 255 if x.dtype == jnp.uint8 else jnp.nan)  # noqa: E731  (MXFP4: inf scales)
    stacked = jnp.stack([poison(k), k, poison(k)])
    sk = None if ks is None else jnp.stack([poison(ks), ks, poison(ks)])

    def run(q, w, pool, bt, sl, scale, i):
        return indexer_topk_chunked(q, w, pool, bt, sl, topk=TOPK, k_scale=scale, layer=i, interpret=True,
                                    max_chunk=CHUNK)

    got = np.asarray(jax.jit(run)(*args[:2], stacked, *args[3:], sk, jnp.int32(layer)))
    np.testing.assert_array_equal(got, np.asarray(indexer_topk_reference(*args, **kw)))
    jaxpr = jax.make_jaxpr(run)(*args[:2], stacked, *args[3:], sk, jnp.int32(layer)).jaxpr
    one_layer = {tuple(k.shape), (*k.shape[:2], k.shape[2] // 4)} | ({tuple(ks.shape)} if ks is not None else set())
    sliced = [e for e in _eqns(jaxpr) for v in e.outvars if tuple(v.aval.shape) in one_layer]
    assert not sliced, f"a layer of the pool is materialized: {sliced[0]}"
    scores = [e for e in _eqns(jaxpr) if e.primitive.name == "pallas_call" and "indexer_scores" in str(e.params)]
    assert len(scores) == 1
    pools = [(tuple(v.aval.shape), v.aval.dtype) for v in scores[0].invars if tuple(v.aval.shape[:2]) == (L, P)]
    want = {"fp8": [((L, P, PAGE, D // 4), jnp.uint32), ((L, P, PAGE), jnp.float32)],
            "int4": [((L, P, PAGE, D // 8), jnp.uint32), ((L, P, PAGE, D // 32), jnp.uint8)]}.get(
        dtype, [((L, P, PAGE, D), k.dtype)])
    assert pools == want, pools


@pytest.mark.parametrize("L,pages", [(1, 300_000), (21, 20_480)])
def test_fp8_keys_of_2_to_4_gib_are_addressed_as_words(L, pages):
    """An e4m3 key pool of 2-4 GiB has over 2^31 elements, and jax's Pallas-Triton lowering addresses operands of
    at most 4 GiB with int32 element offsets (seen in the Triton IR: `tensor<...xi32>` offsets at 3 GiB, i64 at
    5 GiB). The kernel reads such a pool as uint32 words, under 2^31 of them: the lowered call (for CUDA) takes
    the words. Cases: 300K pages x 64 x 128 (2.3 GiB), and GLM-5's stacked index pool read in place at a traced
    layer (21 indexer layers x 20480 pages: 3.3 GiB)."""
    B, I, Dg, MPg = 2, 16, 128, 8
    sds = jax.ShapeDtypeStruct
    stack = (L,) if L > 1 else ()
    args = (sds((B, I, Dg), jnp.bfloat16), sds((B, I), jnp.float32), sds((*stack, pages, 64, Dg), jnp.float8_e4m3fn),
            sds((B, MPg), jnp.int32), sds((B,), jnp.int32), sds((*stack, pages, 64), jnp.float32), sds((), jnp.int32))
    assert L * pages * 64 * Dg > 2**31 and L * pages * 64 * Dg <= 2**32

    def fn(*a):
        return indexer_topk(*a[:5], k_scale=a[5], layer=a[6] if L > 1 else None, topk=64)

    with gpu_lowering_target():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    words = f"tensor<{L}x{pages}x64x{Dg // 4}xui32>"
    assert words in text and L * pages * 64 * Dg // 4 < 2**31
    assert f"{L}x{pages}x64x{Dg}xf8E4M3FN" not in text.split("__gpu$xla.gpu.triton")[1].split("\n")[0]


def test_hadamard_rotates_at_full_precision():
    """The rotation asks for float32 precision: a GPU's default (TF32 operands) rotated integer test keys so far
    off that zeros came back as small e4m3 values after quantization, and the fp8 top-k on an H200 differed from
    the reference at near ties; XLA:CPU computes float32 either way, so this checks the request itself."""
    import jax

    for dt in (jnp.float32, jnp.bfloat16):
        jaxpr = jax.make_jaxpr(hadamard)(jnp.zeros((3, 128), dt))
        dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
        assert dots and all(str(e.params["precision"]).count("HIGHEST") == 2 for e in dots), dots
