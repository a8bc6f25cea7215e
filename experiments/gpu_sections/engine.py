"""gpu_check's `engine` section: the engine's three policies end to end on a GLM-5-shaped model.

One workload (`ENGINE_SIZES`: on a GPU 32 requests of 16000-token prompts, 32 new tokens each, GLM-5's widths
with 4 layers, one full indexer layer and three that share its top-k as GLM-5.2 configs do, 8 routed experts,
random weights, fp8 KV and indexer keys, the Pallas kernels on Triton) runs under "hisparse", "offload" and
"preempt" with a device budget of a quarter of what the requests need (KV + indexer keys, split per policy by
`engine.device_budget`). Per policy it records, from the engine's own metrics (`Engine.metrics()`,
`StepMetrics`) and from wall clocks taken around each `Engine.step()` and around its one batched device call:

* tokens_per_s (the engine's: new tokens / wall time of the steps that did not compile) and
  tokens_per_s_wall (all steps, compiles included);
* inter-token latency: per request, the wall time between consecutive tokens (intervals that span a compiling
  step are left out and counted): itl_median_s, itl_p99_s;
* mean_running (requests decoding per decode step), hit_rate, h2d_bytes_per_step (mean over decode steps);
* sustained_running and sustained_tokens_per_s: the same over the steps while requests waited (the steady state
  under memory pressure, without the tail where the last requests finish with the queue empty);
* host_share: the host's share of the step time, (step wall time - time inside `Runner.step`, the device call
  and its one device -> host read) / step wall time, over the steps that did not compile (and, with whole-prompt
  prefill, ran no prompt's forward: that runs outside the batched call);

and across policies whether their tokens are identical (on every request's tokens that all policies produced:
a policy stopped at its share of the section's soft deadline still counts, and says so).

Prefill is whole-prompt (one causal forward per admitted prompt, outside the batched step; the host share leaves
those steps out): with chunked prefill (2000 rows a step) the prompts, not memory, bound the run — the engine's
scheduler on this workload (`engine.fake_compute.FakeEngine`) keeps 3.6 requests decoding under every policy, so
the policies would not differ — and the 512K prompt rows through the sparse decode would cost an estimated ~1 s a
step (the H200's fp8 Triton decode, 7.18 ms at B 32 x H 128, scaled to 2000 rows x 64 heads x 4 layers). A
16K-token forward of this model needs 69.4 GiB on the device (XLA's memory analysis of the sm_90 build: 64.6 GiB of
temporaries, mostly scores), so the section's process may use 95 % of the device's memory
(XLA_PYTHON_CLIENT_MEM_FRACTION, set by gpu_check for it). Decode steps use one batch bucket (`min_bucket` 32 =
`requests`) and one indexer span (256 pages), so each store format compiles one step; offload and hisparse share
one store capacity, so one program; preempt (no host mirror) compiles its own.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time

import numpy as np

from experiments.engine_vs_calc import sustained
from experiments.gpu_sections import library

POLICIES = ("hisparse", "offload", "preempt")  # most important first: a policy past its time share stops early

ENGINE_SIZES = {
    "full": dict(
        preset="glm-5",
        model=dict(num_hidden_layers=4, indexer_types=("full", "shared", "shared", "shared"),
                   mlp_layer_types=("dense", "sparse", "sparse", "sparse"), n_routed_experts=8,
                   num_experts_per_tok=2, n_shared_experts=1, vocab_size=16384, dtype="bfloat16"),
        requests=32, prompt=16000, new_tokens=32, device_fraction=0.25, prefill="whole", prefill_chunk=2000,
        min_bucket=32, kernels="pallas", kv_dtype="fp8"),
    # tiny widths with the fp8 row geometry (latent 512, indexer keys 128), 2 dense layers (a full indexer and a
    # shared one): CPU compiles are the cost. Whole-prompt prefill, as on the GPU
    "smoke": dict(
        preset="tiny-glm",
        model=dict(num_hidden_layers=2, indexer_types=("full", "shared"), mlp_layer_types=("dense", "dense"),
                   hidden_size=48, intermediate_size=64, num_attention_heads=3, q_lora_rank=40, kv_lora_rank=512,
                   qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=12, vocab_size=97, index_n_heads=16,
                   index_head_dim=128, index_topk=16),
        requests=8, prompt=512, new_tokens=4, device_fraction=0.25, prefill="whole", prefill_chunk=128,
        min_bucket=8, kernels="reference", kv_dtype="fp8"),
}

# every field a policy's record carries (the CPU smoke's test checks each one)
POLICY_FIELDS = ("tokens_per_s", "tokens_per_s_wall", "itl_median_s", "itl_p99_s", "mean_running", "hit_rate",
                 "h2d_bytes_per_step", "host_share", "complete")


def model_config(sz: dict):
    """The section's ModelConfig: `sz["preset"]` with `sz["model"]` replaced."""
    from hisparse_jax.config import PRESETS

    return PRESETS[sz["preset"]].replace(**sz["model"])


def workload(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n random prompts of `length` tokens each (one length: the prefill chunks fill whole batch buckets)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, (n, length)).tolist()


def budgets(cfg, sz: dict) -> dict:
    """Each policy's CacheConfig for the workload: the host pool holds every request, the device gets
    `device_fraction` of the bytes of every request's KV + indexer pages (`engine.device_budget` splits them per
    policy), and all share the largest pools as their capacity (the same compiled programs where formats agree)."""
    from hisparse_jax.config import CacheConfig
    from hisparse_jax.engine import device_budget
    from hisparse_jax.engine.scheduler import pages
    from hisparse_jax.kv.spec import StoreSpec

    R, max_len = sz["requests"], sz["prompt"] + sz["new_tokens"]
    n = pages(max_len)
    base = CacheConfig(kv_dtype=sz["kv_dtype"], max_seq_len=n * 64, max_seqs=R, host_pages=R * n, device_pages=1)
    spec = StoreSpec.create(cfg, base.replace(index_pages=1))
    kv_page = spec.page_bytes * spec.num_layers
    idx_page = 64 * spec.num_indexer_layers * spec.index_row_bytes
    need = R * n * (kv_page + idx_page)
    device_bytes = int(sz["device_fraction"] * need)
    per = {p: device_budget(cfg, base, device_bytes, p, max_running=R, max_len=max_len, prefill=sz["prefill"])
           for p in POLICIES}
    capacity = base.replace(device_pages=max(b.device_pages for b in per.values()),
                            index_pages=max(b.num_index_pages for b in per.values()))
    return {"need_bytes": need, "device_bytes": device_bytes, "kv_page_bytes": kv_page, "index_page_bytes": idx_page,
            "row_bytes": spec.row_bytes, "pages_per_request": n,
            "caches": {p: b.replace(capacity=capacity) for p, b in per.items()}}


def percentile(xs, q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation) of xs; None when empty."""
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else None


def inter_token_latencies(token_times: dict, compiled_steps: set) -> tuple[list[float], int]:
    """Wall seconds between consecutive tokens of each request. token_times: request -> [(step, time)] of each
    token's step; an interval whose steps (after the earlier token's, up to the later one's) include a compiling
    step is left out. Returns (intervals, how many were left out)."""
    out, dropped = [], 0
    for times in token_times.values():
        for (s0, t0), (s1, t1) in zip(times, times[1:]):
            if s1 == s0:
                continue  # two tokens of one step (none without speculation): no interval between them
            if any(s in compiled_steps for s in range(s0 + 1, s1 + 1)):
                dropped += 1
                continue
            out.append(t1 - t0)
    return out, dropped


def outputs_digest(outputs: dict) -> str:
    return hashlib.sha256(json.dumps(outputs, sort_keys=True).encode()).hexdigest()


def run_policy(model, cc, policy: str, prompts, sz: dict, deadline: float, log) -> tuple[dict, dict]:
    """One policy's run: (record, outputs). Stops (aborting the unfinished requests) once `deadline`
    (time.perf_counter()) passes; the record says so (complete False)."""
    from hisparse_jax.engine import Engine, EngineConfig, SamplingParams

    eng = Engine(model, cc, EngineConfig(policy=policy, max_running=sz["requests"], prefill=sz["prefill"],
                                         prefill_chunk=sz["prefill_chunk"], min_bucket=sz["min_bucket"],
                                         kernels=sz["kernels"]))
    params = SamplingParams(max_new_tokens=sz["new_tokens"])
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    # the time inside the step's one batched device call (`Runner.step`: the jitted step, then the one device ->
    # host read of its tokens and stats): wrapped on this engine's runner instance
    inner, device_s = eng.runner.step, [0.0]

    def timed_step(*a, **kw):
        t = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            device_s[0] += time.perf_counter() - t

    eng.runner.step = timed_step
    token_times: dict[str, list] = {rid: [] for rid in eng.requests}
    per_step_device, t0, stopped = [], time.perf_counter(), None
    while eng.has_unfinished():
        device_s[0] = 0.0
        m = eng.step()
        now = time.perf_counter()
        per_step_device.append(device_s[0])
        for rid, times in token_times.items():
            n = len(eng.requests[rid].output)
            times.extend([(m.step, now)] * (n - len(times)))
        if not (m.running or m.prefill_tokens or m.swaps_in or m.preemptions or m.swaps_out or m.failed):
            raise RuntimeError(f"{policy}: no progress at step {m.step} (waiting for {m.wait_reasons})")
        if m.step % 50 == 0:
            log(f"engine {policy}: step {m.step}, {sum(r.finished for r in eng.requests.values())}/"
                f"{len(prompts)} finished, {now - t0:.1f} s")
        if now > deadline and eng.has_unfinished():
            stopped = m.step
            for rid, r in eng.requests.items():
                if not r.finished:
                    eng.abort(rid)
    wall = time.perf_counter() - t0
    em = eng.metrics()
    h = em.history
    compiled = {x.step for x in h if x.compiled}
    itl, dropped = inter_token_latencies(token_times, compiled)
    # steps that did not compile and made the batched call; with prefill="whole" not those that ran a prompt's
    # forward, which runs outside the batched call (the host share would count it as host time)
    warm = [(x, d) for x, d in zip(h, per_step_device) if not x.compiled and x.bucket
            and not (sz["prefill"] == "whole" and x.prefill_tokens)]
    step_s = sum(x.step_time_s for x, _ in warm)
    decode = [x for x in h if x.running]
    # the steady state under pressure: the steps while requests waited (the tail, when the queue is empty and the
    # last requests finish, is left out)
    busy = [x for x, _ in warm if x.waiting and x.running]
    busy_s = sum(x.step_time_s for x in busy)
    outputs = eng.outputs()
    rec = {
        "policy": policy, "complete": stopped is None, "stopped_at_step": stopped,
        "finished_requests": sum(len(v) == sz["new_tokens"] for v in outputs.values()),
        "tokens": em.tokens, "tokens_per_s": em.tokens_per_s,
        "tokens_per_s_wall": em.tokens / wall if wall else None, "wall_s": wall,
        "itl_median_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99), "itl_intervals": len(itl),
        "itl_left_out_compiling": dropped,
        "mean_running": em.mean_running, "max_running": em.max_running, "preemptions": em.preemptions,
        **{k: v for k, v in sustained(h).items() if k.startswith("sustained")},
        "sustained_tokens_per_s": sum(x.tokens for x in busy) / busy_s if busy_s else None,
        "swaps": em.swaps, "failed": em.failed, "hit_rate": em.hit_rate, "hits": em.hits, "misses": em.misses,
        "resident": em.resident, "h2d_bytes": em.h2d_bytes, "d2h_bytes": em.d2h_bytes,
        "h2d_bytes_per_step": float(np.mean([x.h2d_bytes for x in decode])) if decode else 0.0,
        "host_share": (step_s - sum(d for _, d in warm)) / step_s if step_s else None,
        "host_s_per_step_median": statistics.median(x.step_time_s - d for x, d in warm) if warm else None,
        "device_call_s_median": statistics.median(d for _, d in warm) if warm else None,
        "step_s_median": statistics.median(x.step_time_s for x, _ in warm) if warm else None,
        "decode_only_step_s_median": statistics.median(
            [x.step_time_s for x, _ in warm if not x.prefill_tokens] or [float("nan")]) if warm else None,
        "steps": em.steps, "decode_steps": len(decode), "prefill_steps": sum(bool(x.prefill_tokens) for x in h),
        "compile_steps": em.compile_steps, "compile_time_s": em.compile_time_s,
        "buckets": sorted({x.bucket for x in h}),
        "index_spans": sorted({x.scored_pages for x in h}), "device_pages": cc.device_pages,
        "index_pages": cc.num_index_pages, "outputs_sha256": outputs_digest(outputs),
        "running_over_time": [x.running for x in h],
    }
    eng.close()
    return rec, outputs


def compare_outputs(outputs: dict) -> dict:
    """Whether the policies' tokens are identical, on each request's tokens that every policy produced."""
    pols = list(outputs)
    if len(pols) < 2:
        return {"tokens_identical": None, "tokens_compared": 0, "policies_compared": pols}
    compared, same = 0, True
    for rid in outputs[pols[0]]:
        n = min(len(outputs[p][rid]) for p in pols)
        ref = outputs[pols[0]][rid][:n]
        same &= all(outputs[p][rid][:n] == ref for p in pols[1:])
        compared += n
    return {"tokens_identical": bool(same), "tokens_compared": compared, "policies_compared": pols,
            "all_complete_and_identical": bool(same) and len({outputs_digest(o) for o in outputs.values()}) == 1}


def section_engine(ctx) -> dict:
    """The section (run in its own process by gpu_check): every policy in `POLICIES` order, each within its share
    of what is left of the section's soft budget."""
    import jax
    from flax import nnx

    from hisparse_jax.model.decoder import SparseMLAModel

    sz = ENGINE_SIZES["smoke" if ctx.interpret else "full"]
    cfg = model_config(sz)
    t = time.perf_counter()
    model = SparseMLAModel(cfg, rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    init_s = time.perf_counter() - t
    prompts = workload(cfg.vocab_size, sz["requests"], sz["prompt"])
    b = budgets(cfg, sz)
    out = {"model": {"preset": sz["preset"], **{k: list(v) if isinstance(v, tuple) else v
                                                 for k, v in sz["model"].items()},
                     "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
                     "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
                     "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
                     "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim,
                     "index_topk": cfg.index_topk, "weights": "random (nnx.Rngs(0))"},
           "workload": {k: sz[k] for k in ("requests", "prompt", "new_tokens", "prefill", "prefill_chunk", "min_bucket",
                                           "kernels", "kv_dtype", "device_fraction")},
           "model_init_s": init_s,
           # which decode and fetch the library ran (its defaults change under this script)
           "library": library.decode_and_fetch(),
           "budget": {k: v for k, v in b.items() if k != "caches"},
           "policies": {}}
    ctx.partial(**out)
    outputs = {}
    for i, pol in enumerate(POLICIES):
        left = ctx.budget_s - ctx.elapsed()
        deadline = time.perf_counter() + max(left / (len(POLICIES) - i), 1.0)
        rec, outputs[pol] = run_policy(model, b["caches"][pol], pol, prompts, sz, deadline, ctx.log)
        out["policies"][pol] = rec
        ctx.log(f"engine {pol}: {rec['tokens_per_s']:.1f} tok/s, ITL p50 {rec['itl_median_s']} s / p99 "
                f"{rec['itl_p99_s']} s, mean running {rec['mean_running']:.2f}, hit rate {rec['hit_rate']:.3f}, "
                f"host share {rec['host_share']}, complete {rec['complete']}")
        ctx.partial(**out)
    out.update(compare_outputs(outputs))
    p = out["policies"]
    if p["offload"]["tokens_per_s"] and p["offload"]["itl_p99_s"]:
        out["hisparse_vs_offload_tokens_per_s"] = p["hisparse"]["tokens_per_s"] / p["offload"]["tokens_per_s"]
        out["hisparse_vs_offload_itl_p99"] = (p["hisparse"]["itl_p99_s"] / p["offload"]["itl_p99_s"]
                                              if p["hisparse"]["itl_p99_s"] else None)
        hs, off = p["hisparse"]["sustained_tokens_per_s"], p["offload"]["sustained_tokens_per_s"]
        out["hisparse_vs_offload_sustained_tokens_per_s"] = hs / off if hs and off else None
    if out["tokens_identical"] is False:
        out.update(status="error", error="the policies' tokens differ")
    return out
