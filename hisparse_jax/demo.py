"""`hisparse demo`: preemption vs traditional KV offloading vs HiSparse on the same workload and budgets.

An embedded tiny model with the real cache geometry (latent 512, rope 64, indexer keys 128, shared-index
layers, MoE; seeded random weights, nothing downloaded) serves >= 16 concurrent long-context requests
(thousands of tokens each, generated locally) three times, once per memory policy, under one device byte
budget (split into KV and indexer pages as each policy needs) and one host budget. It prints a table of
mean / max running requests, preemptions, swaps, tokens/s, hit rate and bytes moved, writes a PNG of
running requests over time, and checks that every policy produced the same tokens.
"""

from __future__ import annotations

import argparse
import json
import numbers
import os
import re
import sys
import time

import numpy as np
from flax import nnx

from hisparse_jax.cli_args import (bounded_float, check_output_dir, check_output_file, choice, int_at_least,
                                   name_list, nonnegative_int, positive_int)
from hisparse_jax.config import PRESETS, CacheConfig, get_preset
from hisparse_jax.engine import Engine, EngineConfig, SamplingParams, device_budget
from hisparse_jax.engine.scheduler import POLICIES, pages
from hisparse_jax.kv.tiered import KERNELS, check_kernels
from hisparse_jax.model.decoder import SparseMLAModel


def _parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser_class(prog="hisparse demo", description=__doc__.splitlines()[0])
    p.add_argument("--preset", type=choice(sorted(PRESETS), "preset"), default="demo-glm",
                   help="model preset (default demo-glm)")
    p.add_argument("--requests", type=positive_int, default=16, help="concurrent requests (default 16)")
    p.add_argument("--prompt-len", type=int_at_least(64), default=2048,
                   help="longest prompt in tokens, >= 64 (default 2048)")
    p.add_argument("--new-tokens", type=positive_int, default=160, help="tokens generated per request (default 160)")
    p.add_argument("--device-requests", type=bounded_float(0, low_inclusive=False), default=3.5,
                   help="device budget, in whole-request KV footprints (KV + indexer keys) of the longest "
                        "request (default 3.5)")
    p.add_argument("--kv-dtype", default="float32", choices=("bf16", "fp8", "float32"),
                   help="KV format (default float32: XLA:CPU converts bf16/fp8 pools around every scatter, "
                        "which is slow on a CPU; use bf16 or fp8 on a GPU)")
    p.add_argument("--policies", type=name_list(POLICIES, "policy"), default=",".join(POLICIES),
                   help="comma-separated subset of " + ",".join(POLICIES))
    p.add_argument("--prefill", default="whole", choices=("whole", "chunked"),
                   help="prompt prefill for every policy: one causal forward per prompt written into the store "
                        "(default), or chunks through the store within the decode batch")
    p.add_argument("--prefill-chunk", type=positive_int, default=240, help="prompt tokens per step when chunked (240)")
    p.add_argument("--kernels", default="reference", choices=KERNELS,
                   help="decode step: jnp references (default), the Pallas GPU kernels (needs a GPU), or the same "
                        "kernels interpreted (any backend; slow)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--plot", default="hisparse_demo.png", help="PNG of running requests over time ('' = none)")
    p.add_argument("--log-dir", default="", help="write one JSON-lines metrics log per policy here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def workload(vocab: int, n: int, longest: int, seed: int, low: float = 0.55) -> list[list[int]]:
    """n prompts of low..100 % of `longest` tokens with a little repeated structure (random walks over a
    few dozen token ids plus noise), generated locally."""
    rng = np.random.default_rng(seed)
    lens = np.linspace(longest * low, longest, n).astype(int)
    rng.shuffle(lens)
    out = []
    for n_tok in lens:
        base = rng.integers(0, vocab, 64)
        walk = base[rng.integers(0, 64, n_tok)]
        noise = rng.random(n_tok) < 0.3
        out.append(np.where(noise, rng.integers(0, vocab, n_tok), walk).astype(int).tolist())
    return out


def budgets(cfg, requests: int, max_len: int, device_requests: float, kv_dtype: str = "float32"):
    """The demo's budgets for `requests` requests of up to `max_len` tokens: (a base CacheConfig whose host pool
    holds all of them, the device bytes of `device_requests` whole longest requests' KV + indexer keys). Pass both
    to `device_budget` to get each policy's split."""
    base = CacheConfig(kv_dtype=kv_dtype, max_seq_len=pages(max_len) * 64, max_seqs=requests,
                       host_pages=requests * pages(max_len), device_pages=1)
    probe = device_budget(cfg, base, 1 << 40, "preempt", max_running=requests, max_len=max_len)
    per_page = (1 << 40) / probe.device_pages  # bytes of one KV page + one indexer page
    return base, int(device_requests * pages(max_len) * per_page)


class DemoSetupError(ValueError):
    """The arguments are each valid, but the workload cannot run under the budgets they give."""


def run(args: argparse.Namespace | None = None, /, **options) -> dict:
    """Run the workload once per policy and return what `hisparse demo --json` prints; raises DemoSetupError,
    before any policy runs, if one cannot.

    Either `run(parse_args(argv))` or keywords named after the options, e.g. `run(requests=4, prompt_len=256,
    new_tokens=8, policies=("offload", "hisparse"), plot="")`: the rest keep the command's defaults (so `plot`
    writes hisparse_demo.png unless given; `plot=""` writes none) and every value is checked as the command
    checks it, before any work: an unknown keyword or a value of the wrong type is a TypeError, a value the
    command would refuse a ValueError with the command's message (`requests: must be >= 1, got '0'`)."""
    if args is None:
        args = _namespace(options)
    elif options:
        raise TypeError(f"run() takes an argparse.Namespace or keywords, not both (got {', '.join(options)})")
    elif not isinstance(args, argparse.Namespace):
        raise TypeError(f"run() takes an argparse.Namespace (from parse_args) or keywords, got "
                        f"{type(args).__name__}")
    cfg = get_preset(args.preset)
    model = SparseMLAModel(cfg, rngs=nnx.Rngs(args.seed))
    prompts = workload(cfg.vocab_size, args.requests, args.prompt_len, args.seed)
    max_len = max(len(p) for p in prompts) + args.new_tokens
    base, device_bytes = budgets(cfg, args.requests, max_len, args.device_requests, args.kv_dtype)
    params = SamplingParams(max_new_tokens=args.new_tokens)
    quiet = args.json
    results, outputs = {}, {}
    policies = list(args.policies)

    def engine(pol: str, log_path: str | None = None) -> tuple[Engine, CacheConfig]:
        try:
            cc = device_budget(cfg, base, device_bytes, pol, max_running=args.requests, max_len=max_len,
                               prefill=args.prefill)
            eng = Engine(model, cc, EngineConfig(policy=pol, max_running=args.requests, prefill=args.prefill,
                                                 prefill_chunk=args.prefill_chunk, log_path=log_path,
                                                 kernels=args.kernels))
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, params)
        except ValueError as e:  # BudgetError, or a budget of no pages at all
            raise DemoSetupError(f"--device-requests {args.device_requests:g} ({device_bytes:,} bytes) is too small "
                                 f"for this workload under {pol!r}: {e}") from None
        return eng, cc

    for pol in policies:  # every policy's budgets are checked before any runs
        engine(pol)[0].close()
    for pol in policies:
        eng, cc = engine(pol, os.path.join(args.log_dir, f"{pol}.jsonl") if args.log_dir else None)
        t0 = time.perf_counter()

        def progress(e, pol=pol, t0=t0):
            if quiet or e.step_count % 10:
                return
            done = sum(r.finished for r in e.requests.values())
            m = e.history[-1]
            print(f"\r{pol:>8}: step {e.step_count:4d}  finished {done:2d}/{len(e.requests)}  running "
                  f"{m['running']:2d}  waiting {m['waiting']:2d}  {time.perf_counter() - t0:6.1f}s",
                  end="", file=sys.stderr, flush=True)

        eng.run(progress=progress)
        if not quiet:
            print(file=sys.stderr)
        m = eng.metrics()
        outputs[pol] = eng.outputs()
        results[pol] = {
            "mean_running": m["mean_running"], "max_running": m["max_running"], "preemptions": m["preemptions"],
            "swaps": m["swaps"], "tokens_per_s": m["tokens_per_s"], "hit_rate": m["hit_rate"],
            "hits": m["hits"], "misses": m["misses"], "h2d_bytes": m["h2d_bytes"], "d2h_bytes": m["d2h_bytes"],
            "evicted_pages": m["evicted_pages"], "steps": m["steps"], "wall_s": time.perf_counter() - t0,
            "compile_s": m["compile_time_s"], "device_pages": cc.device_pages, "index_pages": cc.num_index_pages,
            "host_pages": cc.host_pages if pol != "preempt" else 0,
            "running_over_time": [h["running"] for h in m["history"]],
        }
        eng.close()
    first = outputs[policies[0]]
    out = {
        "preset": args.preset, "requests": args.requests, "prompt_tokens": [len(p) for p in prompts],
        "new_tokens": args.new_tokens, "kv_dtype": args.kv_dtype, "device_budget_bytes": device_bytes,
        "host_pages": base.host_pages, "kernels": args.kernels, "policies": results,
        "outputs_identical": all(outputs[p] == first for p in policies),
    }
    if "hisparse" in results and "offload" in results and results["offload"]["mean_running"]:
        out["hisparse_over_offload_mean_running"] = results["hisparse"]["mean_running"] / results["offload"][
            "mean_running"]
    if args.plot:
        out["plot"] = plot(results, args.plot)
    return out


def plot(results: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'hisparse-jax[plot]')", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    for pol, r in results.items():
        ax.plot(r["running_over_time"], label=f"{pol} (mean {r['mean_running']:.1f})", lw=1.5)
    ax.set_xlabel("engine step")
    ax.set_ylabel("running requests")
    ax.set_title("Requests decoding per step, same device and host budgets")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _table(out: dict) -> str:
    cols = [("mean running", "mean_running", "{:.2f}"), ("max running", "max_running", "{}"),
            ("preemptions", "preemptions", "{}"), ("swaps", "swaps", "{}"), ("tokens/s", "tokens_per_s", "{:.1f}"),
            ("hit rate", "hit_rate", "{:.3f}"), ("H2D MiB", "h2d_bytes", "{:.1f}"), ("D2H MiB", "d2h_bytes", "{:.1f}"),
            ("device KV pages", "device_pages", "{}"), ("wall s", "wall_s", "{:.1f}")]
    pols = list(out["policies"])
    w = max(len(c[0]) for c in cols)
    lines = [f"{'':<{w}}  " + "  ".join(f"{p:>10}" for p in pols)]
    for name, key, fmt in cols:
        vals = []
        for p in pols:
            v = out["policies"][p][key]
            vals.append(fmt.format(v / 2 ** 20 if key.endswith("_bytes") else v))
        lines.append(f"{name:<{w}}  " + "  ".join(f"{v:>10}" for v in vals))
    lines.append(f"outputs identical across policies: {out['outputs_identical']}")
    if "hisparse_over_offload_mean_running" in out:
        lines.append(f"HiSparse / offload mean running requests: {out['hisparse_over_offload_mean_running']:.2f}x")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The checked arguments: a bad one is a usage error (SystemExit(2)) before any work starts; this creates
    --log-dir."""
    return _checked(_parser(), argv)


def _checked(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    try:
        check_kernels(args.kernels)
    except ValueError as e:
        parser.error(f"argument --kernels: {e}")
    if args.plot:
        check_output_file(parser, "--plot", args.plot)
    if args.log_dir:
        check_output_dir(parser, "--log-dir", args.log_dir)
    return args


class _KeywordParser(argparse.ArgumentParser):
    """`_parser()` for `run(**options)`: a refused value is a ValueError naming the keyword, not SystemExit."""

    def error(self, message: str):
        raise ValueError(re.sub(r"argument --([a-z-]+)", lambda m: m[1].replace("-", "_"), message))


def _namespace(options: dict) -> argparse.Namespace:
    """The checked Namespace for `run(**options)`: the command's defaults, each keyword given turned back into
    its option's text and parsed (and checked) as the command does."""
    parser = _parser(_KeywordParser)
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    defaults = parser.parse_args([])
    argv = []
    for name, value in options.items():
        if name not in actions:
            raise TypeError(f"run() got an unexpected keyword argument {name!r}; options: {', '.join(actions)}")
        option, default = actions[name].option_strings[-1], getattr(defaults, name)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
            argv += [option] if value else []
            continue
        if isinstance(default, tuple):  # --policies: a sequence of names, or the command's comma-separated text
            if isinstance(value, (list, tuple)) and all(isinstance(v, str) and "," not in v for v in value):
                value = ",".join(value)
            elif not isinstance(value, str):
                raise TypeError(f"{name} must be a sequence of names, got {value!r}")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {value!r}")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {value!r}")
        elif not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {value!r}")
        argv.append(f"{option}={value}")  # `=`: a value starting with '-' stays a value
    return _checked(parser, argv)


def main(argv: list[str] | None = None) -> int:
    """`hisparse demo`: 0 on success, 2 (usage and the error on stderr) on a bad argument."""
    try:
        args = parse_args(argv)
    except SystemExit as e:  # argparse already printed usage and the error
        return int(e.code or 0)
    try:
        out = run(args)
    except DemoSetupError as e:
        print(f"hisparse demo: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        print(_table(out))
        if out.get("plot"):
            print(f"plot: {out['plot']}")
    return 0
