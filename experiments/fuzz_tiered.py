"""Differential fuzzer: tiered generation under memory pressure against the contiguous path.

    PYTHONPATH=. python experiments/fuzz_tiered.py [--long] [--examples N] [--seed S] [--first K]
                                                   [--only generate|engine|mesh|pd] [--group-size G]
                                                   [--out experiments/results/fuzz_tiered.json]

Cases run in groups of G (64) per process, so that a crash inside XLA is recorded (the group's cases, the
command that reruns them) and the run goes on; case k of a kind is drawn from (seed, kind, k) alone, so
`--first k --examples 1` reruns it.

Draws random workloads and budgets — prompt counts and lengths (1 to several pages, page-boundary lengths),
`max_new_tokens`, `device_pages` from one below the smallest workable budget upwards, `host_pages`,
`index_pages`, `hot_rows` (top-k to 4x), `max_seqs`, both fetch mechanisms, float32 / bf16 / fp8 formats —
and for the engine also the policy, admission rule ("vllm" / "reserve", from a stream of its own: `admission_rng`),
coldness rule, prefill mode, prefix caching with shared prefixes, random arrivals and aborts, and MTP speculative
decoding (k = 1..3 draft tokens); "mesh" cases run an engine case
(float32, no speculation) on a `MeshEngine` over 1-4 devices (as many as jax sees; the command asks for 4 host
devices), with either placement and with or without expert parallelism, the budgets per device; "pd" cases run an
engine case (float32) whose requests arrive in part as prefill exports (`pd.export_prefill`, passed as objects or
read back from files) on an `Engine` or a `MeshEngine`. Each run is checked against an oracle that knows nothing of
the store's internals:

* **Refusal is exact.** `budget_shortfall` says, from page arithmetic alone, whether the requests can be held
  (each request needs its pages on the indexer and host tiers, and on the device all its pages or its two tail
  pages + its hot buffer, whichever is fewer). A run the oracle calls infeasible must be refused up front with
  a `BudgetError` (a `ValueError`); a feasible one must complete — never an exception or `OutOfPages` midway,
  never a stall.
* **Tokens.** float32: exactly the greedy tokens of the contiguous path (`generate(model, prompts, n)`), or a
  divergence where the reference's logits of the two tokens are within `NEAR_TIE` (outcome "near_tie": XLA:CPU
  rounds a row with the batch's shape, `same_tokens`);
  bf16 / fp8: exactly those of the same format with every page resident.
* **Bookkeeping.** Allocator invariants after every step; every pool empty at the end; with the row mechanism
  the H2D bytes equal misses x row bytes.

The test suite runs a fixed, derandomized profile (`tests/e2e/test_fuzz_tiered.py`); `--long` runs the deep one.
The model is a 2-layer tiny GLM (one full indexer layer and one shared, top-k 64) so compiles stay cheap and
budgets of a few pages already tier.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback

import numpy as np

from experiments.report import stamp

PAGE = 64
TAIL = 2
FORMATS = ("float32", "bf16", "fp8")


def fuzz_model_config():
    from hisparse_jax.config import get_preset

    return get_preset("tiny-glm").replace(num_hidden_layers=2, indexer_types=("full", "shared"),
                                          mlp_layer_types=("dense", "sparse"), index_topk=64)


_MODEL = None


def fuzz_model():
    """The fuzzer's model (built once per process; random weights, seed 0)."""
    global _MODEL
    if _MODEL is None:
        from flax import nnx

        from hisparse_jax.model.decoder import SparseMLAModel

        # with its MTP layer (speculative engine cases); the main weights are those of a model without one
        _MODEL = SparseMLAModel(fuzz_model_config().replace(num_nextn_predict_layers=1), rngs=nnx.Rngs(0),
                                mtp=True)
    return _MODEL


def pages(tokens: int) -> int:
    return -(-tokens // PAGE)


# Every case's budgets lie inside one store capacity per format (`CacheConfig.capacity`), so cases of one format
# and batch bucket run the same compiled programs instead of compiling their own (a case then costs its run, not
# its compiles). It bounds every draw below: generate's <= 4 prompts of <= 11 pages (44 in all, device <= 90,
# host <= 59, max_seq_len <= 1024), the engine's <= 5 of <= 15 pages (75 in all, its roomy reference 77 device
# pages); a draw past it is refused by CacheConfig, loudly. One case in ten keeps shapes = budgets (capacity None),
# the path most users take.
CAPACITY = dict(device_pages=96, host_pages=96, index_pages=None, hot_rows=256, max_seqs=8, max_seq_len=17 * PAGE)


def within_capacity(cache, shared: bool):
    """`cache` with the fuzzer's capacity for its formats (shared=True), or as it is (its budgets are its shapes)."""
    if not shared:
        return cache
    return cache.replace(capacity=cache.replace(**CAPACITY, capacity=None))


# ----- the oracle ---------------------------------------------------------------------------------
def budget_shortfall(kv_lengths: list[int], *, device_pages: int, host_pages: int, index_pages: int,
                     hot_rows: int, max_seqs: int, max_seq_len: int, can_release: bool = True) -> str | None:
    """Why requests needing `kv_lengths` KV positions can never be held together, or None if they can.
    Page arithmetic only: the oracle the fuzzer holds the store to."""
    n = [pages(t) for t in kv_lengths]
    hot = pages(hot_rows)
    dev = [min(k, TAIL + hot) if can_release else k for k in n]
    if len(n) > max_seqs:
        return "max_seqs"
    if max(kv_lengths) > pages(max_seq_len) * PAGE:
        return "max_seq_len"
    if sum(n) > index_pages:
        return "index_pages"
    if can_release and sum(n) > host_pages:
        return "host_pages"
    if sum(dev) > device_pages:
        return "device_pages"
    return None


# ----- generate -----------------------------------------------------------------------------------
@dataclasses.dataclass
class GenerateCase:
    prompts: list[list[int]]
    max_new_tokens: int
    kv_dtype: str
    fetch: str
    device_pages: int
    host_pages: int
    index_pages: int | None
    hot_rows: int
    max_seqs: int
    max_seq_len: int
    shared_capacity: bool = True  # budgets inside the fuzzer's CAPACITY, or shapes = budgets
    index_dtype: str = "auto"  # "int4": MXFP4 indexer keys (the oracle is then the same formats all resident)
    hot_policy: str = "lru"  # the hot buffer's victim order (`CacheConfig.hot_policy`): never changes the tokens
    index_tier: str = "device"  # "host": indexer keys in pinned host memory, exact mode (`CacheConfig.index_tier`):
    # the device keys' top-k bit for bit, so the oracle (device keys) is unchanged. It needs kernels="reference",
    # the only kernels the fuzzer runs (`generate`'s and `EngineConfig`'s default: no case draws Pallas kernels)
    index_summary: str = "box"  # index_tier="host": the page bound (`CacheConfig.index_summary`; "rvq" codebooks:
    # `fuzz_codebooks`)

    def cache_config(self):
        from hisparse_jax.config import CacheConfig

        return within_capacity(CacheConfig(kv_dtype=self.kv_dtype, fetch=self.fetch, device_pages=self.device_pages,
                                           host_pages=self.host_pages, index_pages=self.index_pages,
                                           hot_rows=self.hot_rows, max_seqs=self.max_seqs,
                                           max_seq_len=self.max_seq_len, index_dtype=self.index_dtype,
                                           hot_policy=self.hot_policy, index_tier=self.index_tier,
                                           index_summary=self.index_summary),
                               self.shared_capacity)

    def kv_lengths(self) -> list[int]:
        # the last new token is sampled, never written: the store holds prompt + max_new_tokens - 1 positions
        return [len(p) + self.max_new_tokens - 1 for p in self.prompts]

    def expected_refusal(self) -> str | None:
        c = self.cache_config()
        return budget_shortfall(self.kv_lengths(), device_pages=c.device_pages, host_pages=c.host_pages,
                                index_pages=c.num_index_pages, hot_rows=self.hot_rows, max_seqs=self.max_seqs,
                                max_seq_len=self.max_seq_len)


def draw_prompt_length(rng) -> int:
    """1 token to 9 pages (a request tiers once it outgrows its 2 tail pages + hot buffer: 3-6 pages here), a
    third of the time exactly at a page boundary (+-1)."""
    if rng.random() < 0.35:
        return max(1, int(rng.integers(1, 9)) * PAGE + int(rng.integers(-1, 2)))
    return int(rng.integers(1, 9 * PAGE))


def draw_generate_case(rng, topk: int = 64, vocab: int = 512) -> GenerateCase:
    n = int(rng.integers(1, 5))
    prompts = [rng.integers(0, vocab, draw_prompt_length(rng)).tolist() for _ in range(n)]
    max_new = int(rng.choice([1, 2, int(rng.integers(3, 40)), int(rng.integers(40, 130))]))
    hot_rows = int(rng.choice([topk, topk + topk // 2, 2 * topk, 3 * topk, 4 * topk]))
    kv = [len(p) + max_new - 1 for p in prompts]
    need = [pages(t) for t in kv]
    dmin = sum(min(k, TAIL + pages(hot_rows)) for k in need)
    # one case in four makes exactly one budget one unit too small (it must be refused); the rest are workable
    short = rng.choice(["device", "host", "index", "max_seqs", "max_seq_len"]) if rng.random() < 0.25 else None
    device = dmin + int(rng.choice([0, 0, 1, 2, int(rng.integers(0, sum(need) + 3))]))
    host = sum(need) + int(rng.choice([0, 0, 1, int(rng.integers(0, 16))]))
    index = None if rng.random() < 0.7 else sum(need) + int(rng.choice([0, 3]))
    max_seqs = n + int(rng.choice([0, 0, 0, 2]))
    max_seq_len = pages(max(kv)) * PAGE + int(rng.choice([0, 0, PAGE, 5 * PAGE]))
    if short == "device":
        device = dmin - 1
    elif short == "host":
        host = sum(need) - 1
    elif short == "index":
        index = sum(need) - 1
    elif short == "max_seqs":
        max_seqs = n - 1
    elif short == "max_seq_len":
        max_seq_len = pages(max(kv)) * PAGE - PAGE
    device, max_seqs, max_seq_len = max(device, 1), max(max_seqs, 1), max(max_seq_len, PAGE)
    index = None if index is None else max(index, 1)
    case = GenerateCase(prompts, max_new, str(rng.choice(FORMATS, p=[0.5, 0.3, 0.2])), str(rng.choice(["row", "page"])),
                        device, max(host, 0), index, hot_rows, max_seqs, max_seq_len, bool(rng.random() < 0.9))
    return dataclasses.replace(case, index_dtype=draw_index_dtype(rng))  # (last: earlier draws keep their cases)


def draw_index_dtype(rng) -> str:
    """The indexer key format: the kv format's ("auto") or, one case in five, MXFP4 ("int4")."""
    return "int4" if rng.random() < 0.2 else "auto"


@contextlib.contextmanager
def watch_managers():
    """Check the allocator invariants after every `PageManager.advance` (once per decode step) and record every
    `PageManager` built meanwhile, so the caller can check that its pools end empty."""
    from hisparse_jax.kv.audit import check_manager
    from hisparse_jax.kv.manager import PageManager

    made: list = []
    init, advance = PageManager.__init__, PageManager.advance

    def init_watch(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)

    def advance_watch(self, slots, n=1):
        advance(self, slots, n)
        check_manager(self)

    PageManager.__init__, PageManager.advance = init_watch, advance_watch
    try:
        yield made
    finally:
        PageManager.__init__, PageManager.advance = init, advance


def assert_pools_empty(managers) -> None:
    from hisparse_jax.kv.pool import Tier

    for c in managers:
        used = {t.value: c.pool.num_used(t) for t in Tier}
        assert not c.requests and not any(used.values()), f"pages still in use at the end: {used}"


NEAR_TIE = 1e-5  # two logits this close are a tie XLA:CPU's rounding may break either way (see `same_tokens`)


def same_tokens(what: str, out: list[int], ref: list[int], ref_logits=None) -> bool:
    """True when `out` equals the reference's tokens `ref`. False when they first differ at a step where the
    reference's logits of the two tokens are within NEAR_TIE: XLA:CPU rounds a matmul row differently with the
    batch's row count (docs/limitations.md), so a float32 near tie (seen: 1.2e-7, one ulp) can go either way with
    the batch's composition and the rest of the sequence follows it; such a case is counted as "near_tie", not
    passed and not failed. Anything else raises AssertionError."""
    if out == ref:
        return True
    t = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
    if ref_logits is not None and t < min(len(out), len(ref)):
        margin = abs(float(ref_logits[t][ref[t]]) - float(ref_logits[t][out[t]]))
        if margin <= NEAR_TIE:
            return False
        what += f" (first at step {t}: the reference's logits differ by {margin:.3g} there)"
    raise AssertionError(f"{what}: tokens differ\n got {out}\n ref {ref}")


def same_tokens_or_alone(model, what: str, out: list[int], prompt: list[int], n: int, ref: list[int],
                         ref_logits) -> bool:
    """`same_tokens` against the float32 reference of the whole batch; where that fails, against the prompt's
    contiguous run alone. Rounding that differs with the batch's rows can break a near tie of the INDEXER (two
    positions' scores at the top-k boundary of one prompt position) either way, and the hidden states after it
    differ by far more than a logits tie: seen in seed 0's generate case 24 under `cpu_compile`'s flags, a
    prefill boundary 1.2e-8 apart (about 4 ulp) gave logits 2.6e-3 apart, while the same prompt alone, or the batch
    compiled with XLA's default flags, gives the tiered run's tokens. Output equal to that second reference is
    counted as a near tie (False); a difference from both raises the batch's AssertionError."""
    try:
        return same_tokens(what, out, ref, ref_logits)
    except AssertionError as batched:
        from hisparse_jax.generate import generate

        alone, logits = generate(model, [prompt], n, return_logits=True)
        try:
            same_tokens(what, out, alone[0], np.asarray(logits[0]))
        except AssertionError:
            raise batched from None
        return False


def _reference_tokens(model, case: GenerateCase):
    """(tokens, logits or None): float32, the contiguous path's; bf16 / fp8 or int4 indexer keys, the same formats
    all resident, the indexer keys on the device (a host-tier case's exact mode must give their tokens)."""
    from hisparse_jax.generate import generate

    if case.kv_dtype == "float32" and case.index_dtype == "auto":
        toks, logits = generate(model, case.prompts, case.max_new_tokens, return_logits=True)
        return toks, [np.asarray(x) for x in logits]
    need = sum(pages(t) for t in case.kv_lengths())
    roomy = dataclasses.replace(case, index_tier="device", index_summary="box").cache_config().replace(
        device_pages=need + 2, host_pages=need, index_pages=None, max_seqs=max(case.max_seqs, len(case.prompts)))
    return generate(model, case.prompts, case.max_new_tokens, cache=roomy), None


_CODEBOOKS: dict = {}


def fuzz_codebooks(model, case):
    """The "rvq" codebooks of a case with index_summary="rvq" (else None): fitted once per model on fixed random
    token windows (`index_codebooks.fit_index_codebooks`; any codebooks keep exact mode exact, fitted ones prune)."""
    if case.index_summary != "rvq":
        return None
    if id(model) not in _CODEBOOKS:
        from hisparse_jax.index_codebooks import fit_index_codebooks

        ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 256))
        _CODEBOOKS[id(model)] = (model, fit_index_codebooks(model, ids))
    return _CODEBOOKS[id(model)][1]


def run_generate_case(case: GenerateCase, model=None) -> dict:
    """Run one case and check it against the oracle; raises AssertionError on any disagreement."""
    from hisparse_jax.generate import generate
    from hisparse_jax.kv.spec import BudgetError

    model = model or fuzz_model()
    expect = case.expected_refusal()
    with watch_managers() as managers:
        try:
            toks, stats = generate(model, case.prompts, case.max_new_tokens, cache=case.cache_config(),
                                   return_stats=True, index_codebooks=fuzz_codebooks(model, case))
        except BudgetError as e:
            assert expect is not None, f"refused although the budgets suffice: {e}"
            assert str(e).startswith(expect), f"refused for the wrong reason (expected {expect}): {e}"
            return {"outcome": "refused", "reason": expect}
    assert expect is None, f"not refused although {expect} is too small"
    assert_pools_empty(managers)
    ref, ref_logits = _reference_tokens(model, case)
    exact = all([same_tokens(f"prompt {i}", t, r, None if ref_logits is None else ref_logits[i])
                 if ref_logits is None else same_tokens_or_alone(model, f"prompt {i}", t, case.prompts[i],
                                                                 case.max_new_tokens, r, ref_logits[i])
                 for i, (t, r) in enumerate(zip(toks, ref))])
    if case.fetch == "row":
        row_bytes = managers[0].spec.row_bytes
        assert stats.h2d_bytes == stats.misses * row_bytes, (stats.h2d_bytes, stats.misses, row_bytes)
    return {"outcome": "identical" if exact else "near_tie", "hits": stats.hits, "misses": stats.misses,
            "evicted_pages": stats.evicted_pages, "int4_index": int(case.index_dtype == "int4"),
            "host_index": int(case.index_tier == "host"), "index_h2d_bytes": int(stats.index_h2d_bytes)}


# ----- engine -------------------------------------------------------------------------------------
@dataclasses.dataclass
class EngineCase:
    prompts: list[list[int]]
    max_new: list[int]
    arrivals: list[int]  # engine step at which each request is added
    aborts: dict[int, int]  # request index -> engine step at which it is aborted
    policy: str
    coldness: str
    prefill: str
    prefix_caching: bool
    kv_dtype: str
    fetch: str
    device_pages: int
    host_pages: int
    hot_rows: int
    max_running: int
    prefill_chunk: int
    speculative_tokens: int = 0  # MTP speculative decoding (float32, whole prefill, no prefix caching)
    shared_capacity: bool = True  # budgets inside the fuzzer's CAPACITY, or shapes = budgets
    index_dtype: str = "auto"  # "int4": MXFP4 indexer keys (the oracle is then the same case all resident)
    hot_policy: str = "lru"  # the hot buffer's victim order (`CacheConfig.hot_policy`): never changes the tokens
    index_tier: str = "device"  # "host": indexer keys in pinned host memory, exact mode (see `GenerateCase`)
    index_summary: str = "box"  # index_tier="host": the page bound (see `GenerateCase`)
    admission: str = "vllm"  # preempt / offload's admission rule (`EngineConfig.admission`; `admission_rng`)

    @property
    def lookahead(self) -> int:
        from hisparse_jax.engine.speculative import lookahead

        return lookahead(self.speculative_tokens)

    def cache_config(self):
        from hisparse_jax.config import CacheConfig

        longest = max(len(p) + m for p, m in zip(self.prompts, self.max_new)) + self.lookahead
        return within_capacity(CacheConfig(kv_dtype=self.kv_dtype, fetch=self.fetch, device_pages=self.device_pages,
                                           host_pages=self.host_pages, hot_rows=self.hot_rows,
                                           max_seq_len=pages(longest) * PAGE, index_dtype=self.index_dtype,
                                           speculative_tokens=self.speculative_tokens, hot_policy=self.hot_policy,
                                           index_tier=self.index_tier, index_summary=self.index_summary),
                               self.shared_capacity)

    def engine_config(self):
        from hisparse_jax.engine import EngineConfig

        return EngineConfig(policy=self.policy, admission=self.admission, coldness=self.coldness, prefill=self.prefill,
                            prefix_caching=self.prefix_caching, max_running=self.max_running,
                            prefill_chunk=self.prefill_chunk, check_invariants=True, min_bucket=8,
                            speculative_tokens=self.speculative_tokens)

    def expected_refusal(self, i: int) -> str | None:
        """Whether request i alone can never run (then `add_request` must refuse it)."""
        kv = len(self.prompts[i]) + self.max_new[i] - 1 + self.lookahead
        hisparse = self.policy == "hisparse"
        why = budget_shortfall([kv], device_pages=self.device_pages, host_pages=self.host_pages,
                               index_pages=self.device_pages + self.host_pages, hot_rows=self.hot_rows,
                               max_seqs=self.max_running, max_seq_len=10 ** 9, can_release=hisparse)
        if why is None and self.policy != "preempt" and pages(kv) > self.host_pages:
            why = "host_pages"  # offload swaps a request out whole: every page has a host copy
        if why is None and self.prefill == "chunked" and pages(len(self.prompts[i])) > self.device_pages:
            why = "device_pages"  # a prompt written through the store is resident while it is written
        return why


def draw_engine_case(rng, topk: int = 64, vocab: int = 512) -> EngineCase:
    n = int(rng.choice([4, 3, 5, 2, 1]))  # several requests: pressure needs company
    shared = rng.integers(0, vocab, int(rng.choice([0, PAGE, 2 * PAGE, 2 * PAGE + 17]))).tolist()
    prompts = []
    for _ in range(n):
        length = draw_prompt_length(rng)
        if rng.random() < 0.7:  # mostly long: a request tiers once it outgrows its tail + hot buffer
            length = max(length, int(rng.integers(4 * PAGE, 8 * PAGE)))
        own = rng.integers(0, vocab, length).tolist()
        prompts.append((shared if rng.random() < 0.7 else []) + own)
    max_new = [int(rng.integers(1, 200)) for _ in range(n)]
    arrivals = sorted(int(rng.integers(0, 5)) for _ in range(n))
    aborts = {i: arrivals[i] + int(rng.integers(0, 20)) for i in range(n) if rng.random() < 0.15}
    policy = str(rng.choice(["preempt", "offload", "hisparse"]))
    hot_rows = int(rng.choice([topk, 2 * topk, 4 * topk]))
    need = [pages(len(p) + m - 1) for p, m in zip(prompts, max_new)]
    biggest = max(min(k, TAIL + pages(hot_rows)) if policy == "hisparse" else k for k in need)
    max_running = int(rng.choice([4, 3, 2, 1]))
    # the device either just admits the first `max_running` requests (their prompts, or under HiSparse the
    # others' tail + hot buffer), so their growth is what runs out (preemptions, swaps, releases), or holds
    # a share of what all requests need; never less than the largest alone needs; one case in ten is one
    # page short (refused)
    first = list(range(min(n, max_running)))
    if policy == "hisparse":
        just = sum(min(need[i], TAIL + pages(hot_rows)) for i in first[:-1]) + pages(len(prompts[first[-1]])) + 1
    else:
        just = sum(pages(len(prompts[i])) + 1 for i in first)
    if rng.random() < 0.6:
        device = max(biggest, just + int(rng.choice([0, 0, 1])))
    else:
        device = max(biggest, int(round(sum(need) * float(rng.choice([0.7, 0.5, 0.85, 1.0])))))
    if rng.random() < 0.1:
        device = max(biggest - 1, 1)
    # first options first: hypothesis shrinks towards them
    host = max(0, int(rng.choice([sum(need), sum(need), 2 * max(need), max(need) - 1])))
    kv_dtype = str(rng.choice(FORMATS, p=[0.6, 0.25, 0.15]))
    # bf16 / fp8 prefill through the store only: a whole-prompt forward computes from unrounded keys, so its
    # tokens legitimately differ from rows read back in the store's format (recomputation after preemption too)
    prefill = str(rng.choice(["chunked", "whole"])) if kv_dtype == "float32" else "chunked"
    coldness, prefix_caching = str(rng.choice(["oldest", "recency"])), bool(rng.random() < 0.6)
    fetch, chunk = str(rng.choice(["row", "page"])), int(rng.choice([64, 100, 256]))
    k = 0
    if prefill == "whole" and rng.random() < 0.5:  # MTP speculation: k + 1 rows per request, one union resolve
        k, prefix_caching = int(rng.choice([1, 2, 3])), False
        hot_rows = max(hot_rows, (k + 1) * topk)  # the union of one step's rows must fit
    case = EngineCase(prompts, max_new, arrivals, aborts, policy, coldness, prefill, prefix_caching, kv_dtype, fetch,
                      device, host, hot_rows, max_running, chunk, k, bool(rng.random() < 0.9))
    return with_index_dtype(case, draw_index_dtype(rng))


def with_index_dtype(case: EngineCase, index_dtype: str) -> EngineCase:
    """`case` with that indexer key format. int4 keys, like bf16 / fp8 rows, prefill through the store only: a
    whole prompt's forward scores its own top-k as the model does (exactly), rows written through the store (chunked,
    or after a prefix hit) in the store's format, so whether a prefix was cached would change the tokens."""
    if index_dtype == "int4" and case.prefill == "whole":
        case = dataclasses.replace(case, prefill="chunked", speculative_tokens=0)
    return dataclasses.replace(case, index_dtype=index_dtype)


def _drive(eng, case: EngineCase, admit, max_steps: int = 2000, add=None,
           expected_refusal=None) -> tuple[list[int], list[int]]:
    """Run `eng` through the case's arrivals (requests `admit(i)` says to add) and aborts. Returns (accepted,
    refused) request indices (refusals are checked against the oracle, `case.expected_refusal` unless
    `expected_refusal` is given). `add(eng, i, params)` adds request i (default: `add_request` of its prompt)."""
    from hisparse_jax.engine.request import SamplingParams
    from hisparse_jax.kv.spec import BudgetError

    add = add or (lambda e, i, params: e.add_request(f"r{i}", case.prompts[i], params))
    expected_refusal = expected_refusal or case.expected_refusal

    accepted, refused = [], []
    pending = [i for i in sorted(range(len(case.prompts)), key=lambda i: case.arrivals[i]) if admit(i)]
    while pending or eng.has_unfinished():
        while pending and case.arrivals[pending[0]] <= eng.step_count:
            i = pending.pop(0)
            expect = expected_refusal(i)
            try:
                add(eng, i, SamplingParams(max_new_tokens=case.max_new[i]))
            except BudgetError as e:
                assert expect is not None, f"request {i} refused although it fits alone: {e}"
                refused.append(i)
                continue
            assert expect is None, f"request {i} accepted although {expect} can never hold it"
            accepted.append(i)
        for i, at in case.aborts.items():
            if at == eng.step_count and f"r{i}" in eng.requests:
                eng.abort(f"r{i}")
        if not eng.has_unfinished():
            if pending:
                eng.step_count = case.arrivals[pending[0]]  # idle until the next arrival
            continue
        m = eng.step()
        assert m.step < max_steps, "no end in sight"
        moved = m.running or m.prefill_tokens or m.swaps_in or m.preemptions or m.swaps_out
        assert moved or pending or any(at > eng.step_count for at in case.aborts.values()), \
            f"stalled at step {m.step}: {m}"
    return accepted, refused


def run_engine_case(case: EngineCase, model=None, max_steps: int = 2000) -> dict:
    """Run one engine case against the oracle (refusals at add_request, tokens, invariants, pools empty)."""
    from hisparse_jax.engine.engine import Engine

    model = model or fuzz_model()
    eng = Engine(model, case.cache_config(), case.engine_config(), index_codebooks=fuzz_codebooks(model, case))
    accepted, refused = _drive(eng, case, lambda i: True, max_steps)
    done, exact = _check_end(model, case, eng, [eng.manager], accepted, lambda i: f"request {i}")
    met = eng.metrics()
    return {"outcome": "identical" if exact else "near_tie", "finished": len(done), "refused": len(refused),
            "preemptions": met.preemptions, "vllm_admission": int(case.admission == "vllm"),
            "recomputed_tokens": met.recomputed_tokens, "swap_out_pages": met.swap_out_pages,
            "swaps": met.swaps, "hits": met.hits, "misses": met.misses, "evicted_pages": met.evicted_pages,
            "cached_tokens": met.cached_tokens, "speculative_tokens": case.speculative_tokens,
            "drafts_accepted": sum(m.accepted for m in met.history), "int4_index": int(case.index_dtype == "int4"),
            "host_index": int(case.index_tier == "host"), "index_h2d_bytes": int(met.index_h2d_bytes)}


def _check_end(model, case: EngineCase, eng, managers, accepted: list[int], label) -> tuple[list[int], bool]:
    """The end of an engine run (an `Engine` or a `MeshEngine`, `managers` its ranks' bookkeeping): every rank's
    pools empty and no request left in it, and the finished requests' tokens against the oracle (`same_tokens`;
    `label(i)` names request i in a failure). Returns (finished request indices, whether every one is identical
    rather than a near tie)."""
    for r, c in enumerate(managers):
        used = {t: c.pool.num_used(t) for t in ("device", "index", "host")}
        assert not any(used.values()) and not c.requests, f"rank {r}: pages still in use at the end: {used}"
    reqs = eng.requests
    done = [i for i in accepted if reqs[f"r{i}"].state.value == "finished"]
    if not done:
        return done, True
    ref = _engine_reference(model, case, done, accepted)
    return done, all([same_tokens(label(i), reqs[f"r{i}"].output, *ref[i]) for i in done])


def _engine_reference(model, case: EngineCase, idx: list[int], accepted: list[int]) -> dict[int, tuple]:
    """Request i -> (tokens, logits or None). float32: the contiguous path's greedy tokens and their logits.
    bf16 / fp8 (whose cases prefill through the store, where rows are read back in the store's format), or int4
    indexer keys (scored in the store's format, a whole prefill in the model's): the same
    case — arrivals, aborts, concurrency, prompt chunks — run with every page resident (the `accepted` requests)
    and the indexer keys on the device (a host-tier case's exact mode must give their tokens).
    The schedule matters there: XLA:CPU's matmul rounds a row differently with the batch's row count (M = 8 vs 64
    differ), a float32 difference the store's bf16 rounding can turn into a different token; holding the schedule
    fixed keeps the batch shapes equal where the budget did not change them."""
    from hisparse_jax.engine.engine import Engine
    from hisparse_jax.generate import generate

    if case.kv_dtype == "float32" and case.index_dtype == "auto":
        prompts = [case.prompts[i] for i in idx]
        toks, logits = generate(model, prompts, max(case.max_new[i] for i in idx), return_logits=True)
        return {i: (t[:case.max_new[i]], np.asarray(lg)) for i, t, lg in zip(idx, toks, logits)}
    need = sum(pages(len(case.prompts[i]) + case.max_new[i]) for i in accepted)
    roomy = dataclasses.replace(case, policy="hisparse", device_pages=need + 2, host_pages=need, index_tier="device",
                                index_summary="box")
    cc = roomy.cache_config().replace(index_pages=need + 2)
    eng = Engine(model, cc, roomy.engine_config())
    _drive(eng, roomy, lambda i: i in accepted)
    return {i: (eng.requests[f"r{i}"].output, None) for i in idx}


# ----- the engine across a device mesh ---------------------------------------------------------------
@dataclasses.dataclass
class MeshCase:
    """An engine case (float32, no speculation; its budgets per device) on `devices` ranks."""

    engine: EngineCase
    devices: int
    placement: str
    expert_parallel: bool


def draw_mesh_case(rng, topk: int = 64, vocab: int = 512, max_devices: int | None = None) -> MeshCase:
    if max_devices is None:
        import jax

        max_devices = len(jax.devices())
    case = draw_engine_case(rng, topk, vocab)
    # float32: the contiguous path is the oracle whatever each rank's batches are (bf16 / fp8 tokens may follow a
    # batch's row count: see `_engine_reference`)
    case = dataclasses.replace(case, kv_dtype="float32", speculative_tokens=0, index_dtype="auto")
    devices = min(int(rng.choice([2, 4, 1])), max_devices)
    return MeshCase(case, devices, str(rng.choice(["balanced", "round_robin"])), bool(rng.random() < 0.5))


def run_mesh_case(case: MeshCase, model=None, max_steps: int = 2000) -> dict:
    """An engine case on a `MeshEngine`: refusals as one rank's budget says (every rank has the same), the
    contiguous path's tokens, every rank's allocator invariants after every step and its pools empty at the end."""
    from hisparse_jax import parallel
    from hisparse_jax.engine.mesh import MeshEngine

    model = model or fuzz_model()
    ec = dataclasses.replace(case.engine.engine_config(), placement=case.placement,
                             expert_parallel=case.expert_parallel)
    eng = MeshEngine(model, case.engine.cache_config(), ec, mesh=parallel.data_mesh(case.devices))
    accepted, refused = _drive(eng, case.engine, lambda i: True, max_steps)
    done, exact = _check_end(model, case.engine, eng, eng.managers, accepted,
                             lambda i: f"request {i} (rank {eng.rank_of(f'r{i}')})")
    met = eng.metrics()
    return {"outcome": "identical" if exact else "near_tie", "finished": len(done), "refused": len(refused),
            "preemptions": met.preemptions,
            "swaps": met.swaps, "hits": met.hits, "misses": met.misses, "evicted_pages": met.evicted_pages,
            "cached_tokens": met.cached_tokens, "ranks_used": len({eng.rank_of(f"r{i}") for i in accepted})}


# ----- prefill / decode disaggregation --------------------------------------------------------------
@dataclasses.dataclass
class PDCase:
    """An engine case (float32) whose `imported` requests arrive as prefill exports (`pd.export_prefill` of the
    fuzzer's model) passed as objects or as files (`via`), on an `Engine` (devices = 1, speculation as drawn) or a
    `MeshEngine` over `devices` ranks (no speculation)."""

    engine: EngineCase
    imported: tuple[int, ...]
    via: str
    devices: int

    def expected_refusal(self, i: int) -> str | None:
        """As the engine case's, except that an import's rows arrive whole: a chunked engine does not hold its
        prompt resident while writing it (under HiSparse its older pages land straight in the host tier)."""
        if i not in self.imported or self.engine.prefill != "chunked":
            return self.engine.expected_refusal(i)
        return dataclasses.replace(self.engine, prefill="whole").expected_refusal(i)


def draw_pd_case(rng, topk: int = 64, vocab: int = 512, max_devices: int | None = None) -> PDCase:
    if max_devices is None:
        import jax

        max_devices = len(jax.devices())
    case = draw_engine_case(rng, topk, vocab)
    # float32: the contiguous path is the oracle (in bf16 / fp8 a request preempted after its import recomputes
    # its prompt through the store, rows that legitimately differ from the export's)
    case = dataclasses.replace(case, kv_dtype="float32", index_dtype="auto")
    n = len(case.prompts)
    imported = tuple(i for i in range(n) if rng.random() < 0.7) or (int(rng.integers(0, n)),)
    via = str(rng.choice(["file", "object"]))
    if rng.random() < 0.6:  # pressure: a device that holds about what the largest request alone needs, so that
        # imports land in the host tier (HiSparse), and requests preempt or swap each other (preempt, offload)
        need = [pages(len(p) + m - 1) for p, m in zip(case.prompts, case.max_new)]
        alone = max(min(k, TAIL + pages(case.hot_rows)) if case.policy == "hisparse" else k for k in need)
        case = dataclasses.replace(case, device_pages=alone + int(rng.choice([0, 1, 2])))
    devices = min(int(rng.choice([1, 1, 2, 4])), max_devices)
    if devices > 1:
        case = dataclasses.replace(case, speculative_tokens=0)
    return PDCase(case, imported, via, devices)


def run_pd_case(case: PDCase, model=None, max_steps: int = 2000) -> dict:
    """A P/D case: the imported requests' exports are made by a prefill run of the same model (written to and read
    back from safetensors files when `via` is "file"); then as an engine (or mesh) case: refusals, the contiguous
    path's tokens for every request, invariants, pools empty, and the import bytes accounted."""
    import tempfile

    from hisparse_jax import parallel
    from hisparse_jax.engine.engine import Engine
    from hisparse_jax.engine.mesh import MeshEngine
    from hisparse_jax.engine.pd import export_prefill

    model = model or fuzz_model()
    ec = case.engine
    with tempfile.TemporaryDirectory() as tmp:
        exports, nbytes = {}, {}
        for i in case.imported:
            path = os.path.join(tmp, f"r{i}.safetensors") if case.via == "file" else None
            ex = export_prefill(model, ec.prompts[i], path)
            exports[i], nbytes[i] = (path if path else ex), ex.nbytes

        def add(eng, i, params):
            if i in exports:
                return eng.import_request(f"r{i}", exports[i], params)
            return eng.add_request(f"r{i}", ec.prompts[i], params)

        if case.devices == 1:
            eng = Engine(model, ec.cache_config(), ec.engine_config())
            managers = [eng.manager]
        else:
            eng = MeshEngine(model, ec.cache_config(), ec.engine_config(), mesh=parallel.data_mesh(case.devices))
            managers = eng.managers
        accepted, refused = _drive(eng, ec, lambda i: True, max_steps, add=add,
                                   expected_refusal=case.expected_refusal)
    done, exact = _check_end(model, ec, eng, managers, accepted,
                             lambda i: f"request {i} ({'imported' if i in case.imported else 'local'})")
    met = eng.metrics()
    imported = [i for i in accepted if i in case.imported]
    # an import is written once, at its first admission (an abort may come first; a readmission recomputes)
    assert met.import_bytes <= sum(nbytes[i] for i in imported), f"import bytes {met.import_bytes} > the exports'"
    assert met.import_bytes > 0 or not any(i in case.imported for i in done), "finished imports moved no bytes"
    return {"outcome": "identical" if exact else "near_tie", "finished": len(done), "refused": len(refused),
            "imported": len(imported),
            "imported_from_file": len(imported) if case.via == "file" else 0, "import_bytes": met.import_bytes,
            "preemptions": met.preemptions, "swaps": met.swaps, "hits": met.hits, "misses": met.misses,
            "evicted_pages": met.evicted_pages, "cached_tokens": met.cached_tokens,
            "speculative_tokens": ec.speculative_tokens, "ranks": case.devices}


# ----- hypothesis ---------------------------------------------------------------------------------
class HypothesisChoices:
    """The subset of `numpy.random.Generator` the draw functions use, answered by hypothesis's `data.draw`, so
    the test suite's cases shrink (bulk token ids come from a drawn seed: their values matter little)."""

    def __init__(self, data):
        self.data = data

    def integers(self, low, high=None, size=None):
        from hypothesis import strategies as st

        if high is None:
            low, high = 0, low
        if size is not None:
            seed = self.data.draw(st.integers(0, 2 ** 16), label="token seed")
            return np.random.default_rng(seed).integers(low, high, size)
        return self.data.draw(st.integers(int(low), int(high) - 1))

    def choice(self, options, p=None):
        from hypothesis import strategies as st

        return self.data.draw(st.sampled_from(list(options)))

    def random(self):
        from hypothesis import strategies as st

        return self.data.draw(st.sampled_from([0.5, 0.0, 0.2, 0.8, 0.99]))  # shrinks towards 0.5: the usual


# ----- the long run -------------------------------------------------------------------------------
KINDS = ("generate", "engine", "mesh", "pd")  # append only: a case is drawn from its kind's index


def case_rng(seed: int, kind: str, k: int):
    """The random stream of case `k` of a kind: any case is redrawn alone from (seed, kind, k)."""
    return np.random.default_rng([seed, KINDS.index(kind), k])


def admission_rng(seed: int, kind: str, k: int):
    """The stream that draws case `k`'s admission rule (engine cases): apart from `case_rng`, so that the cases a
    seed drew before the rule existed are drawn the same."""
    return np.random.default_rng([seed, KINDS.index(kind), k, 1])


INDEX_DTYPE_KINDS = ("generate", "engine")  # the kinds whose cases may store int4 indexer keys (see draw_index_dtype)


def run_cases(kind: str, first: int, count: int, seed: int, model, log=print, index_dtype: str = "drawn",
              hot_policy: str = "lru", index_tier: str = "device", index_summary: str = "box") -> dict:
    """Cases first .. first + count - 1 of a kind, in this process: their outcomes, the sums of their counters
    (how much pressure they exercised), how many had each counter > 0, and every failure with its case.
    index_dtype: "drawn" (as the case draws it) or a format every case gets ("int4"; generate and engine only).
    hot_policy: every case's hot buffer policy (generate and engine only; the oracle's tokens do not depend on it).
    index_tier: where every case keeps its indexer keys (generate and engine only; "host": exact mode, held to the
    oracle's device-key tokens); index_summary: with index_tier "host", every case's page bound ("rvq": an engine
    case drawn with speculative decoding runs without it, which "rvq" does not take)."""
    from hisparse_jax.cpu_compile import drop_programs_near_map_limit, memory_maps

    draw = {"generate": draw_generate_case, "engine": draw_engine_case, "mesh": draw_mesh_case,
            "pd": draw_pd_case}[kind]
    run = {"generate": run_generate_case, "engine": run_engine_case, "mesh": run_mesh_case, "pd": run_pd_case}[kind]
    out = {"cases": 0, "outcomes": {}, "totals": {}, "cases_with_nonzero": {}, "failures": [], "crashes": []}
    t0 = time.time()
    for k in range(first, first + count):
        case = draw(case_rng(seed, kind, k))
        if index_dtype != "drawn":
            case = (with_index_dtype(case, index_dtype) if kind == "engine"
                    else dataclasses.replace(case, index_dtype=index_dtype))
        if hot_policy != "lru":
            case = dataclasses.replace(case, hot_policy=hot_policy)
        if index_tier != "device":
            case = dataclasses.replace(case, index_tier=index_tier, index_summary=index_summary)
        if index_summary == "rvq" and kind == "engine":
            case = dataclasses.replace(case, speculative_tokens=0)
        if kind == "engine":
            from hisparse_jax.engine.scheduler import ADMISSIONS

            case = dataclasses.replace(case, admission=str(admission_rng(seed, kind, k).choice(ADMISSIONS)))
        try:
            res = run(case, model)
            out["outcomes"][res["outcome"]] = out["outcomes"].get(res["outcome"], 0) + 1
            for key, v in res.items():
                if isinstance(v, int) and key != "outcome":
                    out["totals"][key] = out["totals"].get(key, 0) + v
                    out["cases_with_nonzero"][key] = out["cases_with_nonzero"].get(key, 0) + (v > 0)
        except Exception as e:  # noqa: BLE001 - every failure is recorded with its case
            out["failures"].append({"case_index": k, "case": dataclasses.asdict(case),
                                    "error": f"{type(e).__name__}: {e}"[:2000],
                                    "traceback": traceback.format_exc()[-3000:]})
            log(f"[{kind} {k}] FAIL {type(e).__name__}: {str(e)[:300]}")
        out["cases"] += 1
        # the cases without the shared capacity, and each batch bucket and prompt length, still compile programs
        # of their own; each live one holds memory maps, and at the kernel's limit XLA:CPU segfaults
        maps = memory_maps()
        out["most_maps"] = max(out.get("most_maps", 0), maps[0] if maps else 0)
        out["programs_dropped"] = out.get("programs_dropped", 0) + drop_programs_near_map_limit()
        if out["cases"] % 10 == 0 or out["cases"] == count:
            log(f"{kind}: cases {first}..{k}: {out['outcomes']}, {len(out['failures'])} failures, "
                f"{time.time() - t0:.0f} s, memory maps {maps[0] if maps else '?'} of {maps[1] if maps else '?'}; "
                f"cases with > 0: {out['cases_with_nonzero']}")
    out["seconds"] = round(time.time() - t0, 1)
    return out


def merge(into: dict, part: dict) -> dict:
    """Add one group's results to a kind's."""
    into["cases"] = into.get("cases", 0) + part["cases"]
    for key in ("outcomes", "totals", "cases_with_nonzero"):
        into.setdefault(key, {})  # (a group whose every case failed has none)
        for name, v in part[key].items():
            into[key][name] = into[key].get(name, 0) + v
    for key in ("failures", "crashes"):
        into.setdefault(key, []).extend(part[key])
    into["seconds"] = round(into.get("seconds", 0) + part["seconds"], 1)
    into["most_maps"] = max(into.get("most_maps", 0), part.get("most_maps", 0))
    into["programs_dropped"] = into.get("programs_dropped", 0) + part.get("programs_dropped", 0)
    return into


def run_group(kind: str, first: int, count: int, seed: int, index_dtype: str = "drawn", hot_policy: str = "lru",
              index_tier: str = "device", index_summary: str = "box") -> dict:
    """Cases first .. first + count - 1 of a kind in a process of their own: a crash of the process (a segfault
    inside XLA, the kernel's OOM killer) is recorded with the cases it ran, how to rerun them and the end of its
    output, and does not end the run."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        part_path = os.path.join(tmp, "part.json")
        argv = [sys.executable, os.path.abspath(__file__), "--only", kind, "--first", str(first), "--examples",
                str(count), "--seed", str(seed), "--group-size", "0", "--index-dtype", index_dtype, "--hot-policy",
                hot_policy, "--index-tier", index_tier, "--index-summary", index_summary, "--out", part_path]
        t0 = time.time()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                     os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)})
        tail = []
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail = (tail + [line])[-40:]
        rc = proc.wait()
        if os.path.exists(part_path):
            with open(part_path) as f:
                return json.load(f)["kinds"][kind]
    rerun = f"PYTHONPATH=. python {' '.join(argv[1:-2])}"
    crash = {"kind": kind, "first": first, "cases": count, "seed": seed, "returncode": rc, "rerun": rerun,
             "output_tail": "".join(tail)[-3000:]}
    print(f"[{kind} {first}..{first + count - 1}] CRASH: the group's process ended with {rc}; rerun: {rerun}",
          flush=True)
    return {"cases": 0, "outcomes": {}, "totals": {}, "cases_with_nonzero": {}, "failures": [], "crashes": [crash],
            "seconds": round(time.time() - t0, 1)}


def main(argv=None) -> int:
    from hisparse_jax.config import HOT_POLICIES
    from hisparse_jax.formats import INDEX_SUMMARIES, INDEX_TIERS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", action="store_true",
                    help="the deep profile (200 generate + 80 engine + 40 mesh + 40 pd cases)")
    ap.add_argument("--examples", type=int, default=None, help="cases of each kind (default 40, or --long's)")
    ap.add_argument("--first", type=int, default=0,
                    help="index of the first case (a case is drawn from --seed, its kind and its index alone)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=list(KINDS), default=None)
    ap.add_argument("--group-size", type=int, default=64,
                    help="cases per process (each group runs in a process of its own, so a crash is recorded and "
                         "the run goes on); 0: all in this process")
    ap.add_argument("--index-dtype", choices=("drawn", "int4"), default="drawn",
                    help="indexer key format: as each case draws it (one in five int4), or int4 for every case "
                         f"(kinds {', '.join(INDEX_DTYPE_KINDS)} only)")
    ap.add_argument("--hot-policy", choices=HOT_POLICIES, default="lru",
                    help="every case's hot buffer policy (`CacheConfig.hot_policy`; kinds "
                         f"{', '.join(INDEX_DTYPE_KINDS)} only): the tokens must not depend on it")
    ap.add_argument("--index-tier", choices=INDEX_TIERS, default="device",
                    help="where every case keeps its indexer keys (`CacheConfig.index_tier`; kinds "
                         f"{', '.join(INDEX_DTYPE_KINDS)} only): host is exact mode, held to the device keys' tokens")
    ap.add_argument("--index-summary", choices=INDEX_SUMMARIES, default="box",
                    help="with --index-tier host, every case's page bound (`CacheConfig.index_summary`; rvq codebooks "
                         "fitted to the fuzz model once)")
    ap.add_argument("--out", default="experiments/results/fuzz_tiered.json")
    ap.add_argument("--xla-defaults", action="store_true",
                    help="compile with XLA's default optimisation (by default the fuzzer compiles as the tests do, "
                         "hisparse_jax.cpu_compile: the same values, compiles several times faster)")
    a = ap.parse_args(argv)
    if a.examples is not None and a.examples < 1:
        ap.error("--examples must be >= 1")
    if a.first < 0 or a.group_size < 0:
        ap.error("--first and --group-size must be >= 0")
    counts = {"generate": 200 if a.long else 40, "engine": 80 if a.long else 20, "mesh": 40 if a.long else 10,
              "pd": 40 if a.long else 10}
    if a.examples:
        counts = {k: a.examples for k in counts}
    kinds = [a.only] if a.only else list(KINDS)
    if a.hot_policy != "lru" and set(kinds) - set(INDEX_DTYPE_KINDS):
        ap.error(f"--hot-policy {a.hot_policy} applies to --only {' or '.join(INDEX_DTYPE_KINDS)}")
    if a.index_dtype != "drawn" and set(kinds) - set(INDEX_DTYPE_KINDS):
        ap.error(f"--index-dtype {a.index_dtype} applies to --only {' or '.join(INDEX_DTYPE_KINDS)} (the mesh and "
                 "P/D cases keep the contiguous path as their oracle)")
    if a.index_tier != "device" and set(kinds) - set(INDEX_DTYPE_KINDS):
        ap.error(f"--index-tier {a.index_tier} applies to --only {' or '.join(INDEX_DTYPE_KINDS)}")
    if a.index_summary != "box" and a.index_tier != "host":
        ap.error(f"--index-summary {a.index_summary} needs --index-tier host")
    if a.index_tier == "host" and a.hot_policy != "lru":
        ap.error(f"--index-tier host needs --hot-policy lru (got {a.hot_policy}): score_ema averages every "
                 "position's score each step, which host-tier keys do not compute")
    forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    if {"mesh", "pd"} & set(kinds) and not forced:
        # read when jax starts its backends (not yet): 4 host devices for the mesh cases where there is no GPU
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4")
    if not a.xla_defaults:
        from hisparse_jax.cpu_compile import request_fast_compile

        request_fast_compile()  # before any group starts: they inherit the flags and skip the probe
    out = {**stamp(), "seed": a.seed,
           "profile": "long" if a.long else "default", "first": a.first, "group_size": a.group_size,
           "index_dtype": a.index_dtype, "hot_policy": a.hot_policy, "index_tier": a.index_tier,
           "index_summary": a.index_summary, "xla_flags": os.environ.get("XLA_FLAGS", ""), "kinds": {}}
    model = fuzz_model() if a.group_size == 0 else None

    def write(complete: bool) -> None:  # after every group too: a long run stopped midway keeps what it ran
        with open(a.out + ".tmp", "w") as f:
            json.dump({**out, "complete": complete}, f, indent=1)
        os.replace(a.out + ".tmp", a.out)

    for kind in kinds:
        if a.group_size == 0:
            out["kinds"][kind] = run_cases(kind, a.first, counts[kind], a.seed, model,
                                           log=lambda m: print(m, flush=True), index_dtype=a.index_dtype,
                                           hot_policy=a.hot_policy, index_tier=a.index_tier,
                                           index_summary=a.index_summary)
            continue
        total: dict = {}
        for start in range(a.first, a.first + counts[kind], a.group_size):
            n = min(a.group_size, a.first + counts[kind] - start)
            merge(total, run_group(kind, start, n, a.seed, a.index_dtype, a.hot_policy, a.index_tier,
                                   a.index_summary))
            out["kinds"][kind] = total
            write(complete=False)
            print(f"{kind}: {total['cases']} cases run, {total['outcomes']}, {len(total['failures'])} failures, "
                  f"{len(total['crashes'])} crashed groups; cases with > 0: {total['cases_with_nonzero']}",
                  flush=True)
        out["kinds"][kind] = total
    failures = sum(len(k["failures"]) + len(k["crashes"]) for k in out["kinds"].values())
    write(complete=True)
    print(f"wrote {a.out}: {failures} failures or crashed groups")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
