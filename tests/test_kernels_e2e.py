"""Generation with the Pallas kernels (interpret mode on the CPU) == generation with the jnp references."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.generate import generate
from test_tiered_decode import model_cfg

# Tolerance: the kernels sum the attention in blocks with an online softmax (another summation order
# than the reference); in float32 the logits agree to ~1e-6.
LOGIT_ATOL = 1e-4


def test_generation_with_kernels_matches_references():
    m = hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 97, n).tolist() for n in (250, 190)]
    cc = CacheConfig(kv_dtype="float32", device_pages=6, host_pages=16, max_seqs=2, max_seq_len=320)
    ref, s_ref, l_ref = generate(m, prompts, 8, cache=cc, return_stats=True, return_logits=True)
    ker, s_ker, l_ker = generate(m, prompts, 8, cache=cc, return_stats=True, return_logits=True,
                                 kernels="pallas_interpret")
    assert ker == ref
    assert s_ker["misses"] == s_ref["misses"] > 0 and s_ker["hits"] == s_ref["hits"]
    for a, b in zip(l_ref, l_ker):
        np.testing.assert_allclose(a, b, atol=LOGIT_ATOL, rtol=0)


def test_kernel_choice_is_explicit():
    m = hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown kernels"):
        generate(m, [[1, 2, 3]], 2, cache=CacheConfig(kv_dtype="float32", max_seqs=1, max_seq_len=128),
                 kernels="triton")
    with pytest.raises(ValueError, match="GPU backend"):
        generate(m, [[1, 2, 3]], 2, cache=CacheConfig(kv_dtype="float32", max_seqs=1, max_seq_len=128),
                 kernels="pallas")
    with pytest.raises(ValueError, match="tiered store"):
        generate(m, [[1, 2, 3]], 2, kernels="pallas_interpret")
