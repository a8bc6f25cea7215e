"""The demo's text workload (`train.data.document_prompts`) never repeats a prompt's beginning unless asked to:
prompts start at distinct documents, and once every document has one, at distinct offsets within them."""

from __future__ import annotations

import numpy as np
import pytest

from hisparse_jax.train import data


@pytest.fixture(scope="module")
def held():
    return data.load_corpus()[1]


def _lengths(n: int, longest: int) -> list[int]:
    lens = np.linspace(longest * 0.55, longest, n).astype(int)  # as `demo_workload.text_workload`
    np.random.default_rng(0).shuffle(lens)
    return lens.tolist()


@pytest.mark.parametrize("n", [16, 64, 130])
def test_more_prompts_than_documents_start_at_distinct_places(held, n):
    docs = int(np.count_nonzero(held == data.BOS_ID))
    lens = _lengths(n, 4096)
    prompts = data.document_prompts(held, lens, seed=0)
    assert [len(p) for p in prompts] == lens and prompts == data.document_prompts(held, lens, seed=0)
    assert len({tuple(p[:64]) for p in prompts}) == n  # no two share a first page (a prefix-cache hit)
    # the first pass as before: from the start of distinct documents (but a start clamped to the end of the text)
    k = min(n, docs)
    assert prompts[:k] == data.document_prompts(held, lens, seed=0, repeat=True)[:k]
    assert sum(p[0] == data.BOS_ID for p in prompts[:k]) >= k - 4


def test_repeat_draws_the_documents_again_from_their_starts(held):
    docs = int(np.count_nonzero(held == data.BOS_ID))
    lens = [300] * (docs + 5)
    again = data.document_prompts(held, lens, seed=1, repeat=True)
    assert all(p[0] == data.BOS_ID for p in again)
    assert len({tuple(p[:64]) for p in again}) <= docs + 1  # later prompts begin as earlier ones did
    distinct = data.document_prompts(held, lens, seed=1)
    assert distinct[:docs] == again[:docs] and len({tuple(p[:64]) for p in distinct}) == len(lens)


def test_rvq_calibration_text_holds_nearly_every_byte_of_the_held_out_text(held):
    """`calibration_ids` for the text workload: training text only, and enough of it that the bytes it never shows
    (whose index layer-0 keys, a function of the byte alone, its codebooks cannot code: radius 6 against 0.004 for the
    8K model's) are under 0.2 % of the held-out text; 4 windows of 2048 left 0.28 %."""
    from hisparse_jax.demo_workload import CALIBRATION_TOKENS, CALIBRATION_WINDOWS, calibration_ids

    ids = np.asarray(calibration_ids("text", None, 10 ** 6, 0))
    assert ids.shape == (CALIBRATION_WINDOWS, CALIBRATION_TOKENS)
    assert set(ids.tolist()[0]) <= set(np.unique(data.load_corpus()[0]).tolist())
    unseen = ~np.isin(held, np.unique(ids))
    assert unseen.mean() < 0.002, unseen.mean()
    assert np.asarray(calibration_ids("text", None, 300, 0)).shape == (CALIBRATION_WINDOWS, 300)  # the prompts' length
