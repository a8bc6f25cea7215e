"""How local is a trained DSA model's attention? On long held-out sequences of the standard-library corpus:

* quality: LM loss / perplexity with dense attention and with the model's own sparse forward, and per full
  indexer layer the recall of the main attention's top-k by the indexer's top-k (`hisparse_jax.train.dsa.evaluate`);
* decode traces: every full indexer's top-k at each step, teacher-forced over the sequences with `decode_step`
  (contiguous cache); per layer the step-to-step top-k overlap (the write-up reports ~44%) and the hot-buffer hit
  rate at 1x/1.5x/2x/3x/4x top-k for every policy of `hot_buffer_sim.py`, OPT (Belady) as the bound;
* the same traces from the same architecture with random weights, side by side: what every earlier hit rate in
  this project was measured on.

* the policy lab on the trained traces, recorded with the indexer's ranking (`record_ranked_traces`: the ordered
  top-(k + margin) and every position's score at each step): LRU, CLOCK, the score-aware policies (score,
  score_lru, score_ema) with and without margin prefetch, and OPT, at 1x/1.5x/2x/4x top-k, per index layer and
  overall: critical-path hit rate (a top-k row found in the buffer before the step's fetch) next to H2D rows and
  bytes per step (misses + prefetched rows); the acceptance bar (at 2x a policy at or above OPT's demand hit rate
  with H2D bytes per step <= 1.5x LRU's); and what limits the hit rate: re-reference distances per index layer,
  where rows entering the top-k ranked one step before, the hit rate by decode position (and, with
  --long-len, on longer sequences than the model was trained on, with its next-token loss by position), by
  top-k (64/128/256 read off the same ranking), and with the store's two resident tail pages;
  whether any prefetcher could close the gap to OPT within the bytes (`prefetch_predictability`: precision and
  coverage of margin-rank, score-average, frequency and neighbour candidates against the rows entering the top-k
  within 4 steps that the last 6 steps' top-k do not hold), next to the precision the bar's byte budget needs
  (`prefetch_need`, in the bar).
  `--tune` also records held-out windows that are not the evaluation ones and sweeps score_ema's beta and
  score_lru's keep there (the constants in `policy_lab.py` were chosen that way).

Writes JSON and a PNG (hit rate against hot-buffer size, trained vs random; re-reference distances; the policy
lab's hit rate against H2D rows per step and by decode position).

    PYTHONPATH=. python experiments/locality.py [--model DIR] [--out experiments/results] [--quick]
        [--margin M] [--long-len N] [--long-sequences N] [--tune]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from experiments.report import finish_axes, pyplot, save_figure, save_results, stamp

HERE = os.path.dirname(os.path.abspath(__file__))


def trace_study(model, sequences, start: int, warmup: int, *, traces=None, record_s: float | None = None) -> dict:
    """Per index layer the adjacent top-k overlap and `study`'s hit rates; `traces` (traces[layer][seq], lists of
    top-k sets) when already recorded, else recorded here."""
    from experiments.hot_buffer_policies import study
    from experiments.hot_buffer_traces import adjacent_overlap, record_traces

    t0 = time.perf_counter()
    if traces is None:
        traces = record_traces(model, sequences, start)
        record_s = time.perf_counter() - t0
    out = {"record_s": record_s, "k": model.cfg.index_topk, "trace_start": start,
           "steps_per_sequence": len(traces[0][0]), "sequences": len(sequences), "per_index_layer": []}
    for li, per_seq in enumerate(traces):
        out["per_index_layer"].append({
            "index_layer": li, "adjacent_overlap": float(np.mean([adjacent_overlap(t) for t in per_seq])),
            "results": study(per_seq, model.cfg.index_topk, warmup)})
    return out


def mean_over_layers(trace_out: dict, policy: str, size: str) -> float:
    return float(np.mean([la["results"][policy][size]["hit_rate"] for la in trace_out["per_index_layer"]]))


# ----------------------------------------------------------------------------------------------------
# the policy lab (ranked traces)
# ----------------------------------------------------------------------------------------------------

TOPK_SWEEP = (64, 128, 256)
BAR_SIZE, BAR_BYTES = "2x", 1.5  # at 2x top-k: hit rate >= OPT's (demand), H2D bytes per step <= 1.5x LRU's


def tuning_windows(tokens: np.ndarray, seq_len: int, n_eval: int) -> np.ndarray:
    """Held-out windows that are not evaluation ones: one halfway between each two consecutive windows of
    `data.fixed_windows(tokens, seq_len, n_eval)` (n_eval - 1 windows, none overlapping an evaluation one)."""
    ev = np.linspace(0, tokens.size - seq_len, n_eval).astype(np.int64)
    if n_eval < 2 or np.min(np.diff(ev)) < 2 * seq_len:
        raise ValueError(f"no room for tuning windows of {seq_len} between {n_eval} evaluation windows")
    return np.stack([tokens[s:s + seq_len] for s in (ev[:-1] + ev[1:]) // 2]).astype(np.int32)


def nll_by_position(nll: np.ndarray, edges) -> list:
    """Mean next-token loss (nats) of positions [lo, hi) over the sequences."""
    return [{"positions": [int(lo), int(hi)], "nll": float(np.nanmean(nll[:, lo:hi]))}
            for lo, hi in zip(edges[:-1], edges[1:]) if lo < nll.shape[1] and np.isfinite(nll[:, lo:hi]).any()]


def _compact(sweep: dict, key: str = "hit_rate") -> dict:
    """{"overall": {variant: {size: value}}, "per_index_layer": [...]} of one statistic of a `lab_sweep`."""
    def one(t):
        return {n: {sz: r[key] for sz, r in rows.items()} for n, rows in t.items()}
    return {"overall": one(sweep["overall"]), "per_index_layer": [one(t) for t in sweep["per_index_layer"]]}


def bar_check(overall: dict, size: str = BAR_SIZE, factor: float = BAR_BYTES) -> dict:
    """The acceptance bar on `lab_sweep`'s overall table: a policy whose critical-path hit rate at `size` is >=
    OPT's (demand caching) with H2D rows (bytes) per step <= factor x LRU's."""
    opt = overall["opt"][size]["hit_rate"]
    lru_rows = overall["lru"][size]["h2d_rows_per_step"]
    within = {n: r[size] for n, r in overall.items()
              if n != "opt" and r[size]["h2d_rows_per_step"] <= factor * lru_rows}
    best = max(within, key=lambda n: within[n]["hit_rate"])
    best_any = max((n for n in overall if n != "opt"), key=lambda n: overall[n][size]["hit_rate"])
    return {"size": size, "opt_hit_rate": opt, "lru_hit_rate": overall["lru"][size]["hit_rate"],
            "lru_h2d_rows_per_step": lru_rows, "max_h2d_over_lru": factor,
            "met_by": [n for n, r in within.items() if r["hit_rate"] >= opt], "met": any(
                r["hit_rate"] >= opt for r in within.values()),
            "best_within_bytes": best, "best_within_bytes_hit_rate": within[best]["hit_rate"],
            "best_within_bytes_h2d_over_lru": within[best]["h2d_over_lru"],
            "best_any_bytes": best_any, "best_any_bytes_hit_rate": overall[best_any][size]["hit_rate"],
            "best_any_bytes_h2d_over_lru": overall[best_any][size]["h2d_over_lru"]}


PREFETCH_MIN_CANDIDATES = 16  # a predictor named best must offer at least this many candidates per step


def prefetch_need(overall: dict, predictability: list, size: str = BAR_SIZE, factor: float = BAR_BYTES,
                  min_candidates: float = PREFETCH_MIN_CANDIDATES) -> dict:
    """The precision a prefetcher needs to meet the bar, against the best measured one. With H2D rows = misses +
    prefetched (`lab_sweep`) and a prefetched row that is later hit replacing one of LRU's misses, reaching OPT's
    hit rate means G = lru_misses - opt_misses useful prefetches per step, and with misses down to OPT's the
    budget leaves factor x lru_rows - opt_misses rows for prefetch: precision >= G / that (a lower bound: it
    ignores the misses a prefetch causes by evicting a row). The stricter reading that counts every prefetched
    row as extra traffic (G / ((factor - 1) x lru_rows)) is reported alongside. The best predictor: the highest
    precision (mean over the index layers of `prefetch_predictability`) among those with >= min_candidates
    candidates per step (mean); and the predictors whose mean precision reaches the needed one. Useful new rows per
    step (`prefetch_predictability`'s useful_new_per_step) compare with the useful prefetches needed per step."""
    lru, opt = overall["lru"][size], overall["opt"][size]
    gain = lru["misses_per_step"] - opt["misses_per_step"]  # (opt_hit - lru_hit) x demand rows per step
    allowed = factor * lru["h2d_rows_per_step"] - opt["misses_per_step"]
    names = list(predictability[0]["predictors"])

    def mean(n, key):
        vals = [la["predictors"][n][key] for la in predictability]
        return None if any(v is None for v in vals) else float(np.mean(vals))
    ok = [n for n in names if (mean(n, "candidates_per_step") or 0) >= min_candidates and mean(n, "precision")
          is not None]
    best = max(ok, key=lambda n: mean(n, "precision")) if ok else None
    need = gain / allowed if allowed > 0 else None
    out = {"prefetch_useful_rows_needed_per_step": gain, "prefetch_rows_allowed_per_step": allowed,
           "prefetch_precision_needed": need,
           "prefetch_precision_needed_formula": f"(opt_hit - lru_hit) * demand_rows_per_step / ({factor:g} * "
           "lru_h2d_rows_per_step - opt_misses_per_step): useful prefetches needed per step over the prefetched "
           "rows the byte budget allows once misses are down to OPT's (a prefetched row later hit replaces a miss; "
           "pollution ignored: a lower bound)",
           "prefetch_precision_needed_if_all_extra": gain / ((factor - 1) * lru["h2d_rows_per_step"]),
           "prefetch_precision_needed_if_all_extra_formula": f"(opt_hit - lru_hit) * demand_rows_per_step / "
           f"({factor - 1:g} * lru_h2d_rows_per_step): every prefetched row counted as extra traffic",
           "best_predictor": best, "best_predictor_min_candidates_per_step": min_candidates,
           "predictors_reaching_precision_needed": [n for n in names if need is not None and
                                                    (mean(n, "precision") or 0) >= need]}
    if best:
        out.update({"best_predictor_precision": mean(best, "precision"),
                    "best_predictor_coverage": mean(best, "coverage"),
                    "best_predictor_candidates_per_step": mean(best, "candidates_per_step"),
                    "best_predictor_new_precision": mean(best, "new_precision"),
                    "best_predictor_new_per_step": mean(best, "new_per_step"),
                    "best_predictor_useful_new_per_step": mean(best, "useful_new_per_step")})
    return out


def policy_lab(ranked, warmup: int, nll=None, position_bin: int = 512) -> dict:
    """The policy lab on ranked traces[index_layer][seq] (see the module docstring)."""
    from experiments import policy_lab as pl

    t0 = time.perf_counter()
    k = ranked[0][0].k
    width = ranked[0][0].order.shape[1]
    L = int(max(rt.positions[-1] for per_seq in ranked for rt in per_seq)) + 1
    edges = list(range(int(ranked[0][0].positions[0]) // position_bin * position_bin, L + position_bin,
                       position_bin))
    sweep = pl.lab_sweep(ranked, warmup)
    steps = sweep.pop("steps")
    lab = {"settings": {"k": k, "recorded_margin": width - k, "warmup": warmup, "sizes": list(pl.LAB_SIZES),
                        "variants": {n: [p, kw] for n, (p, kw) in pl.LAB_VARIANTS.items()},
                        "score_ema_beta": pl.EMA_BETA, "score_lru_keep_x_k": pl.SCORE_LRU_KEEP,
                        "row_bytes": pl.ROW_BYTES, "layers": pl.LAYERS, "score_dtype": "float16 (over the step's max)"},
           "sweep": sweep, "bar": bar_check(sweep["overall"]),
           "by_position_2x": {n: pl.by_position(st, edges) for n, st in steps.items()},
           "reref": [pl.reref_stats([rt.sets for rt in per_seq], warmup) for per_seq in ranked],
           "entry_ranks": [pl.entry_rank_stats(per_seq, warmup) for per_seq in ranked],
           "predictability": [pl.prefetch_predictability(per_seq, warmup) for per_seq in ranked],
           "topk": {}}  # per top-k: lru / score_ema / opt at 1x (= the adjacent overlap), 2x, 4x
    lab["bar"].update(prefetch_need(sweep["overall"], lab["predictability"]))
    if nll is not None:
        lab["nll_by_position"] = nll_by_position(nll, [0] + edges)
    small = {n: pl.LAB_VARIANTS[n] for n in ("lru", "score_ema", "opt")}
    for kk in TOPK_SWEEP:
        if kk <= width:
            lab["topk"][str(kk)] = _compact(pl.lab_sweep(ranked, warmup, small, (1.0, 2.0, 4.0), k=kk))
    lab["resident_tail"] = {
        "pages": 2, "page_tokens": 64, "overall_is": "on_device_rate: (hits + resident rows) / top-k",
        **_compact(pl.lab_sweep(ranked, warmup, {n: pl.LAB_VARIANTS[n] for n in (
            "lru", "score_ema", "score_ema+pf16", "opt")}, (1.0, 2.0, 4.0), resident_pages=2,
                                keep_steps=()), "on_device_rate"),
        "hit_rate_offloaded": _compact(pl.lab_sweep(ranked, warmup, small, (2.0,), resident_pages=2,
                                                    keep_steps=()))["overall"]}
    lab["wall_s"] = time.perf_counter() - t0
    return lab


def long_study(model, sequences, start: int, warmup: int, position_bin: int = 512) -> dict:
    """Hit rates by decode position on sequences longer than the training length (lru, score_ema, opt at 2x and
    4x), with the model's next-token loss by position: does the model, and its locality, generalize?"""
    from experiments import policy_lab as pl
    from experiments.hot_buffer_traces import record_ranked_traces

    t0 = time.perf_counter()
    ranked, nll = record_ranked_traces(model, sequences, start, 0, with_nll=True)
    rec = time.perf_counter() - t0
    L = max(len(s) for s in sequences)
    edges = list(range(start // position_bin * position_bin, L + position_bin, position_bin))
    small = {n: pl.LAB_VARIANTS[n] for n in ("lru", "score_ema", "opt")}
    sw = pl.lab_sweep(ranked, warmup, small, (2.0, 4.0))
    steps = sw.pop("steps")
    return {"sequences": len(sequences), "seq_len": L, "trace_start": start, "record_s": rec,
            "nll_by_position": nll_by_position(nll, [0] + edges),
            "by_position_2x": {n: pl.by_position(st, edges) for n, st in steps.items()},
            "hit_rate": _compact(sw), "reref": [pl.reref_stats([rt.sets for rt in per_seq], warmup)
                                                for per_seq in ranked],
            "wall_s": time.perf_counter() - t0}


def lab_tuning(model, sequences, start: int, warmup: int, margin: int) -> dict:
    """score_ema's beta and score_lru's keep on windows that are not evaluation ones (at 2x)."""
    from experiments import policy_lab as pl
    from experiments.hot_buffer_traces import record_ranked_traces

    t0 = time.perf_counter()
    ranked = record_ranked_traces(model, sequences, start, margin)
    grid = {"lru": ("lru", {}), "opt": ("opt", {})}
    grid.update({f"score_ema/beta={b:g}": ("score_ema", {"beta": b}) for b in (0.8, 0.9, 0.95, 0.97)})
    grid.update({f"score_lru/keep={f:g}k": ("score_lru", {"keep": f}) for f in (1.25, 1.5, 2, 3)})
    ov = pl.lab_sweep(ranked, warmup, grid, (2.0,), keep_steps=())["overall"]
    table = {n: {"hit_rate": r["2x"]["hit_rate"], "h2d_over_lru": r["2x"]["h2d_over_lru"]} for n, r in ov.items()}

    def best(prefix):
        return max((n for n in table if n.startswith(prefix)), key=lambda n: table[n]["hit_rate"])
    return {"sequences": len(sequences), "seq_len": max(len(s) for s in sequences),
            "windows": "halfway between consecutive evaluation windows", "size": "2x", "table": table,
            "best_score_ema": best("score_ema/"), "best_score_lru": best("score_lru/"),
            "used": {"score_ema_beta": pl.EMA_BETA, "score_lru_keep": f"{pl.SCORE_LRU_KEEP:g}k"},
            "wall_s": time.perf_counter() - t0}


def plot(out: dict, path: str) -> None:
    plt = pyplot()
    lab = out.get("policy_lab")
    rows = 2 if lab else 1
    fig, axes = plt.subplots(rows, 3, figsize=(18, 4.4 * rows), squeeze=False)
    for ax, name in zip(axes[0], ("trained", "random")):
        tr = out["traces"][name]
        sizes = list(tr["per_index_layer"][0]["results"]["lru"])
        xs = [float(s[:-1]) for s in sizes]
        for pol in tr["per_index_layer"][0]["results"]:
            ax.plot(xs, [mean_over_layers(tr, pol, s) for s in sizes], marker="o", label=pol,
                    ls="--" if pol == "opt" else "-")
        ov = np.mean([la["adjacent_overlap"] for la in tr["per_index_layer"]])
        ax.set_title(f"{name} weights: top-k {tr['k']}, step-to-step overlap {ov:.2f}")
        ax.set_xlabel("hot buffer rows / top-k")
        ax.set_ylabel("hit rate (mean over index layers)")
        finish_axes(ax, fontsize=8)
    ax = axes[0][2]
    if lab:
        for li, rr in enumerate(lab["reref"]):
            labels = list(rr["hist"])
            ax.bar(np.arange(len(labels)) + 0.4 * li - 0.2, list(rr["hist"].values()), width=0.4,
                   label=f"index layer {li} (median {rr['median']:g}, p90 {rr['p90']:g} steps)")
        ax.set_xticks(np.arange(len(labels)), labels, rotation=45, fontsize=8)
        ax.set_xlabel("re-reference distance (decode steps between two uses of a row)")
        ax.set_ylabel("share of top-k uses")
        ax.set_title("trained: re-reference distance")
        finish_axes(ax, fontsize=8)
    else:
        ax.axis("off")
    if lab:
        ov = lab["sweep"]["overall"]
        ax = axes[1][0]
        for n in ("lru", "clock", "score", "score_lru", "score_ema", "opt"):
            xs = [float(sz[:-1]) for sz in ov[n]]
            ax.plot(xs, [r["hit_rate"] for r in ov[n].values()], marker="o", label=n, ls="--" if n == "opt" else "-")
        ax.set_xlabel("hot buffer rows / top-k")
        ax.set_ylabel("critical-path hit rate (both index layers)")
        ax.set_title("trained: demand policies by buffer size")
        finish_axes(ax, fontsize=8)
        ax = axes[1][1]
        b = lab["bar"]
        lru_rows = b["lru_h2d_rows_per_step"]
        ax.axvspan(0, BAR_BYTES * lru_rows, ymin=0, ymax=1, color="green", alpha=0.05)
        ax.axhline(b["opt_hit_rate"], color="grey", ls="--", lw=0.8, label=f"OPT (demand) {b['opt_hit_rate']:.3f}")
        ax.axvline(BAR_BYTES * lru_rows, color="grey", ls=":", lw=0.8, label=f"{BAR_BYTES:g}x LRU's H2D rows")
        for n, r in ov.items():
            st = r[BAR_SIZE]
            ax.scatter(st["h2d_rows_per_step"], st["hit_rate"], s=18, marker="*" if n == "opt" else "o")
            ax.annotate(n, (st["h2d_rows_per_step"], st["hit_rate"]), fontsize=6, xytext=(3, 2),
                        textcoords="offset points")
        st = lab["settings"]
        ax.set_xlabel(f"H2D rows per step and indexer group (misses + prefetched; x {st['row_bytes']} B x "
                      f"{st['layers']} layers = bytes)")
        ax.set_ylabel("critical-path hit rate")
        ax.set_title(f"trained, {BAR_SIZE} top-k: hit rate vs H2D traffic (bar: green, above the dashed line)")
        finish_axes(ax, fontsize=8, loc="lower right")
        ax = axes[1][2]
        for n, pts in lab["by_position_2x"].items():
            ax.plot([np.mean(p["positions"]) for p in pts], [p["hit_rate"] for p in pts], marker="o",
                    label=f"{n} (eval, {out['settings']['seq_len']})", ls="--" if n == "opt" else "-")
        lg = lab.get("long")
        if lg:
            for n, pts in lg["by_position_2x"].items():
                ax.plot([np.mean(p["positions"]) for p in pts], [p["hit_rate"] for p in pts], marker="x", alpha=0.6,
                        label=f"{n} ({lg['sequences']} x {lg['seq_len']})", ls="--" if n == "opt" else ":")
            ax.axvline(out["settings"]["seq_len"], color="grey", lw=0.8)
        ax.set_xlabel("decode position")
        ax.set_ylabel(f"critical-path hit rate at {BAR_SIZE} top-k")
        ax.set_title("trained: hit rate by context length")
        finish_axes(ax, fontsize=7)
    save_figure(fig, path, dpi=110)


def lab_table(lab: dict) -> str:
    sw = lab["sweep"]
    sizes = list(sw["overall"]["lru"])
    head = f"{'policy':20}" + "".join(f"{s:>22}" for s in sizes)
    lines = ["critical-path hit rate / H2D rows per step (x LRU's), per index layer, then overall"]
    tables = [(f"index layer {i}", t) for i, t in enumerate(sw["per_index_layer"])] + [("overall", sw["overall"])]
    for title, t in tables:
        lines += [title, head]
        for n, rows in t.items():
            lines.append(f"{n:20}" + "".join(f"{r['hit_rate']:>8.3f} /{r['h2d_rows_per_step']:>6.1f} "
                                             f"({r['h2d_over_lru']:.2f}x)" for r in rows.values()))
    b = lab["bar"]
    lines.append(f"bar at {b['size']} (hit >= OPT {b['opt_hit_rate']:.3f}, H2D <= {b['max_h2d_over_lru']:g}x LRU): "
                 f"{'met by ' + ', '.join(b['met_by']) if b['met'] else 'not met'}; best within the bytes "
                 f"{b['best_within_bytes']} {b['best_within_bytes_hit_rate']:.3f} "
                 f"({b['best_within_bytes_h2d_over_lru']:.2f}x LRU's H2D)")
    if "predictability" in lab:
        pr = lab["predictability"]
        lines.append(f"prefetch predictability (horizon {pr[0]['horizon']}, recent {pr[0]['recent']}; target rows per "
                     f"step {[round(la['target_per_step'] or 0, 1) for la in pr]}): precision / coverage / candidates "
                     "per step, per index layer")
        for n in pr[0]["predictors"]:
            lines.append(f"{n:20}" + "".join(
                f"{la['predictors'][n]['precision'] or 0:>8.3f} /{la['predictors'][n]['coverage'] or 0:>6.3f} /"
                f"{la['predictors'][n]['candidates_per_step'] or 0:>6.1f}" for la in pr))
        need = b.get("prefetch_precision_needed")
        lines.append(f"precision needed {need if need is None else round(need, 3)} (every prefetch extra: "
                     f"{b['prefetch_precision_needed_if_all_extra']:.3f}); best predictor {b['best_predictor']} "
                     f"{b.get('best_predictor_precision') or 0:.3f}, useful new rows per step "
                     f"{b.get('best_predictor_useful_new_per_step') or 0:.1f} (needed "
                     f"{b['prefetch_useful_rows_needed_per_step']:.1f})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="stdlib-dsa", help="a shipped checkpoint's name or a checkpoint folder "
                   "(default: the shipped stdlib-dsa)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--sequences", type=int, default=4, help="held-out sequences (default 4)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--trace-start", type=int, default=512, help="first decode position traced (default 512)")
    p.add_argument("--warmup", type=int, default=16, help="steps of each trace not counted (cold buffer)")
    p.add_argument("--margin", type=int, default=None, help="ranks recorded beyond the top-k (default 2k)")
    p.add_argument("--long-len", type=int, default=4096, help="length of the longer sequences of the context-length "
                   "study (0: skip; default 4096, twice the training length)")
    p.add_argument("--long-sequences", type=int, default=2, help="longer sequences (default 2)")
    p.add_argument("--tune", action="store_true", help="also record held-out windows between the evaluation ones and "
                   "sweep score_ema's beta and score_lru's keep there")
    p.add_argument("--quick", action="store_true", help="2 short sequences (tests / smoke)")
    a = p.parse_args(argv)
    if a.quick:
        a.sequences, a.seq_len, a.trace_start, a.warmup, a.long_len, a.tune = 2, 320, 160, 4, 0, False

    import jax
    from flax import nnx

    import hisparse_jax as hj
    from experiments.hot_buffer_traces import record_ranked_traces
    from hisparse_jax import checkpoints
    from hisparse_jax.train import data, dsa

    try:
        folder = checkpoints.resolve(a.model)
    except (ValueError, FileNotFoundError) as e:
        p.error(f"--model: {e}; train one with `python experiments/train_locality_model.py --out DIR` and pass "
                "--model DIR")
    model = hj.load_pretrained(folder)
    k = model.cfg.index_topk
    margin = 2 * k if a.margin is None else a.margin
    _, held, info = data.load_corpus()
    windows = data.fixed_windows(held, a.seq_len + 1, a.sequences)
    t0 = time.perf_counter()
    out = {**stamp(), "jax": jax.__version__,
           "model": a.model if a.model in checkpoints.SHIPPED else os.path.relpath(folder), "corpus": info.to_json(),
           "settings": {key: getattr(a, key) for key in ("sequences", "seq_len", "trace_start", "warmup", "long_len",
                                                         "long_sequences", "tune")} | {"margin": margin},
           "published": {"adjacent_overlap": 0.44, "lru_hit_rate_2x_sglang_glm": 0.94,
                         "glm_5_1_top_2048_lru_hit_rate_2x": 0.866, "glm_5_1_top_2048_belady_hit_rate_2x": 0.918}}
    print("evaluating ...", file=sys.stderr, flush=True)
    out["quality"] = dsa.evaluate(model, windows)
    seqs = [list(w[:-1]) for w in windows]
    out["traces"] = {}
    print("decode traces, trained weights (with the indexer's ranking) ...", file=sys.stderr, flush=True)
    t1 = time.perf_counter()
    ranked, nll = record_ranked_traces(model, seqs, a.trace_start, margin, with_nll=True)
    out["traces"]["trained"] = trace_study(model, seqs, a.trace_start, a.warmup,
                                           traces=[[rt.sets for rt in per_seq] for per_seq in ranked],
                                           record_s=time.perf_counter() - t1)
    print("decode traces, random weights ...", file=sys.stderr, flush=True)
    out["traces"]["random"] = trace_study(hj.SparseMLAModel(model.cfg, rngs=nnx.Rngs(0)), seqs, a.trace_start,
                                          a.warmup)
    out["summary"] = {name: {"adjacent_overlap": float(np.mean([la["adjacent_overlap"]
                                                                 for la in tr["per_index_layer"]])),
                             **{f"{pol}_hit_rate_{s}": mean_over_layers(tr, pol, s)
                                for pol in ("lru", "opt") for s in ("1x", "2x", "4x")}}
                      for name, tr in out["traces"].items()}
    print("policy lab ...", file=sys.stderr, flush=True)
    out["policy_lab"] = policy_lab(ranked, a.warmup, nll)
    del ranked
    if a.long_len:
        print(f"longer sequences ({a.long_sequences} x {a.long_len}) ...", file=sys.stderr, flush=True)
        lw = data.fixed_windows(held, a.long_len + 1, a.long_sequences)
        out["policy_lab"]["long"] = long_study(model, [list(w[:-1]) for w in lw], a.trace_start, a.warmup)
    if a.tune:
        print("tuning windows ...", file=sys.stderr, flush=True)
        tw = tuning_windows(held, a.seq_len + 1, a.sequences)
        out["policy_lab"]["tuning"] = lab_tuning(model, [list(w[:-1]) for w in tw], a.trace_start, a.warmup, margin)
    save_results(a.out, "locality", out, plot, quick=a.quick, started=t0)
    q = out["quality"]
    print(f"ppl dense {q['ppl_dense']:.3f}, sparse {q['ppl_sparse']:.3f}; indexer recall "
          f"{[round(r, 3) for r in q['recall_per_index_layer']]}")
    for name, s in out["summary"].items():
        print(f"{name:8} overlap {s['adjacent_overlap']:.3f}  LRU 1x {s['lru_hit_rate_1x']:.3f}  "
              f"2x {s['lru_hit_rate_2x']:.3f} (OPT {s['opt_hit_rate_2x']:.3f})  4x {s['lru_hit_rate_4x']:.3f}")
    print(lab_table(out["policy_lab"]))
    if "tuning" in out["policy_lab"]:
        tu = out["policy_lab"]["tuning"]
        print(f"tuning: best {tu['best_score_ema']}, {tu['best_score_lru']}; used {tu['used']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
