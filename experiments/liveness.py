"""Scheduler liveness over many random workloads: the property of `tests/e2e/test_liveness.py`, at scale.

    PYTHONPATH=. python experiments/liveness.py [--runs 10000] [--seed 0] [--jobs 1] [--admissions vllm,reserve]
                                                [--out experiments/results/liveness.json]

Each workload seed is run once per admission rule (`engine.scheduler.ADMISSIONS`, the seed's own draw replaced:
the same workload under "vllm" and "reserve"), so --runs 10000 is 10^4 schedules per rule; the summary is given
in all and per rule (`by_admission`). Each run draws a workload (`engine.fake_compute.random_workload`: policy,
prefill mode, prefix caching,
max_running, prompt chunk, hot-buffer size, 2-10 requests sharing documents' first pages or not, arrivals, and
device / indexer / host budgets, half of them within a few pages of the least) and drives the real `Scheduler`
over the real `PageManager` bookkeeping with a fake model (`run_workload`: NumPy only, nothing compiled). It
checks, every step, that every admitted request progressed (a decode row, prompt rows, a whole prefill) or the
plan states why not, and that no `OutOfPages` escaped `schedule` or was raised inside it; at the end, that every
request finished within `step_bound(workload)` and the pools are empty (allocator invariants every 8 steps and at
the end). Written: the number of runs and failures (each failing seed with its first broken property), per
pressure kind the runs that met it and its events (requests admitted sharing a prefix, steps with prompt chunks,
preemptions, swap-outs, HiSparse page releases, whole prefills), the wait reasons seen, and steps vs the bound.
Progress (schedules done, failures so far, time left) goes to stderr about every 30 s.

`demo` also schedules the demo's own workload the same way (`hisparse demo`'s defaults: the trained model's
layout, 16 held-out-text prompts of up to 4096 tokens per device, 160 new tokens, prefill "whole", its HiSparse
budgets; on 1 and 4 devices, each rank its own scheduler, the `MeshEngine`'s balanced placement), with the
documents repeated past the 42 held-out files (as the demo's workload did before `document_prompts` took
distinct offsets) and without: per rank the mean running requests, the longest stretch an admitted request went
without progress or a stated reason, and the OutOfPages raised inside `schedule`. The model's tokens do not
change these (no eos; prefix hits come from the prompts; "oldest" coldness), so they are the real engine's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hisparse_jax.engine.scheduler import ADMISSIONS  # noqa: E402  (after the path above)

KINDS = ("prefix_shared", "chunk_steps", "preemptions", "swaps", "hisparse_releases", "whole")


def one(task: tuple[int, str]) -> dict:
    """Run the workload of `seed` under `admission` (task = (seed, admission)); a small summary of it."""
    import dataclasses

    import numpy as np

    from hisparse_jax.engine.fake_compute import random_workload, run_workload

    seed, admission = task
    w = dataclasses.replace(random_workload(np.random.default_rng(seed)), admission=admission)
    rep = run_workload(w, check_every=8)
    return {"seed": seed, "admission": admission, "policy": w.policy, "prefill": w.prefill,
            "prefix_caching": w.prefix_caching,
            "requests": rep.requests, "refused": rep.refused, "steps": rep.steps, "bound": rep.bound,
            "failures": rep.failures, "counts": rep.counts, "waits": rep.waits}


def summarize(results: list[dict]) -> dict:
    failures = [r for r in results if r["failures"]]
    kinds = {k: {"runs": sum(1 for r in results if r["counts"][k]),
                 "events": sum(r["counts"][k] for r in results)} for k in KINDS}
    by_policy = {}
    for pol in sorted({r["policy"] for r in results}):
        rs = [r for r in results if r["policy"] == pol]
        by_policy[pol] = {"runs": len(rs), "failures": sum(1 for r in rs if r["failures"]),
                          **{k: sum(1 for r in rs if r["counts"][k]) for k in KINDS}}
    waits: dict[str, int] = {}
    for r in results:
        for k, v in r["waits"].items():
            waits[k] = waits.get(k, 0) + v
    ratios = [r["steps"] / r["bound"] for r in results]
    return {
        "runs": len(results), "failures": len(failures),
        "failing": [{"seed": r["seed"], "admission": r["admission"], "policy": r["policy"], "prefill": r["prefill"],
                     "first": r["failures"][0]} for r in failures[:50]],
        "requests": sum(r["requests"] for r in results), "refused_at_the_door": sum(r["refused"] for r in results),
        "steps": sum(r["steps"] for r in results),
        "pressure": kinds, "by_policy": by_policy,
        "by_prefill": {m: sum(1 for r in results if r["prefill"] == m) for m in ("chunked", "whole")},
        "prefix_caching_runs": sum(1 for r in results if r["prefix_caching"]),
        "wait_reasons": dict(sorted(waits.items())),
        "steps_over_bound": {"max": max(ratios, default=0.0), "mean": sum(ratios) / len(ratios) if ratios else 0.0},
    }


def demo_schedule(devices: int, repeat: bool, policy: str = "hisparse", admission: str = "vllm") -> dict:
    """The demo's workload and budgets (its defaults) scheduled over `devices` ranks with the fake model (under
    `policy` and, for preempt / offload, `admission`)."""
    import numpy as np

    from hisparse_jax import checkpoints
    from hisparse_jax.hf_config import from_hf_config
    from hisparse_jax.demo_workload import PROMPT_TOPKS, budgets
    from hisparse_jax.engine import EngineConfig, SamplingParams, device_budget
    from hisparse_jax.engine.fake_compute import FakeEngine
    from hisparse_jax.train import data

    cfg = from_hf_config(checkpoints.resolve("stdlib-dsa"))
    requests, new_tokens, seed, longest = 16, 160, 0, PROMPT_TOPKS * cfg.index_topk
    rng = np.random.default_rng(seed)  # as `demo_workload.text_workload`
    lens = np.linspace(longest * 0.55, longest, requests * devices).astype(int)
    rng.shuffle(lens)
    prompts = data.document_prompts(data.load_corpus()[1], lens, seed, repeat=repeat)
    max_len = max(len(p) for p in prompts) + new_tokens
    base, device_bytes = budgets(cfg, requests, max_len, 3.5)
    cc = device_budget(cfg, base, device_bytes, policy, max_running=requests, max_len=max_len, prefill="whole")
    config = EngineConfig(policy=policy, prefill="whole", max_running=requests, prefill_chunk=240, admission=admission)
    ranks = [FakeEngine(cfg, cc, config) for _ in range(devices)]

    def place(prompt):  # `MeshEngine.place`, "balanced"
        def key(r):
            unfinished = [q for q in ranks[r].requests.values() if not q.finished]
            return (-len(ranks[r].manager.match_prefix(prompt)), len(unfinished),
                    sum(len(q.prompt) + q.params.max_new_tokens for q in unfinished), r)
        return min(range(devices), key=key)

    for i, p in enumerate(prompts):
        ranks[place(p)].add_request(f"r{i}", p, SamplingParams(max_new_tokens=new_tokens))
    running = [[] for _ in ranks]
    longest_stall, streak, raised = [0] * devices, [{} for _ in ranks], [0] * devices
    preemptions = swaps = 0
    steps = 0
    while any(e.has_unfinished() for e in ranks):
        for k, e in enumerate(ranks):
            if not e.has_unfinished():
                continue
            s = e.step_report()
            raised[k] += s.out_of_pages
            preemptions, swaps = preemptions + len(s.plan.preempted), swaps + len(s.plan.swapped_out)
            if s.plan.decode:
                running[k].append(len(s.plan.decode))
            streak[k] = {rid: streak[k].get(rid, 0) + 1 for rid in s.unexplained}
            longest_stall[k] = max([longest_stall[k], *streak[k].values()])
        steps += 1
    return {"devices": devices, "repeated_documents": repeat, "policy": policy,
            "admission": admission if policy != "hisparse" else None, "steps": steps,
            "preemptions": preemptions, "swaps": swaps,
            "device_pages": cc.device_pages, "index_pages": cc.num_index_pages,
            "prompts_sharing_a_first_page": len(prompts) - len({tuple(p[:64]) for p in prompts}),
            "mean_running_per_rank": [round(float(np.mean(r)), 3) for r in running],
            "longest_unexplained_stall_per_rank": longest_stall, "out_of_pages_per_rank": raised,
            "requests_sharing_a_prefix": sum(1 for e in ranks for r in e.requests.values() if r.cached_tokens)}


def run_all(tasks: list[tuple[int, str]], jobs: int, t0: float, every_s: float = 30.0) -> list[dict]:
    """`one` of every task, in order, on `jobs` worker processes; progress on stderr about every `every_s`
    seconds (schedules done, failures so far, time and an estimate of what is left) and at the end."""
    results, last = [], t0
    with contextlib.ExitStack() as stack:
        if jobs > 1:
            import multiprocessing as mp

            runs = stack.enter_context(mp.get_context("spawn").Pool(jobs)).imap(one, tasks, chunksize=64)
        else:
            runs = map(one, tasks)
        for r in runs:
            results.append(r)
            now = time.perf_counter()
            if now - last >= every_s or len(results) == len(tasks):
                last, done = now, len(results)
                left = (now - t0) / done * (len(tasks) - done)
                print(f"liveness: {done:,} / {len(tasks):,} schedules, {sum(1 for x in results if x['failures'])} "
                      f"failed, {now - t0:.0f} s, about {left:.0f} s left", file=sys.stderr, flush=True)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0, help="first workload seed (runs use seed .. seed + runs - 1)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument("--out", default="experiments/results/liveness.json")
    p.add_argument("--no-demo", action="store_true", help="skip the demo workload's schedules")
    p.add_argument("--admissions", default=",".join(ADMISSIONS), help="comma-separated admission rules to run "
                   "every seed under (default: all)")
    args = p.parse_args(argv)
    rules = args.admissions.split(",")
    if not rules or any(a not in ADMISSIONS for a in rules):
        p.error(f"--admissions: comma-separated subset of {','.join(ADMISSIONS)}, got {args.admissions!r}")
    t0 = time.perf_counter()
    tasks = [(s, a) for s in range(args.seed, args.seed + args.runs) for a in rules]
    results = run_all(tasks, args.jobs, t0)
    import jax

    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "jax": jax.__version__,
           "python": platform.python_version(), "seeds": [args.seed, args.seed + args.runs - 1],
           "admissions": rules, **summarize(results),
           "by_admission": {a: summarize([r for r in results if r["admission"] == a]) for a in rules}}
    if not args.no_demo:
        out["demo"] = [demo_schedule(n, repeat) for n, repeat in ((1, False), (4, True), (4, False))]
        out["demo"] += [demo_schedule(1, False, pol, a) for pol in ("preempt", "offload") for a in rules]
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    print(json.dumps({k: out[k] for k in ("runs", "failures", "pressure", "steps_over_bound", "wall_s")}))
    for a, sub in out["by_admission"].items():
        print(json.dumps({"admission": a, **{k: sub[k] for k in ("runs", "failures", "pressure")}}))
    for d in out.get("demo", []):
        print(json.dumps(d))
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
