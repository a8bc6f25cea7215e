"""Attention data parallelism (`generate(..., mesh=...)`, `hisparse_jax.parallel`) on 8 fake CPU devices.

jax sees 8 CPU devices only with XLA_FLAGS=--xla_force_host_platform_device_count=8 set before it initializes;
this test process has initialized jax already, so the checks run once in a subprocess (this file run as a
script), which prints a JSON summary that the tests below assert on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

N = 8
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def _checks() -> dict:
    """Runs in the subprocess (8 devices)."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: tiny.py
    import hisparse_jax as hj
    from hisparse_jax import parallel
    from hisparse_jax.config import CacheConfig
    from hisparse_jax.engine.runner import jitted_sharded_step, prefill_rows
    from hisparse_jax.generate import generate
    from hisparse_jax.kv.manager import PageManager
    from tiny import model_cfg

    out: dict = {"devices": len(jax.devices())}
    t0 = time.perf_counter()
    cfg = model_cfg()
    model = hj.SparseMLAModel(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(130, 300, 10)]
    steps = 6
    # per device: 7 pages for up to 2 requests of up to 5 pages + a hot page each: pages are released, misses
    small = CacheConfig(kv_dtype="float32", device_pages=7, host_pages=24, max_seqs=2, max_seq_len=384)
    mesh = parallel.data_mesh(N)
    toks, stats = generate(model, prompts, steps, cache=small, mesh=mesh, return_stats=True)
    out["mesh_s"] = time.perf_counter() - t0
    one, one_stats = generate(model, prompts, steps, cache=small.replace(device_pages=40, host_pages=80, max_seqs=10),
                              return_stats=True)
    contiguous = generate(model, prompts, steps)
    out.update(mesh_tokens=toks, one_tokens=one, contiguous_tokens=contiguous, stats=stats.to_json(),
               one_misses=one_stats.misses)
    # sampled: rows are sampled in prompt order with the one-device run's keys
    kw = dict(temperature=0.8, top_p=0.9, key=jax.random.key(1), return_logits=True)
    sampled, lg_mesh = generate(model, prompts, 4, cache=small, mesh=mesh, **kw)
    sampled_one, lg_one = generate(model, prompts, 4, cache=small.replace(device_pages=40, host_pages=80,
                                                                          max_seqs=10), **kw)
    out.update(sampled_equal=sampled == sampled_one,
               logits_max_diff=max(float(np.max(np.abs(a - b))) for a, b in zip(lg_mesh, lg_one)))

    # a stacked store with one prompt on some ranks, and the sharded decode step over it
    managers = [PageManager(cfg, small) for _ in range(N)]
    store = parallel.new_stacked_store(managers, mesh)
    rows = {}
    for r in (0, 3, 7):
        _, latent, rope, index_k = prefill_rows(model, prompts[r])
        rows[r] = (latent, rope, index_k, len(prompts[r]))
    store, slots = parallel.admit_prefilled_ranks(store, managers, rows)
    B = 2
    req = np.full((N, B), -1, np.int32)
    for r, s in slots.items():
        req[r, 0] = s
    store = parallel.reserve_next_ranks(store, managers, req.tolist())
    graphdef, state = nnx.split(model)
    state = parallel.replicate(state, mesh)
    batch = parallel.put_batch(mesh, {"tokens": np.ones((N, B), np.int32), "req": req,
                                      "index_span": np.zeros((N, 4), np.int32)})
    step = jitted_sharded_step(graphdef, mesh)
    hlo = step.lower(state, store, batch).compile().as_text()
    out["hlo_collectives"] = {c: hlo.count(c) for c in COLLECTIVES}
    out["hlo_chars"] = len(hlo)
    # the detector's positive control: a psum over the axis compiles to an all-reduce
    psum = jax.jit(parallel.shard_map(lambda x: jax.lax.psum(x, "data"), mesh, P("data"), P()))
    out["control_all_reduce"] = psum.lower(np.ones(N, np.float32)).compile().as_text().count("all-reduce")
    logits, store, step_stats = step(state, store, batch)
    out["logits_shape"] = list(logits.shape)

    def layout(store):
        leaves = {}
        for name, leaf in vars(store).items():
            if not isinstance(leaf, jax.Array):
                continue
            shards = leaf.addressable_shards
            leaves[name] = {"shape": list(leaf.shape), "kind": leaf.sharding.memory_kind,
                            "shard_shapes": [list(s.data.shape) for s in shards],
                            "shard_kinds": sorted({s.data.sharding.memory_kind for s in shards}),
                            "devices": len({s.device.id for s in shards})}
        return leaves

    out["layout"] = layout(store)  # after a decode step: the step keeps the layout
    out["seq_lens"] = np.asarray(store.seq_lens).tolist()
    out["total_s"] = time.perf_counter() - t0
    return out


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N}").strip())
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["wall_s"] = time.perf_counter() - t0
    print(f"mesh checks: {res['wall_s']:.1f}s in the subprocess (mesh generate {res['mesh_s']:.1f}s)")
    return res


def test_sees_eight_devices(result):
    assert result["devices"] == N


def test_mesh_generate_equals_one_device_and_contiguous(result):
    assert result["mesh_tokens"] == result["one_tokens"] == result["contiguous_tokens"]
    s = result["stats"]
    assert s["misses"] > 0 and s["evicted_pages"] > 0 and s["append_dropped"] == 0
    assert s["steps"] == 5


def test_mesh_sampling_equals_one_device(result):
    assert result["sampled_equal"]
    assert result["logits_max_diff"] < 1e-4


def test_sharded_decode_step_has_no_collectives(result):
    # params are replicated (P()) and every store leaf and batch row is split on the data axis: each device
    # decodes its own requests against its own slice, so the compiled step has no cross-device traffic at all
    assert result["hlo_collectives"] == {c: 0 for c in COLLECTIVES}
    assert result["hlo_chars"] > 10_000 and result["control_all_reduce"] > 0
    assert result["logits_shape"] == [N, 2, 97]


def test_every_store_leaf_is_split_over_the_devices(result):
    layout = result["layout"]
    assert {"latent", "rope", "index_k", "h_latent", "h_rope", "block_table", "seq_lens", "hot_token",
            "clock"} <= set(layout)
    for name, leaf in layout.items():
        assert leaf["shape"][0] == N, name
        assert leaf["devices"] == N, name
        assert leaf["shard_shapes"] == [[1] + leaf["shape"][1:]] * N, name
        want = "pinned_host" if name.startswith("h_") else "device"
        assert leaf["kind"] == want and leaf["shard_kinds"] == [want], (name, leaf["kind"], leaf["shard_kinds"])
    # ranks 0, 3, 7 hold their prompt (+1 decoded token) in slot 0; the others are empty
    lens = [row[0] for row in result["seq_lens"]]
    assert [r for r in range(N) if lens[r]] == [0, 3, 7]


def test_mesh_needs_the_tiered_store_and_a_one_axis_mesh():
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh

    import hisparse_jax as hj
    from hisparse_jax import parallel
    from hisparse_jax.config import CacheConfig
    from hisparse_jax.generate import generate
    from tiny import model_cfg

    model = hj.SparseMLAModel(model_cfg(num_hidden_layers=2, indexer_types=("full", "shared"),
                                        mlp_layer_types=("dense", "sparse")), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mesh needs the tiered store"):
        generate(model, [[1, 2, 3]], 2, mesh=parallel.data_mesh(1))
    import jax

    two_axes = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("a", "b"))
    with pytest.raises(ValueError, match="one-axis"):
        generate(model, [[1, 2, 3]], 2, cache=CacheConfig(), mesh=two_axes)
    with pytest.raises(ValueError, match="n must be an int"):
        parallel.data_mesh(len(jax.devices()) + 1)


if __name__ == "__main__":
    print(json.dumps(_checks()))
