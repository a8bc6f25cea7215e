"""`hisparse demo`'s run: the workload served once per memory policy under one set of budgets, and its result.

`run_policies` makes the model (a shipped or given checkpoint, or a random-weight preset), the prompts and every
policy's budgets inside one capacity (`demo_workload`), checks them all before any runs (`demo_checks`, then an
engine per policy), then runs each policy's engine to the end with its progress on stderr (`demo_progress`) and
returns what `hisparse demo --json` prints: the workload, the budgets, and per policy the running requests, the
preemptions and swaps, the hit rate and the bytes moved, with a digest of its tokens (`outputs_digest`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import jax
from flax import nnx

from hisparse_jax import checkpoints, parallel
from hisparse_jax.config import CacheConfig
from hisparse_jax.demo_checks import check_workload
from hisparse_jax.demo_progress import Progress
from hisparse_jax.demo_report import plot
from hisparse_jax.demo_workload import (PROMPT_TOPKS, calibration_ids, model_config, policy_budgets, text_workload,
                                        too_small, workload, workload_kind)
from hisparse_jax.engine import Engine, EngineConfig, MeshEngine, SamplingParams
from hisparse_jax.engine.speculative import lookahead
from hisparse_jax.index_codebooks import fit_index_codebooks
from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.model.decoder import SparseMLAModel


def outputs_digest(outputs: dict[str, list[int]]) -> str:
    """SHA-256 of a run's generated tokens (request id -> token ids, `Engine.outputs()`): equal digests, equal
    outputs, so runs in different processes (with and without speculation, other kernels) compare by their JSON."""
    return hashlib.sha256(json.dumps(outputs, sort_keys=True).encode()).hexdigest()


def run_policies(args: argparse.Namespace, on_setup=None) -> dict:
    """`demo.run` on checked arguments; `on_setup(setup)` is called once every policy's budgets are known, before
    any policy runs, with the workload and budgets (`setup`: the keys of the result that describe them). Raises
    DemoSetupError, before the model is made, for a workload that cannot run."""
    k = args.speculative_tokens
    quiet = args.json
    cfg, folder = model_config(args)
    kind = workload_kind(args, cfg)
    longest = args.prompt_len or PROMPT_TOPKS * cfg.index_topk
    check_workload(args, cfg, kind, longest)  # before the model, the prompts or the stores are made
    n_dev = args.devices
    mesh = parallel.data_mesh(n_dev) if n_dev > 1 else None
    if args.preset:
        model = SparseMLAModel(cfg, rngs=nnx.Rngs(args.seed), mtp=bool(k))
    else:
        model = checkpoints.load(folder, mtp=bool(k))
    if kind == "text":
        prompts = text_workload(args.requests * n_dev, longest, args.seed)
    else:
        prompts = workload(cfg.vocab_size, args.requests * n_dev, longest, args.seed)
    b = policy_budgets(args, cfg, max(len(p) for p in prompts) + args.new_tokens + lookahead(k))
    books, fit_s = None, 0.0
    if args.index_summary == "rvq":  # the store's codebooks, fitted once for every policy's store
        t0 = time.perf_counter()
        if not quiet:
            print("fitting the rvq codebooks of the indexer keys on calibration text ...", file=sys.stderr, flush=True)
        books = fit_index_codebooks(model, calibration_ids(kind, cfg, longest, args.seed))
        fit_s = time.perf_counter() - t0
    params = SamplingParams(max_new_tokens=args.new_tokens)
    results, outputs = {}, {}
    policies = list(args.policies)

    def engine(pol: str, log_path: str | None = None) -> tuple[Engine, CacheConfig]:
        try:
            cc = b.split[pol].replace(capacity=b.capacity)
            ec = EngineConfig(policy=pol, admission=args.admission, max_running=args.requests, prefill=args.prefill,
                              prefill_chunk=args.prefill_chunk, log_path=log_path, kernels=args.kernels,
                              speculative_tokens=k, prefix_caching=not k)
            eng = (Engine(model, cc, ec, index_codebooks=books) if mesh is None
                   else MeshEngine(model, cc, ec, mesh=mesh))
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, params)
        except ValueError as e:
            raise too_small(args, b.device_bytes, pol, e) from None
        return eng, cc

    split = {}
    for pol in policies:  # every policy's budgets are checked before any runs
        eng, cc = engine(pol)
        eng.close()
        del eng  # its store is freed before the next engine makes one
        spec = StoreSpec.create(cfg, cc.replace(capacity=None))  # the budgets' geometry (per device)
        split[pol] = {"device_pages": cc.device_pages, "index_pages": cc.num_index_pages,
                      "host_pages": cc.host_pages if pol != "preempt" else 0,
                      "kv_pool_bytes": cc.device_pages * spec.page_bytes * spec.num_layers,
                      "index_pool_bytes": int(cc.num_index_pages * 64 * spec.num_indexer_layers * spec.index_row_bytes),
                      "index_host_bytes": cc.num_index_pages * 64 * spec.num_indexer_layers * spec.index_host_row_bytes}
    setup = {
        "preset": args.preset, "model": None if args.preset else args.model, "workload": kind,
        "requests": len(prompts), "devices": n_dev, "prompt_tokens": [len(p) for p in prompts],
        "new_tokens": args.new_tokens, "kv_dtype": args.kv_dtype, "index_dtype": args.index_dtype,
        "device_budget_bytes": b.device_bytes, "admission": args.admission,
        "device_requests": args.device_requests, "host_pages": b.base.host_pages, "kernels": args.kernels,
        "miss_attention": args.miss_attention, "speculative_tokens": k, "hot_rows": b.base.hot_rows_for(cfg),
        "hot_policy": args.hot_policy, "index_tier": args.index_tier,
        "index_budget_pages": args.index_budget_pages or None, "index_rank": args.index_rank,
        "index_summary": args.index_summary, "index_codebooks_fit_s": fit_s,
        "prefill": args.prefill, "backend": jax.default_backend(), "policies": split,
        "capacity": {"device_pages": b.capacity.device_pages, "index_pages": b.capacity.num_index_pages,
                     "host_pages": b.capacity.host_pages},
    }
    if on_setup:
        on_setup(setup)
    for pol in policies:
        eng, cc = engine(pol, os.path.join(args.log_dir, f"{pol}.jsonl") if args.log_dir else None)
        t0 = time.perf_counter()
        progress = None if quiet else Progress(pol, len(prompts))
        try:
            eng.run(progress=progress)
        except BaseException:
            eng.close()
            raise
        finally:
            if progress:
                progress.close()
        m = eng.metrics()
        row_bytes = eng.spec.row_bytes
        outputs[pol] = eng.outputs()
        results[pol] = {
            "mean_running": m.mean_running, "max_running": m.max_running, "preemptions": m.preemptions,
            "swaps": m.swaps, "tokens_per_s": m.tokens_per_s, "hit_rate": m.hit_rate,
            "hits": m.hits, "misses": m.misses, "resident": m.resident,
            "h2d_bytes": m.h2d_bytes, "d2h_bytes": m.d2h_bytes, "index_h2d_bytes": m.index_h2d_bytes,
            # index_tier="host": indexer key bytes read from the host per step (every request and index layer)
            "index_h2d_bytes_per_step": m.index_h2d_bytes / max(m.steps, 1),
            "evicted_pages": m.evicted_pages, "steps": m.steps, "wall_s": time.perf_counter() - t0,
            # what preempt / offload cost (`EngineMetrics`): tokens prefilled again, request-steps preempted or
            # swapped out, pages and bytes swapped each way
            "recomputed_tokens": m.recomputed_tokens, "preempted_steps": m.preempted_steps,
            "swapped_steps": m.swapped_steps, "swap_out_pages": m.swap_out_pages, "swap_in_pages": m.swap_in_pages,
            "swap_out_bytes": m.swap_out_bytes, "swap_in_bytes": m.swap_in_bytes,
            "compile_s": m.compile_time_s, "outputs_sha256": outputs_digest(outputs[pol]),
            "acceptance_rate": m.acceptance_rate,
            "tokens_per_step": m.tokens_per_step, "duplicate_misses": m.duplicate_misses,
            # H2D bytes of the steps over (distinct missing rows x row bytes): 1.00 when each miss moves once
            "h2d_per_miss_bytes": _ratio(sum(h.h2d_bytes for h in m.history), m.misses * row_bytes),
            **split[pol],
            "running_over_time": [h.running for h in m.history],
            # per device (a MeshEngine): each rank's mean running requests over its decode steps
            "ranks_mean_running": [r.mean_running for r in m.ranks] or [m.mean_running],
        }
        eng.close()
        del eng
    first = outputs[policies[0]]
    out = {**setup, "policies": results, "outputs_identical": all(outputs[p] == first for p in policies)}
    if "hisparse" in results and "offload" in results and results["offload"]["mean_running"]:
        out["hisparse_over_offload_mean_running"] = results["hisparse"]["mean_running"] / results["offload"][
            "mean_running"]
    if args.plot:
        out["plot"] = plot(results, args.plot)
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None
