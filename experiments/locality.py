"""How local is a trained DSA model's attention? On long held-out sequences of the standard-library corpus:

* quality: LM loss / perplexity with dense attention and with the model's own sparse forward, and per full
  indexer layer the recall of the main attention's top-k by the indexer's top-k (`hisparse_jax.train.dsa.evaluate`);
* decode traces: every full indexer's top-k at each step, teacher-forced over the sequences with `decode_step`
  (contiguous cache); per layer the step-to-step top-k overlap (the write-up reports ~44%) and the hot-buffer hit
  rate at 1x/1.5x/2x/3x/4x top-k for every policy of `hot_buffer_policies.py`, OPT (Belady) as the bound;
* the same traces from the same architecture with random weights, side by side: what every earlier hit rate in
  this project was measured on.

Writes JSON and a PNG (hit rate against hot-buffer size, trained vs random).

    PYTHONPATH=. python experiments/locality.py [--model DIR] [--out experiments/results] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def trace_study(model, sequences, start: int, warmup: int) -> dict:
    from experiments.hot_buffer_policies import adjacent_overlap, record_traces, study

    t0 = time.perf_counter()
    traces = record_traces(model, sequences, start)
    out = {"record_s": time.perf_counter() - t0, "k": model.cfg.index_topk, "trace_start": start,
           "steps_per_sequence": len(traces[0][0]), "sequences": len(sequences), "per_index_layer": []}
    for li, per_seq in enumerate(traces):
        out["per_index_layer"].append({
            "index_layer": li, "adjacent_overlap": float(np.mean([adjacent_overlap(t) for t in per_seq])),
            "results": study(per_seq, model.cfg.index_topk, warmup)})
    return out


def mean_over_layers(trace_out: dict, policy: str, size: str) -> float:
    return float(np.mean([la["results"][policy][size]["hit_rate"] for la in trace_out["per_index_layer"]]))


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, name in zip(axes, ("trained", "random")):
        tr = out["traces"][name]
        sizes = list(tr["per_index_layer"][0]["results"]["lru"])
        xs = [float(s[:-1]) for s in sizes]
        for pol in tr["per_index_layer"][0]["results"]:
            ax.plot(xs, [mean_over_layers(tr, pol, s) for s in sizes], marker="o", label=pol,
                    ls="--" if pol == "opt" else "-")
        ov = np.mean([la["adjacent_overlap"] for la in tr["per_index_layer"]])
        ax.set_title(f"{name} weights: top-k {tr['k']}, step-to-step overlap {ov:.2f}")
        ax.set_xlabel("hot buffer rows / top-k")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("hit rate (mean over index layers)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="stdlib-dsa", help="a shipped checkpoint's name or a checkpoint folder "
                   "(default: the shipped stdlib-dsa)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--sequences", type=int, default=4, help="held-out sequences (default 4)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--trace-start", type=int, default=512, help="first decode position traced (default 512)")
    p.add_argument("--warmup", type=int, default=16, help="steps of each trace not counted (cold buffer)")
    p.add_argument("--quick", action="store_true", help="2 short sequences (tests / smoke)")
    a = p.parse_args(argv)
    if a.quick:
        a.sequences, a.seq_len, a.trace_start, a.warmup = 2, 320, 160, 4

    import jax
    from flax import nnx

    import hisparse_jax as hj
    from hisparse_jax import checkpoints
    from hisparse_jax.train import data, dsa

    try:
        folder = checkpoints.resolve(a.model)
    except (ValueError, FileNotFoundError) as e:
        p.error(f"--model: {e}; train one with `python experiments/train_locality_model.py --out DIR` and pass "
                "--model DIR")
    model = hj.load_pretrained(folder)
    _, held, info = data.load_corpus()
    windows = data.fixed_windows(held, a.seq_len + 1, a.sequences)
    t0 = time.perf_counter()
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "jax": jax.__version__,
           "model": a.model if a.model in checkpoints.SHIPPED else os.path.relpath(folder), "corpus": info.to_json(),
           "settings": {k: getattr(a, k) for k in ("sequences", "seq_len", "trace_start", "warmup")},
           "published": {"adjacent_overlap": 0.44, "lru_hit_rate_2x_sglang_glm": 0.94}}
    print("evaluating ...", file=sys.stderr, flush=True)
    out["quality"] = dsa.evaluate(model, windows)
    seqs = [list(w[:-1]) for w in windows]
    out["traces"] = {}
    for name, m in (("trained", model), ("random", hj.SparseMLAModel(model.cfg, rngs=nnx.Rngs(0)))):
        print(f"decode traces, {name} weights ...", file=sys.stderr, flush=True)
        out["traces"][name] = trace_study(m, seqs, a.trace_start, a.warmup)
    out["summary"] = {name: {"adjacent_overlap": float(np.mean([la["adjacent_overlap"]
                                                                 for la in tr["per_index_layer"]])),
                             **{f"{pol}_hit_rate_{s}": mean_over_layers(tr, pol, s)
                                for pol in ("lru", "opt") for s in ("1x", "2x", "4x")}}
                      for name, tr in out["traces"].items()}
    out["wall_s"] = time.perf_counter() - t0
    os.makedirs(a.out, exist_ok=True)
    tag = "_quick" if a.quick else ""
    with open(os.path.join(a.out, f"locality{tag}.json"), "w") as f:
        json.dump(out, f, indent=1)
    plot(out, os.path.join(a.out, f"locality{tag}.png"))
    q = out["quality"]
    print(f"ppl dense {q['ppl_dense']:.3f}, sparse {q['ppl_sparse']:.3f}; indexer recall "
          f"{[round(r, 3) for r in q['recall_per_index_layer']]}")
    for name, s in out["summary"].items():
        print(f"{name:8} overlap {s['adjacent_overlap']:.3f}  LRU 1x {s['lru_hit_rate_1x']:.3f}  "
              f"2x {s['lru_hit_rate_2x']:.3f} (OPT {s['opt_hit_rate_2x']:.3f})  4x {s['lru_hit_rate_4x']:.3f}")
    print(f"wall {out['wall_s']:.1f}s -> {a.out}/locality{tag}.json/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
