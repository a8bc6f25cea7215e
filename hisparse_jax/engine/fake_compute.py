"""The engine's host half with the model replaced by a fake: the real `Scheduler` over the real `TieredCache`
bookkeeping (NumPy only: nothing is compiled, no device array exists), committed each step as `Engine.begin_step`
/ `Engine.finish_step` commit a step — whole prompts written and registered, prompt chunks advanced, decode rows
appended, one token per emitting request — with each token a function of (seed, position) instead of a model's.

What it is for: checking the scheduler's liveness (`tests/test_liveness.py`, `experiments/liveness.py`). Each
`FakeEngine.step` returns which admitted requests progressed (a decode row, prompt rows, a whole prompt) and, for
those that did not, the reason the step's plan states (`StepPlan.waits`; None: none stated), and counts every
`OutOfPages` the manager raised inside `schedule` (caught there or not).

    eng = FakeEngine(model_cfg, CacheConfig(device_pages=24, ...), policy="hisparse", max_running=4)
    eng.add_request("a", prompt, max_new_tokens=16)
    while eng.has_unfinished():
        s = eng.step()
        assert not s.unexplained and not s.out_of_pages

`run_workload(Workload(...))` runs a whole workload (requests arriving at given steps, under given budgets) and
checks the liveness properties on the way: every admitted request progresses each step or has a stated reason;
no `OutOfPages` escapes `schedule` or is raised inside it; every request finishes within `step_bound(workload)`;
the pools are empty at the end (and the allocator consistent on the way). `random_workload(rng)` draws one.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from hisparse_jax.config import CacheConfig, ModelConfig, get_preset
from hisparse_jax.units import PAGE_SIZE
from hisparse_jax.engine.request import Request, RequestState, SamplingParams
from hisparse_jax.engine.scheduler import (ADMISSIONS, POLICIES, PREFILL_MODES, Scheduler, StepPlan, pages,
                                           policy_cache)
from hisparse_jax.kv.budget import BudgetError, check_batch_fits
from hisparse_jax.kv.manager import COLDNESS, TieredCache
from hisparse_jax.kv.pool import OutOfPages, Tier


def fake_token(seed: int, position: int, vocab: int) -> int:
    """The fake model's token at `position` of a request with `seed` (depends on nothing else, as the engine's
    sampling depends only on (seed, position))."""
    return (seed * 1_000_003 + position * 7_919 + 17) % vocab


@dataclasses.dataclass
class FakeStep:
    """One `FakeEngine.step`: its plan; progressed: request id -> "decode" | "prefill" | "whole" (prompt rows
    computed or a token decoded this step); stalled: id of an admitted request (or one preempted this step) that did
    not progress -> the reason the plan states (None: no reason stated); out_of_pages: `OutOfPages` raised inside
    the manager during `schedule` (the plan lists the policy's actions: preempted, swapped out, swapped in)."""

    step: int
    plan: StepPlan
    progressed: dict[str, str]
    stalled: dict[str, str | None]
    out_of_pages: int

    @property
    def unexplained(self) -> list[str]:
        """Requests that neither progressed nor were given a reason this step."""
        return [rid for rid, why in self.stalled.items() if why is None]


class FakeEngine:
    """`Engine`'s host half (schedule and commit) over a `TieredCache` sized by `cache` for `model`, the policy,
    prefill mode and budgets as in `EngineConfig`, with `fake_token` for the model."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, *, policy: str = "hisparse", prefill: str = "chunked",
                 max_running: int = 8, prefill_chunk: int = 256, prefix_caching: bool = True,
                 coldness: str = "oldest", admission: str = "vllm"):
        device_keys = cache.num_index_pages  # as `Engine`: the device's key budget before `policy_cache`
        cache = policy_cache(cache, policy, max_running, cache.speculative_tokens, admission)  # (speculative
        # rows kept: they size the hot buffer)
        self.model_cfg = model
        self.manager = TieredCache(model, cache, victim_order=COLDNESS[coldness])
        self.manager.partial_eviction = policy == "hisparse"
        self.manager.prefix_caching = prefix_caching
        self.policy, self.prefill = policy, prefill
        self.scheduler = Scheduler(self.manager, policy, max_running=max_running, prefill_chunk=prefill_chunk,
                                   prefill=prefill, admission=admission, device_keys=device_keys)
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self.out_of_pages = 0  # OutOfPages raised inside the manager during schedule (all steps)
        self._raised = 0
        for name in ("admit", "reserve", "swap_in", "evict"):  # count what the manager raises, caught or not
            setattr(self.manager, name, self._counting(getattr(self.manager, name)))

    def _counting(self, fn):
        def wrapped(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except OutOfPages:
                self._raised += 1
                raise
        return wrapped

    # ----- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: list[int], max_new_tokens: int, *, seed: int = 0,
                    eos_token_id=()) -> Request:
        """Queue a request; BudgetError when it could never run alone (as `Engine.add_request` refuses it)."""
        c = self.manager
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = SamplingParams(max_new_tokens=max_new_tokens, seed=seed, eos_token_id=eos_token_id)
        total = len(prompt) + max_new_tokens
        check_batch_fits(c.budget, [total - 1], releasable=c.releasable)  # the last new token is never written
        self.scheduler.check_ever_fits(request_id, total - 1)
        if self.prefill == "chunked" and pages(len(prompt)) > c.budget.device_pages:
            raise BudgetError(f"request {request_id!r}: its prompt ({pages(len(prompt))} pages) is written through "
                              f"the store and must be resident; device_pages is {c.budget.device_pages}")
        r = Request(request_id, list(prompt), params, arrival=self.step_count)
        self.requests[request_id] = r
        self.scheduler.waiting.append(r)
        return r

    def has_unfinished(self) -> bool:
        return any(not r.finished for r in self.requests.values())

    # ----- one step ------------------------------------------------------------------------------
    def step(self) -> FakeStep:
        """Schedule, commit as the engine would after a step with the fake model's tokens, and report."""
        c, sched = self.manager, self.scheduler
        self._raised = 0
        plan = sched.schedule(self.step_count)
        raised = self._raised
        self.out_of_pages += raised
        waits = dict(getattr(plan, "waits", {}) or {})
        progressed: dict[str, str] = {}
        # whole prompts: written and registered, each committing on its own (its first token at once)
        for r in plan.whole:
            c.record_prefill(r.slot, len(r.kv_tokens))
            c.register_prefix(r.slot, r.kv_tokens)
            r.computed = len(r.kv_tokens)
            r.state = RequestState.RUNNING
            progressed[r.request_id] = "whole"
            if not r.output:
                self._commit([r])
        # the batch: decode rows and prompt chunks
        emit = list(plan.decode)
        completed = []
        for r, start, n in plan.prefill:
            progressed[r.request_id] = "prefill"
            if start + n == len(r.kv_tokens):
                completed.append(r)
                if not r.output:
                    emit.append(r)
        for r in plan.decode:
            progressed[r.request_id] = "decode"
        stalled = {r.request_id: waits.get(r.request_id) for r in sched.active if r.request_id not in progressed}
        for r in plan.preempted:  # back in the queue (unless readmitted at once)
            if r.request_id not in progressed:
                stalled.setdefault(r.request_id, waits.get(r.request_id))
        for r, start, n in plan.prefill:
            r.computed = start + n
            c.set_length(r.slot, r.computed)
        for r in completed:
            c.allow_eviction(r.slot)
            c.register_prefix(r.slot, r.kv_tokens)
            r.state = RequestState.RUNNING
        c.advance([r.slot for r in plan.decode])
        self._commit(emit)
        c.take_updates()  # (the engine applies them to its store; nothing to apply here)
        out = FakeStep(self.step_count, plan, progressed, stalled, raised)
        self.step_count += 1
        return out

    def _commit(self, rs: list[Request]) -> None:
        vocab = self.model_cfg.vocab_size
        for r in rs:
            r.output.append(fake_token(r.params.seed, len(r.prompt) + len(r.output), vocab))
            if r.first_token_step is None:
                r.first_token_step = self.step_count
            if r.done_generating():
                self.scheduler.finish(r, RequestState.FINISHED)
                r.finish_step = self.step_count

    # ----- checks --------------------------------------------------------------------------------
    def pool_empty(self) -> bool:
        """No page of any tier in use (cached prefix pages are free) and no request slot held."""
        c = self.manager
        return not c.requests and all(c.pool.num_used(t) == 0 and not c.pool.refcounts(t).any() for t in Tier)


# ----- whole workloads ---------------------------------------------------------------------------------------
def liveness_model() -> ModelConfig:
    """The model whose layout sizes the workloads' stores (tiny-glm; top-k 32, so hot buffers of 1-3 pages)."""
    return get_preset("tiny-glm").replace(index_topk=32)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Engine settings, budgets and requests: (arrival step, prompt, max_new_tokens, eos id or -1)."""

    policy: str
    prefill: str
    prefix_caching: bool
    max_running: int
    prefill_chunk: int
    device_pages: int
    host_pages: int
    index_pages: int
    hot_rows: int
    requests: tuple[tuple[int, tuple[int, ...], int, int], ...]
    admission: str = "vllm"

    def cache_config(self) -> CacheConfig:
        longest = max((len(p) + n for _, p, n, _ in self.requests), default=1)
        return CacheConfig(kv_dtype="float32", device_pages=self.device_pages, host_pages=self.host_pages,
                           index_pages=self.index_pages, hot_rows=self.hot_rows,
                           max_seq_len=pages(longest) * PAGE_SIZE)


def step_bound(w: Workload) -> int:
    """Steps within which every request must have finished: the last arrival, then the requests one after another
    — each one's prompt written in prefill chunks (under preempt / offload with everything it may generate, and
    once more for every page it may add: a preemption each), one step per new token — plus slack. A scheduler
    that moves some request forward every step stays below it (running one request at a time comes within a few
    percent of it); one that leaves a request starving passes it."""
    total = 0
    for _, p, n, _ in w.requests:
        kv = len(p) + n
        recomputes = 1 + (pages(kv) - pages(len(p)) + 1 if w.policy != "hisparse" else 0)
        total += recomputes * (math.ceil(kv / w.prefill_chunk) + 2) + n + 2
    last = max((a for a, _, _, _ in w.requests), default=0)
    return last + total + 16


@dataclasses.dataclass
class LivenessReport:
    """What `run_workload` saw: steps taken and the bound; requests refused at the door (BudgetError: they could
    never run alone); failures (empty: every property held); pressure counts (requests admitted sharing a prefix,
    steps with prompt chunks, preemptions, swap-outs, HiSparse page releases, whole prefills) and wait reasons."""

    steps: int
    bound: int
    requests: int
    refused: int
    failures: list[str]
    counts: dict[str, int]
    waits: dict[str, int]


def run_workload(w: Workload, model: ModelConfig | None = None, check_every: int = 1) -> LivenessReport:
    """Run `w` on a `FakeEngine` and check the liveness properties (see the module docstring); the allocator's
    invariants every `check_every` steps. Never raises for a property: each broken one is a line in `failures`."""
    model = model or liveness_model()
    eng = FakeEngine(model, w.cache_config(), policy=w.policy, prefill=w.prefill, max_running=w.max_running,
                     prefill_chunk=w.prefill_chunk, prefix_caching=w.prefix_caching, admission=w.admission)
    bound = step_bound(w)
    failures: list[str] = []
    counts = {"prefix_shared": 0, "prefix_tokens": 0, "chunk_steps": 0, "preemptions": 0, "swaps": 0,
              "hisparse_releases": 0, "whole": 0, "steps": 0}
    waits: dict[str, int] = {}
    pending = sorted(enumerate(w.requests), key=lambda x: (x[1][0], x[0]))
    refused = 0
    while pending or eng.has_unfinished():
        while pending and pending[0][1][0] <= eng.step_count:
            i, (_, prompt, n, eos) = pending.pop(0)
            try:
                eng.add_request(f"r{i}", list(prompt), n, seed=i, eos_token_id=() if eos < 0 else (eos,))
            except BudgetError:
                refused += 1
        if eng.step_count >= bound:
            left = [r.request_id for r in eng.requests.values() if not r.finished]
            failures.append(f"(c) {len(left)} requests unfinished after {bound} steps: {left[:8]}")
            break
        try:
            s = eng.step()
        except OutOfPages as e:
            failures.append(f"(b) OutOfPages escaped schedule at step {eng.step_count}: {e}")
            break
        except Exception as e:  # noqa: BLE001 - a broken property, reported
            failures.append(f"step {eng.step_count} raised {type(e).__name__}: {e}")
            break
        if s.unexplained:
            failures.append(f"(a) step {s.step}: admitted requests {s.unexplained} made no progress and no reason "
                            "was stated")
        if s.out_of_pages:
            failures.append(f"(b) step {s.step}: {s.out_of_pages} OutOfPages raised (and caught) inside schedule")
        wrong = [r.request_id for r in s.plan.preempted if s.stalled.get(r.request_id, "preempted") != "preempted"]
        if wrong:
            failures.append(f"(a) step {s.step}: preempted {wrong} but the stated reason is not 'preempted'")
        counts["prefix_tokens"] += s.plan.cached_tokens
        counts["chunk_steps"] += bool(s.plan.prefill)
        counts["preemptions"] += len(s.plan.preempted)
        counts["swaps"] += len(s.plan.swapped_out)
        counts["whole"] += len(s.plan.whole)
        for why in getattr(s.plan, "waits", {}).values():
            waits[why] = waits.get(why, 0) + 1
        if check_every and s.step % check_every == 0:
            try:
                eng.manager.check_invariants()
            except Exception as e:  # noqa: BLE001
                failures.append(f"(d) step {s.step}: allocator invariants broken: {e}")
                break
        if failures:
            break
    counts["steps"] = eng.step_count
    counts["prefix_shared"] = sum(1 for r in eng.requests.values() if r.cached_tokens)
    counts["hisparse_releases"] = eng.manager.evicted_pages if w.policy == "hisparse" else 0
    rolled_back = getattr(eng.scheduler, "admission_out_of_pages", 0)
    if rolled_back:
        failures.append(f"(b) {rolled_back} chunked admissions rolled back on OutOfPages")
    if not failures:
        try:
            eng.manager.check_invariants()
        except Exception as e:  # noqa: BLE001
            failures.append(f"(d) allocator invariants broken at the end: {e}")
        if not eng.pool_empty():
            failures.append(f"(d) pages still in use at the end: {eng.manager.pool.stats()}")
    return LivenessReport(eng.step_count, bound, len(w.requests), refused, failures, counts, waits)


def random_workload(rng: np.random.Generator, vocab: int = 512) -> Workload:
    """A random workload: policy, admission (drawn last: the other draws of a seed do not depend on it), prefill
    mode, prefix caching, max_running 1-6, prompt chunk, 2-10 requests of
    1-6 pages (some sharing a document's first pages, some ending on a page boundary), 1-150 new tokens (some
    ending at an eos; or, in 3 workloads of 10, prompts of 1-2 pages and 64-320 new tokens), arrivals over the
    first steps, and budgets from about one request's need to all of them (half within a few pages of the
    least)."""
    policy = POLICIES[rng.integers(len(POLICIES))]
    prefill = PREFILL_MODES[rng.integers(len(PREFILL_MODES))]
    docs = [rng.integers(1, vocab, 6 * PAGE_SIZE).tolist() for _ in range(rng.integers(1, 4))]
    reqs = []
    decode_heavy = rng.random() < 0.3  # short prompts, long outputs: pages added while decoding
    for _ in range(rng.integers(2, 11)):
        n_tok = int(rng.integers(1, 6 * PAGE_SIZE + 1)) if rng.random() < 0.8 else int(rng.integers(1, 7)) * PAGE_SIZE
        if decode_heavy:
            n_tok = int(rng.integers(1, 2 * PAGE_SIZE + 1))
        if rng.random() < 0.6:  # from the start of a shared document, its own tail after a few pages
            own = int(rng.integers(0, n_tok + 1)) if rng.random() < 0.5 else 0
            prompt = docs[rng.integers(len(docs))][:n_tok - own] + rng.integers(1, vocab, own).tolist()
        else:
            prompt = rng.integers(1, vocab, n_tok).tolist()
        new = int(rng.integers(1, 151)) if rng.random() < 0.8 else int(rng.integers(1, 4))
        if decode_heavy:
            new = int(rng.integers(64, 321))
        eos = int(rng.integers(1, vocab)) if rng.random() < 0.2 else -1
        reqs.append((int(rng.integers(0, 30)) if rng.random() < 0.5 else 0, tuple(prompt), new, eos))
    hot_rows = int(rng.choice([32, 64, 128, 192]))
    nh = -(-hot_rows // PAGE_SIZE)
    longest = max(pages(len(p) + n) for _, p, n, _ in reqs)
    total = sum(pages(len(p) + n) for _, p, n, _ in reqs)
    lo = min(longest, 2 + nh) if policy == "hisparse" else longest
    lo = max(lo, max(pages(len(p)) for _, p, _, _ in reqs) if prefill == "chunked" else 1)

    def budget(least: int) -> int:  # half the time within a few pages of the least: under pressure
        return least + int(rng.integers(0, 5) if rng.random() < 0.5 else rng.integers(0, max(total + 2 - least, 1)))

    device = budget(lo)
    host, index = (budget(longest) if rng.random() < 0.25 else total + longest for _ in range(2))
    w = Workload(policy=policy, prefill=prefill, prefix_caching=bool(rng.random() < 0.8),
                 max_running=int(rng.integers(2, 7)) if rng.random() < 0.9 else 1,
                 prefill_chunk=int(rng.choice([16, 64, 100, 256])),
                 device_pages=device, host_pages=host, index_pages=index, hot_rows=hot_rows, requests=tuple(reqs))
    return dataclasses.replace(w, admission=ADMISSIONS[rng.integers(len(ADMISSIONS))])
