"""`EngineConfig`: what an `Engine` (and a `MeshEngine`) does with its requests: the memory policy, admission,
coldness, prefill mode, batch sizes, kernels, speculative decoding, and on a mesh the placement. Checked when
made: an unknown name or a size out of range is refused naming the field."""

from __future__ import annotations

import dataclasses

from hisparse_jax.config import MAX_SPECULATIVE_TOKENS
from hisparse_jax.engine import speculative
from hisparse_jax.engine.scheduler import POLICIES, PREFILL_MODES, check_admission
from hisparse_jax.kv import tiered
from hisparse_jax.kv.manager import COLDNESS
from hisparse_jax.validation import check_int

PLACEMENTS = ("balanced", "round_robin")  # a MeshEngine's choice of rank for a new request


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """policy: "preempt" | "offload" | "hisparse"; coldness (hisparse): "oldest" | "recency";
    admission (preempt / offload): "vllm" (vLLM's rule: admitted on the prompt's pages, KV and indexer keys alike,
    grown page by page; a running request that cannot grow preempts or swaps out the newest admitted one) or
    "reserve" (admitted only when the indexer pages of its whole length fit beside every admitted request's: never
    preempts or swaps); see `engine.scheduler`. HiSparse ignores it: it keeps its own rule (the keys of the whole
    length and the device floor), the same under either value, so its tokens and metrics do not change;
    prefill: "chunked" (prompt rows ride in the decode batch, `prefill_chunk` per step) | "whole" (one full
    causal forward per admitted prompt, written straight into the store);
    max_running: admitted requests at most (also the store's request slots); prefill_chunk: prompt tokens
    per step; min_bucket: smallest batch bucket; log_path: optional JSON-lines log of per-step metrics;
    check_invariants: verify the allocator after every step (tests);
    prefix_caching: share full prompt pages (hash-chained, refcounted, on every tier) across requests and
    prefill only what is not cached;
    kernels: what the decode step runs, as in `generate`: "reference" (jnp), "pallas" (the Pallas GPU kernels;
    needs a GPU backend), "pallas_mosaic" (the same, the sparse MLA decode and the indexer's scores on the Mosaic GPU
    backend; jax >= 0.11), or either interpreted ("pallas_interpret", "pallas_mosaic_interpret"; any backend);
    speculative_tokens: k > 0 turns on MTP speculative decoding (`engine.speculative`): each step verifies k + 1
    rows per request and drafts the next k with the model's MTP layer (the model must be built with it:
    `SparseMLAModel(cfg, mtp=True)` / `load_pretrained(path, mtp=True)`); speculative_acceptance: "match" (a
    draft is accepted when it equals the token the request's (seed, position) draw gives: outputs identical to
    k = 0, greedy and sampled) or "rejection" (the standard rule: accepted with the target's probability of it;
    same distribution, more accepted when sampling, tokens depend on the drafts). Needs prefill="whole" and
    prefix_caching=False (prompts whose rows go through the store in chunks are not carried by the speculative
    step yet);
    placement (a `MeshEngine` only): which rank a new request goes to — "balanced" (the rank already holding most
    of its prompt's pages (prefix caching), then the least loaded) or "round_robin";
    expert_parallel (a `MeshEngine` only): split the routed experts over the mesh's devices (each holds 1/N of every
    MoE layer's experts; each MoE layer gathers the ranks' tokens and scatters the sums back) instead of
    replicating every parameter."""

    policy: str = "hisparse"
    admission: str = "vllm"
    coldness: str = "oldest"
    prefill: str = "chunked"
    max_running: int = 32
    prefill_chunk: int = 256
    min_bucket: int = 8
    log_path: str | None = None
    check_invariants: bool = False
    prefix_caching: bool = True
    kernels: str = "reference"
    speculative_tokens: int = 0
    speculative_acceptance: str = "match"
    placement: str = "balanced"
    expert_parallel: bool = False

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        check_admission(self.admission)
        if self.coldness not in COLDNESS:
            raise ValueError(f"unknown coldness {self.coldness!r}; choose one of {', '.join(COLDNESS)}")
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"unknown prefill mode {self.prefill!r}; choose one of {', '.join(PREFILL_MODES)}")
        for name in ("max_running", "prefill_chunk", "min_bucket"):  # integers (their sizes: the memory account)
            check_int(name, getattr(self, name), lo=1)
        if self.kernels not in tiered.KERNELS:
            raise ValueError(f"unknown kernels {self.kernels!r}; choose one of {', '.join(tiered.KERNELS)}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.placement!r}; choose one of {', '.join(PLACEMENTS)}")
        k = check_int("speculative_tokens", self.speculative_tokens, lo=0, hi=MAX_SPECULATIVE_TOKENS)
        if self.speculative_acceptance not in speculative.ACCEPTANCE:
            raise ValueError(f"unknown speculative_acceptance {self.speculative_acceptance!r}; choose one of "
                             f"{', '.join(speculative.ACCEPTANCE)}")
        if k and (self.prefill != "whole" or self.prefix_caching):
            raise ValueError(f"speculative_tokens={k} needs prefill='whole' and prefix_caching=False (got prefill="
                             f"{self.prefill!r}, prefix_caching={self.prefix_caching}): prompt rows written "
                             "through the store in chunks are not carried by the speculative step yet")

    @property
    def max_step_rows(self) -> int:
        """Batch rows of the largest step this engine can run (its bucket): every running request's decode rows
        (k + 1 each with speculative decoding) and a prefill chunk's rows, padded to a power of two >= min_bucket.
        The memory account counts the step's temporaries at this size (`kv.account.store_costs`)."""
        rows = self.max_running * (self.speculative_tokens + 1)
        rows += self.prefill_chunk if self.prefill == "chunked" else 0
        return max(self.min_bucket, 1 << (rows - 1).bit_length())
