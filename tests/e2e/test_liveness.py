"""Liveness of the scheduler: the real `Scheduler` over the real `PageManager` bookkeeping, the model replaced by a
fake (`engine.fake_compute`: NumPy only, nothing compiled). Every admitted request progresses each step (a decode
row, prompt rows, a whole prefill) or the step's plan states why not; no `OutOfPages` escapes `schedule` or is
swallowed inside it; every request finishes within a bound computed from the workload; the pools end empty.

`experiments/liveness.py` runs the same property over >= 10^4 random workloads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hisparse_jax.config import CacheConfig
from hisparse_jax.engine import Engine, EngineConfig
from hisparse_jax.engine import scheduler
from hisparse_jax.engine.fake_compute import FakeEngine, Workload, fake_token, liveness_model, run_workload
from hisparse_jax.engine.metrics import combine_steps, summarize
from hisparse_jax.engine.request import RequestState, SamplingParams
from hisparse_jax.engine.scheduler import ADMISSIONS, POLICIES, PREFILL_MODES
from hisparse_jax.kv.audit import check_manager
from hisparse_jax.results import StepMetrics

P = 64
VOCAB = 512


def starvation_case(device_pages: int = 20):
    """The demo's starvation in small: `first` is prefilled whole; `shares` (its first 4 pages cached) is admitted
    to write the rest of its 11-page prompt chunk by chunk with the prompt resident; five unrelated requests
    arrive with it. Before the fix the device floor counted `shares` as the pages it held plus one, so the five
    were admitted whole until the device was full, and from step 4 on `shares`' chunk `reserve` raised OutOfPages,
    which `schedule` swallowed: it sat with no prompt rows and no reason until others finished."""
    rng = np.random.default_rng(0)
    doc = rng.integers(1, VOCAB, 1024).tolist()
    eng = FakeEngine(liveness_model(), CacheConfig(kv_dtype="float32", device_pages=device_pages, host_pages=200,
                                                   max_seq_len=1024, hot_rows=64),
                     EngineConfig(policy="hisparse", prefill="whole", max_running=8, prefill_chunk=64))
    new = SamplingParams(max_new_tokens=100)
    eng.add_request("first", doc[:300], new)
    eng.step()  # `first` written and registered: its 4 full pages can be shared
    eng.add_request("shares", doc[:700], new)
    for i in range(5):
        eng.add_request(f"other{i}", rng.integers(1, VOCAB, 250).tolist(), new)
    return eng


def test_a_prompt_written_through_the_store_is_never_starved():
    eng = starvation_case()
    shares = eng.requests["shares"]
    chunks = 0
    while eng.has_unfinished():
        s = eng.step_report()
        assert s.step < 400, "not finished in 400 steps"
        assert not s.unexplained, f"step {s.step}: {s.unexplained} admitted, no progress, no reason stated"
        assert not s.out_of_pages, f"step {s.step}: OutOfPages raised inside schedule"
        if shares.state is RequestState.PREFILLING or s.progressed.get("shares") == "prefill":
            # admitted to write its prompt: it gets rows every step until written (it is the only such prompt)
            assert s.progressed.get("shares") == "prefill", (s.step, s.stalled.get("shares"))
            chunks += 1
        check_manager(eng.manager)
    assert shares.cached_tokens == 4 * P and chunks == -(-(700 - 4 * P) // 64)  # 7 steps of 64 rows
    assert eng.scheduler.admission_out_of_pages == 0 and eng.out_of_pages == 0
    assert eng.pool_empty()


@pytest.mark.parametrize("device_pages", [12, 14, 16, 18, 20, 22, 24, 26, 30])
def test_starvation_case_under_tighter_and_looser_devices(device_pages):
    """The same workload over device budgets from barely one request to all of them: every step explained, no
    OutOfPages, everything finished. (Before the fix, 14-26 pages starved `shares`, and then an OutOfPages escaped
    `_make_writable`: the floor let a request without a hot buffer count on releasing pages it shared, which needs
    a hot buffer first, lent by the pool.)"""
    eng = starvation_case(device_pages)
    while eng.has_unfinished():
        s = eng.step_report()
        assert s.step < 1000 and not s.unexplained and not s.out_of_pages, (s.step, s.stalled)
    assert eng.pool_empty()


def test_wait_reasons_are_named_and_counted():
    eng = starvation_case(14)
    seen: dict[str, int] = {}
    while eng.has_unfinished():
        s = eng.step_report()
        assert set(s.plan.waits) >= {r.request_id for r in eng.scheduler.waiting}
        for why in s.plan.waits.values():
            assert why in scheduler.WAIT_REASONS
        assert sum(s.plan.wait_reasons().values()) == len(s.plan.waits)
        for k, v in s.plan.wait_reasons().items():
            seen[k] = seen.get(k, 0) + v
    assert seen.get("device_budget") and seen.get("queued")


def test_the_fake_engine_runs_the_engines_own_step():
    """Only the model call is replaced: schedule, batch and commit are `Engine`'s methods, not copies, and a step's
    tokens are the (seed, position) function at the positions the engine's batch gives."""
    for name in ("step", "begin_step", "call_model", "finish_step", "add_request", "_commit_tokens", "_prefill_whole",
                 "run", "generate"):
        assert getattr(FakeEngine, name) is getattr(Engine, name), name
    eng = starvation_case()
    while eng.has_unfinished():
        eng.step()
    r = eng.requests["first"]
    assert r.output == [fake_token(0, len(r.prompt) + i, VOCAB) for i in range(100)]
    assert eng.metrics().tokens == 700 and eng.pool_empty()


def _step_metrics(step: int, waits: dict) -> StepMetrics:
    fields = {f: 0 for f in StepMetrics.__dataclass_fields__}
    fields.update(step=step, step_time_s=0.0, compiled=False, wait_reasons=waits)
    return StepMetrics(**fields)


def test_engine_metrics_sum_wait_reasons_over_steps_and_ranks():
    h = [_step_metrics(0, {"queued": 2, "device_budget": 1}), _step_metrics(1, {"device_budget": 1}),
         _step_metrics(2, {})]
    m = summarize(h, [], policy="hisparse")
    assert m.wait_reasons == {"device_budget": 2, "queued": 2}
    assert m.to_json()["history"][0]["wait_reasons"] == {"queued": 2, "device_budget": 1}
    both = combine_steps([h[0], _step_metrics(0, {"device_budget": 3, "max_running": 1})], 0.0, False)
    assert both.wait_reasons == {"device_budget": 4, "max_running": 1, "queued": 2}


# ----- the property over random workloads ---------------------------------------------------------------------
@st.composite
def workloads(draw) -> Workload:
    """Policies, admission rules, prefill modes, prefix caching, max_running, prompt chunks, hot buffers of 1-3
    pages, 2-6 requests of 1-4 pages (most from the start of one of two documents: shared prefixes; some on a page
    boundary) and 1-80
    new tokens (some ending at an eos; or prompts of 1-2 pages and 64-200 new tokens: growth while decoding),
    arrivals over the first steps (the sizes drawn from a drawn seed), and device / indexer / host budgets from
    the least a request needs up (mostly within a few pages of it: under pressure)."""
    policy = draw(st.sampled_from(POLICIES))
    prefill = draw(st.sampled_from(PREFILL_MODES))
    decode_heavy = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    docs = rng.integers(1, VOCAB, (2, 4 * P)).tolist()
    reqs = []
    for _ in range(draw(st.integers(2, 6))):
        n = int(rng.integers(1, 2 * P + 1) if decode_heavy else rng.integers(1, 4 * P + 1) if rng.random() < 0.8
                else rng.integers(1, 5) * P)
        own = (0, n, int(rng.integers(0, n + 1)))[rng.integers(3)]  # all from a document, all its own, or a mix
        prompt = docs[rng.integers(2)][:n - own] + rng.integers(1, VOCAB, own).tolist()
        new = int(rng.integers(64, 201) if decode_heavy else rng.integers(1, 81))
        eos = int(rng.integers(1, VOCAB)) if rng.random() < 0.2 else -1
        reqs.append((int(rng.integers(0, 9)) if rng.random() < 0.5 else 0, tuple(prompt), new, eos))
    hot_rows = draw(st.sampled_from([32, 64, 128, 192]))
    nh = -(-hot_rows // P)
    need = [-(-(len(p) + n) // P) for _, p, n, _ in reqs]
    lo = min(max(need), 2 + nh) if policy == "hisparse" else max(need)
    if prefill == "chunked":
        lo = max(lo, max(-(-len(p) // P) for _, p, _, _ in reqs))
    tight = st.integers(0, 4)  # (mostly under pressure)
    device = lo + draw(tight | st.integers(0, sum(need) + 2 - lo))
    host, index = (draw(st.just(sum(need) + 2) | tight.map(lambda k: max(need) + k)) for _ in range(2))
    return Workload(policy=policy, prefill=prefill, prefix_caching=draw(st.booleans()),
                    max_running=draw(st.sampled_from([4, 2, 6, 3, 5, 1])),
                    prefill_chunk=draw(st.sampled_from([16, 64, 100, 256])), device_pages=device, host_pages=host,
                    index_pages=index, hot_rows=hot_rows, requests=tuple(reqs),
                    admission=draw(st.sampled_from(ADMISSIONS)))


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@pytest.mark.slow
@given(workloads())
def test_every_schedule_is_live(w):
    rep = run_workload(w, check_every=4)
    assert not rep.failures, rep.failures
    for kind in ("prefix_shared", "preemptions", "swaps", "hisparse_releases", "chunk_steps"):
        if rep.counts[kind]:
            event(kind)
    assert rep.steps <= rep.bound


def test_the_experiment_runs_every_task_in_order_on_one_or_two_processes(capsys):
    """`experiments/liveness.py`'s driver: the same summaries, in the tasks' order, on one process or two workers;
    progress on stderr (each result with every_s=0; only the final line when the interval never passes)."""
    import time

    from experiments import liveness

    tasks = [(seed, admission) for seed in range(3) for admission in ADMISSIONS]
    t0 = time.perf_counter()
    alone = liveness.run_all(tasks, jobs=1, t0=t0, every_s=0)
    lines = capsys.readouterr().err.splitlines()
    pooled = liveness.run_all(tasks, jobs=2, t0=t0, every_s=1e9)
    assert [(r["seed"], r["admission"]) for r in alone] == tasks
    assert pooled == alone and not any(r["failures"] for r in alone)
    assert [line.split(" schedules")[0] for line in lines] == [f"liveness: {i} / {len(tasks)}"
                                                               for i in range(1, len(tasks) + 1)]
    last = capsys.readouterr().err.splitlines()
    assert len(last) == 1 and last[0].startswith(f"liveness: {len(tasks)} / {len(tasks)} schedules, 0 failed"), last
