"""Page summaries of the host-tier indexer keys (`reference.key_block_summary` / `summary_score_bound`: box, ball,
box in a per-layer basis, ball + box in a basis, per-key RVQ codes of the key before RoPE) against float64 NumPy
oracles: every valid key's score is at most its page's bound for every summary (random pages and adversarial ones:
all keys equal, one outlier, keys along one axis, negative head weights, a zero query, large magnitudes, padded rows
holding anything, a basis or codebook that fits the keys, one that does not, one not quite orthonormal or perturbed);
reading pages best bound first until no unread bound reaches the k-th score read so far finds the brute-force top-k;
a summary is that of the page's valid rows only (a key appended, a page reused for other keys); the summaries fit
the box's bytes and are exact in bf16; RVQ's pieces (the RoPE it undoes is the model's, codebooks, codes, radii
rounded up to e4m3) against NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.indexer_topk.reference import (SUMMARY_KINDS, host_block_ranks, host_index_select_reference,
                                                   index_scores, key_block_summary, pca_basis, rope_rotate,
                                                   rope_unrotate, round_e4m3_up, rvq_decode, rvq_encode, rvq_fit,
                                                   summary_centre, summary_page_values, summary_rank,
                                                   summary_score_bound)

B, I, D, S, K = 2, 4, 16, 256, 16
R = 8  # the keys' rotated dimensions ("rvq" undoes RoPE on them)
STAGES, SIZE = 3, 32  # "rvq" in these tests: more stages than the box's bytes buy at D = 16 (the bound holds for any)
_ANGLES = np.arange(S)[:, None] * 10000.0 ** (-np.arange(R // 2) * 2 / R)[None]
COS, SIN = np.cos(_ANGLES).astype(np.float32), np.sin(_ANGLES).astype(np.float32)
BLOCKS = (16, 64)
CASES = ("normal", "drift", "equal", "outlier", "axis", "offset")
BASES = ("fit", "random", "skewed")

_summary = jax.jit(key_block_summary, static_argnames=("kind", "block"))
_bound = jax.jit(summary_score_bound, static_argnames=("kind",))
_ranks = jax.jit(host_block_ranks, static_argnames=("block", "rank", "summary"))
_select = jax.jit(host_index_select_reference, static_argnames=("topk", "block", "budget", "rank", "summary"))
_select_within = jax.jit(host_index_select_reference, static_argnames=("topk", "block", "rank", "summary"))


def _keys(rng, case, scale):
    if case == "normal":
        k = rng.standard_normal((B, S, D))
    elif case == "drift":  # slowly moving keys: what makes page summaries tight
        k = np.cumsum(rng.standard_normal((B, S, D)) * 0.2, axis=1)
    elif case == "equal":  # every key of a page the same
        k = np.repeat(rng.standard_normal((B, S // 16, 1, D)), 16, axis=2).reshape(B, S, D)
    elif case == "outlier":  # tight pages, one key far out in each
        k = rng.standard_normal((B, S, D)) * 0.01
        k[:, rng.integers(0, S, 8)] += rng.standard_normal((B, 8, D)) * 50
    elif case == "axis":  # every key along one axis
        k = np.zeros((B, S, D))
        k[..., rng.integers(D)] = rng.standard_normal((B, S))
    else:  # a large shared offset (trained indexer keys have one) plus small variation
        k = rng.standard_normal(D) * 10 + rng.standard_normal((B, S, D))
    return (k * scale).astype(np.float32)


def _codec(rng, keys, how):
    """"rvq"'s basis: (codebooks fitted to the keys, random ones, or fitted ones perturbed; COS, SIN)."""
    if how == "random":
        return rng.standard_normal((STAGES, SIZE, D)).astype(np.float32), COS, SIN
    n = keys.shape[-2]
    books = np.asarray(rvq_fit(rope_unrotate(jnp.asarray(keys), COS[:n], SIN[:n]).reshape(-1, D), STAGES, SIZE,
                               iters=4))
    if how == "skewed":
        books = books + rng.standard_normal(books.shape).astype(np.float32) * 0.05
    return books, COS, SIN


def _basis(rng, keys, kind, how):
    if kind == "rvq":
        return _codec(rng, keys, how)
    m = summary_rank(kind, D)
    if how == "random":  # a basis with nothing to do with the keys
        return np.linalg.qr(rng.standard_normal((D, D)))[0][:, :m].astype(np.float32)
    x = keys.reshape(-1, D)
    if kind == "ball_pca":
        x = (keys.reshape(B, S // 16, 16, D) - keys.reshape(B, S // 16, 16, D).mean(2, keepdims=True)).reshape(-1, D)
    u = np.asarray(pca_basis(jnp.asarray(x), m))
    if how == "skewed":  # not quite orthonormal: the bound must charge for it
        u = u + rng.standard_normal(u.shape).astype(np.float32) * 0.05
    return u


def _case(seed, case, scale, neg_w, zero_q, pad, aim=False):
    rng = np.random.default_rng(seed)
    k = _keys(rng, case, scale)
    q = rng.standard_normal((B, I, D)).astype(np.float32) * np.float32(scale)
    if zero_q:
        q[0] = 0
    w = np.abs(rng.standard_normal((B, I))).astype(np.float32)
    if neg_w:
        w[:, ::2] *= -1
    lens = rng.integers(1, S + 1, B)
    valid = np.arange(S)[None] < lens[:, None]
    if aim:  # heads aimed at a key's deviation from its page's mean, its opposite, the key itself: bounds' worst case
        for b in range(B):
            s = rng.integers(0, min(lens[b], 64), I)
            dev = k[b, s] - k[b, :min(lens[b], 64)].mean(0)
            q[b] = np.stack([dev[0], -dev[1], k[b, s[2]], dev[3] + 0.1 * q[b, 3]]) / np.float32(scale)
    if pad == "zeros":  # the store's unwritten rows
        k[~valid] = 0
    elif pad == "junk":  # a reused page's stale rows
        k[~valid] = rng.standard_normal(k[~valid].shape) * 1e4
    return rng, q, w, k, valid


def _oracle_scores(q, w, k):
    """float64 I(t, s) = sum_h w_h relu(q_h . k_s): [B, S]."""
    dots = np.einsum("bid,bsd->bis", q.astype(np.float64), k.astype(np.float64))
    return np.einsum("bis,bi->bs", np.maximum(dots, 0), w.astype(np.float64))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), case=st.sampled_from(CASES), scale=st.sampled_from([1e-3, 1.0, 1e3]),
       neg_w=st.booleans(), zero_q=st.booleans(), pad=st.sampled_from(["zeros", "junk"]),
       aim=st.booleans(), basis=st.sampled_from(BASES), block=st.sampled_from(BLOCKS))
def test_every_valid_score_is_at_most_its_page_bound(seed, case, scale, neg_w, zero_q, pad, aim, basis, block):
    rng, q, w, k, valid = _case(seed, case, scale, neg_w, zero_q, pad, aim)
    want = _oracle_scores(q, w, k).reshape(B, S // block, block)
    got32 = np.asarray(index_scores(q[:, None], w[:, None], k)[:, 0]).reshape(B, S // block, block)
    vb = valid.reshape(B, S // block, block)
    for kind in SUMMARY_KINDS:
        u = _basis(rng, k, kind, basis) if kind in ("pca_box", "ball_pca", "rvq") else None
        summ = _summary(kind, k, block, valid, u)
        for x in summ:  # bf16-exact: the device's bf16 copy is the summary itself
            x = np.asarray(x)
            np.testing.assert_array_equal(x, x.astype(jnp.bfloat16).astype(np.float32))
        bound = np.asarray(_bound(q[:, None], w[:, None], kind, summ, u)[:, 0])[..., None]  # [B, NB, 1]
        for scores in (want, got32):  # the exact score and the float32 score the indexer computes
            over = np.where(vb, scores - bound, -np.inf)
            assert (over <= 0).all(), (kind, float(over.max()), float(np.abs(scores).max()))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), neg_w=st.booleans())
def test_the_ball_bound_is_at_most_the_per_head_one(seed, neg_w):
    """Bounding the heads together (`JOINT_HEADS_MAX`) never loses to summing each head's q . c + |q| r (float64
    oracle), and with every head aimed the same way it is the per-head sum."""
    rng, q, w, k, valid = _case(seed, "offset", 1.0, neg_w, False, "zeros")
    c, r = (np.asarray(x).astype(np.float64) for x in _summary("ball", k, 16, valid))
    qc = np.einsum("bid,bnd->bin", q, c)
    qn = np.linalg.norm(q.astype(np.float64), axis=-1)[..., None]
    hi, lo = qc + qn * r[:, None], qc - qn * r[:, None]
    per_head = np.where(w[..., None] >= 0, w[..., None] * np.maximum(hi, 0), w[..., None] * np.maximum(lo, 0)).sum(1)
    slack = 2.0 ** -12 * (np.abs(w)[..., None] * qn * (np.linalg.norm(c, axis=-1) + r)[:, None]).sum(1)
    got = np.asarray(_bound(q[:, None], w[:, None], "ball", (c.astype(np.float32), r.astype(np.float32)))[:, 0])
    assert (got <= per_head + slack * 1.001 + 1e-6).all()
    same = np.repeat(q[:, :1], I, axis=1)  # every head the same: nothing to gain
    wp = np.abs(w)
    got = np.asarray(_bound(same[:, None], wp[:, None], "ball", (c.astype(np.float32), r.astype(np.float32)))[:, 0])
    qn1 = np.linalg.norm(same[:, 0].astype(np.float64), axis=-1)[:, None]
    want = wp.sum(1)[:, None] * np.maximum(np.einsum("bd,bnd->bn", same[:, 0], c) + qn1 * r, 0)
    want += 2.0 ** -12 * wp.sum(1)[:, None] * qn1 * (np.linalg.norm(c, axis=-1) + r)  # the float32 slack
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _bound_ordered_read(bound, scores, valid, block, k):
    """Reading pages best bound first until no unread page's bound reaches the k-th best score read so far
    (numpy): -> (pages read, the k best scores read, sorted descending)."""
    order = np.argsort(-bound, kind="stable")
    got, read = [], 0
    for p in order:
        if bound[p] == -np.inf:  # no valid row (+inf: a bound that bounds nothing, read)
            break
        if len(got) >= k and bound[p] < sorted(got, reverse=True)[k - 1]:
            break
        got += list(scores[p * block:(p + 1) * block][valid[p * block:(p + 1) * block]])
        read += 1
    return read, np.sort(np.array(got))[::-1][:k]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), case=st.sampled_from(CASES), neg_w=st.booleans(),
       basis=st.sampled_from(BASES), block=st.sampled_from(BLOCKS))
def test_bound_ordered_reading_finds_the_brute_force_top_k(seed, case, neg_w, basis, block):
    rng, q, w, k, valid = _case(seed, case, 1.0, neg_w, False, "junk")
    scores = np.asarray(index_scores(q[:, None], w[:, None], k)[:, 0])  # the indexer's float32 scores
    for kind in SUMMARY_KINDS:
        u = _basis(rng, k, kind, basis) if kind in ("pca_box", "ball_pca", "rvq") else None
        bound = np.asarray(_ranks(q, w, k, valid, block, "bound", kind, u))
        pos, read, live = (np.asarray(x) for x in _select(q, w, k, valid, topk=K, block=block, summary=kind, basis=u))
        for b in range(B):
            brute = np.sort(scores[b][valid[b]])[::-1][:K]  # score multisets: ties cannot mislead
            n_read, found = _bound_ordered_read(bound[b], scores[b], valid[b], block, K)
            np.testing.assert_array_equal(found, brute, err_msg=kind)
            np.testing.assert_array_equal(np.sort(scores[b][pos[b][pos[b] >= 0]])[::-1], brute, err_msg=kind)
            floor = len({p // block for p in pos[b] if p >= 0})  # pages holding a top-k row
            assert floor <= read[b] <= min(n_read, live[b]), (kind, floor, read[b], n_read, live[b])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), case=st.sampled_from(CASES), n=st.integers(1, 63))
def test_a_summary_is_that_of_the_page_valid_rows(seed, case, n):
    """Appending a key to a page, or reusing a page for other keys: the summary is a function of the valid rows
    only, the oracle's (float64) extremes, mean, radii and coefficient boxes, rounded outward to bf16."""
    rng = np.random.default_rng(seed)
    old = _keys(rng, case, 1.0)[0, :64] * 100  # the page's previous owner
    new = _keys(rng, case, 1.0)[1, :64]
    valid = np.arange(64) < n
    for kind in SUMMARY_KINDS:
        u = None
        if kind in ("pca_box", "ball_pca"):
            u = np.asarray(pca_basis(jnp.asarray(new - new.mean(0) if kind == "ball_pca" else new),
                                     summary_rank(kind, D)))
        elif kind == "rvq":  # the page's rows sit at positions 0..63
            u = (_codec(rng, new[None], "fit")[0], COS[:64], SIN[:64])
        page = np.where(valid[:, None], new, old)  # rows past n still hold the old owner's keys
        got = [np.asarray(x)[0, 0] for x in _summary(kind, page[None], 64, valid[None], u)]
        fresh = [np.asarray(x)[0, 0] for x in _summary(kind, new[None], 64, valid[None], u)]
        for a, b in zip(got, fresh):
            np.testing.assert_array_equal(a, b)
        # the key appended next (row n): the page's new summary bounds every score of its rows, the new one too
        grown = [np.asarray(x)[0, 0] for x in _summary(kind, new[None], 64, (np.arange(64) <= n)[None], u)]
        q = rng.standard_normal((1, 1, I, D)).astype(np.float32)
        wt = rng.standard_normal((1, 1, I)).astype(np.float32)
        bound = float(np.asarray(_bound(q, wt, kind, [x[None, None] for x in grown], u))[0, 0, 0])
        assert (_oracle_scores(q[0], wt[0], new[None, :n + 1])[0] <= bound).all(), kind
        rows = new[:n].astype(np.float64)
        ulp = 2.0 ** -7  # bf16's relative spacing
        if kind == "rvq":  # each valid row's nearest-centroid codes and its residual rounded up to e4m3
            codes, radius = got
            assert (codes[n:] == 0).all() and (radius[n:] == -1).all()
            x = np.asarray(rope_unrotate(jnp.asarray(new[:n]), COS[:n], SIN[:n])).astype(np.float64)
            for g, book in enumerate(u[0].astype(np.float64)):
                d = ((x[:, None] - book[None]) ** 2).sum(-1)
                chosen = d[np.arange(n), codes[:n, g].astype(int)]
                assert (chosen <= d.min(1) * (1 + 1e-5) + 1e-9).all()  # the nearest (ties within float32)
                x = x - book[codes[:n, g].astype(int)]
            res = np.linalg.norm(x, axis=1)
            slack = 2.0 ** -12 * np.linalg.norm(rows, axis=1)  # `reference.SUMMARY_SLACK` |k| for float32 rounding
            assert (radius[:n] >= res).all() and (radius[:n] <= (res + slack) * 1.125 + 2.0 ** -9).all()
            continue
        if kind == "box":
            lo, hi = got
            assert (lo <= rows.min(0)).all() and (hi >= rows.max(0)).all()
            assert (lo >= rows.min(0) - ulp * np.abs(rows.min(0))).all()
            assert (hi <= rows.max(0) + ulp * np.abs(rows.max(0))).all()
            continue
        if kind in ("ball", "ball_pca"):
            c, r = got[0], got[1]
            np.testing.assert_allclose(c, rows.mean(0), rtol=ulp, atol=1e-6 * np.abs(rows).max())
            dist = np.linalg.norm(rows - c, axis=1).max()
            assert dist <= r <= dist * (1 + 2 * ulp) + 1e-30
            if kind == "ball":
                continue
            rows = rows - c
        amin, amax, rp = got[-3:]
        a = rows @ u.astype(np.float64)
        tol = 2.0 ** -18 * np.linalg.norm(new[:n], axis=1).max()  # the box holds float32 coefficients
        assert (amin <= a.min(0) + tol).all() and (amax >= a.max(0) - tol).all()
        res = np.linalg.norm(rows - a @ u.astype(np.float64).T, axis=1).max()
        assert res <= rp <= res * (1 + 2 * ulp) + 2.0 ** -10 * np.linalg.norm(new[:n], axis=1).max()


def test_budgeted_recall_is_the_top_k_share_of_the_pages_read():
    """experiments/index_tier.py's recall curve (the share of the exact top-k in the best-ranked pages) is the
    recall of `host_index_select_reference`'s budgeted top-k, for every summary."""
    from experiments.index_tier import budget_recall

    rng, q, w, k, valid = _case(7, "drift", 1.0, True, False, "zeros")
    full, _, live = _select(q, w, k, valid, topk=K, block=16)
    want = np.zeros((B, S), bool)
    for b in range(B):
        want[b, np.asarray(full[b])[np.asarray(full[b]) >= 0]] = True
    fractions = (0.1, 0.25, 0.5, 1.0)
    for kind in SUMMARY_KINDS:
        u = _basis(rng, k, kind, "fit") if kind in ("pca_box", "ball_pca", "rvq") else None
        curve = np.asarray(budget_recall(_ranks(q, w, k, valid, 16, "bound", kind, u), jnp.asarray(want), live, 16,
                                         K, fractions))
        for i, f in enumerate(fractions):
            budget = np.maximum(np.ceil(f * np.asarray(live)).astype(np.int32), -(-K // 16))
            got = np.asarray(_select_within(q, w, k, valid, topk=K, block=16, budget=jnp.asarray(budget),
                                            summary=kind, basis=u)[0])
            rec = [len(set(got[b][got[b] >= 0]) & set(np.flatnonzero(want[b]))) / want[b].sum() for b in range(B)]
            np.testing.assert_allclose(curve[:, i], rec, rtol=1e-6, err_msg=f"{kind} {f}")


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), block=st.sampled_from(BLOCKS))
def test_a_summary_centre_is_the_centre_of_its_keys(seed, block):
    """`summary_centre` (budgeted mode's rank "centre"), against NumPy: the box's midpoint of each dimension's
    extremes; the ball's centre, the valid keys' mean (to bf16); a page of one repeated key (exact in bf16) centred
    on that key by every summary, the basis kinds with a basis that holds the key."""
    rng, q, w, k, valid = _case(seed, "normal", 1.0, False, False, "junk")
    k = np.asarray(jnp.asarray(k).astype(jnp.bfloat16).astype(jnp.float32))
    nb = S // block
    kb, vb = k.reshape(B, nb, block, D), valid.reshape(B, nb, block)
    got = np.asarray(summary_centre("box", _summary(kind="box", k=jnp.asarray(k), block=block,
                                                    valid=jnp.asarray(valid))))
    ball = np.asarray(summary_centre("ball", _summary(kind="ball", k=jnp.asarray(k), block=block,
                                                      valid=jnp.asarray(valid))))
    for b in range(B):
        for j in range(nb):
            rows = kb[b, j][vb[b, j]]
            if not len(rows):
                continue
            np.testing.assert_array_equal(got[b, j], (rows.min(0) + rows.max(0)) / 2)  # exact: bf16 extremes
            np.testing.assert_allclose(ball[b, j], rows.astype(np.float64).mean(0), rtol=2 ** -7, atol=1e-6)
    # each page one key, the keys in an 8-dimensional subspace that the pca_box basis holds (ball_pca's centre is
    # the ball's, the key itself, whatever its basis)
    basis = np.linalg.qr(rng.standard_normal((D, D)))[0].astype(np.float32)
    one = rng.standard_normal((B, nb, 8)).astype(np.float32) @ basis[:, :8].T
    same = np.asarray(jnp.asarray(np.repeat(one, block, axis=1)).astype(jnp.bfloat16).astype(jnp.float32))
    for kind in [kd for kd in SUMMARY_KINDS if kd != "rvq"]:  # "rvq" has no page centre (below)
        u = basis[:, :summary_rank(kind, D)] if kind in ("pca_box", "ball_pca") else None
        c = np.asarray(summary_centre(kind, _summary(kind=kind, k=jnp.asarray(same), block=block, basis=u), u))
        tol = 2 ** -7 * np.abs(same).max() if kind == "pca_box" else 0  # its coefficients' box is rounded to bf16
        np.testing.assert_allclose(c, same[:, ::block], rtol=0, atol=tol, err_msg=kind)


def test_the_summaries_fit_the_box_bytes():
    """At dI 128 every kind fits 2 x dI bf16 numbers per page (512 bytes per 64-key page), the basis ranks as the
    docstring's table says."""
    assert (summary_rank("pca_box", 128), summary_rank("ball_pca", 128)) == (127, 63)
    assert summary_rank("rvq", 128) == 7  # 7 one-byte codes and a one-byte radius per key
    assert [summary_page_values(kd, 128, summary_rank(kd, 128)) for kd in SUMMARY_KINDS] == [256, 129, 255, 256, 256]
    for kd in SUMMARY_KINDS:
        assert summary_page_values(kd, D, summary_rank(kd, D)) <= 2 * D


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="summary must be one of"):
        key_block_summary("sphere", jnp.zeros((1, 64, 8)), 16)
    with pytest.raises(ValueError, match="needs a basis"):
        key_block_summary("pca_box", jnp.zeros((1, 64, 8)), 16)
    with pytest.raises(ValueError, match="summary must be one of"):
        host_index_select_reference(jnp.zeros((1, 2, 8)), jnp.ones((1, 2)), jnp.zeros((1, 64, 8)),
                                    jnp.ones((1, 64), bool), 4, 16, summary="sphere")
    with pytest.raises(ValueError, match="needs basis"):
        key_block_summary("rvq", jnp.zeros((1, 64, 8)), 16)
    with pytest.raises(ValueError, match="no page centre"):
        summary_centre("rvq", (jnp.zeros((1, 4, 16, 1)), jnp.zeros((1, 4, 16))))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_unrotate_undoes_the_model_rope(interleaved):
    """`rope_unrotate` of a key rotated by the model's `apply_rope` (either pairing) gives back its pairs [a | b];
    `rope_rotate` of those is the rotated key again."""
    from hisparse_jax.model.rope import apply_rope

    x = np.random.default_rng(3).standard_normal((S, D)).astype(np.float32)
    y = np.concatenate([np.asarray(apply_rope(jnp.asarray(x[:, :R]), COS, SIN, interleaved=interleaved)), x[:, R:]],
                       axis=-1)
    pairs = (x[:, 0:R:2], x[:, 1:R:2]) if interleaved else (x[:, :R // 2], x[:, R // 2:R])
    u = np.asarray(rope_unrotate(jnp.asarray(y), COS, SIN))
    np.testing.assert_allclose(u, np.concatenate([*pairs, x[:, R:]], axis=-1), atol=1e-5)
    np.testing.assert_allclose(np.asarray(rope_rotate(jnp.asarray(u), COS, SIN)), y, atol=1e-5)


def test_round_e4m3_up_is_the_least_e4m3_value_not_below():
    """Every float32 >= 0 (zero, e4m3's subnormals, its largest 448, above it) -> the least e4m3 value >= it (+inf
    above 448)."""
    rng = np.random.default_rng(4)
    x = np.concatenate([[0.0, 2.0 ** -9, 2.0 ** -10, 1.0, 448.0, 448.5, 1e4],
                        np.exp(rng.uniform(np.log(1e-4), np.log(500), 2000))]).astype(np.float32)
    y = np.asarray(round_e4m3_up(jnp.asarray(x)))
    finite = x <= 448
    assert (y >= x).all() and np.isinf(y[~finite]).all()
    e4m3 = np.asarray(jnp.asarray(y[finite]).astype(jnp.float8_e4m3fn).astype(jnp.float32))
    np.testing.assert_array_equal(e4m3, y[finite])  # an e4m3 value
    below = np.asarray(jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(jnp.asarray(y[finite]).astype(jnp.float8_e4m3fn), jnp.uint8) - 1,
        jnp.float8_e4m3fn).astype(jnp.float32))
    assert ((below < x[finite]) | (y[finite] == 0)).all()  # the e4m3 value below it is below x: the least one


def test_rvq_codes_clustered_keys_tightly():
    """Keys that are 16 kinds of key, each turned by RoPE at its position (what a trained indexer's look like): one
    stage of codes fitted to them leaves residuals near zero, so each page's bound sits near its best score (the box
    of the same pages bounds nothing of use), and the codes' reconstruction is the key."""
    rng = np.random.default_rng(5)
    kinds = rng.standard_normal((16, D)).astype(np.float32) * 3
    u = kinds[rng.integers(0, 16, (B, S))] + rng.standard_normal((B, S, D)).astype(np.float32) * 1e-3
    k = np.asarray(rope_rotate(jnp.asarray(u), COS, SIN))
    books = rvq_fit(rope_unrotate(jnp.asarray(k), COS, SIN).reshape(-1, D), 1, 16, iters=10)
    codes, radius = rvq_encode(jnp.asarray(k), books, COS, SIN)
    assert float(radius.max()) < 0.02 * float(np.linalg.norm(kinds, axis=-1).min())
    np.testing.assert_allclose(np.asarray(rvq_decode(codes, books, COS, SIN)), k, atol=0.02)
    rng, q, w, _, valid = _case(5, "normal", 1.0, False, False, "zeros")
    scores = np.where(valid, _oracle_scores(q, w, k), -np.inf).reshape(B, S // 16, 16).max(-1)
    live = valid.reshape(B, S // 16, 16).any(-1)
    tight = np.asarray(_ranks(q, w, k, valid, 16, "bound", "rvq", (books, COS, SIN)))
    box = np.asarray(_ranks(q, w, k, valid, 16, "bound", "box"))
    qn = np.abs(w).sum(-1)[:, None] * np.linalg.norm(q, axis=-1).max(-1)[:, None]  # sum_h |w_h| |q|max
    over, box_over = tight[live] - scores[live], box[live] - scores[live]
    assert (over >= 0).all()
    assert over.max() < 0.1 * qn.max(), over.max()
    assert box_over.mean() > 10 * over.mean()


def test_rvq_centre_rank_is_the_best_reconstructed_score():
    """Budgeted mode's rank "centre" with "rvq": each block's best score of its valid keys' reconstructions."""
    rng, q, w, k, valid = _case(6, "offset", 1.0, True, False, "junk")
    codec = _codec(rng, k, "fit")
    got = np.asarray(_ranks(q, w, k, valid, 16, "centre", "rvq", codec))
    codes, _ = rvq_encode(jnp.asarray(k), *codec)
    rec = np.where(valid, _oracle_scores(q, w, np.asarray(rvq_decode(codes, *codec))), -np.inf)
    np.testing.assert_allclose(got, rec.reshape(B, S // 16, 16).max(-1), rtol=1e-5, atol=1e-5)


def test_the_store_sizes_rvq_as_the_reference_does():
    """`formats` (imported where jax is not) restates the "rvq" sizes the reference (imported where only jax is)
    defines: the codebooks' size and the stages at the box's bytes."""
    from hisparse_jax.formats import RVQ_SIZE, rvq_stages
    from pallas_kernels.indexer_topk import reference

    assert RVQ_SIZE == reference.RVQ_SIZE
    for d in (16, 32, 48, 64, 128, 256, 576):
        assert rvq_stages(d) == reference.summary_rank("rvq", d), d
