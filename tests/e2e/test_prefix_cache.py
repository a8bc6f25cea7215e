"""Prefix caching: full pages keyed by their token hash chain are shared across requests with refcounts on the
indexer, device and host tiers; the allocator stays consistent under random admissions, appends, releases,
swaps and aborts with shared pages; rows read through shared pages are the right ones; tokens never change."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from store_pair import StorePair
from hisparse_jax.kv.audit import check_manager
from hisparse_jax.kv.persist import pool_state
from hisparse_jax.kv.pool import OutOfPages, PoolError, Tier, page_hash
from hisparse_jax.units import INVALID
from test_store import DI, LI, MODEL, C, L, R, cache_config

P = 64


def rows_for(tokens, start, end):
    """Deterministic rows of positions start..end-1 (a function of the token and its position, so requests with
    the same prefix have the same rows there): latent [L, T, C], rope [L, T, R], index_k [LI, T, DI]."""
    t = np.asarray(tokens[start:end], np.float32)[None, :, None]
    p = np.arange(start, end, dtype=np.float32)[None, :, None]
    lay = np.arange(L, dtype=np.float32)[:, None, None]
    lat = np.sin(0.37 * t + 0.011 * p + 0.5 * lay + np.arange(C, dtype=np.float32))
    rope = np.cos(0.21 * t - 0.013 * p + 0.7 * lay + np.arange(R, dtype=np.float32))
    idx = np.sin(0.5 * t + 0.003 * p + np.arange(DI, dtype=np.float32))[:1].repeat(LI, 0)
    return lat.astype(np.float32), rope.astype(np.float32), idx.astype(np.float32)


def prefill(tc, tokens, **kw):
    """Admit `tokens` with prefix sharing and write the rows that were not shared; register its pages. The rows are
    padded to the store's longest request with NaN, as the engine pads a prompt: every length writes through one
    compiled program."""
    slot = tc.admit(len(tokens), tokens=tokens, **kw)
    start = tc.cached_tokens[slot]
    rows = max(len(tokens), tc.spec.max_pages * 64)
    lat, rope, idx = (np.full((a.shape[0], rows, a.shape[2]), np.nan, np.float32) for a in rows_for(tokens, 0, 1))
    end = len(tokens)  # (the shared prefix's rows, never written, stay NaN too)
    lat[:, start:end], rope[:, start:end], idx[:, start:end] = rows_for(tokens, start, end)
    tc.write_prefill(slot, jnp.asarray(lat), jnp.asarray(rope), jnp.asarray(idx), end, start=start)
    tc.register_prefix(slot, tokens)
    return slot


def check_rows(tc, slot, tokens, positions):
    """Rows gathered through the store (resident, shared, hot or fetched from host) equal rows_for()."""
    for i in range(0, len(positions), 8):
        chunk = list(positions[i:i + 8])
        topk = np.full((1, 8), -1, np.int32)
        topk[0, :len(chunk)] = chunk
        lat, rope, _, _ = tc.gather([slot], topk)
        for k, p in enumerate(chunk):
            want_lat, want_rope, _ = rows_for(tokens, p, p + 1)
            np.testing.assert_array_equal(np.asarray(lat)[:, 0, k], want_lat[:, 0])
            np.testing.assert_array_equal(np.asarray(rope)[:, 0, k], want_rope[:, 0])


def check_sharing(tc, live):
    """Two requests hold the same indexer / KV page at logical page i only if their first (i+1)*64 tokens agree."""
    owners = {}
    for s, toks in live.items():
        r = tc.requests[s]
        for tier, pages in ((Tier.INDEX, r.index), (Tier.DEVICE, r.device), (Tier.HOST, r.host)):
            for i, pg in enumerate(pages):
                if pg != INVALID:
                    owners.setdefault((tier, pg), []).append((i, tuple(toks[:(i + 1) * P])))
    for (tier, pg), holders in owners.items():
        assert len(set(holders)) == 1, f"{tier.value} page {pg} shared by different prefixes / page indices"


def assert_all_free(pool):
    """Nothing in use; the only registrations left are on cached free pages (kept for later requests)."""
    for t in Tier:
        st = pool.stats()[t.value]
        assert st["used"] == 0 and st["prefix"] == st["cached"], (t, st)


DOC = np.random.default_rng(7).integers(0, 64, 512).tolist()


def test_shared_pages_refcounts_release_and_registration_lifetime():
    tc = StorePair(MODEL, cache_config(max_seqs=3))
    tc.prefix_caching = True
    a_toks = DOC[:200]
    a = prefill(tc, a_toks)
    assert tc.cached_tokens[a] == 0
    assert tc.pool.stats()["index"]["prefix"] == 3 and tc.pool.stats()["device"]["prefix"] == 3  # full pages
    b_toks = DOC[:150] + [1, 2, 3]
    b = prefill(tc, b_toks)
    assert tc.cached_tokens[b] == 128  # pages 0, 1 are shared; page 2 differs
    ra, rb = tc.requests[a], tc.requests[b]
    for tier, la, lb in ((Tier.INDEX, ra.index, rb.index), (Tier.DEVICE, ra.device, rb.device),
                         (Tier.HOST, ra.host, rb.host)):
        assert la[:2] == lb[:2] and la[2] != lb[2]
        assert [tc.pool.refcount(tier, p) for p in la[:3]] == [2, 2, 1]
    assert tc.h2d_bytes == 0  # shared in place: nothing copied
    check_manager(tc)
    check_rows(tc, b, b_toks, range(len(b_toks)))
    # the last token's page is never shared, even when all of it is cached: its logits must be computed
    c_toks = DOC[:128]
    c = prefill(tc, c_toks)
    assert tc.cached_tokens[c] == 64
    tc.release(c)
    # a release drops only that request's references
    shared, ra_device = ra.device[:2], list(ra.device)
    tc.release(a)
    check_manager(tc)
    assert [tc.pool.refcount(Tier.DEVICE, p) for p in shared] == [1, 1]
    assert tc.pool.lookup_prefix(Tier.DEVICE, page_hash(None, DOC[:64])) == shared[0]
    check_rows(tc, b, b_toks, range(len(b_toks)))
    tc.release(b)
    check_manager(tc)
    assert_all_free(tc.pool)
    # a's three full pages stay cached on every tier: a later request revives them, copying nothing
    assert tc.pool.num_cached(Tier.DEVICE) == tc.pool.num_cached(Tier.HOST) == tc.pool.num_cached(Tier.INDEX) == 3
    d = prefill(tc, DOC[:250])
    assert tc.cached_tokens[d] == 192 and tc.requests[d].device[:3] == ra_device[:3] and tc.h2d_bytes == 0
    check_rows(tc, d, DOC[:250], range(0, 250, 3))
    check_manager(tc)
    tc.release(d)
    tc.prefix_caching = False  # switching it off frees the cached pages for good
    check_manager(tc)
    assert all(v["prefix"] == v["cached"] == 0 for v in tc.pool.stats().values())


def test_prefix_caching_off_shares_nothing_and_different_prefix_misses():
    tc = StorePair(MODEL, cache_config(max_seqs=4))
    prefill(tc, DOC[:200])
    assert tc.pool.stats()["device"]["prefix"] == 0  # off: nothing registered
    tc.prefix_caching = True
    b = prefill(tc, DOC[:200])
    assert tc.cached_tokens[b] == 0
    other = [DOC[0] + 1] + DOC[1:200]  # first token differs: the whole chain differs
    c = prefill(tc, other)
    assert tc.cached_tokens[c] == 0
    d = prefill(tc, DOC[:64] + [5] + DOC[65:200])  # second page differs
    assert tc.cached_tokens[d] == 64
    check_manager(tc)


def test_admit_prefilled_registers_pages_for_later_requests():
    tc = StorePair(MODEL, cache_config(max_seqs=2))
    tc.prefix_caching = True
    a = tc.admit_prefilled(*(jnp.asarray(x) for x in rows_for(DOC, 0, 200)), 200, tokens=DOC[:200])
    b = prefill(tc, DOC[:200])
    assert tc.cached_tokens[b] == 192 and tc.requests[b].device[:3] == tc.requests[a].device[:3]
    check_rows(tc, b, DOC[:200], range(0, 200, 7))
    check_manager(tc)


def test_host_only_prefix_page_is_loaded_and_shared_pages_are_not_release_candidates():
    tc = StorePair(MODEL, cache_config(max_seqs=3, device_pages=40))
    tc.prefix_caching = True
    a_toks = DOC[:300]
    a = prefill(tc, a_toks)
    tc._ensure_hot(a)
    released = tc.requests[a].device[:2]
    tc.evict(a, [0, 1])  # a's first two pages now live only on the host; their device pages stay cached
    h0 = page_hash(None, DOC[:64])
    assert tc.pool.num_cached(Tier.DEVICE) == 2 and tc.pool.lookup_prefix(Tier.DEVICE, h0) == released[0]
    # pressure reclaims the cached device pages, and their device registrations with them
    grab = tc.pool.allocate(Tier.DEVICE, tc.pool.num_free(Tier.DEVICE))
    tc.pool.free(Tier.DEVICE, grab)
    assert tc.pool.lookup_prefix(Tier.DEVICE, h0) is None and tc.pool.num_cached(Tier.DEVICE) == 0
    h2d = tc.h2d_bytes
    b_toks = DOC[:260] + [9]
    b = prefill(tc, b_toks)
    ra, rb = tc.requests[a], tc.requests[b]
    assert tc.cached_tokens[b] == 256
    assert rb.device[:2] != [INVALID, INVALID] and all(d != INVALID for d in rb.device)  # loaded: resident
    assert rb.host[:4] == ra.host[:4] and rb.index[:4] == ra.index[:4]
    assert rb.device[2:4] == ra.device[2:4]
    assert tc.h2d_bytes - h2d == 2 * P * L * (C + R) * 4  # two whole pages, every layer
    # the loaded pages are registered on the device now: a third request shares them without a copy
    c = prefill(tc, DOC[:200])
    assert tc.requests[c].device[:2] == rb.device[:2] and tc.h2d_bytes - h2d == 2 * P * L * (C + R) * 4
    check_manager(tc)
    check_rows(tc, b, b_toks, [0, 1, 63, 64, 127, 128, 200, 255, 256, 260])
    check_rows(tc, a, a_toks, [0, 64, 130, 299])  # a reads its evicted pages from host through its hot buffer
    # pages shared by several requests are not release candidates; a's own ones (4 = the last full page) are
    assert 2 not in tc.evictable_pages(a) and 3 not in tc.evictable_pages(b)
    tc.release(c)
    # an explicit release of a shared page drops only that request's reference
    tc._ensure_hot(b)
    page = rb.device[2]
    tc.evict(b, [2])
    assert rb.device[2] == INVALID and ra.device[2] == page and tc.pool.refcount(Tier.DEVICE, page) == 1
    assert 2 in tc.evictable_pages(a)  # a is its last holder: an ordinary cold page again
    check_manager(tc)
    check_rows(tc, b, b_toks, [128, 129, 190])
    for s in (a, b):
        tc.release(s)
    assert_all_free(tc.pool)


def test_pressure_releases_shared_pages_from_every_holder():
    """Once no request has a cold page of its own left, a shared page is released from all its holders at once
    (each gets a hot buffer first): the page is freed, stays cached, and both read it back through the host."""
    tc = StorePair(MODEL, cache_config(max_seqs=3, device_pages=24))
    tc.prefix_caching = True
    a_toks, b_toks = DOC[:300], DOC[:290] + [4]
    a, b = prefill(tc, a_toks), prefill(tc, b_toks)
    ra, rb = tc.requests[a], tc.requests[b]
    assert ra.device[:4] == rb.device[:4] and tc.evictable_pages(a) == tc.evictable_pages(b) == []
    tc.keep_resident(b)  # a holder that must stay resident blocks the release
    assert tc.evictable_shared_pages() == []
    tc.allow_eviction(b)
    assert [d for d, _ in tc.evictable_shared_pages()] == ra.device[:3]  # page 3 is a tail page of both
    shared, free0 = ra.device[:3], tc.pool.num_free(Tier.DEVICE)
    tc.evict_until(free0 + 1)
    assert ra.hot and rb.hot and tc.pool.num_free(Tier.DEVICE) >= free0 + 1
    released = [d for d in shared if d not in ra.device]
    assert released and all(d not in rb.device for d in released)
    assert all(tc.pool.refcount(Tier.DEVICE, d) == 0 for d in released) and tc.pool.num_cached(Tier.DEVICE) >= 1
    check_manager(tc)
    check_rows(tc, a, a_toks, range(0, 300, 9))
    check_rows(tc, b, b_toks, range(0, 291, 9))


def test_swap_in_reshares_resident_prefix_pages():
    tc = StorePair(MODEL, cache_config(max_seqs=2))
    tc.prefix_caching = True
    a = prefill(tc, DOC[:300])
    b_toks = DOC[:280] + [3]
    b = prefill(tc, b_toks)
    shared = tc.requests[b].device[:4]
    tc.swap_out(b)
    assert [tc.pool.refcount(Tier.DEVICE, d) for d in shared] == [1] * 4
    h2d = tc.h2d_bytes
    tc.swap_in(b)
    assert tc.requests[b].device[:4] == shared  # taken from a, not copied
    assert tc.h2d_bytes - h2d == 1 * P * L * (C + R) * 4  # only b's own page 4 came back from host
    check_manager(tc)
    check_rows(tc, b, b_toks, range(0, 281, 7))
    tc.release(a)
    tc.release(b)
    check_manager(tc)


def test_write_prefill_never_touches_shared_pages():
    tc = StorePair(MODEL, cache_config(max_seqs=2))
    tc.prefix_caching = True
    prefill(tc, DOC[:200])
    b = tc.admit(150, tokens=DOC[:150])
    lat, rope, idx = rows_for(DOC, 0, 150)
    with pytest.raises(PoolError, match="shared"):
        tc.write_prefill(b, jnp.asarray(lat), jnp.asarray(rope), jnp.asarray(idx), 150)


def test_save_restore_keeps_the_prefix_cache(tmp_path):
    from hisparse_jax.kv.persist import load_tiered, save_tiered

    tc = StorePair(MODEL, cache_config(max_seqs=3))
    tc.prefix_caching = True
    a = prefill(tc, DOC[:300])
    b = prefill(tc, DOC[:200] + [1])
    tc.release(a)  # a's page 3 is cached now; pages 0-2 are b's (shared)
    save_tiered(tc.manager, tc.sync(), tmp_path / "saved")
    tc2 = StorePair.of(*load_tiered(tmp_path / "saved"))
    assert tc2.prefix_caching and pool_state(tc2.pool) == pool_state(tc.pool)
    assert tc2.prefix_hashes == tc.prefix_hashes and tc2.cached_tokens == tc.cached_tokens
    c = prefill(tc2, DOC[:300])
    assert tc2.cached_tokens[c] == 256 and tc2.h2d_bytes == 0
    check_rows(tc2, c, DOC[:300], range(0, 300, 5))
    check_rows(tc2, b, DOC[:200] + [1], range(0, 201, 5))
    check_manager(tc2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_allocator_invariants_under_random_operations_with_shared_prefixes(seed):
    """Random admissions (prompts drawn from three documents, so prefixes collide), appends, releases of cold
    pages (shared or not), swaps, aborts and reads: invariants and the sharing rule hold after every operation,
    rows read back are exact, and everything is freed (registrations included) at the end."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 64, 400).tolist() for _ in range(3)]
    tc = StorePair(MODEL, cache_config(max_seqs=4, device_pages=30, host_pages=48, max_seq_len=448))
    tc.prefix_caching = True
    live: dict[int, list[int]] = {}
    swapped: set[int] = set()
    shared_seen = 0
    for _ in range(60):
        op = rng.choice(["admit", "admit", "append", "evict", "swap", "read", "release"])
        if op == "admit" and tc.free_slots():
            d = docs[rng.integers(3)]
            toks = d[:int(rng.integers(1, 320))] + rng.integers(0, 64, int(rng.integers(0, 40))).tolist()
            if rng.random() < 0.7:  # mostly long shared prefixes
                toks = d[:int(rng.integers(130, 330))] + toks[-3:]
            try:
                s = prefill(tc, toks)
            except (OutOfPages, PoolError):
                continue
            shared_seen += tc.cached_tokens[s] > 0
            live[s] = toks
        elif op == "append" and live.keys() - swapped:
            s = int(rng.choice(sorted(live.keys() - swapped)))
            for _ in range(int(rng.integers(1, 5))):
                tok = int(rng.integers(0, 64))
                live[s].append(tok)
                lat, rope, idx = rows_for(live[s], len(live[s]) - 1, len(live[s]))
                try:
                    tc.append([s], jnp.asarray(lat), jnp.asarray(rope), jnp.asarray(idx))
                except OutOfPages:
                    live[s].pop()
                    break
        elif op == "evict" and live.keys() - swapped:
            s = int(rng.choice(sorted(live.keys() - swapped)))
            r = tc.requests[s]
            cand = [i for i in range(max(r.num_pages - 2, 0)) if r.device[i] != INVALID and r.host[i] != INVALID]
            if cand and (r.hot or tc.pool.num_free(Tier.DEVICE) >= tc.budget_spec.hot_pages):
                tc._ensure_hot(s)
                k = int(rng.integers(1, len(cand) + 1))
                tc.evict(s, sorted(rng.choice(cand, k, replace=False).tolist()))  # shared ones included
        elif op == "swap" and live:
            s = int(rng.choice(sorted(live)))
            if s in swapped:
                try:
                    tc.swap_in(s)
                    swapped.discard(s)
                except OutOfPages:
                    pass
            else:
                tc.swap_out(s)
                swapped.add(s)
        elif op == "read" and live.keys() - swapped:
            s = int(rng.choice(sorted(live.keys() - swapped)))
            if tc.requests[s].hot or not tc.requests[s].host_only_pages():
                n = len(live[s])
                check_rows(tc, s, live[s], sorted(set(rng.integers(0, n, min(n, 8)).tolist())))
        elif op == "release" and live:
            s = int(rng.choice(sorted(live)))
            tc.release(s)  # finished or aborted, mid-way or not
            live.pop(s)
            swapped.discard(s)
        check_manager(tc)
        check_sharing(tc, live)
    assert shared_seen > 0
    for s in list(live):
        tc.release(s)
    check_manager(tc)
    assert_all_free(tc.pool)


# ----- the engine ------------------------------------------------------------------------------------------
ENGINE_NEW = 10


@pytest.fixture(scope="module")
def engine_model():
    from flax import nnx

    import hisparse_jax as hj
    from tiny import model_cfg

    return hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def shared_prompts():
    """A 300-token shared system prompt (4 full pages + a partial one) and different questions."""
    rng = np.random.default_rng(3)
    system = rng.integers(0, 97, 300).tolist()
    return [system + rng.integers(0, 97, n).tolist() for n in (40, 120, 7, 200)]


@pytest.fixture(scope="module")
def shared_refs(engine_model, shared_prompts):
    from hisparse_jax.generate import generate

    return generate(engine_model, shared_prompts, ENGINE_NEW)  # batched: one compile (== one by one: test_parity)


def run_engine(model, prompts, policy, prefill="chunked", prefix_caching=True, stagger=True):
    from hisparse_jax.engine import Engine, EngineConfig, SamplingParams
    from test_engine import cache_for

    eng = Engine(model, cache_for(policy, model), EngineConfig(policy=policy, max_running=4, prefill_chunk=128,
                                                                prefill=prefill, prefix_caching=prefix_caching,
                                                                check_invariants=True))
    params = SamplingParams(max_new_tokens=ENGINE_NEW)
    eng.add_request("r0", prompts[0], params)
    if stagger:  # the first prompt is prefilled (and its pages registered) before the others arrive
        while not eng.requests["r0"].output:
            eng.step()
    for i, p in enumerate(prompts[1:], 1):
        eng.add_request(f"r{i}", p, params)
    eng.run()
    return [eng.requests[f"r{i}"].output for i in range(len(prompts))], eng


@pytest.mark.parametrize("policy,prefill", [("preempt", "chunked"), ("offload", "chunked"), ("hisparse", "chunked"),
                                            ("offload", "whole"), ("hisparse", "whole")])
@pytest.mark.slow
def test_engine_prefix_hits_keep_tokens_and_skip_prefill(engine_model, shared_prompts, shared_refs, policy,
                                                         prefill):
    out, eng = run_engine(engine_model, shared_prompts, policy, prefill)
    assert out == shared_refs  # equal to unconstrained generate: sharing never changes tokens
    m = eng.metrics()
    assert m.cached_tokens >= 256 * 2 and m.cached_tokens % 64 == 0
    assert all(eng.requests[f"r{i}"].cached_tokens >= 256 for i in (1, 2, 3) if eng.requests[f"r{i}"].preemptions
               == 0)
    total_prompt = sum(len(p) for p in shared_prompts)
    assert m.prefill_tokens + m.cached_tokens >= total_prompt
    assert m.prefix_hit_rate == m.cached_tokens / (m.cached_tokens + m.prefill_tokens)
    assert_all_free(eng.manager.pool)


@pytest.mark.slow
def test_engine_without_prefix_caching_computes_everything(engine_model, shared_prompts, shared_refs):
    out, eng = run_engine(engine_model, shared_prompts, "hisparse", prefix_caching=False)
    assert out == shared_refs
    m = eng.metrics()
    assert m.cached_tokens == 0 and m.prefill_tokens == sum(len(p) for p in shared_prompts)


@pytest.mark.slow
def test_engine_aborts_with_prefix_shared_pages(engine_model, shared_prompts, shared_refs):
    """Abort the request that registered the prefix mid-decode while another prefills on its pages, then abort
    that one mid-prefill: invariants hold after every step, the survivors' tokens are unchanged, nothing leaks."""
    from hisparse_jax.engine import Engine, EngineConfig, RequestState, SamplingParams
    from test_engine import cache_for

    eng = Engine(engine_model, cache_for("hisparse", engine_model),
                 EngineConfig(policy="hisparse", max_running=4, prefill_chunk=32, check_invariants=True))
    params = SamplingParams(max_new_tokens=ENGINE_NEW)
    eng.add_request("r0", shared_prompts[0], params)
    while not eng.requests["r0"].output:
        eng.step()
    for i in (1, 3):
        eng.add_request(f"r{i}", shared_prompts[i], params)
    eng.step()
    r1 = eng.requests["r1"]
    assert r1.state is RequestState.PREFILLING and r1.cached_tokens == 256
    shared = eng.manager.requests[r1.slot].device[:4]
    assert all(eng.manager.pool.refcount(Tier.DEVICE, d) == 2 for d in shared)
    eng.abort("r0")  # the prefix's first owner, mid-decode: r1 keeps the pages
    check_manager(eng.manager)
    assert all(eng.manager.pool.refcount(Tier.DEVICE, d) == 1 for d in shared)
    eng.step()
    assert r1.state is RequestState.PREFILLING
    eng.abort("r1")  # mid-prefill, on pages it shares with nobody now
    eng.run()
    assert eng.requests["r3"].output == shared_refs[3]
    assert_all_free(eng.manager.pool)


@pytest.mark.slow
def test_engine_hisparse_pressure_with_shared_prefix(engine_model, shared_prompts):
    """A device pool too small for the decoding requests: HiSparse releases cold pages it holds alone (shared
    prefix pages stay resident), fetches misses from host, and the tokens still equal unconstrained generate."""
    from hisparse_jax.config import CacheConfig
    from hisparse_jax.engine import Engine, EngineConfig, SamplingParams
    from hisparse_jax.generate import generate

    new = 100
    refs = generate(engine_model, shared_prompts, new)  # batched: one compile
    cc = CacheConfig(kv_dtype="float32", device_pages=11, index_pages=40, host_pages=64, max_seq_len=704)
    eng = Engine(engine_model, cc, EngineConfig(policy="hisparse", max_running=4, prefill_chunk=128,
                                                check_invariants=True))
    params = SamplingParams(max_new_tokens=new)
    eng.add_request("r0", shared_prompts[0], params)
    while not eng.requests["r0"].output:
        eng.step()
    for i, p in enumerate(shared_prompts[1:], 1):
        eng.add_request(f"r{i}", p, params)
    eng.run()
    assert [eng.requests[f"r{i}"].output for i in range(4)] == refs
    m = eng.metrics()
    assert m.cached_tokens > 0 and m.evicted_pages > 0 and m.misses > 0 and m.preemptions == 0
    assert m.max_running >= 2
    assert_all_free(eng.manager.pool)
