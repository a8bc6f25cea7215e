"""Generation with the Pallas kernels (interpret mode on the CPU) == generation with the jnp references: the Triton
kernels ("pallas_interpret") and the sparse MLA decode on Mosaic GPU ("pallas_mosaic_interpret", jax >= 0.11)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.generate import generate
from pallas_kernels.backends import mosaic_unavailable_reason
from tiny import model_cfg

# Tolerance: the kernels sum the attention in blocks with an online softmax (another summation order
# than the reference); in float32 the logits agree to ~1e-6.
LOGIT_ATOL = 1e-4


def same_generation(kernels: str, kv_dtype: str, new_tokens: int = 8, **cfg):
    """Two requests under HiSparse with a device pool too small for both (hot buffers, misses from host):
    `kernels` and the jnp references give the same tokens, hits and misses. Returns both runs' logits."""
    m = hj.SparseMLAModel(model_cfg(**cfg), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 97, n).tolist() for n in (250, 190)]
    cc = CacheConfig(kv_dtype=kv_dtype, device_pages=6, host_pages=16, max_seqs=2, max_seq_len=320)
    ref, s_ref, l_ref = generate(m, prompts, new_tokens, cache=cc, return_stats=True, return_logits=True)
    ker, s_ker, l_ker = generate(m, prompts, new_tokens, cache=cc, return_stats=True, return_logits=True,
                                 kernels=kernels)
    assert ker == ref
    assert s_ker.misses == s_ref.misses > 0 and s_ker.hits == s_ref.hits
    return l_ref, l_ker


def test_generation_with_kernels_matches_references():
    for a, b in zip(*same_generation("pallas_interpret", "float32")):
        np.testing.assert_allclose(a, b, atol=LOGIT_ATOL, rtol=0)


# The Mosaic decode reads bf16 / fp8 pools, latent widths a multiple of 256, rope widths a multiple of 64
MOSAIC_CFG = dict(kv_lora_rank=256, qk_rope_head_dim=64, index_head_dim=64)


@pytest.mark.skipif(mosaic_unavailable_reason() is not None, reason=str(mosaic_unavailable_reason()))
@pytest.mark.parametrize("heads, new_tokens", [(3, 8), (128, 4)])
def test_generation_with_mosaic_decode_matches_references(heads, new_tokens):
    """bf16 KV. The Mosaic kernel multiplies bf16 operands (q and p rounded to bf16, as FlashMLA does): logits
    agree to ~1e-3 of their scale (measured 5e-4), and the same rows are selected, hit and missed. 128 heads: two
    64-head blocks in one cluster sharing the row copies, inside the decode step; 3 decode steps (112 misses, 16
    hits), as each interpreted step of 128 heads takes ~7 s here."""
    l_ref, l_mos = same_generation("pallas_mosaic_interpret", "bf16", new_tokens, **MOSAIC_CFG,
                                   num_attention_heads=heads)
    scale = max(float(np.max(np.abs(a))) for a in l_ref)
    for a, b in zip(l_ref, l_mos):
        np.testing.assert_allclose(a, b, atol=5e-3 * scale, rtol=0)


@pytest.mark.skipif(mosaic_unavailable_reason() is not None, reason=str(mosaic_unavailable_reason()))
@pytest.mark.parametrize("dtype, want", [("bfloat16", "bfloat16"), ("float32", "float32")])
def test_step_asks_the_mosaic_decode_for_the_queries_dtype(monkeypatch, dtype, want):
    """The tiered step asks the Mosaic decode for bf16 output exactly when the queries are bf16 (the model rounds
    o_lat to its dtype before W_UV). The decode is swapped for its reference here (same arguments): the wiring is
    under test, not the kernel."""
    import pallas_kernels
    from pallas_kernels.sparse_mla_decode import sparse_mla_decode_reference

    seen = []

    def recording(*a, backend, interpret, out_dtype, **kw):
        seen.append((backend, jnp.dtype(out_dtype).name))
        return sparse_mla_decode_reference(*a, out_dtype=out_dtype, **kw)

    monkeypatch.setattr(pallas_kernels, "sparse_mla_decode", recording)
    m = hj.SparseMLAModel(model_cfg(**MOSAIC_CFG, dtype=dtype), rngs=nnx.Rngs(0))
    cc = CacheConfig(kv_dtype="bf16", device_pages=6, host_pages=16, max_seqs=1, max_seq_len=320)
    generate(m, [list(range(1, 70))], 2, cache=cc, kernels="pallas_mosaic_interpret")
    assert seen and set(seen) == {("mosaic", want)}


def test_mosaic_choice_is_checked():
    """Refused before anything runs: float32 KV, a latent width or an indexer head dim the kernels do not take (and,
    on jax 0.10, the backend itself); on a CPU the non-interpreted choice needs a GPU backend."""
    def run(cfg, kv, kernels="pallas_mosaic_interpret"):
        m = hj.SparseMLAModel(model_cfg(**cfg), rngs=nnx.Rngs(0))
        generate(m, [[1, 2, 3]], 2, cache=CacheConfig(kv_dtype=kv, max_seqs=1, max_seq_len=128, device_pages=4,
                                                        host_pages=4), kernels=kernels)

    if mosaic_unavailable_reason() is not None:
        with pytest.raises(ValueError, match="jax >= 0.11"):
            run(MOSAIC_CFG, "bf16")
        return
    with pytest.raises(ValueError, match="bfloat16 or fp8 KV .* kv_dtype 'float32'"):
        run(MOSAIC_CFG, "float32")
    with pytest.raises(ValueError, match="multiple of 256 .* latent 32"):
        run({}, "bf16")
    with pytest.raises(ValueError, match="indexer head dim that is a multiple of 32 .*this store: 80"):
        run(dict(MOSAIC_CFG, index_head_dim=80), "bf16")
    if __import__("jax").default_backend() != "gpu":
        with pytest.raises(ValueError, match="GPU backend"):
            run(MOSAIC_CFG, "bf16", kernels="pallas_mosaic")


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


@pytest.mark.skipif(mosaic_unavailable_reason() is not None, reason=str(mosaic_unavailable_reason()))
def test_mosaic_interpret_refused_without_what_it_needs():
    """The interpreted Mosaic decode on an XLA:CPU pool too small for its warpgroups, or on an asynchronously
    dispatching CPU client, is refused, saying what to set (the suite itself has both: conftest)."""
    import jax

    from hisparse_jax.kv.tiered import check_kernels

    if jax.default_backend() != "cpu":
        pytest.skip("CPU only")
    assert check_kernels("pallas_mosaic_interpret") == "pallas_mosaic_interpret"
    with pytest.MonkeyPatch.context() as mp:  # a 2-thread pool cannot run the kernel's warpgroups and the step's callback
        mp.setenv("PJRT_NPROC", "2")
        with pytest.raises(ValueError, match="PJRT_NPROC=8"):
            check_kernels("pallas_mosaic_interpret")
    jax.config.update("jax_cpu_enable_async_dispatch", True)  # the flag only; the existing client keeps its mode
    try:
        with pytest.raises(ValueError, match="jax_cpu_enable_async_dispatch', False"):
            check_kernels("pallas_mosaic_interpret")
        assert check_kernels("pallas_interpret") == "pallas_interpret"
    finally:
        jax.config.update("jax_cpu_enable_async_dispatch", False)


def test_mosaic_decode_refused_on_a_gpu(monkeypatch):
    """kernels='pallas_mosaic' is refused on a GPU backend, saying why (the Mosaic decode was wrong on an H200);
    on a CPU it was refused already (no GPU backend), and its interpreted form stays available."""
    import jax

    from hisparse_jax.kv import tiered

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="not on an H200" if mosaic_unavailable_reason() is None else "jax >= 0.11"):
        tiered.check_kernels("pallas_mosaic")
    assert tiered.check_kernels("pallas") == "pallas"
