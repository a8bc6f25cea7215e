"""`FakeEngine`: the `Engine` with only the model call replaced — `FakeRunner` produces each token as a function
of (seed, position) instead of a model's, and `HostOnly` stands in for the device store. The scheduling, the
batch and the commit are the engine's own (`Engine.begin_step` / `call_model` / `finish_step`) over the real
`PageManager` bookkeeping; NumPy only: nothing is compiled, no device array exists.

What it is for: checking the scheduler's liveness (`tests/e2e/test_liveness.py`, `experiments/liveness.py`). Each
`FakeEngine.step_report` (a step, as `Engine.step`) returns which admitted requests progressed (a decode row, prompt
rows, a whole prompt) and, for those that did not, the reason the step's plan states (`StepPlan.waits`; None: none
stated), and counts every `OutOfPages` the manager raised inside `schedule` (caught there or not).

    eng = FakeEngine(model_cfg, CacheConfig(device_pages=24, ...), EngineConfig(policy="hisparse", max_running=4))
    eng.add_request("a", prompt, SamplingParams(max_new_tokens=16))
    while eng.has_unfinished():
        s = eng.step_report()
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
from hisparse_jax.engine.engine import Engine
from hisparse_jax.engine.engine_config import EngineConfig
from hisparse_jax.engine.request import SamplingParams
from hisparse_jax.engine.runner import StepOutput
from hisparse_jax.engine.scheduler import ADMISSIONS, POLICIES, PREFILL_MODES, StepPlan, pages
from hisparse_jax.kv.audit import check_manager
from hisparse_jax.kv.pool import OutOfPages, Tier
from hisparse_jax.kv.spec import BudgetError
from hisparse_jax.units import PAGE_SIZE


def fake_token(seed: int, position: int, vocab: int) -> int:
    """The fake model's token at `position` of a request with `seed` (depends on nothing else, as the engine's
    sampling depends only on (seed, position))."""
    return (seed * 1_000_003 + position * 7_919 + 17) % vocab


class FakeRunner:
    """`Runner`'s interface without a model: a prompt's rows are empty arrays [0, T, 0] (T its length), and every
    token drawn — after a whole prefill or for a step's emitting rows — is `fake_token(seed, position)`."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def prefill_rows(self, tokens, *, with_hidden: bool = False):
        rows = np.zeros((0, len(tokens), 0), np.float32)
        return None, rows, rows, rows

    def sample(self, logits: list, seeds, positions, temperatures, top_ps) -> list[int]:
        return [fake_token(int(s), int(p), self.cfg.vocab_size) for s, p in zip(seeds, positions)]

    def step(self, spec, store, batch: dict, sampling: dict, n_emit: int, *,
             read_page_stamps: bool = False) -> StepOutput:
        return StepOutput(self.sample(None, sampling["seed"][:n_emit], sampling["pos"][:n_emit], None, None),
                          store, {})


class HostOnly:
    """The engine's store seam with no store: each table update the manager decides is taken and dropped, a
    prompt write is only checked and counted by the manager (`record_prefill`), there are no tables to check."""

    store = None

    def __init__(self, manager):
        pass

    def apply_updates(self, manager) -> None:
        manager.take_updates()

    def write_prefill(self, manager, slot: int, latent, rope, index_k, length: int, offset: int = 0) -> None:
        manager.record_prefill(slot, length, 0, rows=latent.shape[1], offset=offset)
        manager.take_updates()

    def check_tables(self, manager) -> None:
        pass


@dataclasses.dataclass
class FakeStep:
    """One `FakeEngine.step_report`: its plan; progressed: request id -> "decode" | "prefill" | "whole" (prompt rows
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


class FakeEngine(Engine):
    """`Engine` over a `PageManager` sized by `cache` for `model` (a `ModelConfig`: no parameters), with
    `FakeRunner` for the model and `HostOnly` for the store. `config` as the engine's; speculative decoding and
    kernels other than "reference" are refused (there is no model to draft with, nothing to run kernels on)."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, config: EngineConfig = EngineConfig()):
        if config.speculative_tokens or config.kernels != "reference":
            raise ValueError("FakeEngine runs no model: speculative_tokens must be 0 and kernels 'reference'")
        self._build(FakeRunner(model), cache, config, HostOnly)
        self.out_of_pages = 0  # OutOfPages raised inside the manager during schedule (all steps)
        self._raised: int | None = None  # counting: inside `schedule`
        self._raised_last = 0
        for name in ("admit", "reserve", "swap_in", "evict"):  # count what the manager raises, caught or not
            setattr(self.manager, name, self._counting(getattr(self.manager, name)))
        schedule = self.scheduler.schedule

        def counted(step: int):
            self._raised = 0
            try:
                return schedule(step)
            finally:
                self._raised_last, self._raised = self._raised, None

        self.scheduler.schedule = counted

    def _counting(self, fn):
        def wrapped(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except OutOfPages:
                if self._raised is not None:
                    self._raised += 1
                raise
        return wrapped

    def step_report(self) -> FakeStep:
        """`Engine.step` (schedule, batch, the fake model's tokens, commit), reported as a `FakeStep`."""
        w = self.begin_step()
        self.finish_step(self.call_model(w))
        plan = w.plan
        self.out_of_pages += self._raised_last
        waits = dict(getattr(plan, "waits", {}) or {})
        progressed = {r.request_id: "whole" for r in plan.whole}
        progressed.update((r.request_id, "prefill") for r, _, _ in plan.prefill)
        progressed.update((r.request_id, "decode") for r in plan.decode)
        # (a request the commit finished progressed: those still admitted are those admitted before it)
        stalled = {r.request_id: waits.get(r.request_id) for r in self.scheduler.active
                   if r.request_id not in progressed}
        for r in plan.preempted:  # back in the queue (unless readmitted at once)
            if r.request_id not in progressed:
                stalled.setdefault(r.request_id, waits.get(r.request_id))
        return FakeStep(self.step_count - 1, plan, progressed, stalled, self._raised_last)

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

    def engine_config(self) -> EngineConfig:
        return EngineConfig(policy=self.policy, prefill=self.prefill, max_running=self.max_running,
                            prefill_chunk=self.prefill_chunk, prefix_caching=self.prefix_caching,
                            admission=self.admission)

    def params(self, i: int) -> SamplingParams:
        """Request i's parameters: its new tokens and eos, seed i."""
        _, _, n, eos = self.requests[i]
        return SamplingParams(max_new_tokens=n, seed=i, eos_token_id=() if eos < 0 else (eos,))

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
    eng = FakeEngine(model, w.cache_config(), w.engine_config())
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
                eng.add_request(f"r{i}", list(prompt), w.params(i))
            except BudgetError:
                refused += 1
        if eng.step_count >= bound:
            left = [r.request_id for r in eng.requests.values() if not r.finished]
            failures.append(f"(c) {len(left)} requests unfinished after {bound} steps: {left[:8]}")
            break
        try:
            s = eng.step_report()
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
                check_manager(eng.manager)
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
            check_manager(eng.manager)
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
