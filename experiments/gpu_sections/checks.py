"""How gpu_check runs a section's kernel checks: one after another, each record written as soon as it exists
(correctness before timing), a failure recorded and the next check run (`run_variants`); a kernel timed against
its reference (`time_pair`) and against the traffic model (`traffic_fields`); a wrong decode located
(`error_pattern`); one table line per check (`kernel_line`)."""

from __future__ import annotations

import time
import traceback
from typing import Callable

import jax
import numpy as np

from experiments.gpu_sections.harness import Ctx
from experiments.gpu_sections.timing import GB, MIB, bw, d2d_ceiling, loop_time


def time_pair(ctx, kernel_call, ref_call, v0, const, step, nbytes=None) -> dict:
    """Kernel and reference time per call, each from `loop_time` (N chained calls in one jitted loop / N)."""
    sz = ctx.sz
    if not sz["kernels_time"]:
        return {"timed": False}
    tk = loop_time(kernel_call, v0, const, step, sz["loop_n"], sz["loop_reps"])
    tr = loop_time(ref_call, v0, const, step, sz["loop_n"], sz["loop_reps"])
    rec = {"timed": True, "timed_as": f"{sz['loop_n']} chained calls in one jitted fori_loop / {sz['loop_n']}",
           "kernel_time": tk, "reference_time": tr, "kernel_s": tk["per_call_s"],
           "reference_s": tr["per_call_s"], "speedup_vs_reference": tr["per_call_s"] / tk["per_call_s"]}
    if nbytes:
        ceil = d2d_ceiling(ctx)
        rec.update(bytes_read=nbytes, kernel_gb_per_s=bw(nbytes, tk["per_call_s"]),
                   reference_gb_per_s=bw(nbytes, tr["per_call_s"]))
        if ceil:
            rec["kernel_vs_d2d_copy"] = rec["kernel_gb_per_s"] / ceil["copy_gb_per_s"]
            rec["kernel_vs_d2d_rw"] = rec["kernel_gb_per_s"] / ceil["rw_gb_per_s"]
    return rec


def traffic_fields(ctx: Ctx, rec: dict, model: Callable[[], object]) -> dict:
    """The traffic model's bytes for a kernel run (`pallas_kernels/traffic.py`: bytes the kernel reads and
    writes from its grid, blocks and passes, and the ideal) and, when the run was timed and the ceilings are
    known, the model's time at the measured device-copy traffic rate and model time / measured time (the
    roofline fraction). `model()` returns a `traffic.Traffic`; a failure is recorded, never raised."""
    try:
        t = model()
    except Exception:  # noqa: BLE001
        return {"traffic_model_error": traceback.format_exc(limit=4)}
    out = {"traffic_model": t.to_json(), "model_read_bytes": t.read_bytes, "model_write_bytes": t.write_bytes,
           "model_bytes": t.total_bytes, "model_ideal_bytes": t.ideal_bytes, "model_vs_ideal": t.ratio}
    ceil = d2d_ceiling(ctx)
    if rec.get("timed") and ceil and rec.get("kernel_s"):
        rate = ceil["rw_gb_per_s"] * GB
        out.update(model_s_at_d2d=t.total_bytes / rate, ideal_s_at_d2d=t.ideal_bytes / rate,
                   roofline_fraction=t.total_bytes / rate / rec["kernel_s"],
                   ideal_roofline_fraction=t.ideal_bytes / rate / rec["kernel_s"])
    return out


def error_pattern(got: np.ndarray, want: np.ndarray) -> dict:
    """Where a wrong decode output [B, H, C] is wrong: the relative error per 128-column chunk (the Mosaic kernel's
    warpgroups own halves of C), per group of 16 heads and per sequence, and how the rows compare (norms, cosine):
    a scale error, a permutation and noise look different here."""
    a, b = got.astype(np.float64), want.astype(np.float64)
    B, H, C = a.shape
    scale = max(float(np.nanmax(np.abs(b))), 1e-30)
    err = np.abs(np.nan_to_num(a - b, nan=np.inf)) / scale
    chunks = [float(err[..., c:c + 128].max()) for c in range(0, C, 128)]
    heads = [float(err[:, h:h + 16].max()) for h in range(0, H, 16)]
    cos = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
    return {"rel_err_by_128_columns": chunks, "rel_err_by_16_heads": heads,
            "rel_err_by_sequence": [float(err[i].max()) for i in range(B)],
            "nan_outputs": int(np.isnan(a).sum()), "zero_rows": int((np.abs(a).max(-1) == 0).sum()),
            "norm_ratio_median": float(np.median(np.linalg.norm(a, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1),
                                                                                         1e-30))),
            "cosine_median": float(np.nanmedian(cos)), "cosine_min": float(np.nanmin(cos))}


def kernel_line(r: dict) -> str:
    """One table line of a kernels run (after the name)."""
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    c = r.get("correct", {})
    if r["kernel"] == "sparse_mla_decode":
        rel = c.get("max_rel_err")
        acc = f"rel {rel if rel is not None else float('nan'):.1e}"
    elif r["kernel"] == "indexer_topk":
        acc = f"diff {c.get('slots_differing')}"
    else:
        acc = f"hit {r['counts']['hits']} miss {r['counts']['misses']}"
    if not r.get("timed"):
        return acc
    s = f"{acc:16s} kernel {r['kernel_s'] * 1e3:8.3f} ms  ref {r['reference_s'] * 1e3:8.3f} ms  x{r['speedup_vs_reference']:.2f}"
    if r.get("kernel_gb_per_s") is not None:
        s += f"  {r['kernel_gb_per_s']:8.1f} GB/s"
        if r.get("kernel_vs_d2d_rw") is not None:
            s += f" ({100 * r['kernel_vs_d2d_rw']:.1f}% d2d)"
    if r.get("kernel_vs_keys_read_once") is not None:
        s += f"  x{r['kernel_vs_keys_read_once']:.1f} of keys-read-once"
    if r.get("roofline_fraction") is not None:
        s += f"  model {r['model_bytes'] / MIB:.1f} MiB: {r['model_s_at_d2d'] * 1e3:.3f} ms, roofline " \
             f"{100 * r['roofline_fraction']:.0f}%"
    return s


def pallas_kind() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"


def run_variants(ctx, plan) -> dict:
    """Run (name, fn(ctx) -> record) checks one after another; every record is written as soon as it exists
    (its correctness before its timing), an exception is recorded and the next check runs."""
    runs, errors, failed = [], [], []
    longest = 0.0  # the longest check so far: one that would end past the soft deadline is not started (a
    # timeout kills a compile mid-way and loses its record; the H200 lost kernel_mla's third variant so)
    for name, fn in plan:
        if ctx.over_budget() or (not ctx.interpret and ctx.elapsed() + longest > ctx.budget_s):
            runs.append({"name": name, "status": "skipped", "reason": "section soft deadline" + (
                f" (the longest check so far took {longest:.1f} s)" if longest else "")})
            ctx.log(f"{name}: skipped (deadline)")
            ctx.partial(runs=runs)
            continue
        t = time.perf_counter()
        cur = {"name": name, "status": "running"}
        limit = ctx.sz.get("timed_variants")
        vctx = ctx if limit is None or len(runs) < limit or not ctx.sz["kernels_time"] else ctx.with_sizes(
            kernels_time=False)
        runs.append(cur)
        ctx.partial(runs=runs)
        vctx.checkpoint = lambda rec, cur=cur: (cur.update(rec), ctx.partial(runs=runs))
        try:
            rec = fn(vctx)
            cur.update(rec)
            cur["status"] = "ok"
        except Exception:  # noqa: BLE001
            cur.update(status="error", error=traceback.format_exc(limit=12))
            errors.append(name)
            ctx.log(f"{name}: ERROR\n{cur['error']}")
        cur["variant_s"] = time.perf_counter() - t
        longest = max(longest, cur["variant_s"])
        if cur["status"] == "ok":
            if not cur.get("passed"):
                failed.append(name)
            ctx.log(f"{name}: correct={cur.get('passed')} {kernel_line(cur) if 'kernel' in cur else ''}")
        ctx.partial(runs=runs)
    ok_runs = [r for r in runs if r["status"] == "ok"]
    out = {"interpret": ctx.interpret, "d2d_ceiling": d2d_ceiling(ctx), "runs": runs,
           "all_correct": bool(ok_runs) and not failed and not errors,
           "skipped": [r["name"] for r in runs if r["status"] == "skipped"],
           # checks this jax cannot run (the Mosaic GPU kernels before jax 0.11): name -> why
           "unavailable": {r["name"]: r["skipped"] for r in runs if r["status"] == "ok" and r.get("skipped")}}
    if errors or failed:
        out.update(status="error", error=f"errors: {', '.join(errors) or '-'}; incorrect: {', '.join(failed) or '-'}")
    return out


KERNEL_CONVENTION = ("kernel_s / reference_s: time per call from N chained calls in one jitted fori_loop / N; "
                     "kernel_gb_per_s = bytes the kernel must read / time per call; kernel_vs_d2d_rw compares it with "
                     "the d2d copy's read+write traffic rate (kernel_vs_d2d_copy: with bytes copied / s); indexer: "
                     "kernel time / time to read the keys once at the d2d traffic rate; model_bytes = the "
                     "traffic model's bytes read + written per call (pallas_kernels/traffic.py), model_s_at_d2d = "
                     "model_bytes / the d2d read+write rate, roofline_fraction = model_s_at_d2d / kernel_s "
                     "(ideal_*: the model's ideal bytes, each input read once)")
