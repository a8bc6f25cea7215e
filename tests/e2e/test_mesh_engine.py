"""The engine across a device mesh (`MeshEngine`: attention data parallelism, one `Engine` per rank over its slice
of one stacked store) on 8 fake CPU devices.

As in test_mesh.py, jax sees 8 CPU devices only with XLA_FLAGS set before it starts, so the checks run once in a
subprocess (this file run as a script) that prints a JSON summary the tests assert on. The refusals run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

# one 8-device subprocess, ~2-4 min: slow (CI runs it on one leg, the lowest-jax one)
pytestmark = pytest.mark.slow

N = 8
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
POLICIES = ("preempt", "offload", "hisparse")


def _checks() -> dict:
    """Runs in the subprocess (8 devices)."""
    import jax
    import numpy as np
    from flax import nnx

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: tiny.py
    import hisparse_jax as hj
    from hisparse_jax import parallel
    from hisparse_jax.config import CacheConfig
    from hisparse_jax.engine import EngineConfig, MeshEngine, SamplingParams
    from hisparse_jax.engine.runner import jitted_sharded_step
    from hisparse_jax.generate import generate
    from hisparse_jax.model.decoder import layer_runs
    from tiny import model_cfg

    out: dict = {"devices": len(jax.devices())}
    t0 = time.perf_counter()
    cfg = model_cfg()
    model = hj.SparseMLAModel(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(130, 300, 2 * N)]
    new = 5
    out["contiguous"] = generate(model, prompts, new)
    mesh = parallel.data_mesh(N)
    # per device: 7 KV pages for up to 2 requests of up to 5 pages (+ a hot page each under HiSparse)
    small = CacheConfig(kv_dtype="float32", device_pages=7, host_pages=24, max_seq_len=384)
    out["policies"] = {}
    for policy in POLICIES:
        eng = MeshEngine(model, small, EngineConfig(policy=policy, max_running=2, prefill="whole",
                                                    check_invariants=True), mesh=mesh)
        toks = eng.generate(prompts, SamplingParams(max_new_tokens=new))
        m = eng.metrics()
        hist = m.history
        shapes = {(h.bucket, h.scored_pages) for h in hist if h.bucket}
        out["policies"][policy] = {
            "tokens": toks, "ranks": [eng.rank_of(f"gen-{i}") for i in range(len(prompts))],
            "totals": {k: getattr(m, k) for k in ("tokens", "hits", "misses", "evicted_pages", "preemptions",
                                                  "swaps", "h2d_bytes", "d2h_bytes", "max_running")},
            "rank_sums": {k: sum(getattr(r, k) for r in m.ranks) for k in ("tokens", "hits", "misses",
                                                                           "evicted_pages", "preemptions", "swaps",
                                                                           "h2d_bytes", "d2h_bytes")},
            "rank_steps": [r.steps for r in m.ranks], "steps": m.steps,
            "running_sum_ok": all(h.running == sum(r.history[i].running for r in m.ranks) for i, h in enumerate(hist)),
            "compiled_steps": sum(h.compiled for h in hist), "shapes": len(shapes),
        }
    # chunked prefill + prefix caching: a request whose prompt's pages a rank holds goes to that rank
    eng = MeshEngine(model, small.replace(device_pages=12), EngineConfig(policy="hisparse", max_running=2,
                                                                         prefill="chunked", prefill_chunk=64,
                                                                         check_invariants=True), mesh=mesh)
    shared = prompts[0][:192]
    for i in range(3):  # fillers: ranks 0..2
        eng.add_request(f"fill{i}", prompts[i + 1][:100], SamplingParams(max_new_tokens=2))
    eng.add_request("a", shared + [5, 6, 7], SamplingParams(max_new_tokens=3))  # rank 3
    eng.run()
    eng.add_request("b", shared + [9, 9], SamplingParams(max_new_tokens=3))
    eng.add_request("c", prompts[5][:150], SamplingParams(max_new_tokens=3))
    eng.run()
    m = eng.metrics()
    out["prefix"] = {"ranks": {rid: eng.rank_of(rid) for rid in ("fill0", "fill1", "fill2", "a", "b", "c")},
                     "cached_tokens": m.cached_tokens, "outputs": eng.outputs()}
    out["prefix_reference"] = dict(zip(("a", "b", "c"), generate(model, [shared + [5, 6, 7], shared + [9, 9],
                                                                          prompts[5][:150]], 3)))
    rr = MeshEngine(model, small, EngineConfig(policy="hisparse", max_running=2, placement="round_robin"), mesh=mesh)
    for i in range(11):
        rr.add_request(f"r{i}", prompts[i][:70], SamplingParams(max_new_tokens=1))
    out["round_robin"] = [rr.rank_of(f"r{i}") for i in range(11)]
    # the compiled mesh step (decode + sample) moves nothing between devices
    graphdef, state = nnx.split(model)
    step = jitted_sharded_step(graphdef, mesh, sample=True)
    B = 2
    batch = parallel.put_batch(mesh, {"tokens": np.ones((N, B), np.int32), "req": np.full((N, B), -1, np.int32),
                                      "pos": np.full((N, B), -1, np.int32), "index_span": np.zeros((N, 4), np.int32)})
    sampling = parallel.put_batch(mesh, {"rows": np.zeros((N, B), np.int32), "seed": np.zeros((N, B), np.uint32),
                                         "pos": np.zeros((N, B), np.int32),
                                         "temperature": np.zeros((N, B), np.float32),
                                         "top_p": np.ones((N, B), np.float32)})
    hlo = step.lower(parallel.replicate(state, mesh), rr.store, batch, sampling).compile().as_text()
    out["hlo_collectives"] = {c: hlo.count(c) for c in COLLECTIVES}
    out["hlo_chars"] = len(hlo)

    # expert parallelism: 8 routed experts, one per device
    ep_cfg = model_cfg(n_routed_experts=N)
    ep_model = hj.SparseMLAModel(ep_cfg, rngs=nnx.Rngs(1))
    eng = MeshEngine(ep_model, small, EngineConfig(policy="hisparse", max_running=2, prefill="whole",
                                                   expert_parallel=True, check_invariants=True), mesh=mesh)
    toks = eng.generate(prompts, SamplingParams(max_new_tokens=new))
    out["ep"] = {"tokens": toks, "reference": generate(ep_model, prompts, new), "misses": eng.metrics().misses}
    params = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(eng.runner.params)[0]:
        name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        params[name] = {"shape": list(leaf.shape), "shards": sorted({tuple(x.data.shape) for x in leaf.addressable_shards}),
                        "devices": len({x.device.id for x in leaf.addressable_shards})}
    out["ep"]["params"] = params
    ep_step = jitted_sharded_step(nnx.split(ep_model)[0], mesh, "reference", True, sample=True)
    hlo = ep_step.lower(eng.runner.params, eng.store, batch, sampling).compile().as_text()
    out["ep"]["collectives"] = [line.split(" = ", 1)[1].split("(")[0] for line in hlo.splitlines()
                                if any(f" {c}(" in line or f" {c}-start(" in line for c in COLLECTIVES) and " = " in line]
    out["ep"]["moe_layers"] = sum(t == "sparse" for t in ep_cfg.mlp_layer_types)
    # the MoE layers as the program holds them: one stacked module per position of a run's block (`layer_runs`)
    out["ep"]["moe_modules"] = sum(k[1] == "sparse" for run in layer_runs(ep_cfg) for k in run.kinds)
    out["ep"]["hidden"] = ep_cfg.hidden_size
    try:  # 6 experts over 8 devices
        MeshEngine(model, small, EngineConfig(expert_parallel=True), mesh=mesh)
        out["ep"]["refused"] = None
    except ValueError as e:
        out["ep"]["refused"] = str(e)
    # `hisparse demo --devices N`'s engine: a MeshEngine per policy, per-rank running requests reported
    from hisparse_jax import demo

    res = demo.run(devices=N, requests=2, prompt_len=64, new_tokens=2, device_requests=1.5,
                   policies=("offload", "hisparse"), plot="", json=True)
    out["demo"] = {"devices": res["devices"], "requests": res["requests"], "identical": res["outputs_identical"],
                   "ranks": {p: res["policies"][p]["ranks_mean_running"] for p in res["policies"]},
                   "mean_running": {p: res["policies"][p]["mean_running"] for p in res["policies"]}}
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
                          timeout=900, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"mesh engine checks: {time.perf_counter() - t0:.1f}s in the subprocess")
    return res


def test_sees_eight_devices(result):
    assert result["devices"] == N


@pytest.mark.parametrize("policy", POLICIES)
def test_mesh_engine_tokens_equal_one_device(result, policy):
    r = result["policies"][policy]
    assert r["tokens"] == result["contiguous"]
    assert sorted(r["ranks"]) == sorted(list(range(N)) * 2)  # balanced: two requests per rank
    if policy == "hisparse":
        assert r["totals"]["misses"] > 0 and r["totals"]["evicted_pages"] > 0
        assert r["totals"]["max_running"] > N  # both requests of a rank decode together, pages released


@pytest.mark.parametrize("policy", POLICIES)
def test_mesh_metrics_are_the_sums_of_the_ranks(result, policy):
    r = result["policies"][policy]
    assert r["totals"]["tokens"] == 2 * N * 5
    assert {k: r["totals"][k] for k in r["rank_sums"]} == r["rank_sums"]
    assert r["rank_steps"] == [r["steps"]] * N and r["running_sum_ok"]


@pytest.mark.parametrize("policy", POLICIES)
def test_mesh_step_compiles_once_per_shape(result, policy):
    r = result["policies"][policy]
    assert r["compiled_steps"] <= r["shapes"]


def test_placement_prefers_the_rank_holding_the_prefix(result):
    p = result["prefix"]
    assert [p["ranks"][k] for k in ("fill0", "fill1", "fill2", "a")] == [0, 1, 2, 3]
    assert p["ranks"]["b"] == 3 and p["ranks"]["c"] == 0  # b shares a's pages; c goes to the lowest idle rank
    assert p["cached_tokens"] >= 192
    assert {k: p["outputs"][k] for k in ("a", "b", "c")} == result["prefix_reference"]


def test_round_robin_placement(result):
    assert result["round_robin"] == [i % N for i in range(11)]


def test_demo_runs_on_the_mesh(result):
    d = result["demo"]
    assert (d["devices"], d["requests"], d["identical"]) == (N, 2 * N, True)
    for pol, ranks in d["ranks"].items():
        # every rank served its two requests; the total per step is the sum of the ranks' (a rank's mean is over
        # its own decode steps, so the ranks' means add up to at least the total's)
        assert len(ranks) == N and all(r >= 1 for r in ranks), (pol, ranks)
        assert 1 <= d["mean_running"][pol] <= sum(ranks) + 1e-9, (pol, ranks, d["mean_running"][pol])


def test_demo_devices_beyond_what_jax_sees_is_refused():
    import jax

    from hisparse_jax import demo, demo_workload

    with pytest.raises(demo_workload.DemoSetupError, match="xla_force_host_platform_device_count"):
        demo.run(devices=len(jax.devices()) + 1, requests=1, prompt_len=64, new_tokens=1, plot="")


def test_mesh_step_has_no_collectives(result):
    assert result["hlo_collectives"] == {c: 0 for c in COLLECTIVES}
    assert result["hlo_chars"] > 10_000


def test_expert_parallel_tokens_equal_one_device(result):
    ep = result["ep"]
    assert ep["tokens"] == ep["reference"] and ep["misses"] > 0


def test_expert_parallel_needs_experts_divisible_by_devices(result):
    assert "divisible" in result["ep"]["refused"] and "(6)" in result["ep"]["refused"]


def test_expert_parallel_splits_only_the_routed_experts(result):
    params = result["ep"]["params"]
    experts = {k: v for k, v in params.items() if "/experts/" in k}
    assert len(experts) == 3 * result["ep"]["moe_modules"]  # gate, up, down per stacked MoE module
    assert result["ep"]["moe_modules"] < result["ep"]["moe_layers"]  # some MoE layers are stacked
    for name, p in params.items():
        assert p["devices"] == N, name
        if name in experts:  # 1/N of the experts per device: the expert axis (after the stacked layer axis)
            assert name.startswith("stacks/"), name
            assert p["shape"][1] == N and p["shards"] == [[p["shape"][0], 1] + p["shape"][2:]], name
        else:  # replicated
            assert p["shards"] == [p["shape"]], name


def test_expert_parallel_collectives_are_the_moe_token_exchanges(result):
    # per MoE layer: every rank's hidden states gathered [N * B, D] and the expert sums scattered back [B, D];
    # nothing else crosses devices (no KV pool, no table, no logits). A scanned run's block is compiled once: the
    # program holds the exchanges of each stacked MoE module once
    ep, B = result["ep"], 2
    ops = ep["collectives"]
    assert len(ops) == 2 * ep["moe_modules"], ops
    d = ep["hidden"]
    for op in ops:
        shape, kind = op.rsplit(" ", 1)
        assert kind in ("all-gather", "reduce-scatter", "all-gather-start"), op
        want = f"[{N * B},{d}]" if kind.startswith("all-gather") else f"[{B},{d}]"
        assert want in shape, op


# ----- refusals, one device -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_model():
    from flax import nnx

    import hisparse_jax as hj
    from tiny import model_cfg

    return hj.SparseMLAModel(model_cfg(num_hidden_layers=2, indexer_types=("full", "shared"),
                                       mlp_layer_types=("dense", "sparse")), rngs=nnx.Rngs(0))


def test_mesh_engine_refusals_and_log(small_model, tmp_path):
    from hisparse_jax import parallel
    from hisparse_jax.config import CacheConfig
    from hisparse_jax.engine import EngineConfig, MeshEngine, SamplingParams
    from hisparse_jax.engine.engine import UnknownRequest

    mesh = parallel.data_mesh(1)
    cc = CacheConfig(kv_dtype="float32", device_pages=16, host_pages=32, max_seq_len=256)
    with pytest.raises(ValueError, match="unknown placement"):
        EngineConfig(placement="random")
    with pytest.raises(ValueError, match="speculative"):
        MeshEngine(small_model, cc, EngineConfig(prefill="whole", prefix_caching=False, speculative_tokens=1),
                   mesh=mesh)
    with pytest.raises(ValueError, match="one-axis"):
        MeshEngine(small_model, cc, mesh="not a mesh")
    log = tmp_path / "steps.jsonl"
    eng = MeshEngine(small_model, cc, EngineConfig(max_running=2, log_path=str(log)), mesh=mesh)
    eng.add_request("x", [1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("x", [1, 2, 3])
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("y", [])
    with pytest.raises(UnknownRequest):
        eng.rank_of("nope")
    with pytest.raises(RuntimeError, match="step the MeshEngine"):
        eng.engines[0].store
    # a request added to a rank's engine directly is a placement of one's own: the mesh knows it
    eng.engines[0].add_request("z", [4, 5], SamplingParams(max_new_tokens=1))
    assert eng.rank_of("z") == 0 and set(eng.requests) == {"x", "z"}
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("z", [1, 2, 3])
    eng.run()
    assert eng.outputs()["x"] and eng.outputs()["z"] and eng.metrics().tokens == 3
    eng.close()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == eng.metrics().steps and all(len(x["ranks"]) == 1 for x in lines)
    assert sum(x["tokens"] for x in lines) == 3


def test_a_failed_mesh_call_commits_nothing_and_a_consumed_store_stops_the_mesh(small_model, monkeypatch):
    """As `Engine` (tests/e2e/test_bad_input.py), through the same `runner.call_on_store`: a sharded call that raises
    commits nothing and the mesh goes on to the uninterrupted run's tokens; one that consumed the donated stacked
    store stops every later step."""
    import jax

    from hisparse_jax import parallel
    from hisparse_jax.config import CacheConfig
    from hisparse_jax.engine import EngineConfig, MeshEngine, SamplingParams

    cc = CacheConfig(kv_dtype="float32", device_pages=16, host_pages=32, max_seq_len=256)
    reference = MeshEngine(small_model, cc, EngineConfig(max_running=2), mesh=parallel.data_mesh(1))
    want = reference.generate([[1, 2, 3], [7, 8]], SamplingParams(max_new_tokens=3))
    eng = MeshEngine(small_model, cc, EngineConfig(max_running=2), mesh=parallel.data_mesh(1))
    for i, p in enumerate([[1, 2, 3], [7, 8]]):
        eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=3))
    real = eng.runner.step
    for _ in range(2):  # both admitted
        eng.step()

    def fault(*a, **k):
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(eng.runner, "step", fault)
    def state():
        return eng.outputs(), dict(eng.managers[0].lengths), {k: r.computed for k, r in eng.requests.items()}

    before = state()
    with pytest.raises(RuntimeError, match="injected device fault"):
        eng.step()
    assert before == state() and not eng.store_lost and not eng.engines[0].store_lost
    monkeypatch.setattr(eng.runner, "step", real)
    eng.run()
    assert [eng.outputs()[f"r{i}"] for i in range(2)] == want

    def consume(spec, store, *a, **k):
        for x in jax.tree.leaves(store):
            x.delete()
        raise RuntimeError("injected failure after donation")

    eng.add_request("r2", [4, 5, 6], SamplingParams(max_new_tokens=2))
    monkeypatch.setattr(eng.runner, "step", consume)
    with pytest.raises(RuntimeError, match="after donation"):
        eng.step()
    assert eng.store_lost
    with pytest.raises(RuntimeError, match="consumed the stacked KV store"):
        eng.step()


if __name__ == "__main__":
    print(json.dumps(_checks()))
