"""The hot-buffer simulator of the policy studies (pure NumPy): one loop (`_simulate`) over a trace's per-step
demand sets, each replacement policy's bookkeeping and victim order written once (`_Buffer`); `simulate` runs it
on top-k sets (every position offloaded), `simulate_ranked` on a `RankedTrace` (score policies, margin prefetch,
resident tail pages).

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
  score, score_lru, score_ema  (ranked traces only) the victim chosen by this step's indexer scores, or their
         moving average: `simulate_ranked`'s docstring.
"""

from __future__ import annotations

import numpy as np

from experiments.hot_buffer_traces import RankedTrace

POLICIES = ("lru", "fifo", "clock", "lfu", "lru2", "opt")


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


RANKED_POLICIES = ("lru", "fifo", "clock", "score", "score_lru", "score_ema", "opt")
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
      fifo       as `simulate`: lru whose hit leaves the stamp as it was (insertion order).
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
