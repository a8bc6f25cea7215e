"""Consistency checks of the host bookkeeping, for tests, debugging, `EngineConfig(check_invariants=True)` and
restores: `check_pool` (a `PagePool`'s refcounts, free lists and prefix registrations, and optionally its owners),
`check_manager` (a `PageManager`'s requests against its pool and its own rules) and `check_table_copies` (the
store's tables, read back, against the manager). Each raises `PoolError` naming the tier or slot, the page and the
numbers. They read the bookkeeping through its public, read-only views and change nothing; NumPy only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

import numpy as np

from hisparse_jax.kv.pool import PagePool, PoolError, RequestPages, Tier
from hisparse_jax.kv.spec import TAIL_PAGES
from hisparse_jax.units import INVALID, PAGE_SIZE

if TYPE_CHECKING:
    from hisparse_jax.kv.manager import PageManager


def owners_of(requests: Iterable[RequestPages]) -> dict[Tier, list[list[int]]]:
    """The `owners` argument of `check_pool` for a batch of requests: per tier, one page list per request (DEVICE
    includes hot-buffer pages)."""
    reqs = list(requests)
    return {t: [r.owned(t) for r in reqs] for t in Tier}


def check_pool(pool: PagePool, owners: Mapping[Tier | str, Iterable[Iterable[int]]] | None = None) -> None:
    """Raise PoolError (with the tier, the page and the numbers) if the pool is inconsistent. Always checked, per
    tier: refcounts >= 0; a page is free iff its refcount is 0; the free list has no duplicates and no out-of-range
    ids; used + free == budget; prefix registrations are one-to-one, on in-use (or cached free) pages.

    owners: for some or all tiers, an iterable of per-owner page lists (per-request block tables, hot buffers...;
    INVALID entries are skipped). For each tier given, every page's refcount must equal the number of times the
    owners reference it (prefix sharing: k > 1): fewer is a leak, more is double ownership, and a referenced page
    must not be free."""
    for tier in Tier:
        _check_tier(pool, tier)
    for tier, lists in (owners or {}).items():
        tier = Tier(tier)
        rc, budget = pool.refcounts(tier), pool.budget(tier)
        refs = np.zeros(budget, np.int64)
        for i, lst in enumerate(lists):
            arr = np.asarray(lst if isinstance(lst, np.ndarray) else list(lst)).reshape(-1)
            if arr.size and not np.issubdtype(arr.dtype, np.integer):
                raise PoolError(f"owner {i} of tier {tier.value} holds non-integer page ids ({arr.dtype})")
            arr = arr[arr != INVALID].astype(np.int64)
            if (bad := arr[(arr < 0) | (arr >= budget)]).size:
                raise PoolError(f"owner {i} references {tier.value} page {int(bad[0])}, out of range [0, {budget})")
            np.add.at(refs, arr, 1)
        if (bad := np.flatnonzero(refs != rc)).size == 0:
            continue
        msgs = [f"page {p} is referenced by {k} owner(s) but is free" if r == 0 else
                f"page {p} is referenced {k} times but has refcount {r} (double ownership)" if k > r else
                f"page {p} has refcount {r} but only {k} owner reference(s) (leaked)"
                for p, k, r in zip(bad[:5].tolist(), refs[bad[:5]].tolist(), rc[bad[:5]].tolist())]
        more = f" (+{bad.size - 5} more)" if bad.size > 5 else ""
        raise PoolError(f"{tier.value} pool disagrees with its owners: " + "; ".join(msgs) + more)


def _check_tier(pool: PagePool, tier: Tier) -> None:
    name, rc, budget = tier.value, pool.refcounts(tier), pool.budget(tier)
    returned, nf = pool.free_list(tier)
    cached = pool.cached_pages(tier)
    hash_to_page, page_to_hash = pool.prefix_maps(tier)
    if rc.shape != (budget,):
        raise PoolError(f"{name}: refcount table has shape {rc.shape}, budget is {budget}")
    if (rc < 0).any():
        raise PoolError(f"{name}: page {(p := int(np.argmax(rc < 0)))} has negative refcount {int(rc[p])}")
    if not 0 <= nf <= budget:
        raise PoolError(f"{name}: fresh-page watermark {nf} outside [0, {budget}]")
    if (rc[nf:] != 0).any():
        raise PoolError(f"{name}: never-allocated page {(p := nf + int(np.argmax(rc[nf:] != 0)))} has refcount "
                        f"{int(rc[p])}")
    # the free pages below the watermark: each once in the free list, either returned or cached
    free = np.asarray(returned + cached, np.int64)
    if (out := free[(free < 0) | (free >= nf)]).size:
        raise PoolError(f"{name}: free list holds page ids outside [0, {nf}): {sorted(out.tolist())[:5]}")
    if (bad := np.flatnonzero((times := np.bincount(free, minlength=nf)) != (rc[:nf] == 0))).size:
        p = int(bad[0])
        raise PoolError(f"{name}: page {p} " + ("is in the free list more than once" if times[p] > 1 else
                                               f"is in the free list but has refcount {int(rc[p])}" if times[p]
                                               else "has refcount 0 but is not in the free list (lost page)"))
    if cached and not pool.retain_prefix:
        raise PoolError(f"{name}: {len(cached)} cached free pages but retain_prefix is off")
    if unreg := [p for p in cached if p not in page_to_hash]:
        raise PoolError(f"{name}: cached free page {unreg[0]} has no prefix registration")
    used, nfree = int(np.count_nonzero(rc)), free.size + (budget - nf)
    if used != pool.num_used(tier) or used + nfree != budget:
        raise PoolError(f"{name}: used {used} (counter {pool.num_used(tier)}) + free {nfree} != budget {budget}")
    if len(hash_to_page) != len(page_to_hash):
        raise PoolError(f"{name}: prefix maps disagree ({len(hash_to_page)} hashes, {len(page_to_hash)} pages)")
    for h, p in hash_to_page.items():
        if page_to_hash.get(p) != h:
            raise PoolError(f"{name}: hash {h} -> page {p}, but page {p} -> hash {page_to_hash.get(p)}")
        if not 0 <= p < budget or (rc[p] == 0 and p not in cached):
            raise PoolError(f"{name}: prefix hash {h} names page {p}, which is free (not cached) or out of range")


def check_manager(manager: PageManager) -> None:
    """Raise PoolError unless the bookkeeping is consistent: the pool (`check_pool`) and the requests agree (no leak,
    no double ownership); every page has a copy somewhere; a request with evicted pages has a hot buffer (unless
    swapped out whole); tail pages resident; prefix registrations name the pages' own hashes; lengths covered by
    pages. `check_table_copies` checks the device's tables."""
    m = manager
    check_pool(m.pool, owners_of(m.requests.values()))
    for s, r in m.requests.items():
        n, evicted = r.num_pages, r.host_only_pages()
        if evicted and not r.hot and s not in m.swapped:
            raise PoolError(f"slot {s}: pages {evicted[:8]} are released but the request has no hot buffer "
                            "to read them through")
        if lost := [i for i in evicted if r.host[i] == INVALID]:
            raise PoolError(f"slot {s}: page {lost[0]} has no copy anywhere")
        chain = m.prefix_hashes.get(s, [])
        if len(chain) > n:
            raise PoolError(f"slot {s}: {len(chain)} prefix hashes for {n} pages")
        for i, h in enumerate(chain):  # a registered page holds the tokens its hash names
            for tier, page in ((Tier.INDEX, r.index[i]), (Tier.DEVICE, r.device[i]), (Tier.HOST, r.host[i])):
                got = m.pool.prefix_hash(tier, page) if page != INVALID else None
                if got is not None and got != h:
                    raise PoolError(f"slot {s}: {tier.value} page {page} (logical {i}) is registered under "
                                    f"hash {got}, but the slot's page {i} has hash {h}")
        if n < -(-(length := m.lengths[s]) // PAGE_SIZE):
            raise PoolError(f"slot {s}: {length} tokens but only {n} pages")
        for i in range(max(n - TAIL_PAGES, 0), n):
            if length > i * PAGE_SIZE and r.device[i] == INVALID and s not in m.swapped:
                raise PoolError(f"slot {s}: tail page {i} is not resident")


def check_table_copies(manager: PageManager, block_table, host_table, index_table, hot_pages, seq_lens) -> None:
    """Raise PoolError unless the device tables (NumPy copies read back from a `KVStore`: int32[max_seqs,
    max_pages] page tables, int32[max_seqs, hot_pages], int32[max_seqs]) equal the manager's bookkeeping."""
    for s in range(manager.spec.max_seqs):
        r = manager.requests.get(s, RequestPages())
        for name, table, want in (("block", block_table, r.device), ("host", host_table, r.host),
                                  ("index", index_table, r.index)):
            if list(table[s, :(n := len(want))]) != want or np.any(table[s, n:] != -1):
                raise PoolError(f"slot {s}: device {name} table {table[s, :n + 1].tolist()} != host view {want}")
        if s in manager.requests:
            # the row is the capacity's width: the budget's lent pages, then (slots past the hot-row budget) the
            # first lent page again, or -1 throughout while none is lent
            row, k = hot_pages[s].tolist(), len(r.hot)
            past = r.hot[0] if r.hot else INVALID
            if sorted(row[:k]) != sorted(r.hot) or any(x != past for x in row[k:]):
                raise PoolError(f"slot {s}: hot pages {row} != {r.hot} (then {past} past the budget's)")
            if seq_lens[s] != manager.lengths[s]:
                raise PoolError(f"slot {s}: store seq_len {seq_lens[s]} != {manager.lengths[s]}")
