"""The hot-buffer policy lab on ranked traces (experiments/hot_buffer_traces.py: `RankedTrace`; hot_buffer_sim.py:
`simulate_ranked`; policy_lab.py: `lab_sweep`, the trace statistics; experiments/locality.py: the acceptance bar).
Pure NumPy, no model."""
import numpy as np
import pytest

from experiments import hot_buffer_sim as sim
from experiments import policy_lab as pl
from experiments.hot_buffer_traces import RankedTrace
from experiments import locality as loc

DEMAND = [p for p in sim.RANKED_POLICIES if p != "opt"]


def _random_rt(seed=0, steps=60, S=96, k=8, margin=16, drift=0.3):
    """Scores drifting step to step (an AR(1) per position) plus noise: a top-k with some locality."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=S)
    rows = []
    for _ in range(steps):
        base = (1 - drift) * base + drift * rng.normal(size=S)
        rows.append(base + 0.3 * rng.normal(size=S))
    return RankedTrace.from_scores(np.array(rows), k, margin)


def _rt(score_rows, k, margin=0):
    return RankedTrace.from_scores(np.array(score_rows, np.float64), k, margin)


def test_from_scores_ranks_like_select_topk():
    rt = _rt([[1.0, 3.0, 3.0, -np.inf, 2.0]], k=2, margin=3)
    assert rt.order.tolist() == [[1, 2, 4, 0, -1]]  # descending, the lower position first on a tie, -1 unwritten
    assert [s.tolist() for s in rt.sets] == [[1, 2]]
    assert rt.margin == 3 and rt.top(3).k == 3 and [s.tolist() for s in rt.top(3).sets] == [[1, 2, 4]]
    assert rt.scores.dtype == np.float16 and rt.scores[0, 1] == 1.0  # over the step's largest |score|
    with pytest.raises(ValueError):
        rt.top(6)


@pytest.mark.parametrize("policy", ["lru", "clock", "opt"])
@pytest.mark.parametrize("hot_rows", [8, 12, 16, 32])
def test_demand_policies_equal_simulate(policy, hot_rows):
    """Without prefetch, lru / clock / opt on a ranked trace are `simulate`'s on its top-k sets (whose lru is the
    store's rule, tests/e2e/test_blog_experiments.py::test_lru_matches_ops_resolve)."""
    rt = _random_rt(1)
    r = sim.simulate_ranked(rt, hot_rows, policy, return_state=True)
    if policy == "lru":
        h, m, tok, stamp = sim.simulate(rt.sets, hot_rows, "lru", return_state=True)
        np.testing.assert_array_equal(r["tokens"], tok)
        np.testing.assert_array_equal(r["stamp"], stamp)
    else:
        h, m = sim.simulate(rt.sets, hot_rows, policy)
    np.testing.assert_array_equal(r["hits"], h)
    np.testing.assert_array_equal(r["misses"], m)
    assert not r["prefetched"].any() and r["prefetch_used"] == r["prefetch_wasted"] == 0


def test_score_evicts_the_lowest_scored_row():
    """k 2, 3 slots. Step 0 fills rows 0 and 1; step 1 wants 2 and 3: one goes to the empty slot, the other evicts
    row 1 (score 0.5 < row 0's 3) under `score`, but row 0 (lower slot, same stamp) under lru; step 2 wants 0
    and 2 again: two hits for score, one for lru."""
    ninf = -np.inf
    rt = _rt([[5, 4, 1, 0, ninf, ninf], [3, 0.5, 9, 8, 1, 0], [9, 0, 8, 1, 0.5, 0]], k=2, margin=2)
    s = sim.simulate_ranked(rt, 3, "score", return_state=True)
    lru = sim.simulate_ranked(rt, 3, "lru", return_state=True)
    assert s["hits"].tolist() == [0, 0, 2] and lru["hits"].tolist() == [0, 0, 1]
    assert sorted(s["tokens"].tolist()) == [0, 2, 3]
    for pol in ("score_lru", "score_ema"):
        assert sim.simulate_ranked(rt, 3, pol, keep=2.0, beta=0.0)["hits"].tolist() == [0, 0, 2]


def test_score_ema_remembers_what_one_step_forgets():
    """k 1, 2 slots. Row 0 is the top-1 for five steps, row 1 once; then row 2 must evict one of them, at a step
    where row 0 scores just below row 1: `score` evicts row 0 and misses it when it comes back, `score_ema` (its
    average is still high, row 1's low) evicts row 1 and hits."""
    rt = _rt([[9, 0, 0]] * 5 + [[5, 9, 0], [1, 2, 9], [9, 0, 8]], k=1)
    s = sim.simulate_ranked(rt, 2, "score")
    e = sim.simulate_ranked(rt, 2, "score_ema", beta=0.9)
    assert s["misses"][6] == e["misses"][6] == 1
    assert s["hits"][7] == 0 and e["hits"][7] == 1


def test_score_ema_per_slot_forgets_the_history_before_the_fill():
    """k 1, 2 slots. Row 0 is the top-1 at steps 0-4 (filled), row 1 second with 8.5; row 1 is the top-1 at step 5
    (filled), row 3 at step 6, where row 0 scores 2 and row 1 scores 1. The per-position average (what the store
    keeps, `index_ema`) still ranks row 1 above row 0 and evicts row 0; the per-slot one knows row 1 only from its
    fill on (1) and evicts it, and misses it at step 7."""
    rt = _rt([[9, 8.5, 0, 0]] * 5 + [[0, 9, 0, 0], [2, 1, 0, 9], [0, 9, 0, 0]], k=1)
    pos = sim.simulate_ranked(rt, 2, "score_ema", beta=0.9)
    slot = sim.simulate_ranked(rt, 2, "score_ema", beta=0.9, ema_scope="slot")
    assert pos["misses"].tolist()[:7] == slot["misses"].tolist()[:7] == [1, 0, 0, 0, 0, 1, 1]
    assert pos["hits"][7] == 1 and slot["hits"][7] == 0
    with pytest.raises(ValueError, match="ema_scope"):
        sim.simulate_ranked(rt, 2, "score_ema", ema_scope="slot", admit="key")


@pytest.mark.parametrize("policy", DEMAND)
@pytest.mark.parametrize("prefetch", [0, 4])
def test_no_future_information(policy, prefetch):
    """Every policy but opt decides step t from steps <= t: rewriting the future leaves the past unchanged."""
    rt = _random_rt(2)
    t0 = 30
    other = _random_rt(3)
    mixed = RankedTrace(np.concatenate([rt.order[:t0 + 1], other.order[t0 + 1:]]),
                           np.concatenate([rt.scores[:t0 + 1], other.scores[t0 + 1:]]), rt.positions, rt.k)
    a = sim.simulate_ranked(rt, 16, policy, prefetch=prefetch)
    b = sim.simulate_ranked(mixed, 16, policy, prefetch=prefetch)
    for key in ("hits", "misses", "prefetched"):
        np.testing.assert_array_equal(a[key][:t0 + 1], b[key][:t0 + 1])


def test_prefetch_counts_by_hand():
    """k 1, margin 2, 3 slots. Step 0 ranks [0, 1, 2]: 0 misses, 1 and 2 are prefetched into the empty slots.
    Step 1 ranks [1, 3, 0]: 1 is a critical-path hit (a used prefetch); candidate 3 (0 is in the buffer) may only
    replace a row outside the top-3, i.e. 2, an unused prefetch (wasted)."""
    ninf = -np.inf
    rt = _rt([[3, 2, 1, ninf], [1, 3, 0, 2]], k=1, margin=2)
    r = sim.simulate_ranked(rt, 3, "lru", prefetch=2, return_state=True)
    assert r["hits"].tolist() == [0, 1] and r["misses"].tolist() == [1, 0]
    assert r["prefetched"].tolist() == [2, 1]
    assert r["prefetch_used"] == 1 and r["prefetch_wasted"] == 1
    assert sorted(r["tokens"].tolist()) == [0, 1, 3]


@pytest.mark.parametrize("policy", DEMAND)
@pytest.mark.parametrize("hot_rows", [8, 12, 24])
def test_invariants_with_prefetch(policy, hot_rows):
    rt = _random_rt(4)
    m = 8
    r = sim.simulate_ranked(rt, hot_rows, policy, prefetch=m, return_state=True)
    assert (r["hits"] + r["misses"] == rt.k).all()  # nothing resident: every top-k row is a hit or a miss
    assert (r["prefetched"] <= m).all()
    if hot_rows == rt.k:
        assert not r["prefetched"].any()
    tok = r["tokens"]
    assert len(np.unique(tok[tok >= 0])) == (tok >= 0).sum()  # no row twice
    assert set(rt.sets[-1].tolist()) <= set(tok.tolist())  # the step's top-k is in the buffer after it
    assert r["prefetch_used"] + r["prefetch_wasted"] <= r["prefetched"].sum()


def test_no_prefetch_at_1x():
    rt = _random_rt(5)
    r = sim.simulate_ranked(rt, rt.k, "score_ema", prefetch=16)
    assert not r["prefetched"].any()


@pytest.mark.parametrize("hot_rows", [8, 12, 16, 24])
def test_demand_policies_within_opt(hot_rows):
    """Under demand caching (no prefetch) no policy's critical-path hits exceed Belady's."""
    for seed in range(3):
        rt = _random_rt(seed)
        opt = sim.simulate_ranked(rt, hot_rows, "opt")["hits"].sum()
        for pol in DEMAND:
            assert sim.simulate_ranked(rt, hot_rows, pol)["hits"].sum() <= opt


def test_prefetch_can_beat_demand_opt():
    """The next top-k row is always ranked just below this step's: demand caching misses every step (every row
    is new: OPT hits nothing), a margin of 1 hits every step after the first."""
    T = 12
    sc = np.full((T, T + 1), -np.inf)
    for t in range(T):
        sc[t, t], sc[t, t + 1] = 2.0, 1.0
    rt = _rt(sc, k=1, margin=1)
    assert sim.simulate_ranked(rt, 2, "opt")["hits"].sum() == 0
    r = sim.simulate_ranked(rt, 2, "lru", prefetch=1)
    assert r["hits"].sum() == T - 1 and r["prefetched"].sum() == T


def test_opt_refuses_prefetch_and_bad_margin():
    rt = _random_rt(0)
    with pytest.raises(ValueError):
        sim.simulate_ranked(rt, 16, "opt", prefetch=2)
    with pytest.raises(ValueError):
        sim.simulate_ranked(rt, 16, "lru", prefetch=rt.margin + 1)
    with pytest.raises(ValueError):
        sim.simulate_ranked(rt, 16, "lru", admit="key")


def test_resident_tail():
    assert sim.resident_from([130, 63, 200], 2).tolist() == [64, 0, 128]
    assert sim.resident_from([130], 1).tolist() == [128]
    rt = _random_rt(6)
    rt = RankedTrace(rt.order, rt.scores, np.arange(rt.steps) + 128, rt.k)  # at 128..187 rows >= 64 resident
    r = sim.simulate_ranked(rt, 12, "score_ema", prefetch=4, resident_pages=2)
    assert (r["hits"] + r["misses"] + r["resident"] == rt.k).all() and r["resident"].sum() > 0
    full = sim.simulate_ranked(rt, 12, "score_ema", prefetch=4)
    assert r["misses"].sum() < full["misses"].sum()


def test_lab_sweep_bytes_and_bar():
    layers = [[_random_rt(s), _random_rt(s + 10)] for s in (0, 1)]
    variants = {n: pl.LAB_VARIANTS[n] for n in ("lru", "score_ema", "score_ema+pf16", "opt")}
    variants["score_ema+pf16"] = ("score_ema", {"prefetch": 8})
    sw = pl.lab_sweep(layers, 4, variants, (1.0, 2.0))
    ov = sw["overall"]
    for size in ("1x", "2x"):
        assert ov["lru"][size]["h2d_over_lru"] == 1.0
        for n, rows in ov.items():
            st = rows[size]
            assert st["h2d_rows_per_step"] == pytest.approx(st["misses_per_step"] + st["prefetched_per_step"])
            assert st["h2d_bytes_per_step"] == pytest.approx(st["h2d_rows_per_step"] * pl.ROW_BYTES * pl.LAYERS)
    assert ov["opt"]["1x"]["hit_rate"] == ov["lru"]["1x"]["hit_rate"]  # one buffer of top-k: the previous set
    assert ov["score_ema+pf16"]["2x"]["prefetched_per_step"] > 0
    pos = pl.by_position(sw["steps"]["lru"], [96, 120, 200])  # from_scores: positions S + t
    assert len(pos) == 2 and all(0 <= p["hit_rate"] <= 1 for p in pos)
    bar = loc.bar_check(ov)
    assert bar["met"] == bool(bar["met_by"]) and bar["best_within_bytes"] != "opt"
    fake = {"lru": {"2x": {"hit_rate": 0.6, "h2d_rows_per_step": 10.0, "h2d_over_lru": 1.0}},
            "opt": {"2x": {"hit_rate": 0.8, "h2d_rows_per_step": 5.0, "h2d_over_lru": 0.5}},
            "a": {"2x": {"hit_rate": 0.85, "h2d_rows_per_step": 16.0, "h2d_over_lru": 1.6}},
            "b": {"2x": {"hit_rate": 0.8, "h2d_rows_per_step": 14.0, "h2d_over_lru": 1.4}}}
    bar = loc.bar_check(fake)
    assert bar["met"] and bar["met_by"] == ["b"] and bar["best_any_bytes"] == "a"
    fake["b"]["2x"]["hit_rate"] = 0.79
    assert not loc.bar_check(fake)["met"]


def test_reref_and_entry_ranks():
    st = pl.reref_stats([[np.array([1]), np.array([1]), np.array([2]), np.array([1])]], 0)
    assert st["uses"] == 4 and st["first_use_frac"] == 0.5
    assert st["hist"]["1"] == 0.25 and st["hist"]["2"] == 0.25
    ninf = -np.inf
    # step 1's top-1 (row 2) ranked 3rd at step 0 (k = 1: bin 2k-3k); row 3 is written at step 2 ("new")
    rt = _rt([[3, 2, 1, ninf], [1, 0, 3, ninf], [0, 0, 0, 5]], k=1)
    er = pl.entry_rank_stats([rt], 0)
    assert er["entry_rank_share"]["2k-3k"] == 0.5 and er["entry_rank_share"]["new"] == 0.5


def test_tuning_windows_do_not_overlap_evaluation():
    tokens = np.arange(10_000)
    ev_starts = np.linspace(0, tokens.size - 100, 4).astype(np.int64)
    tw = loc.tuning_windows(tokens, 100, 4)
    assert tw.shape == (3, 100) and (np.diff(tw, axis=1) == 1).all()
    for s in tw[:, 0]:
        assert all(abs(int(s) - e) >= 100 for e in ev_starts)
    with pytest.raises(ValueError):
        loc.tuning_windows(tokens, 4000, 4)


def _predictability_oracle(rts, warmup, horizon, recent, sizes, min_step=32, beta=0.9):
    """`prefetch_predictability` with Python sets, step by step."""
    names = ([f"rank_margin/{m}" for m in sizes if m <= min(rt.margin for rt in rts)]
             + [f"score_ema/{m}" for m in sizes] + [f"frequency/{m}" for m in sizes] + ["neighbours"])
    acc = {n: [0, 0, 0, 0] for n in names}
    steps = target_n = 0
    for rt in rts:
        k, T, S = rt.k, rt.steps, rt.scores.shape[1]
        top = [{int(x) for x in rt.order[t, :k] if x >= 0} for t in range(T)]
        ema, count, last, prev = {}, {}, {}, {n: set() for n in names}
        b, b1 = np.float32(beta), np.float32(1 - beta)
        for t in range(T):
            s = rt.scores[t].astype(np.float32)
            for p in range(S):
                if p in ema:
                    ema[p] = np.float32(b * ema[p] + b1 * s[p])
                elif np.isfinite(s[p]):
                    ema[p] = s[p]
            for p in top[t]:
                count[p], last[p] = count.get(p, 0) + 1, t
            rec = set().union(*top[max(t - recent + 1, 0):t + 1])
            cand = {}
            for m in sizes:
                if f"rank_margin/{m}" in acc:
                    cand[f"rank_margin/{m}"] = {int(x) for x in rt.order[t, k:k + m] if x >= 0} - rec
                by_ema = sorted((p for p in ema if p not in rec and np.isfinite(ema[p])), key=lambda p: (-ema[p], p))
                cand[f"score_ema/{m}"] = set(by_ema[:m])
                by_count = sorted((p for p in count if p not in rec), key=lambda p: (-count[p], -last[p], p))
                cand[f"frequency/{m}"] = set(by_count[:m])
            cand["neighbours"] = {q for p in top[t] for q in (p - 1, p + 1) if 0 <= q < S and np.isfinite(s[q])} - rec
            if t >= max(warmup, min_step) and t + horizon < T:
                target = set().union(*top[t + 1:t + horizon + 1]) - rec
                steps += 1
                target_n += len(target)
                for n, c in cand.items():
                    new = c - prev[n]
                    acc[n] = [a + d for a, d in zip(acc[n], (len(c), len(c & target), len(new), len(new & target)))]
            prev = cand
    return steps, target_n, acc


def _check_against_oracle(rts, warmup, **kw):
    got = pl.prefetch_predictability(rts, warmup, **kw)
    steps, target_n, acc = _predictability_oracle(rts, warmup, kw["horizon"], kw["recent"], kw["sizes"],
                                                  kw.get("min_step", 32))
    assert got["steps"] == steps > 0 and got["target_per_step"] == pytest.approx(target_n / steps)
    assert list(got["predictors"]) == list(acc)
    for n, (c, hit, new, new_hit) in acc.items():
        st = got["predictors"][n]
        assert st["candidates_per_step"] == pytest.approx(c / steps), n
        assert st["precision"] == (pytest.approx(hit / c) if c else None), n
        assert st["coverage"] == pytest.approx(hit / target_n), n
        assert st["new_per_step"] == pytest.approx(new / steps), n
        assert st["new_precision"] == (pytest.approx(new_hit / new) if new else None), n
        assert st["useful_new_per_step"] == pytest.approx(new_hit / steps), n
    return got


def test_prefetch_predictability_by_hand():
    """The top-2 slides right by one position a step: at step t it is {t, t+1}, recent (2 steps) {t-1, t, t+1},
    the target (horizon 2) {t+2, t+3}. The neighbours (t-1 is recent) are {t+2}: precision 1, coverage 1/2. Ranks
    2-3 are t-1 and t+2 (tied, the lower first), rank 4 is t-2: rank_margin/2 names {t+2} as well, rank_margin/3
    adds t-2 (precision 1/2). A row that left the window never recurs: frequency, naming only such rows, is never
    right."""
    T, S = 10, 14
    sc = np.array([[10 - abs(p - t - 0.5) for p in range(S)] for t in range(T)])
    rt = _rt(sc, k=2, margin=3)
    got = _check_against_oracle([rt], 0, horizon=2, recent=2, sizes=(2, 3, 4), min_step=2)
    pr = got["predictors"]
    assert "rank_margin/4" not in pr  # beyond the recorded margin
    assert got["steps"] == T - 2 - 2 and got["target_per_step"] == 2
    assert pr["neighbours"]["precision"] == 1 and pr["neighbours"]["coverage"] == 0.5
    assert pr["rank_margin/2"]["precision"] == 1 and pr["rank_margin/3"]["precision"] == 0.5
    assert pr["neighbours"]["new_per_step"] == 1 and pr["neighbours"]["new_precision"] == 1
    assert pr["frequency/2"]["precision"] == 0
    assert pr["score_ema/2"]["candidates_per_step"] == 2  # every position is written
    assert pr["frequency/2"]["candidates_per_step"] == pytest.approx((1 + 2 * 5) / 6)  # at step 2 only row 0 is old


@pytest.mark.parametrize("seed", [0, 7])
def test_prefetch_predictability_matches_oracle(seed):
    rts = [_random_rt(seed), _random_rt(seed + 1, drift=0.6)]
    got = _check_against_oracle(rts, 4, horizon=4, recent=6, sizes=(4, 8, 32))
    assert got["first_step"] == 32 and "rank_margin/32" not in got["predictors"]
    assert 0 < got["predictors"]["score_ema/8"]["precision"] < 1


def test_prefetch_need():
    """LRU misses 40 of 100 rows a step, OPT 25: 15 useful prefetches needed, and 1.5 x 40 - 25 = 35 rows allowed
    once the misses are OPT's (15 / 35); counting every prefetch as extra, 15 / 20. The best predictor is the most
    precise one (mean over the layers) with >= 16 candidates per step, never the more precise but smaller a."""
    overall = {"lru": {"2x": {"misses_per_step": 40.0, "h2d_rows_per_step": 40.0}},
               "opt": {"2x": {"misses_per_step": 25.0, "h2d_rows_per_step": 25.0}}}

    def layer(pa, pb, pc):
        st = {"coverage": 0.1, "new_per_step": 5.0, "new_precision": 0.2, "useful_new_per_step": 1.0}
        return {"predictors": {"a": {**st, "precision": pa, "candidates_per_step": 8.0},
                               "b": {**st, "precision": pb, "candidates_per_step": 20.0},
                               "c": {**st, "precision": pc, "candidates_per_step": 64.0}}}
    need = loc.prefetch_need(overall, [layer(0.9, 0.4, 0.3), layer(0.8, 0.2, 0.35)])
    assert need["prefetch_precision_needed"] == pytest.approx(15 / 35)
    assert need["prefetch_precision_needed_if_all_extra"] == pytest.approx(15 / 20)
    assert need["best_predictor"] == "c" and need["best_predictor_precision"] == pytest.approx(0.325)
    assert need["predictors_reaching_precision_needed"] == ["a"] and need["best_predictor_useful_new_per_step"] == 1
    need = loc.prefetch_need(overall, [layer(0.9, 0.5, 0.3), layer(0.8, 0.3, 0.35)])
    assert need["best_predictor"] == "b" and need["best_predictor_candidates_per_step"] == 20
