"""Does a decode step cost what its work costs? Side by side in one process, writes JSON:

1. step time at a fixed context while `max_seq_len` grows x1 / x4 / x16, with the indexer bounded by the batch's
   longest sequence (`index_span`, what the engine and `generate` pass) and without it (every page a slot could
   hold is scored: the old behaviour);
2. step time under memory pressure (row fetch of misses from the host pool) while the host pool grows x1 / x16,
   in bf16 and float32, at the same misses;
3. the same pressure with `miss_attention="split"` against the single pass (float32, host pool x1): what the
   split costs where nothing overlaps (a CPU).

    python experiments/bench_step_cost.py --out experiments/results/bench_step_cost.json
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import numpy as np
from flax import nnx

from experiments.report import save_json
from hisparse_jax.config import CacheConfig, get_preset
from hisparse_jax.engine.runner import Runner
from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv.manager import PageManager
from hisparse_jax.kv.tiered import index_span
from hisparse_jax.model.decoder import SparseMLAModel


def prefill_random(runner, tc, rng, requests: int, context: int):
    """`requests` random prompts of `context` tokens prefilled into a new store for `tc`: (store, slots)."""
    prompts = [rng.integers(0, tc.model_cfg.vocab_size, context).tolist() for _ in range(requests)]
    store, slots, _ = runner.admit_prompts(kv_device.new_store(tc), tc, prompts)
    return store, slots


def measure(model, runner, context: int, requests: int, max_seq_len: int, steps: int, bounded: bool) -> dict:
    pages = -(-(context + steps + 8) // 64)
    tc = PageManager(model.cfg, CacheConfig(kv_dtype="float32", device_pages=requests * (pages + 2),
                                            host_pages=requests * pages, max_seqs=requests,
                                            max_seq_len=max_seq_len))
    rng = np.random.default_rng(0)
    store, slots = prefill_random(runner, tc, rng, requests, context)
    req = np.asarray(slots, np.int32)
    tokens = np.zeros(requests, np.int32)
    times = []
    for t in range(steps + 2):  # the first two compile / warm up
        store = kv_device.reserve_next(store, tc, slots)
        batch = {"tokens": tokens, "req": req}
        if bounded:
            batch["index_span"] = index_span(tc.spec, max(tc.lengths[s] for s in slots) + 1)
        t0 = time.perf_counter()
        logits, store, _ = runner.decode(store, batch)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
        tc.advance(slots)
    med = float(np.median(times[2:]))
    return {"max_seq_len": max_seq_len, "bounded": bounded, "step_ms": med * 1e3,
            "index_pages_scored": len(index_span(tc.spec, context + steps)) if bounded else tc.spec.max_pages}


def measure_host(model, runner, context: int, requests: int, host_scale: int, steps: int, kv_dtype: str,
                 miss_attention: str = "single") -> dict:
    """Step time with a device pool too small for the requests (misses fetched from host every step), host pool
    `host_scale` x what the requests need."""
    pages = -(-(context + steps + 8) // 64)
    probe = CacheConfig(kv_dtype=kv_dtype, device_pages=1, max_seqs=requests, max_seq_len=pages * 64,
                        miss_attention=miss_attention)
    hot = -(-probe.hot_rows_for(model.cfg) // 64)
    tc = PageManager(model.cfg, probe.replace(device_pages=requests * (2 + hot) + 2,
                                              host_pages=host_scale * requests * pages,
                                              index_pages=requests * pages))
    rng = np.random.default_rng(1)
    store, slots = prefill_random(runner, tc, rng, requests, context)
    req = np.asarray(slots, np.int32)
    tokens = rng.integers(0, model.cfg.vocab_size, requests).astype(np.int32)
    times, misses = [], 0
    for t in range(steps + 2):
        store = kv_device.reserve_next(store, tc, slots)
        batch = {"tokens": tokens, "req": req,
                 "index_span": index_span(tc.spec, max(tc.lengths[s] for s in slots) + 1)}
        t0 = time.perf_counter()
        logits, store, stats = runner.decode(store, batch)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
        tc.advance(slots)
        tokens = np.asarray(jax.numpy.argmax(logits, -1), np.int32)
        if t >= 2:
            misses += int(np.sum(stats["misses"]))
    return {"kv_dtype": kv_dtype, "miss_attention": miss_attention, "host_scale": host_scale,
            "host_pages": tc.spec.host_pages,
            "step_ms": float(np.median(times[2:])) * 1e3, "misses": misses}


def ratio_vs_smallest(rows: list[dict], key: str) -> None:
    """Each row's step time over the first (smallest) row's with the same `key` value: "ratio_vs_smallest"."""
    for r in rows:
        first = next(x for x in rows if x[key] == r[key])
        r["ratio_vs_smallest"] = r["step_ms"] / first["step_ms"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-glm")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--scales", default="1,4,16", help="max_seq_len = scale x the smallest power of two >= context")
    ap.add_argument("--host-scales", default="1,16", help="host pool = scale x what the requests need")
    ap.add_argument("--what", default="all", choices=("all", "max_seq_len", "host_pool", "miss_attention"))
    ap.add_argument("--out", default="experiments/results/bench_step_cost.json")
    a = ap.parse_args(argv)
    cfg = get_preset(a.preset)
    model = SparseMLAModel(cfg, rngs=nnx.Rngs(0))
    runner = Runner(model)
    base = 1 << (a.context + a.steps + 8 - 1).bit_length()
    rows, host_rows = [], []
    for scale in (int(x) for x in a.scales.split(",")) if a.what in ("all", "max_seq_len") else ():
        for bounded in (True, False):
            r = measure(model, runner, a.context, a.requests, base * scale, a.steps, bounded)
            r["scale"] = scale
            rows.append(r)
            print(f"max_seq_len {r['max_seq_len']:>6} ({scale:>2}x)  {'bounded' if bounded else 'all pages'}: "
                  f"{r['step_ms']:.2f} ms/step ({r['index_pages_scored']} pages scored)", flush=True)
    ratio_vs_smallest(rows, "bounded")
    for kv_dtype in ("bf16", "float32") if a.what in ("all", "host_pool") else ():
        for hs in (int(x) for x in a.host_scales.split(",")):
            r = measure_host(model, runner, a.context, a.requests, hs, a.steps, kv_dtype)
            host_rows.append(r)
            print(f"{kv_dtype:>7} host pool x{hs:<3} ({r['host_pages']} pages): {r['step_ms']:.2f} ms/step, "
                  f"{r['misses']} misses", flush=True)
    ratio_vs_smallest(host_rows, "kv_dtype")
    split_rows = []
    for ma in ("single", "split") if a.what in ("all", "miss_attention") else ():
        r = measure_host(model, runner, a.context, a.requests, 1, a.steps, "float32", ma)
        split_rows.append(r)
        print(f"miss_attention {ma:>6}: {r['step_ms']:.2f} ms/step, {r['misses']} misses", flush=True)
    for r in split_rows:
        r["ratio_vs_single"] = r["step_ms"] / split_rows[0]["step_ms"]
    out = {"preset": a.preset, "context": a.context, "requests": a.requests, "steps": a.steps, "rows": rows,
           "host_pool_rows": host_rows, "miss_attention_rows": split_rows,
           "jax": jax.__version__, "backend": jax.default_backend(), "machine": platform.machine(),
           "cpus": os.cpu_count()}
    save_json(a.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
