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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import numbers
import os
import re
import sys
import threading
import time

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from hisparse_jax.cli_args import (bounded_float, check_output_dir, check_output_file, choice, int_at_least,
                                   name_list, positive_int)
from hisparse_jax.config import (HOT_POLICIES, INDEX_DTYPES, INDEX_TIERS, MAX_SPECULATIVE_TOKENS, MISS_ATTENTION,
                                 PRESETS, CacheConfig, ModelConfig, get_preset)
from hisparse_jax.engine.speculative import lookahead
from hisparse_jax.hf_config import from_hf_config
from hisparse_jax import parallel
from hisparse_jax.engine import Engine, EngineConfig, MeshEngine, SamplingParams, device_budget
from hisparse_jax.engine.request import SEED_RANGE
from hisparse_jax.engine.scheduler import ADMISSIONS, POLICIES, pages, policy_cache
from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.kv.tiered import KERNELS, check_kernels
from hisparse_jax.engine.runner import TRACE_COUNTS as _STEP_TRACES
from hisparse_jax.kv.account import store_costs
from hisparse_jax.memory import Cost, check_account
from hisparse_jax.model.decoder import SparseMLAModel
from hisparse_jax import checkpoints
from hisparse_jax.train import data as text_data


def _parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser_class(prog="hisparse demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, metavar="NAME|DIR",
                   help=f"a shipped checkpoint ({', '.join(checkpoints.SHIPPED)}) or a Hugging Face checkpoint "
                        f"folder (default {checkpoints.DEFAULT}, trained on the Python standard library)")
    p.add_argument("--preset", type=choice(sorted(PRESETS), "preset"), default=None,
                   help="a random-weight model preset instead of --model (e.g. demo-glm)")
    p.add_argument("--workload", default=None, choices=WORKLOADS,
                   help="prompts: documents of the held-out stdlib text (bytes; the default for a byte-level "
                        "checkpoint) or random token walks (the default for a preset)")
    p.add_argument("--requests", type=positive_int, default=16,
                   help="concurrent requests per device (default 16; the workload has requests x devices)")
    p.add_argument("--prompt-len", type=int_at_least(64), default=0,
                   help=f"longest prompt in tokens, >= 64 (default {PROMPT_TOPKS} x the model's top-k: 4096 on "
                        "stdlib-dsa, 2048 on demo-glm)")
    p.add_argument("--new-tokens", type=positive_int, default=160, help="tokens generated per request (default 160)")
    p.add_argument("--device-requests", type=bounded_float(0, low_inclusive=False), default=3.5,
                   help="device budget, in whole-request KV footprints (KV + indexer keys) of the longest "
                        "request (default 3.5)")
    p.add_argument("--kv-dtype", default="float32", choices=("bf16", "fp8", "float32"),
                   help="KV format (default float32: XLA:CPU converts bf16/fp8 pools around every scatter, "
                        "which is slow on a CPU; use bf16 or fp8 on a GPU)")
    p.add_argument("--index-dtype", default="auto", choices=INDEX_DTYPES,
                   help="indexer keys: as --kv-dtype stores them (auto, the default), fp8 (132 bytes per key of 128) "
                        "or int4 (MXFP4, 68 bytes). --device-requests counts the default format's bytes, so a "
                        "smaller key format leaves more of the same device budget to HiSparse")
    p.add_argument("--index-tier", default="device", choices=INDEX_TIERS,
                   help="where every policy's indexer keys live (`CacheConfig.index_tier`): device (the default, as "
                        "every published HiSparse) or host (pinned host memory; the device keeps a min / max "
                        "summary per key page and each step reads the keys it needs, best bound first). "
                        "--device-requests counts device keys, so host keys leave the device to the KV; outputs "
                        "are the same (exact mode) unless --index-budget-pages is set")
    p.add_argument("--index-budget-pages", type=int_at_least(0), default=0, metavar="N",
                   help="with --index-tier host: read at most N key pages per step, request and index layer "
                        "(budgeted mode: the top-k among the N best-bounded pages; default 0: exact mode)")
    p.add_argument("--policies", type=name_list(POLICIES, "policy"), default=",".join(POLICIES),
                   help="comma-separated subset of " + ",".join(POLICIES))
    p.add_argument("--admission", default="vllm", choices=ADMISSIONS,
                   help="how preempt and offload admit: 'vllm' (default: on the prompt's pages, grown page by page, "
                        "preempting or swapping out the newest request when one cannot grow) or 'reserve' (only "
                        "when the indexer pages of the whole length fit: never preempts or swaps); HiSparse keeps "
                        "its own rule")
    p.add_argument("--prefill", default="whole", choices=("whole", "chunked"),
                   help="prompt prefill for every policy: one causal forward per prompt written into the store "
                        "(default), or chunks through the store within the decode batch")
    p.add_argument("--prefill-chunk", type=positive_int, default=240, help="prompt tokens per step when chunked (240)")
    p.add_argument("--kernels", default="reference", choices=KERNELS,
                   help="decode step: jnp references (default), the Pallas GPU kernels (needs a GPU; pallas_mosaic: "
                        "the sparse MLA decode and the indexer's scores on the Mosaic GPU backend, jax >= 0.11), or "
                        "the same kernels interpreted (any backend; slow)")
    p.add_argument("--miss-attention", default="single", choices=MISS_ATTENTION,
                   help="attention over the selected rows in one pass after the misses are fetched (default), or "
                        "split: rows already on the device and fetched misses apart, merged by log-sum-exp (the "
                        "first part need not wait for the host copy; needs --kernels reference)")
    p.add_argument("--speculative-tokens", type=int_at_least(0, high=MAX_SPECULATIVE_TOKENS), default=0, metavar="K",
                   help="MTP speculative decoding: verify K draft tokens per request and step, drafted by the "
                        "model's MTP layer (default 0: none); outputs stay identical; acceptance rate and tokens per "
                        "step are reported per policy (needs --prefill whole)")
    p.add_argument("--hot-rows", type=int_at_least(0, high=MAX_HOT_ROWS), default=0, metavar="N",
                   help="hot-buffer rows per request and indexer group, for every policy's store (default 0: the "
                        "store's default, (K + 2) x the model's top-k with --speculative-tokens K, 2 x top-k "
                        "without); at least (K + 1) x top-k, the rows one step can miss. HiSparse's device budget "
                        "lends each running request its hot buffer, so more rows leave room for fewer requests")
    p.add_argument("--hot-policy", default="lru", choices=HOT_POLICIES,
                   help="which hot-buffer slot a HiSparse miss takes over (`CacheConfig.hot_policy`): lru (the "
                        "default: the least recently used) or score_ema (the lowest moving average of the indexer's "
                        "scores of the slot's row); outputs are the same under every choice")
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


WORKLOADS = ("text", "random")
# The most devices the demo serves on: XLA makes that many host devices on request (thousands take seconds and
# memory to create, and 100000 crash XLA), far more than the engines a demo needs.
MAX_DEVICES = 256
# The most hot rows per request the option takes: a hot slot is an int32 index (the machine's memory is the
# tighter bound, checked with the stores' budgets in `_check_memory`).
MAX_HOT_ROWS = 2**31 - 1
# The default longest prompt, in top-k's: the hot buffer (2 x top-k) and the tail pages are then about a tenth of
# a request, as 4096 hot rows are of the published ~80K-token requests (the real ratio is smaller still).
PROMPT_TOPKS = 32


def text_workload(n: int, longest: int, seed: int, low: float = 0.55) -> list[list[int]]:
    """n prompts of low..100 % of `longest` bytes, each from the start of a held-out stdlib file (the text the
    shipped checkpoint never trained on; `hisparse_jax.train.data`)."""
    rng = np.random.default_rng(seed)
    lens = np.linspace(longest * low, longest, n).astype(int)
    rng.shuffle(lens)
    return text_data.document_prompts(text_data.load_corpus()[1], lens, seed)


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


def budgets(cfg, requests: int, max_len: int, device_requests: float, kv_dtype: str = "float32",
            miss_attention: str = "single", speculative_tokens: int = 0, index_dtype: str = "auto",
            hot_rows: int | None = None, hot_policy: str = "lru", index_tier: str = "device",
            index_budget_pages: int | None = None):
    """The demo's budgets for `requests` requests of up to `max_len` tokens: (a base CacheConfig whose host pool
    holds all of them, the device bytes of `device_requests` whole longest requests' KV + indexer keys, the keys
    counted in kv_dtype's own format whatever `index_dtype`: one device budget for every key format). Pass both
    to `device_budget` to get each policy's split. With speculative tokens, `max_len` must include the positions
    a speculative step writes past a request's last token (`speculative.lookahead`). `hot_rows`: the base's
    `CacheConfig.hot_rows` (None: the store's default), `hot_policy`, `index_tier` and `index_budget_pages` its
    `CacheConfig` fields; the device bytes depend on none of them (they count device keys whatever the tier)."""
    base = CacheConfig(kv_dtype=kv_dtype, max_seq_len=pages(max_len) * 64, max_seqs=requests,
                       host_pages=requests * pages(max_len), device_pages=1, miss_attention=miss_attention,
                       speculative_tokens=speculative_tokens, hot_rows=hot_rows, hot_policy=hot_policy)
    probe = device_budget(cfg, base, 1 << 40, "preempt", max_running=requests, max_len=max_len)
    per_page = (1 << 40) / probe.device_pages  # bytes of one KV page + one indexer page
    return (base.replace(index_dtype=index_dtype, index_tier=index_tier, index_budget_pages=index_budget_pages),
            int(device_requests * pages(max_len) * per_page))


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
    return _run(args)


def _too_small(args: argparse.Namespace, device_bytes: int, pol: str, e: ValueError) -> DemoSetupError:
    """A device budget with no room for the workload under `pol` (a BudgetError, or a budget of no pages at all)."""
    return DemoSetupError(f"--device-requests {args.device_requests:g} ({device_bytes:,} bytes) is too small "
                          f"for this workload under {pol!r}: {e}")


def _check_sizes(args: argparse.Namespace, cfg: ModelConfig, kind: str, longest: int) -> None:
    """DemoSetupError, before anything is allocated, for a workload past the model's positions, the workload's
    text, or the memory its stores would take: the prompt (`longest` tokens) and the new tokens (plus the
    speculative lookahead) within the model's max_position_embeddings; text prompts within the held-out text, one
    distinct start each; the host pools (every request's pages, on each device) and the device budgets within the
    machine's memory."""
    n_dev, new, extra = args.devices, args.new_tokens, lookahead(args.speculative_tokens)
    positions = cfg.max_position_embeddings
    prompt_opt = f"--prompt-len {longest}" if args.prompt_len else f"the default prompt length ({longest} tokens)"
    if longest + 1 + extra > positions:
        raise DemoSetupError(f"{prompt_opt} must be <= {positions - 1 - extra}: a prompt and one new token"
                             f"{' (and the speculative lookahead)' if extra else ''} must fit the model's "
                             f"max_position_embeddings ({positions})")
    if longest + new + extra > positions:
        raise DemoSetupError(f"--new-tokens {new} must be <= {positions - longest - extra}: the longest prompt "
                             f"({longest} tokens) and its new tokens must fit the model's max_position_embeddings "
                             f"({positions})")
    text = text_data.load_corpus()[1].size if kind == "text" else None
    if text is not None and longest > text:
        raise DemoSetupError(f"{prompt_opt} must be <= {text}: the held-out text has {text} tokens")
    max_len = longest + new + extra
    base, device_bytes = budgets(cfg, args.requests, max_len, args.device_requests, args.kv_dtype,
                                 args.miss_attention, args.speculative_tokens, args.index_dtype, args.hot_rows or None,
                                 args.hot_policy, args.index_tier, args.index_budget_pages or None)
    for pol in args.policies:  # a budget of no pages at all: refused now, not after the model is made
        try:
            device_budget(cfg, base, device_bytes, pol, max_running=args.requests, max_len=max_len,
                          prefill=args.prefill)
        except ValueError as e:
            raise _too_small(args, device_bytes, pol, e) from None
    _check_memory(args, cfg, longest)
    room = None if text is None else text - longest + 1  # distinct prompt starts (`text_data.document_prompts`)
    if room is not None and args.requests * n_dev > room:
        raise DemoSetupError(f"--requests {args.requests} must be <= {room // n_dev}: the held-out text ({text} "
                             f"tokens) holds {room} distinct prompts of {longest} tokens"
                             + (f" ({n_dev} devices x --requests are asked for)" if n_dev > 1 else ""))


def workload_costs(args: argparse.Namespace, cfg: ModelConfig, longest: int) -> list[Cost]:
    """The memory account of the workload `args` asks for (`kv.account.store_costs`), per device: the largest store
    an engine of its policies builds (`_run`'s budgets: --device-requests split per policy, every policy inside
    one capacity, host pools for every request's pages (--requests), hot buffers of --hot-rows rows), the
    temporaries of the engine's largest step, and a copy of the model's parameters. Raises ValueError when a
    policy's budget holds no page (`device_budget`)."""
    k = args.speculative_tokens
    max_len = longest + args.new_tokens + lookahead(k)
    base, device_bytes = budgets(cfg, args.requests, max_len, args.device_requests, args.kv_dtype,
                                 args.miss_attention, k, args.index_dtype, args.hot_rows or None, args.hot_policy,
                                 args.index_tier, args.index_budget_pages or None)
    split = [device_budget(cfg, base, device_bytes, pol, max_running=args.requests, max_len=max_len,
                           prefill=args.prefill) for pol in args.policies]
    capacity = base.replace(device_pages=max(b.device_pages for b in split),
                            index_pages=max(b.num_index_pages for b in split))
    stores = [StoreSpec.create(cfg, policy_cache(capacity, pol, args.requests, k, args.admission))
              for pol in args.policies]
    step = EngineConfig(max_running=args.requests, prefill=args.prefill, prefill_chunk=args.prefill_chunk,
                        speculative_tokens=k, prefix_caching=not k)
    model = Cost("the model's parameters", sum(cfg.parameter_bytes(mtp=bool(k)).values()), "device",
                 f"--devices {args.devices} (one copy each)")
    costs = [store_costs(spec, step_rows=step.max_step_rows) + [model] for spec in stores]
    return max(costs, key=lambda c: sum(x.nbytes for x in c))


def _culprit(args: argparse.Namespace, part: str) -> str:
    """The option a part of the account follows (`workload_costs`): the one whose bound a refusal states."""
    if "hot" in part and args.hot_rows:
        return "--hot-rows"
    if "step rows" in part and args.prefill == "chunked" and args.prefill_chunk > args.requests:
        return "--prefill-chunk"
    if any(f"store's {n}" in part for n in ("latent", "rope", "index_")):
        return "--device-requests"
    if "parameters" in part and args.devices > 1:
        return "--devices"
    return "--requests"


def _check_memory(args: argparse.Namespace, cfg: ModelConfig, longest: int) -> None:
    """DemoSetupError, before anything is allocated, when the workload's memory account (`workload_costs`: the store
    of every device, their host pools, the step's temporaries, the model's copies) does not fit this machine's
    memory (`memory.check_account`, as the engine checks it): the message gives the largest value of the option
    behind the largest part that would fit, with the others as given."""
    def refusal(**change) -> str | None:
        a = argparse.Namespace(**{**vars(args), **change})
        try:
            costs = workload_costs(a, cfg, longest)
        except ValueError:  # a budget of no pages (`_check_sizes` refuses it): none of its memory is taken
            return None
        try:
            check_account("the workload", costs, ranks=a.devices)
        except ValueError as e:
            return str(e)
        return None

    def largest(option: str):  # the largest value of `option` that fits, the others as given (None: none)
        field = option[2:].replace("-", "_")
        if option == "--device-requests":  # a float: bisect to 4 significant digits
            lo, hi = 0.0, float(args.device_requests)
            while hi - lo > 1e-4 * hi:
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if refusal(device_requests=mid) is None else (lo, mid)
            return float(f"{lo:.4g}") or None
        least = (args.speculative_tokens + 1) * cfg.index_topk if field == "hot_rows" else 1
        lo, hi = least - 1, getattr(args, field)  # hi is refused; lo: none fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if refusal(**{field: mid}) is None else (lo, mid)
        return lo if lo >= least else None

    why = refusal()
    if why is None:
        return
    option = _culprit(args, why.split("the largest part is ", 1)[1])
    bound = largest(option)
    if bound is None and args.devices > 1:  # not even the least of it fits next to the other devices' shares
        option, bound = "--devices", largest("--devices")
    value = getattr(args, option[2:].replace("-", "_"))
    shown = (f"{value:g}", f"{bound or 0:g}") if isinstance(value, float) else (value, bound or 0)
    raise DemoSetupError(f"{option} {shown[0]} must be <= {shown[1]} on this machine: {why}")


def outputs_digest(outputs: dict[str, list[int]]) -> str:
    """SHA-256 of a run's generated tokens (request id -> token ids, `Engine.outputs()`): equal digests, equal
    outputs, so runs in different processes (with and without speculation, other kernels) compare by their JSON."""
    return hashlib.sha256(json.dumps(outputs, sort_keys=True).encode()).hexdigest()


def _run(args: argparse.Namespace, on_setup=None) -> dict:
    """`run` on checked arguments; `on_setup(setup)` is called once every policy's budgets are known, before any
    policy runs, with the workload and budgets (`setup`: the keys of the result that describe them)."""
    k = args.speculative_tokens
    if args.preset:
        cfg = get_preset(args.preset)
        if k:  # the preset's architecture with one MTP layer (random weights like the rest)
            cfg = cfg.replace(num_nextn_predict_layers=max(1, cfg.num_nextn_predict_layers))
    else:
        folder = checkpoints.resolve(args.model)
        cfg = from_hf_config(folder)
        if k and cfg.num_nextn_predict_layers < 1:
            raise DemoSetupError(f"--speculative-tokens {k}: the checkpoint {args.model} has no MTP layer to draft "
                                 "with (use --preset demo-glm, whose MTP layer has random weights like the rest)")
    kind = args.workload or ("text" if not args.preset and cfg.vocab_size == text_data.VOCAB_SIZE else "random")
    if kind == "text" and cfg.vocab_size != text_data.VOCAB_SIZE:
        raise DemoSetupError(f"--workload text: the prompts are bytes (256 token ids); this model's vocabulary has "
                             f"{cfg.vocab_size} (use --workload random)")
    n_dev = args.devices
    if n_dev > len(jax.devices()):
        raise DemoSetupError(f"--devices {n_dev}: jax sees {len(jax.devices())} device(s) "
                             f"({jax.default_backend()}); on a CPU start the process with "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={n_dev} (the hisparse command sets it "
                             "when jax has not started yet)")
    if args.index_budget_pages and args.index_tier != "host":
        raise DemoSetupError(f"--index-budget-pages {args.index_budget_pages} is the read budget of --index-tier "
                             "host (with device keys every key is scored)")
    if args.index_tier == "host" and (args.kernels != "reference" or args.hot_policy != "lru"):
        raise DemoSetupError("--index-tier host needs --kernels reference (the Pallas indexer reads device keys) "
                             "and --hot-policy lru (score_ema averages every key's score each step), got "
                             f"--kernels {args.kernels} --hot-policy {args.hot_policy}")
    need = (k + 1) * cfg.index_topk  # the rows one step can miss (`CacheConfig.hot_rows_for`)
    if args.hot_rows and args.hot_rows < need:
        raise DemoSetupError(f"--hot-rows {args.hot_rows} must be >= {need}, {f'{k + 1} x ' if k else ''}the "
                             f"model's top-k ({cfg.index_topk}): " + (f"a step verifies {k + 1} rows per request "
                                                        f"(--speculative-tokens {k}) and " if k else "a step ")
                             + "can miss every row it selects (0: the store's default, "
                             f"{(k + 2 if k else 2) * cfg.index_topk})")
    longest = args.prompt_len or PROMPT_TOPKS * cfg.index_topk
    _check_sizes(args, cfg, kind, longest)  # before the model, the prompts or the stores are made
    mesh = parallel.data_mesh(n_dev) if n_dev > 1 else None
    if args.preset:
        model = SparseMLAModel(cfg, rngs=nnx.Rngs(args.seed), mtp=bool(k))
    else:
        model = checkpoints.load(folder, mtp=bool(k))
    if kind == "text":
        prompts = text_workload(args.requests * n_dev, longest, args.seed)
    else:
        prompts = workload(cfg.vocab_size, args.requests * n_dev, longest, args.seed)
    max_len = max(len(p) for p in prompts) + args.new_tokens + lookahead(k)
    base, device_bytes = budgets(cfg, args.requests, max_len, args.device_requests, args.kv_dtype,
                                 args.miss_attention, k, args.index_dtype, args.hot_rows or None, args.hot_policy,
                                 args.index_tier, args.index_budget_pages or None)
    params = SamplingParams(max_new_tokens=args.new_tokens)
    quiet = args.json
    results, outputs = {}, {}
    policies = list(args.policies)

    def too_small(pol: str, e: ValueError) -> DemoSetupError:
        return _too_small(args, device_bytes, pol, e)

    budget = {}
    for pol in policies:
        try:
            budget[pol] = device_budget(cfg, base, device_bytes, pol, max_running=args.requests, max_len=max_len,
                                        prefill=args.prefill)
        except ValueError as e:
            raise too_small(pol, e) from None
    # Every policy's budget inside one capacity (the store's shapes: the largest pools any of them is given), so
    # the policies run the same compiled programs where their formats agree (offload and hisparse); each policy
    # still uses only its own budget, which the host bookkeeping enforces.
    capacity = base.replace(device_pages=max(b.device_pages for b in budget.values()),
                            index_pages=max(b.num_index_pages for b in budget.values()))

    def engine(pol: str, log_path: str | None = None) -> tuple[Engine, CacheConfig]:
        try:
            cc = budget[pol].replace(capacity=capacity)
            ec = EngineConfig(policy=pol, admission=args.admission, max_running=args.requests, prefill=args.prefill,
                              prefill_chunk=args.prefill_chunk, log_path=log_path, kernels=args.kernels,
                              speculative_tokens=k, prefix_caching=not k)
            eng = Engine(model, cc, ec) if mesh is None else MeshEngine(model, cc, ec, mesh=mesh)
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, params)
        except ValueError as e:
            raise too_small(pol, e) from None
        return eng, cc

    split = {}
    for pol in policies:  # every policy's budgets are checked before any runs
        eng, cc = engine(pol)
        eng.close()
        spec = StoreSpec.create(cfg, cc.replace(capacity=None))  # the budgets' geometry (per device)
        split[pol] = {"device_pages": cc.device_pages, "index_pages": cc.num_index_pages,
                      "host_pages": cc.host_pages if pol != "preempt" else 0,
                      "kv_pool_bytes": cc.device_pages * spec.page_bytes * spec.num_layers,
                      "index_pool_bytes": int(cc.num_index_pages * 64 * spec.num_index_layers * spec.index_row_bytes),
                      "index_host_bytes": cc.num_index_pages * 64 * spec.num_index_layers * spec.index_host_row_bytes}
    setup = {
        "preset": args.preset, "model": None if args.preset else args.model, "workload": kind,
        "requests": len(prompts), "devices": n_dev, "prompt_tokens": [len(p) for p in prompts],
        "new_tokens": args.new_tokens, "kv_dtype": args.kv_dtype, "index_dtype": args.index_dtype,
        "device_budget_bytes": device_bytes, "admission": args.admission,
        "device_requests": args.device_requests, "host_pages": base.host_pages, "kernels": args.kernels,
        "miss_attention": args.miss_attention, "speculative_tokens": k, "hot_rows": base.hot_rows_for(cfg),
        "hot_policy": args.hot_policy, "index_tier": args.index_tier,
        "index_budget_pages": args.index_budget_pages or None,
        "prefill": args.prefill, "backend": jax.default_backend(), "policies": split,
        "capacity": {"device_pages": capacity.device_pages, "index_pages": capacity.num_index_pages,
                     "host_pages": capacity.host_pages},
    }
    if on_setup:
        on_setup(setup)
    for pol in policies:
        eng, cc = engine(pol, os.path.join(args.log_dir, f"{pol}.jsonl") if args.log_dir else None)
        t0 = time.perf_counter()
        progress = None if quiet else _Progress(pol, len(prompts))
        try:
            eng.run(progress=progress)
        except BaseException:
            eng.close()
            raise
        finally:
            if progress:
                progress.close()
        m = eng.metrics()
        row_bytes = eng.spec.row_bytes
        outputs[pol] = eng.outputs()
        results[pol] = {
            "mean_running": m.mean_running, "max_running": m.max_running, "preemptions": m.preemptions,
            "swaps": m.swaps, "tokens_per_s": m.tokens_per_s, "hit_rate": m.hit_rate,
            "hits": m.hits, "misses": m.misses, "resident": m.resident,
            "h2d_bytes": m.h2d_bytes, "d2h_bytes": m.d2h_bytes, "index_h2d_bytes": m.index_h2d_bytes,
            "evicted_pages": m.evicted_pages, "steps": m.steps, "wall_s": time.perf_counter() - t0,
            # what preempt / offload cost (`EngineMetrics`): tokens prefilled again, request-steps preempted or
            # swapped out, pages and bytes swapped each way
            "recomputed_tokens": m.recomputed_tokens, "preempted_steps": m.preempted_steps,
            "swapped_steps": m.swapped_steps, "swap_out_pages": m.swap_out_pages, "swap_in_pages": m.swap_in_pages,
            "swap_out_bytes": m.swap_out_bytes, "swap_in_bytes": m.swap_in_bytes,
            "compile_s": m.compile_time_s, "outputs_sha256": outputs_digest(outputs[pol]),
            "acceptance_rate": m.acceptance_rate,
            "tokens_per_step": m.tokens_per_step, "duplicate_misses": m.duplicate_misses,
            # H2D bytes of the steps over (distinct missing rows x row bytes): 1.00 when each miss moves once
            "h2d_per_miss_bytes": _ratio(sum(h.h2d_bytes for h in m.history), m.misses * row_bytes),
            **split[pol],
            "running_over_time": [h.running for h in m.history],
            # per device (a MeshEngine): each rank's mean running requests over its decode steps
            "ranks_mean_running": [r.mean_running for r in m.ranks] or [m.mean_running],
        }
        eng.close()
    first = outputs[policies[0]]
    out = {**setup, "policies": results, "outputs_identical": all(outputs[p] == first for p in policies)}
    if "hisparse" in results and "offload" in results and results["offload"]["mean_running"]:
        out["hisparse_over_offload_mean_running"] = results["hisparse"]["mean_running"] / results["offload"][
            "mean_running"]
    if args.plot:
        out["plot"] = plot(results, args.plot)
    return out


_PLAIN_EVERY_S = 5.0  # a plain progress line at least this often when stderr is not a terminal


def _traces() -> tuple[int, int]:
    """(decode-step traces, whole-prompt prefill traces) so far: each new one is a compile under way."""
    return _STEP_TRACES["decode_step"], _STEP_TRACES["prefill"]


def _terminal(stream) -> bool:
    """Whether `stream` is a terminal a bar can be drawn on (a pseudo-terminal of width 0, as some runners give,
    would show tqdm's bar as nothing at all: it gets plain lines too)."""
    try:
        if not stream.isatty():
            return False
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no isatty / fileno (a StringIO), or a closed or odd stream
        return bool(getattr(stream, "isatty", lambda: False)())


class _Progress:
    """One policy's progress on stderr, as `Engine.run(progress=...)`: a tqdm bar (requests finished, with the
    step, running and waiting as postfix) when stderr is a terminal, else a plain line (no carriage return) at
    start, every `_PLAIN_EVERY_S` seconds and at the end. A watcher thread keeps a long step from being silent:
    it sees a compile start (the trace counters move mid-step) and says so; after a step that compiled, a line
    names its batch bucket (and indexer span, where the engine reports one) and how long the step took.
    `close()` stops the thread and ends the bar (or says done)."""

    def __init__(self, pol: str, n_requests: int, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.pol, self.n = pol, n_requests
        self.t0 = self.step_t0 = self.last_line = time.perf_counter()
        self.step, self.finished, self.running, self.waiting = 0, 0, 0, n_requests
        self.traces0, self.compiling = _traces(), ""
        self.lock = threading.Lock()
        self.bar = None
        if _terminal(self.stream):
            self.bar = tqdm(total=n_requests, desc=pol, unit="req", file=self.stream, dynamic_ncols=True,
                            mininterval=0.5, leave=True)
            self.bar.set_postfix({"step": 0, "running": 0, "waiting": n_requests})
        else:
            self._line(f"{pol}: starting {n_requests} requests")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"hisparse-demo-progress-{pol}", daemon=True)
        self._thread.start()

    def _line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)
        self.last_line = time.perf_counter()

    def _state(self) -> str:
        return (f"{self.pol}: step {self.step}, {self.finished}/{self.n} finished, {self.running} running, "
                f"{self.waiting} waiting, {time.perf_counter() - self.t0:.1f} s")

    def __call__(self, engine) -> None:
        m = engine.history[-1]
        with self.lock:
            now = time.perf_counter()
            self.step, self.running, self.waiting = engine.step_count, m.running, m.waiting
            self.finished = sum(r.finished for r in engine.requests.values())
            if m.compiled:
                span = f", indexer span {m.index_pages} pages" if m.index_pages else ""
                self._line(f"{self.pol}: step {m.step}: compiling the decode step for batch bucket {m.bucket}"
                           f"{span} (the step took {m.step_time_s:.1f} s)")
            elif self.compiling:  # a whole-prompt prefill compiled
                self._line(f"{self.pol}: step {m.step}: {self.compiling} (the step took "
                           f"{now - self.step_t0:.1f} s)")
            if self.bar is not None:
                self.bar.set_description_str(self.pol, refresh=False)
                self.bar.set_postfix({"step": self.step, "running": self.running, "waiting": self.waiting},
                                     refresh=False)
                self.bar.update(self.finished - self.bar.n)
            elif now - self.last_line >= _PLAIN_EVERY_S:
                self._line(self._state())
            self.step_t0, self.traces0, self.compiling = now, _traces(), ""

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            with self.lock:
                now = time.perf_counter()
                decode, prefill = (a - b for a, b in zip(_traces(), self.traces0))
                if (decode or prefill) and not self.compiling:
                    self.compiling = ("compiling the decode step for a new step shape" if decode else
                                      "compiling the whole-prompt prefill for a new prompt length bucket")
                    if self.bar is not None:
                        self.bar.set_description_str(f"{self.pol} ({self.compiling})")
                    else:
                        self._line(f"{self.pol}: step {self.step}: {self.compiling}...")
                if self.bar is not None:
                    self.bar.refresh()  # the elapsed time moves during a long step
                elif now - self.last_line >= _PLAIN_EVERY_S:
                    busy = now - self.step_t0
                    self._line(self._state() + (f" (step {self.step} running for {busy:.1f} s"
                                                + (f": {self.compiling})" if self.compiling else ")")
                                                if busy >= _PLAIN_EVERY_S else ""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with self.lock:
            if self.bar is not None:
                self.bar.set_description_str(self.pol, refresh=False)
                self.bar.close()
            else:
                self._line(f"{self.pol}: done: {self.step} steps, {self.finished}/{self.n} finished, "
                           f"{time.perf_counter() - self.t0:.1f} s")


# Line styles that keep overlapping series apart (preempt and offload often coincide step for step): a wide solid
# line under a dashed one under a dotted one, each with its own markers, offset so they do not coincide either.
_STYLES = {"preempt": dict(ls="-", marker="o", lw=2.6, alpha=0.75, zorder=2),
           "offload": dict(ls="--", marker="s", lw=1.8, alpha=0.9, zorder=3),
           "hisparse": dict(ls=":", marker="^", lw=2.0, alpha=0.95, zorder=4)}
_MORE_STYLES = [dict(ls="-.", marker="D", lw=1.6, alpha=0.9), dict(ls=(0, (5, 1, 1, 1, 1, 1)), marker="v", lw=1.6,
                                                                   alpha=0.9)]


def _figure(results: dict):
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
    fig = _figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _header(setup: dict) -> str:
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


def _table(out: dict) -> str:
    cols = [("mean running", "mean_running", "{:.2f}"), ("max running", "max_running", "{}"), ("steps", "steps", "{}"),
            ("preemptions", "preemptions", "{}"), ("swaps", "swaps", "{}"),
            ("recomputed tokens", "recomputed_tokens", "{}"), ("steps preempted", "preempted_steps", "{}"),
            ("steps swapped", "swapped_steps", "{}"), ("swap out MiB", "swap_out_bytes", "{:.1f}"),
            ("swap in MiB", "swap_in_bytes", "{:.1f}"), ("tokens/s", "tokens_per_s", "{:.1f}"),
            ("hit rate", "hit_rate", "{:.3f}"), ("H2D MiB", "h2d_bytes", "{:.1f}"), ("D2H MiB", "d2h_bytes", "{:.1f}"),
            ("device KV pages", "device_pages", "{}"), ("wall s", "wall_s", "{:.1f}")]
    if out.get("speculative_tokens"):
        cols[11:11] = [("acceptance rate", "acceptance_rate", "{:.3f}"), ("tokens/step", "tokens_per_step", "{:.2f}")]
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


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


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
        out = _run(args, on_setup=None if args.json else lambda setup: print(_header(setup), flush=True))
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
