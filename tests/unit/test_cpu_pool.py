"""hisparse_jax.cpu_pool: XLA:CPU's pool size as XLA reads it, and the request that Mosaic's interpreter needs."""

from __future__ import annotations

import os

from hisparse_jax import cpu_pool


def test_pool_size_follows_the_environment(monkeypatch):
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.delenv("NPROC", raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert cpu_pool.cpu_pool_threads() == cpus
    monkeypatch.setenv("NPROC", "3")
    assert cpu_pool.cpu_pool_threads() == 3
    monkeypatch.setenv("PJRT_NPROC", "6")  # read first, as XLA does
    assert cpu_pool.cpu_pool_threads() == 6
    monkeypatch.setenv("PJRT_NPROC", "junk")  # not a number: the next source
    assert cpu_pool.cpu_pool_threads() == 3


def test_request_and_refusal(monkeypatch):
    monkeypatch.setenv("PJRT_NPROC", "2")
    why = cpu_pool.interpret_pool_short_reason(5)
    assert why is not None and "5 warpgroups" in why and "has 2" in why and "PJRT_NPROC=8" in why
    cpu_pool.request_interpret_threads()
    assert os.environ["PJRT_NPROC"] == str(cpu_pool.INTERPRET_POOL_THREADS)
    assert cpu_pool.interpret_pool_short_reason(5) is None
    monkeypatch.setenv("PJRT_NPROC", "16")  # already large enough: left alone
    cpu_pool.request_interpret_threads()
    assert os.environ["PJRT_NPROC"] == "16"
