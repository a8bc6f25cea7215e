"""Trace-driven study of the HiSparse hot buffer (pure NumPy): replacement policy x buffer size x trace.

    PYTHONPATH=. python experiments/hot_buffer_policies.py [--out experiments/results] [--quick]

A trace is a list of per-step top-k sets (int arrays of distinct token positions) of one request and one
indexer group. Every position is treated as offloaded (served by the hot buffer: a hit or a one-row miss
copied from host); the resident tail pages of the real store are ignored.

Policies (a slot hit or filled in the current step is never a victim of that step):
  lru    the store's rule, identical to `hisparse_jax.kv.resolve.resolve`: the misses take the least recently
         used slots not hit this step ((stamp, slot) order: never-used slots first, lower slot first among
         equal stamps), in slot order; a filled slot gets stamp := 2 * step, a hit one 2 * step + 1 (the
         published order's groups [untouched | filled | hit], each in slot order rather than claim / previous
         order).
  fifo   like lru but a hit does not refresh the stamp (stamp = insertion step).
  clock  second chance: one reference bit per slot, set on hit/insert; the hand clears set bits and takes
         the first clear, unprotected slot.
  lfu    fewest accesses since insertion first, ties by least recent use, then lower slot.
  lru2   LRU-K with K=2 (ours): evict the slot whose second-to-last access is oldest (a row used only once
         counts as infinitely old), ties by last access then slot: one-off rows of a drifting neighbourhood
         leave before rows that recur.
  opt    Belady's offline optimum (evict the row whose next use is farthest): an upper bound, not a policy.

Traces:
  demo    top-k sets of the first full indexer of the embedded `demo-glm` model (seeded random weights, top-k
          64), recorded with `model.decoder.decode_step` over the contiguous `DenseKV` backend while
          teacher-forcing a long generated prompt (steps from position `--trace-start` on).
  synth   a synthetic top-2048 generator calibrated to FACTS §3 (see `synthetic_trace`).

H2D bytes per step = misses x 656 B (FP8 ds_mla row) x layers, with layers = 78 (GLM-5.3, assuming every
indexer group misses as this one does; one group of 4 layers moves 4/78 of that).

Ranked traces (the policy lab `experiments/locality.py` runs): `record_ranked_traces` keeps, per step, the
indexer's ordered top-(k + margin) and every position's score (`RankedTrace`), and `simulate_ranked` adds
score-aware retention (score, score_lru, score_ema: the victim chosen by this step's indexer scores, or their
moving average) and margin prefetch (rows ranked k..k+m copied in the same step, counted apart from the
critical-path misses); see its docstring for the exact rules. `lab_sweep` tabulates them with H2D rows and bytes
per step (misses + prefetched) next to the critical-path hit rate. `prefetch_predictability` asks whether any
prefetcher could name the rows a demand cache will miss: precision and coverage of candidate generators (margin
ranks, score moving average, frequency, neighbours) against the rows entering the top-k within a few steps.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

from experiments.report import finish_axes, pyplot, save_figure, save_json, stamp

ROW_BYTES = 656
LAYERS = 78
SIZES = (1.0, 1.5, 2.0, 3.0, 4.0)
POLICIES = ("lru", "fifo", "clock", "lfu", "lru2", "opt")

# ----------------------------------------------------------------------------------------------------
# policies
# ----------------------------------------------------------------------------------------------------


def _next_uses(trace):
    """For every (step, j) the next step at which trace[step][j] recurs (large if never)."""
    steps = np.concatenate([np.full(len(t), s) for s, t in enumerate(trace)])
    pos = np.concatenate([np.asarray(t) for t in trace])
    order = np.lexsort((steps, pos))
    nxt = np.full(len(pos), 1 << 30, np.int64)
    same = pos[order][1:] == pos[order][:-1]
    nxt[order[:-1][same]] = steps[order][1:][same]
    out, o = [], 0
    for t in trace:
        out.append(nxt[o:o + len(t)])
        o += len(t)
    return out


def clock_sweep(blocked, ref, hand: int, n: int):
    """CLOCK's second chance: (n victims, the hand after them). The hand skips `blocked` slots, clears a set
    reference bit (`ref`, updated in place) and takes the first slot whose bit is clear, which becomes blocked (in
    place) so that it is taken once."""
    victims = np.empty(n, np.int64)
    got = 0
    while got < n:
        if blocked[hand]:
            pass
        elif ref[hand]:
            ref[hand] = False
        else:
            victims[got] = hand
            blocked[hand] = True
            got += 1
        hand = (hand + 1) % len(ref)
    return victims, hand


def simulate(trace, hot_rows: int, policy: str = "lru", *, max_pos: int | None = None, return_state=False):
    """Run `policy` (one of POLICIES) over `trace` (per-step position arrays, every position offloaded); returns
    per-step hit and miss counts (and, with `return_state`, the final slot contents and stamps)."""
    if policy not in POLICIES:
        raise ValueError(policy)
    if max_pos is None:
        max_pos = max(int(np.max(t)) for t in trace if len(t)) + 1
    r = _simulate([np.asarray(q, np.int64) for q in trace], hot_rows, policy, max_pos=max_pos,
                  return_state=return_state)
    if return_state:
        return r["hits"], r["misses"], r["tokens"], r["stamp"]
    return r["hits"], r["misses"]


RANKED_POLICIES = ("lru", "clock", "score", "score_lru", "score_ema", "opt")
SCORE_POLICIES = ("score", "score_lru", "score_ema")
_BIG = 1 << 40


def resident_from(positions, pages: int, page_tokens: int = 64):
    """First resident position of each step when the request's last `pages` pages (`page_tokens` tokens each,
    the one being written included) stay on the device (0 pages: none resident, everything is offloaded)."""
    positions = np.asarray(positions, np.int64)
    if pages <= 0:
        return positions + (1 << 30)
    return np.maximum(positions // page_tokens - (pages - 1), 0) * page_tokens


def simulate_ranked(rt: RankedTrace, hot_rows: int, policy: str = "lru", *, prefetch: int = 0,
                    keep: float = 2.0, beta: float = 0.9, admit: str = "rank", ema_scope: str = "position",
                    resident_pages: int = 0,
                    page_tokens: int = 64, return_state: bool = False, return_missed: bool = False) -> dict:
    """Run `policy` (one of RANKED_POLICIES) over a `RankedTrace`, optionally with margin prefetch.

    Each step t: the demand set D_t is the top-k (rt.order[t, :k], taken in position order as `rt.sets`, so
    `lru` here is `simulate`'s lru on `rt.sets`) less the resident positions (the last `resident_pages` pages;
    default none: every position offloaded, as `simulate`). A row of D_t already in the buffer before the step's
    fetch is a critical-path hit; the others are critical-path misses, copied into victim slots. Then, with
    `prefetch=m`, the rows ranked k..k+m-1 this step that are neither in the buffer nor resident (candidates)
    are copied too, best ranked first, into victim slots whose row is not in the current top-(k+m) (empty slots
    included), as many as there are such slots, so that a later step finds them. With admit="key" (score
    policies only) a candidate is copied only while its policy value (below) exceeds its victim's (the i-th best
    candidate against the i-th victim). A slot hit or filled this step (demand or prefetch) is never a victim in
    the same step. Victim order (the first in the order goes first):
      lru        the store's rule (as `simulate`): lowest stamp (never used first; a fill stamps 2t, a hit
                 2t + 1), the demand victims claimed in slot order.
      clock      second chance, as `simulate` (a prefetched row gets its reference bit set, as a fill).
      score      empty slots, then the lowest value v_t(x) = s_t(x), the indexer's score of the slot's row at
                 this step (computed before the fetch: no future), ties by stamp, then slot.
      score_lru  rows outside the current top-(keep x k) (rank >= keep x k) in LRU order (stamp, slot), then
                 rows inside it by lowest s_t: the score protects rows the indexer still ranks high, recency
                 orders the rest (keep = 1 is LRU). Ranks are known to k + margin (the recorded ranking):
                 a row ranked beyond it counts as outside.
      score_ema  as score with v_t(x) = e_t(x), an exponential moving average of the row's score over the steps
                 so far, e_t = beta * e_(t-1) + (1 - beta) * s_t (e = s_t at the first step that scores x): a
                 recency-weighted score (what the indexer has kept saying about the row), not one step's noise.
                 This per-position average is the store's (`CacheConfig(hot_policy="score_ema")`). With
                 ema_scope="slot" it is kept per hot slot only, from the step after the one that filled it (e = s_t
                 then), so a row's history before it entered the buffer is not known (O(hot rows) state).
      opt        Belady (demand caching only, no prefetch): the bound.
    Scores are `rt.scores` (each step's scores over its largest |score|). Returns per-step int arrays hits,
    misses (critical path), prefetched, resident; and totals prefetch_used (prefetched rows hit before their
    eviction) and prefetch_wasted (evicted unused); with `return_missed` also "missed": the missed rows of each
    step (a list of arrays).
    """
    if policy not in RANKED_POLICIES:
        raise ValueError(policy)
    if policy == "opt" and prefetch:
        raise ValueError("opt is demand caching: no prefetch")
    if admit not in ("rank", "key") or (admit == "key" and policy not in SCORE_POLICIES):
        raise ValueError(f"admit={admit!r} with policy {policy!r}")
    if ema_scope not in ("position", "slot") or (ema_scope == "slot" and admit == "key"):
        raise ValueError(f"ema_scope={ema_scope!r} with admit={admit!r}")
    k = rt.k
    if prefetch < 0 or k + prefetch > rt.order.shape[1]:
        raise ValueError(f"prefetch {prefetch} outside 0..{rt.margin} (the recorded margin)")
    first_res = resident_from(rt.positions, resident_pages, page_tokens)
    demand = []
    for t in range(rt.steps):
        d = rt.order[t, :k]
        demand.append(np.sort(d[(d >= 0) & (d < first_res[t])]).astype(np.int64))  # `sets` order
    max_pos = max(int(rt.order.max()) + 1, rt.scores.shape[1]) if rt.steps else 1
    return _simulate(demand, hot_rows, policy, max_pos=max_pos, rt=rt, first_res=first_res, prefetch=prefetch,
                     keep=int(round(keep * k)), beta=beta, admit=admit, ema_scope=ema_scope,
                     return_state=return_state, return_missed=return_missed)


class _Buffer:
    """The hot buffer's slots under one replacement policy: each policy's bookkeeping at a hit and at a fill, and
    its victim order, written once for `simulate` and `simulate_ranked`.

    tokens  int64[hot_rows]: the position each slot holds (-1 empty); `where` int64[max_pos] the inverse.
    stamp   int64[hot_rows]: 2t at a fill of step t; at a hit 2t + 1 (lru, clock, score*, opt: the store's order),
            2t (lfu, lru2: a hit and a fill of one step tie) or unchanged (fifo: insertion order).
    prev    the stamp before the last hit (lru2; -2^40 for a row used once); count: uses since the fill (lfu);
    ref     CLOCK's reference bits; nextuse: the step the slot's row is used next (opt); pf: holds a prefetched
            row not hit yet; slot_ema: score_ema's per-slot average (nan: none yet).
    """

    def __init__(self, hot_rows: int, policy: str, max_pos: int, keep: int, rank_of: np.ndarray):
        self.policy, self.keep, self.rank_of = policy, keep, rank_of
        self.tokens = np.full(hot_rows, -1, np.int64)
        self.stamp = np.full(hot_rows, -1, np.int64)
        self.prev = np.full(hot_rows, -_BIG, np.int64)
        self.count = np.zeros(hot_rows, np.int64)
        self.ref = np.zeros(hot_rows, bool)
        self.nextuse = np.full(hot_rows, -1, np.int64)
        self.pf = np.zeros(hot_rows, bool)
        self.slot_ema = np.full(hot_rows, np.nan, np.float32)
        self.where = np.full(max_pos, -1, np.int64)
        self.slots = np.arange(hot_rows)
        self.hand = 0
        self.wasted = 0

    def hit(self, hs: np.ndarray, t: int) -> int:
        """Record step t's hits in slots `hs`; returns how many of them held a prefetched row not hit before."""
        if self.policy in ("lfu", "lru2"):
            self.prev[hs] = self.stamp[hs]
            self.stamp[hs] = 2 * t
            self.count[hs] += 1
        elif self.policy != "fifo":
            self.stamp[hs] = 2 * t + 1
        self.ref[hs] = True
        used = int(self.pf[hs].sum())
        self.pf[hs] = False
        return used

    def fill(self, v: np.ndarray, rows: np.ndarray, t: int) -> None:
        """Copy `rows` into victim slots `v` at step t (a prefetched row left unused counts as wasted)."""
        old = self.tokens[v]
        self.where[old[old >= 0]] = -1
        self.wasted += int(self.pf[v].sum())
        self.pf[v] = False
        self.tokens[v] = rows
        self.where[rows] = v
        self.stamp[v] = 2 * t
        self.prev[v] = -_BIG
        self.count[v] = 1
        self.ref[v] = True
        self.slot_ema[v] = np.nan

    def victims(self, n: int, eligible: np.ndarray, value: np.ndarray | None) -> np.ndarray:
        """n victims among the `eligible` slots, the first in the policy's order first (`value`: the score
        policies' per-slot value, -inf for an empty slot)."""
        p, stamp, slots = self.policy, self.stamp, self.slots
        if p in ("lru", "fifo"):
            return np.argsort(np.where(eligible, stamp, _BIG), kind="stable")[:n]
        if p == "lfu":
            return np.lexsort((slots, stamp, np.where(eligible, self.count, _BIG)))[:n]
        if p == "lru2":
            return np.lexsort((slots, stamp, np.where(eligible, self.prev, _BIG)))[:n]
        if p == "opt":
            key = np.where(self.tokens < 0, -_BIG, -self.nextuse)  # empty, then the farthest next use first
            return np.lexsort((slots, np.where(eligible, key, _BIG)))[:n]
        if p in ("score", "score_ema"):
            return np.lexsort((slots, stamp, np.where(eligible, value, np.inf)))[:n]
        if p == "score_lru":
            inside = self.rank_of[np.maximum(self.tokens, 0)] < self.keep
            group = np.where(self.tokens < 0, 0, np.where(inside, 2, 1))
            sec = np.where(group == 2, value, stamp.astype(np.float64))
            return np.lexsort((slots, stamp, sec, np.where(eligible, group, 3)))[:n]
        v, self.hand = clock_sweep(~eligible, self.ref, self.hand, n)  # clock
        return v


def _simulate(demand, hot_rows: int, policy: str, *, max_pos: int, rt: RankedTrace | None = None,
              first_res=None, prefetch: int = 0, keep: int = 0, beta: float = 0.9, admit: str = "rank",
              ema_scope: str = "position", return_state: bool = False, return_missed: bool = False) -> dict:
    """The one simulator: `demand[t]` (sorted int64 positions) through a `_Buffer` of `hot_rows` slots; with a
    ranked trace `rt` also its scores (score policies), ranks (score_lru, prefetch) and resident rows
    (`first_res`). Rules and return value: `simulate_ranked`'s docstring."""
    HR, T = hot_rows, len(demand)
    rank_of = np.full(max_pos, _BIG, np.int64)
    buf = _Buffer(HR, policy, max_pos, keep, rank_of)
    ema = np.full(rt.scores.shape[1], -np.inf, np.float32) if rt is not None else None
    slot_scope = policy == "score_ema" and ema_scope == "slot"
    width = 0
    if rt is not None:
        width = min(rt.k + max(prefetch, keep - rt.k if policy == "score_lru" else 0), rt.order.shape[1])
    nu = _next_uses(demand) if policy == "opt" else None
    hits, misses = np.zeros(T, np.int64), np.zeros(T, np.int64)
    prefetched, resident = np.zeros(T, np.int64), np.zeros(T, np.int64)
    used = 0
    missed = []
    for t, q in enumerate(demand):
        if rt is not None:
            row = rt.order[t, :width]
            ok = row >= 0
            rank_of[row[ok]] = np.flatnonzero(ok)
            full = rt.order[t, :rt.k]
            resident[t] = int(((full >= 0) & (full >= first_res[t])).sum())
        if len(q) > HR:
            raise ValueError(f"top-k {len(q)} > hot_rows {HR}")
        pos_value = None
        if policy in SCORE_POLICIES:
            st = rt.scores[t].astype(np.float32)
            if slot_scope:
                held = buf.tokens >= 0
                s_held = st[buf.tokens[held]]
                old = buf.slot_ema[held]
                buf.slot_ema[held] = np.where(np.isnan(old), s_held, beta * old + (1 - beta) * s_held)
            elif policy == "score_ema":
                fin = np.isfinite(ema)
                nxt = st.copy()
                nxt[fin] = beta * ema[fin] + (1 - beta) * st[fin]
                ema = pos_value = nxt
            else:
                pos_value = st
        slot = buf.where[q]
        hit = slot >= 0
        hs = slot[hit]
        m = q[~hit]
        nm = len(m)
        hits[t], misses[t] = hit.sum(), nm
        if return_missed:
            missed.append(m)
        used += buf.hit(hs, t)
        protected = np.zeros(HR, bool)
        protected[hs] = True
        if policy == "opt":
            buf.nextuse[hs] = nu[t][hit]

        def values():
            if slot_scope:
                return np.where(buf.tokens < 0, -np.inf, buf.slot_ema)
            if pos_value is None:
                return None
            return np.where(buf.tokens < 0, -np.inf, pos_value[np.maximum(buf.tokens, 0)])

        if nm:
            v = buf.victims(nm, ~protected, values())
            if policy == "lru":
                v = np.sort(v)  # claimed in slot order
            buf.fill(v, m, t)
            protected[v] = True
            if policy == "opt":
                buf.nextuse[v] = nu[t][~hit]
        if prefetch:
            c = rt.order[t, rt.k:rt.k + prefetch].astype(np.int64)
            c = c[(c >= 0) & (c < first_res[t])]
            c = c[buf.where[c] < 0]
            if len(c):
                toks = np.maximum(buf.tokens, 0)
                eligible = ~protected & ((buf.tokens < 0) | (rank_of[toks] >= rt.k + prefetch))
                n = min(len(c), int(eligible.sum()))
                if n:
                    val = values()
                    v = buf.victims(n, eligible, val)
                    if admit == "key":
                        c = c[np.argsort(-pos_value[c], kind="stable")]
                        n = int(np.cumprod(pos_value[c[:n]] > val[v]).sum())
                        v = v[:n]
                    if n:
                        buf.fill(v, c[:n], t)
                        buf.pf[v] = True
                        prefetched[t] = n
        if rt is not None:
            rank_of[row[ok]] = _BIG
    out = {"hits": hits, "misses": misses, "prefetched": prefetched, "resident": resident,
           "prefetch_used": used, "prefetch_wasted": buf.wasted}
    if return_state:
        out["tokens"], out["stamp"] = buf.tokens.copy(), buf.stamp.copy()
    if return_missed:
        out["missed"] = missed
    return out


# ----------------------------------------------------------------------------------------------------
# traces
# ----------------------------------------------------------------------------------------------------

# Calibrated (see `calibrate`) so that exact top-k overlap between adjacent steps ~0.44 and LRU at 2x top-k
# ~94% hits, as FACTS §3 reports for DeepSeek-V3.2 layers 20-60.
SYNTH_DEFAULTS = dict(k=2048, context=65_536, ws_factor=2.1, sigma=0.7, drift=0.01, local_frac=0.5, anti=0.75)


def synthetic_trace(steps: int = 256, *, k: int = 2048, context: int = 65_536, ws_factor: float = 2.6,
                    sigma: float = 1.3, drift: float = 0.04, local_frac: float = 0.5, anti: float = 0.0,
                    seed: int = 0):
    """Top-k sets drawn from a drifting, weighted working set.

    * working set W of ws_factor*k distinct positions, each with a persistent log-weight ~ N(0, sigma^2)
      (a heavy-tailed mix: high-weight rows are a sticky core picked almost every step, low-weight ones
      flicker in and out);
    * each step, `drift` of W is replaced by fresh rows: a `local_frac` share are neighbours (+-1..32) of a
      surviving row (drifting neighbourhoods), the rest uniformly random old context positions; the newest
      decode position always joins with a high weight (it was just written);
    * the step's top-k = k rows of W sampled without replacement in proportion to weight (Gumbel top-k),
      i.e. a noisy score ranking over W, with the log-weight of rows picked last step lowered by `anti`
      (rows near the top-k boundary flicker in and out: this is what lets adjacent-step overlap be as low as
      ~44% while 2x-top-k LRU still hits ~94%; with independent draws the two cannot both hold).
    Note: with buffer = top-k, LRU's hit rate equals the adjacent-step overlap (the buffer holds exactly the
    previous set), so the published 66-83% at 1x (another study, LongBenchV2) is not a calibration target.
    Returns a list of `steps` int64 arrays of k distinct positions.
    """
    rng = np.random.default_rng(seed)
    M = int(ws_factor * k)
    pos = rng.choice(context, M, replace=False).astype(np.int64)
    logw = rng.normal(0, sigma, M)
    member = np.zeros(context + steps + 64, bool)
    member[pos] = True
    last = np.zeros(M)  # 1 for rows in the previous step's top-k
    trace = []
    for s in range(steps):
        # drift
        n_new = rng.binomial(M, drift)
        if n_new:
            out = rng.choice(M, n_new, replace=False)
            member[pos[out]] = False
            fresh = np.empty(n_new, np.int64)
            n_loc = int(round(local_frac * n_new))
            anchors = pos[rng.integers(0, M, n_loc)]
            off = rng.integers(1, 33, n_loc) * rng.choice([-1, 1], n_loc)
            fresh[:n_loc] = np.clip(anchors + off, 0, context - 1)
            fresh[n_loc:] = rng.integers(0, context, n_new - n_loc)
            fresh[0] = context + s  # the token written last step
            # resolve collisions with current members / each other: redraw uniformly
            for i in range(n_new):
                while member[fresh[i]]:
                    fresh[i] = rng.integers(0, context)
                member[fresh[i]] = True
            pos[out] = fresh
            logw[out] = rng.normal(0, sigma, n_new)
            logw[out[0]] = 2 * sigma
            last[out] = 0.0
        g = logw + rng.gumbel(size=M) - anti * last
        top = np.argpartition(-g, k - 1)[:k]
        last[:] = 0.0
        last[top] = 1.0
        trace.append(np.sort(pos[top]))
    return trace


def adjacent_overlap(trace) -> float:
    """Mean |T_t & T_{t-1}| / |T_t| over the trace."""
    vals = [len(np.intersect1d(a, b, assume_unique=True)) / max(len(b), 1) for a, b in zip(trace[:-1], trace[1:])]
    return float(np.mean(vals)) if vals else 0.0


def calibration(trace, k: int, warmup: int = 32) -> dict:
    out = {"adjacent_overlap": adjacent_overlap(trace)}
    for f in (1.0, 2.0):
        h, m = simulate(trace, int(f * k), "lru")
        h, m = h[warmup:], m[warmup:]
        out[f"lru_hit_rate_{f:g}x"] = float(h.sum() / (h.sum() + m.sum()))
        out[f"lru_misses_per_step_{f:g}x"] = float(m.mean())
    return out


def calibrate(steps: int = 160, seed: int = 0):  # pragma: no cover - offline helper
    """Grid search of (ws_factor, sigma, drift) toward overlap 0.44 and 2x-LRU hits 0.94."""
    best = None
    for ws in (2.0, 2.3, 2.6, 3.0):
        for sg in (0.8, 1.0, 1.3, 1.6):
            for dr in (0.02, 0.03, 0.04, 0.06):
                tr = synthetic_trace(steps, ws_factor=ws, sigma=sg, drift=dr, seed=seed)
                c = calibration(tr, 2048)
                err = abs(c["adjacent_overlap"] - 0.44) / 0.44 + abs(c["lru_hit_rate_2x"] - 0.94) / 0.06
                if best is None or err < best[0]:
                    best = (err, ws, sg, dr, c)
                print(ws, sg, dr, c, flush=True)
    return best


def record_demo_traces(n_requests: int = 2, prompt_len: int = 1536, start: int = 256, seed: int = 0,
                       indexer: int = 0):
    """Per-step top-k sets of full indexer `indexer` of the demo-glm model, teacher-forced over generated
    prompts with `decode_step` + `DenseKV`; one trace per request, steps at positions start..prompt_len-1."""
    from flax import nnx

    from hisparse_jax.config import get_preset
    from hisparse_jax.demo_workload import workload
    from hisparse_jax.model.decoder import SparseMLAModel

    cfg = get_preset("demo-glm")
    model = SparseMLAModel(cfg, rngs=nnx.Rngs(seed))
    prompts = workload(cfg.vocab_size, n_requests, prompt_len, seed)
    traces = record_traces(model, prompts, start)[indexer]
    return traces, cfg.index_topk, [len(p) for p in prompts]


def record_traces(model, sequences, start: int):
    """Per-step top-k sets of every full indexer of `model`, teacher-forced over `sequences` (token lists)
    with `decode_step` over the contiguous `DenseKV` backend, all sequences in one batch: traces[indexer][seq]
    is a list of sorted int64 position arrays, one per step at positions start..len(seq)-1."""
    from hisparse_jax.kv.dense import DenseKV

    backend = DenseKV(topk=model.cfg.index_topk, index_dtype=model.index_dtype)
    steps = run_decode(model, sequences, start, backend, {}, with_nll=False)["topk"]  # [LI, n, K] per step
    lens = [len(p) for p in sequences]
    traces = [[[] for _ in sequences] for _ in model.cfg.full_indexer_layers]
    for i, tk in enumerate(steps):
        for li, per_layer in enumerate(traces):
            for b, trace in enumerate(per_layer):
                if start + i < lens[b]:
                    trace.append(np.sort(tk[li, b][tk[li, b] >= 0]).astype(np.int64))
    return traces


class RankedTrace:
    """One request's decode trace of one full indexer, with the indexer's ranking beyond its top-k.

    order   int32[steps, k + margin]: the top-(k + margin) positions of each step in descending score order
            (`select_topk`'s order: the lower position first among equal scores; -1 pads a short context);
            order[:, :k] is the step's top-k set.
    scores  float16[steps, S]: the indexer's score of every position at each step, divided by the step's
            largest |score| (ranking unchanged, no float16 overflow); -inf where the position is not written yet.
    positions  int64[steps]: the decode position of each step.
    k       the top-k the model attends over.
    """

    def __init__(self, order: np.ndarray, scores: np.ndarray, positions: np.ndarray, k: int):
        # a plain class, not a dataclass: the tests load this file without registering it as a module
        self.order, self.scores, self.positions, self.k = order, scores, positions, int(k)

    def __repr__(self) -> str:
        return f"RankedTrace(steps={self.steps}, k={self.k}, margin={self.margin}, S={self.scores.shape[1]})"

    @classmethod
    def from_scores(cls, scores, k: int, margin: int = 0, positions=None) -> "RankedTrace":
        """A trace from a score matrix [steps, S] (-inf: not written yet), ranked as `select_topk` ranks (descending,
        the lower position first among equal scores); scores stored as `record_ranked_traces` stores them."""
        sc = np.asarray(scores, np.float32)
        T, S = sc.shape
        order = np.argsort(-sc, axis=1, kind="stable")[:, :min(k + margin, S)]
        order = np.where(np.isfinite(np.take_along_axis(sc, order, 1)), order, -1).astype(np.int32)
        big = np.max(np.abs(np.where(np.isfinite(sc), sc, 0)), axis=1, keepdims=True)
        pos = np.arange(T, dtype=np.int64) + S if positions is None else np.asarray(positions, np.int64)
        return cls(order, (sc / np.where(big > 0, big, 1)).astype(np.float16), pos, k)

    @property
    def steps(self) -> int:
        return len(self.order)

    @property
    def margin(self) -> int:
        return self.order.shape[1] - self.k

    @property
    def sets(self) -> list:
        """The per-step top-k sets as `record_traces` gives them (sorted int64 arrays)."""
        return [np.sort(o[o >= 0]).astype(np.int64) for o in self.order[:, :self.k]]

    def top(self, k: int) -> "RankedTrace":
        """The same ranking read as a top-`k` trace (k <= k + margin): the model attended over self.k rows;
        this asks what a buffer would see with a smaller or larger top-k of the same indexer."""
        if not 0 < k <= self.order.shape[1]:
            raise ValueError(f"k={k} outside 1..{self.order.shape[1]}")
        return RankedTrace(self.order, self.scores, self.positions, k)

    def window(self, lo: int, hi: int) -> "RankedTrace":
        """Steps lo..hi-1."""
        return RankedTrace(self.order[lo:hi], self.scores[lo:hi], self.positions[lo:hi], self.k)


def record_ranked_traces(model, sequences, start: int, margin: int, *, with_nll: bool = False):
    """`record_traces` with the indexer's ranking kept: traces[indexer][seq] is a `RankedTrace` (its `sets` are
    exactly `record_traces`' lists) with the ordered top-(k + margin) and every position's score at each step.
    Memory: steps x S float16 + steps x (k + margin) int32 per trace. With `with_nll` also returns
    nll float32[n, L - 1]: the model's next-token loss at every position (positions with no next token: nan)."""
    import jax.numpy as jnp

    from hisparse_jax.kv.dense import DenseKV, index_select_reference
    from pallas_kernels.indexer_topk.reference import index_scores, select_topk

    def select(self, kv, ids, positions, q_index, w):
        keys = kv["index_k"][ids.index]
        topk = index_select_reference(keys, positions, q_index, w, self.topk, index_dtype=self.index_dtype)
        scores = index_scores(q_index[:, None], w[:, None], keys, index_dtype=self.index_dtype)[:, 0]
        valid = jnp.arange(keys.shape[1], dtype=jnp.int32)[None] <= positions[:, None]
        kv = dict(kv)
        kv["rank_order"] = kv["rank_order"].at[ids.index].set(select_topk(scores, valid, self.topk + self.margin))
        kv["rank_scores"] = kv["rank_scores"].at[ids.index].set(jnp.where(valid, scores, -jnp.inf))
        return topk, kv

    # DenseKV whose `select` also writes the step's scores and wide ranking into two extra carry arrays (made with
    # real types: string annotations would need this file registered as a module)
    RankingKV = dataclasses.make_dataclass("RankingKV", [("margin", int, dataclasses.field(default=0))],
                                           bases=(DenseKV,), frozen=True, namespace={"select": select})

    cfg = model.cfg
    n = len(sequences)
    L = max(len(p) for p in sequences)
    K = cfg.index_topk
    W = min(K + margin, L)
    backend = RankingKV(topk=K, index_dtype=model.index_dtype, margin=margin)
    out = run_decode(model, sequences, start, backend, {
        "rank_order": jnp.zeros((cfg.num_indexer_layers, n, W), jnp.int32),
        "rank_scores": jnp.zeros((cfg.num_indexer_layers, n, L), jnp.float32)}, with_nll)
    LI = cfg.num_indexer_layers
    lens = np.array([len(p) for p in sequences])
    traces = []
    for li in range(LI):
        per_seq = []
        for b in range(n):
            steps = max(int(lens[b]) - start, 0)
            order = np.stack([o[li, b] for o in out["rank_order"][:steps]]) if steps else np.zeros((0, W), np.int32)
            sc = np.stack([s[li, b] for s in out["rank_scores"][:steps]]) if steps else np.zeros((0, L))
            big = np.max(np.abs(np.where(np.isfinite(sc), sc, 0)), axis=1, keepdims=True)
            sc = (sc / np.where(big > 0, big, 1)).astype(np.float16)
            rt = RankedTrace(order.astype(np.int32), sc, np.arange(start, start + steps, dtype=np.int64), K)
            for s_, (a, t) in enumerate(zip(rt.order[:, :K], out["topk"][:steps])):  # same rows as the model
                if not np.array_equal(np.sort(a[a >= 0]), np.sort(t[li, b][t[li, b] >= 0])):
                    raise AssertionError(f"ranking disagrees with the model's top-k at step {s_}")
            per_seq.append(rt)
        traces.append(per_seq)
    if with_nll:
        return traces, out["nll"]
    return traces


def run_decode(model, sequences, start: int, backend, extra: dict, with_nll: bool) -> dict:
    """Teacher-force `sequences` (one batch) with `decode_step` over `backend` whose carry is `init_dense_kv`'s
    plus `extra` arrays; returns per step t >= start the host copies of the extra arrays and the top-k, and the
    next-token loss at every position."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hisparse_jax.kv.dense import init_dense_kv
    from hisparse_jax.model.decoder import decode_step

    cfg = model.cfg
    n = len(sequences)
    L = max(len(p) for p in sequences)
    toks = np.zeros((n, L), np.int32)
    for i, p in enumerate(sequences):
        toks[i, :len(p)] = p
    lens = np.array([len(p) for p in sequences])
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, positions, nxt, kv):
        m = nnx.merge(graphdef, state)
        logits, kv, all_topk = decode_step(m, tokens, positions, kv, backend)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), nxt[:, None], axis=1)[:, 0]
        return kv, jnp.stack(all_topk), nll

    kv = {**init_dense_kv(cfg, n, L), **extra}
    res = {name: [] for name in extra}
    res["topk"] = []
    nll = np.full((n, L - 1), np.nan, np.float32)
    for t in range(L):
        positions = np.where(t < lens, t, -1).astype(np.int32)
        nxt = toks[:, min(t + 1, L - 1)]
        kv, topk, loss = step(state, jnp.asarray(toks[:, t]), jnp.asarray(positions), jnp.asarray(nxt), kv)
        if with_nll and t < L - 1:
            nll[:, t] = np.where(t + 1 < lens, np.asarray(loss), np.nan)
        if t >= start:
            res["topk"].append(np.asarray(topk))
            for name in extra:
                res[name].append(np.asarray(kv[name]))
    res["nll"] = nll
    return res


# ----------------------------------------------------------------------------------------------------
# study
# ----------------------------------------------------------------------------------------------------


def study(traces, k: int, warmup: int) -> dict:
    """Hit rate and misses / H2D bytes per step for every policy and size, pooled over `traces`."""
    res = {}
    for pol in POLICIES:
        res[pol] = {}
        for f in SIZES:
            H = M = steps = 0
            for tr in traces:
                h, m = simulate(tr, int(round(f * k)), pol)
                H += int(h[warmup:].sum())
                M += int(m[warmup:].sum())
                steps += len(h[warmup:])
            res[pol][f"{f:g}x"] = {"hot_rows": int(round(f * k)), "hit_rate": H / max(H + M, 1),
                                   "misses_per_step": M / max(steps, 1),
                                   "h2d_bytes_per_step": M / max(steps, 1) * ROW_BYTES * LAYERS}
    return res


# ----------------------------------------------------------------------------------------------------
# the policy lab on ranked traces (score-aware retention, margin prefetch): used by experiments/locality.py
# ----------------------------------------------------------------------------------------------------

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


def plot(out: dict, path: str) -> None:
    plt = pyplot()
    names = list(out["traces"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        t = out["traces"][name]
        for pol, rows in t["results"].items():
            xs = [float(s[:-1]) for s in rows]
            ax.plot(xs, [r["hit_rate"] for r in rows.values()], marker="o", label=pol,
                    ls="--" if pol == "opt" else "-")
        if name == "synthetic":
            ax.axhline(0.94, color="grey", lw=0.8, ls=":", label="published LRU 2x (~94%)")
        ax.set_title(f"{name}: top-k {t['k']}, {t['steps']} steps x {t['n_traces']} trace(s)")
        ax.set_xlabel("hot buffer rows / top-k")
        ax.set_ylabel("hit rate")
        finish_axes(ax, fontsize=8)
    save_figure(fig, path)


def _table(out: dict) -> str:
    lines = []
    for name, t in out["traces"].items():
        lines.append(f"{name} (top-k {t['k']}): hit rate / H2D MiB per step (x{LAYERS} layers, {ROW_BYTES} B rows)")
        lines.append(f"{'policy':8}" + "".join(f"{s:>17}" for s in t["results"]["lru"]))
        for pol, rows in t["results"].items():
            lines.append(f"{pol:8}" + "".join(f"{r['hit_rate']:>8.3f} /{r['h2d_bytes_per_step'] / 2**20:>7.2f}"
                                              for r in rows.values()))
        if "calibration" in t:
            lines.append("calibration: " + json.dumps({k: round(v, 3) for k, v in t["calibration"].items()}))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="experiments/results")
    p.add_argument("--quick", action="store_true", help="short traces (tests / smoke)")
    p.add_argument("--no-demo", action="store_true", help="skip recording the demo-model trace")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    out = {**stamp(), "row_bytes": ROW_BYTES,
           "layers": LAYERS, "sizes": list(SIZES), "traces": {}}
    if not a.no_demo:
        n_req, plen, start = (1, 384, 64) if a.quick else (2, 1024, 128)
        t1 = time.perf_counter()
        traces, k, lens = record_demo_traces(n_req, plen, start, a.seed)
        rec = time.perf_counter() - t1
        out["traces"]["demo"] = {"k": k, "steps": len(traces[0]), "n_traces": len(traces), "prompt_lens": lens,
                                 "trace_start": start, "record_s": rec, "indexer": 0,
                                 "adjacent_overlap": float(np.mean([adjacent_overlap(t) for t in traces])),
                                 "results": study(traces, k, warmup=8)}
    steps = 64 if a.quick else 256
    tr = synthetic_trace(steps, seed=a.seed, **SYNTH_DEFAULTS)
    out["traces"]["synthetic"] = {"k": SYNTH_DEFAULTS["k"], "steps": steps, "n_traces": 1,
                                  "generator": SYNTH_DEFAULTS, "calibration": calibration(tr, SYNTH_DEFAULTS["k"]),
                                  "calibration_target": {"adjacent_overlap": 0.44, "lru_hit_rate_2x": 0.94,
                                                         "lru_hit_rate_1x": "0.66-0.83"},
                                  "results": study([tr], SYNTH_DEFAULTS["k"], warmup=32)}
    out["wall_s"] = time.perf_counter() - t0
    tag = "_quick" if a.quick else ""
    save_json(os.path.join(a.out, f"hot_buffer_policies{tag}.json"), out)
    plot(out, os.path.join(a.out, f"hot_buffer_policies{tag}.png"))
    print(_table(out))
    print(f"wall {out['wall_s']:.1f}s -> {a.out}/hot_buffer_policies{tag}.json/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
