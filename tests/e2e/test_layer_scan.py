"""The layers are stacked by runs of identical blocks and scanned: the runs of the real configurations, the scanned
forward against a plain loop over the layers one by one, and a program that does not grow with depth."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig, get_preset
from hisparse_jax.engine import runner
from hisparse_jax.gpu_build import abstract_step_args
from hisparse_jax.model.block import prefill_layer
from hisparse_jax.model.decoder import layer_runs
from tiny import model_cfg


def test_runs_of_the_real_models():
    glm = layer_runs(get_preset("glm-5"))
    assert [(r.first, r.repeats, r.size) for r in glm] == [(0, 2, 1), (2, 1, 4), (6, 18, 4)]
    assert sum(r.num_layers for r in glm) == 78 and sum(r.repeats for r in glm) == 21  # 21 full indexers
    ds = layer_runs(get_preset("deepseek-v3.2"))
    assert [(r.first, r.repeats, r.size) for r in ds] == [(0, 3, 1), (3, 58, 1)]


def test_scanned_forward_is_the_layer_by_layer_forward():
    cfg = model_cfg(num_hidden_layers=6, indexer_types=("full", "shared", "full", "shared", "full", "shared"),
                    mlp_layer_types=("dense", "sparse", "sparse", "sparse", "sparse", "sparse"))
    model = hj.SparseMLAModel(cfg, rngs=nnx.Rngs(2))
    assert [(r.repeats, r.size) for r in model.runs] == [(1, 2), (2, 2)]  # a scan of 2 blocks
    ids = jax.random.randint(jax.random.key(0), (2, 40), 0, cfg.vocab_size, dtype=jnp.int32)
    logits, aux = model.forward(ids)

    T = ids.shape[1]
    cos, sin = model.rope(jnp.broadcast_to(jnp.arange(T), ids.shape))
    causal = jnp.tril(jnp.ones((T, T), bool))[None]
    x, attend, latents, topks = model.embed(ids), None, [], []
    for i in range(cfg.num_hidden_layers):
        x, rows, attend = prefill_layer(model, model.layer(i), x, cos, sin, causal, attend)
        latents.append(rows["latent"])
        if rows["topk"] is not None:
            topks.append(rows["topk"])
    np.testing.assert_array_equal(np.asarray(aux["topk"]), np.asarray(jnp.stack(topks)))
    np.testing.assert_allclose(np.asarray(aux["latent"]), np.asarray(jnp.stack(latents)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model.logits(x)), rtol=1e-5, atol=1e-5)


def test_the_step_program_does_not_grow_with_depth():
    """The lowered tiered decode step at 4 and at 16 layers (reference kernels): the same program size up to the
    few per-run constants (lowering only: nothing is compiled)."""
    sizes = {}
    cache = CacheConfig(kv_dtype="float32", device_pages=16, host_pages=16, max_seqs=2, max_seq_len=256)
    for n in (4, 16):
        cfg = model_cfg(num_hidden_layers=n, indexer_types=("full", "shared") * (n // 2),
                        mlp_layer_types=("dense",) + ("sparse",) * (n - 1))
        graphdef, params, store, rows = abstract_step_args(cfg, cache, 2)
        text = runner._jitted_step(graphdef, "reference").trace(params, store, rows).lower().as_text()
        sizes[n] = len(text)
    assert sizes[16] < 1.1 * sizes[4], sizes  # unrolled, it was about 4x
