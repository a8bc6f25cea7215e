"""Train the small DSA model whose attention has learned real text: dense LM, indexer warm-up, sparse stage
(`hisparse_jax.train`), on the Python standard library's sources read from this interpreter. Writes the
checkpoint (Hugging Face layout: config.json + model.safetensors, loadable with `load_pretrained`), a training
log (JSON: every logged step, the held-out evaluation after each stage, the corpus) and the model card.

    python experiments/train_locality_model.py                       # the shipped checkpoint's recipe
    python experiments/train_locality_model.py --recipe smoke --out /tmp/m   # a few steps (the test's run)

Progress goes to stderr, one line per logged step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

DEFAULT_OUT = os.path.join("hisparse_jax", "checkpoints", "stdlib-dsa")


def main(argv=None) -> int:
    from hisparse_jax.train.recipe import RECIPES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="default", choices=sorted(RECIPES))
    p.add_argument("--out", default=DEFAULT_OUT, help=f"checkpoint folder (default {DEFAULT_OUT})")
    p.add_argument("--log", default="", help="training log JSON (default <out>/training_log.json)")
    p.add_argument("--eval-windows", type=int, default=16, help="held-out windows per evaluation (default 16)")
    p.add_argument("--eval-len", type=int, default=0, help="tokens per evaluation window (default: the last "
                   "stage's seq_len)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    a = p.parse_args(argv)

    import jax
    from flax import nnx

    from hisparse_jax.model.decoder import SparseMLAModel
    from hisparse_jax.model.weights import save_pretrained
    from hisparse_jax.train import data, dsa
    from hisparse_jax.train.recipe import STDLIB_DSA

    stages = RECIPES[a.recipe]
    train, held, info = data.load_corpus()
    eval_len = a.eval_len or stages[-1].seq_len
    windows = data.fixed_windows(held, eval_len + 1, a.eval_windows)
    model = SparseMLAModel(STDLIB_DSA, rngs=nnx.Rngs(a.seed))
    n_params = sum(int(x.size) for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    print(f"corpus: {info.train_files} training files ({info.train_bytes:,} bytes), {info.held_out_files} held out "
          f"({info.held_out_bytes:,} bytes), Python {info.python}; model: {n_params:,} parameters", file=sys.stderr)
    log = {"recipe": a.recipe, "seed": a.seed, "corpus": info.to_json(), "parameters": n_params,
           "config": STDLIB_DSA.to_hf_config(), "stages": [], "steps": [],
           "jax": jax.__version__, "python": platform.python_version(), "machine": platform.platform(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    t_all = time.perf_counter()

    def show(row):
        log["steps"].append(row)
        print(f"  {row['stage']:>6} step {row['step']:>5}: loss {row['loss']:.4f} (lm {row['lm']:.4f}, "
              f"kl {row['kl']:.4f}) {row['s_per_step']:.2f} s/step", file=sys.stderr, flush=True)

    for i, sc in enumerate(stages):
        print(f"stage {i + 1}/{len(stages)}: {sc.stage}, {sc.steps} steps of {sc.batch} x {sc.seq_len} tokens",
              file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        batches = data.random_windows(train, sc.seq_len + 1, sc.batch, seed=a.seed * 1000 + i)
        dsa.train_stage(model, sc, batches, log=show, log_every=a.log_every)
        ev = dsa.evaluate(model, windows, batch=1)
        log["stages"].append({"stage": sc.stage, "config": sc.__dict__, "wall_s": time.perf_counter() - t0,
                              "eval": ev})
        print(f"  held out: ppl dense {ev['ppl_dense']:.3f}, sparse {ev['ppl_sparse']:.3f} "
              f"(x{ev['sparse_over_dense_ppl']:.4f}), indexer recall {ev['recall_per_index_layer']}",
              file=sys.stderr, flush=True)
    log["wall_s"] = time.perf_counter() - t_all
    save_pretrained(model, a.out)
    log_path = a.log or os.path.join(a.out, "training_log.json")
    with open(log_path, "w") as f:
        json.dump(log, f, indent=1)
    with open(os.path.join(a.out, "README.md"), "w") as f:
        f.write(model_card(log))
    print(f"wrote {a.out} (checkpoint, README.md) and {log_path}", file=sys.stderr)
    return 0


def stage_rows(steps: list[dict]) -> list[list[dict]]:
    """The logged rows split by stage, in order (a stage's step numbers restart at its first row; two stages of
    one kind, such as two dense ones, are told apart that way)."""
    out: list[list[dict]] = []
    for row in steps:
        if not out or row["step"] <= out[-1][-1]["step"] or row["stage"] != out[-1][-1]["stage"]:
            out.append([])
        out[-1].append(row)
    return out


def model_card(log: dict) -> str:
    c, cfg = log["corpus"], log["config"]
    lines = [
        "# stdlib-dsa: a small DSA model trained on the Python standard library", "",
        "A GLM-5-style DeepSeek-Sparse-Attention decoder (MLA with a 512-wide latent and 64-wide rope key, a lightning "
        "indexer with 128-wide keys, IndexShare: layers 1 and 3 reuse the top-k of layers 0 and 2), byte-level, "
        f"{log['parameters']:,} parameters, trained by `experiments/train_locality_model.py --recipe "
        f"{log['recipe']}` so that the hit rates this project reports come from attention that has learned real "
        "text, not from random weights.", "",
        "## Data",
        f"The `.py` files of CPython {c['python']}'s standard library (test suites and site-packages left out), "
        f"each as a BOS byte (0) then its bytes: {c['train_files']} training files ({c['train_bytes']:,} bytes) and "
        f"{c['held_out_files']} held-out files ({c['held_out_bytes']:,} bytes), the split by a hash of the path "
        f"(`hisparse_jax.train.data`). Corpus SHA-256 `{c['sha256']}`.", "",
        "## Stages", "",
        "| stage | steps | batch x tokens | lr | final loss (train) | held-out ppl dense | sparse | sparse/dense | "
        "indexer recall per index layer | wall |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for st, rows in zip(log["stages"], stage_rows(log["steps"])):
        sc, ev = st["config"], st["eval"]
        lines.append(f"| {sc['stage']} | {sc['steps']} | {sc['batch']} x {sc['seq_len']} | {sc['lr']:g} | "
                     f"{rows[-1]['loss']:.4f} | {ev['ppl_dense']:.3f} | {ev['ppl_sparse']:.3f} | "
                     f"{ev['sparse_over_dense_ppl']:.4f} | "
                     f"{', '.join(f'{r:.3f}' for r in ev['recall_per_index_layer'])} | {st['wall_s'] / 60:.1f} min |")
    ev = log["stages"][-1]["eval"]
    lines += [
        "", "Losses are nats per byte. The stages are DeepSeek's for DSA: dense language modelling; an indexer "
        "warm-up (the rest frozen) in which each indexer learns KL(attention summed over heads || softmax(indexer "
        "scores)); a sparse stage with top-k selection active (LM loss for the model, the KL over the selected "
        "keys for the indexer, whose inputs are detached). Recall: the share of the main attention's top-"
        f"{cfg['index_topk']} keys (dense attention, summed over heads) that the indexer's top-{cfg['index_topk']} "
        f"holds, over queries that see more than {cfg['index_topk']} keys.", "",
        f"Evaluation: {ev['windows']} held-out windows of {ev['tokens_per_window']} bytes; sparse = the model's own "
        "forward (`model(ids)`, what prefill runs), dense = full causal attention.", "",
        f"Trained in {log['wall_s'] / 60:.1f} min on {log['machine']} (CPU), jax {log['jax']}, Python "
        f"{log['python']}, seed {log['seed']}; the full log is `training_log.json` beside this card.", "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
