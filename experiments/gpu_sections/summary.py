"""gpu_check's summary table: one line per engine policy, kernel check, ceiling, fetch run and section of a
report, printed at the end of a run."""

from __future__ import annotations

import re

from experiments.gpu_sections.checks import kernel_line
from experiments.gpu_sections.timing import MIB


def summary_table(report: dict) -> str:
    env = report.get("environment", {})
    secs = report.get("sections", {})
    lines = [f"== gpu_check: {env.get('device_kind')} ({env.get('backend')}), jax {env.get('jax')}, "
             f"{env.get('date_utc')}, sizes={env.get('sizes')}, {report.get('elapsed_s', 0):.0f} s =="]

    def f(v, fmt):
        return format(v, fmt) if v is not None else format("-", ">" + re.match(r"\d*", fmt).group())

    def run_lines(prefix, runs):
        for r in runs:
            if r.get("status") == "ok":
                body = kernel_line(r) if "kernel" in r else ("tokens equal" if r.get("passed") else "DIFFERENT")
                lines.append(f"{prefix} {r['name']:38s} {'ok' if r.get('passed') else 'WRONG'}  {body}")
            else:
                err = (r.get("error") or "").strip().splitlines()
                lines.append(f"{prefix} {r['name']:38s} {r.get('status')} {r.get('reason', '')}"
                             + (f" {err[-1][:120]}" if err else ""))

    en = secs.get("engine", {})
    if en.get("policies"):
        w = en.get("workload", {})
        lines.append(f"engine   {w.get('requests')} x {w.get('prompt')} tokens + {w.get('new_tokens')}, "
                     f"{w.get('kv_dtype')} KV, kernels {w.get('kernels')}, device {en.get('budget', {}).get('device_bytes', 0) / MIB:.0f} "
                     "MiB  (tok/s  ITL p50 / p99 ms  running  hit  H2D MiB/step  host share)")
        for pol, r in en["policies"].items():
            ms = [r.get("itl_median_s"), r.get("itl_p99_s")]
            lines.append(f"engine   {pol:9s} {f(r.get('tokens_per_s'), '9.1f')}  "
                         f"{f(ms[0] * 1e3 if ms[0] else None, '7.2f')} / {f(ms[1] * 1e3 if ms[1] else None, '7.2f')}  "
                         f"{r.get('mean_running', 0):6.2f}  {r.get('hit_rate', 0):.3f}  "
                         f"{r.get('h2d_bytes_per_step', 0) / MIB:9.3f}  {f(r.get('host_share'), '5.2f')}"
                         + ("" if r.get("complete") else f"  (stopped at step {r.get('stopped_at_step')})"))
        if "tokens_identical" in en:
            lines.append(f"engine   tokens identical across policies: {en['tokens_identical']} "
                         f"({en.get('tokens_compared')} tokens); hisparse / offload tok/s "
                         f"{f(en.get('hisparse_vs_offload_tokens_per_s'), '.2f')} (sustained "
                         f"{f(en.get('hisparse_vs_offload_sustained_tokens_per_s'), '.2f')}), ITL p99 "
                         f"{f(en.get('hisparse_vs_offload_itl_p99'), '.2f')}")
    mm = secs.get("mosaic_matrix", {})
    for r in mm.get("runs", []):
        c = r.get("correct", {})
        body = (f"skipped: {r['skipped']}" if r.get("skipped") else
                f"rel {c.get('max_rel_err')}" if r.get("status") == "ok" else
                (r.get("error") or r.get("tail") or r.get("reason") or "").strip().splitlines()[-1:] or "")
        state = "ok" if r.get("passed") else "WRONG" if r.get("status") == "ok" else r.get("status")
        lines.append(f"mosaic   {r['name']:38s} {state}  {body if isinstance(body, str) else ' '.join(body)[:120]}")
    if mm.get("verdict", {}).get("features_failing_everywhere"):
        lines.append(f"mosaic   fails wherever it is on: {', '.join(mm['verdict']['features_failing_everywhere'])}")
    run_lines("compile ", secs.get("compile", {}).get("runs", []))
    c = secs.get("ceilings", {})
    for name in ("d2d_copy", "h2d_device_put", "h2d_jit_whole", "h2d_jit_chunked", "h2d_jit_page_blocks",
                 "d2h_device_put"):
        v = c.get(name)
        if isinstance(v, dict) and v.get("gb_per_s"):
            lines.append(f"ceiling  {name:22s} {v['gb_per_s']:9.2f} GB/s  ({v['bytes'] / MIB:.0f} MiB, "
                         f"{v['median_s'] * 1e3:.3f} ms)")
        elif isinstance(v, dict):
            lines.append(f"ceiling  {name:22s} {v.get('status')} {v.get('reason', '')}")
    fe = secs.get("fetch", {})
    if fe.get("runs"):
        lines.append("fetch    dtype mech miss     ms   payload MiB  moved MiB  payload GB/s  moved GB/s  "
                     "%ceil  exact")
        for r in fe["runs"]:
            if r.get("status") != "ok":
                lines.append(f"fetch    {r.get('kv_dtype'):5s} {r.get('mechanism'):4s} "
                             f"{r.get('status')} {r.get('reason', '')}")
                continue
            ok = r["verify"]["all_exact"] and r["verify"]["others_untouched"] and r["bytes_match"]
            lines.append(
                f"fetch    {r['kv_dtype']:5s} {r['mechanism']:4s} {r['miss_fraction']:4.0%} {r['time_s'] * 1e3:8.3f} "
                f"{r['payload_bytes'] / MIB:11.2f} {r['transfer_bytes'] / MIB:10.2f} "
                f"{f(r['payload_gb_per_s'], '12.2f')} {f(r['transfer_gb_per_s'], '11.2f')} "
                f"{f(100 * r['payload_vs_h2d_ceiling'] if r.get('payload_vs_h2d_ceiling') else None, '6.1f')}  "
                f"{'yes' if ok else 'NO'}")
        for r in fe.get("pool_scaling", []):
            if r.get("status") == "ok":
                lines.append(f"fetch    {r['kv_dtype']:5s} {r['mechanism']:4s} pools x{r['pool_scale']}: "
                             f"{r['time_s'] * 1e3:.3f} ms vs {r['base_time_s'] * 1e3:.3f} ms "
                             f"(x{r['time_ratio_vs_base']:.2f}), exact "
                             f"{'yes' if r['verify']['all_exact'] and r['verify']['others_untouched'] else 'NO'}")
            else:
                lines.append(f"fetch    {r.get('kv_dtype')} {r.get('mechanism')} pools scaled: {r.get('status')}")
        for r in fe["runs"]:
            if r.get("hlo"):
                h, cnt = r["hlo"], r["hlo"]["counts"]
                lines.append(f"hlo      {r['kv_dtype']:5s} {r['mechanism']:4s} host-compute instrs "
                             f"{cnt['host_compute_attr']:4d}  copy-start {cnt['copy_start']:3d}  custom-calls "
                             f"{sum(h['custom_call_targets'].values()):3d}  host ops: "
                             f"{','.join(h['host_compute_ops'][:6]) or '-'}")
    de = secs.get("decode", {})
    if de.get("stores"):
        for name, s in de["stores"].items():
            lines.append(f"decode   {name:14s} {f(s['step_median_s'] * 1e3 if s['step_median_s'] else None, '9.3f')} "
                         f"ms/step  misses/step {s['per_step_mean']['misses']:7.0f}  h2d/step "
                         f"{s['per_step_mean']['h2d_bytes'] / MIB:7.3f} MiB  device pages {s['device_pages']}")
        pub = de.get("public_decode_step", {}).get("step_median_s")
        lines.append(f"decode   resident via public store_decode_step (splits the model per call) "
                     f"{f(pub * 1e3 if pub else None, '.3f')} ms/step")
        for name in [n for n in de["stores"] if n != "resident"]:
            lines.append(f"decode   ratio {name} / resident = {f(de.get(f'ratio_{name}_vs_resident'), '.2f')}")
    dk = secs.get("decode_kernels", {})
    for kind, r in dk.get("kernels", {}).items():
        lines.append(f"decode   decode_loop kernels={kind:16s} {f(r['step_s'] * 1e3 if r.get('step_s') else None, '9.3f')}"
                     f" ms/step  misses {r.get('misses')}")
    if "tokens_equal" in dk:
        lines.append(f"decode   pallas vs reference: tokens equal {dk['tokens_equal']}, max rel logit diff "
                     f"{dk['max_rel_logit_diff']:.1e}, step time ratio {f(dk.get('kernel_step_vs_reference'), '.2f')}")
    for name in ("kernel_indexer", "kernel_gather", "kernel_mla", "kernel_mla_mosaic", "mla_big_pool", "mosaic_probes"):
        run_lines("kernels ", secs.get(name, {}).get("runs", []))
    for name, s in secs.items():
        err = s.get("error", "").strip().splitlines() if s.get("status") not in ("ok", "skipped") else []
        if s.get("status") in ("timeout", "crashed") and not err:
            err = (s.get("stderr_tail") or "").strip().splitlines()
        lines.append(f"section  {name:15s} {s.get('status'):8s} {f(s.get('wall_s'), '6.1f')} s of "
                     f"{f(s.get('timeout_s'), '4.0f')} s  rc {s.get('rc')}" + (f"  {err[-1][:140]}" if err else ""))
    return "\n".join(lines)
