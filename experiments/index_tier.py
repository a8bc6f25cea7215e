"""Can the indexer find its exact top-k with its key history on the host? Page summaries on the trained model.

An indexer whose keys live in host memory keeps on the device only a summary per block of keys, from which
`reference.summary_score_bound` bounds every score of the block (`reference.SUMMARY_KINDS`, each at most the box's
2 x dI bf16 numbers per 64-key page): "box" each dimension's min and max; "ball" the mean key and a radius;
"pca_box" the box of the keys' coefficients in a per-layer basis plus the largest residual norm; "ball_pca" the ball
and the box of the deviations from its centre in a per-layer basis plus their residual; "rvq" per key, 7 one-byte
codes of the key before its RoPE (residual vector quantization, 256 centroids a stage) and an e4m3 residual radius,
bounded key by key. The bases are `reference.pca_basis` of index keys of training text (the keys, or their
deviations from their block's mean), fitted once per layer and block size; the codebooks fitted as `hisparse demo
--index-summary rvq` fits them (`index_codebooks.fit_index_codebooks` of `demo_workload.calibration_ids`' training
text). Per decode step the indexer ranks the blocks and reads exact keys of the best ones from the host:

* exact mode reads blocks in bound order until no unread bound reaches the k-th best score read so far: the
  top-k is exact (recall 1), at the cost of the blocks whose bound reaches the true k-th score; the floor of any
  exact block-level method is the blocks holding a position of the exact top-k;
* budgeted mode reads the N best-ranked blocks (by a summary's bound, or by the score of the block's mean key:
  HISA's coarse filter) and takes the top-k among their positions; N is a fraction of the step's live blocks (at
  least the top-k's own size).

This script teacher-forces held-out sequences through a trained model (`decode_step`, contiguous cache; default
`stdlib-dsa`, or `--model <checkpoint folder>`) and records at every step of every full indexer: the live blocks,
the floor, per summary the blocks exact mode reads and how far its bounds sit above each block's best score, and
the budgeted recall (|top-k found & exact top-k| / k) at several budgets per ranking; overall and per bucket of the
decoding position (`BUCKETS`). Bytes are those of fp8 keys (dI + 4 per key) fetched per step and layer, against
the whole key history and against the KV rows the step attends to (top-k x 656 B, DeepSeek's fp8 row).

    PYTHONPATH=. python experiments/index_tier.py [--model stdlib-dsa] [--sequences 4] [--seq-len 2048]
        [--trace-start 512] [--blocks 16,64] [--summaries box,ball,pca_box,ball_pca,rvq] [--out experiments/results]
        [--quick]

Writes index_tier.json (index_tier-<model>.json for another --model than stdlib-dsa; the `summary` section per
block size as before: the box's reads and recall by bound and by the mean key; each summary's figures under
`summary[block]["summaries"]`, with its ranking by its centre under "centre") and index_tier.png (recall against
blocks read per summary, exact mode's points on it; exact mode's reads over the floor per position bucket).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

from experiments.report import finish_axes, pyplot, save_figure, save_json, stamp

FP8_ROW = 656  # bytes of one DeepSeek fp8 KV row (512 e4m3 + 4 scales + 64 bf16 rope)
RANKS = ("bound", "mean")  # budgeted mode's block ranking (`reference.HOST_INDEX_RANKS`)
SUMMARIES = ("box", "ball", "pca_box", "ball_pca", "rvq")  # the page summaries (`reference.SUMMARY_KINDS`)
BASIS_WINDOWS, BASIS_TOKENS = 2, 1024  # the per-layer bases: PCA of the keys of these training-text windows
BUCKETS = (0, 512, 1024, 2048, 4096, 8192)  # decoding-position buckets [a, b) of the per-position tables (and >= 8192)


FRACTIONS = (0.0625, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)  # budgets: these parts of the live blocks


def bucket_name(i: int) -> str:
    lo, hi = BUCKETS[i], (BUCKETS[i + 1] if i + 1 < len(BUCKETS) else None)
    return f"{lo}-{hi}" if hi is not None else f"{lo}-"


def budget_recall(rank, want, live, block: int, topk: int, fractions):
    """Budgeted mode's recall at each fraction of the live blocks (at least the top-k's own size in blocks), blocks
    read best `rank` first (`reference.host_block_ranks`, stable: the lower block wins a tie): the top-k among a
    subset of the positions keeps every exact top-k position in it, so the recall is the share of the exact top-k
    (want bool[n, S]) in the blocks read. -> f32[n, len(fractions)]."""
    import jax.numpy as jnp

    n, S = want.shape
    order = jnp.argsort(-rank, axis=-1, stable=True)
    held = jnp.take_along_axis(want.reshape(n, S // block, block).sum(-1), order, axis=-1).cumsum(-1)  # [n, NB]
    out = []
    for f in fractions:
        b = jnp.maximum(jnp.ceil(f * live).astype(jnp.int32), -(-topk // block))
        got = jnp.take_along_axis(held, jnp.clip(b - 1, 0, S // block - 1)[:, None], axis=-1)[:, 0]
        out.append(got / jnp.maximum(want.sum(-1), 1))
    return jnp.stack(out, -1)


def index_keys(model, windows):
    """The index keys of every full indexer over `windows` (teacher-forced) -> f32[LI, n, L, dI]."""
    import jax.numpy as jnp

    from experiments.hot_buffer_traces import run_decode
    from hisparse_jax.kv.dense import DenseKV

    cfg = model.cfg
    n, L = len(windows), len(windows[0])

    def select(self, kv, ids, positions, q_index, w):
        topk, kv = DenseKV.select(self, kv, ids, positions, q_index, w)
        return topk, {**kv, "basis_keys": kv["basis_keys"].at[ids.index].set(kv["index_k"][ids.index])}

    KeysKV = dataclasses.make_dataclass("KeysKV", [], bases=(DenseKV,), frozen=True, namespace={"select": select})
    extra = {"basis_keys": jnp.zeros((cfg.num_indexer_layers, n, L, cfg.index_head_dim), jnp.float32)}
    return jnp.asarray(run_decode(model, windows, L - 1, KeysKV(topk=cfg.index_topk), extra, False)["basis_keys"][-1])


def fit_bases(model, windows, blocks: list[int], summaries) -> dict:
    """Per (summary, block size) of the kinds with a basis: U f32[LI, dI, m] (`reference.pca_basis`, m the
    largest rank fitting the box's bytes, `reference.summary_rank`) from the index keys of every full indexer over
    `windows` (teacher-forced): "pca_box" from the keys, "ball_pca" from the keys minus their block's mean."""
    from pallas_kernels.indexer_topk.reference import pca_basis, summary_rank

    keys = index_keys(model, windows)
    n, L = len(windows), len(windows[0])
    LI, D = keys.shape[0], keys.shape[-1]
    out = {}
    for bs in blocks:
        nb = L // bs
        kb = keys[:, :, :nb * bs].reshape(LI, n, nb, bs, D)
        for kind in summaries:
            m = summary_rank(kind, D)
            if kind == "pca_box":
                out[kind, bs] = pca_basis(keys.reshape(LI, -1, D), m)
            elif kind == "ball_pca":
                out[kind, bs] = pca_basis((kb - kb.mean(-2, keepdims=True)).reshape(LI, -1, D), m)
    return out


def record(model, sequences, start: int, blocks: list[int], summaries=SUMMARIES, bases=None, progress=None) -> dict:
    """Per block size: live, the blocks holding a top-k position, and per summary exact-mode reads and budgeted
    recall at every traced step, per index layer; budgeted recall by the mean key too. `progress(done, total)`,
    when given, is called after each decoded position."""
    import jax.numpy as jnp

    from experiments.hot_buffer_traces import run_decode
    from hisparse_jax.kv.dense import DenseKV
    from hisparse_jax.kv.dense import index_select_reference
    from hisparse_jax.config import CacheConfig
    from hisparse_jax.kv.spec import StoreSpec
    from hisparse_jax.kv.summary import rope_tables
    from hisparse_jax.units import PAGE_SIZE
    from hisparse_jax.model.rope import rope_frequencies
    from pallas_kernels.indexer_topk.reference import host_block_ranks, host_index_select_reference, index_scores

    cfg = model.cfg
    bases = bases or {}
    n, L = len(sequences), max(len(p) for p in sequences)
    K, LI = cfg.index_topk, cfg.num_indexer_layers
    Sp = -(-L // max(blocks)) * max(blocks)
    plan = {bs: FRACTIONS for bs in blocks}
    ns, nf = len(summaries), len(FRACTIONS)
    # "rvq": the rope tables of the key positions, as the store turns keys (`kv.summary.rope_tables`)
    cos, sin = rope_tables(jnp.asarray(rope_frequencies(cfg.rope, cfg.qk_rope_head_dim)[0]), jnp.arange(Sp))

    def layer_basis(kind, bs, li):
        """The basis `reference.key_block_summary` takes for `kind` at index layer li (None without one)."""
        if (kind, bs) not in bases:
            return None
        return (bases[kind, bs][li], cos, sin) if kind == "rvq" else bases[kind, bs][li]

    def select(self, kv, ids, positions, q_index, w):
        keys = kv["index_k"][ids.index]  # [n, L, dI]
        topk = index_select_reference(keys, positions, q_index, w, self.topk, index_dtype=self.index_dtype)
        kp = jnp.pad(keys.astype(jnp.float32), ((0, 0), (0, Sp - keys.shape[1]), (0, 0)))
        valid = jnp.arange(Sp, dtype=jnp.int32)[None] <= positions[:, None]
        kv = dict(kv)
        for bs, budgets in plan.items():
            full, _, live = host_index_select_reference(q_index, w, kp, valid, self.topk, bs)
            want = jnp.zeros((n, Sp), bool).at[jnp.arange(n)[:, None], jnp.maximum(full, 0)].set(full >= 0)
            # blocks holding a top-k position: what any block-level method must read for recall 1
            needed = want.reshape(n, Sp // bs, bs).any(-1).sum(-1).astype(jnp.float32)
            # how far a bound sits above its block's best score, against the gap between the best and k-th scores
            scores = jnp.where(valid, index_scores(q_index[:, None], w[:, None], kp)[:, 0], -jnp.inf)
            best = scores.reshape(n, Sp // bs, bs).max(-1)  # [n, NB]
            has = best > -jnp.inf  # live blocks
            kth = jnp.take_along_axis(scores, jnp.maximum(full[:, -1:], 0), axis=-1)[:, 0]
            gap = scores.max(-1) - kth
            reads, excess, recs = [], [], []
            for kind in summaries:
                basis = layer_basis(kind, bs, ids.index)
                reads.append(host_index_select_reference(q_index, w, kp, valid, self.topk, bs, summary=kind,
                                                         basis=basis)[1].astype(jnp.float32))
                rank = host_block_ranks(q_index, w, kp, valid, bs, "bound", kind, basis)
                excess.append(jnp.where(has, rank - best, 0).sum(-1) / jnp.maximum(has.sum(-1), 1))
                recs.append(budget_recall(rank, want, live, bs, self.topk, budgets))
            for kind in summaries:  # the same summaries ranking by their centres' scores
                basis = layer_basis(kind, bs, ids.index)
                recs.append(budget_recall(host_block_ranks(q_index, w, kp, valid, bs, "centre", kind, basis), want,
                                          live, bs, self.topk, budgets))
            recs.append(budget_recall(host_block_ranks(q_index, w, kp, valid, bs, "mean"), want, live, bs,
                                      self.topk, budgets))
            stats = jnp.concatenate([live.astype(jnp.float32)[:, None], needed[:, None], gap[:, None],
                                     jnp.stack(reads, -1), jnp.stack(excess, -1), *recs], axis=-1)
            kv[f"tier_{bs}"] = kv[f"tier_{bs}"].at[ids.index].set(stats)
        return topk, kv

    TierKV = dataclasses.make_dataclass("TierKV", [], bases=(DenseKV,), frozen=True, namespace={"select": select})
    backend = TierKV(topk=K, index_dtype=model.index_dtype)
    C = 3 + 2 * ns  # stats columns before the recall curves: live, floor, gap, reads and excess per summary
    # the store's exact mode reads the same pages rounded up to its rounds (tests/e2e/test_index_host_tier.py)
    chunk = StoreSpec.create(cfg, CacheConfig(index_tier="host")).index_read_chunk
    extra = {f"tier_{bs}": jnp.zeros((LI, n, C + (2 * ns + 1) * nf), jnp.float32) for bs in plan}
    out = run_decode(model, sequences, start, backend, extra, False, progress)
    lens = np.array([len(p) for p in sequences])
    res = {}
    for bs, budgets in plan.items():
        arr = np.stack(out[f"tier_{bs}"])  # [steps, LI, n, C + (2 ns + 1) nf]
        steps = np.arange(arr.shape[0]) + start
        keep = steps[:, None] < lens[None, :]  # [steps, n]: the step decodes a real position of the sequence
        pos = np.broadcast_to(steps[:, None], keep.shape)[keep]
        bucket = np.searchsorted(BUCKETS, pos, side="right") - 1
        per_layer = []
        for li in range(LI):
            a = arr[:, li][keep]  # [m, C + (2 ns + 1) nf]
            live, need, gap = a[:, 0], a[:, 1], a[:, 2]

            def rec(j):  # recall columns of ranking j (summaries' bounds, their centres, then the mean key)
                return a[:, C + j * nf: C + (j + 1) * nf]

            def reads(read, rows=slice(None)):
                out = {"exact_blocks_read_mean": float(read[rows].mean()),
                       "exact_fraction_read_mean": float((read[rows] / live[rows]).mean()),
                       "exact_read_over_floor_mean": float((read[rows] / need[rows]).mean())}
                if int(bs) == PAGE_SIZE:  # the store's exact mode: these pages, in whole rounds of `chunk` pages
                    store = np.minimum(live, np.ceil(read / chunk) * chunk)[rows]
                    out.update({"store_blocks_read_mean": float(store.mean()),
                                "store_read_over_floor_mean": float((store / need[rows]).mean())})
                return out

            per_summary = {}
            for j, kind in enumerate(summaries):
                read = a[:, 3 + j]
                per_summary[kind] = {
                    **reads(read), "exact_blocks_read_p95": float(np.percentile(read, 95)),
                    "bound_excess_mean": float(a[:, 3 + ns + j].mean()),
                    "bound_excess_over_gap_median": float(np.median(a[:, 3 + ns + j] / np.maximum(gap, 1e-30))),
                    "recall_by_budget": {str(b): float(v) for b, v in zip(budgets, rec(j).mean(0))},
                    "recall_by_budget_min": {str(b): float(v) for b, v in zip(budgets, rec(j).min(0))},
                    "recall_by_budget_centre": {str(b): float(v) for b, v in zip(budgets, rec(ns + j).mean(0))},
                    "by_position": {bucket_name(i): {"steps": int((bucket == i).sum()),
                                                     "live_blocks_mean": float(live[bucket == i].mean()),
                                                     "topk_blocks_mean": float(need[bucket == i].mean()),
                                                     **reads(read, bucket == i),
                                                     "recall_by_budget": {str(b): float(v) for b, v in zip(
                                                         budgets, rec(j)[bucket == i].mean(0))},
                                                     "recall_by_budget_centre": {str(b): float(v) for b, v in zip(
                                                         budgets, rec(ns + j)[bucket == i].mean(0))}}
                                    for i in range(len(BUCKETS)) if (bucket == i).any()}}
            entry = {"index_layer": li, "steps": int(a.shape[0]), "live_blocks_mean": float(live.mean()),
                     "topk_blocks_mean": float(need.mean()),
                     "topk_fraction_of_blocks_mean": float((need / live).mean()),
                     "best_minus_kth_score_mean": float(gap.mean())}
            if "box" in summaries:  # the fields the box alone had (read back by older readers)
                box = per_summary["box"]
                entry.update({k: box[k] for k in ("exact_blocks_read_mean", "exact_blocks_read_p95",
                                                  "exact_fraction_read_mean")})
                entry["recall_by_budget_bound"], entry["recall_by_budget_bound_min"] = (
                    box["recall_by_budget"], box["recall_by_budget_min"])
            entry["recall_by_budget_mean"] = {str(b): float(v) for b, v in zip(budgets, rec(2 * ns).mean(0))}
            entry["recall_by_budget_mean_min"] = {str(b): float(v) for b, v in zip(budgets, rec(2 * ns).min(0))}
            entry["per_summary"] = per_summary
            per_layer.append(entry)
        res[str(bs)] = {"block": bs, "budget_fractions": list(budgets), "summaries": list(summaries),
                        "per_index_layer": per_layer}
    return res


def _store_reads(entries, floor: float) -> dict:
    """The store's exact-mode pages read (64-key pages only: the reference's in whole rounds) over layers' entries,
    and over the floor (ratio of means, as `read_over_floor`)."""
    if "store_blocks_read_mean" not in entries[0]:
        return {}
    read = float(np.mean([x["store_blocks_read_mean"] for x in entries]))
    return {"store_blocks_read": read, "store_read_over_floor": read / floor}


def _recall_table(layers, key, fractions) -> dict:
    rec = {f: float(np.mean([key(x)[str(f)] for x in layers])) for f in fractions}
    need = {t: next((f for f in fractions if rec[f] >= t), None) for t in (0.9, 0.99, 0.999)}
    return {"recall_by_fraction_read": {str(f): v for f, v in rec.items()},
            **{f"fraction_read_for_recall_{t}": need[t] for t in need}}


def summarize(res: dict, k: int, index_dim: int) -> dict:
    """Bytes per step and layer (fp8 keys) and the smallest budget reaching recall 0.99 / 0.999, per block size;
    per summary its device bytes, exact mode's reads against the floor (the blocks holding a top-k position),
    overall and per decoding-position bucket, and its budgeted recall (layers averaged)."""
    from pallas_kernels.indexer_topk.reference import RVQ_SIZE, summary_page_values, summary_rank

    key_bytes = index_dim + 4
    out = {}
    for bs, r in res.items():
        layers = r["per_index_layer"]
        live = float(np.mean([x["live_blocks_mean"] for x in layers]))
        block_bytes = int(bs) * key_bytes
        topk_frac = float(np.mean([x["topk_fraction_of_blocks_mean"] for x in layers]))
        floor = float(np.mean([x["topk_blocks_mean"] for x in layers]))
        summ = {}
        for kind in r["summaries"]:
            ps = [x["per_summary"][kind] for x in layers]
            m = summary_rank(kind, index_dim)
            read = float(np.mean([p["exact_blocks_read_mean"] for p in ps]))
            buckets = {}
            for b in ps[0]["by_position"]:
                bp = [p["by_position"][b] for p in ps]
                bl, bf, br = (float(np.mean([x[f] for x in bp])) for f in (
                    "live_blocks_mean", "topk_blocks_mean", "exact_blocks_read_mean"))
                buckets[b] = {"steps": bp[0]["steps"], "live_blocks": bl, "floor_blocks": bf, "exact_blocks_read": br,
                              "exact_fraction_read": br / bl, "floor_fraction": bf / bl, "read_over_floor": br / bf,
                              **_store_reads(bp, bf),
                              "recall_by_fraction_read": {f: float(np.mean([x["recall_by_budget"][f] for x in bp]))
                                                          for f in bp[0]["recall_by_budget"]},
                              "centre_recall_by_fraction_read": {
                                  f: float(np.mean([x["recall_by_budget_centre"][f] for x in bp]))
                                  for f in bp[0]["recall_by_budget_centre"]}}
            if kind == "rvq":  # per key: m codes and a radius, a byte each; m bf16 codebooks of RVQ_SIZE centroids
                page_bytes, basis_bytes = (m + 1) * int(bs), 2 * m * RVQ_SIZE * index_dim
            else:
                page_bytes, basis_bytes = 2 * summary_page_values(kind, index_dim, m), 4 * index_dim * m
            summ[kind] = {"basis_rank": m, "page_values_bf16": page_bytes // 2, "page_bytes": page_bytes,
                          "bytes_per_token": page_bytes / int(bs), "basis_bytes_per_layer": basis_bytes,
                          "exact_blocks_read": read, "exact_fraction_read": read / live, "floor_blocks": floor,
                          "read_over_floor": read / floor, **_store_reads(ps, floor),
                          "bound_excess_over_best_score": float(np.mean([p["bound_excess_mean"] for p in ps])),
                          "bound_excess_over_gap_median": float(np.mean([p["bound_excess_over_gap_median"]
                                                                         for p in ps])),
                          "exact_key_bytes_per_step_layer": read * block_bytes,
                          **_recall_table(ps, lambda x: x["recall_by_budget"], r["budget_fractions"]),
                          "centre": _recall_table(ps, lambda x: x["recall_by_budget_centre"], r["budget_fractions"]),
                          "by_position": buckets}
        out[bs] = {"live_blocks": live, "topk_fraction_of_blocks": topk_frac,
                   "best_minus_kth_score": float(np.mean([x["best_minus_kth_score_mean"] for x in layers])),
                   "full_key_bytes_per_step_layer": live * block_bytes,
                   "summary_bytes_per_token_bf16": {"bound": 2 * index_dim * 2 / int(bs),
                                                    "mean": index_dim * 2 / int(bs)}}
        if "box" in summ:
            box = summ["box"]
            out[bs].update({"exact_blocks_read": box["exact_blocks_read"],
                            "exact_fraction_read": box["exact_fraction_read"],
                            "exact_key_bytes_per_step_layer": box["exact_key_bytes_per_step_layer"],
                            "exact_key_bytes_vs_topk_kv_rows": box["exact_key_bytes_per_step_layer"] / (k * FP8_ROW),
                            "bound": {key: box[key] for key in box if key.startswith(("recall_by", "fraction_read"))}})
        out[bs]["mean"] = _recall_table(layers, lambda x: x["recall_by_budget_mean"], r["budget_fractions"])
        out[bs]["summaries"] = summ
    return out


def plot(out: dict, path: str) -> None:
    """Left: budgeted recall against blocks read per summary (the largest block size), exact mode's reads as
    stars, the floor as a cross. Right: exact mode's reads / the floor per decoding-position bucket."""
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    bs = max(out["summary"], key=int)
    s = out["summary"][bs]
    for i, (kind, d) in enumerate(s["summaries"].items()):
        rec = d["recall_by_fraction_read"]
        line, = ax.plot([float(f) for f in rec], list(rec.values()), "o-", ms=3,
                        label=f"by {kind} bound ({d['page_bytes']} B / page)")
        ax.plot([d["exact_fraction_read"]], [1.0], "*", ms=11, color=line.get_color())
        x = np.arange(len(d["by_position"]))
        bx.bar(x + 0.8 * i / len(s["summaries"]), [b["read_over_floor"] for b in d["by_position"].values()],
               0.8 / len(s["summaries"]), color=line.get_color(), label=kind)
        bx.set_xticks(x + 0.4 - 0.4 / len(s["summaries"]), list(d["by_position"]))
    rec = s["mean"]["recall_by_fraction_read"]
    ax.plot([float(f) for f in rec], list(rec.values()), "k--", label="by the mean key (no bound)")
    if "box" in s["summaries"]:
        rec = s["summaries"]["box"]["centre"]["recall_by_fraction_read"]
        ax.plot([float(f) for f in rec], list(rec.values()), "k:", label="by the box's midpoint (no more bytes)")
    ax.plot([s["topk_fraction_of_blocks"]], [1.0], "kx", ms=9, label="floor: blocks holding a top-k position")
    ax.set_xlabel("fraction of the key history read per step and layer")
    ax.set_ylabel("recall of the exact top-k")
    ax.set_title(f"{out['model']}, top-{out['k']}, blocks of {bs} (stars: exact mode)", fontsize=9)
    finish_axes(ax, loc="lower right")
    bx.axhline(1.0, color="k", lw=0.8)
    bx.set_xlabel("decoding position")
    bx.set_ylabel("exact mode's blocks read / floor")
    bx.set_title("exact mode against the floor", fontsize=9)
    finish_axes(bx, loc="upper right")
    save_figure(fig, path)


def main(argv=None) -> int:
    from experiments import held_out

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    held_out.add_arguments(p)
    p.add_argument("--blocks", default="16,64", help="key-block sizes, comma-separated (default 16,64)")
    p.add_argument("--summaries", default=",".join(SUMMARIES),
                   help=f"page summaries, comma-separated (default all: {','.join(SUMMARIES)})")
    a = p.parse_args(argv)
    if a.quick:
        a.sequences, a.seq_len, a.trace_start = 2, 320, 192
    held_out.check(p, a)
    try:
        blocks = sorted({int(x) for x in a.blocks.split(",") if x})
    except ValueError:
        blocks = []
    if not blocks or any(b <= 0 for b in blocks):
        p.error(f"--blocks: positive sizes, comma-separated, got {a.blocks!r}")
    summaries = [x for x in SUMMARIES if x in a.summaries.split(",")]
    if not summaries or set(a.summaries.split(",")) - set(SUMMARIES):
        p.error(f"--summaries: some of {','.join(SUMMARIES)}, comma-separated, got {a.summaries!r}")

    import jax
    import jax.numpy as jnp

    import hisparse_jax as hj
    from hisparse_jax.demo_workload import calibration_ids
    from hisparse_jax.index_codebooks import fit_index_codebooks

    folder, windows, info = held_out.load(p, a)
    model = hj.load_pretrained(folder)
    t0 = time.perf_counter()
    basis_len = min(a.seq_len, BASIS_TOKENS)
    bases = {}
    if {"pca_box", "ball_pca"} & set(summaries):
        from hisparse_jax.train import data

        train = data.load_corpus()[0]
        print(f"fitting the bases on {BASIS_WINDOWS} x {basis_len} tokens of training text ...", file=sys.stderr,
              flush=True)
        bases = fit_bases(model, [list(w) for w in data.fixed_windows(train, basis_len, BASIS_WINDOWS)], blocks,
                          summaries)
    if "rvq" in summaries:
        calibration = np.asarray(calibration_ids("text", model.cfg, a.seq_len, 0))
        print(f"fitting the RVQ codebooks on {len(calibration)} x {calibration.shape[1]} tokens of training text ...",
              file=sys.stderr, flush=True)
        books = jnp.asarray(fit_index_codebooks(model, calibration).books)
        bases.update({("rvq", bs): books for bs in blocks})
    print(f"recording {a.sequences} x {a.seq_len} tokens from position {a.trace_start}, blocks {blocks}, "
          f"summaries {summaries} ...", file=sys.stderr, flush=True)
    t1 = time.perf_counter()

    def progress(done, total):
        if done % max(total // 16, 1) == 0 or done == total:
            print(f"  decoded {done}/{total} positions ({time.perf_counter() - t1:.0f} s)", file=sys.stderr,
                  flush=True)
    res = record(model, [list(w) for w in windows], a.trace_start, blocks, summaries, bases, progress)
    out = {**stamp(), "jax": jax.__version__,
           "model": held_out.model_name(a, folder), "corpus": info.to_json(),
           "k": model.cfg.index_topk, "index_heads": model.cfg.index_n_heads, "index_dim": model.cfg.index_head_dim,
           "settings": {"sequences": a.sequences, "seq_len": a.seq_len, "trace_start": a.trace_start,
                        "blocks": blocks, "summaries": summaries,
                        "basis": {"from": "training text (pca_basis of the keys of every full indexer)",
                                  "windows": BASIS_WINDOWS, "tokens": basis_len},
                        "rvq_codebooks": {"from": "training text (demo_workload.calibration_ids, "
                                                  "index_codebooks.fit_index_codebooks)",
                                          "windows": len(calibration), "tokens": calibration.shape[1]}
                        if "rvq" in summaries else None},
           "bytes": {"fp8_key": model.cfg.index_head_dim + 4, "fp8_kv_row": FP8_ROW},
           "record_s": time.perf_counter() - t0, "per_block_size": res,
           "summary": summarize(res, model.cfg.index_topk, model.cfg.index_head_dim)}
    os.makedirs(a.out, exist_ok=True)
    name = "index_tier" if a.model == "stdlib-dsa" else f"index_tier-{os.path.basename(os.path.normpath(a.model))}"
    save_json(os.path.join(a.out, f"{name}.json"), out)
    plot(out, os.path.join(a.out, f"{name}.png"))
    for bs, s in out["summary"].items():
        print(f"blocks of {bs:>3}: live {s['live_blocks']:.1f}, holding a top-k position "
              f"{100 * s['topk_fraction_of_blocks']:.0f} %; recall by the mean key at 25 / 50 % "
              + " / ".join(f"{s['mean']['recall_by_fraction_read'][f]:.3f}" for f in ("0.25", "0.5")))
        if "box" in s["summaries"]:
            print(f"blocks of {bs:>3}: live {s['live_blocks']:.1f}, exact mode reads {s['exact_blocks_read']:.1f} "
                  f"({100 * s['exact_fraction_read']:.0f} %), blocks holding a top-k position "
                  f"{100 * s['topk_fraction_of_blocks']:.0f} %; exact keys / top-k KV rows "
                  f"{s['exact_key_bytes_vs_topk_kv_rows']:.2f}; recall at half the blocks "
                  + ", ".join(f"{s[r]['recall_by_fraction_read']['0.5']:.3f} (by {r})" for r in RANKS)
                  + "; recall 0.99 reading "
                  + ", ".join(f"{s[r]['fraction_read_for_recall_0.99']} (by {r})" for r in RANKS))
        for kind, d in s["summaries"].items():
            print(f"  {kind:>8} ({d['page_bytes']} B / page): exact mode reads {d['exact_blocks_read']:.2f} blocks "
                  f"= {d['read_over_floor']:.3f} x the floor {d['floor_blocks']:.2f} "
                  f"({100 * d['exact_fraction_read']:.0f} % of live); per position "
                  + ", ".join(f"{b} {x['read_over_floor']:.3f}" for b, x in d["by_position"].items())
                  + "; recall at 25 / 50 % "
                  + " / ".join(f"{d['recall_by_fraction_read'][f]:.3f}" for f in ("0.25", "0.5"))
                  + " (by its centre "
                  + " / ".join(f"{d['centre']['recall_by_fraction_read'][f]:.3f}" for f in ("0.25", "0.5")) + ")"
                  + f"; bound - block's best score {d['bound_excess_over_best_score']:.2f} "
                  f"(best - k-th score {s['best_minus_kth_score']:.2f})"
                  + (f"; the store reads {d['store_read_over_floor']:.3f} x the floor (whole rounds)"
                     if "store_read_over_floor" in d else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
