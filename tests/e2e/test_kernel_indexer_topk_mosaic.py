"""The Mosaic GPU indexer top-k (`indexer_topk(..., backend="mosaic")`: Mosaic scores, XLA's top-k) == its
reference, in Mosaic GPU's interpret mode with race detection and uninitialized shared memory read as NaN.

The cases of tests/e2e/test_kernel_indexer_topk.py: NaN-poisoned pools wherever no valid position reads (pages
past seq_len, and the rows past it in the last page), permuted block tables with -1 entries, lengths around
a page and the top-k, idle rows. Integer-valued data makes every score exact whatever the summation order,
so the order is compared slot by slot under the lower-position-first tie rule; continuous data is compared
up to near ties. MXFP4 ("int4") keys: unused pool rows hold codes 0xFF with scale byte 255 (infinite scales).
Needs jax >= 0.11 (the newest-jax CI leg).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.indexer_topk import indexer_topk, indexer_topk_reference, paged_index_scores
from test_kernel_indexer_topk import (PAGE, SWEEP, TOPK, _eqns, assert_same_up_to_near_ties, check_well_formed,
                                      contiguous_topk, make_case, with_huge_keys_past_seq_len)
from test_kernel_mosaic import needs_interpret, plgpu

# MXFP4's poison (infinite scales) in the rows past seq_len of a page that is read: inf * 0 in the interpreter's numpy
# MMA (those rows' scores are masked; the valid ones are compared exactly)
pytestmark = [needs_interpret, pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")]


def mosaic(args, kw):
    params = plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
    with plgpu.force_gpu_interpret_mode(params):
        return np.asarray(indexer_topk(*args, backend="mosaic", **kw))


@pytest.mark.parametrize("dtype", ["bf16", "bf16q", "fp8", "int4"])
def test_equals_reference_slot_by_slot(dtype):
    """bf16 keys with f32 (rounded to bf16, exact here) or bf16 queries, FP8 keys (f16 operands) and MXFP4 keys
    (dI 32: one scale byte per key; values times their scales in bf16, exact)."""
    for i, seq_lens in enumerate(SWEEP):
        args, kw, contig = make_case(i, seq_lens, dtype)
        got = mosaic(args, kw)
        ref = np.asarray(indexer_topk_reference(*args, **kw))
        np.testing.assert_array_equal(ref, contiguous_topk(*contig, seq_lens, TOPK))
        np.testing.assert_array_equal(got, ref)
        check_well_formed(got, seq_lens, TOPK)


@pytest.mark.parametrize("dtype", ["bf16", "bf16q", "fp8", "int4"])
def test_continuous_scores_match_up_to_near_ties(dtype):
    """bf16: f32 queries, as three bf16 parts (exact products): the same scores up to the summation order."""
    seq_lens = [6 * PAGE, 130, 0, 64]
    args, kw, _ = make_case(7, seq_lens, dtype, integer=False)
    got = mosaic(args, kw)
    ref = np.asarray(indexer_topk_reference(*args, **kw))
    assert_same_up_to_near_ties(got, ref, paged_index_scores(*args[:4], k_scale=kw["k_scale"]), seq_lens)
    check_well_formed(got, seq_lens, TOPK)


@pytest.mark.parametrize("heads,dim,mp,dtype", [(72, 64, 9, "fp8"), (3, 128, 2, "fp8"), (72, 64, 9, "int4"),
                                                (3, 128, 2, "int4")])
def test_heads_padded_past_one_tile_dims_and_tables_past_a_block(heads, dim, mp, dtype):
    """72 heads (padded to 128: two MMA column tiles), 3 (padded to 64); dI 64 and 128 (MXFP4: a key's 2 and 4
    scale bytes read as one 16- / 32-bit word); 9 pages (two blocks of 8, the second mostly padding) and 2 (one
    block, mostly padding)."""
    S = mp * PAGE
    seq_lens = [S, S - 1, 65, 0]
    args, kw, contig = make_case(11, seq_lens, dtype, heads=heads, dim=dim, mp=mp, pool=4 * mp + 5)
    got = mosaic(args, kw)
    np.testing.assert_array_equal(got, np.asarray(indexer_topk_reference(*args, **kw)))
    np.testing.assert_array_equal(got, contiguous_topk(*contig, seq_lens, TOPK))


@pytest.mark.parametrize("heads,dim,mp", [(72, 64, 9), (3, 128, 2)])
def test_int4_scales_differ_per_key_and_block(heads, dim, mp):
    """MXFP4 keys whose scales differ per key and per block of 32 (the exponent bytes of every valid key moved by
    -3..3; the data stay exact): the kernel applies each block's own scale byte of each key (byte b of the key's
    16- / 32-bit scale word to block b). The shapes of the test above (its programs are reused)."""
    S = mp * PAGE
    seq_lens = [S, S - 1, 65, 0]
    args, kw, _ = make_case(11, seq_lens, "int4", heads=heads, dim=dim, mp=mp, pool=4 * mp + 5)
    ks = np.array(kw["k_scale"])
    moved = np.where(ks == 255, ks, ks + np.random.default_rng(1).integers(-3, 4, ks.shape)).astype(np.uint8)
    valid = (moved != 255).all(axis=-1)  # (poison stays poison: byte 255)
    assert (np.ptp(moved, axis=-1)[valid] > 0).mean() > 0.5  # most keys' blocks have scales of their own
    kw = dict(kw, k_scale=jnp.asarray(moved))
    got = mosaic(args, kw)
    np.testing.assert_array_equal(got, np.asarray(indexer_topk_reference(*args, **kw)))
    check_well_formed(got, seq_lens, TOPK)


@pytest.mark.parametrize("topk", [16, 512])
def test_topk_smaller_than_a_page_and_larger_than_the_table(topk):
    seq_lens = [6 * PAGE, 10, 0, 200]
    args, kw, contig = make_case(4, seq_lens, "bf16q", topk=topk)
    got = mosaic(args, kw)
    np.testing.assert_array_equal(got, contiguous_topk(*contig, seq_lens, topk))
    check_well_formed(got, seq_lens, topk)


def test_keys_past_seq_len_never_matter():
    """Huge keys at every position at or past a row's seq_len (and across the rest of the pool) change nothing."""
    args, kw, _ = make_case(5, [100, 1, 64, 250], "bf16q")
    np.testing.assert_array_equal(mosaic(with_huge_keys_past_seq_len(args), kw), mosaic(args, kw))


@pytest.mark.parametrize("dtype", ["fp8", "int4"])
def test_stacked_keys_are_read_in_place_at_a_traced_layer(dtype):
    """With `layer=` the kernel reads the stacked pool [L, P, 64, ...] itself, flattened to [L * P] pages (MXFP4:
    the codes as [L * P * 64, dI / 2] bytes and each key's scale bytes as one word, [L * P, 64]): no layer's pages
    or scales are sliced out into a buffer of their own, and it picks the right layer (the others poisoned: NaN,
    or MXFP4 codes 0xFF with infinite scales) with the layer traced."""
    seq_lens = [6 * PAGE, 130, 0, 64]
    args, kw, _ = make_case(3, seq_lens, dtype)
    L, layer = 3, 1
    k, ks = args[2], kw["k_scale"]
    poison = lambda x: jnp.full_like(x, 255 if x.dtype == jnp.uint8 else jnp.nan)  # noqa: E731
    stacked, sk = (jnp.stack([poison(x), x, poison(x)]) for x in (k, ks))

    def run(q, w, pool, bt, sl, scale, i):
        return indexer_topk(q, w, pool, bt, sl, topk=TOPK, k_scale=scale, layer=i, backend="mosaic")

    params = plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
    with plgpu.force_gpu_interpret_mode(params):
        got = np.asarray(jax.jit(run)(*args[:2], stacked, *args[3:], sk, jnp.int32(layer)))
    np.testing.assert_array_equal(got, np.asarray(indexer_topk_reference(*args, **kw)))
    jaxpr = jax.make_jaxpr(run)(*args[:2], stacked, *args[3:], sk, jnp.int32(layer)).jaxpr
    P = k.shape[0]
    one_layer = {tuple(k.shape), tuple(ks.shape), (P * PAGE, k.shape[2]), (P, PAGE)}
    sliced = [e for e in _eqns(jaxpr) for v in e.outvars if tuple(v.aval.shape) in one_layer]
    assert not sliced, f"a layer of the pool is materialized: {sliced[0]}"
    pools = [(tuple(v.aval.shape), v.aval.dtype) for e in _eqns(jaxpr) if e.primitive.name == "mpmd_map"
             for v in e.invars if v.aval.shape[0] in (L * P, L * P * PAGE)]
    want = {"fp8": [((L * P * PAGE, k.shape[2]), k.dtype), ((L * P, PAGE), jnp.float32)],
            "int4": [((L * P * PAGE, k.shape[2]), jnp.uint8), ((L * P, PAGE), jnp.uint8)]}[dtype]  # dI 32: 1 byte
    assert pools == want, pools


@pytest.mark.parametrize("change,match", [
    (dict(dim=48), "multiple of 32"),
    (dict(dtype="f32"), "bfloat16, float8_e4m3fn or uint8 \\(MXFP4\\) keys"),
    (dict(heads=300), "at most 256 heads"),
    (dict(dtype="int4", dim=256), "MXFP4 keys of dI 32, 64 or 128"),
])
def test_unsupported_shapes_raise(change, match):
    dtype = change.pop("dtype", "bf16q")
    args, kw, _ = make_case(0, [64, 64], dtype, **change)
    with pytest.raises(ValueError, match=match):
        indexer_topk(*args, backend="mosaic", **kw)


def test_unknown_backend_is_refused():
    args, kw, _ = make_case(0, [64], "bf16q")
    with pytest.raises(ValueError, match="backend must be one of"):
        indexer_topk(*args, backend="cuda", **kw)
