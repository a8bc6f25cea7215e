"""Public `PageManager` calls are safe in any order: random sequences of admit / write / append / release (abort) /
evict / swap / gather over 3 requests, and after every call each live request reads exactly its own rows.

The calls are the public ones only (no `_ensure_hot` first, unlike the store's other tests): a request whose pages
are released without a hot buffer must never have its misses written through hot page -1 (= page 0 of the pool,
another request's live page)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from store_pair import StorePair
from hisparse_jax.kv.audit import check_manager
from hisparse_jax.kv.manager import PageManager
from hisparse_jax.kv.pool import OutOfPages, Tier
from test_store import DI, LI, MODEL, C, L, R, cache_config

HOT = 64  # hot rows per group: one hot page, and the read-back gathers 64 positions at a time
PROMPTS = (1, 64, 65, 200, 330)  # few distinct prefill lengths: few compiles


class Oracle:
    """Every row each live slot was given."""

    def __init__(self):
        self.lat: dict[int, np.ndarray] = {}
        self.rope: dict[int, np.ndarray] = {}

    def put(self, slot, lat, rope, start=0):
        n = start + lat.shape[1]
        for d, v in ((self.lat, lat), (self.rope, rope)):
            old = d.get(slot, np.zeros((L, 0, v.shape[2]), np.float32))[:, :start]
            d[slot] = np.concatenate([old, v], axis=1)
        assert self.lat[slot].shape[1] == n


def rows(rng, n):
    return (rng.standard_normal((L, n, C)).astype(np.float32), rng.standard_normal((L, n, R)).astype(np.float32),
            rng.standard_normal((LI, n, DI)).astype(np.float32))


def read_back(tc: PageManager, oracle: Oracle, slot: int) -> None:
    n = tc.lengths[slot]
    for start in range(0, n, HOT):
        pos = np.full((1, HOT), -1, np.int32)
        k = min(HOT, n - start)
        pos[0, :k] = np.arange(start, start + k)
        lat, rope, valid, _ = tc.gather([slot], pos)
        assert np.asarray(valid)[0, :k].all() and not np.asarray(valid)[0, k:].any()
        np.testing.assert_array_equal(np.asarray(lat)[:, 0, :k], oracle.lat[slot][:, start:start + k],
                                      err_msg=f"slot {slot} rows {start}..{start + k}")
        np.testing.assert_array_equal(np.asarray(rope)[:, 0, :k], oracle.rope[slot][:, start:start + k])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_public_calls_keep_every_request_reading_its_own_rows(seed):
    rng = np.random.default_rng(seed)
    tc = StorePair(MODEL, cache_config(device_pages=14, host_pages=40, max_seqs=3, max_seq_len=640, hot_rows=HOT))
    tc.partial_eviction = True
    oracle = Oracle()
    counts: dict[str, int] = {}
    for _ in range(48):
        live = sorted(tc.requests)
        resident = [s for s in live if s not in tc.swapped]
        op = str(rng.choice(["admit", "append", "append", "evict", "evict", "evict", "swap", "gather", "release"]))
        if op == "admit" or not live:
            op = "admit"
            n = int(rng.choice(PROMPTS))
            if not tc.free_slots():
                continue
            try:
                slot = tc.admit(n)
            except OutOfPages:
                continue
            lat, rope, idx = rows(rng, n)
            tc.write_prefill(slot, jnp.asarray(lat), jnp.asarray(rope), jnp.asarray(idx), n)
            oracle.put(slot, lat, rope)
        elif op == "append":
            if not resident or max(tc.lengths[s] for s in resident) >= 600:
                continue
            k = int(rng.integers(1, 40))
            try:
                for _ in range(k):
                    lat, rope, idx = rows(rng, len(resident))
                    pos = [tc.lengths[s] for s in resident]
                    tc.append(resident, jnp.asarray(lat), jnp.asarray(rope), jnp.asarray(idx))
                    for b, s in enumerate(resident):
                        oracle.put(s, lat[:, b:b + 1], rope[:, b:b + 1], start=pos[b])
            except OutOfPages:
                pass  # refused with nothing changed: the oracle holds what was appended before
        elif op == "evict":
            if not resident:
                continue
            s = int(rng.choice(resident))
            pages = tc.evictable_pages(s)
            if not pages:
                continue
            chosen = sorted(rng.choice(pages, int(rng.integers(1, len(pages) + 1)), replace=False).tolist())
            try:
                tc.evict(s, chosen)  # public call, no hot buffer beforehand
            except OutOfPages:
                continue
        elif op == "swap":
            s = int(rng.choice(live))
            if s in tc.swapped:
                try:
                    tc.swap_in(s)
                except OutOfPages:
                    continue
            else:
                tc.swap_out(s)
        elif op == "gather":
            if not resident:
                continue
            s = int(rng.choice(resident))
            n = tc.lengths[s]
            pos = np.full((1, HOT), -1, np.int32)
            k = min(HOT, n)
            pos[0, :k] = rng.choice(n, k, replace=False)
            lat, _, valid, _ = tc.gather([s], pos)
            np.testing.assert_array_equal(np.asarray(lat)[:, 0, :k], oracle.lat[s][:, pos[0, :k]])
        else:
            s = int(rng.choice(live))
            tc.release(s)
            del oracle.lat[s], oracle.rope[s]
        counts[op] = counts.get(op, 0) + 1
        check_manager(tc)
        for s in sorted(tc.requests):
            if s not in tc.swapped:
                read_back(tc, oracle, s)
        check_manager(tc)
    assert counts.get("evict", 0) >= 3 and counts.get("admit", 0) >= 3, counts
    for s in list(tc.requests):
        tc.release(s)
    check_manager(tc)
    assert all(tc.pool.num_used(t) == 0 for t in Tier)


def test_invariants_reject_released_pages_without_a_hot_buffer():
    rng = np.random.default_rng(5)
    tc = StorePair(MODEL, cache_config(device_pages=14, host_pages=40, max_seqs=3, max_seq_len=640, hot_rows=HOT))
    slot = tc.admit(330)
    lat, rope, idx = rows(rng, 330)
    tc.write_prefill(slot, jnp.asarray(lat), jnp.asarray(rope), jnp.asarray(idx), 330)
    assert not tc.requests[slot].hot
    tc.evict(slot, [0, 1])
    assert tc.requests[slot].hot  # the public call gave it the buffer its released pages are read through
    check_manager(tc)
    tc.pool.free(Tier.DEVICE, tc.requests[slot].hot)  # break it by hand: what a buggy path would leave
    tc.requests[slot].hot.clear()
    with pytest.raises(Exception, match=r"released but the request has no hot buffer"):
        check_manager(tc)
