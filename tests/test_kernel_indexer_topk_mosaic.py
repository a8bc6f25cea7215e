"""The Mosaic GPU indexer top-k (`indexer_topk(..., backend="mosaic")`: Mosaic scores, XLA's top-k) == its
reference, in Mosaic GPU's interpret mode with race detection and uninitialized shared memory read as NaN.

The cases of tests/test_kernel_indexer_topk.py: NaN-poisoned pools wherever no valid position reads (pages
past seq_len, and the rows past it in the last page), permuted block tables with -1 entries, lengths around
a page and the top-k, idle rows. Integer-valued data makes every score exact whatever the summation order,
so the order is compared slot by slot under the lower-position-first tie rule; continuous data is compared
up to near ties. Needs jax >= 0.11 (the newest-jax CI leg).
"""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels.indexer_topk import indexer_topk, indexer_topk_reference, paged_index_scores
from test_kernel_indexer_topk import (PAGE, SWEEP, TOPK, assert_same_up_to_near_ties, check_well_formed,
                                      contiguous_topk, make_case, with_huge_keys_past_seq_len)
from test_kernel_mosaic import needs_interpret, plgpu

pytestmark = needs_interpret


def mosaic(args, kw):
    params = plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
    with plgpu.force_gpu_interpret_mode(params):
        return np.asarray(indexer_topk(*args, backend="mosaic", **kw))


@pytest.mark.parametrize("dtype", ["bf16", "bf16q", "fp8"])
def test_equals_reference_slot_by_slot(dtype):
    """bf16 keys with f32 (rounded to bf16, exact here) or bf16 queries, and FP8 keys (f16 operands)."""
    for i, seq_lens in enumerate(SWEEP):
        args, kw, contig = make_case(i, seq_lens, dtype)
        got = mosaic(args, kw)
        ref = np.asarray(indexer_topk_reference(*args, **kw))
        np.testing.assert_array_equal(ref, contiguous_topk(*contig, seq_lens, TOPK))
        np.testing.assert_array_equal(got, ref)
        check_well_formed(got, seq_lens, TOPK)


@pytest.mark.parametrize("dtype", ["bf16", "bf16q", "fp8"])
def test_continuous_scores_match_up_to_near_ties(dtype):
    """bf16: f32 queries, as three bf16 parts (exact products): the same scores up to the summation order."""
    seq_lens = [6 * PAGE, 130, 0, 64]
    args, kw, _ = make_case(7, seq_lens, dtype, integer=False)
    got = mosaic(args, kw)
    ref = np.asarray(indexer_topk_reference(*args, **kw))
    assert_same_up_to_near_ties(got, ref, paged_index_scores(*args[:4], k_scale=kw["k_scale"]), seq_lens)
    check_well_formed(got, seq_lens, TOPK)


@pytest.mark.parametrize("heads,dim,mp", [(72, 64, 9), (3, 128, 2)])
def test_heads_padded_past_one_tile_dims_and_tables_past_a_block(heads, dim, mp):
    """72 heads (padded to 128: two MMA column tiles), 3 (padded to 64); dI 64 and 128; 9 pages (two blocks of
    8, the second mostly padding) and 2 (one block, mostly padding)."""
    S = mp * PAGE
    seq_lens = [S, S - 1, 65, 0]
    args, kw, contig = make_case(11, seq_lens, "fp8", heads=heads, dim=dim, mp=mp, pool=4 * mp + 5)
    got = mosaic(args, kw)
    np.testing.assert_array_equal(got, np.asarray(indexer_topk_reference(*args, **kw)))
    np.testing.assert_array_equal(got, contiguous_topk(*contig, seq_lens, TOPK))


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


@pytest.mark.parametrize("change,match", [
    (dict(dim=48), "multiple of 32"),
    (dict(dtype="f32"), "bfloat16 or float8_e4m3fn keys"),
    (dict(heads=300), "at most 256 heads"),
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
