"""What `hisparse demo` shows of a run: the header (the workload and each policy's budgets, printed before any policy
runs), the table of the result (`table`) and the PNG of running requests over time (`figure`, `plot`)."""

from __future__ import annotations

import sys

# Line styles that keep overlapping series apart (preempt and offload often coincide step for step): a wide solid
# line under a dashed one under a dotted one, each with its own markers, offset so they do not coincide either.
_STYLES = {"preempt": dict(ls="-", marker="o", lw=2.6, alpha=0.75, zorder=2),
           "offload": dict(ls="--", marker="s", lw=1.8, alpha=0.9, zorder=3),
           "hisparse": dict(ls=":", marker="^", lw=2.0, alpha=0.95, zorder=4)}
_MORE_STYLES = [dict(ls="-.", marker="D", lw=1.6, alpha=0.9), dict(ls=(0, (5, 1, 1, 1, 1, 1)), marker="v", lw=1.6,
                                                                   alpha=0.9)]


def figure(results: dict):
    """The running-requests figure `plot` saves (the caller closes it)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    n = len(results)
    for i, (pol, r) in enumerate(results.items()):
        style = dict(_STYLES.get(pol) or _MORE_STYLES[i % len(_MORE_STYLES)])
        style.setdefault("zorder", 2 + i)
        every = max(1, len(r["running_over_time"]) // 12)
        ax.plot(r["running_over_time"], label=f"{pol} (mean {r['mean_running']:.1f})", markersize=5,
                markevery=(i * every // max(n, 1), every), markerfacecolor="none", **style)
    ax.set_xlabel("engine step")
    ax.set_ylabel("running requests")
    ax.set_title("Requests decoding per step, same device and host budgets")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot(results: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'hisparse-jax[plot]')", file=sys.stderr)
        return None
    fig = figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def header(setup: dict) -> str:
    """What the table is about, printed before any policy runs: the workload and each policy's budgets."""
    lens = setup["prompt_tokens"]
    pols = list(setup["policies"])
    on = f" on {setup['devices']} devices (per device: budgets below, {setup['requests'] // setup['devices']} requests)" \
        if setup.get("devices", 1) > 1 else ""
    lines = [f"workload: {setup['requests']} requests{on}, prompts {min(lens)}..{max(lens)} tokens, "
             f"{setup['new_tokens']} new tokens each, kv {setup['kv_dtype']}, {_model_name(setup)} "
             f"(prefill {setup['prefill']}, kernels {setup['kernels']}, backend {setup['backend']})",
             f"budgets: device {setup['device_budget_bytes']:,} bytes ({setup['device_budget_bytes'] / 2 ** 20:.1f} "
             f"MiB = {setup['device_requests']:g} longest requests' KV + indexer keys), split per policy into pages "
             f"of 64 tokens; host pool {setup['host_pages']} pages (offload, hisparse)"
             + (f"; hot buffers of {setup['hot_rows']} rows, {setup.get('hot_policy', 'lru')} (hisparse)"
                if "hot_rows" in setup else "")]
    w = len("device KV pages")
    lines.append(f"{'':<{w}}  " + "  ".join(f"{p:>10}" for p in pols))
    for name, key in (("device KV pages", "device_pages"), ("indexer pages", "index_pages"),
                      ("host pages", "host_pages")):
        lines.append(f"{name:<{w}}  " + "  ".join(f"{setup['policies'][p][key]:>10}" for p in pols))
    cap = setup.get("capacity")
    if cap:
        lines.append(f"(the store is shaped by one capacity holding every budget, {cap['device_pages']} device KV / "
                     f"{cap['index_pages']} indexer pages, so the policies share compiled programs; each policy "
                     "uses only its budget)")
    return "\n".join(lines)


def _model_name(setup: dict) -> str:
    if setup.get("preset"):
        return f"preset {setup['preset']} (random weights), {setup['workload']} prompts"
    return f"model {setup['model']}, {setup['workload']} prompts"


def table(out: dict) -> str:
    cols = [("mean running", "mean_running", "{:.2f}"), ("max running", "max_running", "{}"), ("steps", "steps", "{}"),
            ("preemptions", "preemptions", "{}"), ("swaps", "swaps", "{}"),
            ("recomputed tokens", "recomputed_tokens", "{}"), ("steps preempted", "preempted_steps", "{}"),
            ("steps swapped", "swapped_steps", "{}"), ("swap out MiB", "swap_out_bytes", "{:.1f}"),
            ("swap in MiB", "swap_in_bytes", "{:.1f}"), ("tokens/s", "tokens_per_s", "{:.1f}"),
            ("hit rate", "hit_rate", "{:.3f}"), ("H2D MiB", "h2d_bytes", "{:.1f}"), ("D2H MiB", "d2h_bytes", "{:.1f}"),
            ("device KV pages", "device_pages", "{}"), ("wall s", "wall_s", "{:.1f}")]
    if out.get("index_tier") == "host":
        cols[14:14] = [("key MiB read", "index_h2d_bytes", "{:.1f}"),
                       ("key KiB / step", "index_h2d_bytes_per_step", "{:.1f}")]
    if out.get("speculative_tokens"):
        cols[11:11] = [("acceptance rate", "acceptance_rate", "{:.3f}"), ("tokens/step", "tokens_per_step", "{:.2f}")]
    pols = list(out["policies"])
    w = max(len(c[0]) for c in cols)
    lines = [f"{'':<{w}}  " + "  ".join(f"{p:>10}" for p in pols)]
    for name, key, fmt in cols:
        vals = []
        for p in pols:
            v = out["policies"][p][key]
            vals.append(fmt.format(v / 2 ** 20 if key.endswith("_bytes") else v / 2 ** 10 if
                                   key.endswith("_bytes_per_step") else v))
        lines.append(f"{name:<{w}}  " + "  ".join(f"{v:>10}" for v in vals))
    lines.append(f"outputs identical across policies: {out['outputs_identical']}")
    if "hisparse_over_offload_mean_running" in out:
        lines.append(f"HiSparse / offload mean running requests: {out['hisparse_over_offload_mean_running']:.2f}x")
    if out.get("backend", "cpu") == "cpu":
        lines.append("note: tokens/s and wall s are CPU figures and do not reflect GPU memory-bound decode; what "
                     "carries over is running requests, preemptions/swaps, hit rate and bytes moved")
    res = out["policies"]
    if "preempt" in res and res["preempt"]["preemptions"] == 0:
        also = " (offload's 0 swaps likewise)" if "offload" in res and res["offload"]["swaps"] == 0 else ""
        why = ("admission 'reserve' admits a request only when the pages of its whole length (prompt + new "
               "tokens) fit next to every admitted request's, so the waiting queue absorbs the pressure"
               if out.get("admission") == "reserve" else
               "admission 'vllm' admits on the prompt's pages, and here every admitted request could still grow to "
               "its end beside the others (nothing had to give way)")
        lines.append(f"preempt shows 0 preemptions{also}: {why}")
    return "\n".join(lines)
