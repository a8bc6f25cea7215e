"""Reproduce the GLM-5.3 HiSparse blog's capacity claim: (a) the calculator, (b) the engine, scaled down.

    PYTHONPATH=. python experiments/reproduce_blog.py [--out experiments/results] [--quick]

(a) `hisparse_jax.calc.max_requests` for the blog's setup (GLM-5.3, H200, DP1 TP8 EP, FP8; 74,160 / 85,836 /
    142,000 / 1,048,576 tokens; hot rows 4096 and 10240): baseline vs HiSparse running requests per replica,
    the limiting resource and the minimum non-limiting host pool. -> blog_calculator.json + printed table.
(b) The engine on the embedded `demo-glm` model with the blog's *ratio* of device KV memory to one request's
    KV: device bytes = R_dev x (KV + indexer bytes of the longest request), R_dev = the calculator's
    baseline pool blocks / blocks per request at 81,920 tokens (6260 / 1280 = 4.89: "~4 whole requests fit").
    Concurrency 32 is scaled to `--requests` (16) prompts of 86-100 % of `--prompt-len` (the blog's
    74K..86K spread; default 1024, 32 new tokens), whole-prompt prefill, the same device and host budgets for every policy.
    Calculator-style prediction for the scaled configuration (n = pages(longest prompt + new tokens)):
        baseline = min(R, floor(device_pages_offload / n))
        hisparse = min(R, floor(device_bytes / (n * idx_page + (2 + hot_pages) * kv_page)), host_pages // n)
    with kv_page = 64 tokens x all layers' MLA rows, idx_page = 64 tokens x all full indexers' keys,
    hot_pages = ceil(hot_rows / 64) (one hot page serves every indexer group; see kv/state.py).
    -> blog_engine.json, blog_engine.png (running requests per step, with the prediction lines).
"""
from __future__ import annotations

import argparse
import os
import sys
import time


from experiments.report import finish_axes, pyplot, save_figure, save_json, save_results, stamp
from hisparse_jax import calc

SEQS = (74_160, 85_836, 142_000, 1_048_576)
HOT_ROWS = (4096, 10_240)
BLOG_MEASURED = {"offload_running": [5, 6], "hisparse_running": [19, 25], "concurrency": 32}


def calculator_table() -> list[dict]:
    rows = []
    for hot in HOT_ROWS:
        for seq in SEQS:
            r = calc.max_requests(calc.CalcInput(preset="glm-5.3-blog", seq=seq, hot_rows=hot))
            rows.append({"seq": seq, "hot_rows": hot, "baseline_running": r.baseline_running,
                         "hisparse_running": r.hisparse_running, "hisparse_gpu_limit": r.hisparse_gpu_limit,
                         "limiting": r.limiting, "min_host_gib": r.min_host_gib,
                         "min_host_gib_published": r.min_host_gib_published, "kv_hbm_gib": r.kv_hbm_gib,
                         "baseline_pool_blocks": r.baseline_pool_blocks,
                         "baseline_blocks_per_request": r.baseline_blocks_per_request,
                         "hisparse_gpu_blocks_per_request": r.hisparse_gpu_blocks_per_request,
                         "ratio": r.hisparse_running / r.baseline_running if r.baseline_running else None})
    return rows


def print_calculator(rows: list[dict]) -> None:
    print("(a) calculator, GLM-5.3 FP8, H200 DP1 TP8 EP, per replica (KV HBM "
          f"{rows[0]['kv_hbm_gib']:g} GiB/GPU)")
    print(f"{'seq':>10}{'hot rows':>9}{'baseline':>9}{'hisparse':>9}{'ratio':>7}{'limiting':>9}{'min host GiB':>13}")
    for r in rows:
        ratio = f"{r['ratio']:.1f}" if r["ratio"] else "inf"
        print(f"{r['seq']:>10,}{r['hot_rows']:>9,}{r['baseline_running']:>9}{r['hisparse_running']:>9}{ratio:>7}"
              f"{r['limiting']:>9}{r['min_host_gib']:>9.1f} ({r['min_host_gib_published']})")


def blog_device_requests() -> float:
    r = calc.max_requests(calc.CalcInput(seq=81_920))
    return r.baseline_pool_blocks / r.baseline_blocks_per_request


def workload(vocab: int, n: int, longest: int, seed: int, low: float = 74_160 / 85_836) -> list[list[int]]:
    """The demo's prompt generator with the blog's spread of context lengths (74K..86K, scaled)."""
    from hisparse_jax.demo_workload import workload as demo_workload

    return demo_workload(vocab, n, longest, seed, low)


def engine_run(a) -> dict:
    from flax import nnx

    from hisparse_jax.config import CacheConfig, get_preset
    from hisparse_jax.engine import Engine, EngineConfig, SamplingParams, device_budget
    from hisparse_jax.engine.scheduler import pages
    from hisparse_jax.kv.state import StoreSpec
    from hisparse_jax.model.decoder import SparseMLAModel

    cfg = get_preset(a.preset)
    model = SparseMLAModel(cfg, rngs=nnx.Rngs(a.seed))
    prompts = workload(cfg.vocab_size, a.requests, a.prompt_len, a.seed)
    max_len = max(len(p) for p in prompts) + a.new_tokens
    n = pages(max_len)
    base = CacheConfig(kv_dtype=a.kv_dtype, max_seq_len=n * 64, max_seqs=a.requests,
                       host_pages=a.requests * n, device_pages=1)
    spec = StoreSpec.create(cfg, base.replace(device_pages=1, index_pages=1))
    kv_page = spec.page_bytes * spec.num_layers
    idx_page = 64 * spec.num_indexer_layers * (spec.index_dim + 4 if spec.fp8 else 2 * spec.index_dim
                                             if spec.kv_dtype == "bf16" else 4 * spec.index_dim)
    dev_req = a.device_requests if a.device_requests else blog_device_requests()
    device_bytes = int(dev_req * n * (kv_page + idx_page))
    off_pages = device_bytes // (kv_page + idx_page)
    per_req_hs = n * idx_page + (2 + spec.hot_pages) * kv_page
    pred = {
        "baseline": int(min(a.requests, off_pages // n)),
        "hisparse_gpu_limit": int(device_bytes // per_req_hs),
        "hisparse_host_limit": int(base.host_pages // n),
    }
    pred["hisparse"] = int(min(a.requests, pred["hisparse_gpu_limit"], pred["hisparse_host_limit"]))
    pred["hisparse_uncapped"] = pred["hisparse_gpu_limit"]  # ignoring the request count and host pool
    pred["formula"] = ("baseline = min(R, floor(device_pages / n)); hisparse = min(R, floor(device_bytes / "
                       "(n*idx_page + (2 + hot_pages)*kv_page)), host_pages // n); n = pages(longest prompt + new)")
    params = SamplingParams(max_new_tokens=a.new_tokens)
    results, outputs = {}, {}
    for pol in [p.strip() for p in a.policies.split(",") if p.strip()]:
        cc = device_budget(cfg, base, device_bytes, pol, max_running=a.requests, max_len=max_len, prefill="whole")
        eng = Engine(model, cc, EngineConfig(policy=pol, max_running=a.requests, prefill="whole"))
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        t0 = time.perf_counter()
        eng.run()
        m = eng.metrics()
        outputs[pol] = eng.outputs()
        results[pol] = {k: getattr(m, k) for k in ("mean_running", "max_running", "preemptions", "swaps", "steps",
                                                   "tokens_per_s", "hit_rate", "hits", "misses", "h2d_bytes",
                                                   "d2h_bytes", "evicted_pages", "compile_time_s")}
        results[pol].update(wall_s=time.perf_counter() - t0, device_pages=cc.device_pages,
                            index_pages=cc.num_index_pages, running_over_time=[h.running for h in m.history])
        eng.close()
        print(f"  {pol:>8}: mean running {m.mean_running:.2f}  max {m.max_running}  "
              f"{results[pol]['wall_s']:.1f}s", file=sys.stderr, flush=True)
    pols = list(results)
    out = {"preset": a.preset, "requests": a.requests, "prompt_tokens": [len(p) for p in prompts],
           "new_tokens": a.new_tokens, "kv_dtype": a.kv_dtype, "pages_per_request_longest": n,
           "kv_page_bytes": kv_page, "index_page_bytes": idx_page, "hot_rows": spec.hot_rows,
           "hot_pages": spec.hot_pages, "device_requests": dev_req, "device_budget_bytes": device_bytes,
           "host_pages": base.host_pages, "prediction": pred, "policies": results,
           "outputs_identical": all(outputs[p] == outputs[pols[0]] for p in pols)}
    if "offload" in results and "hisparse" in results and results["offload"]["mean_running"]:
        out["hisparse_over_offload_mean"] = results["hisparse"]["mean_running"] / results["offload"]["mean_running"]
        out["hisparse_over_offload_max"] = results["hisparse"]["max_running"] / max(results["offload"]["max_running"], 1)
    out["predicted_ratio"] = pred["hisparse"] / pred["baseline"] if pred["baseline"] else None
    out["predicted_ratio_uncapped"] = pred["hisparse_uncapped"] / pred["baseline"] if pred["baseline"] else None
    out["blog"] = {**BLOG_MEASURED, "ratio_range": [19 / 6, 25 / 5]}
    return out


def plot(out: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    colors = {"preempt": "tab:red", "offload": "tab:blue", "hisparse": "tab:green"}
    for pol, r in out["policies"].items():
        ax.plot(r["running_over_time"], label=f"{pol} (mean {r['mean_running']:.1f}, max {r['max_running']})",
                color=colors.get(pol), lw=1.5)
    pr = out["prediction"]
    ax.axhline(pr["baseline"], color="tab:blue", ls="--", lw=1, label=f"calc baseline {pr['baseline']}")
    ax.axhline(pr["hisparse"], color="tab:green", ls="--", lw=1,
               label=f"calc hisparse {pr['hisparse']} (uncapped {pr['hisparse_uncapped']})")
    finish_axes(ax, xlabel="engine step", ylabel="running requests", fontsize=8,
                title=f"{out['preset']}: {out['requests']} requests, device = {out['device_requests']:.2f} "
                "requests' KV")
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="experiments/results")
    p.add_argument("--quick", action="store_true", help="small engine run (< 60 s on a CPU)")
    p.add_argument("--no-engine", action="store_true", help="calculator table only")
    p.add_argument("--preset", default="demo-glm")
    p.add_argument("--requests", type=int, default=None, help="concurrent requests (16; quick 6)")
    p.add_argument("--prompt-len", type=int, default=None, help="longest prompt (1024; quick 512)")
    p.add_argument("--new-tokens", type=int, default=None, help="generated tokens per request (32; quick 8)")
    p.add_argument("--device-requests", type=float, default=None,
                   help="device budget in longest-request KV footprints (default: the blog's 6260/1280 = 4.89)")
    p.add_argument("--kv-dtype", default="float32", choices=("bf16", "fp8", "float32"))
    p.add_argument("--policies", default=None, help="comma-separated (default offload,hisparse; preempt "
                                                     "also works but adds time)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    q = a.quick
    a.requests = a.requests or (6 if q else 16)
    a.prompt_len = a.prompt_len or (512 if q else 1024)
    a.new_tokens = a.new_tokens or (8 if q else 32)
    a.policies = a.policies or "offload,hisparse"
    os.makedirs(a.out, exist_ok=True)
    meta = stamp()
    rows = calculator_table()
    save_json(os.path.join(a.out, "blog_calculator.json"), {
        **meta, "setup": "GLM-5.3 FP8, H200 141 GB, DP1 TP8 EP, util 0.92, reserve 15 GiB, default (non-limiting) "
        "host pool", "blog_measured": BLOG_MEASURED, "rows": rows})
    print_calculator(rows)
    if a.no_engine:
        return 0
    t0 = time.perf_counter()
    out = engine_run(a)
    out.update(meta, wall_s=time.perf_counter() - t0)
    save_results(a.out, "blog_engine", out, plot, quick=q)
    pr = out["prediction"]
    print(f"\n(b) engine, {out['preset']}, {out['requests']} requests of {min(out['prompt_tokens'])}-"
          f"{max(out['prompt_tokens'])} prompt + {out['new_tokens']} new tokens; device = "
          f"{out['device_requests']:.2f} x one request's KV ({out['device_budget_bytes'] / 2**20:.1f} MiB)")
    print(f"{'policy':>10}{'mean run':>10}{'max run':>9}{'predicted':>10}{'preempt':>9}{'swaps':>7}{'hit rate':>9}"
          f"{'wall s':>8}")
    for pol, r in out["policies"].items():
        pred = pr["hisparse"] if pol == "hisparse" else pr["baseline"]
        print(f"{pol:>10}{r['mean_running']:>10.2f}{r['max_running']:>9}{pred:>10}{r['preemptions']:>9}"
              f"{r['swaps']:>7}{r['hit_rate']:>9.3f}{r['wall_s']:>8.1f}")
    if "hisparse_over_offload_mean" in out:
        print(f"HiSparse/offload: measured mean {out['hisparse_over_offload_mean']:.2f}x, max "
              f"{out['hisparse_over_offload_max']:.2f}x; predicted {out['predicted_ratio']:.2f}x (uncapped "
              f"{out['predicted_ratio_uncapped']:.2f}x); blog 19-25 vs 5-6 = {19 / 6:.1f}-{25 / 5:.1f}x")
    print(f"outputs identical across policies: {out['outputs_identical']}; wall {out['wall_s']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
