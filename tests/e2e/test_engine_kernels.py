"""The engine runs its decode step with the kernels its `EngineConfig` names, like `generate(kernels=...)`;
`hisparse demo --kernels` passes the choice through. A bad choice is refused, never silently replaced."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax import cli, demo_run
from hisparse_jax.config import CacheConfig
from hisparse_jax.engine import Engine, EngineConfig, SamplingParams
from tiny import model_cfg


@pytest.fixture(scope="module")
def model():
    return hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_engine_with_interpreted_kernels_gives_the_reference_tokens(model):
    """Two requests under HiSparse with a device pool too small for them (hot buffers, misses from host):
    the Pallas kernels (interpret mode) and the jnp references produce the same greedy tokens and hit counts."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 97, n).tolist() for n in (250, 190)]
    cache = CacheConfig(kv_dtype="float32", device_pages=6, host_pages=16, max_seq_len=320)
    out, metrics = {}, {}
    for kernels in ("reference", "pallas_interpret"):
        eng = Engine(model, cache, EngineConfig(policy="hisparse", max_running=2, prefill="whole", min_bucket=2,
                                                kernels=kernels, check_invariants=True))
        out[kernels] = eng.generate(prompts, SamplingParams(max_new_tokens=4))
        metrics[kernels] = eng.metrics()
    assert out["pallas_interpret"] == out["reference"]
    assert all(len(t) == 4 for t in out["reference"])
    ref, ker = metrics["reference"], metrics["pallas_interpret"]
    assert ref.misses > 0 and (ker.hits, ker.misses) == (ref.hits, ref.misses)


def test_bad_kernels_are_refused(model):
    with pytest.raises(ValueError, match="unknown kernels 'triton'"):
        EngineConfig(kernels="triton")
    if __import__("jax").default_backend() != "gpu":
        with pytest.raises(ValueError, match="GPU backend"):
            Engine(model, CacheConfig(kv_dtype="float32", max_seq_len=128), EngineConfig(kernels="pallas"))
    assert EngineConfig().kernels == "reference"


def test_demo_kernels_flag(monkeypatch, capsys):
    assert cli.main(["demo", "--kernels", "triton"]) == 2  # argparse choices: a usage error
    assert "invalid choice" in capsys.readouterr().err
    if __import__("jax").default_backend() != "gpu":
        assert cli.main(["demo", "--kernels", "pallas"]) == 2
        assert "GPU backend" in capsys.readouterr().err

    seen = {}

    class Reached(Exception):
        pass

    def engine(model, cache, config, index_codebooks=None):
        seen["kernels"] = config.kernels
        raise Reached

    monkeypatch.setattr(demo_run, "Engine", engine)
    with pytest.raises(Reached):
        cli.main(["demo", "--kernels", "pallas_interpret", "--requests", "1", "--prompt-len", "64", "--new-tokens", "1",
                  "--policies", "hisparse", "--plot", ""])
    assert seen == {"kernels": "pallas_interpret"}
