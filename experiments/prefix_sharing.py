"""Prefix caching under the three memory policies: requests sharing a long system prompt, with the prefix
cache on and off, same model, workload and budgets.

    PYTHONPATH=. python experiments/prefix_sharing.py [--quick] [--out experiments/results/prefix_sharing.json]
                                                      [--plot experiments/results/prefix_sharing.png]

Every request is one shared system prompt (`--shared-len` tokens) followed by its own question
(`--question-len` tokens, varying). With the cache on, the first request's full prompt pages are registered
(indexer keys, device KV, host KV) and every later request shares them and prefills only its question.
Reported per policy and setting: prompt tokens computed vs served from the cache, the prefix hit rate,
mean / max running requests, steps, mean time to first token and latency (in engine steps), bytes moved and
wall time; and whether the outputs are identical with the cache on and off (they must be).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from experiments.report import pyplot, save_figure, save_json, stamp


def workload(vocab: int, n: int, shared_len: int, question_len: int, seed: int) -> list[list[int]]:
    """n prompts: one shared prefix of `shared_len` tokens, then a question of 25-100 % of `question_len`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, shared_len).tolist()
    lens = np.linspace(question_len // 4, question_len, n).astype(int)
    rng.shuffle(lens)
    return [system + rng.integers(0, vocab, max(int(q), 1)).tolist() for q in lens]


def run(eng, prompts, params, every: int) -> list[list[int]]:
    """Request i arrives at engine step i * every; step until all have finished; their outputs in order."""
    for i, prompt in enumerate(prompts):
        while eng.step_count < i * every:
            eng.step()
        eng.add_request(f"q{i}", prompt, params)
    eng.run()
    return [eng.requests[f"q{i}"].output for i in range(len(prompts))]


def plot(out: dict, path: str) -> None:
    plt = pyplot()
    pols = list(out["policies"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, title in ((axes[0], "prefill_tokens", "prompt tokens computed"),
                           (axes[1], "mean_running", "mean running requests")):
        for j, setting in enumerate(("off", "on")):
            vals = [out["policies"][p][setting][key] for p in pols]
            ax.bar([i + 0.38 * j for i in range(len(pols))], vals, width=0.38, label=f"prefix cache {setting}")
        ax.set_xticks([i + 0.19 for i in range(len(pols))], pols)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(f"{out['requests']} requests sharing a {out['shared_len']}-token prefix ({out['preset']})")
    save_figure(fig, path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="experiments/results/prefix_sharing.json")
    p.add_argument("--plot", default="", help="PNG of prompt tokens computed and mean running requests per policy ('' = none)")
    p.add_argument("--quick", action="store_true", help="small run (CI-sized)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--shared-len", type=int, default=1536, help="tokens of the shared system prompt")
    p.add_argument("--question-len", type=int, default=256, help="longest per-request suffix")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--device-requests", type=float, default=2.5,
                   help="device budget in whole-request footprints of the longest request (smaller = more pressure)")
    p.add_argument("--prefill", default="whole", choices=("whole", "chunked"))
    p.add_argument("--policies", default="preempt,offload,hisparse")
    p.add_argument("--arrival-every", type=int, default=1,
                   help="engine steps between arrivals (0 = all at once: requests admitted in the same step as "
                        "the first one cannot share what it has not written yet)")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.shared_len, a.question_len, a.new_tokens = 3, 128, 48, 4

    from flax import nnx

    from hisparse_jax.config import get_preset
    from hisparse_jax.demo_workload import budgets
    from hisparse_jax.engine import Engine, EngineConfig, SamplingParams, device_budget
    from hisparse_jax.model.decoder import SparseMLAModel

    cfg = get_preset("demo-glm")
    model = SparseMLAModel(cfg, rngs=nnx.Rngs(0))
    prompts = workload(cfg.vocab_size, a.requests, a.shared_len, a.question_len, 0)
    max_len = max(len(x) for x in prompts) + a.new_tokens
    base, device_bytes = budgets(cfg, a.requests, max_len, a.device_requests)
    params = SamplingParams(max_new_tokens=a.new_tokens)
    results, identical = {}, {}
    for pol in a.policies.split(","):
        cc = device_budget(cfg, base, device_bytes, pol, max_running=a.requests, max_len=max_len, prefill=a.prefill)
        results[pol], outs = {}, {}
        for setting in ("off", "on"):
            t0 = time.perf_counter()
            eng = Engine(model, cc, EngineConfig(policy=pol, max_running=a.requests, prefill=a.prefill,
                                                 prefill_chunk=256, prefix_caching=setting == "on"))
            outs[setting] = run(eng, prompts, params, a.arrival_every)
            m = eng.metrics()
            results[pol][setting] = {
                k: getattr(m, k) for k in ("prefill_tokens", "cached_tokens", "prefix_hit_rate", "mean_running",
                                           "max_running", "steps", "mean_ttft_steps", "mean_latency_steps",
                                           "preemptions", "swaps", "hit_rate", "h2d_bytes", "d2h_bytes",
                                           "tokens_per_s")}
            results[pol][setting]["wall_s"] = time.perf_counter() - t0
            r = results[pol][setting]
            print(f"{pol:>8} prefix cache {setting:>3}: computed {r['prefill_tokens']:>6} cached {r['cached_tokens']:>6} "
                  f"mean running {r['mean_running']:5.2f}  TTFT {r['mean_ttft_steps']:6.1f} steps  "
                  f"steps {r['steps']:>4}  {r['wall_s']:6.1f} s", file=sys.stderr)
        identical[pol] = outs["on"] == outs["off"]
    import jax

    out = {**stamp(), "jax": jax.__version__,
           "preset": "demo-glm", "requests": a.requests, "shared_len": a.shared_len, "question_len": a.question_len,
           "new_tokens": a.new_tokens, "device_requests": a.device_requests, "prefill": a.prefill,
           "arrival_every": a.arrival_every,
           "policies": results, "outputs_identical": all(identical.values()), "outputs_identical_by_policy": identical}
    save_json(a.out, out)
    if a.plot:
        plot(out, a.plot)
    print(json.dumps({"outputs_identical": out["outputs_identical"],
                      "prefill_tokens": {p: {s: v[s]["prefill_tokens"] for s in v} for p, v in results.items()}}))
    return 0 if out["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
