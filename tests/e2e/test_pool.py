"""Host-side page-pool bookkeeping (hisparse_jax.kv.pool): allocation, refcounts, prefix hashes, invariants; its saved
state (kv.persist.pool_state / restore_pool)."""

from __future__ import annotations

import collections
import copy
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hisparse_jax.kv.audit import check_pool, owners_of
from hisparse_jax.kv.persist import pool_state, restore_pool
from hisparse_jax.kv.pool import OutOfPages, PagePool, PoolError, RequestPages, Tier, page_hash
from hisparse_jax.units import PAGE_SIZE
from hisparse_jax.units import INVALID


def test_constructor_validation():
    PagePool(1, 1, 0)
    for args in [(0, 1, 1), (1, 0, 1), (1, 1, -1), (-3, 1, 1)]:
        with pytest.raises(ValueError, match="_pages must be >="):
            PagePool(*args)
    with pytest.raises(TypeError):
        PagePool(2.5, 1, 1)
    with pytest.raises(TypeError):
        PagePool(True, 1, 1)


def test_allocation_order_lowest_free_first():
    pool = PagePool(8, 4, 6)
    assert pool.allocate(Tier.DEVICE, 3) == [0, 1, 2]
    assert pool.allocate("device", 2) == [3, 4]
    pool.free(Tier.DEVICE, [3, 1])
    assert pool.num_free(Tier.DEVICE) == 5 and pool.num_used(Tier.DEVICE) == 3
    assert pool.allocate(Tier.DEVICE, 3) == [1, 3, 5]
    # tiers are independent
    assert pool.allocate(Tier.HOST, 2) == [0, 1]
    assert pool.allocate(Tier.INDEX, 4) == [0, 1, 2, 3]
    assert pool.allocate(Tier.INDEX, 0) == []
    assert all(pool.refcount(Tier.DEVICE, p) == 1 for p in [0, 1, 2, 3, 4, 5])
    assert pool.budget(Tier.HOST) == 6
    assert pool.stats() == {"device": {"budget": 8, "used": 6, "free": 2, "prefix": 0, "cached": 0},
                            "index": {"budget": 4, "used": 4, "free": 0, "prefix": 0, "cached": 0},
                            "host": {"budget": 6, "used": 2, "free": 4, "prefix": 0, "cached": 0}}
    check_pool(pool)


def test_out_of_pages_leaves_state_unchanged():
    pool = PagePool(4, 2, 0)
    pool.allocate(Tier.DEVICE, 3)
    before = pool_state(pool)
    assert pool.can_allocate(Tier.DEVICE, 1) and not pool.can_allocate(Tier.DEVICE, 2)
    with pytest.raises(OutOfPages, match=r"out of device pages: asked for 2, 1 free") as ei:
        pool.allocate(Tier.DEVICE, 2)
    assert (ei.value.tier, ei.value.requested, ei.value.free, ei.value.budget) == (Tier.DEVICE, 2, 1, 4)
    assert isinstance(ei.value, PoolError)
    assert pool_state(pool) == before
    with pytest.raises(OutOfPages, match=r"out of host pages: asked for 1, 0 free"):
        pool.allocate(Tier.HOST, 1)
    assert pool.allocate(Tier.DEVICE, 1) == [3]
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(Tier.DEVICE, -1)
    with pytest.raises(ValueError, match="unknown tier"):
        pool.allocate("gpu", 1)


def test_double_free_and_bad_ids_raise():
    pool = PagePool(4, 1, 2)
    (p,) = pool.allocate(Tier.DEVICE, 1)
    assert pool.decref(Tier.DEVICE, p) is True
    with pytest.raises(PoolError, match="double free: device page 0 is already free"):
        pool.decref(Tier.DEVICE, p)
    with pytest.raises(PoolError, match="double free"):
        pool.free(Tier.DEVICE, [p])
    with pytest.raises(PoolError, match="out of range"):
        pool.decref(Tier.DEVICE, 4)
    with pytest.raises(PoolError, match=r"INVALID \(-1\) is out of range"):
        pool.free(Tier.DEVICE, [INVALID])
    with pytest.raises(PoolError, match="out of range"):
        pool.refcount(Tier.HOST, 2)
    with pytest.raises(PoolError, match="incref of free"):
        pool.incref(Tier.DEVICE, 1)
    # free is all-or-nothing: one bad entry leaves every page untouched
    a, b = pool.allocate(Tier.HOST, 2)
    with pytest.raises(PoolError, match="freed 2 time"):
        pool.free(Tier.HOST, [a, b, b])
    assert pool.refcount(Tier.HOST, a) == 1 and pool.refcount(Tier.HOST, b) == 1
    with pytest.raises(PoolError, match="out of range"):
        pool.free(Tier.HOST, [a, 7])
    assert pool.num_used(Tier.HOST) == 2
    check_pool(pool)


def test_refcounts_with_prefix_sharing():
    pool = PagePool(8, 8, 8)
    toks = list(range(2 * PAGE_SIZE))
    h0 = page_hash(None, toks[:PAGE_SIZE])
    h1 = page_hash(h0, toks[PAGE_SIZE:])
    a = pool.allocate(Tier.DEVICE, 3)            # request A: two full pages + one partial
    pool.register_prefix(Tier.DEVICE, h0, a[0])
    pool.register_prefix(Tier.DEVICE, h1, a[1])
    pool.register_prefix(Tier.DEVICE, h1, a[1])  # idempotent
    assert pool.stats()["device"]["prefix"] == 2
    # request B has the same two-page prefix: hits, increfs, then its own tail page
    b = []
    for h in (h0, h1):
        p = pool.lookup_prefix(Tier.DEVICE, h)
        assert p is not None
        pool.incref(Tier.DEVICE, p)
        b.append(p)
    b += pool.allocate(Tier.DEVICE, 1)
    assert b == [0, 1, 3]
    assert [pool.refcount(Tier.DEVICE, p) for p in range(4)] == [2, 2, 1, 1]
    check_pool(pool, {Tier.DEVICE: [a, b]})
    pool.free(Tier.DEVICE, a)                    # A finishes: shared pages survive, still registered
    assert [pool.refcount(Tier.DEVICE, p) for p in range(4)] == [1, 1, 0, 1]
    assert pool.lookup_prefix(Tier.DEVICE, h0) == 0 and pool.prefix_hash(Tier.DEVICE, 1) == h1
    check_pool(pool, {Tier.DEVICE: [b]})
    assert pool.lookup_prefix(Tier.DEVICE, page_hash(None, toks[PAGE_SIZE:])) is None


def test_prefix_registration_dropped_on_free():
    pool = PagePool(4, 1, 4)
    (p,) = pool.allocate(Tier.HOST, 1)
    pool.register_prefix(Tier.HOST, 123, p)
    pool.incref(Tier.HOST, p)
    assert pool.decref(Tier.HOST, p) is False
    assert pool.lookup_prefix(Tier.HOST, 123) == p
    assert pool.decref(Tier.HOST, p) is True
    assert pool.lookup_prefix(Tier.HOST, 123) is None
    assert pool.stats()["host"]["prefix"] == 0
    # the reallocated page starts unregistered and can take a new hash
    assert pool.allocate(Tier.HOST, 1) == [p]
    assert pool.prefix_hash(Tier.HOST, p) is None
    pool.register_prefix(Tier.HOST, 456, p)
    check_pool(pool)


def test_prefix_registration_errors_and_rebinding():
    pool = PagePool(4, 2, 1)
    x, y = pool.allocate(Tier.DEVICE, 2)
    with pytest.raises(PoolError, match="free device page"):
        pool.register_prefix(Tier.DEVICE, 1, 3)
    ix = pool.allocate(Tier.INDEX, 1)[0]       # indexer-key pages are shared under the same hash as KV pages
    pool.register_prefix(Tier.INDEX, 7, ix)
    assert pool.lookup_prefix(Tier.INDEX, 7) == ix and pool.lookup_prefix(Tier.HOST, 7) is None
    pool.register_prefix(Tier.DEVICE, 7, x)
    with pytest.raises(PoolError, match="already registered under hash 7"):
        pool.register_prefix(Tier.DEVICE, 8, x)
    pool.register_prefix(Tier.DEVICE, 7, y)      # the newer page takes the hash; x is left unregistered
    assert pool.lookup_prefix(Tier.DEVICE, 7) == y and pool.prefix_hash(Tier.DEVICE, x) is None
    pool.free(Tier.DEVICE, [x])
    assert pool.lookup_prefix(Tier.DEVICE, 7) == y
    check_pool(pool)


def test_page_hash_chain_determinism_and_sensitivity():
    t = list(range(PAGE_SIZE))
    h = page_hash(None, t)
    assert h == page_hash(None, np.arange(PAGE_SIZE, dtype=np.int64)) == page_hash(None, tuple(t))
    assert 0 <= h < 2 ** 63
    assert page_hash(None, t[::-1]) != h                 # order matters
    assert page_hash(h, t) != h                          # chained page differs from the first page
    assert page_hash(0, t) != h                          # None is not 0
    assert page_hash(1, t) != page_hash(2, t)            # previous hash matters
    assert page_hash(None, [1, 2]) != page_hash(None, [1, 2, 0])
    # the same value in another process (hash randomization must not matter)
    code = ("from hisparse_jax.kv.pool import page_hash; import sys; "
            "h = page_hash(None, list(range(64))); print(h, page_hash(h, [5] * 64))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345"}).stdout.split()
    assert [int(v) for v in out] == [h, page_hash(h, [5] * 64)]
    with pytest.raises(ValueError, match="int32"):
        page_hash(None, [2 ** 31])
    with pytest.raises(ValueError, match="non-empty"):
        page_hash(None, [])
    with pytest.raises(TypeError):
        page_hash(None, [1.5])
    with pytest.raises(ValueError, match="prev_hash"):
        page_hash(-1, [1])


def test_saved_state_round_trip():
    pool = PagePool(6, 3, 5)
    d = pool.allocate(Tier.DEVICE, 4)
    pool.free(Tier.DEVICE, [d[1]])
    pool.incref(Tier.DEVICE, d[2])
    pool.register_prefix(Tier.DEVICE, 2 ** 62 + 5, d[2])
    pool.allocate(Tier.INDEX, 2)
    h = pool.allocate(Tier.HOST, 5)
    pool.free(Tier.HOST, [h[0], h[3]])
    pool.register_prefix(Tier.HOST, 99, h[4])
    snap = pool_state(pool)
    restored = restore_pool(json.loads(json.dumps(snap)))
    assert pool_state(restored) == snap
    assert restored.stats() == pool.stats()
    check_pool(restored)
    # future allocations agree
    for t, n in [(Tier.DEVICE, 2), (Tier.HOST, 2), (Tier.INDEX, 1)]:
        assert restored.allocate(t, n) == pool.allocate(t, n)
    assert pool_state(restored) == pool_state(pool)
    # malformed states are refused
    bad = json.loads(json.dumps(snap))
    bad["tiers"]["device"]["prefix"].append([1, 1])     # page 1 is free
    with pytest.raises(PoolError):
        restore_pool(bad)
    with pytest.raises(PoolError, match="version"):
        restore_pool({**snap, "version": 99})
    with pytest.raises(PoolError, match="not a PagePool state"):
        restore_pool({"tiers": {}})
    for tier, key, entry, match in [("device", "used", [0, 1], "distinct pages"),  # page 0 is listed already
                                    ("host", "cached", 2, "cached pages must be"),  # page 2 is in use
                                    ("device", "cached", 1, "cached pages must be"),  # free, but not registered
                                    ("index", "used", [3, 1], "out of range"),  # the index budget is 3
                                    ("device", "prefix", [2 ** 62 + 5, 3], "repeated prefix"),
                                    ("host", "used", [True, 1], "bad pool state")]:
        bad = json.loads(json.dumps(snap))
        bad["tiers"][tier][key].append(entry)
        with pytest.raises(PoolError, match=match):
            restore_pool(bad)
    cached = copy.deepcopy(snap)
    cached["tiers"]["device"]["cached"], cached["tiers"]["device"]["prefix"] = [1], [[7, 1], [2 ** 62 + 5, 2]]
    assert pool_state(restore_pool({**cached, "retain_prefix": True}))["tiers"]["device"]["cached"] == [1]
    with pytest.raises(PoolError, match="retain_prefix is off"):
        restore_pool(cached)


def test_invariants_detect_owner_mismatches():
    pool = PagePool(8, 4, 4)
    a = pool.allocate(Tier.DEVICE, 2)
    b = pool.allocate(Tier.DEVICE, 2)
    check_pool(pool, {Tier.DEVICE: [a, b]})
    check_pool(pool, {Tier.DEVICE: [a + [INVALID], [INVALID] + b]})  # INVALID entries are skipped
    check_pool(pool, {Tier.DEVICE: np.array([a, b], np.int32)})     # a block table as an array
    with pytest.raises(PoolError, match=r"page 3 has refcount 1 but only 0 owner reference\(s\) \(leaked\)"):
        check_pool(pool, {Tier.DEVICE: [a, b[:1]]})
    with pytest.raises(PoolError, match=r"page 1 is referenced 2 times but has refcount 1 \(double ownership\)"):
        check_pool(pool, {Tier.DEVICE: [a, b, [a[1]]]})
    with pytest.raises(PoolError, match="page 5 is referenced by 1 owner.* but is free"):
        check_pool(pool, {Tier.DEVICE: [a, b, [5]]})
    with pytest.raises(PoolError, match="out of range"):
        check_pool(pool, {Tier.DEVICE: [a, b, [8]]})
    with pytest.raises(PoolError, match="host pool disagrees"):
        check_pool(pool, {Tier.HOST: [[0]]})
    # tiers absent from owners are not owner-checked
    pool.allocate(Tier.INDEX, 1)
    check_pool(pool, {Tier.DEVICE: [a, b]})


def test_invariants_detect_internal_corruption():
    pool = PagePool(4, 1, 1)
    pool.allocate(Tier.DEVICE, 3)
    pool.free(Tier.DEVICE, [0])
    s = pool._t[Tier.DEVICE]
    s.returned.append(0)
    with pytest.raises(PoolError, match="more than once"):
        check_pool(pool)
    s.returned.pop()
    s.refcount[1] = 0                       # page 1 free by refcount but not in the free list
    with pytest.raises(PoolError, match="page 1 has refcount 0 but is not in the free list"):
        check_pool(pool)
    s.refcount[1] = 1
    s.refcount[0] = 2                       # in the free list with a refcount
    with pytest.raises(PoolError, match="page 0 is in the free list but has refcount 2"):
        check_pool(pool)
    s.refcount[0] = 0
    s.used += 1
    with pytest.raises(PoolError, match="used 2 .counter 3."):
        check_pool(pool)
    s.used -= 1
    check_pool(pool)


def test_request_pages():
    pool = PagePool(8, 8, 8)
    r = RequestPages()
    for i in range(3):
        r.append(index=pool.allocate(Tier.INDEX, 1)[0], device=pool.allocate(Tier.DEVICE, 1)[0])
    # offload logical page 1 to the host
    r.host[1] = pool.allocate(Tier.HOST, 1)[0]
    pool.free(Tier.DEVICE, [r.device[1]])
    r.device[1] = INVALID
    r.hot = pool.allocate(Tier.DEVICE, 2)
    r.validate()
    assert r.num_pages == 3
    assert r.resident_pages() == [0, 2] and r.host_only_pages() == [1]
    assert r.owned(Tier.DEVICE) == [0, 2, 1, 3] and r.owned(Tier.HOST) == [0] and r.owned(Tier.INDEX) == [0, 1, 2]
    check_pool(pool, owners_of([r]))
    with pytest.raises(PoolError, match="no indexer page"):
        r.append(index=INVALID, device=5)
    with pytest.raises(PoolError, match="neither a device nor a host"):
        r.append(index=5)
    assert r.num_pages == 3                 # failed appends are rolled back
    with pytest.raises(PoolError, match="differ in length"):
        RequestPages(device=[0], host=[], index=[0])
    r.release(pool)
    assert r.num_pages == 0 and r.hot == []
    assert all(pool.num_used(t) == 0 for t in Tier)
    check_pool(pool, owners_of([r]))


# ----------------------------------------------------------------------------------- property tests
TIERS = list(Tier)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / share / free / prefix traffic (with and without retention of freed prefix pages)
    against a plain-dict model of the pool."""

    @initialize(dev=st.integers(1, 8), idx=st.integers(1, 6), host=st.integers(0, 6), retain=st.booleans())
    def setup(self, dev, idx, host, retain):
        self.pool = PagePool(dev, idx, host, retain_prefix=retain)
        self.retain = retain
        self.owners: list[tuple[Tier, list[int]]] = []       # every live owner: (tier, its pages)
        self.registered: dict[Tier, dict[int, int]] = {t: {} for t in TIERS}   # model: hash -> page
        self.cached: dict[Tier, list[int]] = {t: [] for t in TIERS}            # model: reclaim order

    def model_refcounts(self, tier):
        return collections.Counter(p for t, pages in self.owners if t is tier for p in pages)

    def unregister(self, tier, p):
        self.registered[tier] = {h: q for h, q in self.registered[tier].items() if q != p}

    @rule(tier=st.sampled_from(TIERS), n=st.integers(0, 5))
    def allocate(self, tier, n):
        rc = self.model_refcounts(tier)
        cached = self.cached[tier]
        free = [p for p in range(self.pool.budget(tier)) if rc[p] == 0 and p not in cached]
        if n > len(free) + len(cached):
            before = pool_state(self.pool)
            with pytest.raises(OutOfPages):
                self.pool.allocate(tier, n)
            assert pool_state(self.pool) == before
        else:
            pages = self.pool.allocate(tier, n)
            reclaimed = cached[:max(0, n - len(free))]
            assert pages == free[:n] + reclaimed     # lowest free first, then cached ones, least recently freed first
            for p in reclaimed:
                cached.remove(p)
                self.unregister(tier, p)
            self.owners.append((tier, pages))

    @precondition(lambda self: any(pages for _, pages in self.owners))
    @rule(data=st.data())
    def share(self, data):
        """A new owner increfs some pages of an existing owner (prefix sharing)."""
        tier, pages = data.draw(st.sampled_from([o for o in self.owners if o[1]]))
        sub = data.draw(st.lists(st.sampled_from(pages), min_size=1, max_size=3, unique=True))
        for p in sub:
            self.pool.incref(tier, p)
        self.owners.append((tier, sub))

    @precondition(lambda self: any(self.cached.values()))
    @rule(data=st.data())
    def revive(self, data):
        """A lookup finds a cached free page and takes it back with its registration."""
        tier = data.draw(st.sampled_from([t for t in TIERS if self.cached[t]]))
        p = data.draw(st.sampled_from(self.cached[tier]))
        h = next(h for h, q in self.registered[tier].items() if q == p)
        assert self.pool.lookup_prefix(tier, h) == p
        self.pool.incref(tier, p)
        self.cached[tier].remove(p)
        self.owners.append((tier, [p]))

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def release(self, data):
        i = data.draw(st.integers(0, len(self.owners) - 1))
        tier, pages = self.owners.pop(i)
        self.pool.free(tier, pages)
        rc = self.model_refcounts(tier)
        for p in dict.fromkeys(pages):
            if rc[p] == 0:
                with pytest.raises(PoolError, match="double free"):
                    self.pool.decref(tier, p)
                if self.retain and p in self.registered[tier].values():
                    self.cached[tier].append(p)
                else:
                    self.unregister(tier, p)

    @precondition(lambda self: any(pages for _, pages in self.owners))
    @rule(data=st.data(), h=st.integers(0, 3))
    def register(self, data, h):
        tier, pages = data.draw(st.sampled_from([o for o in self.owners if o[1]]))
        p = data.draw(st.sampled_from(pages))
        reg = self.registered[tier]
        if any(q == p and g != h for g, q in reg.items()):
            with pytest.raises(PoolError, match="already registered"):
                self.pool.register_prefix(tier, h, p)
        else:
            self.pool.register_prefix(tier, h, p)
            old = reg.get(h)
            if old is not None and old != p and old in self.cached[tier]:
                self.cached[tier].remove(old)   # a cached page that loses its hash is plainly free
            reg[h] = p

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        check_pool(self.pool, {t: [pages for u, pages in self.owners if u is t] for t in TIERS})
        for t in TIERS:
            rc = self.model_refcounts(t)
            assert self.pool.num_used(t) == len(rc)
            assert self.pool.num_used(t) + self.pool.num_free(t) == self.pool.budget(t)
            assert self.pool.num_cached(t) == len(self.cached[t])
            for h in range(4):
                assert self.pool.lookup_prefix(t, h) == self.registered[t].get(h)

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        snap = pool_state(self.pool)
        restored = restore_pool(json.loads(json.dumps(snap)))
        assert pool_state(restored) == snap
        for t in TIERS:  # the restored pool hands out the same pages in the same order
            n = self.pool.num_free(t)
            assert restored.allocate(t, n) == copy.deepcopy(self.pool).allocate(t, n)
        for tier, pages in self.owners:
            self.pool.free(tier, pages)
        check_pool(self.pool, {t: [] for t in TIERS})
        self.pool.set_retain_prefix(False)  # drops the cached pages for good
        check_pool(self.pool, {t: [] for t in TIERS})
        for t in TIERS:
            assert self.pool.num_used(t) == 0 and self.pool.num_free(t) == self.pool.budget(t)
            assert self.pool.stats()[t.value]["prefix"] == 0
            assert self.pool.allocate(t, self.pool.budget(t)) == list(range(self.pool.budget(t)))


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@settings(max_examples=100, deadline=None)
@given(cap=st.integers(1, 16), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_alloc_free_sequence_returns_to_empty(cap, ops):
    """Allocate / free interleavings: used count tracks the model and freeing everything empties the pool."""
    pool = PagePool(cap, 1, 0)
    live: list[list[int]] = []
    for alloc, n in ops:
        if alloc:
            if pool.can_allocate(Tier.DEVICE, n):
                live.append(pool.allocate(Tier.DEVICE, n))
            else:
                with pytest.raises(OutOfPages):
                    pool.allocate(Tier.DEVICE, n)
        elif live:
            pool.free(Tier.DEVICE, live.pop(n % len(live)))
        assert pool.num_used(Tier.DEVICE) == sum(map(len, live))
        check_pool(pool, {Tier.DEVICE: live})
    for pages in live:
        pool.free(Tier.DEVICE, pages)
    assert pool.num_used(Tier.DEVICE) == 0
    assert pool.allocate(Tier.DEVICE, cap) == list(range(cap))
