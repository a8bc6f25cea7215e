"""gpu_check's `kernel_indexer` section: indexer_topk against its reference and against the host's float64 top-k of
the same dequantized inputs (a difference counts only beyond TIE_RTOL of the k-th score); a wrong top-k explained
by the reference's scores (`indexer_mismatch`)."""

from __future__ import annotations

import jax
import numpy as np

from experiments.gpu_sections.checks import KERNEL_CONVENTION, run_variants, time_pair, traffic_fields
from experiments.gpu_sections.harness import Ctx
from experiments.gpu_sections.timing import GB, block, bw, d2d_ceiling, nudge
from hisparse_jax.kernel_cases import indexer_case


def section_case(seed: int, B: int, I: int, D: int, S: int, kd: str):
    """The section's case (`kernel_cases.indexer_case`, integer-valued: order compared slot by slot): B sequences
    of S, S - 1, S - 65 and S / 2 + 3 keys in turn, key format `kd` (bf16 keys with bf16 queries, fp8 or int4 with
    float32 ones), a pool 16 pages larger than they need. Returns (args, kwargs, seq_lens, key_bytes: the live keys'
    bytes with their scales)."""
    from pallas_kernels.traffic import index_key_bytes

    lens = [S, S - 1, max(S - 65, 1), S // 2 + 3]
    seq_lens = np.array([lens[b % 4] for b in range(B)], np.int32)
    mp = S // 64
    case = indexer_case(seed, seq_lens, "bf16q" if kd == "bf16" else kd, heads=I, dim=D, pages_per_seq=mp,
                        pool=B * mp + 16)
    kw = {} if case.k_scale is None else {"k_scale": case.k_scale}
    return block(case.args), block(kw), seq_lens, int(seq_lens.sum()) * index_key_bytes(kd, D)


def kernel_indexer(ctx, S: int, kd: str, seed: int, backend: str = "triton") -> dict:
    """One indexer_topk variant against its reference. backend "mosaic": the Mosaic GPU scores and XLA's top-k
    (jax >= 0.11)."""
    from functools import partial

    from pallas_kernels.indexer_topk import indexer_topk, indexer_topk_reference

    if backend == "mosaic":
        from pallas_kernels.backends import mosaic_unavailable_reason

        if (why := mosaic_unavailable_reason()) is not None:
            return {"kernel": "indexer_topk", "backend": backend, "variant": kd, "context": S, "passed": True,
                    "skipped": why}
    sz = ctx.sz
    B, I, D, topk = sz["idx_B"], sz["idx_heads"], sz["idx_dim"], sz["idx_topk"]
    args, kw, seq_lens, key_bytes = section_case(seed, B, I, D, S, kd)
    kern = jax.jit(partial(indexer_topk, topk=topk, interpret=ctx.interpret, backend=backend))
    ref = jax.jit(partial(indexer_topk_reference, topk=topk))
    got, want = np.asarray(kern(*args, **kw)), np.asarray(ref(*args, **kw))
    well_formed = True
    for row, n in zip(got, seq_lens):
        m = min(int(n), topk)
        well_formed &= bool((row[m:] == -1).all() and ((row[:m] >= 0) & (row[:m] < n)).all()
                            and len(set(row[:m].tolist())) == m)
    sets_equal = all(set(a.tolist()) == set(b.tolist()) for a, b in zip(got, want))
    order_equal = bool(np.array_equal(got, want))
    rec = {"kernel": "indexer_topk", "backend": backend, "variant": kd, "q_dtype": str(args[0].dtype),
           "key_dtype": str(args[2].dtype),
           "B": B, "heads": I, "dim": D, "context": S, "pages": S // 64, "topk": topk,
           "seq_lens": seq_lens.tolist(), "interpret": ctx.interpret,
           "correct": {"sets_equal": sets_equal, "order_equal": order_equal, "well_formed": well_formed,
                       "slots_differing": int((got != want).sum())},
           "passed": sets_equal and order_equal and well_formed}
    host = rec["correct"]["host_f64"] = host_topk_check(args, kw, seq_lens, got, kd)
    if not rec["passed"]:
        rec["mismatch"] = indexer_mismatch(args, kw, seq_lens, got, want)
        # the reference's own order is f32: a kernel that differs from it only at near ties of the float64 scores
        # is correct (the H200's fp8 top-k); the record keeps both verdicts
        rec["passed"] = bool(well_formed and host["checked"] and host["mismatches_beyond_tie_tol"] == 0)
        rec["passed_by"] = "host float64 top-k within the tie tolerance" if rec["passed"] else None
    ctx.checkpoint(rec)
    call = lambda f: lambda v, c: f(v, *c[0], **c[1])  # noqa: E731  (v: q, nudged per call)
    rec.update(time_pair(ctx, call(kern), call(ref), args[0], (args[1:], kw), nudge))
    ceil = d2d_ceiling(ctx)
    rec["key_bytes"] = key_bytes
    if rec.get("timed"):  # the next run's goal: >= 2 TB/s of keys read
        rec["keys_gb_per_s"] = bw(key_bytes, rec["kernel_s"])
    if rec.get("timed") and ceil:
        t_read = key_bytes / (ceil["rw_gb_per_s"] * GB)
        rec["keys_read_once_s_at_d2d"] = t_read
        rec["kernel_vs_keys_read_once"] = rec["kernel_s"] / t_read
        rec["reference_vs_keys_read_once"] = rec["reference_s"] / t_read
    from pallas_kernels import traffic

    model = traffic.indexer_topk_mosaic_traffic if backend == "mosaic" else traffic.indexer_topk_traffic
    rec.update(traffic_fields(ctx, rec, lambda: model(
        B, I, D, S, topk, key_dtype=kd, query_dtype=str(args[0].dtype), seq_lens=seq_lens.tolist())))
    return rec


# A kernel's pick that the host's float64 top-k does not hold (or the reverse) is a near tie, not an error, when its
# float64 score is within this relative distance of the k-th best float64 score: float32 sums of 128-term dots and
# of the heads' weighted ReLUs round to ~1e-6 of the score, and the fp8 indexer's k-th score on 128K positions
# has hundreds of neighbours closer than 1e-3 (the H200's 10-14 % of slots off)
TIE_RTOL = 1e-3


def host_scores_f64(args, kw, kd: str) -> np.ndarray | None:
    """Indexer scores [B, S] in float64 on the host from the same dequantized inputs the kernel reads: keys
    (bf16, or e4m3 x their fp32 scale) and the query as the scoring quantizes it (fp8: Hadamard-rotated e4m3 x its
    per-head scale, `index_scores_fp8`'s own quantization run on the CPU). None for int4 (not modelled here)."""
    from pallas_kernels.common import FP8_BLOCK, fp8_quantize, hadamard

    q, w, k_pages, bt, _ = (np.asarray(a) for a in args)
    if kd == "int4":
        return None
    w = w.astype(np.float64)
    if kd == "fp8":
        cpu = jax.devices("cpu")[0]
        qq, qs = jax.jit(lambda x: fp8_quantize(hadamard(x), block=max(x.shape[-1], FP8_BLOCK)), device=cpu)(
            jax.device_put(q.astype(np.float32), cpu))
        qd, w = np.asarray(qq).astype(np.float64), w * np.asarray(qs, np.float64)
        ks = np.asarray(kw["k_scale"]).astype(np.float64)
    else:
        qd, ks = q.astype(np.float64), None
    page = k_pages.shape[1]
    B, MP = bt.shape
    out = np.empty((B, MP * page))
    for b in range(B):
        pg = np.maximum(bt[b], 0)
        keys = k_pages[pg].reshape(MP * page, -1).astype(np.float64)  # [S, D]
        s = np.maximum(qd[b] @ keys.T, 0.0)  # [I, S]
        out[b] = w[b] @ s
        if ks is not None:
            out[b] *= ks[pg].reshape(-1)
    return out


def host_topk_check(args, kw, seq_lens, got, kd: str) -> dict:
    """The kernel's top-k sets against the host's float64 top-k of the same inputs (`host_scores_f64`), counting
    only mismatches beyond a near tie: a pick the host's top-k lacks whose float64 score is below kth - tol, or a
    host pick the kernel lacks above kth + tol (tol = TIE_RTOL x |kth|)."""
    scores = host_scores_f64(args, kw, kd)
    if scores is None:
        return {"checked": False, "why": f"no float64 host model of {kd} scores here"}
    rows, beyond_total = [], 0
    for b, n in enumerate(seq_lens):
        n = int(n)
        m = min(n, got.shape[1])
        sc = scores[b, :n]
        order = np.lexsort((np.arange(n), -sc))[:m]  # descending, the lower position first in a tie
        kth = float(sc[order[-1]]) if m else 0.0
        tol = TIE_RTOL * abs(kth)
        g = {int(p) for p in got[b, :m] if 0 <= p < n}
        host = set(order.tolist())
        extra, missing = sorted(g - host), sorted(host - g)
        far_extra = [p for p in extra if sc[p] < kth - tol]
        far_missing = [p for p in missing if sc[p] > kth + tol]
        beyond = len(far_extra) + len(far_missing)
        beyond_total += beyond
        rel = [abs(sc[p] - kth) / max(abs(kth), 1e-30) for p in far_extra + far_missing]
        rows.append({"kernel_not_host": len(extra), "host_not_kernel": len(missing), "within_tie_tol": len(extra)
                     + len(missing) - beyond, "beyond_tie_tol": beyond, "kth_f64": kth,
                     "max_rel_distance_beyond": max(rel) if rel else 0.0,
                     "host_positions_within_tol_of_kth": int(np.sum(np.abs(sc - kth) <= tol))})
    return {"checked": True, "tie_rtol": TIE_RTOL, "rows": rows, "mismatches_beyond_tie_tol": beyond_total,
            "rule": "kernel picks vs the host's float64 top-k of the same dequantized inputs; a difference counts "
                    "only beyond tie_rtol x |k-th score| of the k-th score"}


def indexer_mismatch(args, kw, seq_lens, got, want) -> dict:
    """What a top-k mismatch is, by the reference's own scores (`paged_index_scores`, on this device): a
    tie-break difference (the kernel's picks have the scores of the reference's picks, slot by slot) or different
    positions (some pick scores below the reference's k-th: the kernel's scores are not the reference's)."""
    from pallas_kernels.indexer_topk.reference import paged_index_scores

    q, w, k_pages, bt, _ = args
    scores = np.asarray(jax.jit(paged_index_scores)(q, w, k_pages, bt, **kw))
    # the same reference on the host CPU: a GPU-only difference of the reference itself (its rotation, scales or
    # sums) shows as gpu_vs_cpu_reference; the kernel's picks are judged by both
    cpu = jax.devices("cpu")[0]
    on_cpu = jax.device_put((q, w, k_pages, bt, kw), cpu)
    cpu_scores = np.asarray(jax.jit(paged_index_scores)(*on_cpu[:4], **on_cpu[4]))
    out = {"rows": [], "gpu_vs_cpu_reference_max_abs": float(np.nanmax(np.abs(
        np.where(np.isfinite(scores) & np.isfinite(cpu_scores), scores - cpu_scores, 0.0))))}
    for b, n in enumerate(seq_lens):
        m = min(int(n), got.shape[1])
        g, r = got[b, :m], want[b, :m]
        sg, sr = scores[b, g], scores[b, r]
        kth = float(sr.min()) if m else None
        live = np.arange(scores.shape[1]) < n
        cpu_kth = float(np.sort(np.where(live, cpu_scores[b], -np.inf))[::-1][m - 1]) if m else None
        out["rows"].append({
            "slots_differing": int((g != r).sum()),
            "picks_below_cpu_reference_kth": int((cpu_scores[b, g] < cpu_kth).sum()) if m else 0,
            "reference_picks_below_cpu_reference_kth": int((cpu_scores[b, r] < cpu_kth).sum()) if m else 0,
            "max_score": float(np.max(np.abs(sr))) if m else 0.0,
            "same_scores_slot_by_slot": bool(np.array_equal(sg, sr)),
            "picks_below_reference_kth": int((sg < kth).sum()) if m else 0,
            "picks_tied_at_kth": int((sg == kth).sum()) if m else 0,
            "reference_sorted": bool(np.all(np.diff(sr) <= 0)),
            "max_score_gap": float(np.max(np.abs(sg - sr))) if m else 0.0})
    out["tie_break_only"] = all(r["same_scores_slot_by_slot"] for r in out["rows"])
    return out


def section_kernel_indexer(ctx: Ctx) -> dict:
    sz = ctx.sz
    plan = [(f"indexer_topk {kd} ctx={S}" + (f" {be[0]}" if be else ""),
             lambda c, S=S, kd=kd, s=10 * i + j, be=be: kernel_indexer(c, S, kd, s, *be))
            for i, S in enumerate(sz["idx_contexts"]) for j, kd in enumerate(sz["idx_dtypes"])
            for be in ((), ("mosaic",)) if not be or S in sz["idx_mosaic_contexts"]]
    return dict(run_variants(ctx, plan), convention=KERNEL_CONVENTION)
