"""Tiered generation under memory pressure never crashes: refused up front, or exactly the reference tokens.

The differential fuzzer lives in `experiments/fuzz_tiered.py` (oracle, case generators, `--long` profile);
here: the cases that crashed before (as regression tests) and a fixed, derandomized hypothesis profile of it.
Set HISPARSE_FUZZ_EXAMPLES to run more examples of each kind.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hisparse_jax as hj
from experiments import fuzz_tiered as fz
from hisparse_jax.config import CacheConfig
from hisparse_jax.cpu_compile import drop_programs_near_map_limit
from hisparse_jax.kv.spec import BudgetError

EXAMPLES = int(os.environ.get("HISPARSE_FUZZ_EXAMPLES", "0"))


def _numbers_add_up(msg: str) -> None:
    """'... need a + b = s ...; X is h, d short': the terms sum to s and s - h = d."""
    m = re.search(r"need[s]? ((?:\d+ \+ )*\d+)(?: = (\d+))? .*?; \w+ is (\d+), (\d+) short", msg)
    assert m, msg
    terms = [int(x) for x in m.group(1).split(" + ")]
    total = int(m.group(2)) if m.group(2) else terms[0]
    assert sum(terms) == total and total - int(m.group(3)) == int(m.group(4)), msg


# The three reports: each was an IndexError or an OutOfPages midway; each must now be refused up front (the
# tiny-glm hot buffer is 8 pages: a request over 10 pages needs 2 tail + 8 hot-buffer pages on the device).
REPORTED = [
    ([[1, 2, 3] * 200, [7, 8] * 300], dict(device_pages=12, host_pages=256, max_seqs=4, fetch="row"), 20),
    ([[(i * 7 + j) % 100 for j in range(n)] for i, n in enumerate([450, 520, 580, 610])],
     dict(device_pages=14, host_pages=256, max_seqs=4), 39),
    ([[(i * 7 + j) % 100 for j in range(n)] for i, n in enumerate([900, 70])],
     dict(device_pages=10, host_pages=256, max_seqs=4), 13),
]


@pytest.mark.parametrize("prompts,budget,least", REPORTED)
def test_reported_crashes_are_refused_up_front(tiny_glm, prompts, budget, least):
    with pytest.raises(BudgetError, match="device_pages is too small") as e:
        hj.generate(tiny_glm, prompts, 64, return_stats=True, cache=CacheConfig(**budget))
    _numbers_add_up(str(e.value))
    assert f"need {least} " in str(e.value) or f"= {least} " in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.fixture(scope="module")
def first_report_tokens(tiny_glm):
    """The contiguous path's 64 tokens of the first report's prompts (one run for both fetch mechanisms)."""
    return hj.generate(tiny_glm, REPORTED[0][0], 64)


@pytest.mark.slow
@pytest.mark.parametrize("fetch", ["row", "page"])
def test_smallest_accepted_budget_tiers_and_matches_contiguous(tiny_glm, first_report_tokens, fetch):
    """The first report at the smallest device budget the check accepts (20 pages): it completes, really tiers
    (evictions, hits and misses), and gives exactly the contiguous path's tokens; one page less is refused."""
    prompts = REPORTED[0][0]
    ref = first_report_tokens
    with pytest.raises(BudgetError, match="1 short"):
        hj.generate(tiny_glm, prompts, 64, cache=CacheConfig(device_pages=19, host_pages=256, max_seqs=4))
    toks, stats = hj.generate(tiny_glm, prompts, 64, return_stats=True,
                              cache=CacheConfig(kv_dtype="float32", device_pages=20, host_pages=256, max_seqs=4,
                                                fetch=fetch))
    assert toks == ref
    assert stats.evicted_pages > 0 and stats.hits > 0 and stats.misses > 0


@pytest.mark.slow
def test_reported_mixed_lengths_at_the_smallest_budget(tiny_glm):
    prompts, budget, least = REPORTED[2]
    toks, stats = hj.generate(tiny_glm, prompts, 64, return_stats=True,
                              cache=CacheConfig(**{**budget, "device_pages": least, "kv_dtype": "float32"}))
    assert toks == hj.generate(tiny_glm, prompts, 64)
    assert stats.misses > 0


def test_check_counts_written_positions_not_sampled_tokens():
    """A prompt of 64 tokens and 1 new token holds 64 positions (1 page): the last sampled token is never
    written, so a one-page store is enough; the refusal for 2 pages names host_pages exactly."""
    model = hj.SparseMLAModel(fz.fuzz_model_config(), rngs=nnx.Rngs(0))
    out = hj.generate(model, [[5] * 64], 1, cache=CacheConfig(kv_dtype="float32", device_pages=1, host_pages=1,
                                                              max_seqs=1, max_seq_len=64))
    assert len(out[0]) == 1
    with pytest.raises(BudgetError, match="host_pages is too small") as e:
        hj.generate(model, [[5] * 64], 2, cache=CacheConfig(device_pages=2, host_pages=1, max_seqs=1))
    _numbers_add_up(str(e.value))


# ----- regressions found by the fuzzer (shrunk) --------------------------------------------------------
@pytest.mark.slow
def test_engine_fp8_chunked_prefill_reference_is_through_the_store():
    """Found by the fuzzer: with fp8 and chunked prefill, a prompt's rows read each other back in fp8, so the
    reference is an all-resident engine of the same format, not a whole-prompt forward (the first token
    already differs). The engine itself was right; the oracle now prefills the same way."""
    case = fz.EngineCase(prompts=[[(7 * j) % 500 for j in range(225)], [(11 * j) % 500 for j in range(224)]],
                         max_new=[14, 13], arrivals=[3, 10], aborts={}, policy="preempt", coldness="recency",
                         prefill="chunked", prefix_caching=True, kv_dtype="fp8", fetch="page", device_pages=6,
                         host_pages=3, hot_rows=256, max_running=2, prefill_chunk=256)
    assert fz.run_engine_case(case)["outcome"] == "identical"


@pytest.mark.slow
def test_engine_prompt_that_fills_the_device_is_admitted():
    """Found by the fuzzer (long profile, engine case 50): HiSparse, chunked prefill, one 524-token prompt (9
    pages) that grows to 11 pages, device_pages=9. It fits (the prompt is resident while written; then the
    request releases pages into a hot buffer), so `add_request` accepted it, but admission asked for the prompt's
    pages + 1 and the request waited forever. Admission now asks for the pages of the prompt and of its first
    decode row only."""
    case = fz.EngineCase(prompts=[[(13 * j) % 500 for j in range(524)]], max_new=[146], arrivals=[0], aborts={},
                         policy="hisparse", coldness="oldest", prefill="chunked", prefix_caching=True,
                         kv_dtype="float32", fetch="row", device_pages=9, host_pages=22, hot_rows=128, max_running=2,
                         prefill_chunk=256)
    res = fz.run_engine_case(case)
    assert res["finished"] == 1 and res["evicted_pages"] > 0 and res["misses"] > 0


@pytest.mark.slow
def test_engine_int4_index_keys_under_pressure():
    """A fuzz case with MXFP4 indexer keys (`index_dtype="int4"`, one case in five of the draws): HiSparse,
    chunked prefill, a prompt that fills the device and then tiers. Its oracle is the same case all resident
    (the keys are scored in int4 either way); it must miss, evict and give those tokens."""
    case = fz.EngineCase(prompts=[[(13 * j) % 500 for j in range(524)], [(5 * j) % 500 for j in range(300)]],
                         max_new=[146, 40], arrivals=[0, 2], aborts={}, policy="hisparse", coldness="oldest",
                         prefill="chunked", prefix_caching=False, kv_dtype="float32", fetch="row", device_pages=9,
                         host_pages=22, hot_rows=128, max_running=2, prefill_chunk=256, index_dtype="int4")
    assert case.cache_config().index_dtype == "int4"
    res = fz.run_engine_case(case)
    assert res["finished"] == 2 and res["evicted_pages"] > 0 and res["misses"] > 0 and res["int4_index"] == 1


def test_a_host_tier_case_gives_the_device_keys_tokens():
    """`--index-tier host` (`run_cases(..., index_tier="host")`): generate case 2 of seed 2026 (bf16, two prompts, a
    device one page short of all resident, 27 new tokens) with its indexer keys in pinned host memory, exact mode.
    Its oracle is the same formats all resident with the keys on the device: the same tokens, the row fetches still
    accounted, and keys read from the host."""
    out = fz.run_cases("generate", 2, 1, 2026, fz.fuzz_model(), log=lambda m: None, index_tier="host")
    assert not out["failures"] and out["outcomes"] == {"identical": 1}, out["failures"]
    assert out["totals"]["host_index"] == 1 and out["totals"]["index_h2d_bytes"] > 0 and out["totals"]["misses"] > 0


def test_index_tier_option_applies_to_the_kinds_and_policy_that_take_it(capsys):
    """--index-tier: generate and engine cases only (mesh and P/D keep the contiguous path as their oracle), and
    host-tier keys with the lru hot buffer only (as `CacheConfig` has it)."""
    for argv, why in ((["--only", "pd", "--index-tier", "host"], "--index-tier host applies to --only generate or "
                       "engine"),
                      (["--index-tier", "host"], "--index-tier host applies to --only generate or engine"),
                      (["--only", "generate", "--index-tier", "host", "--hot-policy", "score_ema"],
                       "--index-tier host needs --hot-policy lru (got score_ema)"),
                      (["--only", "engine", "--index-tier", "disk"], "invalid choice: 'disk'")):
        with pytest.raises(SystemExit) as e:
            fz.main(argv + ["--out", "/nonexistent/x.json"])
        assert e.value.code == 2 and why in capsys.readouterr().err, argv


def test_a_crashed_group_is_recorded_and_the_run_goes_on(monkeypatch, capsys):
    """A group whose process dies (here XLA aborts at start-up on an unknown flag, as it would on a segfault) is
    recorded with its cases and the command that reruns them, instead of ending the run."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_hisparse_no_such_flag=1")
    part = fz.run_group("generate", 5, 2, seed=3)
    assert part["cases"] == 0 and not part["failures"]
    (crash,) = part["crashes"]
    assert crash["returncode"] != 0 and crash["first"] == 5 and crash["cases"] == 2
    assert "--only generate --first 5 --examples 2 --seed 3" in crash["rerun"]
    assert "no_such_flag" in crash["output_tail"] and "CRASH" in capsys.readouterr().out
    total = fz.merge(fz.merge({}, part), {"cases": 3, "outcomes": {"identical": 3}, "totals": {"hits": 4},
                                          "cases_with_nonzero": {"hits": 1}, "failures": [], "crashes": [],
                                          "seconds": 1.0})
    assert total["cases"] == 3 and total["outcomes"] == {"identical": 3} and len(total["crashes"]) == 1


def test_the_oracle_tells_a_near_tie_from_a_wrong_token():
    """Found by the fuzzer (pd case 256 of seed 2026, a local request of a preempt engine): the contiguous
    reference picked token 477 where the engine picked 7, their logits 1.2e-7 apart (one ulp) in the reference;
    XLA:CPU's matmul rounds a row differently with the batch's row count, so such a tie goes either way. The oracle
    counts it as a near tie; any other difference fails, naming the step and the margin."""
    logits = np.zeros((3, 8), np.float32)
    logits[1, [2, 5]] = [0.66306055, 0.6630604]
    assert fz.same_tokens("r", [1, 2, 3], [1, 2, 3], logits)
    assert not fz.same_tokens("r", [1, 5, 5], [1, 2, 3], logits)  # diverged at a near tie: not a failure
    logits[1, 5] = 0.5
    with pytest.raises(AssertionError, match=r"first at step 1: the reference's logits differ by 0.163"):
        fz.same_tokens("r", [1, 5, 5], [1, 2, 3], logits)
    with pytest.raises(AssertionError, match="tokens differ"):
        fz.same_tokens("r", [1, 5, 5], [1, 2, 3], None)  # no logits (bf16 / fp8 references): exact only


# ----- the fuzzer's CI profile -------------------------------------------------------------------------
_SETTINGS = dict(derandomize=True, deadline=None, database=None, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.slow
@settings(max_examples=EXAMPLES or 6, **_SETTINGS)
@given(st.data())
def test_fuzz_generate(data):
    drop_programs_near_map_limit()  # many examples in one test: stay clear of the map limit
    case = fz.draw_generate_case(fz.HypothesisChoices(data))
    fz.run_generate_case(case)


@pytest.mark.slow
@settings(max_examples=EXAMPLES or 3, **_SETTINGS)
@given(st.data())
def test_fuzz_engine(data):
    drop_programs_near_map_limit()  # many examples in one test: stay clear of the map limit
    case = fz.draw_engine_case(fz.HypothesisChoices(data))
    fz.run_engine_case(case)


@pytest.mark.slow
@settings(max_examples=EXAMPLES or 1, **_SETTINGS)
@given(st.data())
def test_fuzz_mesh_engine(data):
    drop_programs_near_map_limit()  # many examples in one test: stay clear of the map limit
    # this process sees one device: the mesh cases run one rank (the 8-device mesh is tests/e2e/test_mesh_engine.py;
    # `fuzz_tiered.py --only mesh` runs 1-4 ranks)
    case = fz.draw_mesh_case(fz.HypothesisChoices(data))
    fz.run_mesh_case(case)


@pytest.mark.slow
@settings(max_examples=EXAMPLES or 1, **_SETTINGS)
@given(st.data())
def test_fuzz_pd_import(data):
    drop_programs_near_map_limit()  # many examples in one test: stay clear of the map limit
    # one device here (the mesh's P/D cases run under `fuzz_tiered.py --only pd`, on 4 host devices)
    case = fz.draw_pd_case(fz.HypothesisChoices(data))
    fz.run_pd_case(case)


def test_rvq_host_tier_cases_give_the_device_keys_tokens():
    """`--index-tier host --index-summary rvq`: the same generate case, and an engine case, with each key's "rvq"
    codes and radius as the page bound (codebooks fitted to the fuzz model once): the device keys' tokens."""
    model = fz.fuzz_model()
    for kind, k in (("generate", 2), ("engine", 3)):
        out = fz.run_cases(kind, k, 1, 2026, model, log=lambda m: None, index_tier="host", index_summary="rvq")
        assert not out["failures"] and not out["crashes"], out["failures"]
        assert out["totals"]["host_index"] == 1 and out["totals"]["index_h2d_bytes"] > 0, (kind, out["totals"])
