"""Fast checks of experiments/reproduce_blog.py, experiments/hot_buffer_policies.py and the calculator side of
experiments/engine_vs_calc.py."""
import importlib.util
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import hot_buffer_sim as sim
from experiments.hot_buffer_traces import SYNTH_DEFAULTS, synthetic_trace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "experiments", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


blog = _load("reproduce_blog")
hb = _load("hot_buffer_policies")
evc = _load("engine_vs_calc")


def test_calculator_table_json(tmp_path):
    assert blog.main(["--no-engine", "--out", str(tmp_path)]) == 0
    rows = json.load(open(tmp_path / "blog_calculator.json"))["rows"]
    got = {(r["seq"], r["hot_rows"]): (r["baseline_running"], r["hisparse_running"]) for r in rows}
    assert set(got) == {(s, h) for s in blog.SEQS for h in blog.HOT_ROWS}
    assert got[(142_000, 4096)] == (2, 29) and got[(1_048_576, 4096)] == (0, 5)
    assert got[(85_836, 4096)][0] == 4 and got[(85_836, 10_240)][1] == 22
    assert all(r["limiting"] and r["min_host_gib"] > 0 for r in rows)


def test_blog_device_requests():
    assert blog.blog_device_requests() == pytest.approx(6260 / 1280)


def test_engine_vs_calc_scaled_case():
    """The published 80K case's ratios, and the calculator at the scaled default (64 pages, 64 requests, this
    model's 656-B FP8 rows): >= 8x over the baseline with FP8 keys, more with int4, limited by the device."""
    g = evc.glm_ratios()
    assert g["device_requests"] == pytest.approx(6260 / 1280) and (g["baseline"], g["hisparse_unified"]) == (4, 39)
    assert g["hot_fraction"] == 0.05 and g["indexer_over_kv"]["fp8"] == pytest.approx(21 * 132 / (78 * 576))
    cfg = evc.model_config(4, 4, 64, g)
    assert (cfg.index_topk, cfg.indexer_types) == (96, ("full", "shared", "shared", "shared"))
    kv, idx = 64 * 4 * 656, 64 * 132
    device = int(g["device_requests"] * 64 * (kv + idx))
    got = {d: evc.predict(cfg, pages=64, requests=64, device_bytes=device, hot_rows=192, host_pages=10 ** 6,
                          index_dtype=d) for d in ("fp8", "int4")}
    assert got["fp8"].baseline_running == 4 and got["fp8"].hisparse_running >= 8 * 4
    assert got["int4"].hisparse_running > got["fp8"].hisparse_running
    assert all(r.limiting == "gpu" and r.block_bytes.host == kv for r in got.values())
    # the calculator's split layout is the engine's own split of the device bytes (engine.device_budget)
    assert got["fp8"].hisparse_running == device // (64 * idx + (3 + 2) * kv)
    # host-tier keys: a page's bf16 min / max summary (4 x 128 B) on the device instead of its 132-B keys
    host = evc.predict(cfg, pages=64, requests=64, device_bytes=device, hot_rows=192, host_pages=10 ** 6,
                       index_dtype="fp8", index_tier="host")
    assert host.hisparse_running == min(64, device // (64 * 4 * 128 + (3 + 2) * kv)) > got["int4"].hisparse_running


def test_sustained_running_counts_steps_with_a_queue():
    from types import SimpleNamespace as H

    hist = [H(running=0, waiting=5, wait_reasons={"device_budget": 1, "queued": 4}),
            H(running=4, waiting=4, wait_reasons={"device_budget": 1, "queued": 3}),
            H(running=3, waiting=1, wait_reasons={"index_budget": 1}), H(running=2, waiting=0, wait_reasons={})]
    s = evc.sustained(hist)
    assert (s["sustained_running"], s["sustained_steps"], s["max_running"]) == (3.5, 2, 4)
    assert s["mean_running"] == 3.0
    assert evc.first_wait(hist) == {"device_budget": 2, "index_budget": 1}


def _resolve_reference(trace, HR, K):
    """Run hisparse_jax.kv.resolve.resolve on a one-request, all-offloaded store over `trace` (a `KVStore` holding
    only the tables the resolver reads: no pools)."""
    from types import SimpleNamespace

    from hisparse_jax.kv.resolve import resolve
    from hisparse_jax.kv.state import KVStore

    spec = SimpleNamespace(hot_rows=HR, max_seqs=1, max_pages=64, hot_policy="lru")
    tables = dict(block_table=-jnp.ones((1, 64), jnp.int32), host_table=jnp.arange(64, dtype=jnp.int32)[None],
                  hot_pages=jnp.arange(-(-HR // 64), dtype=jnp.int32)[None],
                  hot_token=-jnp.ones((1, 1, HR), jnp.int32), hot_stamp=-jnp.ones((1, 1, HR), jnp.int32),
                  page_stamp=-jnp.ones((1, 64), jnp.int32))
    pools = dict.fromkeys(("latent", "rope", "index_k", "h_latent", "h_rope", "index_table", "seq_lens"))
    store = KVStore(**tables, **pools, clock=jnp.int32(0), spec=spec)
    hits, misses = [], []
    for t, q in enumerate(trace):
        store.clock = jnp.int32(t)
        topk = jnp.asarray(np.asarray(q, np.int32)[None])
        plan, store = resolve(store, 0, jnp.asarray([0], jnp.int32), topk)
        m = int(np.asarray(plan.miss).sum())
        misses.append(m)
        hits.append(len(q) - m)
    return np.array(hits), np.array(misses), np.asarray(store.hot_token)[0, 0], np.asarray(store.hot_stamp)[0, 0]


def test_lru_matches_ops_resolve():
    rng = np.random.default_rng(0)
    K, HR, steps, ctx = 16, 24, 40, 256
    hot = rng.choice(ctx, 40, replace=False)
    trace = []
    for _ in range(steps):
        a = rng.choice(hot, 10, replace=False)
        b = rng.choice(ctx, 12, replace=False)
        q = np.unique(np.concatenate([a, b]))[:K]
        rng.shuffle(q)  # resolve takes misses in top-k order
        trace.append(q)
    h_ref, m_ref, tok_ref, stamp_ref = _resolve_reference(trace, HR, K)
    h, m, tok, stamp = sim.simulate(trace, HR, "lru", return_state=True)
    np.testing.assert_array_equal(h, h_ref)
    np.testing.assert_array_equal(m, m_ref)
    np.testing.assert_array_equal(tok, tok_ref)
    np.testing.assert_array_equal(stamp, stamp_ref)


@pytest.mark.parametrize("policy", sim.POLICIES)
def test_policies_sane(policy):
    rng = np.random.default_rng(1)
    trace = [rng.choice(200, 32, replace=False) for _ in range(30)]
    h, m = sim.simulate(trace, 64, policy)
    assert (h + m == 32).all() and m[0] == 32
    big_h, big_m = sim.simulate(trace, 256, policy)  # everything fits: only compulsory misses
    assert big_m.sum() == len(np.unique(np.concatenate(trace)))
    opt_m = sim.simulate(trace, 64, "opt")[1].sum()
    assert opt_m <= m.sum()


def test_synthetic_calibration():
    tr = synthetic_trace(128, seed=0, **SYNTH_DEFAULTS)
    assert all(len(np.unique(t)) == SYNTH_DEFAULTS["k"] for t in tr)
    c = hb.calibration(tr, SYNTH_DEFAULTS["k"])
    assert c["adjacent_overlap"] == pytest.approx(0.44, abs=0.05)
    assert c["lru_hit_rate_2x"] == pytest.approx(0.94, abs=0.02)


@pytest.mark.slow
def test_prefix_sharing_experiment_quick(tmp_path):
    """experiments/prefix_sharing.py runs end to end (HiSparse only, tiny): the cache serves the shared prefix,
    the computed prompt tokens drop accordingly, and the outputs are the same with the cache on and off."""
    ps = _load("prefix_sharing")
    out = tmp_path / "ps.json"
    assert ps.main(["--quick", "--policies", "hisparse", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    on, off = res["policies"]["hisparse"]["on"], res["policies"]["hisparse"]["off"]
    assert res["outputs_identical"] and off["cached_tokens"] == 0 and on["cached_tokens"] > 0
    assert on["prefill_tokens"] + on["cached_tokens"] == off["prefill_tokens"]
