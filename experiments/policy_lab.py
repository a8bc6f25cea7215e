"""The policy lab on ranked traces (the one `experiments/locality.py` runs): every variant of `LAB_VARIANTS`
(score-aware retention, margin prefetch: `hot_buffer_sim.simulate_ranked`) x buffer size, tabulated with H2D rows
and bytes per step (misses + prefetched) next to the critical-path hit rate (`lab_sweep`, `by_position`); the
traces' re-reference distances and where entering rows were ranked (`reref_stats`, `entry_rank_stats`); and
whether any prefetcher could name the rows a demand cache will miss (`prefetch_predictability`: precision and
coverage of candidate generators against the rows entering the top-k within a few steps).

H2D bytes per step = rows x ROW_BYTES (656: an FP8 ds_mla row) x LAYERS (78: GLM-5.3, assuming every indexer group
misses as this one does; one group of 4 layers moves 4/78 of that).
"""

from __future__ import annotations

import numpy as np

from experiments.hot_buffer_sim import simulate_ranked

ROW_BYTES = 656
LAYERS = 78


# score_ema's beta and score_lru's keep: chosen from {0.8, 0.9, 0.95, 0.97} and {1.25, 1.5, 2, 3} on held-out
# windows that are not the evaluation ones (`locality.py --tune`: three windows halfway between the four
# evaluation windows), at 2x top-k
EMA_BETA = 0.9


SCORE_LRU_KEEP = 3.0
LAB_SIZES = (1.0, 1.5, 2.0, 4.0)


# name -> (policy, simulate_ranked keywords); "+pfM": prefetch margin M; "/key": admit="key"
LAB_VARIANTS = {
    "lru": ("lru", {}), "clock": ("clock", {}), "score": ("score", {}),
    "score_lru": ("score_lru", {"keep": SCORE_LRU_KEEP}),
    "score_ema": ("score_ema", {"beta": EMA_BETA}),
    "lru+pf16": ("lru", {"prefetch": 16}), "lru+pf64": ("lru", {"prefetch": 64}),
    "score+pf16": ("score", {"prefetch": 16}), "score+pf64": ("score", {"prefetch": 64}),
    "score_lru+pf16": ("score_lru", {"keep": SCORE_LRU_KEEP, "prefetch": 16}),
    "score_lru+pf64": ("score_lru", {"keep": SCORE_LRU_KEEP, "prefetch": 64}),
    "score_ema+pf16": ("score_ema", {"beta": EMA_BETA, "prefetch": 16}),
    "score_ema+pf64": ("score_ema", {"beta": EMA_BETA, "prefetch": 64}),
    "score_ema+pf64/key": ("score_ema", {"beta": EMA_BETA, "prefetch": 64, "admit": "key"}),
    # the average kept per hot slot from its fill on (O(hot rows) state, no history before the fill)
    "score_ema/slot": ("score_ema", {"beta": EMA_BETA, "ema_scope": "slot"}),
    "opt": ("opt", {}),
}


def _lab_stats(H, M, P, steps, used=0, p_all=0, R=0, hot_rows=None) -> dict:
    rows = (M + P) / max(steps, 1)
    n = max(steps, 1)
    out = {"hit_rate": H / max(H + M, 1), "misses_per_step": M / n, "prefetched_per_step": P / n,
           "prefetched_bytes_per_step": P / n * ROW_BYTES * LAYERS, "h2d_rows_per_step": rows,
           "h2d_bytes_per_step": rows * ROW_BYTES * LAYERS,
           "prefetch_used_frac": used / p_all if p_all else None}  # over whole traces, warm-up included
    if R:
        out["resident_per_step"] = R / max(steps, 1)
        out["on_device_rate"] = (H + R) / max(H + M + R, 1)
    if hot_rows is not None:
        out["hot_rows"] = hot_rows
    return out


def lab_sweep(per_layer, warmup: int, variants: dict | None = None, sizes=LAB_SIZES, *, k: int | None = None,
              resident_pages: int = 0, keep_steps=("lru", "score_ema", "opt"), keep_size: str = "2x") -> dict:
    """Every variant x size on traces[index_layer][seq] (`RankedTrace`s, read at top-`k`, default their own),
    the first `warmup` steps of each trace not counted. Returns {"per_index_layer": [{variant: {size: stats}}],
    "overall": {variant: {size: stats}} (pooled over layers: hits / accesses; rows per step and indexer group),
    "steps": {variant: (positions, hits, misses, prefetched) over all layers and sequences at `keep_size`}}.
    stats: hit_rate (critical path), misses_per_step, prefetched_per_step (and _bytes_), h2d_rows_per_step (misses +
    prefetched), h2d_bytes_per_step (x ROW_BYTES x LAYERS, as `study`), h2d_over_lru (against lru at the same
    size), prefetch_used_frac (prefetched rows hit before eviction), hot_rows; with resident pages also
    resident_per_step and on_device_rate ((hits + resident) / top-k)."""
    variants = LAB_VARIANTS if variants is None else variants
    layers = [[rt if k is None else rt.top(k) for rt in per_seq] for per_seq in per_layer]
    kk = layers[0][0].k
    res = {"per_index_layer": [{} for _ in layers], "overall": {}, "steps": {}}
    for name, (pol, kw) in variants.items():
        res["overall"][name] = {}
        for f in sizes:
            size, HR = f"{f:g}x", int(round(f * kk))
            tot = np.zeros(7)
            keep_rows = []
            for li, per_seq in enumerate(layers):
                acc = np.zeros(7)
                for rt in per_seq:
                    r = simulate_ranked(rt, HR, pol, resident_pages=resident_pages, **kw)
                    w = slice(warmup, None)
                    acc += [r["hits"][w].sum(), r["misses"][w].sum(), r["prefetched"][w].sum(),
                            len(r["hits"][w]), r["prefetch_used"], r["prefetched"].sum(), r["resident"][w].sum()]
                    if name in keep_steps and size == keep_size:
                        keep_rows.append(np.stack([rt.positions[w], r["hits"][w], r["misses"][w],
                                                   r["prefetched"][w]]))
                res["per_index_layer"][li].setdefault(name, {})[size] = _lab_stats(*acc, hot_rows=HR)
                tot += acc
            res["overall"][name][size] = _lab_stats(*tot, hot_rows=HR)
            if keep_rows:
                res["steps"][name] = np.concatenate(keep_rows, axis=1)
    for table in res["per_index_layer"] + [res["overall"]]:
        for name, rows in table.items():
            for size, st in rows.items():
                base = table["lru"][size]["h2d_rows_per_step"] if "lru" in table else None
                st["h2d_over_lru"] = st["h2d_rows_per_step"] / base if base else None
    return res


def by_position(steps: np.ndarray, edges) -> list:
    """Critical-path hit rate and H2D rows per step of `lab_sweep`'s kept per-step rows, by decode position
    bin [edges[i], edges[i+1])."""
    pos, h, m, p = steps
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (pos >= lo) & (pos < hi)
        if sel.any():
            hs, ms = h[sel].sum(), m[sel].sum()
            out.append({"positions": [int(lo), int(hi)], "hit_rate": float(hs / max(hs + ms, 1)),
                        "h2d_rows_per_step": float((m[sel].sum() + p[sel].sum()) / sel.sum())})
    return out


REREF_EDGES = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257)


def reref_stats(traces, warmup: int) -> dict:
    """Re-reference distance (steps between two uses of a row) over the top-k sets of `traces` (lists of
    per-step position arrays), for uses at steps >= warmup: histogram over REREF_EDGES (bin i: distances in
    [e_i, e_(i+1)), the last open), the share of first uses in the trace, quantiles."""
    dist, first, n = [], 0, 0
    for tr in traces:
        last = {}
        for t, q in enumerate(tr):
            for x in np.asarray(q).tolist():
                if t >= warmup:
                    n += 1
                    if x in last:
                        dist.append(t - last[x])
                    else:
                        first += 1
                last[x] = t
    d = np.asarray(dist, np.int64)
    hist = np.histogram(d, bins=list(REREF_EDGES) + [1 << 30])[0] if len(d) else np.zeros(len(REREF_EDGES))
    labels = [f"{a}-{b - 1}" if b - 1 > a else f"{a}" for a, b in zip(REREF_EDGES, REREF_EDGES[1:])]
    labels.append(f">={REREF_EDGES[-1]}")
    q = np.percentile(d, [50, 75, 90, 99]).tolist() if len(d) else [None] * 4
    return {"uses": n, "first_use_frac": first / max(n, 1),
            "hist": dict(zip(labels, (hist / max(n, 1)).tolist())),
            "median": q[0], "p75": q[1], "p90": q[2], "p99": q[3]}


def entry_rank_stats(rts, warmup: int) -> dict:
    """Where the rows that enter the top-k come from: for each row of T_t not in T_(t-1) (t >= warmup), its rank
    in step t-1's ranking (from `scores`; a position written at step t itself counts as "new"), as shares in
    bins of k; and the share of the top-k within the last 128 positions (the store's two resident tail pages)."""
    k = rts[0].k
    edges = np.array([k, 1.5 * k, 2 * k, 3 * k, 4 * k, 8 * k])
    labels = ["k-1.5k", "1.5k-2k", "2k-3k", "3k-4k", "4k-8k", ">=8k", "new"]
    counts = np.zeros(len(labels))
    tail = acc = 0
    for rt in rts:
        prev = None
        for t in range(rt.steps):
            o = rt.order[t, :k]
            cur = o[o >= 0]
            if prev is not None and t >= warmup:
                ent = np.setdiff1d(cur, prev, assume_unique=True)
                s = rt.scores[t - 1].astype(np.float32)
                rank = np.empty(len(s), np.int64)
                rank[np.argsort(-s, kind="stable")] = np.arange(len(s))
                fresh = ~np.isfinite(s[ent])
                b = np.searchsorted(edges, rank[ent[~fresh]], side="right") - 1
                counts[:-1] += np.bincount(np.clip(b, 0, len(edges) - 1), minlength=len(edges))
                counts[-1] += fresh.sum()
                tail += int((rt.positions[t] - cur < 128).sum())
                acc += len(cur)
            prev = cur
    n = counts.sum()
    return {"entries_per_step": float(n / max(sum(max(rt.steps - max(warmup, 1), 0) for rt in rts), 1)),
            "entry_rank_share": dict(zip(labels, (counts / max(n, 1)).tolist())),
            "topk_in_last_128_positions": tail / max(acc, 1)}


PREDICT_MIN_STEP = 32  # the first step scored: the moving averages and counts have some history by then


def prefetch_predictability(rts, warmup: int, *, horizon: int = 4, recent: int = 6, sizes=(16, 32, 64),
                            beta: float = EMA_BETA, min_step: int = PREDICT_MIN_STEP) -> dict:
    """Could a prefetcher predict the rows a demand cache will miss? On the `RankedTrace`s of one index layer, at
    each step t with max(warmup, min_step) <= t and t + horizon < steps:
      recent_t  the positions in the top-k at any of steps t-recent+1..t (what an LRU-like buffer still holds);
      target_t  the positions in the top-k at any of steps t+1..t+horizon not in recent_t (what it would miss).
    Candidate generators, each from what is known at step t (scores and top-k sets of steps <= t), then less
    recent_t:
      rank_margin/m  the rows ranked k..k+m-1 at step t (order[t, k:k+m]; m beyond the recorded margin skipped);
      score_ema/m    the m written positions with the highest moving average of the score (simulate_ranked's
                     score_ema: e = s at the first step that scores the position, then e = beta e + (1 - beta) s,
                     step t included), outside recent_t; ties: the lower position first;
      frequency/m    the m positions most often in the top-k at steps 0..t, outside recent_t (never-used ones
                     excluded); ties: the more recently used, then the lower position;
      neighbours     p - 1 and p + 1 of every p in step t's top-k that are written at step t (finite score).
    Per generator, pooled over steps and traces (ratios of sums): precision = |C ∩ target| / |C|, coverage =
    |C ∩ target| / |target|, candidates_per_step; and, for a prefetcher that already copied step t-1's candidates,
    the new ones (C_t less C_(t-1), what it would copy at step t): new_per_step, new_precision (|new ∩ target| /
    |new|) and useful_new_per_step (|new ∩ target| per step: misses it could turn into hits). Also target rows per
    step, the share of them not written yet at step t (no predictor can name them) and recent rows per step."""
    k = rts[0].k
    margin = min(rt.margin for rt in rts)
    names = ([f"rank_margin/{m}" for m in sizes if m <= margin] + [f"score_ema/{m}" for m in sizes]
             + [f"frequency/{m}" for m in sizes] + ["neighbours"])
    acc = {n: np.zeros(4, np.int64) for n in names}  # candidates, correct, new, new correct
    n_steps = n_target = n_unwritten = n_recent = 0
    first = max(warmup, min_step, 0)
    for rt in rts:
        T, S = rt.steps, rt.scores.shape[1]
        if T - horizon <= first:
            continue
        lo = max(first - 1, 0)  # one step before the first: its candidates are the "previous" ones
        ext = np.arange(lo, T - horizon)
        top = np.zeros((T, S), bool)
        o = rt.order[:, :k]
        r, c = np.nonzero(o >= 0)
        top[r, o[r, c]] = True
        cs = np.zeros((T + 1, S), np.int32)
        np.cumsum(top, axis=0, out=cs[1:])
        rec = (cs[ext + 1] - cs[np.maximum(ext - recent + 1, 0)]) > 0
        written = np.isfinite(rt.scores[ext])
        nt = len(ext)

        def top_m(key, m_max):
            """[nt, m_max] positions by descending key (stable: lower position first), -1 where key is -inf."""
            idx = np.argsort(-key, axis=1, kind="stable")[:, :m_max]
            return np.where(np.isfinite(np.take_along_axis(key, idx, 1)), idx, -1)

        def mask(pos):
            out = np.zeros((nt, S), bool)
            i, j = np.nonzero(pos >= 0)
            out[i, pos[i, j]] = True
            return out & ~rec

        cand = {}
        for m in sizes:
            if m <= margin:
                cand[f"rank_margin/{m}"] = mask(rt.order[ext, k:k + m])
        ema = np.full(S, -np.inf, np.float32)
        E = np.empty((T - horizon, S), np.float32)
        for t in range(T - horizon):
            st = rt.scores[t].astype(np.float32)
            fin = np.isfinite(ema)
            nxt = st.copy()
            nxt[fin] = beta * ema[fin] + (1 - beta) * st[fin]
            ema = E[t] = nxt
        best = top_m(np.where(rec, -np.inf, E[ext]), max(sizes))
        for m in sizes:
            cand[f"score_ema/{m}"] = mask(best[:, :m])
        last = np.maximum.accumulate(np.where(top, np.arange(T)[:, None], -1), axis=0)
        count = cs[ext + 1].astype(np.int64)
        key = np.where(rec | (count == 0), -np.inf, (count * (T + 1) + last[ext]).astype(np.float64))
        best = top_m(key, max(sizes))
        for m in sizes:
            cand[f"frequency/{m}"] = mask(best[:, :m])
        nb = np.zeros((nt, S), bool)
        nb[:, :-1] |= top[ext, 1:]
        nb[:, 1:] |= top[ext, :-1]
        cand["neighbours"] = nb & written & ~rec
        cur = slice(1, None) if lo < first else slice(0, None)  # the scored steps among ext
        ts = ext[cur]
        tgt = ((cs[ts + 1 + horizon] - cs[ts + 1]) > 0) & ~rec[cur]
        n_steps += len(ts)
        n_target += int(tgt.sum())
        n_unwritten += int((tgt & ~written[cur]).sum())
        n_recent += int(rec[cur].sum())
        for n, cm in cand.items():
            now = cm[cur]
            prev = cm[:-1] if lo < first else np.concatenate([np.zeros((1, S), bool), cm[:-1]])
            new = now & ~prev
            acc[n] += [now.sum(), (now & tgt).sum(), new.sum(), (new & tgt).sum()]

    def ratio(a, b):
        return float(a / b) if b else None

    return {"horizon": horizon, "recent": recent, "beta": beta, "first_step": first, "steps": n_steps,
            "target_per_step": ratio(n_target, n_steps), "target_unwritten_frac": ratio(n_unwritten, n_target),
            "recent_rows_per_step": ratio(n_recent, n_steps),
            "predictors": {n: {"precision": ratio(a[1], a[0]), "coverage": ratio(a[1], n_target),
                               "candidates_per_step": ratio(a[0], n_steps), "new_per_step": ratio(a[2], n_steps),
                               "new_precision": ratio(a[3], a[2]), "useful_new_per_step": ratio(a[3], n_steps)}
                           for n, a in acc.items()}}
