"""Requests and their sampling parameters."""

from __future__ import annotations

import dataclasses
import enum
import functools

from hisparse_jax.validation import check_float, check_int, check_token_list

SEED_RANGE = 2 ** 32  # a request's PRNG stream is keyed by a uint32 seed


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued: not admitted yet, or preempted (its KV dropped; recomputed on readmission)
    PREFILLING = "prefilling"  # admitted; its prompt (or recomputed tokens) is being written chunk by chunk
    RUNNING = "running"  # decoding
    SWAPPED = "swapped"  # offload policy: its whole KV is on the host; must be swapped in before decoding
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"  # its own work raised inside a step (`Request.error` says what); the others went on


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """max_new_tokens; temperature 0 = greedy; top_p nucleus; seed: per-request PRNG stream in [0, 2**32) (a
    token's draw depends only on (seed, position), so outputs do not depend on batching or scheduling);
    eos_token_id: one id or a sequence of ids that end the output.

    Every field is checked here, at the door (types and ranges, `ValueError` naming the field): a value that
    would only fail inside an engine step is refused before the request exists."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    eos_token_id: tuple[int, ...] = ()

    def __post_init__(self):
        put = functools.partial(object.__setattr__, self)
        put("max_new_tokens", check_int("max_new_tokens", self.max_new_tokens, lo=1))
        put("temperature", check_float("temperature", self.temperature, lo=0))
        put("top_p", check_float("top_p", self.top_p, lo=0, lo_open=True, hi=1))
        put("seed", check_int("seed", self.seed, lo=0, hi=SEED_RANGE - 1))
        put("eos_token_id", check_token_list("eos_token_id", self.eos_token_id))


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: int = 0
    state: RequestState = RequestState.WAITING
    slot: int = -1
    output: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens of `kv_tokens` whose KV is in the store
    cached_tokens: int = 0  # prompt tokens taken from shared (prefix-cached) pages instead of computed (all admissions)
    preemptions: int = 0
    swaps: int = 0
    first_token_step: int | None = None
    finished_at: int | None = None
    error: str | None = None  # why it FAILED
    imported: object = None  # a `pd.PrefillExport` whose rows replace the prompt's prefill (until written)
    lookahead: int = 0  # positions past the pending token a speculative step writes (`speculative.lookahead`)
    drafts: list[int] = dataclasses.field(default_factory=list)  # speculative: the next step's drafts (-1: none)
    drafted: int = 0  # draft tokens verified for this request so far
    accepted: int = 0  # of which accepted

    @property
    def kv_tokens(self) -> list[int]:
        """Tokens whose KV must be in the store before the next decode step: the prompt and every generated
        token but the last (which the next step feeds in)."""
        return self.prompt + self.output[:-1] if self.output else list(self.prompt)

    @property
    def max_len(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def max_kv_len(self) -> int:
        """KV positions the request holds at its longest: the last sampled token is never written (plus the
        positions a speculative step writes past its pending token)."""
        return self.max_len - 1 + self.lookahead

    @property
    def finished(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED)

    def done_generating(self) -> bool:
        p = self.params
        return len(self.output) >= p.max_new_tokens or (bool(self.output) and self.output[-1] in p.eos_token_id)
