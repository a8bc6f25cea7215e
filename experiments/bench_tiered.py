#!/usr/bin/env python3
"""Benchmark: decode-step time through the tiered store vs all-resident, and bytes moved per step.

    PYTHONPATH=. python3 experiments/bench_tiered.py [--steps 16] [--prompt-len 1024] [--requests 2]
                                                     [--device-pages N] [--out experiments/results/bench_tiered.json]

On a tiny model with the real cache geometry ("tiny-glm": latent 512, rope 64, indexer 128, top-k 256), with
seeded random weights and prompts:

1. `generate(model, prompts, steps + 1, cache=CacheConfig(...), return_stats=True)` once all-resident and once
   per fetch mechanism ("row", "page") under a small device budget: hits / misses / resident rows and the
   host -> device bytes per decode step (payload and what the mechanism moved), plus whether the greedy
   tokens equal the all-resident run's.
2. Per-step timing: three `PageManager` stores built as `generate` builds them (prefill, `admit`,
   `write_prefill`), then `hisparse_jax.engine.runner.store_decode_step` stepped side by side (one step of each store
   per round), `--warmup` rounds first, median of `--steps` rounds; ratio tiered / resident per mechanism.

This is a benchmark, not a test: on a CPU the host and device pools are the same memory, so the ratio shows
the cost of the tiering logic (resolve, LRU, fetch loops), not of PCIe. Progress goes to stderr, the JSON
to --out. Units: *_s seconds, *_bytes bytes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.report import run_to_json

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_tiered.json")


def log(t0, *a):
    print(f"[{time.perf_counter() - t0:6.1f}s]", *a, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per store (default 16)")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per store first (default 2)")
    p.add_argument("--prompt-len", type=int, default=1024, help="tokens per prompt (default 1024)")
    p.add_argument("--requests", type=int, default=2, help="prompts decoded together (default 2)")
    p.add_argument("--device-pages", type=int, default=None,
                   help="device pages of the tiered stores (default: per request 2 tail pages + the hot buffer "
                        "+ 2, i.e. most of each prompt lives on the host)")
    p.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8", "float32"))
    p.add_argument("--preset", default="tiny-glm", choices=("tiny-glm", "tiny-deepseek"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output (default {os.path.relpath(DEFAULT_OUT)})")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.prompt_len < 16 or args.requests < 1:
        p.error("need --steps >= 1, --warmup >= 1, --prompt-len >= 16, --requests >= 1")
    return args


def run(args) -> dict:
    from flax import nnx

    from hisparse_jax.config import CacheConfig, get_preset
    from hisparse_jax.units import PAGE_SIZE
    from hisparse_jax.generate import generate
    from hisparse_jax.kv import device as kv_device
    from hisparse_jax.kv.manager import PageManager
    from hisparse_jax.engine.runner import store_decode_step
    from hisparse_jax.kv.tiered import stats_bytes
    from hisparse_jax.model.decoder import SparseMLAModel

    t0 = time.perf_counter()
    cfg = get_preset(args.preset)
    model = SparseMLAModel(cfg, rngs=nnx.Rngs(args.seed))
    # Commit the parameters to the device. Otherwise generate()'s first decode step gets uncommitted tokens
    # and every later step committed ones, and XLA compiles the step twice (see the report).
    dev = jax.devices()[0]
    nnx.update(model, jax.device_put(nnx.state(model), dev))
    rng = np.random.default_rng(args.seed)
    R, P, W, N = args.requests, args.prompt_len, args.warmup, args.steps
    prompts = [rng.integers(0, cfg.vocab_size, P).tolist() for _ in range(R)]
    total = P + W + N + 1
    pages = -(-total // PAGE_SIZE)
    hot_rows = 2 * cfg.index_topk
    hot_pages = -(-hot_rows // PAGE_SIZE)
    tight = args.device_pages if args.device_pages is not None else R * (2 + hot_pages + 2)
    common = dict(kv_dtype=args.kv_dtype, host_pages=R * (pages + 1), max_seqs=R, max_seq_len=(pages + 1) * PAGE_SIZE)
    configs = {
        # the manager keeps room for a hot buffer while admitting, so "resident" gets that slack as well
        "resident": CacheConfig(device_pages=R * (pages + hot_pages + 1), **common),
        "row": CacheConfig(device_pages=tight, fetch="row", **common),
        "page": CacheConfig(device_pages=tight, fetch="page", **common),
    }
    log(t0, f"{args.preset}: {cfg.num_hidden_layers} layers, top-k {cfg.index_topk}; {R} prompts x {P} tokens; "
            f"device pages resident {configs['resident'].device_pages}, tiered {tight} "
            f"(a request holds {pages} pages)")

    # ---- 1. generate(): bytes, hits and misses per step -------------------------------------------------
    gen = {}
    tokens = {}
    for name, cc in configs.items():
        log(t0, f"generate ({name}) ...")
        t = time.perf_counter()
        toks, st = generate(model, prompts, N + 1, cache=cc, return_stats=True)
        steps = max(st.steps, 1)
        tokens[name] = toks
        gen[name] = {
            "wall_s": time.perf_counter() - t, "steps": st.steps, "evicted_pages": st.evicted_pages,
            "totals": {k: getattr(st, k) for k in ("resident", "hits", "misses", "h2d_bytes", "h2d_transfer_bytes",
                                                  "d2h_bytes", "append_dropped")},
            "per_step": {
                "resident_rows": st.resident / steps, "hit_rows": st.hits / steps,
                "miss_rows": st.misses / steps, "h2d_payload_bytes": st.h2d_bytes / steps,
                "h2d_transfer_bytes": st.h2d_transfer_bytes / steps,
            },
            "d2h_bytes_incl_prefill": st.d2h_bytes,
        }
        served = st.hits + st.misses
        gen[name]["hit_rate"] = st.hits / served if served else None
    for name in ("row", "page"):
        gen[name]["tokens_match_resident"] = tokens[name] == tokens["resident"]

    # ---- 2. per-step timing, side by side -----------------------------------------------------------------
    from hisparse_jax.engine.runner import prefill_rows

    rows, first = [], []
    for p in prompts:
        last, lat, rope, ik = prefill_rows(model, p)
        rows.append((lat, rope, ik))
        first.append(int(jnp.argmax(last)))
    runs = {}
    for name, cc in configs.items():
        tc = PageManager(cfg, cc)
        store = kv_device.new_store(tc)
        slots = []
        for p, (lat, rope, ik) in zip(prompts, rows):
            store, slot = kv_device.admit_prefilled(store, tc, lat, rope, ik, len(p))
            slots.append(slot)
        # as in generate(): tokens come out of a jitted function (committed), req is a host-made constant
        runs[name] = {"tc": tc, "store": store, "slots": slots, "times": [], "warm": [], "stats": [],
                      "tokens": jax.device_put(jnp.asarray(first, jnp.int32), dev),
                      "req": jnp.asarray(slots, jnp.int32)}

    def one_step(r):
        tc = r["tc"]
        store = kv_device.reserve_next(r["store"], tc, r["slots"])
        t = time.perf_counter()
        logits, r["store"], stats = store_decode_step(model, store, {"tokens": r["tokens"], "req": r["req"]})
        jax.block_until_ready(logits)
        dt = time.perf_counter() - t
        tc.advance(r["slots"])
        r["tokens"] = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return dt, stats

    log(t0, f"timing: {W} warm-up + {N} timed steps per store, side by side ...")
    for _ in range(W):
        for r in runs.values():
            r["warm"].append(one_step(r)[0])
    for i in range(N):
        for r in runs.values():
            dt, stats = one_step(r)
            r["times"].append(dt)
            r["stats"].append(stats_bytes(r["tc"].spec, stats))
        if (i + 1) % max(1, N // 4) == 0:
            log(t0, f"  step {i + 1}/{N}")
    timing = {}
    for name, r in runs.items():
        ts = r["times"]
        timing[name] = {
            "device_pages": configs[name].device_pages, "step_median_s": statistics.median(ts),
            "step_min_s": min(ts), "step_max_s": max(ts), "steps": len(ts), "warmup_steps_s": r["warm"],
            "per_step_mean": {k: sum(s[k] for s in r["stats"]) / len(r["stats"]) for k in r["stats"][0]},
            "evicted_pages": r["tc"].evicted_pages,
        }
        for s in r["slots"]:
            r["tc"].release(s)
    base = timing["resident"]["step_median_s"]
    ratio = {name: timing[name]["step_median_s"] / base for name in ("row", "page")}
    bytes_per_step = {
        name: {"h2d_payload_bytes": gen[name]["per_step"]["h2d_payload_bytes"],
               "h2d_transfer_bytes": gen[name]["per_step"]["h2d_transfer_bytes"],
               "transfer_over_payload": (gen[name]["per_step"]["h2d_transfer_bytes"]
                                         / gen[name]["per_step"]["h2d_payload_bytes"]
                                         if gen[name]["per_step"]["h2d_payload_bytes"] else None),
               "d2h_mirror_bytes": timing[name]["per_step_mean"]["d2h_bytes"],
               "miss_rows": gen[name]["per_step"]["miss_rows"], "hit_rate": gen[name]["hit_rate"]}
        for name in ("resident", "row", "page")}
    for name in ("row", "page"):
        log(t0, f"{name}: {timing[name]['step_median_s'] * 1e3:.2f} ms/step vs resident {base * 1e3:.2f} "
                f"(x{ratio[name]:.2f}); H2D payload {bytes_per_step[name]['h2d_payload_bytes'] / 1024:.1f} KiB/step, "
                f"moved {bytes_per_step[name]['h2d_transfer_bytes'] / 1024:.1f} KiB/step")
    return {
        "tool": "experiments/bench_tiered.py",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": {"jax": jax.__version__, "backend": jax.default_backend(), "device_kind": dev.device_kind,
                        "python": platform.python_version(), "cpu_count": os.cpu_count()},
        "config": {"preset": args.preset, "layers": cfg.num_hidden_layers, "topk": cfg.index_topk,
                   "requests": R, "prompt_len": P, "steps": N, "warmup": W, "kv_dtype": args.kv_dtype,
                   "hot_rows": hot_rows, "pages_per_request": pages,
                   "device_pages": {k: c.device_pages for k, c in configs.items()}},
        "timing": timing, "ratio_vs_resident": ratio, "bytes_per_step": bytes_per_step, "generate": gen,
        "units": {"*_s": "seconds", "*_bytes": "bytes", "*_rows": "KV rows (one token, one layer)"},
        "elapsed_s": time.perf_counter() - t0,
    }


def main(argv=None) -> int:
    return run_to_json(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
