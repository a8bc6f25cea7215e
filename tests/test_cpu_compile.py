"""The fast-compile flags: an XLA that does not know a flag is never given it (it would abort at start-up), and
this run got every flag its XLA knows."""

from __future__ import annotations

import os

from hisparse_jax import cpu_compile


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
