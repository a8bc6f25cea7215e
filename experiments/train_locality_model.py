"""Train the small DSA model whose attention has learned real text: dense LM, indexer warm-up, sparse stage
(`hisparse_jax.train`), on the Python standard library's sources read from this interpreter. Writes the
checkpoint (Hugging Face layout: config.json + model.safetensors, loadable with `load_pretrained`), a training
log (JSON: every logged step, the held-out evaluation after each stage, the corpus) and the model card.

    python experiments/train_locality_model.py                       # the shipped checkpoint's recipe
    python experiments/train_locality_model.py --recipe smoke --out /tmp/m   # a few steps (the test's run)
    python experiments/train_locality_model.py --init hisparse_jax/checkpoints/stdlib-dsa --first-stage 5
                                       # from the shipped weights, only the MTP stages (the log keeps stages 1-4)
    python experiments/train_locality_model.py --recipe long8k --init hisparse_jax/checkpoints/stdlib-dsa \
        --out hisparse_jax/checkpoints/stdlib-dsa-8k --remat --resume
                                       # the 8K-context model; the same command again continues a killed run

Every stage's weights and log are written to --out as the stage ends, and inside a stage its state (parameters,
optimizer, logged rows) is saved with Orbax every --save-every steps under <out>/.resume-stage<N>: `--resume`
continues from --out's last finished stage and from there inside the next one (`hisparse_jax.train.resume`).

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
    p.add_argument("--eval-len", type=int, default=0, help="tokens per evaluation window (default: the longest "
                   "stage's seq_len)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--remat", action="store_true",
                   help="recompute each block's forward in the backward pass: the same updates in far less memory "
                        "(an 8K context needs it on a 24 GB machine), about a third more compute")
    p.add_argument("--init", default="", metavar="FOLDER",
                   help="start from this checkpoint's weights (its MTP layer too when it has one) instead of random ones")
    p.add_argument("--first-stage", type=int, default=1, metavar="N",
                   help="run the recipe from its stage N (1-based; default 1); needs --init, whose training_log.json "
                        "must hold stages 1..N-1 of the same recipe (they are kept in the new log)")
    p.add_argument("--save-every", type=int, default=10, metavar="N",
                   help="save the running stage's state every N steps (default 10; 0: never) for --resume")
    p.add_argument("--resume", action="store_true",
                   help="continue the run that writes --out: after the stages its training_log.json holds (as "
                        "--init OUT --first-stage N+1), and inside the next stage from its last saved step")
    a = p.parse_args(argv)
    n_stages = len(RECIPES[a.recipe])
    if a.save_every < 0:
        p.error("argument --save-every: must be >= 0")
    if a.resume and os.path.exists(os.path.join(a.out, "training_log.json")):
        with open(os.path.join(a.out, "training_log.json")) as f:
            done = len(json.load(f).get("stages", []))
        if done >= n_stages:
            print(f"{a.out}: all {n_stages} stages of recipe {a.recipe} are done", file=sys.stderr)
            return 0
        a.init, a.first_stage = a.out, done + 1
        print(f"resuming {a.out} at stage {a.first_stage}", file=sys.stderr)
    if not 1 <= a.first_stage <= n_stages:
        p.error(f"argument --first-stage: must be 1..{n_stages} (recipe {a.recipe} has {n_stages} stages)")
    if a.first_stage > 1 and not a.init:
        p.error("argument --first-stage: needs --init (the weights the skipped stages trained)")

    import jax
    from flax import nnx

    from hisparse_jax.hf_config import from_hf_config, to_hf_config
    from hisparse_jax.model.decoder import SparseMLAModel
    from hisparse_jax.model.weights import load_pretrained
    from hisparse_jax.train import data, dsa
    from hisparse_jax.train.recipe import STDLIB_DSA
    from hisparse_jax.train.resume import StageResume

    stages = RECIPES[a.recipe]
    skipped = stages[:a.first_stage - 1]
    earlier = initial_log(a.init, a.recipe, skipped) if a.init else None
    train, held, info = data.load_corpus()
    if earlier and earlier["corpus"]["sha256"] != info.sha256:
        sys.exit(f"--init {a.init}: its stages were trained on another corpus (SHA-256 {earlier['corpus']['sha256']}"
                 f", this interpreter's is {info.sha256})")
    eval_len = a.eval_len or max(sc.seq_len for sc in stages)
    windows = data.fixed_windows(held, eval_len + 1, a.eval_windows)
    with_mtp = any(sc.stage in dsa.MTP_STAGES for sc in stages)
    model = SparseMLAModel(STDLIB_DSA, rngs=nnx.Rngs(a.seed), mtp=with_mtp)
    # the MTP layer starts fresh (its head a copy of the main model's, before its first stage) unless --init has one
    fresh_mtp = with_mtp and not (a.init and from_hf_config(a.init).num_nextn_predict_layers > 0)
    if a.init:  # every parameter the checkpoint has
        nnx.update(model, nnx.state(load_pretrained(a.init, mtp=with_mtp and not fresh_mtp), nnx.Param))
    n_params = sum(int(x.size) for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    print(f"corpus: {info.train_files} training files ({info.train_bytes:,} bytes), {info.held_out_files} held out "
          f"({info.held_out_bytes:,} bytes), Python {info.python}; model: {n_params:,} parameters", file=sys.stderr)
    log = {"name": os.path.basename(os.path.normpath(a.out)), "recipe": a.recipe, "seed": a.seed, "remat": a.remat, "corpus": info.to_json(), "parameters": n_params,
           "config": to_hf_config(STDLIB_DSA), "stages": [], "steps": [],
           "jax": jax.__version__, "python": platform.python_version(), "machine": platform.platform(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if earlier:
        # a resumed run keeps the first run's starting weights as its `init`
        log.update(stages=earlier["stages"][:len(skipped)], init=earlier.get("init", a.init) if skipped else a.init,
                   first_stage=earlier.get("first_stage", a.first_stage) if skipped else a.first_stage,
                   steps=[r for rows in stage_rows(earlier["steps"])[:len(skipped)] for r in rows])
    t_all = time.perf_counter()

    def show(row):
        print(f"  {row['stage']:>6} step {row['step']:>5}: loss {row['loss']:.4f} (lm {row['lm']:.4f}, "
              f"kl {row['kl']:.4f}) {row['s_per_step']:.2f} s/step", file=sys.stderr, flush=True)

    for i, sc in enumerate(stages):
        if i < len(skipped):
            continue
        print(f"stage {i + 1}/{len(stages)}: {sc.stage}, {sc.steps} steps of {sc.batch} x {sc.seq_len} tokens",
              file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        if sc.stage in dsa.MTP_STAGES and fresh_mtp:
            dsa.init_mtp_head(model)
            fresh_mtp = False
        batches = data.random_windows(train, sc.seq_len + 1, sc.batch, seed=a.seed * 1000 + i)
        resume = None
        if a.save_every:
            resume = StageResume(os.path.join(a.out, f".resume-stage{i + 1}"), a.save_every,
                                 {"recipe": a.recipe, "stage": i + 1, "config": sc.__dict__, "seed": a.seed})
            if os.path.isdir(resume.directory):
                print(f"  continuing from the state saved in {resume.directory}", file=sys.stderr, flush=True)
        # (a resumed stage returns the rows logged before the interruption too)
        log["steps"] += dsa.train_stage(model, sc, batches, log=show, log_every=a.log_every, remat=a.remat,
                                        resume=resume)
        ev = dsa.evaluate(model, windows, batch=1)
        log["stages"].append({"stage": sc.stage, "config": sc.__dict__, "wall_s": time.perf_counter() - t0,
                              "eval": ev})
        print(f"  held out: ppl dense {ev['ppl_dense']:.3f}, sparse {ev['ppl_sparse']:.3f} "
              f"(x{ev['sparse_over_dense_ppl']:.4f}), indexer recall {ev['recall_per_index_layer']}",
              file=sys.stderr, flush=True)
        if "mtp" in ev:
            print(f"  MTP held out: loss {ev['mtp']['loss']:.4f}, draft accuracy {ev['mtp']['draft_accuracy']:.3f}, "
                  f"agreement with the main model {ev['mtp']['draft_agreement']:.3f}, indexer recall "
                  f"{ev['mtp']['indexer_recall']:.3f}", file=sys.stderr, flush=True)
        # every stage's weights and log are saved as it ends: `--init OUT --first-stage N+1` resumes from there
        log["wall_s"] = time.perf_counter() - t_all + sum(st["wall_s"] for st in log["stages"][:len(skipped)])
        save(model, log, a)
    return 0


def save(model, log: dict, a) -> None:
    """The checkpoint (config.json + model.safetensors), the training log and the model card, in `a.out`."""
    from hisparse_jax.model.weights import save_pretrained

    save_pretrained(model, a.out)
    log_path = a.log or os.path.join(a.out, "training_log.json")
    with open(log_path, "w") as f:
        json.dump(log, f, indent=1)
    with open(os.path.join(a.out, "README.md"), "w") as f:
        f.write(model_card(log))
    print(f"wrote {a.out} (checkpoint, README.md) and {log_path} after stage {len(log['stages'])}", file=sys.stderr)


def initial_log(folder: str, recipe: str, skipped) -> dict:
    """The training log of `--init FOLDER`, checked to hold the skipped stages of `recipe` (same configs, in
    order); exits saying what differs otherwise."""
    path = os.path.join(folder, "training_log.json")
    try:
        with open(path) as f:
            log = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"--init {folder}: cannot read its training log {path} ({e})")
    if not skipped:
        return log
    done = [st["config"] for st in log.get("stages", [])][:len(skipped)]
    want = [sc.__dict__ for sc in skipped]
    if log.get("recipe") != recipe or done != want:
        sys.exit(f"--init {folder}: its log ({path}, recipe {log.get('recipe')!r}) does not hold stages "
                 f"1..{len(skipped)} of recipe {recipe!r}: {done} != {want}")
    return log


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
        f"# {log.get('name', 'stdlib-dsa')}: a small DSA model trained on the Python standard library", "",
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
        if "mtp" in ev:  # the MTP stages leave the main model as it was: their own table below
            continue
        lines.append(f"| {sc['stage']} | {sc['steps']} | {sc['batch']} x {sc['seq_len']} | {sc['lr']:g} | "
                     f"{rows[-1]['loss']:.4f} | {ev['ppl_dense']:.3f} | {ev['ppl_sparse']:.3f} | "
                     f"{ev['sparse_over_dense_ppl']:.4f} | "
                     f"{', '.join(f'{r:.3f}' for r in ev['recall_per_index_layer'])} | {st['wall_s'] / 60:.1f} min |")
    mtp = [(st, rows) for st, rows in zip(log["stages"], stage_rows(log["steps"])) if "mtp" in st["eval"]]
    if mtp:
        lines += [
            "", "## The multi-token-prediction layer", "",
            "One MTP layer (DeepSeek-V3's: the main model's final hidden state at t and the embedding of token t + 1 "
            "-> one decoder layer with its own full indexer -> the token at t + 2), trained last with the main model "
            "frozen, its output head starting as a copy of the main model's: first with dense attention "
            "(`mtp_dense`), then over its indexer's top-k (`mtp_sparse`), as it drafts. Held out: the MTP loss on "
            "the token two ahead; draft accuracy = its greedy draft is the data's token; agreement = its greedy "
            "draft is the main model's greedy token there (what speculative decoding accepts, teacher-forced).", "",
            "| stage | steps | batch x tokens | lr | final MTP loss (train) | held-out MTP loss | draft accuracy | "
            "agreement with the main model | its indexer's recall | wall |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for st, rows in mtp:
            sc, ev = st["config"], st["eval"]["mtp"]
            lines.append(f"| {sc['stage']} | {sc['steps']} | {sc['batch']} x {sc['seq_len']} | {sc['lr']:g} | "
                         f"{rows[-1]['lm']:.4f} | {ev['loss']:.4f} | {ev['draft_accuracy']:.3f} | "
                         f"{ev['draft_agreement']:.3f} | {ev['indexer_recall']:.3f} | {st['wall_s'] / 60:.1f} min |")
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
    ]
    if ev.get("by_position"):  # (logs written before `evaluate` reported it have none)
        lines += [
            "Where the sparse model's loss comes from, after the last stage: the held-out loss by query position "
            f"(below {cfg['index_topk']} every query sees at most top-k keys, so sparse attention is dense there).", "",
            "| positions | loss dense | loss sparse | sparse/dense perplexity |", "|---|---:|---:|---:|",
            *(f"| {b['positions'][0]}-{b['positions'][1] - 1} | {b['loss_dense']:.4f} | {b['loss_sparse']:.4f} | "
              f"{b['sparse_over_dense_ppl']:.4f} |" for b in ev["by_position"]), "",
        ]
    lines += [
        (f"Stages {log['first_stage']}.. ran from the weights of {log['init']} (`--init`, `--first-stage`). "
         if "init" in log else "") +
        f"Trained in {log['wall_s'] / 60:.1f} min on {log['machine']} (CPU), jax {log['jax']}, Python "
        f"{log['python']}, seed {log['seed']}; the full log is `training_log.json` beside this card.", "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
