"""Shared fixtures: tiny transformers reference models (CPU, float32) saved as HF checkpoints."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

import pytest

import parallel

# the runner's hooks (tests/parallel.py): `make test`'s workers share the files out; --list-deselected
pytest_addoption, pytest_deselected = parallel.pytest_addoption, parallel.pytest_deselected
pytest_runtestloop, pytest_terminal_summary = parallel.pytest_runtestloop, parallel.pytest_terminal_summary


def _synchronous_cpu_dispatch() -> None:
    """XLA:CPU runs each program on the calling thread (no asynchronous dispatch), set before jax's CPU client
    exists. kernels='pallas_mosaic_interpret' needs it (`tiered.check_kernels` refuses it otherwise, so the
    refusal tests of test_kernels_e2e reach the checks after it): the interpreted Mosaic kernel runs from a host
    callback of the decode step. (The hangs once seen there, 3 of 5 runs on 2 cores with asynchronous dispatch
    and one in CI without, were the simulated warpgroups waiting for XLA:CPU pool threads: `_interpret_threads`.)
    Values are unchanged."""
    import jax  # (jax reads no environment variable for this flag)

    jax.config.update("jax_cpu_enable_async_dispatch", False)


def _interpret_threads() -> None:
    """XLA:CPU's pool large enough for Mosaic GPU's interpret mode (`hisparse_jax.cpu_pool`): a cluster of 2
    blocks simulates 4 warpgroups at once, each holding a pool thread while it waits at a barrier, and on a 2-core
    machine the pool has 2 (seen: the cluster tests hang). Set before jax's CPU client exists."""
    from hisparse_jax.cpu_pool import request_interpret_threads

    request_interpret_threads()


def _share_compiled_programs() -> None:
    """One persistent XLA compilation cache for the whole test run, subprocesses included (they inherit the
    environment). Most of the suite's time is XLA:CPU compiling the same small programs again: each test builds
    its own engine or model, and `_drop_compiled_programs` empties the in-memory caches after every module. With
    this cache an identical program is compiled once per run. Trace counts (what the no-recompile tests read)
    are unchanged: a cache hit still traces and lowers; only the backend compile is skipped. A directory the
    user set in JAX_COMPILATION_CACHE_DIR is used and kept; otherwise a temporary one is removed at exit."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        path = tempfile.mkdtemp(prefix="hisparse-tests-xla-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    if "jax" in sys.modules:  # imported before this file (a plugin): tell its config too
        import jax

        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
        jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                          int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))


def _compile_fast() -> None:
    """XLA:CPU compiles this suite's hundreds of small programs fast (`hisparse_jax.cpu_compile`: -O0, and the
    elemental fusion emitters where XLA has them; the same values). HISPARSE_TEST_XLA_OPT=1 keeps XLA's defaults."""
    if os.environ.get("HISPARSE_TEST_XLA_OPT") != "1":
        from hisparse_jax.cpu_compile import request_fast_compile

        request_fast_compile()


_share_compiled_programs()
_compile_fast()
_interpret_threads()
_synchronous_cpu_dispatch()

# torch and transformers are numerical references only (extra `test`, Python 3.11 leg); the Python 3.12 /
# newest-jax CI leg has neither, and the tests that need them skip with this reason.
REFERENCE_SKIP_REASON = "needs torch + transformers (the numerical references; installed by the 'test' extra)"


def need_reference(name: str):
    """Import torch or transformers, or skip the calling test (or module) with a visible reason."""
    return pytest.importorskip(name, reason=REFERENCE_SKIP_REASON)


@pytest.fixture(scope="module")
def tiny_glm():
    """The library's "tiny-glm" preset as a random-weight model (what the README's snippets build)."""
    from flax import nnx

    import hisparse_jax as hj

    return hj.SparseMLAModel(hj.get_preset("tiny-glm"), rngs=nnx.Rngs(0))


@pytest.fixture(scope="session", params=["deepseek", "glm"])
def hf_pair(request, tmp_path_factory):
    """(kind, transformers model, our model loaded from its saved checkpoint)."""
    import jax.numpy as jnp

    import hisparse_jax as hj
    from tiny import hf_model

    model = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, hj.load_pretrained(path, dtype=jnp.float32)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Drop every compiled program when a test module ends (the next module compiles its own anyway). Keeping
    all executables of the whole suite alive in one process made XLA:CPU crash while compiling late tests."""
    yield
    import jax

    jax.clear_caches()
