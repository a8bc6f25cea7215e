"""Block bounds of the indexer's scores (`reference.key_block_bounds` / `block_score_bound`) and the top-k an
indexer with its key history on the host finds from them (`host_index_select_reference`), against the exact
scores: the bound is never below a score of its block (negative head weights included), exact mode's top-k is
the full top-k and reads every block holding one of its positions, a budget of every live block is exact mode,
and recall grows with the budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.indexer_topk.reference import (block_score_bound, host_index_select_reference, index_scores,
                                                   key_block_bounds, select_topk)

B, I, D, S, K = 2, 4, 16, 256, 24
BLOCKS = (8, 16, 64)


def _case(seed, kind, neg_w):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, I, D)).astype(np.float32)
    if kind == "clustered":  # keys drift slowly with position (what makes block bounds tight)
        k = np.cumsum(rng.standard_normal((B, S, D)) * 0.2, axis=1).astype(np.float32)
    elif kind == "integer":  # many exact ties
        k = rng.integers(-3, 4, (B, S, D)).astype(np.float32)
        q = np.round(q * 2)
    else:
        k = rng.standard_normal((B, S, D)).astype(np.float32) * rng.choice([1e-3, 1.0, 1e3])
    w = np.abs(rng.standard_normal((B, I))).astype(np.float32)
    if neg_w:
        w[:, ::2] *= -1
    lens = rng.integers(1, S + 1, B)
    valid = np.arange(S)[None] < lens[:, None]
    return jnp.asarray(q), jnp.asarray(w), jnp.asarray(k), jnp.asarray(valid)


@jax.jit
def _scores(q, w, k):
    return index_scores(q[:, None], w[:, None], k)[:, 0]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["normal", "clustered", "integer"]),
       neg_w=st.booleans(), block=st.sampled_from(BLOCKS))
def test_block_bound_is_never_below_a_score(seed, kind, neg_w, block):
    q, w, k, _ = _case(seed, kind, neg_w)
    kmin, kmax = jax.jit(key_block_bounds, static_argnums=1)(k, block)
    bound = np.asarray(jax.jit(block_score_bound)(q[:, None], w[:, None], kmin, kmax)[:, 0])  # [B, NB]
    scores = np.asarray(_scores(q, w, k)).reshape(B, S // block, block)
    assert (bound[..., None] >= scores).all(), float((scores - bound[..., None]).max())


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["normal", "clustered", "integer"]),
       neg_w=st.booleans(), block=st.sampled_from(BLOCKS))
def test_exact_mode_is_the_full_top_k_and_budgets_grow_to_it(seed, kind, neg_w, block):
    q, w, k, valid = _case(seed, kind, neg_w)
    want = np.asarray(select_topk(_scores(q, w, k), valid, K))
    sel = jax.jit(host_index_select_reference, static_argnames=("topk", "block", "budget", "rank"))
    got, read, live = (np.asarray(x) for x in sel(q, w, k, valid, topk=K, block=block))
    np.testing.assert_array_equal(got, want)
    assert (read <= live).all() and (read >= 1).all()
    nb = S // block
    # every block holding a top-k position was read, so exact mode reads at least that many
    assert all(read[b] >= len({p // block for p in want[b] if p >= 0}) for b in range(B))
    for rank in ("bound", "mean", "centre"):
        recall_prev = np.zeros(B)
        for budget in sorted({1, 2, nb // 2, nb}):
            pos = np.asarray(sel(q, w, k, valid, topk=K, block=block, budget=budget, rank=rank)[0])
            recall = np.array([len(set(pos[b][pos[b] >= 0]) & set(want[b][want[b] >= 0]))
                               / max((want[b] >= 0).sum(), 1) for b in range(B)])
            assert (recall >= recall_prev - 1e-9).all(), (rank, budget, recall, recall_prev)
            recall_prev = recall
        np.testing.assert_array_equal(pos, want)  # a budget of every block is exact mode


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="do not split into blocks of 48"):
        key_block_bounds(jnp.zeros((1, 100, 8)), 48)
    with pytest.raises(ValueError, match="rank must be one of"):
        host_index_select_reference(jnp.zeros((1, 2, 8)), jnp.ones((1, 2)), jnp.zeros((1, 64, 8)),
                                    jnp.ones((1, 64), bool), 4, 16, budget=2, rank="max")


@pytest.mark.slow
def test_index_tier_experiment_runs(tmp_path, capsys):
    """experiments/index_tier.py --quick on the shipped trained model: every step's exact mode reads at most the
    live blocks, and a budget of every live block finds the whole top-k with either ranking; with every page
    summary exact mode reads at least the blocks holding a top-k position, and the position buckets hold every
    step. The recording shows its progress, to the last position."""
    import json
    import re

    from experiments import index_tier

    assert index_tier.main(["--quick", "--out", str(tmp_path)]) == 0
    assert re.search(r"decoded (\d+)/\1 positions", capsys.readouterr().err)  # to the last position
    out = json.loads((tmp_path / "index_tier.json").read_text())
    assert (tmp_path / "index_tier.png").exists()
    for bs, s in out["summary"].items():
        assert 0 < s["exact_blocks_read"] <= s["live_blocks"] + 1e-9, bs
        assert 0 < s["topk_fraction_of_blocks"] <= s["exact_fraction_read"] + 1e-9, bs  # exact mode reads them all
        for rank in ("bound", "mean"):
            rec = s[rank]["recall_by_fraction_read"]
            assert rec["1.0"] == 1.0 and all(0 <= v <= 1 for v in rec.values()), (bs, rank, rec)
        assert set(s["summaries"]) == {"box", "ball", "pca_box", "ball_pca", "rvq"}, bs
        for kind, d in s["summaries"].items():  # every summary: exact mode reads the floor and at most the live blocks
            assert d["floor_blocks"] <= d["exact_blocks_read"] + 1e-9 <= s["live_blocks"] + 2e-9, (bs, kind)
            assert d["page_bytes"] <= 2 * 2 * out["index_dim"] and d["bound_excess_over_best_score"] >= 0, (bs, kind)
            assert d["recall_by_fraction_read"]["1.0"] == 1.0 and sum(b["steps"] for b in d["by_position"].values()) \
                == out["per_block_size"][bs]["per_index_layer"][0]["steps"], (bs, kind)
            rec = d["centre"]["recall_by_fraction_read"]  # ranked by the summary's centre: no bound, a curve to 1
            assert rec["1.0"] == 1.0 and list(rec.values()) == sorted(rec.values()), (bs, kind, rec)


@pytest.mark.parametrize("argv, match", [(["--blocks", "16,x"], "--blocks: positive sizes"),
                                         (["--blocks", "0"], "--blocks: positive sizes"),
                                         (["--summaries", "box,cube"], "--summaries: some of"),
                                         (["--sequences", "0"], "need --sequences >= 1"),
                                         (["--trace-start", "4096"], "0 <= --trace-start < --seq-len")])
def test_index_tier_refuses_bad_options(argv, match, capsys):
    from experiments import index_tier

    with pytest.raises(SystemExit) as e:
        index_tier.main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err
