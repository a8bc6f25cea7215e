"""The fast-compile flags: an XLA that does not know a flag is never given it (it would abort at start-up), and
this run got every flag its XLA knows. The memory-map limit: XLA:CPU crashes at it (the reproducer), and the guard
drops compiled programs before a long run gets there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hisparse_jax import cpu_compile

REPRO = Path(__file__).resolve().parents[2] / "experiments" / "repro_xla_cpu_map_limit.py"


def test_unknown_flags_are_left_out():
    bogus = "--xla_cpu_no_such_flag_hisparse=true"
    known = "--xla_backend_optimization_level=0"
    assert cpu_compile.known_xla_flags([bogus, known]) == [known]
    assert cpu_compile.known_xla_flags([known]) == [known]


def test_this_run_compiles_fast():
    if os.environ.get("HISPARSE_TEST_XLA_OPT") == "1":
        return  # the user asked for XLA's defaults
    flags = os.environ["XLA_FLAGS"].split()
    assert set(cpu_compile.FAST_COMPILE_FLAGS) <= set(flags)
    assert set(cpu_compile.known_xla_flags(cpu_compile.PROBED_FLAGS)) <= set(flags)


def test_dropping_programs_frees_their_memory_maps():
    import jax
    import jax.numpy as jnp

    if cpu_compile.memory_maps() is None:
        pytest.skip("the kernel does not report memory maps (not Linux)")
    assert not cpu_compile.drop_programs_near_map_limit(1.0)  # nowhere near: nothing dropped
    fns = [jax.jit(lambda x, i=i: jnp.tanh(x * (i + 1)).sum()) for i in range(60)]
    before = cpu_compile.memory_maps()[0]
    for f in fns:
        f(jnp.ones(3)).block_until_ready()
    held = cpu_compile.memory_maps()[0]
    assert held - before >= 60  # each live executable holds maps (about 3 each)
    assert cpu_compile.drop_programs_near_map_limit(0.0)
    assert cpu_compile.memory_maps()[0] < held - 50
    assert float(fns[0](jnp.ones(3))) == pytest.approx(3 * float(jnp.tanh(1.0)))  # compiles again when called


def _repro(spare: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}  # no persistent cache: a real compile
    return subprocess.run([sys.executable, str(REPRO), "--spare", str(spare)], capture_output=True, text=True,
                          timeout=300, env={**env, "JAX_PLATFORMS": "cpu"})


def test_xla_cpu_fails_to_compile_at_the_memory_map_limit():
    """The reproducer of docs/xla_cpu_map_limit.md: 50 maps under the limit a program compiles and runs; 5 under
    it the compile fails for want of maps ("Cannot allocate memory"). Today XLA:CPU then dies of SIGSEGV while
    throwing that error; a fixed XLA would raise it (either way the run is lost, which the guard prevents)."""
    maps = cpu_compile.memory_maps()
    if maps is None or maps[1] > 300_000:
        pytest.skip("needs Linux and a vm.max_map_count small enough to fill in a test")
    ok = _repro(50)
    assert ok.returncode == 0 and "compiled and ran" in ok.stdout, ok.stdout + ok.stderr
    at_limit = _repro(5)
    out = at_limit.stdout + at_limit.stderr
    assert at_limit.returncode != 0 and "Cannot allocate memory" in out, out
