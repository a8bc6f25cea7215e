"""MTP speculative decoding's hot-buffer sizing on real acceptances: does a hot buffer of (k + 2) x top-k rows (the
store's default, the published HiSparse sizing) buy anything over the (k + 1) x top-k a step needs at least?

    PYTHONPATH=. python experiments/speculative_sizing.py [--quick] [--preset NAME] [--ks 0,1,2,3]
        [--out experiments/results/speculative_sizing.json] [--plot experiments/results/speculative_sizing.png]

`hisparse demo` (`demo.run`) under HiSparse alone, on the demo's default model (the shipped trained `stdlib-dsa`,
whose MTP layer drafts; held-out stdlib text) and default budgets, once per speculative tokens k in --ks and hot
buffer size (`--hot-rows`): (k + 1) and (k + 2) x top-k for k >= 1, 1 and 2 x top-k for k = 0 (no speculation).
A step verifies k + 1 rows per request and resolves the union of their top-k, so it may miss up to (k + 1) x
top-k rows: the smaller size is the least the store takes, the larger leaves one top-k of slack for the LRU to
keep what the next step re-reads. The hot buffer is lent from the device budget, so a larger one can also leave
room for fewer running requests (`mean_running`).

Recorded per run: k, hot rows (and as a multiple of top-k), acceptance rate, tokens per decode step, hit rate
(hot-buffer hits over hits + misses; rows read from resident pages are neither), misses and the share of all
selected rows they are, H2D bytes (in all, per decode step, per running request and step, per generated token),
steps and decode steps,
mean running requests, wall seconds, the outputs' SHA-256 and whether they equal the first k = 0 run's (match
acceptance: they must). `--preset demo-glm` runs the random-weight preset instead (its MTP layer is random too, so
almost no draft is accepted); `--quick` a few short requests (checks the script). The JSON is rewritten after
every run, so a run cut short keeps what it measured. Progress (the demo's) on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from experiments.report import pyplot, save_figure, save_json, stamp

DEFAULT_OUT = "experiments/results/speculative_sizing.json"
QUICK = dict(requests=2, prompt_len=192, new_tokens=8)  # --quick: a few short requests
KEYS = ("acceptance_rate", "tokens_per_step", "hit_rate", "hits", "misses", "resident", "h2d_bytes", "d2h_bytes", "steps",
        "mean_running", "max_running", "preemptions", "duplicate_misses", "wall_s", "compile_s", "device_pages",
        "index_pages", "outputs_sha256")


def sizes(k: int) -> tuple[int, int]:
    """The hot-buffer sizes measured at k speculative tokens, in top-k's: the least the store takes, then one more."""
    return (k + 1, k + 2) if k else (1, 2)


def record(out: dict, k: int, mult: int, topk: int) -> dict:
    """One run's row from `demo.run`'s result (HiSparse only)."""
    r = out["policies"]["hisparse"]
    decode_steps = sum(1 for n in r["running_over_time"] if n)
    request_steps = sum(r["running_over_time"])
    tokens = out["requests"] * out["new_tokens"]
    row = {"k": k, "hot_rows": out["hot_rows"], "hot_rows_x_topk": mult, **{key: r[key] for key in KEYS},
           "decode_steps": decode_steps, "generated_tokens": tokens,
           "h2d_bytes_per_decode_step": r["h2d_bytes"] / decode_steps if decode_steps else None,
           "h2d_bytes_per_request_step": r["h2d_bytes"] / request_steps if request_steps else None,
           "h2d_bytes_per_token": r["h2d_bytes"] / tokens,
           "misses_per_decode_step": r["misses"] / decode_steps if decode_steps else None,
           # of every selected row read (resident pages, hot-buffer hits, misses): the share fetched from the host
           # (the hit rate leaves out the resident rows, and how many pages stay resident depends on the hot rows
           # lent from the same device budget)
           "miss_share": r["misses"] / max(1, r["resident"] + r["hits"] + r["misses"])}
    if not k:  # no drafts: the engine's 0 / 0
        row["acceptance_rate"] = None
    assert row["hot_rows"] == mult * topk, (row["hot_rows"], mult, topk)
    return row


def plot(res: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, key, title in ((axes[0], "hit_rate", "hot-buffer hit rate"),
                           (axes[1], "h2d_bytes_per_decode_step", "H2D KiB per decode step"),
                           (axes[2], "mean_running", "mean running requests (the budget lends hot rows)")):
        for k in res["speculative_tokens"]:
            rows = sorted((r for r in res["runs"] if r["k"] == k), key=lambda r: r["hot_rows"])
            if not rows:
                continue
            ys = [(r[key] or 0) / (1024 if key.endswith("step") else 1) for r in rows]
            acc = rows[0]["acceptance_rate"]
            label = f"k = {k}" + (f" (acceptance {acc:.2f})" if k and acc is not None else "")
            ax.plot([r["hot_rows_x_topk"] for r in rows], ys, marker="o", label=label)
        ax.set_xlabel(f"hot rows (x top-k = {res['index_topk']})")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"MTP speculative decoding, hot-buffer size: {res['model']}, {res['requests']} requests, "
                 f"{res['new_tokens']} new tokens")
    save_figure(fig, path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--plot", default=None, help="PNG of hit rate, H2D bytes per step and mean running requests vs hot "
                                                "rows, one line per k (default: --out with .png; '' = none)")
    p.add_argument("--quick", action="store_true",
                   help=f"a small run ({QUICK['requests']} requests of <= {QUICK['prompt_len']} tokens, "
                        f"{QUICK['new_tokens']} new tokens): checks the script")
    p.add_argument("--preset", default=None, help="a random-weight preset (demo-glm) instead of the shipped model")
    p.add_argument("--ks", default="0,1,2,3", help="speculative tokens to measure (comma-separated; 0 first)")
    p.add_argument("--requests", type=int, default=None, help="requests (the demo's default, 16)")
    p.add_argument("--prompt-len", type=int, default=None, help="longest prompt (the demo's default, 32 x top-k)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per request (the demo's default, 160)")
    p.add_argument("--device-requests", type=float, default=None, help="device budget (the demo's default, 3.5)")
    a = p.parse_args(argv)
    try:
        ks = [int(x) for x in a.ks.split(",")]
    except ValueError:
        ks = []
    if not ks or ks[0] != 0 or len(set(ks)) != len(ks) or min(ks) < 0:
        p.error(f"argument --ks: distinct values >= 0, 0 first (its outputs are the reference), got {a.ks!r}")
    opts = dict(QUICK) if a.quick else {}
    for name in ("requests", "prompt_len", "new_tokens", "device_requests"):
        if getattr(a, name) is not None:
            opts[name] = getattr(a, name)
    if a.preset:
        opts["preset"] = a.preset
    plot_path = os.path.splitext(a.out)[0] + ".png" if a.plot is None else a.plot

    import jax

    from hisparse_jax import checkpoints, demo
    from hisparse_jax.config import get_preset
    from hisparse_jax.hf_config import from_hf_config

    cfg = get_preset(a.preset) if a.preset else from_hf_config(checkpoints.resolve(checkpoints.DEFAULT))
    topk = cfg.index_topk
    res = {**stamp(), "jax": jax.__version__,
           "backend": jax.default_backend(), "quick": a.quick, "model": a.preset or checkpoints.DEFAULT,
           "preset": a.preset, "index_topk": topk, "speculative_tokens": ks, "policy": "hisparse",
           "options": opts, "runs": []}
    t_all, ref = time.perf_counter(), None
    for k in ks:
        for mult in sorted(sizes(k), reverse=not k):  # k = 0: the default size first (the reference)
            print(f"[sizing] k = {k}, hot rows {mult} x {topk} = {mult * topk}: running "
                  f"({time.perf_counter() - t_all:.0f} s so far)", file=sys.stderr, flush=True)
            out = demo.run(policies=("hisparse",), plot="", speculative_tokens=k, hot_rows=mult * topk, **opts)
            row = record(out, k, mult, topk)
            ref = ref or row["outputs_sha256"]
            row["outputs_equal_k0"] = row["outputs_sha256"] == ref
            if not res["runs"]:  # the workload and budgets (the same for every run but the hot-buffer split)
                res.update({key: out[key] for key in ("workload", "requests", "prompt_tokens", "new_tokens",
                                                      "kv_dtype", "device_requests", "device_budget_bytes",
                                                      "host_pages", "prefill", "kernels")})
            res["runs"].append(row)
            res["outputs_identical"] = all(r["outputs_equal_k0"] for r in res["runs"])
            res["total_s"] = time.perf_counter() - t_all
            acc = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.3f}"
            print(f"[sizing] k = {k}, hot rows {mult} x top-k: acceptance {acc}, tokens/step "
                  f"{row['tokens_per_step']:.2f}, hit rate {row['hit_rate']:.4f}, H2D/step "
                  f"{(row['h2d_bytes_per_decode_step'] or 0) / 1024:.1f} KiB, mean running {row['mean_running']:.2f}, "
                  f"steps {row['steps']}, outputs equal k=0: {row['outputs_equal_k0']}, {row['wall_s']:.0f} s",
                  file=sys.stderr, flush=True)
            save_json(a.out, res)  # after every run: a run cut short keeps what it measured
    if plot_path:
        plot(res, plot_path)
        res["plot"] = plot_path
        save_json(a.out, res)
    print(json.dumps({"outputs_identical": res["outputs_identical"],
                      "runs": [{key: r[key] for key in ("k", "hot_rows_x_topk", "acceptance_rate", "hit_rate",
                                                         "h2d_bytes_per_decode_step")} for r in res["runs"]]}))
    return 0 if res["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
