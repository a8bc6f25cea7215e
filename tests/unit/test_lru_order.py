"""The hot buffer's LRU rule: hot_stamp records the step that last touched each slot (2 * clock when a miss
claimed it, 2 * clock + 1 when a hit touched it, -1 never); the order is (stamp, slot), least recent first. A
step's victims are the m least recent slots it did not hit (m = its misses), claimed by the misses in slot
order; only the touched slots are written. So after a step the order is [untouched, previous order | claimed,
slot order | hit, slot order]: vLLM / SGLang's groups.

1. A hand-worked 6-step sequence (one request, HR = 6, K = 4): every miss's slot, the tags and the stamps
   after every step written down by hand, run through the jnp reference and the Pallas kernel (interpret mode).
2. Random multi-step trajectories against a plain list model of the order.
3. The kernel's ways to find the m-th least recent slot (one window pass ending at this step's stamps, which
   also counts never-used slots; extreme values then exact radix passes for older or newer thresholds; a
   threshold equal to a pass's base) each agree with the reference and with the list model.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.sparse_gather import sparse_gather, sparse_gather_reference
from pallas_kernels.sparse_gather.kernel import SELECT_BUCKETS

RESOLVERS = {"reference": lambda *a, **k: sparse_gather_reference(*a, **k),
             "pallas_interpret": lambda *a, **k: sparse_gather(*a, interpret=True, **k)}

HR, K = 6, 4
HOT_PAGE = 3
HOST = (5, 7)  # host pages of positions 0..63 and 64..127; nothing is resident
CLOCK0 = 1000  # step s runs at clock CLOCK0 + s

# (top-k, {position: slot it is read from}, positions that miss, tags after, stamps after). Initial state: empty
# buffer, stamps -1 -> order [0, 1, 2, 3, 4, 5]. Step s: clock 1000 + s, claimed slots stamped 2000 + 2s, hit
# slots 2001 + 2s.
STEPS = [
    # 1. four misses: the victims are the four least recent slots 0..3 (all -1, slot order), claimed in slot order.
    ([40, 10, 30, 20], {40: 0, 10: 1, 30: 2, 20: 3}, {40, 10, 30, 20},
     [40, 10, 30, 20, -1, -1], [2002, 2002, 2002, 2002, -1, -1]),
    # 2. 30 (slot 2) and 40 (slot 0) hit; 50, 60 take the never-used slots 4, 5. Order: untouched [1, 3] |
    #    claimed [4, 5] | hit [0, 2].
    ([30, 50, 40, 60], {30: 2, 50: 4, 40: 0, 60: 5}, {50, 60},
     [40, 10, 30, 20, 50, 60], [2005, 2002, 2005, 2002, 2004, 2004]),
    # 3. 10 hits slot 1. Untouched, least recent first: [3 (2002), 4, 5 (claimed in step 2), 0, 2 (hit in step
    #    2)]: the victims are 3 and 4: 70 -> slot 3 (evicts 20), 80 -> slot 4 (evicts 50).
    ([70, 10, 80, -1], {70: 3, 10: 1, 80: 4}, {70, 80},
     [40, 10, 30, 70, 80, 60], [2005, 2007, 2005, 2006, 2006, 2004]),
    # 4. 30 (slot 2) and 40 (slot 0) hit; untouched [5 (2004), 3, 4 (2006), 1 (2007)]: the victims 5 and 3 are
    #    claimed in slot order: 90 -> slot 3, 100 -> slot 5.
    ([90, 100, 30, 40], {90: 3, 100: 5, 30: 2, 40: 0}, {90, 100},
     [40, 10, 30, 90, 80, 100], [2009, 2007, 2009, 2008, 2006, 2008]),
    # 5. 90 (slot 3), 80 (slot 4) and 10 (slot 1) hit; 120 claims the least recent untouched slot: 5 (2008,
    #    before the slots 0 and 2 hit in step 4), evicting 100.
    ([90, 80, 10, 120], {90: 3, 80: 4, 10: 1, 120: 5}, {120},
     [40, 10, 30, 90, 80, 120], [2009, 2011, 2009, 2011, 2011, 2010]),
    # 6. the same position twice (both hit slot 1, stamped once); padding elsewhere; no miss.
    ([10, -1, 10, -1], {10: 1}, set(),
     [40, 10, 30, 90, 80, 120], [2009, 2013, 2009, 2011, 2011, 2010]),
]


@pytest.mark.parametrize("resolver", list(RESOLVERS))
def test_hand_worked_sequence(resolver):
    fn = RESOLVERS[resolver]
    req, block_table = jnp.asarray([0], jnp.int32), jnp.asarray([[-1, -1]], jnp.int32)
    host_table, hot_pages = jnp.asarray([HOST], jnp.int32), jnp.asarray([[HOT_PAGE]], jnp.int32)
    tok = jnp.full((1, HR), -1, jnp.int32)
    stamp = jnp.full((1, HR), -1, jnp.int32)
    for step, (topk, slots, misses, tokens, stamps) in enumerate(STEPS, 1):
        out = fn(jnp.asarray([topk], jnp.int32), req, block_table, host_table, hot_pages, tok, stamp,
                 jnp.int32(CLOCK0 + step), hot_rows=HR)
        page, row, valid, resident, miss, src_page, src_row, tok, stamp = (np.asarray(x) for x in out)
        t = np.asarray(topk)
        live = t >= 0
        want_slot = np.array([slots.get(int(p), 0) for p in t])
        want_miss = np.array([int(p) in misses for p in t])
        msg = f"step {step}"
        np.testing.assert_array_equal(valid[0], live, err_msg=msg)
        assert not resident.any(), msg
        np.testing.assert_array_equal(row[0], np.where(live, want_slot, 0), err_msg=msg)
        np.testing.assert_array_equal(page[0], np.where(live, HOT_PAGE, 0), err_msg=msg)
        np.testing.assert_array_equal(miss[0], want_miss, err_msg=msg)
        np.testing.assert_array_equal(src_page[0], np.where(want_miss, np.where(t >= 64, HOST[1], HOST[0]), -1),
                                      err_msg=msg)
        np.testing.assert_array_equal(src_row[0], np.maximum(t, 0) % 64, err_msg=msg)
        np.testing.assert_array_equal(tok[0], tokens, err_msg=msg)
        np.testing.assert_array_equal(stamp[0], stamps, err_msg=msg)
        tok, stamp = jnp.asarray(tok), jnp.asarray(stamp)


# ----- random trajectories against a list model --------------------------------------------------------
def list_model_step(lru, tokens, topk):
    """One request's step on a list of its slots, least recent first -> (list after, tags after)."""
    slot_of = {}
    for s, t in enumerate(tokens):  # lowest slot holding a tag
        if t >= 0:
            slot_of.setdefault(int(t), s)
    misses = [int(t) for t in topk if t >= 0 and int(t) not in slot_of]
    hit_slots = {slot_of[int(t)] for t in topk if t >= 0 and int(t) in slot_of}
    untouched = [s for s in lru if s not in hit_slots]
    victims = sorted(untouched[:len(misses)])
    tokens = list(tokens)
    for t, s in zip(misses, victims):
        tokens[s] = t
    return untouched[len(misses):] + victims + sorted(hit_slots), tokens


def order_of(stamps):
    """Slots least recent first under the (max(stamp, -1), slot) order."""
    return list(np.lexsort((np.arange(len(stamps)), np.maximum(stamps, -1))))


@pytest.mark.parametrize("resolver", list(RESOLVERS))
def test_random_trajectories_follow_the_list_model(resolver):
    fn = RESOLVERS[resolver]
    rng = np.random.default_rng(0)
    B, Kr, HRr, MP, Rq = 4, 12, 20, 2, 4
    S = MP * 64
    req = np.array([2, -1, 0, 3], np.int32)  # an idle row; request 1 not scheduled, request 3 without a hot buffer
    block_table = np.full((Rq, MP), -1, np.int32)
    host_table = np.arange(Rq * MP, dtype=np.int32).reshape(Rq, MP)
    hot_pages = np.array([[0], [1], [2], [-1]], np.int32)
    tok = np.full((Rq, HRr), -1, np.int32)
    stamp = np.full((Rq, HRr), -1, np.int32)
    stamp[3] = rng.permutation(HRr)  # the request without a hot buffer must keep its stamps
    lru = {r: list(range(HRr)) for r in (0, 2)}
    pool = rng.choice(S, 30, replace=False)  # a small working set: many hits and evictions
    for step in range(12):
        topk = np.stack([rng.choice(pool, Kr, replace=b == 0) for b in range(B)]).astype(np.int32)  # row 0: repeats
        topk[rng.random((B, Kr)) < 0.1] = -1
        before, prev_tok = stamp.copy(), tok.copy()
        clock = 3 * step + 1  # gaps between steps change nothing
        out = fn(*(jnp.asarray(x) for x in (topk, req, block_table, host_table, hot_pages, tok, stamp)),
                 jnp.int32(clock), hot_rows=HRr)
        tok, stamp = np.asarray(out[7]), np.asarray(out[8])
        for b, r in enumerate(req):
            if r in lru:
                lru[r], want_tok = list_model_step(lru[r], prev_tok[r], topk[b])
                np.testing.assert_array_equal(tok[r], want_tok, err_msg=f"step {step} request {r}")
                assert order_of(stamp[r]) == lru[r], f"step {step} request {r}"
                changed = stamp[r] != before[r]
                assert np.isin(stamp[r][changed], (2 * clock, 2 * clock + 1)).all()  # only touched slots written
        np.testing.assert_array_equal(stamp[[1, 3]], before[[1, 3]])  # idle / no hot buffer: untouched


# ----- the kernel's ways to find the m-th least recent slot ---------------------------------------------
NB = SELECT_BUCKETS
CLOCK = 5000
NOW = 2 * CLOCK  # this step's stamp of a claimed slot; the window's NB exact keys end at NOW + 1


def _stamps(kind, rng, n):
    """n stamps whose m-th smallest lands where `kind` says."""
    if kind == "window":  # a steady buffer: every stamp within the last NB / 2 - 1 steps
        return rng.integers(NOW - NB + 2, NOW, n)
    if kind == "fresh":  # never used (-1, and foreign values below -1 that read as -1) and recent stamps
        return np.where(rng.random(n) < 0.8, rng.choice([-1, -5, -(2**31)], n), NOW - 1)
    if kind == "older":  # spread over a long past: several radix passes below the window
        return rng.integers(0, NOW - NB, n)
    if kind == "wide":  # 31-bit stamps up to the largest allowed, ties, a few foreign negatives (read as -1)
        s = rng.integers(0, 2**31 - 1, n)
        s[::5] = 2**31 - 2
        s[1::7] = s[1]
        s[2::9] = -(2**31)
        return s
    if kind == "older_ties":  # the m-th least recent in a tie at the top of a long past: radix passes end in it
        return np.where(rng.random(n) < 0.2, 100, NOW - 200)
    if kind == "newer_ties":  # the same past the clock
        return np.where(rng.random(n) < 0.2, NOW + 10, NOW + 30_000)
    if kind == "newer":  # stamps past the clock (another group's later step, or foreign): above the window
        return rng.integers(NOW + 2, NOW + 40_000, n)
    raise ValueError(kind)


KINDS = ("window", "fresh", "older", "wide", "newer", "older_ties", "newer_ties")


@pytest.mark.parametrize("kind", KINDS)
def test_victim_selection_paths(kind):
    rng = np.random.default_rng(KINDS.index(kind))
    B, Kr, HRr, MP, Rq = 3, 24, 72, 4, 3
    S = MP * 64
    req = np.array([0, 1, 2], np.int32)
    block_table = np.full((Rq, MP), -1, np.int32)
    host_table = rng.permutation(Rq * MP).reshape(Rq, MP).astype(np.int32)
    hot_pages = rng.permutation(2 * Rq)[:2 * Rq].reshape(Rq, 2).astype(np.int32)
    tok = np.stack([rng.permutation(S)[:HRr] for _ in range(Rq)]).astype(np.int32)
    stamp = np.stack([_stamps(kind, rng, HRr) for _ in range(Rq)]).astype(np.int32)
    topk = np.stack([np.concatenate([rng.choice(tok[r], n_hit, replace=False),  # hits, then misses
                                     rng.choice(np.setdiff1d(np.arange(S), tok[r]), Kr - n_hit, replace=False)])
                     for r, n_hit in zip(req, (0, 7, 23))]).astype(np.int32)
    args = [jnp.asarray(x) for x in (topk, req, block_table, host_table, hot_pages, tok, stamp)] + [jnp.int32(CLOCK)]
    ref = [np.asarray(x) for x in sparse_gather_reference(*args, hot_rows=HRr)]
    ker = [np.asarray(x) for x in sparse_gather(*args, hot_rows=HRr, interpret=True)]
    for i, (a, b) in enumerate(zip(ker, ref)):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}")
    for b, r in enumerate(req):  # the list model, started from the (stamp, slot) order
        lru, want_tok = list_model_step(order_of(stamp[r]), tok[r], topk[b])
        np.testing.assert_array_equal(ref[7][r], want_tok, err_msg=f"request {r}")
        touched = ref[8][r] != stamp[r]
        assert np.isin(ref[8][r][touched], (NOW, NOW + 1)).all()
        assert [s for s in lru if not touched[s]] == [s for s in order_of(stamp[r]) if not touched[s]]
    assert ref[4].sum() == 3 * Kr - 30  # every miss claimed a slot
