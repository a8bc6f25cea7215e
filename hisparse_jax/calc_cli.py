"""`hisparse calc`: the capacity calculator's command (its options, each checked as it is parsed; the table, the
sweep and its plot). What it computes is `hisparse_jax.calc`'s; like it, this imports neither jax nor numpy."""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from fractions import Fraction
from typing import Any, Sequence

from hisparse_jax import calc
from hisparse_jax.calc import (DEFAULT_HIT_RATE, DEFAULT_LINK_GB_PER_S, DEFAULT_TOP_K, GPU_MEMORY_GB, LAYOUTS,
                               LIMITS, PRESETS, CalcError, CalcInput, CalcResult, get_preset, max_requests, sweep)
from hisparse_jax.cli_args import bounded_float, check_output_file, choice, int_at_least
from hisparse_jax.formats import INDEX_SUMMARIES, INDEX_TIERS, QUANTIZED_INDEX_DTYPES


def plot_sweep(rows: Sequence[dict[str, Any]], path: str,
               other_rows: Sequence[dict[str, Any]] | None = None) -> None:
    """Write a PNG of running requests per replica vs sequence length (log x) for both systems; `other_rows`
    (the same sweep with the other indexer dtype) adds both systems again, dashed."""
    from matplotlib.figure import Figure  # lazy: matplotlib is optional

    fig = Figure(figsize=(7, 4), tight_layout=True)
    ax = fig.add_subplot()
    for rs, style in ((rows, "o-"), (other_rows or (), "s--")):
        if not rs:
            continue
        seqs = [r["seq"] for r in rs]
        tag = f", {rs[0]['index_dtype']} indexer" if other_rows and "index_dtype" in rs[0] else ""
        ax.plot(seqs, [r["baseline_running"] for r in rs], style, color="0.5", label=f"all-GPU KV (baseline){tag}")
        ax.plot(seqs, [r["hisparse_running"] for r in rs], style, color="#008768", label=f"Hybrid HiSparse{tag}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("running requests per DP replica")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)


def parse_tokens(text: str) -> int:
    """'81920', '81_920', '80k' (x1024), '1.5k', '1m' (x2^20) -> tokens: a decimal number and an optional k / m
    giving a whole number of at most LIMITS["seq"] (no exponent: '1e3k' is not a token count); raises
    ArgumentTypeError."""
    t = text.strip().lower().replace("_", "").replace(",", "")
    m = re.fullmatch(r"(\d{1,40})(\.\d{1,40})?([km]?)", t)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (digits with an optional k or m, e.g. 81920, "
                                         "80k, 1.5k, 1m)")
    mult = {"k": 1024, "m": 2 ** 20, "": 1}[m.group(3)]
    value = Fraction(m.group(1) + (m.group(2) or "")) * mult  # exact: 1.5k is 1536 tokens, 1.3k no whole number
    if value.denominator != 1:
        raise argparse.ArgumentTypeError(f"sequence length must be a whole number of tokens, got {text!r} "
                                         f"({float(value):g})")
    value = int(value)
    if not 1 <= value <= LIMITS["seq"]:
        raise argparse.ArgumentTypeError(f"sequence length must be a positive number of tokens, at most "
                                         f"{LIMITS['seq']}, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    """Every value is checked as it is parsed (a bad one is a usage error, exit 2); messages name the
    CalcInput field too."""
    p = argparse.ArgumentParser(prog="hisparse calc", description=calc.__doc__.split("\n")[0])
    p.add_argument("--preset", type=choice(PRESETS, "preset"), default="glm-5.3-blog",
                   help=f"model constants ({', '.join(PRESETS)})")
    p.add_argument("--seq", type=parse_tokens, default=81_920, help="tokens: 81920, 80k (=81920), 1m (=1048576)")
    p.add_argument("--gpu", choices=sorted(GPU_MEMORY_GB), default="h200")
    p.add_argument("--dp", type=int_at_least(1, "dp", high=LIMITS["dp"]), default=1)
    p.add_argument("--tp", type=int_at_least(1, "tp", high=LIMITS["tp"]), default=8)
    p.add_argument("--ep", action=argparse.BooleanOptionalAction, default=True, help="expert parallel over DP*TP")
    p.add_argument("--kv-dtype", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--index-dtype", type=choice(QUANTIZED_INDEX_DTYPES, "index dtype"), default="fp8",
                   metavar="{fp8,int4}",
                   help="indexer key storage: fp8 (128 B + fp32 scale = 132 B/token/layer) or int4 (4-bit values "
                        "+ UE8M0 block-32 scales = 68 B, the MXFP4 layout of vLLM #48558 / SGLang #30546)")
    p.add_argument("--layout", type=choice(LAYOUTS, "layout"), default="unified", metavar="{unified,split}",
                   help="HiSparse's GPU memory: unified (one block size for indexer and hot pages, vLLM's shared "
                        "pool: the published calculator) or split (indexer keys in a pool of their own, hot and tail "
                        "KV pages of all layers in another, as hisparse-jax's store keeps them)")
    p.add_argument("--index-tier", type=choice(INDEX_TIERS, "index tier"), default="device", metavar="{device,host}",
                   help="where the indexer-key history lives: device (every published HiSparse) or host (beside the "
                        "KV; the GPU keeps a per-page min / max summary and reads --index-read-fraction of the keys "
                        "each step)")
    p.add_argument("--index-read-fraction", type=bounded_float(0, 1, name="index_read_fraction"), default=1.0,
                   help="with --index-tier host: the part of a request's key history read per step and layer "
                        "(default 1: an exact top-k from min / max page bounds read every page on the trained model, "
                        "docs/results.md)")
    p.add_argument("--index-summary", type=choice(INDEX_SUMMARIES, "index summary"), default="box",
                   metavar="{box,rvq}",
                   help="with --index-tier host: what the GPU keeps of the keys: box (bf16 min and max per dimension "
                        "per 64-token page) or rvq (per key d / 16 - 1 one-byte residual-VQ codes and an e4m3 radius, "
                        "plus their bf16 codebooks, 256 centroids per code and full layer, off the GPU pool)")
    p.add_argument("--index-summary-bytes", type=bounded_float(0, name="index_summary_bytes",
                                                               high=LIMITS["index_summary_bytes"]), default=None,
                   help="with --index-tier host: GPU bytes per token and full layer of the key summary (default: "
                        "the --index-summary's, box 4 d / 64, rvq d / 16: 8 at d 128)")
    p.add_argument("--hot-rows", type=int_at_least(1, "hot_rows", high=LIMITS["hot_rows"]), default=4096,
                   help="hot-buffer rows per group (10240 with MTP3)")
    p.add_argument("--groups", type=int_at_least(1, "groups", high=LIMITS["groups"]), default=None,
                   help="hot/resident groups (default: the preset's)")
    p.add_argument("--retained", type=int_at_least(0, "retained", high=LIMITS["retained"]), default=2,
                   help="retained resident pages per group")
    p.add_argument("--other", type=int_at_least(0, "other", high=LIMITS["other"]), default=0,
                   help="other GPU blocks per request")
    p.add_argument("--host-gib", type=bounded_float(0, allow_inf=True, name="host_gib", high=LIMITS["host_gib"]),
                   default=None,
                   help="host pool per DP replica (default: minimum; inf = unlimited)")
    p.add_argument("--max-seqs", type=int_at_least(1, "max_seqs", high=LIMITS["max_seqs"]), default=1024)
    p.add_argument("--gpu-memory-utilization", type=bounded_float(0, 1, low_inclusive=False,
                                                                  name="gpu_memory_utilization"), default=0.92)
    p.add_argument("--reserve-gib", type=bounded_float(0, name="reserve_gib"), default=15.0)
    p.add_argument("--kv-hbm-gib", type=bounded_float(0, low_inclusive=False, name="kv_hbm_gib"), default=None,
                   help="override the KV HBM estimate per GPU")
    p.add_argument("--hit-rate", type=bounded_float(0, 1, name="hit_rate"), default=None,
                   help="hot-buffer hit rate for the H2D cost (default: the measured one in "
                        f"experiments/results/demo.json, else {DEFAULT_HIT_RATE})")
    p.add_argument("--top-k", type=int_at_least(1, "top_k", high=LIMITS["top_k"]), default=DEFAULT_TOP_K,
                   help="rows the indexer selects per layer and step")
    p.add_argument("--link-gb-per-s", type=bounded_float(0, low_inclusive=False, name="link_gb_per_s",
                                                         high=LIMITS["link_gb_per_s"]),
                   default=DEFAULT_LINK_GB_PER_S, help="host->GPU link bandwidth per GPU, GB/s (1e9 B/s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--sweep", action="store_true", help="tabulate capacity vs sequence length (8K..1M)")
    p.add_argument("--plot", metavar="PATH", help="with the sweep, write a PNG plot")
    return p


def _table(r: CalcResult) -> str:
    i, bb = r.inputs, r.block_bytes
    host = "unlimited" if r.hisparse_host_limit is None else f"{r.hisparse_host_limit:,}"
    per_layer = r.indexer_bytes_per_token_layer
    idx = f"{r.index_dtype}" + ("" if per_layer is None else f": {per_layer} B / token / full layer")
    if r.index_tier == "host":
        idx = f"host tier ({idx}); GPU summary {r.index_summary_bytes_per_token:g} B / token"
        if i.index_summary != "box":
            idx += f" ({i.index_summary}) + codebooks {r.index_codebook_bytes:,} B / GPU"
    h2d = (f"{r.h2d_bytes_per_step / 1e6:,.1f} MB ({r.h2d_bytes_per_request_step / 1e6:,.2f} MB / request), "
           f"{r.h2d_ms_per_step:,.2f} ms at {r.link_gb_per_s:g} GB/s")
    rows = [("", "baseline", "HiSparse"),
            ("block bytes (64 tokens)", f"{bb.baseline:,}", f"{bb.hisparse_gpu:,} (host {bb.host:,})"),
            ("GPU pool (blocks)", f"{r.baseline_pool_blocks:,}", f"{r.hisparse_pool_blocks:,}"),
            ("GPU blocks / request", f"{r.baseline_blocks_per_request:,}", f"{r.hisparse_gpu_blocks_per_request:,}"),
            ("GPU limit", f"{r.baseline_running:,}", f"{r.hisparse_gpu_limit:,}"),
            ("host limit", "-", f"{host} ({r.host_gib:g} GiB pool)"),
            ("running / replica", f"{r.baseline_running:,}", f"{r.hisparse_running:,} (limit: {r.limiting})"),
            (f"running total (x DP{i.dp})", f"{r.baseline_total:,}", f"{r.hisparse_total:,}"),
            ("min host pool / replica", "-", f"{r.min_host_gib:.2f} GiB (shown as {r.min_host_gib_published})"),
            ("indexer B / token", f"{r.indexer_bytes_per_token:,}", idx),
            ("H2D / decode step", "0", h2d),
            ("  assuming", "", f"hit rate {r.hit_rate:.3f} ({r.hit_rate_source}), top-k {r.top_k:,}")]
    if r.index_tier == "host":
        rows.append(("  of which indexer keys", "", f"{r.index_h2d_bytes_per_request_step / 1e6:,.2f} MB / request "
                     f"(read fraction {r.index_read_fraction:g})"))
    head = (f"preset {get_preset(i.preset).name}  {i.gpu} DP{i.dp} TP{i.tp} {'EP' if i.ep else 'no-EP'}  "
            f"{i.kv_dtype} (indexer {r.index_dtype}, {r.layout if r.index_tier == 'device' else 'host-tier keys'} "
            f"layout)  seq {i.seq:,}  hot rows {i.hot_rows:,}  "
            f"KV HBM {r.kv_hbm_gib:g} GiB/GPU (weights {r.weights_per_gpu_gib:.2f} GiB/GPU)")
    return "\n".join([head] + [f"  {a:26}{b:>12}   {c}" for a, b, c in rows])


def main(argv: list[str] | None = None) -> int:
    """`hisparse calc`: 0 on success, 2 (with a message on stderr) on bad input."""
    parser = _parser()
    try:
        a = parser.parse_args(argv)
        if a.plot:
            check_output_file(parser, "--plot", a.plot)
    except SystemExit as e:  # argparse already printed usage and the error
        return int(e.code or 0)
    inp = CalcInput(preset=a.preset, gpu=a.gpu, dp=a.dp, tp=a.tp, ep=a.ep, kv_dtype=a.kv_dtype, seq=a.seq,
                    hot_rows=a.hot_rows, groups=a.groups, retained=a.retained, other=a.other, host_gib=a.host_gib,
                    max_seqs=a.max_seqs, gpu_memory_utilization=a.gpu_memory_utilization,
                    reserve_gib=a.reserve_gib, kv_hbm_gib=a.kv_hbm_gib, index_dtype=a.index_dtype,
                    hit_rate=a.hit_rate, top_k=a.top_k, link_gb_per_s=a.link_gb_per_s, layout=a.layout,
                    index_tier=a.index_tier, index_read_fraction=a.index_read_fraction,
                    index_summary_bytes=a.index_summary_bytes, index_summary=a.index_summary)
    try:
        result = max_requests(inp)
        rows = sweep(inp) if a.sweep or a.plot else None
        if a.plot:  # a comparison plot: both indexer dtypes
            other = next(d for d in QUANTIZED_INDEX_DTYPES if d != inp.index_dtype)
            plot_sweep(rows, a.plot, sweep(replace(inp, index_dtype=other)))
    except (CalcError, ImportError, OSError) as e:
        print(f"hisparse calc: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        out = result.to_dict()
        if rows is not None:
            out["sweep"] = rows
        print(json.dumps(out))
    elif rows is not None:
        cols = {"seq": "seq", "baseline_running": "baseline", "hisparse_running": "hisparse",
                "hisparse_gpu_limit": "gpu limit", "hisparse_host_limit": "host limit",
                "min_host_gib": "min host GiB", "limiting": "limiting", "h2d_ms_per_step": "H2D ms/step"}
        print(f"indexer {inp.index_dtype}; H2D at hit rate {result.hit_rate:.3f} ({result.hit_rate_source}), "
              f"top-k {inp.top_k:,}, {inp.link_gb_per_s:g} GB/s")
        print("".join(f"{h:>13}" for h in cols.values()))
        for row in rows:
            cells = [f"{row[c]:.1f}" if c in ("min_host_gib", "h2d_ms_per_step") else "-" if row[c] is None else
                     f"{row[c]:,}" if isinstance(row[c], int) else str(row[c]) for c in cols]
            print("".join(f"{x:>13}" for x in cells))
    else:
        print(_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
