"""gpu_check's `mosaic_matrix` section: the Mosaic GPU sparse MLA decode over a bisection matrix.

On the H200 (2026-12-04) the Mosaic decode gave wrong outputs at every shape it ran (relative error ~1) and an
illegal instruction with an fp8 pool at 16 heads, while interpret mode matched. Each cell of `CELLS` changes one
feature the kernel has an option or a shape for, so one run says which feature fails:

* one CUDA block per 64 heads vs a cluster of 2 (`cluster=1` / `cluster=2`, H 128: the cluster's blocks share
  each latent row's copy by multicast; with `cluster=1` nothing is multicast);
* bf16 vs fp8 pools (the fp8 path converts rows in shared memory, with their scale rows);
* 16 heads (padded to one block of 64) vs 64 vs 128;
* one split of the top-k (`splits=1`) vs the default split-K.

Not separable with the kernel's options (a kernel option is needed): a cluster of 2 *without* multicast (the
kernel multicasts the latent row whenever cluster=2, `kernel_mosaic.MULTICAST`).

A fault (illegal instruction / address) poisons the process's CUDA context, so the cells run in worker processes
(`python3 gpu_check.py --matrix-cells I,J,... --matrix-out FILE`, XLA_PYTHON_CLIENT_PREALLOCATE=false: the
section's own process holds the preallocated memory); a worker stops at the first cell that raises and the next
worker starts at the cell after it. Every cell's record lands in FILE (JSON lines) as soon as it exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

import numpy as np

from experiments.gpu_sections.checks import error_pattern
from experiments.gpu_sections.kernel_mla import section_case

# (heads, pool, cluster, splits): splits None is the kernel's default. bf16 before fp8, and run2's illegal
# instruction (fp8, 16 heads) last but one: a fault costs only a new worker, but the cheap cells come first
CELLS = (
    (64, "bf16", 1, 1),
    (64, "bf16", 1, None),
    (16, "bf16", 1, None),
    (128, "bf16", 1, None),
    (128, "bf16", 2, None),
    (64, "fp8", 1, None),
    (128, "fp8", 1, None),
    (128, "fp8", 2, None),
    (16, "fp8", 1, None),
)
AXES = {"cluster": 2, "pool": 1, "heads": 0, "splits": 3}  # axis -> index in a cell
# cells: which of CELLS run (None: all); interpreted, each is seconds: a bf16 and an fp8 one prove the section
SHAPES = {"full": dict(B=4, C=512, R=64, K=512, cells=None), "smoke": dict(B=2, C=256, R=64, K=32, cells=(0, 5))}
REL_TOL = 2e-2  # bf16 operands


def cell_name(cell) -> str:
    H, pool, cluster, splits = cell
    return f"H{H} {pool} cluster={cluster} splits={'default' if splits is None else splits}"


def run_cell(cell, shapes: dict, interpret: bool, seed: int) -> dict:
    """One cell: the Mosaic decode with these options against the reference on the decode sections' case
    (`kernel_mla.section_case`: NaN-poisoned unused rows, ~1/32 invalid slots)."""
    from functools import partial

    import jax
    import jax.numpy as jnp

    from pallas_kernels.backends import mosaic_unavailable_reason
    from pallas_kernels.sparse_mla_decode import sparse_mla_decode_reference

    H, pool, cluster, splits = cell
    rec = {"name": cell_name(cell), "kernel": "sparse_mla_decode", "backend": "mosaic", "H": H, "pool": pool,
           "cluster": cluster, "splits": splits, "variant": cell_name(cell)}
    if (why := mosaic_unavailable_reason()) is not None:
        return dict(rec, passed=True, skipped=why)
    from pallas_kernels.sparse_mla_decode.kernel_mosaic import decode_grid, sparse_mla_decode_mosaic

    B, C, R, K = (shapes[k] for k in ("B", "C", "R", "K"))
    args, kw, n_valid, _, _ = section_case(seed, B, H, C, R, K, pool, jnp.bfloat16)
    tau = float(1 / np.sqrt(192))
    hp, nsplit, steps = decode_grid(B, H, K, splits)
    rec.update(B=B, C=C, R=R, K=K, padded_heads=hp, grid_splits=nsplit, steps_per_split=steps, valid_rows=n_valid,
               interpret=interpret)
    kern = jax.jit(partial(sparse_mla_decode_mosaic, tau=tau, interpret=interpret, splits=splits, cluster=cluster))
    want = np.asarray(jax.jit(partial(sparse_mla_decode_reference, tau=tau))(*args, **kw))
    got = np.asarray(kern(*args, **kw))
    finite = bool(np.all(np.isfinite(got)))
    rel = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30)) if finite else None
    rec.update(correct={"finite": finite, "max_rel_err": rel, "rel_tol": REL_TOL},
               passed=finite and rel is not None and rel <= REL_TOL)
    if not rec["passed"]:
        rec["error_pattern"] = error_pattern(got, want)
    return rec


def worker(indices: list[int], out_path: str, shapes: dict, interpret: bool) -> int:
    """Run CELLS[i] for i in indices, appending each record to out_path; stop after the first that raises (its
    CUDA context may be poisoned)."""
    for i in indices:
        t = time.perf_counter()
        try:
            rec = run_cell(CELLS[i], shapes, interpret, 500 + i)
            rec["status"] = "ok"
        except Exception:  # noqa: BLE001
            rec = {"name": cell_name(CELLS[i]), "status": "error", "error": traceback.format_exc(limit=6),
                   "H": CELLS[i][0], "pool": CELLS[i][1], "cluster": CELLS[i][2], "splits": CELLS[i][3]}
        rec.update(cell=i, pid=os.getpid(), cell_s=time.perf_counter() - t)
        with open(out_path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        print(f"[mosaic_matrix worker] {rec['name']}: {rec['status']} passed={rec.get('passed')}", flush=True)
        if rec["status"] == "error":
            sys.stdout.flush()
            os._exit(0)  # a poisoned context can hang in its destructors
    return 0


def verdict(runs: list[dict]) -> dict:
    """Per axis value: cells run / correct (a cell that raised counts as not correct); the features whose every
    cell failed while another value of the same axis has a correct cell."""
    done = [r for r in runs if r.get("status") in ("ok", "error", "crashed") and not r.get("skipped")]
    table = {}
    for axis, k in AXES.items():
        vals = {}
        for r in done:
            v = str(CELLS[r["cell"]][k])
            ok, n = vals.get(v, (0, 0))
            vals[v] = (ok + bool(r.get("passed")), n + 1)
        table[axis] = {v: {"correct": ok, "cells": n} for v, (ok, n) in vals.items()}
    failing = [f"{axis}={v}" for axis, vals in table.items() for v, c in vals.items()
               if c["correct"] == 0 and any(o["correct"] for o in vals.values())]
    return {"by_axis": table, "all_cells_wrong": bool(done) and not any(r.get("passed") for r in done),
            "features_failing_everywhere": failing}


def section_mosaic_matrix(ctx, script: str) -> dict:
    """The section (in gpu_check's child process): workers over the cells until every cell has a record or the
    section's soft budget is spent."""
    shapes = SHAPES["smoke" if ctx.interpret else "full"]
    chosen = list(range(len(CELLS))) if shapes["cells"] is None else list(shapes["cells"])
    out_path = os.path.join(ctx.out_dir, "mosaic_matrix.jsonl")
    if os.path.exists(out_path):
        os.remove(out_path)
    out = {"axes": {a: sorted({str(CELLS[i][k]) for i in chosen}) for a, k in AXES.items()},
           "cells": [cell_name(CELLS[i]) for i in chosen], "shapes": shapes,
           "not_separable": "a cluster of 2 without multicast: the kernel has no option for it "
                            "(kernel_mosaic.MULTICAST is fixed)", "workers": []}
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    runs: list[dict] = []
    crashed: list[dict] = []  # cells whose worker died before recording them
    nxt = 0  # the position in `chosen` of the next cell to run
    while nxt < len(chosen):
        left = ctx.budget_s - ctx.elapsed()
        if left < 5:
            break
        cmd = [sys.executable, script, "--out", ctx.out_dir, "--matrix-cells", ",".join(map(str, chosen[nxt:])),
               "--matrix-out", out_path] + (["--cpu-smoke"] if ctx.args.cpu_smoke else [])
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left, errors="replace")
            rc, tail = p.returncode, (p.stdout + p.stderr)[-1500:]
        except subprocess.TimeoutExpired as e:
            rc, tail = "timeout", str(e)[-500:]
        runs = sorted(read_records(out_path) + crashed, key=lambda r: r["cell"])
        out["workers"].append({"first_cell": nxt, "rc": rc, "wall_s": time.perf_counter() - t,
                               "tail": tail if rc != 0 else tail[-300:]})
        done = {chosen.index(r["cell"]) for r in runs}
        if not done or max(done) < nxt:  # the worker recorded nothing: it died before its first cell finished
            i = chosen[nxt]
            crashed.append({"name": cell_name(CELLS[i]), "cell": i, "status": "crashed", "rc": rc, "tail": tail})
            runs.append(crashed[-1])
            done.add(nxt)
        nxt = max(done) + 1
        ctx.partial(runs=runs, **out)
        if rc == "timeout":
            break
    for i in chosen[nxt:]:
        runs.append({"name": cell_name(CELLS[i]), "cell": i, "status": "skipped", "reason": "section soft deadline"})
    out.update(runs=runs, verdict=verdict(runs),
               unavailable={r["name"]: r["skipped"] for r in runs if r.get("skipped")})
    bad = [r["name"] for r in runs if r["status"] != "skipped" and not r.get("passed")]
    if bad:
        out.update(status="error", error=f"wrong or failed: {', '.join(bad)}")
    return out


def read_records(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []
