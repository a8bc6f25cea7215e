"""`hisparse demo`: preemption vs traditional KV offloading vs HiSparse on the same workload and budgets.

A small DSA model with the real KV geometry (latent 512, rope 64, indexer keys 128, shared-index layers)
serves >= 16 concurrent long-context requests (thousands of tokens each) three times, once per memory policy,
under one device byte budget (split into KV and indexer pages as each policy needs) and one host budget. It
prints the workload and each policy's budgets first, each policy's progress on stderr while it runs (a tqdm bar on a terminal,
a plain line every few seconds otherwise, and a line whenever a step compiles), then a table of mean / max
running requests, engine steps, preemptions, swaps, tokens/s, hit rate and bytes moved; it writes a PNG of
running requests over time and checks that every policy produced the same tokens.

The model is by default the shipped checkpoint `stdlib-dsa` (`hisparse_jax.checkpoints`: trained on the Python
standard library, so its indexer's selections, and the hit rates, are those of attention that learned real text),
prompted with documents of the held-out text; `--model DIR` takes another checkpoint folder, `--preset NAME` a
random-weight preset (prompted with locally generated token walks), as the tests use.

This module is the command: its options, their checks, `run` (the library's face) and `main`. What it runs is
`demo_workload`'s, whether that fits `demo_checks`'s, the run itself `demo_run`'s, and what it shows
`demo_progress`'s and `demo_report`'s.
"""

from __future__ import annotations

import argparse
import json
import numbers
import os
import re
import sys

import jax

from hisparse_jax import checkpoints
from hisparse_jax.cli_args import (bounded_float, check_output_dir, check_output_file, choice, int_at_least,
                                   name_list, positive_int)
from hisparse_jax.config import HOT_POLICIES, INDEX_DTYPES, MAX_SPECULATIVE_TOKENS, MISS_ATTENTION, PRESETS
from hisparse_jax.demo_report import header, table
from hisparse_jax.demo_run import run_policies
from hisparse_jax.demo_workload import PROMPT_TOPKS, WORKLOADS, DemoSetupError
from hisparse_jax.engine.request import SEED_RANGE
from hisparse_jax.engine.scheduler import ADMISSIONS, POLICIES
from hisparse_jax.formats import INDEX_RANKS, INDEX_SUMMARIES, INDEX_TIERS
from hisparse_jax.kv.tiered import KERNELS, check_kernels


# The most devices the demo serves on: XLA makes that many host devices on request (thousands take seconds and
# memory to create, and 100000 crash XLA), far more than the engines a demo needs.
MAX_DEVICES = 256
# The most hot rows per request the option takes: a hot slot is an int32 index (the machine's memory is the
# tighter bound, checked with the stores' budgets in `demo_checks.check_memory`).
MAX_HOT_ROWS = 2**31 - 1


# The options that pick one of a few named modes (the workload, every policy's store formats and engine modes):
# option -> (default, choices, help).
_MODES = {
    "--workload": (None, WORKLOADS,
        "prompts: documents of the held-out stdlib text (bytes; the default for a byte-level "
        "checkpoint) or random token walks (the default for a preset)"),
    "--kv-dtype": ("float32", ("bf16", "fp8", "float32"),
        "KV format (default float32: XLA:CPU converts bf16/fp8 pools around every scatter, "
        "which is slow on a CPU; use bf16 or fp8 on a GPU)"),
    "--index-dtype": ("auto", INDEX_DTYPES,
        "indexer keys: as --kv-dtype stores them (auto, the default), fp8 (132 bytes per key of 128) "
        "or int4 (MXFP4, 68 bytes). --device-requests counts the default format's bytes, so a "
        "smaller key format leaves more of the same device budget to HiSparse"),
    "--index-tier": ("device", INDEX_TIERS,
        "where every policy's indexer keys live (`CacheConfig.index_tier`): device (the default, as "
        "every published HiSparse) or host (pinned host memory; the device keeps a min / max "
        "summary per key page and each step reads the keys it needs, best bound first). "
        "--device-requests counts device keys, so host keys leave the device to the KV; outputs "
        "are the same (exact mode) unless --index-budget-pages is set"),
    "--index-summary": ("box", INDEX_SUMMARIES,
        "with --index-tier host: what the device keeps to bound each key page's scores "
        "(`CacheConfig.index_summary`): box (the default: each dimension's min / max per page) or rvq "
        "(each key's codes before its RoPE and a residual radius, the same bytes per token; codebooks "
        "fitted on calibration text first: the training text's for a byte-level checkpoint, random "
        "token walks for a preset); rvq reads fewer pages on the trained models"),
    "--index-rank": ("bound", INDEX_RANKS,
        "with --index-budget-pages: which key pages a step reads (`CacheConfig.index_rank`): those of the best "
        "summary bounds (bound, the default) or of the best scores of the summaries' midpoints (centre: no "
        "more bytes, a higher recall per page read on the trained models)"),
    "--admission": ("vllm", ADMISSIONS,
        "how preempt and offload admit: 'vllm' (default: on the prompt's pages, grown page by page, "
        "preempting or swapping out the newest request when one cannot grow) or 'reserve' (only "
        "when the indexer pages of the whole length fit: never preempts or swaps); HiSparse keeps "
        "its own rule"),
    "--prefill": ("whole", ("whole", "chunked"),
        "prompt prefill for every policy: one causal forward per prompt written into the store "
        "(default), or chunks through the store within the decode batch"),
    "--kernels": ("reference", KERNELS,
        "decode step: jnp references (default), the Pallas GPU kernels (needs a GPU; pallas_mosaic: "
        "the sparse MLA decode and the indexer's scores on the Mosaic GPU backend, jax >= 0.11), or "
        "the same kernels interpreted (any backend; slow)"),
    "--miss-attention": ("single", MISS_ATTENTION,
        "attention over the selected rows in one pass after the misses are fetched (default), or "
        "split: rows already on the device and fetched misses apart, merged by log-sum-exp (the "
        "first part need not wait for the host copy; needs --kernels reference)"),
    "--hot-policy": ("lru", HOT_POLICIES,
        "which hot-buffer slot a HiSparse miss takes over (`CacheConfig.hot_policy`): lru (the "
        "default: the least recently used) or score_ema (the lowest moving average of the indexer's "
        "scores of the slot's row); outputs are the same under every choice"),
}


def _parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser_class(prog="hisparse demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, metavar="NAME|DIR",
                   help=f"a shipped checkpoint ({', '.join(checkpoints.SHIPPED)}) or a Hugging Face checkpoint "
                        f"folder (default {checkpoints.DEFAULT}, trained on the Python standard library)")
    p.add_argument("--preset", type=choice(sorted(PRESETS), "preset"), default=None,
                   help="a random-weight model preset instead of --model (e.g. demo-glm)")
    for option, (default, choices, text) in _MODES.items():
        p.add_argument(option, default=default, choices=choices, help=text)
    p.add_argument("--requests", type=positive_int, default=16,
                   help="concurrent requests per device (default 16; the workload has requests x devices)")
    p.add_argument("--prompt-len", type=int_at_least(64), default=0,
                   help=f"longest prompt in tokens, >= 64 (default {PROMPT_TOPKS} x the model's top-k: 4096 on "
                        "stdlib-dsa, 2048 on demo-glm)")
    p.add_argument("--new-tokens", type=positive_int, default=160, help="tokens generated per request (default 160)")
    p.add_argument("--device-requests", type=bounded_float(0, low_inclusive=False), default=3.5,
                   help="device budget, in whole-request KV footprints (KV + indexer keys) of the longest "
                        "request (default 3.5)")
    p.add_argument("--index-budget-pages", type=int_at_least(0), default=0, metavar="N",
                   help="with --index-tier host: read at most N key pages per step, request and index layer "
                        "(budgeted mode: the top-k among the N best-bounded pages; default 0: exact mode)")
    p.add_argument("--policies", type=name_list(POLICIES, "policy"), default=",".join(POLICIES),
                   help="comma-separated subset of " + ",".join(POLICIES))
    p.add_argument("--prefill-chunk", type=positive_int, default=240, help="prompt tokens per step when chunked (240)")
    p.add_argument("--speculative-tokens", type=int_at_least(0, high=MAX_SPECULATIVE_TOKENS), default=0, metavar="K",
                   help="MTP speculative decoding: verify K draft tokens per request and step, drafted by the "
                        "model's MTP layer (default 0: none); outputs stay identical; acceptance rate and tokens per "
                        "step are reported per policy (needs --prefill whole)")
    p.add_argument("--hot-rows", type=int_at_least(0, high=MAX_HOT_ROWS), default=0, metavar="N",
                   help="hot-buffer rows per request and indexer group, for every policy's store (default 0: the "
                        "store's default, (K + 2) x the model's top-k with --speculative-tokens K, 2 x top-k "
                        "without); at least (K + 1) x top-k, the rows one step can miss. HiSparse's device budget "
                        "lends each running request its hot buffer, so more rows leave room for fewer requests")
    p.add_argument("--devices", type=int_at_least(1, high=MAX_DEVICES), default=1, metavar="N",
                   help="attention data parallelism over N devices (default 1, at most "
                        f"{MAX_DEVICES}): each device serves its own "
                        "requests under the same per-device budgets (a MeshEngine); on a CPU the command asks jax for "
                        "N host devices (XLA_FLAGS=--xla_force_host_platform_device_count=N) when jax has not started")
    p.add_argument("--seed", type=int_at_least(0, high=SEED_RANGE - 1), default=0)
    p.add_argument("--plot", default="hisparse_demo.png", help="PNG of running requests over time ('' = none)")
    p.add_argument("--log-dir", default="", help="write one JSON-lines metrics log per policy here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p



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
    return run_policies(args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The checked arguments: a bad one is a usage error (SystemExit(2)) before any work starts; this creates
    --log-dir."""
    return _checked(_parser(), argv)


def _checked(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.preset and args.model:
        parser.error(f"argument --preset: a random-weight preset instead of --model: give one of them (got --model "
                     f"{args.model} and --preset {args.preset})")
    if not args.preset:
        args.model = args.model or checkpoints.DEFAULT
        try:
            checkpoints.resolve(args.model)
        except (ValueError, FileNotFoundError) as e:
            parser.error(f"argument --model: {e}")
    if args.devices > 1 and args.speculative_tokens:
        parser.error("argument --speculative-tokens: not carried across devices yet (use --devices 1)")
    if args.speculative_tokens and args.prefill != "whole":
        parser.error(f"argument --speculative-tokens: needs --prefill whole (got {args.prefill})")
    if args.kernels == "pallas_mosaic_interpret":  # before jax's CPU client exists (see `tiered.check_kernels`)
        from hisparse_jax.cpu_pool import request_interpret_threads

        jax.config.update("jax_cpu_enable_async_dispatch", False)
        request_interpret_threads()
    try:
        check_kernels(args.kernels)
    except ValueError as e:
        parser.error(f"argument --kernels: {e}")
    if args.miss_attention == "split" and args.kernels != "reference":
        parser.error(f"argument --miss-attention: split needs --kernels reference (got {args.kernels})")
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
    if args.devices > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # read when jax starts its backends (not yet, in the command): fake host devices where there is no GPU
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}").strip()
    try:
        out = run_policies(args, on_setup=None if args.json else lambda setup: print(header(setup), flush=True))
    except DemoSetupError as e:
        print(f"hisparse demo: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        print(table(out))
        if out.get("plot"):
            print(f"plot: {out['plot']}")
    return 0
