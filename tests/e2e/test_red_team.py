"""Red-team regressions (issue 50): every size a user sets is checked against what it will cost before anything of
that size exists, and every bad argument of the library, the engine and the CLI is one clear refusal.

Each size is set to 10^9 or more (each CLI count to 1e9 / 1e30) in a child process under an address-space limit
(`LIMIT`): a refusal must come within `FAST_S` with the child's peak RSS under `PEAK_MB` and one line naming the
size, its bytes and the limit. An allocation of a refused size would instead end in a MemoryError, an XLA
out-of-memory error or the limit's kill, which the assertions name. The cases run in two children (the library and
the engine; the CLI) and one for `--devices 256`, whose 256 host devices must be made before jax starts.

The memory account these refusals come from (`kv.account.store_costs`, `memory.check_account`) counts the store's
arrays, the host bookkeeping and the step's hot-buffer resolve temporaries; `test_step_temporaries_formula` checks
the last against XLA's memory analysis of the compiled engine step."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx

from hisparse_jax import calc
from hisparse_jax.config import CacheConfig, ModelConfig
from hisparse_jax.engine import EngineConfig
from hisparse_jax.engine.runner import _jitted_step_and_sample
from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.kv.account import RESOLVE_BYTES_PER_ROW_SLOT, index_bytes_per_row_position
from hisparse_jax.kv.state import init_store
from hisparse_jax.model.decoder import SparseMLAModel
from limit_harness import CLI, PRELUDE, child
from tiny import MICRO

FAST_S = 10.0  # seconds a refusal may take
PEAK_MB = 2500  # the child's peak RSS, jax and a micro model included

# sizes of 10^9 and more, each through generate and the engine (the engine's request slots are its max_running)
SIZES = {"max_seq_len": 64 * 10**9, "index_pages": 10**10, "host_pages": 2 * 10**9, "max_seqs": 10**9,
         "device_pages": 10**9, "hot_rows": 10**9}
ENGINE_COUNTS = {"max_running": 10**9, "prefill_chunk": 10**9, "min_bucket": 10**9}

_LIBRARY = PRELUDE + f"""
import jax
from flax import nnx
import hisparse_jax as hj
from hisparse_jax.config import CacheConfig, ModelConfig
from hisparse_jax.engine import Engine, EngineConfig, MeshEngine
from hisparse_jax.kv.manager import PageManager
from hisparse_jax.kv.pool import PagePool
from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.kv.account import check_store_memory
from hisparse_jax.memory import host_memory_bytes
from hisparse_jax.parallel import data_mesh

cfg = ModelConfig(**{MICRO!r})
model = hj.SparseMLAModel(cfg, rngs=nnx.Rngs(0))
prompts = [[1, 2, 3]]
for name, value in {SIZES!r}.items():
    cache = lambda: CacheConfig(**{{name: value}})
    attempt("generate " + name, lambda: hj.generate(model, prompts, 2, cache=cache()))
    if name != "max_seqs":  # an engine's request slots are its max_running (below)
        attempt("engine " + name, lambda: Engine(model, cache()))
attempt("manager max_seqs", lambda: PageManager(cfg, CacheConfig(max_seqs=10**9)))
attempt("pool index_pages", lambda: PagePool(1, 10**10, 0))
# the issue's case: 10^7 hot rows pass a count of the store alone; the engine's step resolves each of its 512
# batch rows against a request's whole hot buffer
attempt("engine hot_rows 1e7", lambda: Engine(model, CacheConfig(hot_rows=10**7)))
for name, value in {ENGINE_COUNTS!r}.items():
    attempt("engine " + name, lambda: Engine(model, CacheConfig(), EngineConfig(**{{name: value}})))
# a host pool of 40 % of the RAM fits one device; four devices' pools do not
hp = int(0.4 * host_memory_bytes() / StoreSpec.create(cfg, CacheConfig()).page_bytes)
attempt("one device host_pages", lambda: check_store_memory(StoreSpec.create(cfg, CacheConfig(host_pages=hp))))
mesh = data_mesh(4)
attempt("mesh generate host_pages", lambda: hj.generate(model, prompts * 4, 2, cache=CacheConfig(host_pages=hp),
                                                        mesh=mesh))
attempt("mesh engine host_pages", lambda: MeshEngine(model, CacheConfig(host_pages=hp), mesh=mesh))
# arguments of the wrong kind, and values one field contradicts
attempt("generate cache=dict", lambda: hj.generate(model, prompts, 2, cache={{"device_pages": 8}}))
attempt("engine cache=None", lambda: Engine(model, None))
attempt("engine speculative conflict", lambda: Engine(model, CacheConfig(speculative_tokens=2)))
attempt("hot_ema_beta with lru", lambda: CacheConfig(hot_ema_beta=0.5))
attempt("index_budget_pages above index_pages",
        lambda: CacheConfig(index_tier="host", index_pages=4, index_budget_pages=8))
print(json.dumps(results))
"""

# (argv, the option the one error line names); demo cases on the default model and on demo-glm
DEMO = {
    "hot_rows": (["--hot-rows", "100000000"], "--hot-rows 100000000 must be <= "),
    "hot_rows_preset": (["--preset", "demo-glm", "--hot-rows", "1000000000"], "--hot-rows 1000000000 must be <= "),
    "device_requests": (["--device-requests", "5000"], "--device-requests 5000 must be <= "),
    "device_requests_1e9": (["--device-requests", "1e9"], "--device-requests 1e+09 must be <= "),
    "device_requests_tiny": (["--device-requests", "1e-300"], "--device-requests 1e-300 (0 bytes) is too small"),
    "requests": (["--preset", "demo-glm", "--requests", "1000000000"], "--requests 1000000000 must be <= "),
    "prefill_chunk": (["--preset", "demo-glm", "--prefill", "chunked", "--prefill-chunk", "1000000000"],
                      "--prefill-chunk 1000000000 must be <= "),
}
CALC_COUNTS = ("--dp", "--tp", "--hot-rows", "--groups", "--retained", "--other", "--max-seqs", "--top-k")
CALC = {
    "seq 1e30": (["--seq", "1e30"], "argument --seq: not a token count: '1e30'"),
    "seq 1e3k": (["--seq", "1e3k"], "argument --seq: not a token count: '1e3k'"),
    "seq 10^12": (["--seq", "1000000000000"], "argument --seq: sequence length must be a positive number of tokens"),
    "top-k past the hot rows": (["--top-k", "2000000", "--seq", "1m"], "top_k (2000000) must be <= hot_rows (4096)"),
    "host-gib 1e30": (["--host-gib", "1e30"], "argument --host-gib: host_gib must be a number >= 0 and <= "),
    "link 1e30": (["--link-gb-per-s", "1e30"], "argument --link-gb-per-s: link_gb_per_s must be a finite number"),
    **{f"{opt} {v}": ([opt, v], f"argument {opt}: {opt[2:].replace('-', '_')} must be "
                      + ("a whole number" if "e" in v else "<= "))
       for opt in CALC_COUNTS for v in ("1e9", "1e30", "1" + "0" * 30)},
}


@pytest.fixture(scope="module")
def library():
    return child(_LIBRARY, devices=4, timeout=300)


@pytest.fixture(scope="module")
def cli():
    cases = {f"demo {k}": ["demo", "--plot", "", *argv] for k, (argv, _) in DEMO.items()}
    cases.update({f"calc {k}": ["calc", *argv] for k, (argv, _) in CALC.items()})
    return child(CLI, json.dumps(cases), devices=1, timeout=300)


def _quick(r: dict) -> None:
    assert r["seconds"] < FAST_S and r["peak_mb"] < PEAK_MB, r


def _refused(r: dict, kind: str, *words: str) -> str:
    assert r["error"] == kind, r
    msg = r["message"]
    assert "\n" not in msg and all(w in msg for w in words), msg
    _quick(r)
    return msg


@pytest.mark.parametrize("where, name", [(w, n) for n in sorted(SIZES) for w in ("generate", "engine")
                                         if (w, n) != ("engine", "max_seqs")])  # an engine's: its max_running
def test_a_size_past_the_memory_is_refused_before_it_exists(library, where, name):
    msg = _refused(library[f"{where} {name}"], "ValueError", "the KV store needs", "bytes", "more than the",
                   "sized by")
    need, have = (int(x.replace(",", "")) for x in re.search(r"needs ([\d,]+) bytes .* the ([\d,]+) bytes", msg)
                  .groups())
    assert need > have, msg
    # the message names the size as set (thousands separated)
    shown = f"{SIZES[name]:,}" if name != "max_seq_len" else f"max_seq_len={SIZES[name]:,}"
    assert shown in msg, msg


def test_the_bookkeeping_counts_before_it_allocates(library):
    _refused(library["manager max_seqs"], "ValueError", "the host bookkeeping needs", "max_seqs=1,000,000,000")
    _refused(library["pool index_pages"], "ValueError", "the page pools' bookkeeping needs 120,000,000,012 bytes",
             "index_pages=10,000,000,000")


def test_the_engine_counts_its_step_temporaries(library):
    """The issue's case: 10^7 hot rows fit as a store (2.6 GB here) but not the step that resolves each of the
    engine's 512 batch rows against them, which XLA failed to allocate (80 GB) at run time."""
    _refused(library["engine hot_rows 1e7"], "ValueError", "the largest part is the step's hot-buffer resolve "
             "temporaries", "hot_rows=10,000,000 x 512 step rows")


@pytest.mark.parametrize("name", sorted(ENGINE_COUNTS))
def test_engine_counts_are_counted(library, name):
    _refused(library[f"engine {name}"], "ValueError", "the KV store needs", "1,0")


def test_every_device_is_counted(library):
    """A host pool that one device's store fits is refused for four: the account is per device."""
    assert library["one device host_pages"]["error"] is None, library["one device host_pages"]
    for case in ("mesh generate host_pages", "mesh engine host_pages"):
        _refused(library[case], "ValueError", "the KV store needs", "(4 devices' share)", "host_pages=")


@pytest.mark.parametrize("case, kind, words", [
    ("generate cache=dict", "TypeError", "generate: cache must be a CacheConfig or None (contiguous KV), got dict"),
    ("engine cache=None", "TypeError", "Engine: cache must be a CacheConfig, got NoneType"),
    ("engine speculative conflict", "ValueError", "CacheConfig.speculative_tokens=2 conflicts with "
                                                  "EngineConfig.speculative_tokens=0"),
    ("hot_ema_beta with lru", "ValueError", "hot_ema_beta is hot_policy='score_ema''s weight"),
    ("index_budget_pages above index_pages", "ValueError", "index_budget_pages (8) must be <= index_pages (4)"),
])
def test_unclear_arguments_are_clear_refusals(library, case, kind, words):
    _refused(library[case], kind, words)


@pytest.mark.parametrize("case", sorted(DEMO))
def test_demo_sizes_are_refused_up_front(cli, case):
    r = cli[f"demo {case}"]
    assert r["error"] is None and r["rc"] == 2, r
    err = r["stderr"]
    assert "Traceback" not in err and err.count("\n") == 1, err  # one line
    assert err.startswith(f"hisparse demo: error: {DEMO[case][1]}"), err
    _quick(r)


@pytest.mark.parametrize("case", sorted(CALC))
def test_calc_values_are_bounded(cli, case):
    r = cli[f"calc {case}"]
    assert r["error"] is None and r["rc"] == 2, r
    err = r["stderr"]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("hisparse calc: error: "), err
    assert CALC[case][1] in err, err
    _quick(r)


def test_calc_library_refuses_what_is_no_count():
    for kw, words in ((dict(seq=1e30), "seq must be a whole number"), (dict(dp=2.5), "dp must be a whole number"),
                      (dict(seq=10**12), "seq must be <= "), (dict(top_k=8192), "top_k (8192) must be <= hot_rows")):
        with pytest.raises(calc.CalcError, match=re.escape(words)):
            calc.max_requests(calc.CalcInput(**kw))


def test_demo_devices_256_is_refused_before_any_engine():
    """`--devices 256`, the option's documented maximum: the account counts every device's store, step and model
    copy (it used to pass a check of the stores alone, then run 256 engines to 6.5 GB and die)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))  # 256 host devices: jax 0.12 needs > 8 GiB

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "hisparse_jax.cli", "demo", "--devices", "256", "--plot", ""],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=limit,
                         env={**env, "JAX_PLATFORMS": "cpu"})
    _, err = p.communicate(timeout=120)
    seconds = time.perf_counter() - t0
    assert p.returncode == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert re.match(r"hisparse demo: error: --(devices 256|requests 16) must be <= \d+ on this machine: "
                    r"the workload needs [\d,]+ bytes", err), err
    assert seconds < 60, seconds  # jax making 256 host devices takes a few seconds


def _step_temporaries(step, state, store, rows: int, *, index_pages: int) -> int:
    """XLA's temporaries (bytes) of the compiled engine step at `rows` batch rows scoring `index_pages` pages."""
    i32 = np.zeros(rows, np.int32)
    batch = {"tokens": i32, "req": i32, "pos": i32, "index_span": np.zeros(index_pages, np.int32)}
    sampling = {"rows": i32, "seed": np.zeros(rows, np.uint32), "pos": i32,
                "temperature": np.zeros(rows, np.float32), "top_p": np.ones(rows, np.float32)}
    stats = step.lower(state, store, batch, sampling).compile().memory_analysis()
    if stats is None:
        pytest.skip("this backend gives no memory analysis")
    return stats.temp_size_in_bytes


def test_step_temporaries_formula():
    """`RESOLVE_BYTES_PER_ROW_SLOT` against XLA's memory analysis of the compiled engine step (micro model, one
    indexer group): the temporaries that grow with hot_rows, per step row and hot slot, are at most the constant
    and more than half of it (the account neither misses nor grossly overstates them)."""
    cfg = ModelConfig(**MICRO)
    g, state = nnx.split(SparseMLAModel(cfg, rngs=nnx.Rngs(0)))
    step = _jitted_step_and_sample(g, "reference")
    B, temps = 16, {}
    for hr in (1024, 16384):
        store = init_store(StoreSpec.create(cfg, CacheConfig(device_pages=8, host_pages=8, max_seqs=4,
                                                             max_seq_len=512, hot_rows=hr)))
        temps[hr] = _step_temporaries(step, state, store, B, index_pages=8)
    per = (temps[16384] - temps[1024]) / (B * (16384 - 1024))
    assert RESOLVE_BYTES_PER_ROW_SLOT / 2 < per <= RESOLVE_BYTES_PER_ROW_SLOT, (per, temps)


def test_step_index_temporaries_formula():
    """`index_bytes_per_row_position` against XLA's memory analysis of the compiled engine step (micro model with
    the keys and heads of demo-glm's indexer): what grows with the indexer's span, per step row and position, is at
    most the formula and more than half of it."""
    cfg = ModelConfig(**{**MICRO, "index_head_dim": 128, "index_n_heads": 4})
    g, state = nnx.split(SparseMLAModel(cfg, rngs=nnx.Rngs(0)))
    step = _jitted_step_and_sample(g, "reference")
    store = init_store(StoreSpec.create(cfg, CacheConfig(device_pages=8, host_pages=8, max_seqs=4, max_seq_len=2048,
                                                         hot_rows=128)))
    B = 16
    temps = {pages: _step_temporaries(step, state, store, B, index_pages=pages) for pages in (4, 32)}
    per = (temps[32] - temps[4]) / (B * 28 * 64)
    bound = index_bytes_per_row_position(128, 4)
    assert bound / 2 < per <= bound, (per, bound, temps)


@pytest.mark.parametrize("name", sorted(ENGINE_COUNTS))
def test_engine_counts_are_integers(name):
    for value, words in ((1e9, "must be an integer, got 1000000000.0"), (0, "must be >= 1, got 0"),
                         (True, "must be an integer, got True")):
        with pytest.raises(ValueError, match=f"{name} {words}"):
            EngineConfig(**{name: value})
