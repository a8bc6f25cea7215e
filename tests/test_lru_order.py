"""The hot buffer's within-step LRU order (vLLM / SGLang HiSparse's): after a step, from least to most recent,
[untouched slots, previous order | slots the misses claimed, claim (top-k) order | hit slots, previous order],
stored as per-slot ranks in hot_stamp (a permutation of 0..HR-1). Victims: the untouched slots, least
recent first.

1. A hand-worked 6-step sequence (one request, HR = 6, K = 4): every miss's slot and the order after every
   step written down by hand, run through the jnp reference and the Pallas kernel (interpret mode).
2. Random multi-step trajectories against a plain list model of the order (the vLLM kernel's lru list).
3. The kernel's O(HR) path for canonical stamps (ranks, -1, gaps) and its general path (foreign stamps)
   agree with the reference.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.sparse_gather import sparse_gather, sparse_gather_reference

RESOLVERS = {"reference": lambda *a, **k: sparse_gather_reference(*a, **k),
             "pallas_interpret": lambda *a, **k: sparse_gather(*a, interpret=True, **k)}

HR, K = 6, 4
HOT_PAGE = 3
HOST = (5, 7)  # host pages of positions 0..63 and 64..127; nothing is resident

# (top-k, {position: slot it is read from}, positions that miss, LRU order after the step: slots, least
# recent first). Initial state: empty buffer, stamps -1 -> order [0, 1, 2, 3, 4, 5].
STEPS = [
    # 1. four misses claim the four least recent slots in top-k order; untouched 4, 5 stay first.
    ([40, 10, 30, 20], {40: 0, 10: 1, 30: 2, 20: 3}, {40, 10, 30, 20}, [4, 5, 0, 1, 2, 3]),
    # 2. hits and misses mix: 30 (slot 2) and 40 (slot 0) hit; 50, 60 take the least recent untouched slots
    #    4, 5. Order: untouched [1, 3] | missed [4, 5] | hits in previous order [0, 2].
    #    (Old rule: every touched slot stamped = clock, ties by slot -> [1, 3, 0, 2, 4, 5].)
    ([30, 50, 40, 60], {30: 2, 50: 4, 40: 0, 60: 5}, {50, 60}, [1, 3, 4, 5, 0, 2]),
    # 3. 10 hits slot 1. Untouched, least recent first: 3 (held 20 since step 1), then 4 (step 2's miss,
    #    ranked before step 2's hits): 70 evicts 20 from slot 3, 80 evicts 50 from slot 4.
    #    (Old rule: slots 0, 2, 4, 5 tied at stamp 2 -> 80 would have evicted 40 from slot 0.)
    ([70, 10, 80, -1], {70: 3, 10: 1, 80: 4}, {70, 80}, [5, 0, 2, 3, 4, 1]),
    # 4. hits 30 (slot 2), 40 (slot 0); untouched [5, 3, 4, 1]: 90 -> slot 5, 100 -> slot 3. The claimed
    #    slots are ranked in claim order [5, 3], not slot order (the old rule's tie-break gave [3, 5]).
    ([90, 100, 30, 40], {90: 5, 100: 3, 30: 2, 40: 0}, {90, 100}, [4, 1, 5, 3, 0, 2]),
    # 5. hits 90 (slot 5), 80 (slot 4), 10 (slot 1) keep their previous order [4, 1, 5] (neither top-k
    #    order [5, 4, 1] nor slot order [1, 4, 5]); 120 claims the least recent untouched slot 3 (evicts
    #    100, step 4's miss).
    ([90, 80, 10, 120], {90: 5, 80: 4, 10: 1, 120: 3}, {120}, [0, 2, 3, 4, 1, 5]),
    # 6. the same position twice (both hit slot 1, which counts once); padding elsewhere.
    ([10, -1, 10, -1], {10: 1}, set(), [0, 2, 3, 4, 5, 1]),
]
TOKENS_AFTER = [  # hot_token after each step, worked out from the slots above
    [40, 10, 30, 20, -1, -1],
    [40, 10, 30, 20, 50, 60],
    [40, 10, 30, 70, 80, 60],
    [40, 10, 30, 100, 80, 90],
    [40, 10, 30, 120, 80, 90],
    [40, 10, 30, 120, 80, 90],
]


def ranks_of(order):
    """Slots listed least recent first -> hot_stamp (rank of each slot)."""
    rank = np.empty(len(order), np.int32)
    rank[np.asarray(order)] = np.arange(len(order))
    return rank


@pytest.mark.parametrize("resolver", list(RESOLVERS))
def test_hand_worked_sequence(resolver):
    fn = RESOLVERS[resolver]
    tables = (jnp.asarray([0], jnp.int32), jnp.asarray([[-1, -1]], jnp.int32), jnp.asarray([HOST], jnp.int32),
              jnp.asarray([[HOT_PAGE]], jnp.int32))
    tok = jnp.full((1, HR), -1, jnp.int32)
    stamp = jnp.full((1, HR), -1, jnp.int32)
    for step, ((topk, slots, misses, order), tokens) in enumerate(zip(STEPS, TOKENS_AFTER), 1):
        req, block_table, host_table, hot_pages = tables
        out = fn(jnp.asarray([topk], jnp.int32), req, block_table, host_table, hot_pages, tok, stamp,
                 jnp.int32(1000 + step), hot_rows=HR)
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
        np.testing.assert_array_equal(stamp[0], ranks_of(order), err_msg=msg)
        tok, stamp = jnp.asarray(tok), jnp.asarray(stamp)


# ----- random trajectories against a list model --------------------------------------------------------
def list_model_step(lru, tokens, topk):
    """One request's step in the vLLM kernel's terms: `lru` lists the slots least recent first."""
    slot_of = {}
    for s, t in enumerate(tokens):  # lowest slot holding a tag
        if t >= 0:
            slot_of.setdefault(int(t), s)
    misses = [int(t) for t in topk if t >= 0 and int(t) not in slot_of]
    hit_slots = {slot_of[int(t)] for t in topk if t >= 0 and int(t) in slot_of}
    untouched = [s for s in lru if s not in hit_slots]
    victims = untouched[:len(misses)]
    tokens = list(tokens)
    for t, s in zip(misses, victims):
        tokens[s] = t
    return untouched[len(misses):] + victims + [s for s in lru if s in hit_slots], tokens


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
        out = fn(*(jnp.asarray(x) for x in (topk, req, block_table, host_table, hot_pages, tok, stamp)),
                 jnp.int32(step), hot_rows=HRr)
        tok, stamp = np.asarray(out[7]), np.asarray(out[8])
        for b, r in enumerate(req):
            if r in lru:
                lru[r], want_tok = list_model_step(lru[r], prev_tok[r], topk[b])
                np.testing.assert_array_equal(tok[r], want_tok, err_msg=f"step {step} request {r}")
                np.testing.assert_array_equal(stamp[r], ranks_of(lru[r]), err_msg=f"step {step} request {r}")
        np.testing.assert_array_equal(stamp[[1, 3]], before[[1, 3]])  # idle / no hot buffer: untouched


# ----- the kernel's two ways to read the previous order -----------------------------------------------
@pytest.mark.parametrize("stamps", ["ranks", "gappy", "foreign"])
def test_kernel_previous_order_paths(stamps):
    """ranks (permutations) and gappy rows (-1 and distinct values in [0, HR)) take the kernel's O(HR) path;
    foreign rows (a repeated stamp, one >= HR, one < -1) its compare-and-count path. Both == reference, and
    every live row with a hot buffer leaves with a permutation."""
    rng = np.random.default_rng({"ranks": 1, "gappy": 2, "foreign": 3}[stamps])
    B, Kr, HRr, MP, Rq = 4, 12, 24, 2, 5
    S = MP * 64
    req = np.array([4, 0, -1, 2], np.int32)
    block_table = np.where(rng.random((Rq, MP)) < 0.3, rng.permutation(Rq * MP).reshape(Rq, MP), -1).astype(np.int32)
    host_table = rng.permutation(2 * Rq * MP)[:Rq * MP].reshape(Rq, MP).astype(np.int32)
    hot_pages = rng.permutation(Rq).reshape(Rq, 1).astype(np.int32)
    pool = rng.choice(S, 40, replace=False)
    tok = np.where(rng.random((Rq, HRr)) < 0.2, -1, rng.choice(pool, (Rq, HRr))).astype(np.int32)
    stamp = np.stack([rng.permutation(HRr) for _ in range(Rq)]).astype(np.int32)
    if stamps != "ranks":  # distinct values drawn from [0, HR) on ~60% of the slots, -1 on the rest
        for r in range(Rq):
            used = rng.random(HRr) < 0.6
            stamp[r] = -1
            stamp[r, used] = rng.choice(HRr, used.sum(), replace=False)
    if stamps == "foreign":
        stamp[0, 2], stamp[0, 7] = 5, 5  # a repeat
        stamp[2, 0] = HRr + 3  # beyond HR
        stamp[4, 4] = -7  # below -1
    topk = np.stack([rng.choice(pool, Kr, replace=False) for _ in range(B)]).astype(np.int32)
    args = [jnp.asarray(x) for x in (topk, req, block_table, host_table, hot_pages, tok, stamp)] + [jnp.int32(9)]
    ref = [np.asarray(x) for x in sparse_gather_reference(*args, hot_rows=HRr)]
    ker = [np.asarray(x) for x in sparse_gather(*args, hot_rows=HRr, interpret=True)]
    for i, (a, b) in enumerate(zip(ker, ref)):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}")
    for b, r in enumerate(req):  # the list model, started from the (stamp, slot) order
        if r < 0:
            continue
        lru = list(np.lexsort((np.arange(HRr), stamp[r])))
        offloaded = [t for t in topk[b] if block_table[r, t // 64] < 0]
        lru, want_tok = list_model_step(lru, tok[r], offloaded)
        np.testing.assert_array_equal(ref[7][r], want_tok, err_msg=f"request {r}")
        np.testing.assert_array_equal(ref[8][r], ranks_of(lru), err_msg=f"request {r}")
    assert ref[7].tolist() != tok.tolist() and ref[4].any()  # something was claimed
