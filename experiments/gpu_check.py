#!/usr/bin/env python3
"""One prepared, unattended check of the tiered KV store and the Pallas kernels on a GPU (and, with
--cpu-smoke, the same structure at tiny sizes on a CPU).

    PYTHONPATH=. python3 experiments/gpu_check.py --out DIR [--cpu-smoke] [--only NAME,...] [--budget-s 480]

Contract: shared/gpu/README.md. It imports nothing beyond the standard library, numpy, jax and flax (through
the package itself), so it runs on the GPU image as it is.

Every section runs in its own subprocess (`python3 gpu_check.py --section NAME ...`) with its own timeout:
a Triton abort or an illegal address poisons the CUDA context and cannot be caught by `try`, so the parent
process never touches the accelerator; it starts one child per section, streams its output, kills its
process group when its timeout passes, records a timeout / crash (exit code, signal, stderr tail) and goes
on with the next section. A child writes DIR/sections/NAME.json as soon as it has something (status
"running" with what it has so far, then the final record); the parent merges every section file into
DIR/gpu_check.json after each section and every few seconds while one runs, so a kill at any moment
leaves everything measured so far. Child logs: DIR/logs/NAME.log (stdout) and NAME.stderr.log.

The plan (`SECTIONS`: name -> soft budget on a GPU, start-up and compiles included; `PLAN`, the sections without
an `only_because`, in table order, sums to at most PLAN_LIMIT_S = 480 s, 8 minutes of a 15-minute lease, most
important first; the parent stops starting sections once --budget-s (default 480) is spent and trims the last
one's timeout to what remains; a section skips a check that would end past its soft budget):

* engine (190 s): the engine's three policies on a GLM-5-shaped model, fp8 KV, 32 x 16,000-token prompts
  (whole-prompt prefill), a device budget of a quarter of their need: tokens/s, inter-token latency, running requests, hit rate, H2D bytes
  per step, the host's share of the step time, identical tokens (`gpu_sections/engine.py`).
* ceilings (20 s): device-to-device copy bandwidth and pinned_host -> device copy bandwidth (device_put,
  inside jit whole / in chunks / page-sized blocks) plus device -> pinned_host; median after warm-up.
* kernel_mla (60 s): the public `sparse_mla_decode` (the library's default variant; its keyword defaults are
  recorded) at H 128 with fp8 then bf16 pools, then the other shapes while the budget lasts.
* fetch (55 s): `kv.resolve.fetch_misses` per mechanism (`config.FETCH_MECHANISMS`) and row format (bf16, fp8) at
  10/20/30 % misses on a store with the real cache geometry, verified byte for byte against the host pool (every
  other device row must keep its NaN poison); the `fetch*` options recorded; HLO facts (DIR/hlo_fetch.txt).
* kernel_indexer (50 s): indexer_topk against its reference and against the host's float64 top-k of the same
  dequantized inputs (a difference counts only beyond TIE_RTOL of the k-th score).
* mosaic_matrix (60 s): the Mosaic GPU decode's bisection matrix (`gpu_sections/mosaic_matrix.py`), each cell
  in a worker process.

Behind --only (each with its reason in the table): compile (every kernel and the tiered decode step once at tiny
shapes), decode (`runner.store_decode_step` on "tiny-glm", all resident vs under pressure), decode_kernels
(`decode_loop` with the references vs the Pallas kernels), kernel_gather, kernel_mla_mosaic, mla_big_pool
(sparse_mla_decode on stacked fp8 pools of > 4 GiB read with `layer=`), mosaic_probes (the Mosaic decode on
inputs that isolate its stages, `MOSAIC_PROBES`). A wrong top-k is explained by the reference's scores
(`mismatch`); a wrong decode by where it is wrong (`error_pattern`).

Every kernel run also carries the traffic model's bytes for its shapes and plan (`pallas_kernels/traffic.py`:
model_bytes, model_ideal_bytes, traffic_model) and, when timed with the ceilings known, the model's time at
the measured device-copy read+write rate (model_s_at_d2d) and model time / measured time (roofline_fraction).

Kernel and decode times are N calls chained inside one jitted `lax.fori_loop` (each call's input depends on
the previous call's output, so nothing is hoisted) divided by N: per-call dispatch (20-60 us) is larger than
a kernel's ideal time. Ceilings and fetches are large enough to be timed per call.

--cpu-smoke runs every section (the plan, then the rest), every check the installed jax can run: before jax 0.11
(no Mosaic GPU Pallas API) each Mosaic GPU kernel check is recorded as passed with `skipped` saying why (and listed in its section's `unavailable`),
the Triton ones run. Its section timeouts are hang guards sized for two idle cores, stretched on a busier machine
by its load average per core (at most SMOKE_TIMEOUT_MAX_SCALE; a section's `timeout_scale`).

Units in the JSON: *_s seconds, *_bytes bytes, *_gb_per_s 1e9 bytes per second, *_mib 2**20 bytes.

This script is the plan (`SECTIONS`) and the process harness (parent and child); the sections and what they share
live in experiments/gpu_sections/ (harness: a section's context and files; sizes; timing; checks: running and
timing kernel checks; one module per section or family of sections; summary: the table). The kernels' inputs
are the tests' (`hisparse_jax.kernel_cases`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import faulthandler
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable

import jax

from experiments.gpu_sections import mosaic_matrix
from experiments.gpu_sections.ceilings import section_ceilings
from experiments.gpu_sections.decode import section_compile, section_decode, section_decode_kernels
from experiments.gpu_sections.engine import section_engine
from experiments.gpu_sections.fetch import section_fetch
from experiments.gpu_sections.harness import Ctx, device_env, parent_env, read_section_files, section_path, write_json
from experiments.gpu_sections.kernel_gather import section_kernel_gather
from experiments.gpu_sections.kernel_indexer import section_kernel_indexer
from experiments.gpu_sections.kernel_mla import (section_kernel_mla, section_kernel_mla_mosaic, section_mla_big_pool,
                                                 section_mosaic_probes)
from experiments.gpu_sections.sizes import SIZES, TINY
from experiments.gpu_sections.summary import summary_table


def section_mosaic_matrix(ctx: Ctx) -> dict:
    """The Mosaic decode's bisection matrix (`gpu_sections.mosaic_matrix`), its cells in worker processes."""
    return mosaic_matrix.section_mosaic_matrix(ctx, os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class Section:
    fn: Callable[[Ctx], dict]
    # on a GPU: the section's soft budget and its timeout (the process, from its start: interpreter, jax import,
    # device init and compiles included), sized from the H200 runs of 2026-12-04
    budget_s: float
    smoke_timeout_s: float  # --cpu-smoke
    # why a section is not in the default plan (None: it is): run it with --only
    only_because: str | None = None


# The default plan runs the sections with only_because None, in this order (most important first: a lease that
# ends early loses the least); its budgets sum to at most PLAN_LIMIT_S, start-up and compiles included (8 minutes
# of a 15-minute lease, at most 10 per command). --cpu-smoke runs every section, the plan first.
SECTIONS: dict[str, Section] = {
    "engine": Section(section_engine, 190, 120),
    "ceilings": Section(section_ceilings, 20, 30),  # the copy rates the next sections' ratios divide by
    "kernel_mla": Section(section_kernel_mla, 60, 45),
    "fetch": Section(section_fetch, 55, 45),
    "kernel_indexer": Section(section_kernel_indexer, 50, 45),
    "mosaic_matrix": Section(section_mosaic_matrix, 60, 60),
    "compile": Section(section_compile, 70, 90, only_because=(
        "every kernel once at tiny shapes before anything big: the plan's sections check their kernels "
        "themselves, each in its own process, and the CPU proves the sm_90 builds")),
    "decode": Section(section_decode, 60, 45, only_because=(
        "the tiny-glm step under pressure vs all resident: the engine section measures the real step")),
    "decode_kernels": Section(section_decode_kernels, 50, 45, only_because=(
        "Pallas vs reference tokens in decode_loop: equal on the H200 twice (2026-12-04 run1 and run2)")),
    "kernel_gather": Section(section_kernel_gather, 25, 30, only_because=(
        "the resolver kernel: correct on the H200 twice, not on the hot path's critical list")),
    "kernel_mla_mosaic": Section(section_kernel_mla_mosaic, 40, 45, only_because=(
        "the Mosaic decode at full size: wrong on the H200; mosaic_matrix bisects it first")),
    "mla_big_pool": Section(section_mla_big_pool, 40, 30, only_because=(
        "stacked pools past 4 GiB read with layer=: correct on the H200 (run2), same kernel as kernel_mla")),
    "mosaic_probes": Section(section_mosaic_probes, 35, 45, only_because=(
        "the Mosaic decode's stage probes: after the matrix names the failing feature")),
}


PLAN = [n for n, s in SECTIONS.items() if s.only_because is None]
PLAN_LIMIT_S = 480.0  # the default plan's budgets, summed, at most this
MIN_SECTION_S = 12.0  # a section is not started with less time than this left in the budget


# --cpu-smoke's timeouts are hang guards for two idle cores; on a busier machine each section's timeout (and so its
# soft budget) is stretched by how many cores' worth of work the machine runs per core (load average / cores) when
# it starts, at most this much. Timeouts given with --timeouts are taken as they are.
SMOKE_TIMEOUT_MAX_SCALE = 3.0


def _contention() -> float:
    """Runnable work per core (1-minute load average / cores), at least 1."""
    try:
        return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except OSError:  # no load average on this platform
        return 1.0


def child_main(args) -> int:
    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
        # on a CPU the run is compile-bound: sections share compiles (the kernel sections run the compile pass's
        # shapes, both decode sections the same prefill) through a persistent cache private to this run
        jax.config.update("jax_compilation_cache_dir", os.path.join(args.out, "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    elif args.section == "engine":  # its programs are the run's largest compiles: a rerun into the same DIR (one
        # lease, after a timeout) reads them back (the parent keeps this cache; it clears only the smoke's)
        jax.config.update("jax_compilation_cache_dir", os.path.join(args.out, "jax_cache_engine"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    name, timeout = args.section, args.timeout_s
    faulthandler.enable()  # a fatal signal (abort, segfault) prints the Python stacks into the stderr log
    # the stacks go to the stderr log a little before the parent kills a hung section
    faulthandler.dump_traceback_later(max(timeout - 4.0, 1.0), exit=False)
    rec: dict = {"status": "running", "pid": os.getpid(), "parent_pid": os.getppid(), "timeout_s": timeout}
    write_json(section_path(args.out, name), rec)
    sizes = "smoke" if args.cpu_smoke or jax.default_backend() == "cpu" else "full"
    # a soft deadline well inside the timeout: a section stops timing and returns what it has
    ctx = Ctx(args, sizes, name, soft_budget_s=max(0.8 * timeout - 3.0, 1.0))
    ctx.record = rec
    rec["soft_budget_s"] = ctx.budget_s
    try:
        rec["env"] = device_env(sizes)
    except Exception:  # noqa: BLE001
        rec["env"] = {"status": "error", "error": traceback.format_exc(limit=4)}
    ctx.write()
    ctx.log(f"jax {jax.__version__} backend {jax.default_backend()} pid {os.getpid()}")
    # tests: GPU_CHECK_FAULT="NAME=abort|hang,..." makes a section die the way a Triton abort / a hang would
    fault = dict(f.split("=", 1) for f in os.environ.get("GPU_CHECK_FAULT", "").split(",") if "=" in f).get(name)
    if fault:
        ctx.partial(injected_fault=fault)
        if fault == "abort":
            os.abort()
        time.sleep(10 * timeout)
    t = time.perf_counter()
    try:
        res = dict(SECTIONS[name].fn(ctx))
        res.setdefault("status", "ok")
    except Exception:  # noqa: BLE001
        res = {"status": "error", "error": traceback.format_exc()}
        ctx.log(f"ERROR\n{res['error']}")
    rec.update(res)
    rec["section_s"] = time.perf_counter() - t
    ctx.write()
    faulthandler.cancel_dump_traceback_later()
    return 0


def _pump(stream, sinks, log, tail, lock):
    for line in iter(stream.readline, ""):
        log.write(line)
        log.flush()
        if tail is not None:
            tail.append(line)
        with lock:
            for s in sinks:
                s.write(line)
                s.flush()
    stream.close()


def run_section(args, name: str, timeout: float, tick: Callable[[float], None]) -> dict:
    """Run one section in a child process (own process group) for at most `timeout` seconds and return its
    record: what the child wrote, plus rc / signal / wall time / stderr tail; "timeout" or "crashed" when the
    child did not finish its record."""
    cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--out", args.out,
           "--timeout-s", f"{timeout:.1f}"] + (["--cpu-smoke"] if args.cpu_smoke else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if name == "engine" and not args.cpu_smoke:  # its 16K-token prompt forward needs 69.4 GiB (`gpu_sections.engine`)
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    if args.cpu_smoke:  # compile-bound on a CPU: LLVM at -O0 compiles faster (the smoke's timings mean nothing)
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    try:
        os.remove(section_path(args.out, name))
    except OSError:
        pass
    print(f"== section {name} (timeout {timeout:.0f} s) ==", flush=True)
    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True, bufsize=1,
                            errors="replace", start_new_session=True)
    tail: collections.deque = collections.deque(maxlen=80)
    lock = threading.Lock()
    logs = [open(os.path.join(args.out, "logs", f"{name}{ext}.log"), "w") for ext in ("", ".stderr")]
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, [sys.stdout], logs[0], None, lock), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, [sys.stderr], logs[1], tail, lock), daemon=True)]
    for th in pumps:
        th.start()
    timed_out = False
    deadline = t0 + timeout
    while True:
        try:
            rc = proc.wait(timeout=max(min(5.0, deadline - time.perf_counter()), 0.05))
            break
        except subprocess.TimeoutExpired:
            if time.perf_counter() >= deadline:
                timed_out = True
                for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 10.0)):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        pass
                    try:
                        proc.wait(timeout=grace)
                        break
                    except subprocess.TimeoutExpired:
                        continue
                rc = proc.poll()
                break
            tick(time.perf_counter() - t0)
    for th in pumps:
        th.join(timeout=5)
    for lg in logs:
        lg.close()
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    rec = read_section_files(args.out).get(name) or {}
    finished = rec.get("status") not in (None, "running")
    if timed_out:
        rec.update(status="timeout", reason=f"killed after {timeout:.0f} s" + (
            " (it had finished its record)" if finished else "; what it recorded so far is kept"))
    elif rc != 0:
        rec.update(status="crashed", reason=f"exit code {rc}" + (f" (signal {-rc})" if rc and rc < 0 else ""))
    elif not finished:
        rec.update(status="crashed", reason="exited 0 without a final record")
    rec.update(child_pid=proc.pid, rc=rc, wall_s=wall, timeout_s=timeout,
               cpu_s=ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime)
    text = "".join(tail)
    rec["stderr_tail"] = text[-4000:] if rec["status"] not in ("ok",) else text[-600:]
    print(f"== section {name}: {rec['status']} in {wall:.1f} s (rc {rc}) ==", flush=True)
    return rec


def parent_main(args, only: list[str]) -> int:
    t0 = time.perf_counter()
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    os.makedirs(os.path.join(args.out, "sections"), exist_ok=True)
    shutil.rmtree(os.path.join(args.out, "jax_cache"), ignore_errors=True)  # --cpu-smoke's compile cache
    for name in SECTIONS:  # stale results of an earlier run in the same DIR are not this run's
        for path in (section_path(args.out, name), os.path.join(args.out, f"hlo_{name}.txt")):
            if os.path.exists(path):
                os.remove(path)
    # --only: those sections in table order; else the plan (--cpu-smoke: every section, the plan first)
    plan = [n for n in SECTIONS if n in only] if only else PLAN + (
        [n for n in SECTIONS if n not in PLAN] if args.cpu_smoke else [])
    timeouts = {n: SECTIONS[n].smoke_timeout_s if args.cpu_smoke else SECTIONS[n].budget_s for n in plan}
    overridden = {n: float(v) for n, v in (t.split("=", 1) for t in args.timeouts.split(",") if t) if n in timeouts}
    timeouts.update(overridden)
    report = {"tool": "experiments/gpu_check.py", "argv": sys.argv[1:], "budget_s": args.budget_s,
              "parent_pid": os.getpid(), "mode": "cpu-smoke" if args.cpu_smoke else "full",
              "plan": [{"section": n, "timeout_s": timeouts[n]} for n in plan],
              "default_plan": {"sections": PLAN, "budget_s": {n: SECTIONS[n].budget_s for n in PLAN},
                               "sum_s": sum(SECTIONS[n].budget_s for n in PLAN), "limit_s": PLAN_LIMIT_S},
              "only_sections": {n: s.only_because for n, s in SECTIONS.items() if s.only_because},
              "units": {"*_s": "seconds", "*_bytes": "bytes", "*_gb_per_s": "1e9 bytes / s", "*_mib": "2**20 bytes",
                        "miss_fraction": "fraction of the B x K top-k rows fetched from host"},
              "environment": parent_env(), "sections": {}}
    report["sizes"] = {"tiny_compile": TINY}
    path = os.path.join(args.out, "gpu_check.json")

    def write(running: str | None = None, running_s: float = 0.0):
        if running:  # what the running section has written so far
            part = read_section_files(args.out).get(running)
            if part:
                report["sections"][running] = dict(part, wall_s=running_s, timeout_s=timeouts[running])
        report["elapsed_s"] = time.perf_counter() - t0
        write_json(path, report)

    write()
    print(f"gpu_check: {len(plan)} sections, each in its own process; budget {args.budget_s:.0f} s; "
          f"JSON in {path}", flush=True)
    for name in plan:
        remaining = args.budget_s - (time.perf_counter() - t0)
        if remaining < min(MIN_SECTION_S, timeouts[name]):
            report["sections"][name] = {"status": "skipped", "reason": f"budget {args.budget_s:.0f} s spent",
                                        "timeout_s": timeouts[name]}
            write()
            continue
        scale = min(_contention(), SMOKE_TIMEOUT_MAX_SCALE) if args.cpu_smoke and name not in overridden else 1.0
        rec = run_section(args, name, min(timeouts[name] * scale, remaining), lambda s, name=name: write(name, s))
        if scale > 1.0:
            rec["timeout_scale"] = scale  # the machine was busy: the smoke timeout stretched by this much
        report["sections"][name] = rec
        child_env = rec.get("env")
        if isinstance(child_env, dict) and "backend" in child_env and "backend" not in report["environment"]:
            report["environment"].update(child_env)
            report["sizes"][child_env.get("sizes", "?")] = SIZES.get(child_env.get("sizes"), {})
        write()
    report["ok"] = all(s.get("status") == "ok" for s in report["sections"].values()) and bool(plan)
    report["cpu_s"] = sum(s.get("cpu_s", 0.0) for s in report["sections"].values())
    write()
    print(summary_table(report), flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for gpu_check.json, sections/, logs/ and hlo_*.txt")
    p.add_argument("--cpu-smoke", action="store_true", help="run on the CPU with tiny sizes (< 60 s)")
    p.add_argument("--only", default="", help=f"comma-separated sections out of {','.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=PLAN_LIMIT_S,
                   help="no section starts after this much time; the last one's timeout is trimmed to what is left")
    p.add_argument("--section", default="", help=argparse.SUPPRESS)  # internal: run one section (child)
    p.add_argument("--timeout-s", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--timeouts", default="", help="override section timeouts: NAME=SECONDS,... (tests)")
    p.add_argument("--matrix-cells", default="", help=argparse.SUPPRESS)  # internal: a mosaic_matrix worker
    p.add_argument("--matrix-out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.matrix_cells:
        if args.cpu_smoke:
            jax.config.update("jax_platforms", "cpu")
        interpret = jax.default_backend() != "gpu"
        return mosaic_matrix.worker([int(i) for i in args.matrix_cells.split(",")], args.matrix_out,
                                    mosaic_matrix.SHAPES["smoke" if interpret else "full"], interpret)
    if args.section:
        if args.section not in SECTIONS:
            p.error(f"unknown section {args.section!r}")
        return child_main(args)
    if args.cpu_smoke:  # the sections' children inherit it: Mosaic GPU's interpreter needs a large XLA:CPU pool
        from hisparse_jax.cpu_pool import request_interpret_threads

        request_interpret_threads()
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
    return parent_main(args, only)


if __name__ == "__main__":
    sys.exit(main())
