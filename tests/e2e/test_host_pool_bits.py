"""Host pools of sub-32-bit floats are stored as their bit patterns (`kv.state.host_dtype`): bf16 -> uint16,
e4m3 -> uint8, float32 as is. Every row written into a host pool by the store's own write functions (prefill,
the eager mirror, the write-back on eviction) is held there bit for bit — NaN payloads, -0.0, inf and subnormals
included — and read out by its own read functions (row / page fetch of misses, page loads) into the device pools
bit for bit, except that XLA:CPU's bf16 scatters into the *device* pools (unchanged by the host-bits layout, the
same before it) turn a NaN into the quiet NaN 0x7FC0 of its sign. Tiered decode on a bf16 store is exactly the
all-resident decode."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.generate import generate
from hisparse_jax.kv.device import evict_pages, load_pages
from hisparse_jax.kv.resolve import Plan, fetch_misses
from hisparse_jax.kv.writes import append_rows, mirror_rows, write_prefill
from hisparse_jax.kv.state import StoreSpec, from_host_bits, host_dtype, init_store, to_host_bits
from tiny import BIG, model_cfg

L, C, R, MP = 2, 16, 8, 2  # two layers (one indexer group), two logical pages of 64 rows
T = MP * 64
BF16_SPECIALS = np.array([
    0x0000, 0x8000,  # +0.0, -0.0
    0x7F80, 0xFF80,  # +inf, -inf
    0x7FC0, 0xFFC0, 0x7FC1, 0x7F81, 0x7FFF, 0xFF81, 0xFFFF, 0x7FA5,  # quiet / signalling NaNs with payloads
    0x0001, 0x8001, 0x007F, 0x807F, 0x0040,  # subnormals
    0x0080, 0x7F7F, 0xFF7F,  # smallest normal, largest finite
], np.uint16)


def spec_for(kv_dtype: str, **over) -> StoreSpec:
    kw = dict(num_layers=L, num_indexer_layers=1, groups=((0, 1),), latent_dim=C, rope_dim=R, index_dim=16,
              device_pages=8, index_pages=MP, host_pages=4, max_seqs=1, max_pages=MP, hot_rows=64,
              kv_dtype=kv_dtype, fetch="row", fetch_min_rows=4, mirror_to_host=True, topk=8)
    kw.update(over)
    return StoreSpec(**kw)


def with_tables(spec, block_row, host_row, seq_len=0):
    store = init_store(spec)
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    return dataclasses.replace(store, block_table=i32([block_row]), host_table=i32([host_row]),
                               index_table=i32([list(range(MP))]), seq_lens=i32([seq_len]))


def random_bf16_bits(rng, shape) -> np.ndarray:
    """Random bf16 bit patterns of `shape`, every special value of BF16_SPECIALS among them."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    flat = bits.reshape(-1)
    flat[rng.choice(flat.size, BF16_SPECIALS.size, replace=False)] = BF16_SPECIALS
    flat[: BF16_SPECIALS.size] = BF16_SPECIALS  # and once at a fixed place
    return bits


def bits_of(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(f"uint{8 * x.dtype.itemsize}")


def assert_device_bits(got, want):
    """Device-pool rows `got` hold the bf16 bits `want` exactly, but for a NaN, which a bf16 scatter into a device
    pool may canonicalize on XLA:CPU (0x7FC0 | sign; an all-float32 store is exact, tests/e2e/test_store.py)."""
    got, want = np.asarray(got), np.asarray(want)
    nan = ((want & 0x7F80) == 0x7F80) & ((want & 0x007F) != 0)
    canon = (want & 0x8000) | 0x7FC0
    ok = (got == want) | (nan & (got == canon))
    assert ok.all(), f"{(~ok).sum()} rows differ, e.g. got {got[~ok][:5]} want {want[~ok][:5]}"


def test_host_pool_dtypes():
    assert host_dtype(jnp.bfloat16) == jnp.uint16 and host_dtype(jnp.float16) == jnp.uint16
    assert host_dtype(jnp.float8_e4m3fn) == jnp.uint8
    assert host_dtype(jnp.float32) == jnp.float32 and host_dtype(jnp.int32) == jnp.int32
    bf, f32, fp8 = (init_store(spec_for(k, latent_dim=128, index_dim=128)) for k in ("bf16", "float32", "fp8"))
    assert (bf.h_latent.dtype, bf.h_rope.dtype) == (jnp.uint16, jnp.uint16)
    assert (bf.latent.dtype, bf.rope.dtype) == (jnp.bfloat16, jnp.bfloat16)  # device pools unchanged
    assert (f32.h_latent.dtype, f32.h_rope.dtype) == (jnp.float32, jnp.float32)
    assert (fp8.h_latent.dtype, fp8.h_rope.dtype, fp8.h_latent_scale.dtype) == (jnp.uint8, jnp.uint16, jnp.float32)
    for s in (bf, f32, fp8):
        assert s.h_latent.sharding.memory_kind == s.h_rope.sharding.memory_kind == "pinned_host"
        assert s.h_latent.nbytes * s.latent.shape[1] == s.latent.nbytes * s.h_latent.shape[1]  # same bytes per row


def test_bit_helpers_round_trip_every_bf16():
    every = np.arange(1 << 16, dtype=np.uint16)
    vals = every.view(ml_dtypes.bfloat16)
    assert np.array_equal(to_host_bits(vals), every)  # numpy: a view
    assert np.array_equal(bits_of(from_host_bits(every, jnp.bfloat16)), every)
    got = jax.jit(lambda b: to_host_bits(from_host_bits(b, jnp.bfloat16)))(jnp.asarray(every))
    assert got.dtype == jnp.uint16 and np.array_equal(np.asarray(got), every)
    with pytest.raises(TypeError, match="cannot hold"):
        from_host_bits(every, jnp.float32)


def _prefilled(spec, rng, start_split=100):
    """A store whose logical pages 0, 1 live only in host pages 2, 0 (no device copy), written by two
    write_prefill calls (0..start_split-1, then start_split..T-1: a page merged on the device). Returns
    (store, latent bits [L, T, C], rope bits [L, T, R])."""
    store = with_tables(spec, [-1, -1], [2, 0])
    lat_b, rope_b = random_bf16_bits(rng, (L, T, C)), random_bf16_bits(rng, (L, T, R))
    lat, rope = jnp.asarray(lat_b.view(ml_dtypes.bfloat16)), jnp.asarray(rope_b.view(ml_dtypes.bfloat16))
    idx = jnp.zeros((1, T, spec.index_dim), jnp.float32)
    write = jax.jit(write_prefill)
    store, _ = write(store, 0, lat, rope, idx, start_split)
    store, _ = write(store, 0, lat, rope, idx, T, start_split)
    return store, lat_b, rope_b


def _check_host(store, lat_b, rope_b, host_pages):
    """The host pools, read through from_host_bits, hold exactly the bits `lat_b` / `rope_b` (NaN payloads too)."""
    for name, dev, want in (("h_latent", "latent", lat_b), ("h_rope", "rope", rope_b)):
        host = from_host_bits(np.asarray(getattr(store, name)), getattr(store, dev).dtype)
        assert host.dtype == ml_dtypes.bfloat16
        got = bits_of(host[:, host_pages]).reshape(want.shape)
        np.testing.assert_array_equal(got, want)


def test_prefill_then_load_pages_is_bit_exact():
    spec = spec_for("bf16")
    store, lat_b, rope_b = _prefilled(spec, np.random.default_rng(0))
    _check_host(store, lat_b, rope_b, [2, 0])
    store, rows = jax.jit(load_pages)(store, jnp.asarray([2, 0, -1], jnp.int32), jnp.asarray([5, 3, -1], jnp.int32))
    assert int(rows) == 2 * L * 64
    assert_device_bits(bits_of(np.asarray(store.latent)[:, [5, 3]]).reshape(lat_b.shape), lat_b)
    assert_device_bits(bits_of(np.asarray(store.rope)[:, [5, 3]]).reshape(rope_b.shape), rope_b)
    _check_host(store, lat_b, rope_b, [2, 0])  # reading does not change the host pools


@pytest.mark.parametrize("fetch", ["row", "page"])
def test_prefill_then_fetch_misses_is_bit_exact(fetch):
    spec = spec_for("bf16", fetch=fetch)
    rng = np.random.default_rng(1)
    store, lat_b, rope_b = _prefilled(spec, rng)
    K = 24
    pos = np.sort(rng.choice(T, K, replace=False)).astype(np.int32)
    pos[:2] = [0, 1]  # rows holding the specials
    slot = rng.permutation(128)[:K]  # destination hot slots on device pages 6, 7
    host_of = np.array([2, 0])
    plan = Plan(page=jnp.asarray(6 + slot // 64)[None], row=jnp.asarray(slot % 64)[None],
                valid=jnp.ones((1, K), bool), resident=jnp.zeros((1, K), bool), miss=jnp.ones((1, K), bool),
                src_page=jnp.asarray(host_of[pos // 64], jnp.int32)[None],
                src_row=jnp.asarray(pos % 64, jnp.int32)[None])
    store, payload, _ = jax.jit(fetch_misses, static_argnums=(2,))(store, 0, 2, plan)
    assert int(payload) == K * L
    for dev, want in ((store.latent, lat_b), (store.rope, rope_b)):
        assert_device_bits(bits_of(np.asarray(dev)[:, 6 + slot // 64, slot % 64]), want[:, pos])
    _check_host(store, lat_b, rope_b, [2, 0])


@pytest.mark.parametrize("mirror", [True, False], ids=["mirror_rows", "write_back"])
def test_device_rows_to_host_and_back_are_bit_exact(mirror):
    """Rows appended on the device reach the host by the eager mirror (mirror_rows) or by the write-back of
    evict_pages, and come back by load_pages, bit for bit."""
    spec = spec_for("bf16", mirror_to_host=mirror)
    rng = np.random.default_rng(2)
    store = with_tables(spec, [1, 4], [3, 1])
    lat_b, rope_b = random_bf16_bits(rng, (L, T, C)), random_bf16_bits(rng, (L, T, R))

    @jax.jit
    def append(store, t):
        req, pos = jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32)
        lat = jax.lax.dynamic_slice_in_dim(jnp.asarray(lat_b.view(ml_dtypes.bfloat16)), t, 1, axis=1)
        rope = jax.lax.dynamic_slice_in_dim(jnp.asarray(rope_b.view(ml_dtypes.bfloat16)), t, 1, axis=1)
        for layer in range(L):
            store, _ = append_rows(store, layer, 0 if layer == 0 else None, req, pos, lat[layer], rope[layer],
                                   jnp.zeros((1, spec.index_dim), jnp.float32))
        if spec.mirror_to_host:
            store, _ = mirror_rows(store, req, pos)
        return store

    for t in range(T):
        store = append(store, t)
    dev_lat = bits_of(np.asarray(store.latent)[:, [1, 4]]).reshape(lat_b.shape)  # the device copy: the source
    dev_rope = bits_of(np.asarray(store.rope)[:, [1, 4]]).reshape(rope_b.shape)
    assert_device_bits(dev_lat, lat_b)
    assert_device_bits(dev_rope, rope_b)
    if not mirror:
        assert not np.asarray(store.h_latent).any()  # nothing reached the host yet
        store, d2h = jax.jit(evict_pages)(store, jnp.asarray([0, 0], jnp.int32), jnp.asarray([0, 1], jnp.int32))
        assert int(d2h) == 2 * L * 64
    _check_host(store, dev_lat, dev_rope, [3, 1])  # the host copy is the device copy, bit for bit
    store, _ = jax.jit(load_pages)(store, jnp.asarray([3, 1], jnp.int32), jnp.asarray([6, 7], jnp.int32))
    np.testing.assert_array_equal(bits_of(np.asarray(store.latent)[:, [6, 7]]).reshape(lat_b.shape), dev_lat)
    np.testing.assert_array_equal(bits_of(np.asarray(store.rope)[:, [6, 7]]).reshape(rope_b.shape), dev_rope)


@pytest.fixture(scope="module")
def bf16_resident():
    """(bf16 model, prompts, the all-resident bf16 store's tokens and logits): no miss, so one reference serves both
    fetch mechanisms."""
    m = hj.SparseMLAModel(model_cfg(dtype="bfloat16"), rngs=nnx.Rngs(1))
    rng = np.random.default_rng(1)
    ps = [rng.integers(0, 97, n).tolist() for n in (260, 140)]
    a, sa, la = generate(m, ps, 24, cache=BIG.replace(kv_dtype="bf16"), return_stats=True, return_logits=True)
    assert sa.misses == 0
    return m, ps, a, la


@pytest.mark.parametrize("fetch", ["row", "page"])
def test_tiered_bf16_decode_equals_all_resident(bf16_resident, fetch):
    """A bf16 store under a tiny device budget (misses fetched from the uint16 host pools every step) decodes
    exactly as the all-resident one: same tokens, bit-identical logits."""
    m, ps, a, la = bf16_resident
    cc: CacheConfig = BIG.replace(kv_dtype="bf16", fetch=fetch, device_pages=7)
    b, sb, lb = generate(m, ps, 24, cache=cc, return_stats=True, return_logits=True)
    assert sb.misses > 0 and sb.evicted_pages > 0
    assert a == b
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
