"""The hot-buffer studies' traces (NumPy, recorded with jax): per-step top-k sets of one request and one indexer
group, drawn (`synthetic_trace`, calibrated to the published locality) or recorded from a model teacher-forced
with `decode_step` over the contiguous `DenseKV` backend (`record_traces`, `record_demo_traces`); a
`RankedTrace` keeps, per step, the indexer's ordered top-(k + margin) and every position's score
(`record_ranked_traces`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Calibrated (see `hot_buffer_policies.calibrate`) so that exact top-k overlap between adjacent steps ~0.44 and
# LRU at 2x top-k ~94% hits, as FACTS §3 reports for DeepSeek-V3.2 layers 20-60.
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


def step_overlaps(trace) -> np.ndarray:
    """|T_t & T_{t-1}| / |T_t| at each step t = 1..len(trace) - 1 (float64[len(trace) - 1])."""
    return np.array([len(np.intersect1d(a, b, assume_unique=True)) / max(len(b), 1)
                     for a, b in zip(trace[:-1], trace[1:])], np.float64)


def adjacent_overlap(trace) -> float:
    """Mean |T_t & T_{t-1}| / |T_t| over the trace."""
    vals = step_overlaps(trace)
    return float(np.mean(vals)) if len(vals) else 0.0


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


def record_ranked_traces(model, sequences, start: int, margin: int, *, with_nll: bool = False, progress=None):
    """`record_traces` with the indexer's ranking kept: traces[indexer][seq] is a `RankedTrace` (its `sets` are
    exactly `record_traces`' lists) with the ordered top-(k + margin) and every position's score at each step.
    Memory: steps x S float16 + steps x (k + margin) int32 per trace. With `with_nll` also returns
    nll float32[n, L - 1]: the model's next-token loss at every position (positions with no next token: nan).
    `progress`: as `run_decode`'s."""
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
        "rank_scores": jnp.zeros((cfg.num_indexer_layers, n, L), jnp.float32)}, with_nll, progress)
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


def run_decode(model, sequences, start: int, backend, extra: dict, with_nll: bool, progress=None) -> dict:
    """Teacher-force `sequences` (one batch) with `decode_step` over `backend` whose carry is `init_dense_kv`'s
    plus `extra` arrays; returns per step t >= start the host copies of the extra arrays and the top-k, and the
    next-token loss at every position. `progress(done, total)`, when given, is called after each position."""
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
        if progress is not None:
            progress(t + 1, L)
    res["nll"] = nll
    return res
