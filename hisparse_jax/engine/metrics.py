"""What the engine reports: one step's `StepMetrics`, a run's `EngineMetrics` from its steps and requests, and a
mesh step's metrics combined from its ranks'.

    m = step_metrics(engine, work, bucket=B, scored_pages=P, stats=out.stats, new_tokens=..., ...)
    summarize(engine.history, list(engine.requests.values()), policy="hisparse")   # -> EngineMetrics
    combine_steps([rank_step_0, rank_step_1], step_time_s, compiled)                # -> StepMetrics
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from hisparse_jax.engine.request import RequestState
from hisparse_jax.engine.runner import TRACE_COUNTS
from hisparse_jax.results import EngineMetrics, StepMetrics
from hisparse_jax.units import PAGE_SIZE

# step fields that are not counts summed over ranks: how they combine
_MAX_FIELDS = ("scored_pages",)


def step_metrics(engine, w, *, bucket: int, scored_pages: int, stats: dict, new_tokens: int, decode_tokens: int,
                 drafted: int, accepted: int) -> StepMetrics:
    """The `StepMetrics` of `engine`'s step `w` (its `StepWork`), committed: the plan's actions, the scheduler's
    queues after it, the batched call's bucket, indexer pages and counters (`stats`, empty: no call), the tokens
    it emitted, its wall time since `w.t0` and whether it compiled."""
    plan, sched, manager, st = w.plan, engine.scheduler, engine.manager, stats
    return StepMetrics(**{
        "step": engine.step_count, "running": len(plan.decode),
        "admitted": len(sched.active), "prefilling": sum(r.state is RequestState.PREFILLING for r in sched.active),
        "swapped": sum(r.state is RequestState.SWAPPED for r in sched.active), "waiting": len(sched.waiting),
        "preemptions": len(plan.preempted), "swaps_out": len(plan.swapped_out),
        "swaps_in": len(plan.swapped_in), "tokens": new_tokens, "prefill_tokens": w.prefill_tokens,
        "cached_tokens": plan.cached_tokens, "failed": len(w.failed), "bucket": bucket,
        "scored_pages": scored_pages, "decode_tokens": decode_tokens, "drafted": drafted, "accepted": accepted,
        "duplicate_misses": st.get("row_misses", 0) - st.get("misses", 0),
        "hits": st.get("hits", 0), "misses": st.get("misses", 0), "resident": st.get("resident", 0),
        "h2d_bytes": st.get("h2d_bytes", 0), "d2h_bytes": st.get("d2h_bytes", 0),
        "index_h2d_bytes": st.get("index_h2d_bytes", 0),
        "device_pages_used": manager.pool.num_used("device"), "step_time_s": time.perf_counter() - w.t0,
        "compiled": TRACE_COUNTS["store_decode_step"] > w.traces, "wait_reasons": plan.wait_reasons(),
        "recomputed_tokens": w.recomputed_tokens,
        "preempted_waiting": sum(1 for r in sched.waiting if r.preemptions),
        "swap_out_pages": plan.swap_out_pages, "swap_in_pages": plan.swap_in_pages,
        "swap_out_bytes": swap_bytes(manager, plan.swap_out_pages, plan.swap_out_keys),
        "swap_in_bytes": swap_bytes(manager, plan.swap_in_pages, plan.swap_in_keys),
    })


def swap_bytes(manager, kv_pages: int, key_pages: int) -> int:
    """Bytes of `kv_pages` KV pages (every layer) and `key_pages` indexer pages (every indexer layer) of
    `manager`'s store."""
    spec = manager.spec
    key_page = int(PAGE_SIZE * spec.num_indexer_layers * spec.index_row_bytes)
    return kv_pages * manager.all_layers_page_bytes + key_pages * key_page


def summarize(h: list, requests: list, *, policy: str, admission: str = "vllm", speculative_tokens: int = 0,
              extra_h2d_bytes: int = 0,
              extra_d2h_bytes: int = 0, evicted_pages: int = 0, import_bytes: int = 0, ranks=()) -> EngineMetrics:
    """`EngineMetrics` of a run from its per-step history `h` and its `requests`; extra_h2d/d2h_bytes: bytes moved
    outside the steps (page loads, prompt writes); ranks: per-rank metrics (a `MeshEngine`)."""
    decode_steps = [m for m in h if m.running]
    total_time = sum(m.step_time_s for m in h)
    warm = [m for m in h if not m.compiled]
    warm_time = sum(m.step_time_s for m in warm)
    hits, misses = sum(m.hits for m in h), sum(m.misses for m in h)
    tokens = sum(m.tokens for m in h)
    cached, prefill = sum(m.cached_tokens for m in h), sum(m.prefill_tokens for m in h)
    done = [r for r in requests if r.state is RequestState.FINISHED]
    return EngineMetrics(**{
        "policy": policy, "steps": len(h),
        "mean_running": float(np.mean([m.running for m in decode_steps])) if decode_steps else 0.0,
        "max_running": max((m.running for m in h), default=0),
        "preemptions": sum(m.preemptions for m in h), "swaps": sum(m.swaps_out for m in h),
        "failed": sum(r.state is RequestState.FAILED for r in requests),
        "tokens": tokens, "prefill_tokens": sum(m.prefill_tokens for m in h),
        # prompt tokens served by prefix caching, and their share of all prompt tokens admitted
        "cached_tokens": cached, "prefix_hit_rate": cached / (cached + prefill) if cached + prefill else 0.0,
        "time_s": total_time, "compile_steps": len(h) - len(warm), "compile_time_s": total_time - warm_time,
        # throughput over the steps that did not compile (the step compiles once per batch bucket)
        "tokens_per_s": sum(m.tokens for m in warm) / warm_time if warm_time else 0.0,
        "hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
        "resident": sum(m.resident for m in h),
        "h2d_bytes": sum(m.h2d_bytes for m in h) + extra_h2d_bytes,
        "d2h_bytes": sum(m.d2h_bytes for m in h) + extra_d2h_bytes,
        "index_h2d_bytes": sum(m.index_h2d_bytes for m in h),
        "evicted_pages": evicted_pages, "import_bytes": import_bytes,
        # speculative decoding: drafts accepted / verified, and tokens a running request gains per decode step
        "speculative_tokens": speculative_tokens,
        "acceptance_rate": _ratio(sum(m.accepted for m in h), sum(m.drafted for m in h)),
        "duplicate_misses": sum(m.duplicate_misses for m in h),
        "tokens_per_step": _ratio(sum(m.decode_tokens for m in h), sum(m.running for m in h)),
        # in engine steps, from arrival (add_request) to the first token / to the last, finished requests only
        "mean_ttft_steps": _mean(r.first_token_step - r.arrival for r in done if r.first_token_step is not None),
        "mean_latency_steps": _mean(r.finished_at - r.arrival for r in done),
        "history": list(h), "ranks": list(ranks), "wait_reasons": sum_counts(m.wait_reasons for m in h),
        # what preempt / offload cost: tokens prefilled again after a preemption, request-steps spent preempted
        # (back in the queue) or swapped out, pages and bytes swapped each way
        "admission": admission if policy != "hisparse" else "hisparse",
        "recomputed_tokens": sum(m.recomputed_tokens for m in h),
        "preempted_steps": sum(m.preempted_waiting for m in h), "swapped_steps": sum(m.swapped for m in h),
        "swap_out_pages": sum(m.swap_out_pages for m in h), "swap_in_pages": sum(m.swap_in_pages for m in h),
        "swap_out_bytes": sum(m.swap_out_bytes for m in h), "swap_in_bytes": sum(m.swap_in_bytes for m in h),
    })


def sum_counts(dicts) -> dict[str, int]:
    """Counts per key summed over `dicts`, keys sorted."""
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _mean(xs) -> float:
    xs = list(xs)
    return float(np.mean(xs)) if xs else 0.0


def combine_steps(ms: list[StepMetrics], step_time_s: float, compiled: bool) -> StepMetrics:
    """One mesh step's metrics from its ranks' (same step): counts summed (wait reasons per reason), `scored_pages`
    the largest, the mesh step's wall time and whether it compiled."""
    out = {}
    for f in dataclasses.fields(StepMetrics):
        vals = [getattr(m, f.name) for m in ms]
        if f.name == "step":
            out[f.name] = vals[0]
        elif f.name in _MAX_FIELDS:
            out[f.name] = max(vals)
        elif f.name == "step_time_s":
            out[f.name] = step_time_s
        elif f.name == "compiled":
            out[f.name] = compiled
        elif f.name == "wait_reasons":
            out[f.name] = sum_counts(vals)
        else:
            out[f.name] = sum(vals)
    return StepMetrics(**out)
