"""Indexer keys in 4 bits (`CacheConfig(index_dtype="int4")`: MXFP4, as vLLM's and SGLang's indexer caches): the
store's layout and bytes, tiered decoding equal to the contiguous path scoring the same format, the engine, a P/D
import and a saved store carrying it, and what is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.kv.state import init_store
from hisparse_jax.kv.tiered import check_backend
from pallas_kernels.backends import mosaic_unavailable_reason
from tiny import BIG, model_cfg

PROMPTS = [[(7 * j + i) % 97 for j in range(n)] for i, n in enumerate([300, 460, 190])]
NEW = 24
MOSAIC_CFG = dict(kv_lora_rank=256, qk_rope_head_dim=64, index_head_dim=64)  # what the Mosaic decode takes


@pytest.fixture(scope="module")
def model():
    return hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(0), index_dtype="int4")


def test_index_layout_and_bytes_per_format():
    cfg = model_cfg(index_head_dim=128)
    want = {"auto": 512, "fp8": 132, "int4": 68}  # per token and index layer (auto: the float32 store's keys)
    for fmt, row in want.items():
        spec = StoreSpec.create(cfg, CacheConfig(kv_dtype="float32", index_dtype=fmt, device_pages=2, host_pages=2,
                                                 max_seqs=1, max_seq_len=128))
        assert spec.index_row_bytes == row
        store = jax.eval_shape(lambda s=spec: init_store(s))
        per_token = store.index_k.size * store.index_k.dtype.itemsize + (
            0 if store.index_scale is None else store.index_scale.size * store.index_scale.dtype.itemsize)
        assert per_token == row * spec.num_indexer_layers * spec.index_pages * 64
    spec = StoreSpec.create(cfg, CacheConfig(kv_dtype="bf16", index_dtype="int4", device_pages=2, host_pages=2))
    store = jax.eval_shape(lambda: init_store(spec))
    assert store.index_k.shape[-1] == 64 and store.index_k.dtype == jnp.uint8
    assert store.index_scale.shape[-1] == 4 and store.index_scale.dtype == jnp.uint8
    assert store.latent.dtype == jnp.bfloat16  # the KV format is kv_dtype's


def test_tiered_int4_decodes_the_contiguous_int4_tokens(model):
    """The store's int4 keys are scored exactly as the contiguous path scores int4 (the same quantization of the
    same keys), through evictions, hits and misses; the selection differs from exact keys'."""
    want = hj.generate(model, PROMPTS, NEW)
    cc = BIG.replace(index_dtype="int4", device_pages=14, capacity=BIG.replace(index_dtype="int4"))
    toks, stats = hj.generate(model, PROMPTS, NEW, cache=cc, return_stats=True)
    assert toks == want and stats.misses > 0 and stats.evicted_pages > 0
    exact = hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(0))
    assert hj.generate(exact, PROMPTS, NEW) != want  # the format changes which rows are selected


@pytest.mark.slow
def test_engine_import_and_saved_store_carry_int4(model, tmp_path):
    """An engine with int4 keys: a P/D import decodes the tokens of the same prompt prefilled locally; the policies
    agree; a store saved mid-run restores with its int4 keys bit for bit."""
    from hisparse_jax.engine import Engine, EngineConfig, SamplingParams
    from hisparse_jax.engine.pd import export_prefill
    from hisparse_jax.kv.device import apply_updates
    from hisparse_jax.kv.persist import load_tiered, save_tiered

    cc = BIG.replace(index_dtype="int4", device_pages=20, capacity=BIG.replace(index_dtype="int4"))
    params = SamplingParams(max_new_tokens=NEW)
    outs = {}
    for pol in ("offload", "hisparse"):
        eng = Engine(model, cc, EngineConfig(policy=pol, max_running=3, check_invariants=True))
        eng.add_request("local", PROMPTS[1], params)
        eng.import_request("imported", export_prefill(model, PROMPTS[1], tmp_path / f"{pol}.safetensors"), params)
        eng.add_request("other", PROMPTS[0], params)
        eng.step()
        if pol == "hisparse":
            store = apply_updates(eng.store, eng.manager)
            save_tiered(eng.manager, store, tmp_path / "saved")
            tc, back = load_tiered(tmp_path / "saved")
            assert tc.spec.index_dtype == "int4" and back.index_k.dtype == jnp.uint8
            assert np.array_equal(np.asarray(back.index_k), np.asarray(store.index_k))
            assert np.array_equal(np.asarray(back.index_scale), np.asarray(store.index_scale))
            eng.store = store
        eng.run()
        outs[pol] = eng.outputs()
        assert outs[pol]["imported"] == outs[pol]["local"] and eng.metrics().import_bytes > 0
    assert outs["offload"] == outs["hisparse"]


@pytest.mark.slow
def test_the_triton_indexer_reads_int4_keys_in_the_decode_step(model):
    """kernels='pallas_interpret': the Triton indexer top-k (interpreted) scores the store's MXFP4 keys in place at
    each layer, with the resolver and the decode kernels around it: the reference kernels' tokens, through misses."""
    prompts = [PROMPTS[0], PROMPTS[2]]
    cc = BIG.replace(index_dtype="int4", device_pages=8, capacity=BIG.replace(index_dtype="int4"))
    want, ref_stats = hj.generate(model, prompts, 8, cache=cc, return_stats=True)
    got, stats = hj.generate(model, prompts, 8, cache=cc, return_stats=True, kernels="pallas_interpret")
    assert got == want and stats.misses == ref_stats.misses > 0


def test_int4_refusals():
    with pytest.raises(ValueError, match="index_dtype must be one of"):
        CacheConfig(index_dtype="int8")
    with pytest.raises(ValueError, match="index_dtype must be the capacity's"):
        CacheConfig(index_dtype="int4", capacity=CacheConfig())
    with pytest.raises(ValueError, match="multiple of 32"):
        StoreSpec.create(model_cfg(index_head_dim=16), CacheConfig(index_dtype="int4"))
    spec = StoreSpec.create(model_cfg(), BIG.replace(index_dtype="int4"))
    check_backend(spec, "reference")
    check_backend(spec, "pallas_interpret")
    mosaic = CacheConfig(kv_dtype="bf16", index_dtype="int4", device_pages=2, host_pages=2)
    check_backend(StoreSpec.create(model_cfg(**MOSAIC_CFG), mosaic), "pallas_mosaic_interpret")
    with pytest.raises(ValueError, match="int4 \\(MXFP4\\) keys of an indexer head dim of at most 128"):
        check_backend(StoreSpec.create(model_cfg(**dict(MOSAIC_CFG, index_head_dim=256)), mosaic), "pallas_mosaic")


def test_demo_takes_int4_with_every_kernels_choice():
    from hisparse_jax import demo

    assert demo.parse_args(["--index-dtype", "int4"]).index_dtype == "int4"
    if mosaic_unavailable_reason() is None:  # (jax 0.10 refuses the Mosaic kernels themselves)
        args = demo.parse_args(["--index-dtype", "int4", "--kernels", "pallas_mosaic_interpret"])
        assert (args.index_dtype, args.kernels) == ("int4", "pallas_mosaic_interpret")


@pytest.mark.slow
@pytest.mark.newest_leg  # (CI's slow tests of the lowest-jax leg would skip it: the Mosaic kernels need jax >= 0.11)
@pytest.mark.skipif(mosaic_unavailable_reason() is not None, reason=str(mosaic_unavailable_reason()))
def test_the_mosaic_indexer_reads_int4_keys_in_the_decode_step():
    """kernels='pallas_mosaic_interpret': the Mosaic indexer scores (interpreted) read the store's MXFP4 keys in place
    at each layer (dI 64: a key's two scale bytes as one 16-bit word), with the Mosaic decode and the resolver around
    them: the reference kernels' tokens, hits and misses."""
    m = hj.SparseMLAModel(model_cfg(**MOSAIC_CFG), rngs=nnx.Rngs(0), index_dtype="int4")
    cc = CacheConfig(kv_dtype="bf16", index_dtype="int4", device_pages=6, host_pages=16, max_seqs=2, max_seq_len=320)
    prompts = [PROMPTS[0][:250], PROMPTS[2]]
    want, ref_stats = hj.generate(m, prompts, 8, cache=cc, return_stats=True)
    got, stats = hj.generate(m, prompts, 8, cache=cc, return_stats=True, kernels="pallas_mosaic_interpret")
    assert got == want and stats.misses == ref_stats.misses > 0 and stats.hits == ref_stats.hits
