"""What do 4-bit indexer keys cost? The trained model's held-out quality with its indexer scoring keys exactly, as FP8
(DeepSeek's inference path: 132 bytes per key of 128 values) and as MXFP4 (vLLM #48558 / SGLang #30546's 4-bit
indexer cache: 68 bytes), side by side in one run.

    PYTHONPATH=. python experiments/index_dtype_quality.py [--model stdlib-dsa] [--sequences 4] [--seq-len 2048]
                                                           [--quick] [--out experiments/results]

For each format (`SparseMLAModel(index_dtype=...)`: None, "fp8", "int4"; queries are quantized as the keys):

* sparse perplexity on held-out windows (the model's own forward: each query attends to its indexer's top-k);
* per index layer, top-k recall against the FP8 selection (|top-k ∩ top-k_fp8| / k over the queries that see more
  than k keys) and against the exact one;
* the hot buffer's hit rate per index layer (LRU at 1x / 2x / 4x top-k, and OPT) on decode traces recorded in that
  format (teacher-forced over the same windows from --trace-start).

Writes `index_dtype_quality[_quick].json` in --out. The issue's bar: recall against FP8 >= 0.97 per index layer and
sparse perplexity within 1% of FP8's.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

from experiments.report import save_json, stamp

FORMATS = {"exact": None, "fp8": "fp8", "int4": "int4"}  # name in the results -> SparseMLAModel(index_dtype=...)


def key_bytes(index_head_dim: int) -> dict[str, int]:
    """Bytes per token and index layer of a key in each stored format (bf16 for the unquantized one)."""
    return {"exact": 2 * index_head_dim, "fp8": index_head_dim + 4, "int4": index_head_dim // 2 + index_head_dim // 32}


def selections(model, windows: np.ndarray):
    """The model's own forward over each window: (mean next-token loss, top-k int32[L_I, N, T, K])."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hisparse_jax.train.dsa import lm_loss

    graphdef, state = nnx.split(model)

    @jax.jit
    def one(state, ids):
        logits, aux = nnx.merge(graphdef, state).forward(ids[:, :-1])
        return lm_loss(logits.astype(jnp.float32), ids[:, 1:]), jnp.stack(aux["topk"])

    losses, topk = [], []
    for w in windows:
        loss, tk = jax.device_get(one(state, jnp.asarray(w[None])))
        losses.append(float(loss))
        topk.append(tk[:, 0])
    return float(np.mean(losses)), np.stack(topk, axis=1)


def recall(mine: np.ndarray, ref: np.ndarray, k: int) -> list[float]:
    """Per index layer: |mine ∩ ref| / k averaged over windows and the queries t >= k (each sees > k keys):
    mine, ref int32[L_I, N, T, K]."""
    out = []
    for a, b in zip(mine, ref):
        shared = [len(np.intersect1d(a[n, t], b[n, t])) for n in range(a.shape[0]) for t in range(k, a.shape[1])]
        out.append(float(np.mean(shared)) / k if shared else 1.0)
    return out


def main(argv=None) -> int:
    from experiments import held_out

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    held_out.add_arguments(p)
    p.add_argument("--warmup", type=int, default=16, help="steps of each trace not counted (cold buffer)")
    a = p.parse_args(argv)
    if a.quick:
        a.sequences, a.seq_len, a.trace_start, a.warmup = 2, 320, 160, 4
    held_out.check(p, a)
    if a.warmup < 0:
        p.error("need --warmup >= 0")

    import jax

    import hisparse_jax as hj
    from experiments.locality import mean_over_layers, trace_study

    folder, windows, info = held_out.load(p, a)
    t0 = time.perf_counter()
    cfg = None
    per, tops = {}, {}
    for name, fmt in FORMATS.items():
        print(f"{name}: held-out forward ...", file=sys.stderr, flush=True)
        model = hj.load_pretrained(folder, index_dtype=fmt)
        cfg = model.cfg
        loss, tops[name] = selections(model, windows)
        print(f"{name}: decode traces ...", file=sys.stderr, flush=True)
        traces = trace_study(model, [list(w[:-1]) for w in windows], a.trace_start, a.warmup)
        per[name] = {"index_dtype": fmt, "loss_sparse": loss, "ppl_sparse": math.exp(loss),
                     "hit_rate_per_index_layer": {
                         f"{pol}_{size}": [la["results"][pol][size]["hit_rate"] for la in traces["per_index_layer"]]
                         for pol in ("lru", "opt") for size in ("1x", "2x", "4x")},
                     "lru_hit_rate_2x": mean_over_layers(traces, "lru", "2x")}
    k = cfg.index_topk
    for name in FORMATS:
        per[name]["recall_vs_fp8_per_index_layer"] = recall(tops[name], tops["fp8"], k)
        per[name]["recall_vs_exact_per_index_layer"] = recall(tops[name], tops["exact"], k)
        per[name]["ppl_over_fp8"] = per[name]["ppl_sparse"] / per["fp8"]["ppl_sparse"]
    out = {**stamp(), "jax": jax.__version__,
           "model": held_out.model_name(a, folder), "corpus": info.to_json(),
           "settings": {key: getattr(a, key) for key in ("sequences", "seq_len", "trace_start", "warmup")},
           "index_topk": k, "index_head_dim": cfg.index_head_dim, "index_heads": cfg.index_n_heads,
           "key_bytes_per_token_per_index_layer": key_bytes(cfg.index_head_dim), "formats": per,
           "bar": {"recall_vs_fp8": 0.97, "ppl_within": 0.01},
           "meets_bar": {"recall_vs_fp8": min(per["int4"]["recall_vs_fp8_per_index_layer"]) >= 0.97,
                         "ppl_within_1pct": abs(per["int4"]["ppl_over_fp8"] - 1) <= 0.01},
           "wall_s": time.perf_counter() - t0}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"index_dtype_quality{'_quick' if a.quick else ''}.json")
    save_json(path, out)
    print(f"{'format':7} {'bytes':>5} {'ppl':>7} {'/fp8':>6}  recall vs fp8 (per index layer)  vs exact  LRU 2x hit")
    for name, r in per.items():
        print(f"{name:7} {out['key_bytes_per_token_per_index_layer'][name]:5d} {r['ppl_sparse']:7.3f} "
              f"{r['ppl_over_fp8']:6.3f}  {[round(x, 3) for x in r['recall_vs_fp8_per_index_layer']]}  "
              f"{[round(x, 3) for x in r['recall_vs_exact_per_index_layer']]}  {r['lru_hit_rate_2x']:.3f}")
    print(f"wall {out['wall_s']:.1f}s -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
