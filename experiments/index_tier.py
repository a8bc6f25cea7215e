"""Can the indexer find its exact top-k with its key history on the host? Block bounds on the trained model.

An indexer whose keys live in host memory keeps on the device only a summary per block of keys: each dimension's
min and max (`reference.key_block_bounds`), from which `reference.block_score_bound` bounds every score of the
block. Per decode step it ranks the blocks by bound and reads exact keys of the best ones from the host:

* exact mode reads blocks in bound order until no unread bound reaches the k-th best score read so far: the
  top-k is exact (recall 1), at the cost of the blocks whose bound reaches the true k-th score;
* budgeted mode reads the N best-ranked blocks (by bound, or by the score of the block's mean key: HISA's coarse
  filter) and takes the top-k among their positions; N is a fraction of the step's live blocks (at least the
  top-k's own size).

This script teacher-forces held-out sequences through the trained `stdlib-dsa` model (`decode_step`, contiguous
cache) and records at every step of every full indexer: the live blocks, the blocks exact mode reads, the blocks
holding a position of the exact top-k (what any block-level method must read for recall 1), and the
budgeted recall (|top-k found & exact top-k| / k) at several budgets and both rankings, for blocks of 16 and 64
keys (64: the store's page). Bytes are those of fp8 keys (dI + 4 per key) fetched per step and layer, against the whole key
history and against the KV rows the step attends to (top-k x 656 B, DeepSeek's fp8 row).

    PYTHONPATH=. python experiments/index_tier.py [--model stdlib-dsa] [--sequences 4] [--seq-len 2048]
        [--trace-start 512] [--blocks 16,64] [--out experiments/results] [--quick]

Writes index_tier.json (and index_tier.png: recall against blocks read per step, exact mode's point on it).
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


FRACTIONS = (0.0625, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)  # budgets: these parts of the live blocks


def record(model, sequences, start: int, blocks: list[int]) -> dict:
    """Per block size: live, exact-mode reads and budgeted recall at every traced step, per index layer."""
    import jax.numpy as jnp

    from experiments.hot_buffer_traces import run_decode
    from hisparse_jax.kv.dense import DenseKV
    from hisparse_jax.kv.dense import index_select_reference
    from pallas_kernels.indexer_topk.reference import host_index_select_reference

    cfg = model.cfg
    n, L = len(sequences), max(len(p) for p in sequences)
    K, LI = cfg.index_topk, cfg.num_indexer_layers
    Sp = -(-L // max(blocks)) * max(blocks)
    plan = {bs: FRACTIONS for bs in blocks}

    def select(self, kv, ids, positions, q_index, w):
        keys = kv["index_k"][ids.index]  # [n, L, dI]
        topk = index_select_reference(keys, positions, q_index, w, self.topk, index_dtype=self.index_dtype)
        kp = jnp.pad(keys.astype(jnp.float32), ((0, 0), (0, Sp - keys.shape[1]), (0, 0)))
        valid = jnp.arange(Sp, dtype=jnp.int32)[None] <= positions[:, None]
        kv = dict(kv)
        for bs, budgets in plan.items():
            full, read, live = host_index_select_reference(q_index, w, kp, valid, self.topk, bs)
            want = jnp.zeros((n, Sp), bool).at[jnp.arange(n)[:, None], jnp.maximum(full, 0)].set(full >= 0)
            # blocks holding a top-k position: what any block-level method must read for recall 1
            needed = want.reshape(n, Sp // bs, bs).any(-1).sum(-1).astype(jnp.float32)
            rec = [needed]
            for rank in RANKS:
                for f in budgets:  # at least the blocks the top-k's own size takes
                    b = jnp.maximum(jnp.ceil(f * live).astype(jnp.int32), -(-self.topk // bs))
                    got = host_index_select_reference(q_index, w, kp, valid, self.topk, bs, budget=b, rank=rank)[0]
                    hit = jnp.zeros((n, Sp), bool).at[jnp.arange(n)[:, None], jnp.maximum(got, 0)].set(got >= 0)
                    rec.append((hit & want).sum(-1) / jnp.maximum(want.sum(-1), 1))
            stats = jnp.stack([read.astype(jnp.float32), live.astype(jnp.float32), *rec], axis=-1)  # [n, 3 + ...]
            kv[f"tier_{bs}"] = kv[f"tier_{bs}"].at[ids.index].set(stats)
        return topk, kv

    TierKV = dataclasses.make_dataclass("TierKV", [], bases=(DenseKV,), frozen=True, namespace={"select": select})
    backend = TierKV(topk=K, index_dtype=model.index_dtype)
    extra = {f"tier_{bs}": jnp.zeros((LI, n, 3 + len(RANKS) * len(b)), jnp.float32) for bs, b in plan.items()}
    out = run_decode(model, sequences, start, backend, extra, False)
    lens = np.array([len(p) for p in sequences])
    res = {}
    for bs, budgets in plan.items():
        arr = np.stack(out[f"tier_{bs}"])  # [steps, LI, n, 2 + nb]
        steps = np.arange(arr.shape[0]) + start
        keep = steps[:, None] < lens[None, :]  # [steps, n]: the step decodes a real position of the sequence
        per_layer = []
        for li in range(LI):
            a = arr[:, li][keep]  # [m, 2 + nb]
            per_layer.append({
                "index_layer": li, "steps": int(a.shape[0]),
                "live_blocks_mean": float(a[:, 1].mean()),
                "exact_blocks_read_mean": float(a[:, 0].mean()),
                "exact_blocks_read_p95": float(np.percentile(a[:, 0], 95)),
                "exact_fraction_read_mean": float((a[:, 0] / a[:, 1]).mean()),
                "topk_blocks_mean": float(a[:, 2].mean()),
                "topk_fraction_of_blocks_mean": float((a[:, 2] / a[:, 1]).mean()),
                **{f"recall_by_budget_{rank}": {str(b): float(a[:, 3 + j * len(budgets) + i].mean())
                                                 for i, b in enumerate(budgets)} for j, rank in enumerate(RANKS)},
                **{f"recall_by_budget_{rank}_min": {str(b): float(a[:, 3 + j * len(budgets) + i].min())
                                                     for i, b in enumerate(budgets)} for j, rank in enumerate(RANKS)}})
        res[str(bs)] = {"block": bs, "budget_fractions": list(budgets), "per_index_layer": per_layer}
    return res


def summarize(res: dict, k: int, index_dim: int) -> dict:
    """Bytes per step and layer (fp8 keys) and the smallest budget reaching recall 0.99 / 0.999, per block size."""
    key_bytes = index_dim + 4
    out = {}
    for bs, r in res.items():
        layers = r["per_index_layer"]
        live = float(np.mean([x["live_blocks_mean"] for x in layers]))
        exact = float(np.mean([x["exact_blocks_read_mean"] for x in layers]))
        block_bytes = int(bs) * key_bytes
        topk_frac = float(np.mean([x["topk_fraction_of_blocks_mean"] for x in layers]))
        out[bs] = {"live_blocks": live, "exact_blocks_read": exact, "exact_fraction_read": exact / live,
                   "topk_fraction_of_blocks": topk_frac,
                   "exact_key_bytes_per_step_layer": exact * block_bytes,
                   "full_key_bytes_per_step_layer": live * block_bytes,
                   "exact_key_bytes_vs_topk_kv_rows": exact * block_bytes / (k * FP8_ROW),
                   "summary_bytes_per_token_bf16": {"bound": 2 * index_dim * 2 / int(bs), "mean": index_dim * 2 / int(bs)}}
        for rank in RANKS:
            rec = {f: float(np.mean([x[f"recall_by_budget_{rank}"][str(f)] for x in layers]))
                   for f in r["budget_fractions"]}
            need = {t: next((f for f in r["budget_fractions"] if rec[f] >= t), None) for t in (0.9, 0.99, 0.999)}
            out[bs][rank] = {"recall_by_fraction_read": {str(f): v for f, v in rec.items()},
                             **{f"fraction_read_for_recall_{t}": need[t] for t in need}}
    return out


def plot(out: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (bs, s) in enumerate(out["summary"].items()):
        for rank, style in zip(RANKS, ("o-", "s--")):
            rec = s[rank]["recall_by_fraction_read"]
            ax.plot([float(f) for f in rec], list(rec.values()), style, label=f"budgeted by {rank}, blocks of {bs}")
        ax.plot([s["exact_fraction_read"]], [1.0], "k*", ms=10)
        ax.plot([s["topk_fraction_of_blocks"]], [1.0], "kx", ms=9)

    sizes = " / ".join(out["summary"])
    ax.text(0.02, 0.96, f"star: exact mode's reads, blocks of {sizes}: " + " / ".join(
        f"{100 * s['exact_fraction_read']:.0f} %" for s in out["summary"].values()) + "\n"
        "x: blocks holding a top-k position: " + " / ".join(
        f"{100 * s['topk_fraction_of_blocks']:.0f} %" for s in out["summary"].values()),
        transform=ax.transAxes, va="top", fontsize=8)
    ax.set_xlabel("fraction of the key history read per step and layer")
    ax.set_ylabel("recall of the exact top-k")
    ax.set_title(f"host-tier indexer keys, {out['model']} (top-{out['k']})")
    finish_axes(ax, loc="lower right")
    save_figure(fig, path)


def main(argv=None) -> int:
    from experiments import held_out

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    held_out.add_arguments(p)
    p.add_argument("--blocks", default="16,64", help="key-block sizes, comma-separated (default 16,64)")
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

    import jax

    import hisparse_jax as hj

    folder, windows, info = held_out.load(p, a)
    model = hj.load_pretrained(folder)
    t0 = time.perf_counter()
    print(f"recording {a.sequences} x {a.seq_len} tokens from position {a.trace_start}, blocks {blocks} ...",
          file=sys.stderr, flush=True)
    res = record(model, [list(w) for w in windows], a.trace_start, blocks)
    out = {**stamp(), "jax": jax.__version__,
           "model": held_out.model_name(a, folder), "corpus": info.to_json(),
           "k": model.cfg.index_topk, "index_heads": model.cfg.index_n_heads, "index_dim": model.cfg.index_head_dim,
           "settings": {"sequences": a.sequences, "seq_len": a.seq_len, "trace_start": a.trace_start,
                        "blocks": blocks},
           "bytes": {"fp8_key": model.cfg.index_head_dim + 4, "fp8_kv_row": FP8_ROW},
           "record_s": time.perf_counter() - t0, "per_block_size": res,
           "summary": summarize(res, model.cfg.index_topk, model.cfg.index_head_dim)}
    os.makedirs(a.out, exist_ok=True)
    save_json(os.path.join(a.out, "index_tier.json"), out)
    plot(out, os.path.join(a.out, "index_tier.png"))
    for bs, s in out["summary"].items():
        print(f"blocks of {bs:>3}: live {s['live_blocks']:.1f}, exact mode reads {s['exact_blocks_read']:.1f} "
              f"({100 * s['exact_fraction_read']:.0f} %), blocks holding a top-k position "
              f"{100 * s['topk_fraction_of_blocks']:.0f} %; exact keys / top-k KV rows "
              f"{s['exact_key_bytes_vs_topk_kv_rows']:.2f}; recall at half the blocks "
              + ", ".join(f"{s[r]['recall_by_fraction_read']['0.5']:.3f} (by {r})" for r in RANKS)
              + "; recall 0.99 reading " + ", ".join(f"{s[r]['fraction_read_for_recall_0.99']} (by {r})" for r in RANKS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
