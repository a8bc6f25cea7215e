"""Which pages should HiSparse release first? The vLLM rule (oldest sealed pages first) vs indexer recency
(pages whose positions the indexer selected least recently), same workload and budgets.

    PYTHONPATH=. python experiments/coldness.py [--quick] [--out experiments/results/coldness.json]

Both rules decode the same tokens; what differs is how often the indexer then asks for released rows:
reported are hit rate, misses, H2D bytes per decode step and released pages. The demo model has random
weights, so its indexer's locality is weak; run it on a real checkpoint for conclusions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from experiments.report import save_json, stamp


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="experiments/results/coldness.json")
    p.add_argument("--quick", action="store_true", help="small run (CI-sized)")
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=1536)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--device-requests", type=float, default=3.0,
                   help="device budget in whole-request footprints (smaller = more pressure)")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.prompt_len, a.new_tokens = 4, 512, 16

    from flax import nnx

    from hisparse_jax.config import get_preset
    from hisparse_jax.demo_workload import budgets, workload
    from hisparse_jax.engine import Engine, EngineConfig, SamplingParams, device_budget
    from hisparse_jax.model.decoder import SparseMLAModel

    cfg = get_preset("demo-glm")
    model = SparseMLAModel(cfg, rngs=nnx.Rngs(0))
    prompts = workload(cfg.vocab_size, a.requests, a.prompt_len, 0)
    max_len = max(len(x) for x in prompts) + a.new_tokens
    base, device_bytes = budgets(cfg, a.requests, max_len, a.device_requests)
    # chunked prefill: each prompt is written resident, so under pressure there is a real choice of which of
    # its sealed pages to release (with whole prefill most pages start on the host and there is none)
    cc = device_budget(cfg, base, device_bytes, "hisparse", max_running=a.requests, max_len=max_len,
                       prefill="chunked")
    results, outputs = {}, {}
    for rule in ("oldest", "recency"):
        t0 = time.perf_counter()
        eng = Engine(model, cc, EngineConfig(policy="hisparse", coldness=rule, max_running=a.requests,
                                             prefill="chunked", prefill_chunk=240))
        outputs[rule] = eng.generate(prompts, SamplingParams(max_new_tokens=a.new_tokens))
        m = eng.metrics()
        decode_steps = max(sum(1 for h in m.history if h.running), 1)
        results[rule] = {"hit_rate": m.hit_rate, "hits": m.hits, "misses": m.misses,
                         "h2d_bytes_per_decode_step": m.h2d_bytes / decode_steps,
                         "released_pages": m.evicted_pages, "mean_running": m.mean_running,
                         "wall_s": time.perf_counter() - t0}
        print(f"{rule:>8}: hit rate {m.hit_rate:.3f}  misses {m.misses}  H2D/step "
              f"{results[rule]['h2d_bytes_per_decode_step'] / 2**20:.2f} MiB  released {m.evicted_pages}",
              file=sys.stderr)
    out = {**stamp(), "preset": "demo-glm",
           "requests": a.requests, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
           "device_requests": a.device_requests, "device_pages": cc.device_pages, "rules": results,
           "outputs_identical": outputs["oldest"] == outputs["recency"]}
    save_json(a.out, out)
    print(json.dumps({k: out[k] for k in ("rules", "outputs_identical")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
