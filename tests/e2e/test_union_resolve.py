"""Several query rows per request in one step (speculative verification): each request's rows are resolved once,
over the union of their top-k (`TieredKV(rows_per_request=S)`, `resolve.union_topk` / `resolve.row_plan`). Each distinct
missing row is fetched once, and every row attends over exactly its own top-k: the logits are bit-identical to
the same batch through an all-resident store."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.engine import runner
from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv.resolve import Plan, check_groups, group_req, row_plan, union_topk
from hisparse_jax.kv.manager import PageManager
from hisparse_jax.kv.state import StoreSpec
from hisparse_jax.kv.tiered import TieredKV, empty_stats, stats_bytes
from tiny import model_cfg

PAGE = 64


# ----- unit: union and row plans on hand-made arrays ------------------------------------------------
def test_union_topk_sorts_dedupes_and_pads():
    topk = jnp.asarray([[5, 3, -1, 9],     # group 0: rows 0, 1 share 3 and 5
                        [3, 7, 5, -1],
                        [-1, -1, -1, -1],  # group 1: an idle row and a row with one position
                        [2, -1, -1, -1],
                        [-1, -1, -1, -1],  # group 2: idle
                        [-1, -1, -1, -1]], jnp.int32)
    u = np.asarray(union_topk(topk, 2))
    np.testing.assert_array_equal(u, [[3, 5, 7, 9, -1, -1, -1, -1],
                                      [2, -1, -1, -1, -1, -1, -1, -1],
                                      [-1] * 8])
    assert u.dtype == np.int32
    # S = 1: each row's positions, sorted
    np.testing.assert_array_equal(np.asarray(union_topk(topk[:2], 1)), [[3, 5, 9, -1], [3, 5, 7, -1]])
    # S = 3 over the same positions repeated in every row: one copy
    same = jnp.asarray([[4, 8, 1]] * 3, jnp.int32)
    np.testing.assert_array_equal(np.asarray(union_topk(same, 3)), [[1, 4, 8] + [-1] * 6])
    with pytest.raises(ValueError, match="rows_per_request=4"):
        union_topk(topk, 4)


def test_group_req_and_host_check():
    np.testing.assert_array_equal(np.asarray(group_req(jnp.asarray([1, 1, -1, 0, -1, -1]), 2)), [1, 0, -1])
    check_groups(np.asarray([1, 1, -1, 0, -1, -1]), 2)
    with pytest.raises(ValueError, match="different requests"):
        check_groups(np.asarray([1, 0, 2, 2]), 2)
    with pytest.raises(ValueError, match="request 1 is in row groups 0 and 1"):
        check_groups(np.asarray([1, 1, 1, -1]), 2)
    with pytest.raises(ValueError, match="not groups"):
        check_groups(np.asarray([1, 1, 1]), 2)


def test_row_plan_reads_each_rows_topk_from_the_union():
    topk = jnp.asarray([[5, 3, -1, 9], [3, 7, 5, -1], [-1, -1, -1, -1], [2, -1, -1, -1]], jnp.int32)
    union = union_topk(topk, 2)  # [[3, 5, 7, 9, -1...], [2, -1, ...]]
    G, U = union.shape
    # a made-up union plan: 3 resident (page 10), 5 a hit (page 20 row 1), 7 a miss (page 20 row 2, host 4/7),
    # 9 invalid (no copy), 2 a miss (page 21 row 0, host 0/2)
    z = np.zeros((G, U), np.int32)
    page, row, src_page, src_row = z.copy(), z.copy(), z - 1, z.copy()
    valid, resident, miss = z.astype(bool), z.astype(bool), z.astype(bool)
    page[0, :3], row[0, :3] = [10, 20, 20], [3, 1, 2]
    valid[0, :3], resident[0, 0], miss[0, 2] = True, True, True
    src_page[0, 2], src_row[0, :4] = 4, [3, 5, 7, 9]
    page[1, 0], row[1, 0], valid[1, 0], miss[1, 0], src_page[1, 0], src_row[1, 0] = 21, 0, True, True, 0, 2
    up = Plan(*(jnp.asarray(a) for a in (page, row, valid, resident, miss, src_page, src_row)))
    p = row_plan(up, union, topk, 2)
    np.testing.assert_array_equal(np.asarray(p.valid), [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(p.page), [[20, 10, 0, 0], [10, 20, 20, 0], [0] * 4, [21, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(p.row), [[1, 3, 0, 0], [3, 2, 1, 0], [0] * 4, [0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(p.resident), [[0, 1, 0, 0], [1, 0, 0, 0], [0] * 4, [0] * 4])
    np.testing.assert_array_equal(np.asarray(p.miss), [[0, 0, 0, 0], [0, 1, 0, 0], [0] * 4, [1, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(p.src_page), [[-1] * 4, [-1, 4, -1, -1], [-1] * 4, [0, -1, -1, -1]])
    np.testing.assert_array_equal(np.asarray(p.src_row), np.maximum(np.asarray(topk), 0) % PAGE)


def test_union_resolve_matches_the_resolver_on_distinct_rows():
    """S = 1 rows through union_topk + row_plan read what the resolver gives each row directly (the union of one
    row is its top-k, sorted: the same addresses, the hot slots claimed in position order)."""
    rng = np.random.default_rng(0)
    Rq, MP, HR = 3, 6, 64
    bt = np.where(rng.random((Rq, MP)) < 0.5, rng.integers(0, 50, (Rq, MP)), -1).astype(np.int32)
    ht = rng.integers(0, 40, (Rq, MP)).astype(np.int32)
    hp = np.asarray([[60], [61], [62]], np.int32)
    tok = np.full((Rq, HR), -1, np.int32)
    stamp = np.full((Rq, HR), -1, np.int32)
    topk = np.stack([np.sort(rng.choice(MP * PAGE, 16, replace=False)) for _ in range(Rq)]).astype(np.int32)
    topk[1, 10:] = -1
    req = jnp.asarray([2, 0, 1], jnp.int32)
    args = (jnp.asarray(bt), jnp.asarray(ht), jnp.asarray(hp), jnp.asarray(tok), jnp.asarray(stamp), jnp.int32(0))
    from pallas_kernels.sparse_gather.reference import resolve_positions

    direct = resolve_positions(jnp.asarray(topk), req, *args, hot_rows=HR)
    union = union_topk(jnp.asarray(topk), 1)
    via = resolve_positions(union, req, *args, hot_rows=HR)
    rp = row_plan(Plan(*via[:7]), union, jnp.asarray(topk), 1)
    for a, b in zip(direct[:7], rp):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----- end to end: a model's step through a store under pressure --------------------------------------------
CFG = model_cfg()  # 4 layers (2 indexer groups), top-k 16, float32
TIGHT = CacheConfig(kv_dtype="float32", device_pages=10, host_pages=48, max_seqs=4, max_seq_len=512, hot_rows=64)
ROOMY = TIGHT.replace(device_pages=48)
LENGTHS = (300, 200, 260)
STEPS = 3


@pytest.fixture(scope="module")
def model():
    return hj.SparseMLAModel(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prefilled(model):
    from hisparse_jax.engine.runner import prefill_rows

    rng = np.random.default_rng(11)
    return [(n, prefill_rows(model, rng.integers(0, CFG.vocab_size, n).tolist())[1:]) for n in LENGTHS]


def _admit(prefilled, cc):
    tc = PageManager(CFG, cc)
    store = kv_device.new_store(tc)
    slots = []
    for n, (latent, rope, index_k) in prefilled:
        store, slot = kv_device.admit_prefilled(store, tc, latent, rope, index_k, n)
        slots.append(slot)
    return tc, store, slots


@functools.lru_cache(maxsize=None)
def _step(graphdef, S, kernels):
    @jax.jit
    def step(state, store, batch):
        return runner.step_impl(nnx.merge(graphdef, state), store, batch, kernels, rows_per_request=S)

    return step


def _batch(tc, slots, S, rng):
    """Groups of S rows: each request at positions n..n+S-1, the last request with its last row idle, and one
    idle group. Returns (batch, rows written per slot)."""
    req, pos, wrote = [], [], {}
    for i, s in enumerate(slots):
        live = S - 1 if i == len(slots) - 1 else S
        n = tc.lengths[s]
        req += [s] * live + [-1] * (S - live)
        pos += list(range(n, n + S))
        wrote[s] = live
    req += [-1] * S
    pos += [0] * S
    tokens = rng.integers(0, CFG.vocab_size, len(req))
    return {"tokens": jnp.asarray(tokens, jnp.int32), "req": jnp.asarray(req, jnp.int32),
            "pos": jnp.asarray(pos, jnp.int32)}, wrote


def _run(model, prefilled, cc, S, kernels="reference", steps=STEPS):
    """`steps` steps of S rows per request through a fresh store: (logits per step, stats per step, tc, store)."""
    graphdef, state = nnx.split(model)
    step = _step(graphdef, S, kernels)
    tc, store, slots = _admit(prefilled, cc)
    rng = np.random.default_rng(S)
    logits, stats = [], []
    for _ in range(steps):
        for s in slots:
            tc.reserve(s, tc.lengths[s] + S)
        store = kv_device.apply_updates(store, tc)
        batch, wrote = _batch(tc, slots, S, rng)
        check_groups(np.asarray(batch["req"]), S)
        lg, store, st = step(state, store, batch)
        for s, n in wrote.items():
            tc.advance([s], n)
        logits.append(np.asarray(lg))
        stats.append(jax.device_get(st))
        check_hot_buffers(tc, store)
    kv_device.check_tables(store, tc)
    return logits, stats, tc, store


def check_hot_buffers(tc, store):
    """Every live request's hot buffer, per indexer group: a used slot stamped with a past step and a never-used
    one with -1, the tags of its used slots distinct positions of the request, and each used slot holding its
    position's row (all layers of the group, bit for bit the host copy)."""
    spec = tc.spec
    hot_pages, tokens, stamps, host_table, latent, rope, h_latent, h_rope, clock = jax.device_get(
        (store.hot_pages, store.hot_token, store.hot_stamp, store.host_table, store.latent, store.rope,
         store.h_latent, store.h_rope, store.clock))
    checked = 0
    for s in tc.requests:
        if np.any(hot_pages[s, :spec.hot_pages] < 0):
            continue
        for g, layers in enumerate(spec.groups):
            np.testing.assert_array_equal(stamps[s, g] >= 0, tokens[s, g] >= 0)
            assert np.all(stamps[s, g] < 2 * clock)
            used = np.nonzero(tokens[s, g] >= 0)[0]
            t = tokens[s, g, used]
            assert len(set(t.tolist())) == len(t) and np.all(t < tc.lengths[s])
            dp, dr = hot_pages[s, used // PAGE], used % PAGE
            hp, hr = host_table[s, t // PAGE], t % PAGE
            for layer in layers:
                np.testing.assert_array_equal(latent[layer, dp, dr], h_latent[layer, hp, hr])
                np.testing.assert_array_equal(rope[layer, dp, dr], h_rope[layer, hp, hr])
            checked += len(used)
    return checked


def _total(stats, k):
    return sum(int(np.sum(s[k])) for s in stats)


@pytest.mark.parametrize("S", [2, 4])
def test_union_resolve_is_lossless_and_fetches_each_row_once(model, prefilled, S):
    want, st_want, _, _ = _run(model, prefilled, ROOMY, S)
    got, st_got, tc, store = _run(model, prefilled, TIGHT, S)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)  # bit-identical logits, every row of every step
    assert _total(st_want, "misses") == _total(st_want, "hits") == _total(st_want, "row_misses") == 0
    assert tc.evicted_pages > 0
    assert _total(st_got, "misses") > 0 and _total(st_got, "hits") > 0
    for st in st_got:
        assert int(st["h2d_rows"]) == int(np.sum(st["misses"]))  # each distinct missing row fetched once
        assert np.all(st["row_misses"] >= st["misses"]) and int(st["append_dropped"]) == 0
        assert stats_bytes(tc.spec, st)["h2d_bytes"] == int(np.sum(st["misses"])) * tc.spec.row_bytes
    assert _total(st_got, "row_misses") > _total(st_got, "misses")  # duplicates across a request's rows avoided
    assert check_hot_buffers(tc, store) > 0


def test_split_miss_attention_with_union(model, prefilled):
    """miss_attention='split' reads the same rows: same counters, logits equal up to the merge's rounding."""
    S = 2
    want, st_want, _, _ = _run(model, prefilled, TIGHT, S, steps=2)
    got, st_got, _, _ = _run(model, prefilled, TIGHT.replace(miss_attention="split"), S, steps=2)
    for k in ("resident", "hits", "misses", "row_misses", "h2d_rows"):
        assert _total(st_got, k) == _total(st_want, k)
    assert _total(st_got, "misses") > 0
    for a, b in zip(want, got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_pallas_kernels_with_union(model, prefilled):
    """The Pallas resolver over [B/S, S*K] and the Pallas sparse MLA decode over each row's plan (interpret mode):
    the same counters and hot state as the jnp references, logits within the kernels' summation-order tolerance."""
    S = 2
    want, st_want, _, s_want = _run(model, prefilled, TIGHT, S, steps=2)
    got, st_got, _, s_got = _run(model, prefilled, TIGHT, S, kernels="pallas_interpret", steps=2)
    for k in ("resident", "hits", "misses", "row_misses", "h2d_rows"):
        assert _total(st_got, k) == _total(st_want, k)
    assert _total(st_got, "misses") > 0
    np.testing.assert_array_equal(np.asarray(s_got.hot_token), np.asarray(s_want.hot_token))
    np.testing.assert_array_equal(np.asarray(s_got.hot_stamp), np.asarray(s_want.hot_stamp))
    for a, b in zip(want, got):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


# ----- refusals and S == 1 ------------------------------------------------------------------------------------
def test_too_small_hot_buffer_and_ragged_batch_are_refused(model, prefilled):
    spec = StoreSpec.create(CFG, TIGHT)  # hot_rows 64, top-k 16
    TieredKV(spec, rows_per_request=4)
    with pytest.raises(ValueError, match=r"hot_rows \(64\) must be >= rows_per_request \(5\) x topk \(16\) = 80"):
        TieredKV(spec, rows_per_request=5)
    with pytest.raises(ValueError, match="rows_per_request must be an int >= 1"):
        TieredKV(spec, rows_per_request=0)
    tc, store, slots = _admit(prefilled[:1], TIGHT)
    batch = {"tokens": jnp.zeros((6,), jnp.int32), "req": jnp.asarray([slots[0]] * 4 + [-1, -1], jnp.int32),
             "pos": jnp.arange(6, dtype=jnp.int32) + LENGTHS[0]}
    with pytest.raises(ValueError, match="6 rows is not groups of rows_per_request=4"):
        jax.eval_shape(lambda st, b: runner.step_impl(model, st, b, rows_per_request=4), store, batch)


def test_row_misses_is_a_stat_everywhere():
    spec = StoreSpec.create(CFG, TIGHT)
    st = empty_stats(spec)
    assert st["row_misses"].shape == (spec.num_layers,)
    assert stats_bytes(spec, st)["row_misses"] == 0
