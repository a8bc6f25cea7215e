"""Does the hot buffer's locality hold at long context, as top-k / context falls?

Every earlier locality figure comes from `stdlib-dsa` (trained at a 2K-byte context: its top-k of 128 is 6 % of
it). Here any list of trained models (e.g. `stdlib-dsa` and `stdlib-dsa-8k`, trained at 8K: 1.6 %, GLM-5's 2048 of
128K) is teacher-forced over the same held-out text, each at its own context, and each full indexer's top-k is
recorded at every decode step with its scores (`hot_buffer_traces.record_ranked_traces`). On those traces
(`policy_lab.lab_sweep` -> `hot_buffer_sim.simulate_ranked`): the critical-path hit rate of LRU, FIFO, CLOCK,
score_ema (the score-aware policy of the policy lab, its beta) and OPT (Belady, the bound) with a hot buffer of
1x, 2x, 3x and 4x top-k rows, overall and by decode-position bucket (0-512, 512-1K, 1K-2K, 2K-4K, 4K-8K, ...: the
buckets the traces reach), and the step-to-step top-k overlap |T_t & T_(t-1)| / |T_t| by bucket. Rates pool the
index layers, the windows and the steps of a bucket (hits / top-k rows), the first --warmup steps of each trace
not counted.

Context per model (--seq-len 0, the default): the context it was trained at, i.e. the longest training stage's
seq_len in the checkpoint's training_log.json (stdlib-dsa: 2048; stdlib-dsa-8k: 8192, though its last stage took 2K
windows), else config.json's max_position_embeddings (only the reach of its position table: stdlib-dsa's is 8192
though it was trained at 2048, hence the log first). The windows are `data.fixed_windows` of the held-out text at
the longest context of the run, each model reading the first seq_len tokens of each: the models see the same text,
so a bucket they share compares the models, not the text.

Memory while recording, per model: about 6 x LI x sequences x seq_len^2 bytes (every position's score at every
step: float32 while decoding, float16 kept; LI = 2 full indexers): 3.2 GB at 8K x 4 windows.

Writes locality_long.json (locality_long_quick.json with --quick) and a PNG (hit rate at 2x top-k by position
bucket, one panel per model, and LRU / OPT of all models side by side) under --out; prints a table.

    PYTHONPATH=. python experiments/locality_long.py --models stdlib-dsa,stdlib-dsa-8k \\
        [--seq-len 0] [--sequences 4] [--trace-start 0] [--warmup 16] [--quick] [--out experiments/results]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from experiments import held_out
from experiments.report import finish_axes, pyplot, save_figure, save_results, stamp

HERE = os.path.dirname(os.path.abspath(__file__))

MULTIPLES = (1.0, 2.0, 3.0, 4.0)  # hot buffer rows / top-k
POLICIES = ("lru", "fifo", "clock", "score_ema", "opt")
PLOT_SIZE = "2x"
QUICK = {"sequences": 2, "seq_len": 640, "trace_start": 0, "warmup": 4}


def variants() -> dict:
    """name -> (simulate_ranked policy, keywords): the policy lab's own where it has the policy (score_ema's beta)."""
    from experiments import policy_lab as pl

    return {n: pl.LAB_VARIANTS.get(n, (n, {})) for n in POLICIES}


def bucket_edges(length: int) -> list:
    """0, 512, then doubling (1K, 2K, 4K, 8K, ...) up to the first edge >= `length`."""
    edges = [0, 512]
    while edges[-1] < length:
        edges.append(edges[-1] * 2)
    return edges


def bucket_label(lo: int, hi: int) -> str:
    def short(n):
        return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
    return f"{short(lo)}-{short(hi)}"


def training_context(folder: str, cfg) -> tuple[int, str]:
    """(the context `folder`'s model was trained at, where that was read): the longest stage's seq_len of its
    training_log.json, else config.json's max_position_embeddings."""
    path = os.path.join(folder, "training_log.json")
    if os.path.isfile(path):
        with open(path) as f:
            stages = json.load(f).get("stages") or []
        lens = [st["config"]["seq_len"] for st in stages if isinstance(st.get("config"), dict)
                and st["config"].get("seq_len")]
        if lens:
            return int(max(lens)), "training_log.json: the longest stage's seq_len"
    return int(cfg.max_position_embeddings), "config.json: max_position_embeddings (no training log)"


def overlap_by_bucket(ranked, warmup: int, edges) -> dict:
    """Step-to-step top-k overlap (`step_overlaps`) of steps >= max(warmup, 1), pooled over index layers and
    sequences: {"overall": mean, "buckets": {label: mean}} (buckets with steps only)."""
    from experiments.hot_buffer_traces import step_overlaps

    pos, val = [], []
    for per_seq in ranked:
        for rt in per_seq:
            first = max(warmup, 1)
            val.append(step_overlaps(rt.sets)[first - 1:])
            pos.append(rt.positions[first:])
    pos, val = np.concatenate(pos), np.concatenate(val)
    out = {"overall": float(val.mean()) if len(val) else None, "buckets": {}}
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (pos >= lo) & (pos < hi)
        if sel.any():
            out["buckets"][bucket_label(lo, hi)] = float(val[sel].mean())
    return out


def hit_rates(ranked, warmup: int, edges, log=None) -> dict:
    """{policy: {"1x": {"overall", "per_index_layer", "buckets": {label: hit rate}}, ...}} at MULTIPLES x top-k."""
    from experiments import policy_lab as pl

    vs = variants()
    out = {n: {} for n in vs}
    for f in MULTIPLES:
        size = f"{f:g}x"
        t0 = time.perf_counter()
        sw = pl.lab_sweep(ranked, warmup, vs, (f,), keep_steps=tuple(vs), keep_size=size)
        for n in vs:
            out[n][size] = {"overall": sw["overall"][n][size]["hit_rate"],
                            "per_index_layer": [la[n][size]["hit_rate"] for la in sw["per_index_layer"]],
                            "buckets": {bucket_label(*b["positions"]): b["hit_rate"]
                                        for b in pl.by_position(sw["steps"][n], edges)}}
        if log:
            rates = ", ".join(f"{n} {out[n][size]['overall']:.3f}" for n in vs)
            log(f"  {size} top-k: {rates} ({time.perf_counter() - t0:.0f} s)")
    return out


def study(model, sequences, start: int, warmup: int, log=None) -> dict:
    """Record the ranked traces of `sequences` and measure them (see the module docstring)."""
    from experiments.hot_buffer_traces import record_ranked_traces

    L = max(len(s) for s in sequences)
    every = max(L // 8, 1)
    t0 = time.perf_counter()

    def progress(done, total):
        if log and (done % every == 0 or done == total):
            log(f"  decoded {done}/{total} positions ({time.perf_counter() - t0:.0f} s)")
    ranked = record_ranked_traces(model, sequences, start, 0, progress=progress)
    record_s = time.perf_counter() - t0
    edges = bucket_edges(L)
    t1 = time.perf_counter()
    res = {"record_s": record_s, "index_layers": len(ranked), "steps_per_sequence": ranked[0][0].steps}
    counted = np.concatenate([rt.positions[warmup:] for rt in ranked[0]])
    res["buckets"] = {bucket_label(lo, hi): {"positions": [lo, hi], "counted": [int(counted[sel].min()),
                                                                                int(counted[sel].max()) + 1]}
                      for lo, hi in zip(edges[:-1], edges[1:]) if (sel := (counted >= lo) & (counted < hi)).any()}
    res["overlap"] = overlap_by_bucket(ranked, warmup, edges)
    res["hit_rate"] = hit_rates(ranked, warmup, edges, log)
    res["simulate_s"] = time.perf_counter() - t1
    return res


def model_folder(p: argparse.ArgumentParser, name: str) -> str:
    """`held_out.resolve`'s folder (a shipped checkpoint's name or a checkpoint folder), or, for a bare name, the
    checkpoint folder of that name beside the shipped ones (hisparse_jax/checkpoints/NAME: one trained there and
    not shipped yet, e.g. stdlib-dsa-8k); a usage error otherwise."""
    from hisparse_jax import checkpoints

    beside = os.path.join(os.path.dirname(os.path.abspath(checkpoints.__file__)), name)
    if (name not in checkpoints.SHIPPED and os.path.basename(name) == name and not os.path.isdir(name)
            and os.path.isfile(os.path.join(beside, "config.json"))):
        return beside
    return held_out.resolve(p, name, "--models")


def parse_seq_lens(p: argparse.ArgumentParser, text: str, n: int) -> list:
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        p.error(f"--seq-len: expected integers separated by commas, got {text!r}")
    if len(vals) == 1:
        vals = vals * n
    if len(vals) != n or any(v < 0 for v in vals):
        p.error(f"--seq-len: one value >= 0 or one per model ({n}), got {text!r}")
    return vals


def plot(out: dict, path: str) -> None:
    plt = pyplot()
    models = out["models"]
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(5.2 * (len(models) + 1), 4.2), squeeze=False)
    axes = axes[0]
    ymin = 1.0
    for ax, (name, m) in zip(axes, models.items()):
        labels = list(m["buckets"])
        x = np.arange(len(labels))
        for pol, sizes in m["hit_rate"].items():
            ys = [sizes[PLOT_SIZE]["buckets"].get(b, np.nan) for b in labels]
            ax.plot(x, ys, marker="o", label=pol, ls="--" if pol == "opt" else "-")
            ymin = min(ymin, np.nanmin(ys))
        ov = [m["overlap"]["buckets"].get(b, np.nan) for b in labels]
        ax.plot(x, ov, color="grey", ls=":", marker=".", label="top-k overlap")
        ymin = min(ymin, np.nanmin(ov))
        ax.set_xticks(x, labels)
        finish_axes(ax, xlabel="decode position", ylabel=f"hit rate, hot buffer {PLOT_SIZE} top-k",
                    title=f"{name}: top-k {m['k']} of {m['seq_len']} ({100 * m['topk_over_context']:.1f} %)",
                    fontsize=8)
    ax = axes[-1]
    edges = bucket_edges(max(m["seq_len"] for m in models.values()))
    labels = [bucket_label(lo, hi) for lo, hi in zip(edges[:-1], edges[1:])]
    for i, (name, m) in enumerate(models.items()):
        for pol, ls in (("lru", "-"), ("opt", "--")):
            ys = [m["hit_rate"][pol][PLOT_SIZE]["buckets"].get(b, np.nan) for b in labels]
            ax.plot(np.arange(len(labels)), ys, marker="o", ls=ls, color=f"C{i}",
                    label=f"{name} {pol} ({100 * m['topk_over_context']:.1f} %)")
    ax.set_xticks(np.arange(len(labels)), labels)
    finish_axes(ax, xlabel="decode position", ylabel=f"hit rate, hot buffer {PLOT_SIZE} top-k",
                title="the models side by side (top-k / context)", fontsize=8)
    for a in axes:
        a.set_ylim(max(0.0, ymin - 0.05), 1.0)
    save_figure(fig, path)


def table(out: dict) -> str:
    lines = []
    for name, m in out["models"].items():
        labels = list(m["buckets"])
        lines.append(f"{name}: top-k {m['k']} / context {m['seq_len']} = {100 * m['topk_over_context']:.1f} %, "
                     f"{out['settings']['sequences']} windows, {m['index_layers']} index layers")
        lines.append(f"{'hit rate':16}{'overall':>9}" + "".join(f"{b:>9}" for b in labels))
        for pol, sizes in m["hit_rate"].items():
            r = sizes[PLOT_SIZE]
            lines.append(f"{pol + ' ' + PLOT_SIZE:16}{r['overall']:>9.3f}"
                         + "".join(f"{r['buckets'].get(b, float('nan')):>9.3f}" for b in labels))
        ov = m["overlap"]
        lines.append(f"{'top-k overlap':16}{ov['overall']:>9.3f}"
                     + "".join(f"{ov['buckets'].get(b, float('nan')):>9.3f}" for b in labels))
        lines.append("overall by buffer size: " + "; ".join(
            f"{pol} " + " ".join(f"{r['overall']:.3f}" for r in sizes.values()) for pol, sizes in m["hit_rate"].items())
            + f" (at {', '.join(m['hit_rate']['lru'])})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="stdlib-dsa", help="shipped checkpoints' names, names of checkpoint folders "
                   "under hisparse_jax/checkpoints, or checkpoint folders, separated by commas (default stdlib-dsa)")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="folder of the JSON and PNG")
    p.add_argument("--sequences", type=int, default=4, help="held-out windows (default 4)")
    p.add_argument("--seq-len", default="0", help="tokens per window: one value, or one per model, separated by "
                   "commas; 0: the model's training context (default 0)")
    p.add_argument("--trace-start", type=int, default=0, help="first decode position traced (default 0: every "
                   "bucket from the start)")
    p.add_argument("--warmup", type=int, default=16, help="steps of each trace not counted (cold buffer; default 16)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK['sequences']} windows of {QUICK['seq_len']} tokens "
                   f"(or --seq-len's), traced from position {QUICK['trace_start']}, warm-up {QUICK['warmup']} "
                   "(tests / smoke)")
    a = p.parse_args(argv)
    names = [n.strip() for n in a.models.split(",") if n.strip()]
    if not names:
        p.error("--models: give at least one model")
    if a.quick:
        a.sequences, a.trace_start, a.warmup = QUICK["sequences"], QUICK["trace_start"], QUICK["warmup"]
        if a.seq_len == "0":
            a.seq_len = str(QUICK["seq_len"])
    lens = parse_seq_lens(p, a.seq_len, len(names))
    if a.sequences < 1 or a.trace_start < 0 or a.warmup < 0:
        p.error("need --sequences >= 1, --trace-start >= 0 and --warmup >= 0")
    folders = [model_folder(p, n) for n in names]

    import jax

    import hisparse_jax as hj
    from experiments import policy_lab as pl
    from hisparse_jax.train import data

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    models = []
    for name, folder, L in zip(names, folders, lens):
        model = hj.load_pretrained(folder)
        trained, source = training_context(folder, model.cfg)
        L, source = (L, "--seq-len") if L else (trained, source)
        if L < 2 or not a.trace_start < L:
            p.error(f"{name}: need a context >= 2 above --trace-start {a.trace_start}, got {L}")
        models.append((name, folder, model, L, source, trained))
    longest = max(m[3] for m in models)
    _, held, info = data.load_corpus()
    windows = data.fixed_windows(held, longest + 1, a.sequences)
    t0 = time.perf_counter()
    out = {**stamp(), "jax": jax.__version__, "corpus": info.to_json(),
           "settings": {"models": names, "sequences": a.sequences, "trace_start": a.trace_start, "warmup": a.warmup,
                        "quick": a.quick, "multiples": [f"{f:g}x" for f in MULTIPLES],
                        "policies": {n: [pol, kw] for n, (pol, kw) in variants().items()},
                        "score_ema_beta": pl.EMA_BETA, "bucket_edges": bucket_edges(longest),
                        "windows": f"data.fixed_windows(held-out text, {longest + 1}, {a.sequences}); each model "
                                   "reads the first seq_len tokens of each",
                        "rates": "hits / top-k rows, pooled over index layers, windows and the steps of a bucket; "
                                 "overlap: |T_t & T_(t-1)| / |T_t| averaged the same way"},
           "models": {}}
    for name, folder, model, L, source, trained in models:
        k = model.cfg.index_topk
        log(f"{name}: top-k {k}, context {L} ({source}), {a.sequences} windows, traced from {a.trace_start} ...")
        seqs = [list(w[:L]) for w in windows]
        res = study(model, seqs, a.trace_start, a.warmup, log)
        out["models"][name] = {"folder": held_out.model_name(name, folder), "k": k, "seq_len": L,
                               "seq_len_from": source, "trained_context": trained, "topk_over_context": k / L,
                               **res}
        del model, res
    save_results(a.out, "locality_long", out, plot, quick=a.quick, started=t0)
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
