"""What `hisparse demo` runs: the model's config, the prompts and the budgets every policy shares.

`model_config` resolves `--preset` / `--model` (one MTP layer where speculation needs it); `text_workload` and
`workload` make the prompts (held-out stdlib documents, or local random token walks); `budgets` turns
`--device-requests` into one device byte budget and a base `CacheConfig` whose host pool holds every request, and
`policy_budgets` splits it per policy inside one capacity. The checks that a workload fits before anything is
allocated are `demo_checks`'s.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from hisparse_jax import checkpoints
from hisparse_jax.config import CacheConfig, ModelConfig, get_preset
from hisparse_jax.engine import device_budget
from hisparse_jax.engine.scheduler import pages
from hisparse_jax.hf_config import from_hf_config
from hisparse_jax.train import data as text_data

WORKLOADS = ("text", "random")

# The default longest prompt, in top-k's: the hot buffer (2 x top-k) and the tail pages are then about a tenth of
# a request, as 4096 hot rows are of the published ~80K-token requests (the real ratio is smaller still).
PROMPT_TOPKS = 32


class DemoSetupError(ValueError):
    """The arguments are each valid, but the workload cannot run under the budgets they give."""


def model_config(args: argparse.Namespace) -> tuple[ModelConfig, str | None]:
    """(the model's config, its checkpoint folder or None for a random-weight `--preset`); with
    `--speculative-tokens`, a preset gets one MTP layer and a checkpoint without one is a DemoSetupError."""
    k = args.speculative_tokens
    if args.preset:
        cfg = get_preset(args.preset)
        if k:  # the preset's architecture with one MTP layer (random weights like the rest)
            cfg = cfg.replace(num_nextn_predict_layers=max(1, cfg.num_nextn_predict_layers))
        return cfg, None
    folder = checkpoints.resolve(args.model)
    cfg = from_hf_config(folder)
    if k and cfg.num_nextn_predict_layers < 1:
        raise DemoSetupError(f"--speculative-tokens {k}: the checkpoint {args.model} has no MTP layer to draft "
                             "with (use --preset demo-glm, whose MTP layer has random weights like the rest)")
    return cfg, folder


def workload_kind(args: argparse.Namespace, cfg: ModelConfig) -> str:
    """`--workload`, or its default: "text" for a byte-level checkpoint, "random" otherwise."""
    return args.workload or ("text" if not args.preset and cfg.vocab_size == text_data.VOCAB_SIZE else "random")


def text_workload(n: int, longest: int, seed: int, low: float = 0.55) -> list[list[int]]:
    """n prompts of low..100 % of `longest` bytes, each from the start of a held-out stdlib file (the text the
    shipped checkpoint never trained on; `hisparse_jax.train.data`)."""
    rng = np.random.default_rng(seed)
    lens = np.linspace(longest * low, longest, n).astype(int)
    rng.shuffle(lens)
    return text_data.document_prompts(text_data.load_corpus()[1], lens, seed)


CALIBRATION_WINDOWS, CALIBRATION_TOKENS = 32, 2048  # --index-summary rvq: the text its codebooks are fitted on


def calibration_ids(kind: str, cfg: ModelConfig, longest: int, seed: int) -> np.ndarray:
    """int[CALIBRATION_WINDOWS, T] token ids the "rvq" codebooks are fitted on (`index_codebooks.fit_index_codebooks`),
    T the prompts' longest length up to CALIBRATION_TOKENS: for the text workload, windows of the training text (the
    prompts are held out), else random walks drawn apart from the prompts' (another seed). An index layer-0 key
    depends on the byte alone, and a byte calibration never shows codes far from its key: 32 windows of 2048 bytes
    leave 0.14 % of the held-out text's bytes unseen, 4 left 0.28 % and made exact mode read more pages
    (docs/results.md)."""
    T = min(longest, CALIBRATION_TOKENS)
    if kind == "text":
        return text_data.fixed_windows(text_data.load_corpus()[0], T, CALIBRATION_WINDOWS)
    return np.asarray(workload(cfg.vocab_size, CALIBRATION_WINDOWS, T, seed + 1, low=1.0))


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
            index_budget_pages: int | None = None, index_rank: str = "bound", index_summary: str = "box"):
    """The demo's budgets for `requests` requests of up to `max_len` tokens: (a base CacheConfig whose host pool
    holds all of them, the device bytes of `device_requests` whole longest requests' KV + indexer keys, the keys
    counted in kv_dtype's own format whatever `index_dtype`: one device budget for every key format). Pass both
    to `device_budget` to get each policy's split. With speculative tokens, `max_len` must include the positions
    a speculative step writes past a request's last token (`speculative.lookahead`). `hot_rows`: the base's
    `CacheConfig.hot_rows` (None: the store's default), `hot_policy`, `index_tier`, `index_budget_pages`,
    `index_rank` and `index_summary` its `CacheConfig` fields; the device bytes depend on none of them (they count
    device keys whatever the tier)."""
    base = CacheConfig(kv_dtype=kv_dtype, max_seq_len=pages(max_len) * 64, max_seqs=requests,
                       host_pages=requests * pages(max_len), device_pages=1, miss_attention=miss_attention,
                       speculative_tokens=speculative_tokens, hot_rows=hot_rows, hot_policy=hot_policy)
    probe = device_budget(cfg, base, 1 << 40, "preempt", max_running=requests, max_len=max_len)
    per_page = (1 << 40) / probe.device_pages  # bytes of one KV page + one indexer page
    return (base.replace(index_dtype=index_dtype, index_tier=index_tier, index_budget_pages=index_budget_pages,
                         index_rank=index_rank, index_summary=index_summary),
            int(device_requests * pages(max_len) * per_page))



def option_budgets(args: argparse.Namespace, cfg: ModelConfig, max_len: int) -> tuple[CacheConfig, int]:
    """`budgets` for the options in `args` and requests of up to `max_len` tokens: (base CacheConfig, device
    bytes); the CacheConfig's own checks refuse a combination of store options it does not take (ValueError)."""
    return budgets(cfg, args.requests, max_len, args.device_requests, args.kv_dtype, args.miss_attention,
                   args.speculative_tokens, args.index_dtype, args.hot_rows or None, args.hot_policy,
                   args.index_tier, args.index_budget_pages or None, args.index_rank, args.index_summary)


@dataclasses.dataclass(frozen=True)
class PolicyBudgets:
    """The budgets of a run: `base` (`budgets`' CacheConfig), `device_bytes`, each policy's CacheConfig (`split`,
    `device_budget`'s) and the `capacity` holding every one of them (the largest pools any policy is given), so the
    policies run the same compiled programs where their formats agree; each still uses only its own budget."""

    base: CacheConfig
    device_bytes: int
    split: dict[str, CacheConfig]
    capacity: CacheConfig


def policy_budgets(args: argparse.Namespace, cfg: ModelConfig, max_len: int) -> PolicyBudgets:
    """The budgets the options in `args` give for requests of up to `max_len` tokens (the speculative lookahead
    included); a policy whose device budget holds no page is a DemoSetupError (`too_small`)."""
    base, device_bytes = option_budgets(args, cfg, max_len)
    split = {}
    for pol in args.policies:
        try:
            split[pol] = device_budget(cfg, base, device_bytes, pol, max_running=args.requests, max_len=max_len,
                                       prefill=args.prefill)
        except ValueError as e:
            raise too_small(args, device_bytes, pol, e) from None
    capacity = base.replace(device_pages=max(b.device_pages for b in split.values()),
                            index_pages=max(b.num_index_pages for b in split.values()))
    return PolicyBudgets(base, device_bytes, split, capacity)


def too_small(args: argparse.Namespace, device_bytes: int, pol: str, e: ValueError) -> DemoSetupError:
    """A device budget with no room for the workload under `pol` (a BudgetError, or a budget of no pages at all)."""
    return DemoSetupError(f"--device-requests {args.device_requests:g} ({device_bytes:,} bytes) is too small "
                          f"for this workload under {pol!r}: {e}")
