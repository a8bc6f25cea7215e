"""What does it cost to COMPILE a step, and does that grow with depth? Writes JSON.

1. XLA:CPU compile seconds of the tiered decode step (`engine.runner`'s jitted step, reference kernels, one
   process) and of the prefill forward, at tiny-glm widths with 2, 4, 8 and 16 layers (GLM's pattern: a full
   indexer then a shared one), twice: the first layer dense and the rest MoE (two kinds of block from 4 layers on),
   and every layer MoE ("uniform": one kind of block, only the depth varies). The layers are scanned
   (`decoder.scan_layers`), so the program, and its compile time, grows with the kinds of block, not the depth.
2. The deviceless sm_90 build (`hisparse_jax.gpu_build`, XLA's whole GPU pipeline on this CPU) of GLM-5's tiered
   decode step at all 78 layers (fp8 KV, kernels="pallas", batch 32), with the HLO checks the tests apply: store
   donated, host pools in host memory, no pool-sized temporary. Skipped, saying why, without the CUDA plugin /
   ptxas / libdevice (`make test-setup GPU_BUILD=1` installs them, on jax >= 0.11).

Arrays are abstract (nothing is allocated): only compilation is measured. Lowering (tracing + StableHLO) is timed
apart from XLA's compile.

    python experiments/bench_compile.py --out experiments/results/bench_compile.json
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.report import save_json
from hisparse_jax import deviceless as dl
from hisparse_jax import gpu_build
from hisparse_jax.config import CacheConfig, get_preset
from hisparse_jax.engine import runner
from hisparse_jax.kv.state import StoreSpec
from hisparse_jax.model.decoder import SparseMLAModel, layer_runs


def tiny_glm_layers(n: int, uniform: bool = False):
    """tiny-glm widths at n layers: a full indexer then a shared one; the first layer dense and the rest MoE (as
    tiny-glm, GLM-5 and DeepSeek-V3.2 start), or with `uniform` every layer MoE (one kind of block: only the depth
    varies)."""
    base = get_preset("tiny-glm")
    first = "sparse" if uniform else "dense"
    return base.replace(num_hidden_layers=n, indexer_types=("full", "shared") * (n // 2) + ("full",) * (n % 2),
                        mlp_layer_types=(first,) + ("sparse",) * (n - 1))


def timed(lower):
    """(lowering seconds, compile seconds, the compiled executable) of `lower()` -> a `Lowered`."""
    t0 = time.perf_counter()
    lowered = lower()
    t1 = time.perf_counter()
    exe = lowered.compile()
    return t1 - t0, time.perf_counter() - t1, exe


def cpu_step(n: int, batch: int, uniform: bool = False) -> dict:
    cfg = tiny_glm_layers(n, uniform)
    cache = CacheConfig(kv_dtype="float32", device_pages=64, host_pages=64, max_seqs=batch, max_seq_len=2048)
    graphdef, params, store, rows = gpu_build.abstract_step_args(cfg, cache, batch)
    step = runner._jitted_step(graphdef, "reference")
    low, comp, _ = timed(lambda: step.trace(params, store, rows).lower())
    return {"layers": n, "runs": len(layer_runs(cfg)), "lower_s": round(low, 2), "compile_s": round(comp, 2)}


def cpu_prefill(n: int, tokens: int, uniform: bool = False) -> dict:
    cfg = tiny_glm_layers(n, uniform)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: SparseMLAModel(cfg, rngs=nnx.Rngs(0))))
    fn = runner.jitted_prefill(graphdef)
    ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    low, comp, _ = timed(lambda: fn.trace(dl.abstractify(params), ids).lower())
    return {"layers": n, "tokens": tokens, "lower_s": round(low, 2), "compile_s": round(comp, 2)}


def sm90_step(layers: int, kv: str, kernels: str) -> dict:
    cfg = gpu_build.glm5_layers(layers)
    cache = CacheConfig(kv_dtype=kv, device_pages=4096, host_pages=16384, max_seqs=32, max_seq_len=131072)
    graphdef, params, store, rows = gpu_build.abstract_step_args(cfg, cache)
    step = runner._jitted_step(graphdef, kernels)
    t0 = time.perf_counter()
    lowered = dl.lower_for_gpu(step, params, store, rows)
    t1 = time.perf_counter()
    exe = dl.compile_lowered(lowered)
    t2 = time.perf_counter()
    text = dl.hlo_text(exe)
    label = f"glm-5[{layers}] kv={kv} kernels={kernels}"
    gpu_build.check_store_donated(label, store, text)
    gpu_build.check_host_pools_in_host_memory(label, store, text)
    gpu_build.check_no_pool_sized_temporary(label, store, text, exe.get_compiled_memory_stats())
    spec = StoreSpec.create(cfg, cache)
    return {"model": "glm-5", "layers": layers, "runs": len(layer_runs(cfg)), "kv": kv, "kernels": kernels,
            "batch": gpu_build.BATCH, "store_layers": spec.num_layers, "lower_s": round(t1 - t0, 2),
            "compile_s": round(t2 - t1, 2), "xla_options": dl.XLA_OPTIONS, "hlo_checks": "passed"}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="experiments/results/bench_compile.json")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16], help="CPU depths (tiny-glm widths)")
    ap.add_argument("--batch", type=int, default=8, help="CPU step batch")
    ap.add_argument("--prefill-tokens", type=int, default=256)
    ap.add_argument("--sm90-layers", type=int, default=78, help="GLM-5 layers of the sm_90 build (0: skip it)")
    args = ap.parse_args(argv)

    out = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "python": platform.python_version(),
           "cpus": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    for uniform in (False, True):
        tag = "_uniform" if uniform else ""
        steps, prefills = out[f"cpu_step{tag}"], out[f"cpu_prefill{tag}"] = [], []
        for n in args.layers:
            steps.append(cpu_step(n, args.batch, uniform))
            prefills.append(cpu_prefill(n, args.prefill_tokens, uniform))
            print(f"{n:3d} layers{' (all MoE)' if uniform else ''}: step compile {steps[-1]['compile_s']:6.2f} s, "
                  f"prefill compile {prefills[-1]['compile_s']:6.2f} s", flush=True)
        for key, rows in ((f"cpu_step{tag}", steps), (f"cpu_prefill{tag}", prefills)):
            out[f"{key}_growth"] = round(rows[-1]["compile_s"] / rows[0]["compile_s"], 3)  # deepest / shallowest
    if args.sm90_layers:
        why = dl.unavailable_reason()
        if why is not None:
            out["sm90_step"] = {"skipped": str(why)}
        else:
            out["sm90_step"] = sm90_step(args.sm90_layers, "fp8", "pallas")
        print("sm_90:", out["sm90_step"], flush=True)
    save_json(args.out, out, indent=2)
    return out


if __name__ == "__main__":
    main()
