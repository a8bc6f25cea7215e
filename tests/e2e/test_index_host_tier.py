"""Indexer keys in the host tier (`CacheConfig(index_tier="host")`): the keys in pinned-host pools, a min / max
summary per page on the device, and each step's key pages read best bound first (`scoring.index_scores_host`).

Exact mode must select what device keys select, bit for bit: driven with arbitrary prompt lengths, appends across
page boundaries, negative head weights and every key format against the device tier (the oracle), with every
unused page's keys and summaries NaN-poisoned; and through `generate` and the engine the tokens must be the device
tier's. Budgeted mode reads at most its pages, its recall grows with the budget, and a budget of every page is
exact mode. What cannot run is refused."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.index_codebooks import fit_index_codebooks
from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv.scoring import index_select_read
from hisparse_jax.kv.manager import PageManager
from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.kv.state import host_sharding, init_store
from hisparse_jax.kv.summary import IndexCodebooks, with_index_codebooks
from hisparse_jax.kv.tiered import check_backend
from pallas_kernels.indexer_topk.reference import rope_rotate
from tiny import BIG, model_cfg

CFG = model_cfg()
L, LI, C, R, DI, K = 4, 2, 32, 16, 32, 16
SMALL = CacheConfig(kv_dtype="float32", device_pages=24, host_pages=24, max_seqs=2, max_seq_len=512)
PROMPTS = [[(7 * j + i) % 97 for j in range(n)] for i, n in enumerate([300, 460, 190])]
NEW = 24


def host(cache: CacheConfig, **over) -> CacheConfig:
    """`cache` (and its capacity) with host-tier keys."""
    over = dict(index_tier="host", **over)
    cap = None if cache.capacity is None else cache.capacity.replace(**over)
    return cache.replace(**over, capacity=cap)


def test_layout_memory_kinds_and_bytes():
    for fmt, key_bytes in (("auto", 4 * DI), ("fp8", DI + 4), ("int4", DI // 2 + DI // 32)):
        dev = StoreSpec.create(CFG, SMALL.replace(index_dtype=fmt))
        spec = StoreSpec.create(CFG, host(SMALL, index_dtype=fmt))
        assert dev.index_row_bytes == key_bytes == spec.index_key_bytes == spec.index_host_row_bytes
        assert spec.index_row_bytes == 4 * DI / 64 and dev.index_host_row_bytes == 0  # the summary's share (bf16)
        store = jax.eval_shape(lambda s=spec: init_store(s))
        dstore = jax.eval_shape(lambda s=dev: init_store(s))
        for name in ("index_k", "index_scale"):
            a, d = getattr(store, name), getattr(dstore, name)
            if d is None:
                assert a is None
                continue
            assert a.shape == d.shape and a.dtype.itemsize == d.dtype.itemsize  # the same bits, as a host pool
        assert store.index_lo.shape == store.index_hi.shape == (LI, spec.index_pages, DI)
        assert dstore.index_lo is None
    real = init_store(StoreSpec.create(CFG, host(SMALL, index_dtype="fp8")))
    assert real.index_k.sharding.memory_kind == real.index_scale.sharding.memory_kind == "pinned_host"
    assert real.index_k.dtype == jnp.uint8 and real.index_lo.sharding.memory_kind == "device"
    assert np.isposinf(np.asarray(real.index_lo)).all() and np.isneginf(np.asarray(real.index_hi)).all()


# "rvq" codebooks for the tiny model (1 stage at dI 32; rope over the first 16 dimensions): any codebooks give true
# bounds. Their first 8 centroids are CENTRES, the keys `_keys(..., "rotated")` are drawn around.
_rng = np.random.default_rng(7)
CENTRES = (_rng.standard_normal((8, DI)) * 2).astype(np.float32)
FREQ = (1.0 / 10000.0 ** (np.arange(0, R, 2) / R)).astype(np.float32)
BOOKS = IndexCodebooks(books=np.concatenate([np.broadcast_to(CENTRES, (LI, 1, 8, DI)),
                                             _rng.standard_normal((LI, 1, 248, DI)).astype(np.float32)], axis=2
                                            ).astype(jnp.bfloat16).astype(np.float32),  # as the store holds them
                       rope_freq=FREQ)


def _poisoned(spec):
    """An empty store whose indexer pools (host keys, or device keys) and summaries are NaN everywhere: a page
    the tables do not name must never reach a score ("rvq": its radii NaN, which bound nothing, and its codes
    the last centroid's)."""
    store = init_store(spec)
    if spec.index_summary == "rvq":
        store = with_index_codebooks(store, BOOKS).replace(
            index_codes=jnp.full(store.index_codes.shape, 255, jnp.uint8),
            index_radius=jnp.full(store.index_radius.shape, jnp.nan, store.index_radius.dtype))
    kdt, sdt = spec.index_dtypes
    nan_bits = {jnp.dtype(jnp.float32): None, jnp.dtype(jnp.float8_e4m3fn): 0x7F}
    upd = {}
    for name, dt in (("index_k", kdt), ("index_scale", sdt)):
        a = getattr(store, name)
        if a is None or jnp.dtype(dt) not in nan_bits:
            continue
        fill = jnp.full(a.shape, jnp.nan, jnp.float32) if nan_bits[jnp.dtype(dt)] is None else \
            jnp.full(a.shape, nan_bits[jnp.dtype(dt)], jnp.uint8)
        upd[name] = jax.device_put(fill.astype(a.dtype) if fill.dtype != a.dtype else fill, a.sharding)
    if store.index_lo is not None:
        upd["index_lo"] = jnp.full(store.index_lo.shape, jnp.nan, store.index_lo.dtype)
        upd["index_hi"] = jnp.full(store.index_hi.shape, jnp.nan, store.index_hi.dtype)
    return dataclasses.replace(store, **upd)


def _fill(cache, prompt_lens, appends, keys, seed):
    """A store of `cache` holding two requests: prompts of `prompt_lens` rows, then `appends` tokens each. Each
    prompt's rows are padded to the store's max_seq_len, as the engine pads a prompt to its bucket (the keys with
    NaN: a padded row must never be written), so every prompt length writes through one compiled program."""
    tc = PageManager(CFG, cache)
    store = kv_device.apply_updates(_poisoned(tc.spec), tc)
    rng = np.random.default_rng(seed)
    slots, rows = [], cache.max_seq_len
    for n, k in zip(prompt_lens, keys):
        lat = np.zeros((L, rows, C), np.float32)
        rope = np.zeros((L, rows, R), np.float32)
        lat[:, :n], rope[:, :n] = rng.standard_normal((L, n, C)), rng.standard_normal((L, n, R))
        idx = np.full((LI, rows, DI), np.nan, np.float32)
        idx[:, :n] = k[:, :n]
        store, s = kv_device.admit_prefilled(store, tc, jnp.asarray(lat), jnp.asarray(rope), jnp.asarray(idx), n)
        slots.append(s)
    for t in range(appends):
        idx = jnp.asarray(np.stack([keys[b][:, prompt_lens[b] + t] for b in range(2)], axis=1))
        store = kv_device.append(store, tc, slots, jnp.zeros((L, 2, C)), jnp.zeros((L, 2, R)), idx)
    return tc, store, slots


@functools.partial(jax.jit, static_argnums=(1,))
def _select(store, index_layer, req, positions, q, w):
    return index_select_read(store, index_layer, req, positions, q, w)


def _keys(rng, n, kind):
    if kind == "rotated":  # pages of keys near one of CENTRES each, turned by RoPE: "rvq" codes them tightly
        u = CENTRES[(np.arange(n) // 64 + rng.integers(0, 8, (LI, 1))) % 8] + rng.standard_normal((LI, n, DI)) * 0.05
        cos, sin = np.cos(np.arange(n)[:, None] * FREQ), np.sin(np.arange(n)[:, None] * FREQ)
        return np.asarray(rope_rotate(jnp.asarray(u, jnp.float32), cos, sin), np.float32)
    if kind == "clustered":  # keys drifting with position: tight page bounds, pages pruned
        return np.cumsum(rng.standard_normal((LI, n, DI)) * 0.3, axis=1).astype(np.float32)
    if kind == "ties":
        return rng.integers(-2, 3, (LI, n, DI)).astype(np.float32)
    return (rng.standard_normal((LI, n, DI)) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), fmt=st.sampled_from(["auto", "fp8", "int4"]),
       kind=st.sampled_from(["normal", "clustered", "ties", "rotated"]),
       lens=st.tuples(st.integers(1, 300), st.integers(1, 300)), appends=st.integers(0, 70),
       budget=st.sampled_from([1, 3]), summary=st.sampled_from(["box", "rvq"]))  # static: each value compiles
def test_exact_mode_selects_the_device_keys_top_k(seed, fmt, kind, lens, appends, budget, summary):
    rng = np.random.default_rng(seed)
    keys = [_keys(rng, n + appends, kind) for n in lens]
    dev_tc, dev, slots = _fill(SMALL.replace(index_dtype=fmt), lens, appends, keys, seed)
    host_tc, hst, _ = _fill(host(SMALL, index_dtype=fmt, index_summary=summary), lens, appends, keys, seed)
    bud_tc, bud, _ = _fill(host(SMALL, index_dtype=fmt, index_budget_pages=budget, index_summary=summary), lens,
                           appends, keys, seed)
    full_tc, full, _ = _fill(host(SMALL, index_dtype=fmt, index_budget_pages=8, index_summary=summary), lens,
                             appends, keys, seed)
    req = jnp.asarray(slots, jnp.int32)
    pos = jnp.asarray([n + appends - 1 for n in lens], jnp.int32)
    live_pages = sum(-(-(n + appends) // 64) for n in lens)
    for li in range(LI):
        q = jnp.asarray(rng.standard_normal((2, CFG.index_n_heads, DI)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((2, CFG.index_n_heads)), jnp.float32)  # negative weights too
        want, none = _select(dev, li, req, pos, q, w)
        got, read = _select(hst, li, req, pos, q, w)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert int(none) == 0 and 1 <= int(read) <= live_pages
        part, n_part = _select(bud, li, req, pos, q, w)
        whole, n_whole = _select(full, li, req, pos, q, w)  # 8 pages: all of a 512-token request
        np.testing.assert_array_equal(np.asarray(whole), np.asarray(want))
        assert int(n_whole) == live_pages and int(n_part) == sum(min(budget, -(-(n + appends) // 64)) for n in lens)
        part = np.asarray(part)
        for b in range(2):
            sel = part[b][part[b] >= 0]
            assert len(set(sel.tolist())) == len(sel) and (sel <= int(pos[b])).all()
            assert len(set((sel // 64).tolist())) <= budget  # positions from the pages read only
            if -(-(lens[b] + appends) // 64) <= budget:  # every page read: exact
                np.testing.assert_array_equal(part[b], np.asarray(want)[b])


def test_budgeted_recall_grows_with_the_budget():
    rng = np.random.default_rng(3)
    lens, appends = (400, 333), 5
    keys = [_keys(rng, n + appends, "normal") for n in lens]
    _, dev, slots = _fill(SMALL, lens, appends, keys, 0)
    req = jnp.asarray(slots, jnp.int32)
    pos = jnp.asarray([n + appends - 1 for n in lens], jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, CFG.index_n_heads, DI)), jnp.float32)
    w = jnp.asarray(np.abs(rng.standard_normal((2, CFG.index_n_heads))), jnp.float32)
    want = np.asarray(_select(dev, 0, req, pos, q, w)[0])
    prev = -1.0
    for budget in (1, 2, 3, 5, 7):
        tc, st_, _ = _fill(host(SMALL, index_budget_pages=budget), lens, appends, keys, 0)
        got = np.asarray(_select(st_, 0, req, pos, q, w)[0])
        recall = np.mean([len(set(got[b]) & set(want[b])) / K for b in range(2)])
        assert recall >= prev
        prev = recall
    assert prev == 1.0


@pytest.mark.parametrize("rank", ["bound", "centre"])
def test_budgeted_mode_reads_the_pages_the_reference_ranks_first(rank):
    """Budgeted mode's top-k is `host_index_select_reference`'s over the keys written (the oracle summarizes each
    page's valid keys itself), for either page order: by the min / max box's bound, or by its midpoint's score."""
    from pallas_kernels.indexer_topk.reference import host_index_select_reference

    rng = np.random.default_rng(11)
    lens, appends, budget = (400, 233), 30, 3
    keys = [_keys(rng, n + appends, "normal") for n in lens]
    _, st_, slots = _fill(host(SMALL, index_budget_pages=budget, index_rank=rank), lens, appends, keys, 0)
    req = jnp.asarray(slots, jnp.int32)
    pos = jnp.asarray([n + appends - 1 for n in lens], jnp.int32)
    S = SMALL.max_seq_len
    valid = jnp.arange(S)[None] <= pos[:, None]
    for li in range(LI):
        q = jnp.asarray(rng.standard_normal((2, CFG.index_n_heads, DI)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((2, CFG.index_n_heads)), jnp.float32)
        k = jnp.asarray(np.stack([np.pad(kk[li], ((0, S - kk.shape[1]), (0, 0))) for kk in keys]))
        want, read, _ = host_index_select_reference(q, w, k, valid, K, 64, budget=budget, rank=rank)
        got, n = _select(st_, li, req, pos, q, w)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert int(n) == int(read.sum()) == 2 * budget


def test_generate_exact_mode_gives_the_device_tier_tokens():
    """Through evictions, hot-buffer hits and misses; the keys read are counted apart from the KV's bytes."""
    model = hj.SparseMLAModel(CFG, rngs=nnx.Rngs(0))
    cc = BIG.replace(device_pages=14)
    want, dev = hj.generate(model, PROMPTS, NEW, cache=cc, return_stats=True)
    got, hst = hj.generate(model, PROMPTS, NEW, cache=host(cc), return_stats=True)
    assert got == want and dev.misses > 0 and dev.evicted_pages > 0
    assert (hst.hits, hst.misses, hst.h2d_bytes) == (dev.hits, dev.misses, dev.h2d_bytes)
    assert dev.index_h2d_bytes == 0
    # at most every live key page of every index layer and step (this random model's scores leave few unread)
    spec = StoreSpec.create(CFG, host(cc))
    most = sum(-(-(len(p) + t + 1) // 64) for p in PROMPTS for t in range(NEW - 1)) * LI * 64 * spec.index_key_bytes
    assert 0 < hst.index_h2d_bytes <= most


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_generate_exact_mode_per_key_format(fmt):
    model = hj.SparseMLAModel(CFG, rngs=nnx.Rngs(0), index_dtype=fmt)
    cc = BIG.replace(index_dtype=fmt, device_pages=14, capacity=BIG.replace(index_dtype=fmt))
    assert hj.generate(model, PROMPTS, NEW, cache=host(cc)) == hj.generate(model, PROMPTS, NEW, cache=cc)


@pytest.mark.slow
def test_engine_exact_mode_gives_the_device_tier_tokens_without_recompiling():
    """HiSparse with a shared prompt prefix (its pages written once, the second prompt's tail page merged into the
    summaries) under a tight device pool: the host tier's tokens (the box's and "rvq"'s) are the device tier's, the
    step compiles as often as with device keys (the reads are a loop inside the step, whatever their number), and
    its key reads are in the metrics."""
    from hisparse_jax.engine import Engine, EngineConfig, SamplingParams
    from hisparse_jax.engine import runner

    model = hj.SparseMLAModel(CFG, rngs=nnx.Rngs(0))
    shared = PROMPTS[1][:200]
    prompts = [PROMPTS[1], shared + PROMPTS[0][:90], PROMPTS[2]]
    params = SamplingParams(max_new_tokens=NEW)
    out, metrics, traces = {}, {}, {}
    books = fit_index_codebooks(model, np.asarray([PROMPTS[0][:256], PROMPTS[1][:256]]))
    for tier in ("device", "host", "rvq"):
        cc = BIG.replace(device_pages=11)
        cc = cc if tier == "device" else host(cc, index_summary="rvq" if tier == "rvq" else "box")
        eng = Engine(model, cc, EngineConfig(policy="hisparse", max_running=3, check_invariants=True),
                     index_codebooks=books if tier == "rvq" else None)
        before = runner.TRACE_COUNTS["store_decode_step"]
        eng.add_request("r0", prompts[0], params)
        while not eng.requests["r0"].output:  # the others arrive once it decodes (its prefix pages are cached)
            eng.step()
        for i, p in enumerate(prompts[1:], 1):
            eng.add_request(f"r{i}", p, params)
        eng.run()
        traces[tier] = runner.TRACE_COUNTS["store_decode_step"] - before
        out[tier], metrics[tier] = eng.outputs(), eng.metrics()
        eng.close()
    assert out["host"] == out["device"] == out["rvq"]
    # the same compiles as device keys: one per batch bucket and index span the schedule meets, none per step
    assert traces["host"] == traces["device"] == traces["rvq"] <= 1 + len(
        {(h.bucket, h.scored_pages) for h in metrics["host"].history if h.running})
    assert metrics["rvq"].index_h2d_bytes > 0
    assert len(metrics["host"].history) > 2 * traces["host"]
    assert metrics["device"].cached_tokens > 0
    assert metrics["host"].index_h2d_bytes > 0 == metrics["device"].index_h2d_bytes
    assert metrics["host"].hits == metrics["device"].hits and metrics["host"].misses == metrics["device"].misses


def test_what_cannot_run_is_refused():
    with pytest.raises(ValueError, match="index_tier must be one of"):
        CacheConfig(index_tier="disk")
    with pytest.raises(ValueError, match="needs hot_policy='lru'"):
        CacheConfig(index_tier="host", hot_policy="score_ema")
    with pytest.raises(ValueError, match="read budget of index_tier='host'"):
        CacheConfig(index_budget_pages=4)
    with pytest.raises(ValueError, match="index_budget_pages"):
        CacheConfig(index_tier="host", index_budget_pages=0)
    with pytest.raises(ValueError, match="index_rank ranks the pages budgeted mode reads"):
        CacheConfig(index_tier="host", index_rank="centre")
    with pytest.raises(ValueError, match="index_rank must be one of"):
        CacheConfig(index_tier="host", index_budget_pages=2, index_rank="mean")
    with pytest.raises(ValueError, match="index_tier must be the capacity's"):
        CacheConfig(index_tier="host", capacity=CacheConfig())
    with pytest.raises(ValueError, match="index_summary must be one of"):
        CacheConfig(index_tier="host", index_summary="ball")
    with pytest.raises(ValueError, match="with index_tier='device' leave it 'box'"):
        CacheConfig(index_summary="rvq")
    with pytest.raises(ValueError, match="index_summary='rvq' does not run with speculative_tokens"):
        CacheConfig(index_tier="host", index_summary="rvq", speculative_tokens=1)
    with pytest.raises(ValueError, match="index_summary='rvq' needs index_head_dim >= 32"):
        StoreSpec.create(model_cfg(index_head_dim=16), host(SMALL, index_summary="rvq"))
    rvq = PageManager(CFG, host(SMALL, index_summary="rvq"))
    with pytest.raises(ValueError, match="index_summary='rvq' needs the store's codebooks"):
        kv_device.new_store(rvq)
    with pytest.raises(ValueError, match=r"index_codebooks.books has shape \(2, 1, 256, 16\); this store's is"):
        kv_device.new_store(rvq, index_codebooks=BOOKS._replace(books=BOOKS.books[..., :16]))
    with pytest.raises(ValueError, match="not finite"):
        kv_device.new_store(rvq, index_codebooks=BOOKS._replace(rope_freq=FREQ * np.nan))
    with pytest.raises(TypeError, match="index_codebooks must be an IndexCodebooks"):
        kv_device.new_store(rvq, index_codebooks=(BOOKS.books, FREQ))
    with pytest.raises(ValueError, match="given to an empty store"):
        with_index_codebooks(_fill(host(SMALL, index_summary="rvq"), (70, 5), 0, [np.ones((LI, 80, DI))] * 2, 0)[1],
                             BOOKS)
    with pytest.raises(ValueError, match="index_codebooks are index_summary='rvq''s"):
        kv_device.new_store(PageManager(CFG, host(SMALL)), index_codebooks=BOOKS)
    model = hj.SparseMLAModel(CFG, rngs=nnx.Rngs(0))
    for ids, msg in (([[1, 2], [3]], "must be a non-empty int array"), (np.ones((2, 4)), "must be a non-empty int"),
                     (np.zeros((0, 4), int), "non-empty"), ([[1, 97]], r"token ids in \[0, 97\)")):
        with pytest.raises(ValueError, match=msg):
            fit_index_codebooks(model, ids)
    with pytest.raises(ValueError, match="rvq codebooks need index_head_dim >= 32"):
        fit_index_codebooks(hj.SparseMLAModel(model_cfg(index_head_dim=16), rngs=nnx.Rngs(0)), [[1, 2]])
    with pytest.raises(ValueError, match="runs on one device"):
        hj.generate(hj.SparseMLAModel(CFG, rngs=nnx.Rngs(0)), PROMPTS[:1], 2, mesh=object(),
                    cache=host(SMALL, index_summary="rvq"))
    spec = StoreSpec.create(CFG, host(SMALL))
    with pytest.raises(ValueError, match="index_tier='host' needs kernels='reference'"):
        check_backend(spec, "pallas_interpret")
    check_backend(spec, "reference")
    assert host_sharding().memory_kind == "pinned_host"


@pytest.mark.slow
def test_import_saved_store_and_mesh_carry_host_keys(tmp_path):
    """A P/D import decodes the tokens of the same prompt prefilled locally; a store saved mid-run restores its
    host keys (in pinned host memory) and summaries bit for bit; two data-parallel devices give one device's
    tokens (in a subprocess: jax must start with two CPU devices)."""
    import os
    import subprocess
    import sys

    from hisparse_jax.engine import Engine, EngineConfig, SamplingParams
    from hisparse_jax.engine.pd import export_prefill
    from hisparse_jax.kv.device import apply_updates
    from hisparse_jax.kv.persist import load_tiered, save_tiered

    model = hj.SparseMLAModel(CFG, rngs=nnx.Rngs(0))
    params = SamplingParams(max_new_tokens=NEW)
    eng = Engine(model, host(BIG.replace(device_pages=20)), EngineConfig(policy="hisparse", max_running=3,
                                                                        check_invariants=True))
    eng.add_request("local", PROMPTS[1], params)
    eng.import_request("imported", export_prefill(model, PROMPTS[1], tmp_path / "p.safetensors"), params)
    eng.step()
    store = apply_updates(eng.store, eng.manager)
    save_tiered(eng.manager, store, tmp_path / "saved")
    _, restored = load_tiered(tmp_path / "saved")
    for name in ("index_k", "index_lo", "index_hi"):
        a, b = getattr(store, name), getattr(restored, name)
        assert b.sharding.memory_kind == a.sharding.memory_kind
        np.testing.assert_array_equal(np.asarray(b).view(np.uint8), np.asarray(a).view(np.uint8))
    eng.run()
    out = eng.outputs()
    assert out["local"] == out["imported"] == hj.generate(model, [PROMPTS[1]], NEW)[0]
    eng.close()
    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "import hisparse_jax as hj\nfrom flax import nnx\nfrom hisparse_jax import parallel\n"
        "from tiny import BIG, model_cfg\n"
        f"P = {PROMPTS!r}\n"
        "m = hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(0))\n"
        "cc = BIG.replace(device_pages=14)\n"
        "hc = cc.replace(index_tier='host', capacity=BIG.replace(index_tier='host'))\n"
        f"print(hj.generate(m, P + P[:1], {NEW}, cache=hc, mesh=parallel.data_mesh(2)) == "
        f"hj.generate(m, P + P[:1], {NEW}, cache=cc))\n")
    # added to the suite's XLA_FLAGS (its fast-compile flags), not replacing them: XLA's defaults compile slowly
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env = dict(os.environ, XLA_FLAGS=flags)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == "True", res.stderr[-3000:]


# ----- hisparse demo --index-tier / --index-budget-pages ---------------------------------------------------------
def test_demo_options_are_checked_before_any_work(monkeypatch, capsys):
    from hisparse_jax import checkpoints, cli, demo, demo_run, demo_workload

    def refuse(*a, **k):
        raise AssertionError("a model was built")

    monkeypatch.setattr(demo_run, "SparseMLAModel", refuse)
    monkeypatch.setattr(checkpoints, "load", refuse)
    assert cli.main(["demo", "--index-tier", "disk"]) == 2
    err = capsys.readouterr().err
    assert "argument --index-tier: invalid choice: 'disk'" in err and "Traceback" not in err
    assert cli.main(["demo", "--index-budget-pages", "-1"]) == 2
    assert "argument --index-budget-pages" in capsys.readouterr().err
    for argv, msg in ((["--index-budget-pages", "3"], "index_budget_pages is the read budget of index_tier='host'"),
                      (["--index-tier", "host", "--kernels", "pallas_interpret"], "index_tier='host' needs "
                                                                                   "kernels='reference'"),
                      (["--index-tier", "host", "--hot-policy", "score_ema"], "index_tier='host' needs hot_policy"),
                      (["--index-tier", "host", "--index-rank", "centre"], "index_rank ranks the pages budgeted"),
                      (["--index-summary", "rvq"], "with index_tier='device' leave it 'box'"),
                      (["--index-tier", "host", "--index-summary", "rvq", "--devices", "2"],
                       "--index-summary rvq runs on one device")):
        assert cli.main(["demo", *argv, "--plot", ""]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hisparse demo: error: ") and msg in err and "Traceback" not in err, err
    assert demo.parse_args([]).index_tier == "device" and demo.parse_args([]).index_budget_pages == 0
    base, dev_bytes = demo_workload.budgets(CFG, 2, 500, 2.0, index_tier="host", index_budget_pages=3,
                                            index_rank="centre")
    assert (base.index_tier, base.index_budget_pages, base.index_rank) == ("host", 3, "centre")
    assert demo_workload.budgets(CFG, 2, 500, 2.0)[1] == dev_bytes  # the device budget counts device keys whatever the tier


@pytest.mark.slow
def test_demo_host_keys_give_the_same_outputs_and_count_their_reads():
    from hisparse_jax import demo

    kw = dict(requests=4, prompt_len=384, new_tokens=4, policies=("hisparse",), plot="", device_requests=2.5,
              preset="demo-glm")
    dev, hst = demo.run(**kw), demo.run(index_tier="host", **kw)
    rvq = demo.run(index_tier="host", index_summary="rvq", **kw)
    a, b, c = dev["policies"]["hisparse"], hst["policies"]["hisparse"], rvq["policies"]["hisparse"]
    assert hst["index_tier"] == "host" and a["outputs_sha256"] == b["outputs_sha256"] == c["outputs_sha256"]
    assert rvq["index_summary"] == "rvq" and rvq["index_codebooks_fit_s"] > 0 and c["index_h2d_bytes"] > 0
    assert a["index_h2d_bytes"] == 0 < b["index_h2d_bytes"] and b["index_host_bytes"] > 0 == a["index_host_bytes"]
    assert b["index_pool_bytes"] < a["index_pool_bytes"]  # summaries on the device instead of keys
    assert b["index_h2d_bytes_per_step"] == b["index_h2d_bytes"] / b["steps"]
    assert "key KiB / step" in demo.table(hst) and "key KiB / step" not in demo.table(dev)


# ----- index_summary="rvq": each key's codes and radius bound its page ------------------------------------------
def test_rvq_layout_costs_the_box_bytes_per_token():
    spec = StoreSpec.create(CFG, host(SMALL, index_summary="rvq"))
    box = StoreSpec.create(CFG, host(SMALL))
    assert spec.index_stages == 1 and spec.index_row_bytes == box.index_row_bytes == DI / 16
    store = jax.eval_shape(lambda: init_store(spec))
    assert store.index_lo is None and store.index_codes.shape == (LI, spec.index_pages, 64, 1)
    assert store.index_radius.shape == (LI, spec.index_pages, 64) and store.index_radius.dtype == jnp.float8_e4m3fn
    assert store.index_codebooks.shape == (LI, 1, 256, DI) and store.index_rope_freq.shape == (R // 2,)


@pytest.mark.parametrize("kind", ["normal", "clustered", "ties"])
def test_rvq_is_exact_with_codebooks_that_do_not_fit_the_keys(kind):
    """Keys far from every centroid (BOOKS is random where the keys are not near CENTRES): each key's radius is
    most of its norm, and the bound must still hold, key by key, on every index layer and row (negative head
    weights too)."""
    rng = np.random.default_rng({"normal": 1, "clustered": 2, "ties": 3}[kind])
    lens, appends = (400, 270), 41
    keys = [_keys(rng, n + appends, kind) for n in lens]
    _, dev, slots = _fill(SMALL, lens, appends, keys, 0)
    _, rvq, _ = _fill(host(SMALL, index_summary="rvq"), lens, appends, keys, 0)
    req = jnp.asarray(slots, jnp.int32)
    for pos in ([n + appends - 1 for n in lens], [n - 1 for n in lens], [130, 64]):
        pos = jnp.asarray(pos, jnp.int32)
        for li in range(LI):
            for _ in range(4):
                q = jnp.asarray(rng.standard_normal((2, CFG.index_n_heads, DI)), jnp.float32)
                w = jnp.asarray(rng.standard_normal((2, CFG.index_n_heads)), jnp.float32)
                np.testing.assert_array_equal(np.asarray(_select(rvq, li, req, pos, q, w)[0]),
                                              np.asarray(_select(dev, li, req, pos, q, w)[0]))


@pytest.mark.parametrize("fmt", ["auto", "fp8"])
def test_rvq_reads_fewer_pages_than_the_box_on_keys_it_codes(fmt):
    """Keys near the codebooks' centroids before their RoPE: each key's bound sits within its small radius of its
    score, so exact mode reads fewer pages than the min / max box (whose every page is widened by the rotation)
    and still selects the device keys' top-k."""
    rng = np.random.default_rng(5)
    lens, appends = (400, 333), 10
    keys = [_keys(rng, n + appends, "rotated") for n in lens]
    _, dev, slots = _fill(SMALL.replace(index_dtype=fmt), lens, appends, keys, 0)
    _, box, _ = _fill(host(SMALL, index_dtype=fmt), lens, appends, keys, 0)
    _, rvq, _ = _fill(host(SMALL, index_dtype=fmt, index_summary="rvq"), lens, appends, keys, 0)
    req = jnp.asarray(slots, jnp.int32)
    pos = jnp.asarray([n + appends - 1 for n in lens], jnp.int32)
    reads = {"box": 0, "rvq": 0}
    for li in range(LI):
        q = jnp.asarray(rng.standard_normal((2, CFG.index_n_heads, DI)), jnp.float32)
        w = jnp.asarray(np.abs(rng.standard_normal((2, CFG.index_n_heads))), jnp.float32)
        want = np.asarray(_select(dev, li, req, pos, q, w)[0])
        for name, st_ in (("box", box), ("rvq", rvq)):
            got, n = _select(st_, li, req, pos, q, w)
            np.testing.assert_array_equal(np.asarray(got), want)
            reads[name] += int(n)
    live = LI * sum(-(-(n + appends) // 64) for n in lens)
    assert reads["rvq"] < reads["box"] and reads["rvq"] <= 0.6 * live, (reads, live)  # 14 of 26 (the box: 26)


def test_rvq_exact_mode_reads_the_reference_pages_in_whole_rounds():
    """The store reads what `host_index_select_reference(summary="rvq")` (the selection experiments/index_tier.py
    measures) reads, rounded up to its rounds of `index_read_chunk` pages: every page whose bound reaches the k-th
    best score and no round past them (the same codes, radii and bounds, computed in the store)."""
    from hisparse_jax.kv.summary import rope_tables
    from pallas_kernels.indexer_topk.reference import host_index_select_reference

    rng = np.random.default_rng(9)
    lens, appends = (450, 381), 7
    keys = [_keys(rng, n + appends, "rotated") for n in lens]
    _, rvq, slots = _fill(host(SMALL, index_summary="rvq"), lens, appends, keys, 0)
    C = StoreSpec.create(CFG, host(SMALL, index_summary="rvq")).index_read_chunk
    req = jnp.asarray(slots, jnp.int32)
    pos = jnp.asarray([n + appends - 1 for n in lens], jnp.int32)
    S = SMALL.max_seq_len
    valid = jnp.arange(S)[None] <= pos[:, None]
    cos, sin = rope_tables(jnp.asarray(FREQ), jnp.arange(S))
    for li in range(LI):
        k = jnp.asarray(np.stack([np.pad(kk[li], ((0, S - kk.shape[1]), (0, 0))) for kk in keys]))
        for _ in range(3):
            q = jnp.asarray(rng.standard_normal((2, CFG.index_n_heads, DI)), jnp.float32)
            w = jnp.asarray(rng.standard_normal((2, CFG.index_n_heads)), jnp.float32)
            want, read, live = host_index_select_reference(q, w, k, valid, K, 64, summary="rvq",
                                                            basis=(BOOKS.books[li], cos, sin))
            got, n = _select(rvq, li, req, pos, q, w)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            rounds = [min(int(lv), -(-int(r) // C) * C) for r, lv in zip(read, live)]
            assert int(n) == sum(rounds) and sum(rounds) < int(live.sum()), (int(n), read, live)


def test_rvq_codebooks_come_off_the_device_budget():
    """The codebooks are a fixed device cost (`kv.account.index_codebook_bytes`, the store's own arrays' bytes):
    `engine.device_budget` takes them off before it splits the budget into pages."""
    from hisparse_jax.engine import device_budget
    from hisparse_jax.kv.account import index_codebook_bytes, store_layout

    cc = host(SMALL, index_summary="rvq")
    spec = StoreSpec.create(CFG, cc)
    layout = store_layout(spec)
    fixed = sum(int(np.prod(layout[n][0])) * layout[n][1].itemsize for n in ("index_codebooks", "index_rope_freq"))
    assert index_codebook_bytes(spec) == fixed == LI * 1 * 256 * DI * 2 + R // 2 * 4
    assert index_codebook_bytes(StoreSpec.create(CFG, host(SMALL))) == 0
    for pol in ("hisparse", "offload"):
        got = device_budget(CFG, cc, 10 ** 7 + fixed, pol, max_running=2, max_len=400)
        want = device_budget(CFG, host(SMALL), 10 ** 7, pol, max_running=2, max_len=400)
        assert (got.device_pages, got.index_pages) == (want.device_pages, want.index_pages)
