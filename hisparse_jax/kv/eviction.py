"""Which device pages a `TieredCache` releases under pressure, and in what order (HiSparse).

Coldness (`COLDNESS`, the manager's `victim_order(manager, slot)`) orders one request's releasable pages:
"oldest" (the oldest logical pages first: vLLM's release order) or "recency" (the pages the indexer selected
least recently first: reads the host copy of the device's per-page stamps, `TieredCache.page_stamps`, which
the store's owner refreshes after each step). `evict_until` picks the requests that give, `release_shared_page`
releases a page several requests share from all of them at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hisparse_jax.kv.pool import Tier
from hisparse_jax.units import INVALID

if TYPE_CHECKING:
    from hisparse_jax.kv.manager import TieredCache

TAIL_PAGES = 2  # a request's last pages (being written) are never released


def oldest_first(manager: "TieredCache", slot: int) -> list[int]:
    """Default coldness: a request's evictable logical pages, oldest first (vLLM's release order)."""
    return manager.evictable_pages(slot)


def least_recently_selected(manager: "TieredCache", slot: int) -> list[int]:
    """Indexer-recency coldness: evictable pages ordered by the last step the indexer selected any of their
    positions (never selected first; ties -> older page first), from `manager.page_stamps`."""
    stamps = manager.page_stamps[slot]
    return sorted(manager.evictable_pages(slot), key=lambda i: (int(stamps[i]), i))


least_recently_selected.needs_page_stamps = True  # the store's owner refreshes `manager.page_stamps` each step
COLDNESS = {"oldest": oldest_first, "recency": least_recently_selected}


def evictable_pages(manager: "TieredCache", slot: int) -> list[int]:
    """Logical pages of `slot` that may be released now: resident, sealed (not among the last two — counting
    the pages a growth in progress is about to add), with a current host copy, and held by this request
    alone (releasing a shared page frees nothing). Oldest first."""
    r = manager.requests[slot]
    limit = min(r.num_pages + manager.growing(slot) - TAIL_PAGES, r.num_pages)  # pages being added are not there yet
    rc = manager.pool.refcounts(Tier.DEVICE)
    return [i for i in range(max(limit, 0)) if r.device[i] != INVALID and r.host[i] != INVALID
            and rc[r.device[i]] == 1]


def evict_until(manager: "TieredCache", free_target: int, exclude: int | None = None) -> None:
    """Release cold pages until `free_target` device pages are free (or nothing more can be released).
    Requests that already have a hot buffer give first (every release is a net gain); one without pays
    for its hot buffer out of the pages it releases, so it is used only when it has more than that."""
    nh = manager.hot_pages_per_request
    while manager.pool.num_free(Tier.DEVICE) < free_target:
        cands = []
        for s in manager.requests:
            if s == exclude or s in manager.resident_only:
                continue
            n = len(manager.evictable_pages(s))
            has_hot = bool(manager.requests[s].hot)
            if n and (has_hot or n > nh):
                cands.append((has_hot, n, s))
        if not cands:
            if not release_shared_page(manager, exclude):
                return
            continue
        _, _, s = max(cands)
        if not manager.requests[s].hot:  # the hot buffer is lent from the pages being released (evict allocates it)
            manager.evict(s, manager.victim_order(manager, s)[:nh])
        missing = free_target - manager.pool.num_free(Tier.DEVICE)
        if missing > 0:
            manager.evict(s, manager.victim_order(manager, s)[:missing])


def shared_release_candidates(manager: "TieredCache", exclude: int | None = None
                              ) -> list[tuple[int, list[tuple[int, int]]]]:
    """Device pages held by several requests that all of them may release now: sealed for every holder,
    with a host copy, no holder resident-only (or `exclude`). Returns [(page, [(slot, logical page)])], oldest
    (lowest logical page) first."""
    rc = manager.pool.refcounts(Tier.DEVICE)
    holders: dict[int, list[tuple[int, int, bool]]] = {}
    for s, r in manager.requests.items():
        limit = r.num_pages + manager.growing(s) - TAIL_PAGES
        for i, d in enumerate(r.device):
            if d != INVALID and rc[d] > 1:
                ok = i < limit and r.host[i] != INVALID and s not in manager.resident_only and s != exclude
                holders.setdefault(d, []).append((s, i, ok))
    out = [(d, [(s, i) for s, i, _ in hs]) for d, hs in holders.items()
           if len(hs) == rc[d] and all(ok for _, _, ok in hs)]
    return sorted(out, key=lambda x: (min(i for _, i in x[1]), x[0]))


def release_shared_page(manager: "TieredCache", exclude: int | None) -> bool:
    """Release one shared device page from every holder (HiSparse under pressure, once no request has a
    page of its own left to give). Holders without a hot buffer get one first, when the pool can lend
    it. Returns whether anything changed."""
    nh = manager.hot_pages_per_request
    for d, holders in shared_release_candidates(manager, exclude):
        need = nh * sum(1 for s, _ in holders if not manager.requests[s].hot)
        if need > manager.pool.num_free(Tier.DEVICE):
            continue
        for s, i in holders:
            manager.evict(s, [i])
        return True
    return False
