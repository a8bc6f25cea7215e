"""The tiered paged KV store: lossless (bit-exact) under any sequence of appends, evictions and
resolves; invariants after every step; exact byte accounting; memory kinds; clear errors."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store_pair import StorePair
from hisparse_jax.config import CacheConfig
from hisparse_jax.kv.audit import check_manager
from hisparse_jax.kv.persist import pool_state
from hisparse_jax.kv.pool import OutOfPages, PoolError, Tier
from hisparse_jax.kv.spec import BudgetError, check_batch_fits
from hisparse_jax.units import INVALID
from tiny import model_cfg

# tiny.py's base at the sizes L, LI, C, R, DI below: all-dense, 2 of 4 layers with their own indexer
MODEL = model_cfg(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_attention_heads=2,
                  q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                  mlp_layer_types=("dense",) * 4, max_position_embeddings=1024, index_n_heads=2, index_head_dim=16,
                  index_topk=8)
L, LI, C, R, DI = 4, 2, 16, 8, 16
ROW_BYTES = (C + R) * 4


def cache_config(**over):
    kw = dict(kv_dtype="float32", device_pages=24, host_pages=24, max_seqs=2, max_seq_len=512, hot_rows=8)
    kw.update(over)
    return CacheConfig(**kw)


class Reference:
    """What a store that never evicts anything would return."""

    def __init__(self):
        self.lat = np.zeros((L, 2, 512, C), np.float32)
        self.rope = np.zeros((L, 2, 512, R), np.float32)

    def rows(self, slots, topk):
        lat = np.zeros((L, len(slots), topk.shape[1], C), np.float32)
        rope = np.zeros((L, len(slots), topk.shape[1], R), np.float32)
        for b, s in enumerate(slots):
            for k, p in enumerate(topk[b]):
                if p >= 0:
                    lat[:, b, k], rope[:, b, k] = self.lat[:, s, p], self.rope[:, s, p]
        return lat, rope


def append_tokens(tc, ref, rng, slots, n):
    for _ in range(n):
        lat = rng.standard_normal((L, len(slots), C)).astype(np.float32)
        rope = rng.standard_normal((L, len(slots), R)).astype(np.float32)
        idx = rng.standard_normal((LI, len(slots), DI)).astype(np.float32)
        pos = [tc.lengths[s] for s in slots]
        tc.append(slots, jnp.asarray(lat), jnp.asarray(rope), jnp.asarray(idx))
        for b, (s, p) in enumerate(zip(slots, pos)):
            ref.lat[:, s, p], ref.rope[:, s, p] = lat[:, b], rope[:, b]


PROMPT_ROWS = 256  # a prompt's rows padded to this bucket (NaN), as the engine pads a prompt: one compiled write


def admit(tc, ref, rng, n):
    slot = tc.admit(n)
    lat = rng.standard_normal((L, n, C)).astype(np.float32)
    rope = rng.standard_normal((L, n, R)).astype(np.float32)
    idx = rng.standard_normal((LI, n, DI)).astype(np.float32)
    pad = [(0, 0), (0, max(n, PROMPT_ROWS) - n), (0, 0)]
    tc.write_prefill(slot, *(jnp.asarray(np.pad(a, pad, constant_values=np.nan)) for a in (lat, rope, idx)), n)
    ref.lat[:, slot, :n], ref.rope[:, slot, :n] = lat, rope
    return slot


@pytest.fixture(scope="module", params=["row", "page"])
def fetch(request):
    return request.param


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_lossless_under_random_operations(fetch, data):
    """Random appends / evictions / resolves (with -1 padding, page-boundary positions) return exactly the rows
    of a store that never evicted anything, and the invariants hold after every operation."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    tc = StorePair(MODEL, cache_config(fetch=fetch))
    ref = Reference()
    slots = [admit(tc, ref, rng, data.draw(st.integers(1, 200))) for _ in range(2)]
    check_manager(tc)
    topk = None
    for _ in range(data.draw(st.integers(4, 14))):
        op = data.draw(st.sampled_from(["append", "evict", "evict", "resolve", "resolve", "again"]))
        if op == "again" and topk is None:
            op = "resolve"
        if op == "append":
            room = 500 - max(tc.lengths[x] for x in slots)
            if room > 0:
                append_tokens(tc, ref, rng, slots, min(room, data.draw(st.integers(1, 150))))
        elif op == "evict":
            s = data.draw(st.sampled_from(slots))
            pages = tc.evictable_pages(s)
            if pages:
                chosen = data.draw(st.lists(st.sampled_from(pages), min_size=1, max_size=len(pages), unique=True))
                tc._ensure_hot(s)
                tc.evict(s, chosen)
        else:
            if op == "resolve":  # fresh sets, biased towards released pages; "again" re-reads them (hits)
                topk = draw_topk(tc, slots, rng, data)
            elif rng.random() < 0.5:  # partly overlapping with the previous step, like real decode
                fresh = draw_topk(tc, slots, rng, data)
                topk = np.where(rng.random(topk.shape) < 0.5, topk, fresh)
                topk = np.array([dedupe(row) for row in topk], np.int32)
            lat, rope, valid, _ = tc.gather(slots, topk)
            want_lat, want_rope = ref.rows(slots, topk)
            np.testing.assert_array_equal(np.asarray(valid), topk >= 0)
            np.testing.assert_array_equal(np.asarray(lat), want_lat)
            np.testing.assert_array_equal(np.asarray(rope), want_rope)
        check_manager(tc)
    for s in slots:
        tc.release(s)
    check_manager(tc)
    assert all(tc.pool.num_used(t) == 0 for t in Tier)


def draw_topk(tc, slots, rng, data):
    topk = np.full((len(slots), 8), -1, np.int32)
    for b, s in enumerate(slots):
        n = tc.lengths[s]
        r = tc.requests[s]
        released = [p for i in r.host_only_pages() for p in range(i * 64, min((i + 1) * 64, n))]
        boundary = [p for p in (0, 63, 64, 65, 127, 128, n - 1) if p < n]
        cand = set(boundary) | set(rng.integers(0, n, 6).tolist())
        if released:
            cand |= set(rng.choice(released, min(8, len(released)), replace=False).tolist())
        cand = sorted(cand)
        k = data.draw(st.integers(1, min(8, len(cand))))
        topk[b, :k] = rng.permutation(cand)[:k]
        topk[b] = rng.permutation(topk[b])  # -1 padding anywhere, not only at the end
    return topk


def dedupe(row):
    seen, out = set(), []
    for p in row.tolist():
        out.append(-1 if p in seen else p)
        if p >= 0:
            seen.add(p)
    return out


def test_appended_rows_survive_eviction():
    """Rows written by decode (the eager host mirror), not by prefill, are read back exactly after release."""
    rng = np.random.default_rng(5)
    for fetch, kv_dtype in (("row", "float32"), ("page", "float32"), ("row", "bf16")):
        tc = StorePair(MODEL, cache_config(fetch=fetch, max_seqs=1, kv_dtype=kv_dtype))
        ref = Reference()
        s = admit(tc, ref, rng, 10)
        append_tokens(tc, ref, rng, [s], 250)  # pages 0..3; 0 and 1 become sealed
        tc._ensure_hot(s)
        tc.evict(s, [0, 1])
        for start in range(0, 128, 8):
            topk = np.arange(start, start + 8, dtype=np.int32)[None]
            lat, rope, _, payload = tc.gather([s], topk)
            assert payload == 8 * 4 * ROW_BYTES or kv_dtype == "bf16"
            want_lat, want_rope = ref.rows([s], topk)
            if kv_dtype == "bf16":  # stored rounded to bf16, returned exactly
                want_lat, want_rope = (w.astype(ml_dtypes.bfloat16).astype(np.float32) for w in (want_lat, want_rope))
                assert payload == 8 * 4 * (C + R) * 2
            np.testing.assert_array_equal(np.asarray(lat), want_lat)
            np.testing.assert_array_equal(np.asarray(rope), want_rope)


def test_exact_accounting_and_lru_by_hand():
    rng = np.random.default_rng(0)
    for fetch, transfer in (("row", 2 * 8 * 2 * ROW_BYTES), ("page", 2 * 1 * 2 * 64 * ROW_BYTES)):
        tc = StorePair(MODEL, cache_config(fetch=fetch, max_seqs=1))
        ref = Reference()
        s = admit(tc, ref, rng, 192)  # logical pages 0, 1, 2
        tc._ensure_hot(s)
        tc.evict(s, [0])
        topk = np.array([[0, 1, 2, 63, 64, 100, 130, -1]], np.int32)
        _, _, _, payload = tc.gather([s], topk)
        # 4 misses (page 0) x 2 groups x 2 layers per group x one row each
        assert payload == 4 * 2 * 2 * ROW_BYTES
        store = tc.store
        assert np.asarray(store.hot_token[s, 0]).tolist() == [0, 1, 2, 63, -1, -1, -1, -1]
        _, _, _, payload = tc.gather([s], topk)
        assert payload == 0  # all hits now
        # LRU: slots of 0 and 1 are touched, the other misses take the least recently used slots
        tc.evict(s, [])
        _, _, _, payload = tc.gather([s], np.array([[0, 1, 3, 4, 5, 6, 7, 8]], np.int32))
        assert payload == 6 * 4 * ROW_BYTES
        tokens = np.asarray(tc.store.hot_token[s, 0]).tolist()
        assert sorted(tokens) == [0, 1, 3, 4, 5, 6, 7, 8]  # 2 and 63 (least recent) were replaced
        del transfer


def test_transfer_bytes_per_mechanism():
    """Row mechanism moves the smallest staging size that holds the misses (`resolve.fetch_sizes`); page mechanism
    each distinct host page once."""
    from hisparse_jax.kv.resolve import fetch_misses, resolve
    rng = np.random.default_rng(1)
    for fetch in ("row", "page"):
        tc = StorePair(MODEL, cache_config(fetch=fetch, max_seqs=1, fetch_min_rows=4))
        s = admit(tc, Reference(), rng, 192)
        tc._ensure_hot(s)
        tc.evict(s, [0])
        topk = jnp.asarray([[0, 1, 2, 63, 64, 100, 130, -1]], jnp.int32)
        plan, store = resolve(tc.sync(), 0, jnp.asarray([s], jnp.int32), topk)
        _, payload, transfer = fetch_misses(store, 0, 2, plan)
        assert int(payload) * ROW_BYTES == 4 * 2 * ROW_BYTES  # layer-rows; bytes = rows x row_bytes
        assert int(transfer) * ROW_BYTES == (1 * 4 * 2 * ROW_BYTES if fetch == "row" else 1 * 2 * 64 * ROW_BYTES)


def test_fetch_sizes_and_their_option():
    """The row fetch's static staging sizes: fetch_min_rows doubling, capped at and ending with B x K."""
    from hisparse_jax.kv.resolve import fetch_sizes
    assert fetch_sizes(256, 65536) == (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
    assert fetch_sizes(256, 1000) == (256, 512, 1000)
    assert fetch_sizes(256, 100) == (100,)  # fewer slots than the smallest size: one size
    assert fetch_sizes(65536, 65536) == (65536,)  # the single B x K size
    with pytest.raises(ValueError, match="fetch_min_rows must be >= 1"):
        CacheConfig(fetch_min_rows=0)


def test_host_pools_are_pinned_and_device_pools_are_not():
    tc = StorePair(MODEL, cache_config())
    assert tc.store.h_latent.sharding.memory_kind == "pinned_host"
    assert tc.store.h_rope.sharding.memory_kind == "pinned_host"
    for name in ("latent", "rope", "index_k", "block_table", "hot_token"):
        assert getattr(tc.store, name).sharding.memory_kind == "device"
    # and they stay pinned through decode-side updates
    rng = np.random.default_rng(2)
    ref = Reference()
    s = admit(tc, ref, rng, 100)
    append_tokens(tc, ref, rng, [s], 3)
    assert tc.store.h_latent.sharding.memory_kind == "pinned_host"


def test_errors_are_clear_and_change_nothing():
    rng = np.random.default_rng(3)
    # budget too small for one request: needs 2 tail pages + 1 hot page
    with pytest.raises(BudgetError, match="device pages"):
        tc = StorePair(MODEL, cache_config(device_pages=2))
        check_batch_fits(tc.budget_spec, [64 * 5], releasable=tc.releasable)
    with pytest.raises(ValueError, match="hot_rows"):
        StorePair(MODEL, cache_config(hot_rows=4))
    # a full host pool: OutOfPages naming the host tier, the pool unchanged
    tc = StorePair(MODEL, cache_config(host_pages=5, max_seqs=2))
    ref = Reference()
    admit(tc, ref, rng, 64 * 3)
    before = pool_state(tc.pool)
    with pytest.raises(OutOfPages, match="host"):
        tc.admit(64 * 3)
    assert pool_state(tc.pool) == before and len(tc.requests) == 1
    check_manager(tc)
    # a position beyond seq_len
    s = next(iter(tc.requests))
    with pytest.raises(ValueError, match="outside"):
        tc.gather([s], np.array([[0, 64 * 3]], np.int32))
    with pytest.raises(ValueError, match="unknown or repeated"):
        tc.gather([s + 1], np.array([[0]], np.int32))
    # a table entry pointing at a freed page is caught by the invariant check
    r = tc.requests[s]
    freed = tc.pool.allocate(Tier.DEVICE, 1)[0]
    tc.pool.free(Tier.DEVICE, [freed])
    good = r.device[0]
    r.device[0] = freed
    with pytest.raises(PoolError):
        check_manager(tc)
    r.device[0] = good
    check_manager(tc)
    # the last two pages are never evicted
    with pytest.raises(PoolError, match="last 2"):
        tc.evict(s, [r.num_pages - 1])
    assert INVALID not in r.device


def test_lone_request_grows_under_pressure():
    """A single request longer than the device pool keeps growing: its own sealed pages make room."""
    rng = np.random.default_rng(6)
    tc = StorePair(MODEL, cache_config(device_pages=4, max_seqs=1))  # 2 tail pages + 1 hot page + 1
    ref = Reference()
    s = admit(tc, ref, rng, 64 * 3)
    append_tokens(tc, ref, rng, [s], 64 * 4)  # crosses four page boundaries
    check_manager(tc)
    assert tc.evicted_pages >= 4
    topk = np.array([[0, 70, 130, 200, 260, 300, 400, 447]], np.int32)
    lat, rope, _, _ = tc.gather([s], topk)
    want_lat, want_rope = ref.rows([s], topk)
    np.testing.assert_array_equal(np.asarray(lat), want_lat)


def test_recency_coldness_orders_by_last_selection():
    """The indexer-recency rule releases the pages selected least recently (never-selected first)."""
    from hisparse_jax.kv.manager import least_recently_selected, oldest_first

    rng = np.random.default_rng(8)
    tc = StorePair(MODEL, cache_config(max_seqs=1))
    s = admit(tc, Reference(), rng, 64 * 6)  # pages 0..3 evictable
    assert oldest_first(tc.evictable_pages(s), tc.page_stamps[s]) == [0, 1, 2, 3]
    tc.gather([s], np.array([[0, 200, -1, -1, -1, -1, -1, -1]], np.int32))  # touches pages 0 and 3
    tc.gather([s], np.array([[70, -1, -1, -1, -1, -1, -1, -1]], np.int32))  # then page 1
    assert least_recently_selected(tc.evictable_pages(s), tc.page_stamps[s]) == [2, 0, 3, 1]


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32])
def test_set_rows_writes_in_place_without_a_pool_sized_conversion(dtype):
    """`kv.codec.set_rows` (every pool write of the store) equals `.at[].set(mode="drop")`, out-of-range rows dropped,
    and its compiled program converts nothing pool-sized: XLA:CPU scattered into an fp8 / bf16 pool by converting
    the whole pool to a wider float and back, a pool-sized copy on every decode step."""
    import jax

    from hisparse_jax.kv.codec import set_rows

    pool = jnp.asarray(np.random.default_rng(0).normal(size=(2, 300, 64, 32)), dtype)
    vals = jnp.asarray(np.random.default_rng(1).normal(size=(3, 32)), dtype)
    idx = (jnp.int32(1), jnp.asarray([5, 299, 300], jnp.int32), jnp.asarray([0, 63, 7], jnp.int32))  # 300: dropped
    want = pool.at[idx].set(vals, mode="drop")
    fn = jax.jit(set_rows)
    got = fn(pool, idx, vals)
    assert got.dtype == pool.dtype
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    hlo = fn.lower(pool, idx, vals).compile().as_text()
    wide = [line for line in hlo.splitlines() if " convert(" in line and "300,64,32]" in line.split("=")[1]]
    assert not wide, wide
