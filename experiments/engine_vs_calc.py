"""Engine = calculator? The calculator's 81,920-token GLM-5.3 case scaled down to a model that runs here, the
calculator asked for its prediction at the scaled numbers, and the engine run under offload and HiSparse (FP8 and
int4 indexer keys on the device, and FP8 keys in the host tier: `CacheConfig(index_tier="host")`, exact mode) on one
workload and one device byte budget.

    PYTHONPATH=. python experiments/engine_vs_calc.py [--pages 64] [--requests 64] [--quick] [--out DIR]

What is scaled (`glm_ratios`: the published case at 81,920 tokens, GLM-5.3 on 8xH200, TP8 EP, FP8):

* device KV memory in whole requests: the baseline pool's blocks / one request's blocks (6260 / 1280 = 4.89);
* hot rows as a fraction of a request (4096 of 81,920 tokens: 5 %, here in whole pages), top-k half of them;
* the indexer keys' share of a 64-token page: GLM-5.3 keeps 21 of its 78 layers' keys (132 B each, FP8) beside
  78 layers of 576-B rows: 0.0617 of the KV bytes (int4: 0.0318). The model here (`demo-glm`'s KV geometry:
  latent 512, rope 64, indexer 128) with one indexer every 4 layers (`--layers 4`: one full, three shared, like
  GLM's IndexShare) has 0.0503 (int4 0.0259): its store's FP8 row is FlashMLA's 656 B, not 576;
* the host pool: the calculator's default is the minimum that does not limit HiSparse (here: the int4 case's,
  so one host pool serves every run).

The one ratio that cannot scale is the two tail pages every request keeps resident: 2 of GLM's 1280 pages, 2 of
`--pages` here. It bounds the scaled case: with these ratios the calculator's HiSparse / baseline ratio is 8.2x
(FP8) and 10x (int4) at 64 pages per request (4,096 tokens: 3 hot pages, top-k 96) and falls below 8x under ~60.
(A whole prefill runs at the next power of two of the prompt's length: 64 pages keeps it at 4,096 tokens.)

Every request is `--pages` pages long from its prompt on (prompt 64 * pages - 48 tokens, 16-48 new tokens, so
finishes are staggered and the queue refills while requests decode), so the calculator's uniform sequence length
is the workload's. The calculator (`hisparse_jax.calc.max_requests`, layout "split": this project's store, with its
indexer pool apart from the KV pool) gets the model's block bytes (FP8 row 656 B), the same device bytes, hot rows,
tail pages, host pool and request count. The engine gets the same device bytes split by `engine.device_budget`.

"Sustained running" is the mean number of requests decoding per step over the steps where requests were waiting
(demand above capacity): the calculator's number. Each run also records why the first waiting request waited.
Writes engine_vs_calc[_quick].json and .png in --out.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from experiments.report import finish_axes, pyplot, save_figure, save_results, stamp
from hisparse_jax import calc

SEQ = 81_920  # the calculator's published default case
NEW_TOKENS = (16, 48)  # per request, drawn uniformly (the prompt leaves room for the longest in the same pages)
TAIL_PAGES = 2  # the calculator's "retained" pages: the store's tail pages (kv.spec.TAIL_PAGES)
# (policy, indexer key format, where the keys live: `CacheConfig.index_tier`)
VARIANTS = (("offload", "fp8", "device"), ("hisparse", "fp8", "device"), ("hisparse", "int4", "device"),
            ("hisparse", "fp8", "host"))


def variant_name(pol: str, dt: str, tier: str) -> str:
    return f"{pol}-{dt}" + ("-host" if tier == "host" else "")


def glm_ratios() -> dict:
    """The published case's ratios (GLM-5.3 FP8, H200 DP1 TP8 EP, 81,920 tokens, hot rows 4096, top-k 2048)."""
    inp = calc.CalcInput(seq=SEQ)
    r = calc.max_requests(inp)
    lay8 = calc.block_layout(calc.GLM53_KV_SHAPE, "fp8")
    lay4 = calc.block_layout(calc.GLM53_KV_SHAPE, "fp8", indexer_dtype="int4")
    n = r.baseline_blocks_per_request
    return {"seq": SEQ, "pages_per_request": n, "device_requests": r.baseline_pool_blocks / n,
            "hot_fraction": -(-inp.hot_rows // 64) / n, "topk_fraction": inp.top_k / SEQ,
            "indexer_over_kv": {"fp8": lay8.indexer_page / lay8.host, "int4": lay4.indexer_page / lay4.host},
            "tail_fraction": TAIL_PAGES / n, "baseline": r.baseline_running, "hisparse_unified": r.hisparse_running,
            "hisparse_split": calc.max_requests(calc.CalcInput(seq=SEQ, layout="split")).hisparse_running}


def model_config(layers: int, full_every: int, pages: int, glm: dict):
    """demo-glm's KV geometry with `layers` layers, an indexer every `full_every` (the rest shared), and hot rows at
    GLM's fraction of a request, in whole pages; top-k half of them (GLM: 2048 of 4096)."""
    from hisparse_jax.config import get_preset

    topk = 32 * max(1, round(glm["hot_fraction"] * pages))
    return get_preset("demo-glm").replace(
        num_hidden_layers=layers, index_topk=topk, max_position_embeddings=max(65_536, 64 * pages),
        indexer_types=tuple("full" if i % full_every == 0 else "shared" for i in range(layers)),
        mlp_layer_types=("dense",) + ("sparse",) * (layers - 1))


def predict(cfg, *, pages: int, requests: int, device_bytes: int, hot_rows: int, host_pages: int,
            index_dtype: str, layout: str = "split", index_tier: str = "device") -> calc.CalcResult:
    """The calculator at the scaled numbers: this model's block bytes (the store's 656-B FP8 row), the device
    bytes as the KV HBM, one DP replica of one GPU (no weights: the device bytes are given). The host pool is
    `host_pages` KV pages (with host-tier keys, each beside its page of keys: the store keeps them in a pool of their
    own, as large)."""
    preset = calc.preset_from_config(cfg, "engine-vs-calc", 0.0, 0.0, mla_fp8_layout="ds_mla")
    lay = calc.block_layout(cfg, "fp8", mla_fp8_layout="ds_mla", indexer_dtype=index_dtype)
    host_block = lay.host + (lay.indexer_page if index_tier == "host" else 0)
    return calc.max_requests(calc.CalcInput(
        preset=preset, tp=1, dp=1, ep=False, kv_dtype="fp8", seq=64 * pages, hot_rows=hot_rows, top_k=cfg.index_topk,
        retained=TAIL_PAGES, other=0, host_gib=host_pages * host_block / 2 ** 30, max_seqs=requests,
        kv_hbm_gib=device_bytes / 2 ** 30, index_dtype=index_dtype, layout=layout, index_tier=index_tier))


def sustained(history) -> dict:
    """Mean running requests over the decode steps where requests were waiting, and over all decode steps."""
    busy = [h.running for h in history if h.waiting and h.running]
    steps = [h.running for h in history if h.running]
    return {"sustained_running": sum(busy) / len(busy) if busy else 0.0, "sustained_steps": len(busy),
            "mean_running": sum(steps) / len(steps) if steps else 0.0, "max_running": max(steps, default=0)}


def first_wait(history) -> dict[str, int]:
    """Steps per reason the first waiting request gave (what keeps the queue out: the limiting budget)."""
    out: dict[str, int] = {}
    for h in history:
        reasons = {k: v for k, v in h.wait_reasons.items() if k not in ("queued", "prefill_chunk")}
        for k in reasons:
            if k in ("max_running", "device_budget", "index_budget", "host_budget", "prefill_busy"):
                out[k] = out.get(k, 0) + 1
    return out


def run(a) -> dict:
    import numpy as np
    from flax import nnx

    from hisparse_jax.config import CacheConfig
    from hisparse_jax.demo_workload import workload
    from hisparse_jax.engine import Engine, EngineConfig, SamplingParams, device_budget
    from hisparse_jax.kv.state import StoreSpec
    from hisparse_jax.model.decoder import SparseMLAModel

    glm = glm_ratios()
    cfg = model_config(a.layers, a.full_every, a.pages, glm)
    hot_rows = 2 * cfg.index_topk
    n = a.pages
    longest = 64 * n
    prompt_len = longest - NEW_TOKENS[1]
    prompts = workload(cfg.vocab_size, a.requests, prompt_len, a.seed, low=1.0)
    rng = np.random.default_rng(a.seed)
    new = rng.integers(NEW_TOKENS[0], NEW_TOKENS[1] + 1, a.requests).tolist()
    base = CacheConfig(kv_dtype="fp8", index_dtype="fp8", max_seq_len=longest, max_seqs=a.requests,
                       host_pages=1, device_pages=1, hot_rows=hot_rows)
    spec = {d: StoreSpec.create(cfg, base.replace(index_dtype=d, device_pages=1, index_pages=1))
            for d in ("fp8", "int4")}
    kv_page = spec["fp8"].page_bytes * spec["fp8"].num_layers
    idx_page = {d: 64 * s.num_indexer_layers * s.index_row_bytes for d, s in spec.items()}
    device_bytes = int(glm["device_requests"] * n * (kv_page + idx_page["fp8"]))
    # the host pool: the calculator's minimum non-limiting one for the largest HiSparse case, unlimited first
    limit = max(predict(cfg, pages=n, requests=a.requests, device_bytes=device_bytes, hot_rows=hot_rows,
                        host_pages=10 ** 9, index_dtype=d, index_tier=t).hisparse_gpu_limit
                for p, d, t in VARIANTS if p == "hisparse")
    host_pages = max(limit, 1) * n if limit < a.requests else a.requests * n
    base = base.replace(host_pages=host_pages)
    out = {"glm": glm, "model": {"layers": a.layers, "full_every": a.full_every, "index_topk": cfg.index_topk,
                                 "hot_rows": hot_rows, "kv_page_bytes": kv_page, "index_page_bytes": idx_page,
                                 "row_bytes": spec["fp8"].row_bytes},
           "scaled": {"pages_per_request": n, "device_requests": glm["device_requests"],
                      "hot_fraction": -(-hot_rows // 64) / n, "topk_fraction": cfg.index_topk / longest,
                      "indexer_over_kv": {d: v / kv_page for d, v in idx_page.items()},
                      "tail_fraction": TAIL_PAGES / n},
           "requests": a.requests, "prompt_tokens": prompt_len, "new_tokens": NEW_TOKENS,
           "device_budget_bytes": device_bytes, "host_pages": host_pages, "runs": {}}
    print(f"scaled case: {n} pages per request, device = {glm['device_requests']:.2f} requests "
          f"({device_bytes / 2 ** 20:.1f} MiB), hot rows {hot_rows}, top-k {cfg.index_topk}, host {host_pages} pages",
          file=sys.stderr, flush=True)
    model = SparseMLAModel(cfg, rngs=nnx.Rngs(a.seed))
    outputs = {}
    budgets = {(p, d, t): device_budget(cfg, base.replace(index_dtype=d, index_tier=t), device_bytes, p,
                                        max_running=a.requests, max_len=longest, prefill="whole")
               for p, d, t in VARIANTS}
    for pol, dt, tier in [v for v in VARIANTS if variant_name(*v) in a.variants]:
        name = variant_name(pol, dt, tier)
        pred = predict(cfg, pages=n, requests=a.requests, device_bytes=device_bytes, hot_rows=hot_rows,
                       host_pages=host_pages, index_dtype=dt, index_tier=tier)
        unified = predict(cfg, pages=n, requests=a.requests, device_bytes=device_bytes, hot_rows=hot_rows,
                          host_pages=host_pages, index_dtype=dt, layout="unified", index_tier=tier)
        predicted = pred.baseline_running if pol == "offload" else pred.hisparse_running
        # one capacity per key format and tier: shared programs
        same = [b for (p, d, t), b in budgets.items() if (d, t) == (dt, tier)]
        cc = budgets[pol, dt, tier].replace(capacity=budgets[pol, dt, tier].replace(
            device_pages=max(b.device_pages for b in same), index_pages=max(b.num_index_pages for b in same)))
        eng = Engine(model, cc, EngineConfig(policy=pol, max_running=a.requests, prefill="whole"))
        for i, (p, k) in enumerate(zip(prompts, new)):
            eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=int(k)))
        t0 = time.perf_counter()
        done = [0]

        def progress(e, t0=t0, done=done):
            fin = sum(r.finished for r in e.requests.values())
            if fin >= done[0] + max(1, a.requests // 8):
                done[0] = fin
                print(f"  {name}: {fin}/{a.requests} finished, step {e.step_count}, "
                      f"{time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)

        eng.run(progress=progress)
        m = eng.metrics()
        outputs[name] = eng.outputs()
        eng.close()
        got = sustained(m.history)
        out["runs"][name] = {
            "policy": pol, "index_dtype": dt, "index_tier": tier, "predicted": predicted, **got,
            "difference": got["sustained_running"] - predicted,
            "within_one": abs(got["sustained_running"] - predicted) <= 1.0,
            "calculator": {k: v for k, v in pred.to_dict().items() if k not in ("inputs",)},
            "calculator_unified": {"baseline_running": unified.baseline_running,
                                   "hisparse_running": unified.hisparse_running},
            "device_pages": cc.device_pages, "index_pages": cc.num_index_pages,
            "first_wait_reasons": first_wait(m.history), "wait_reasons": m.wait_reasons,
            "preemptions": m.preemptions, "swaps": m.swaps, "hit_rate": m.hit_rate, "steps": m.steps,
            "h2d_bytes": m.h2d_bytes, "index_h2d_bytes": m.index_h2d_bytes,
            "calculator_h2d_bytes_per_request_step": pred.h2d_bytes_per_request_step,
            "wall_s": time.perf_counter() - t0, "compile_s": m.compile_time_s,
            "running_over_time": [h.running for h in m.history], "waiting_over_time": [h.waiting for h in m.history],
        }
        print(f"  {name}: sustained {got['sustained_running']:.2f} over {got['sustained_steps']} steps, calculator "
              f"{predicted}; {out['runs'][name]['wall_s']:.0f}s", file=sys.stderr, flush=True)
    runs = out["runs"]
    fp8 = [outputs[k] for k in ("offload-fp8", "hisparse-fp8", "hisparse-fp8-host") if k in outputs]
    if len(fp8) > 1:  # exact mode: host keys select what device keys select
        out["outputs_identical_fp8"] = all(o == fp8[0] for o in fp8)
    for name in ("hisparse-fp8", "hisparse-int4", "hisparse-fp8-host"):
        if name in runs and "offload-fp8" in runs and runs["offload-fp8"]["predicted"]:
            runs[name]["predicted_over_offload"] = runs[name]["predicted"] / runs["offload-fp8"]["predicted"]
            runs[name]["measured_over_offload"] = (runs[name]["sustained_running"]
                                                   / max(runs["offload-fp8"]["sustained_running"], 1e-9))
    out["all_within_one"] = all(r["within_one"] for r in runs.values())
    return out


def plot(out: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    colors = {"offload-fp8": "tab:blue", "hisparse-fp8": "tab:green", "hisparse-int4": "tab:purple",
              "hisparse-fp8-host": "tab:red"}
    for name, r in out["runs"].items():
        c = colors.get(name)
        ax.plot(r["running_over_time"], color=c, lw=1.3,
                label=f"{name}: sustained {r['sustained_running']:.1f}, calculator {r['predicted']}")
        ax.axhline(r["predicted"], color=c, ls="--", lw=1)
    ax.set_xscale("symlog", linthresh=50)
    s = out["scaled"]
    finish_axes(ax, xlabel="engine step", ylabel="running requests", fontsize=8)
    ax.set_title(f"{out['requests']} requests of {s['pages_per_request']} pages; device = "
                 f"{s['device_requests']:.2f} requests' KV (dashed: calculator)", fontsize=10)
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="experiments/results")
    p.add_argument("--quick", action="store_true", help="a small run (16 pages, 12 requests): checks the script")
    p.add_argument("--pages", type=int, default=None, help="pages of 64 tokens per request (64; quick 16)")
    p.add_argument("--requests", type=int, default=None, help="requests (64; quick 12)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--full-every", type=int, default=4, help="an indexer every N layers (the rest share it)")
    p.add_argument("--variants", default=",".join(variant_name(*v) for v in VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.pages = a.pages or (16 if a.quick else 64)
    a.requests = a.requests or (12 if a.quick else 64)
    if a.pages < 4 or a.requests < 1 or a.layers < 1 or a.full_every < 1:
        p.error("--pages >= 4, --requests, --layers and --full-every >= 1")
    a.variants = {v.strip() for v in a.variants.split(",") if v.strip()}
    unknown = a.variants - {variant_name(*v) for v in VARIANTS}
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}")
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    out = run(a)
    out.update(**stamp(), wall_s=time.perf_counter() - t0)
    save_results(a.out, "engine_vs_calc", out, plot, quick=a.quick)
    print(f"{'run':>14}{'calculator':>11}{'sustained':>10}{'mean':>7}{'max':>5}{'within 1':>9}  first waits")
    for name, r in out["runs"].items():
        print(f"{name:>14}{r['predicted']:>11}{r['sustained_running']:>10.2f}{r['mean_running']:>7.2f}"
              f"{r['max_running']:>5}{str(r['within_one']):>9}  {r['first_wait_reasons']}")
    return 0 if out["all_within_one"] or a.quick else 1


if __name__ == "__main__":
    sys.exit(main())
