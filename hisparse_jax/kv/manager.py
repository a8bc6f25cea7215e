"""`PageManager`: the host-side page bookkeeping of a tiered KV store, in one class: admission, tail-page
reservation, eviction under pressure, whole-request swap, prefix sharing. Whether requests fit its limits at all is
`kv.spec.check_batch_fits`; its consistency checks are `kv.audit`'s. NumPy only: it never calls jit and never reads a device array. It decides
which pages exist where (`PagePool`) and records what the device tables must become as ordered `updates`
(`kv.updates`), which the owner of the `KVStore` applies (`kv.device.apply_updates`) before the next device call.

Residency: a request's pages stay on the device until the pool runs low; then sealed pages (never the last
`TAIL_PAGES`) are evicted, coldest first (`COLDNESS`), and a request with an evicted page reads it through its hot
buffer (lent from the same device pool). Prefix caching: full prompt pages are registered under the hash chain of
their tokens in every tier that holds them and shared (refcounted) by later requests; a page found only on the host
is loaded into a fresh device page; under pressure a shared device page is evicted from all its holders at once."""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from hisparse_jax.config import CacheConfig, ModelConfig
from hisparse_jax.kv.account import bookkeeping_costs
from hisparse_jax.kv.pool import OutOfPages, PagePool, PoolError, RequestPages, Tier, page_hash
from hisparse_jax.kv.spec import TAIL_PAGES, StoreSpec, check_batch_fits
from hisparse_jax.kv.updates import ClearStamps, EvictPages, LoadPages, SetTables, Update, pad_pow2, table_row
from hisparse_jax.memory import check_account
from hisparse_jax.units import INVALID, PAGE_SIZE

def oldest_first(pages: list[int], stamps: np.ndarray) -> list[int]:
    """Default coldness: a request's evictable logical pages, oldest first (vLLM's eviction order)."""
    return list(pages)


def least_recently_selected(pages: list[int], stamps: np.ndarray) -> list[int]:
    """Indexer-recency coldness: `pages` ordered by the last step the indexer selected any of their positions
    (`stamps`: int32[max_pages], -1 = never selected; never selected first, ties -> older page first)."""
    return sorted(pages, key=lambda i: (int(stamps[i]), i))


least_recently_selected.needs_page_stamps = True  # the store's owner refreshes `page_stamps` after each step
COLDNESS = {"oldest": oldest_first, "recency": least_recently_selected}


class PrefixHit(NamedTuple):
    """One registered page a prompt can share: its hash and its page in each tier (INVALID where none)."""

    hash: int
    index: int
    device: int
    host: int


class PageManager:
    """The page bookkeeping of one tiered store: its `PagePool` (`.pool`), each request slot's pages (`.requests`)
    and length (`.lengths`), and the device-table `updates` not yet applied. `.spec` is the store's geometry (its
    arrays' shapes: the `CacheConfig`'s capacity when it has one), `.budget_spec` the limits enforced inside it (the
    `CacheConfig`'s own numbers: pool pages, `max_seqs` slots of up to `max_pages` pages, `hot_rows`; without a
    capacity the two are equal). `victim_order(pages, stamps)`: the coldness (one of `COLDNESS`). Its own arrays are
    checked against the RAM before they exist (`kv.account`); the store's are the caller's (`check_store_memory`)."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, *,
                 victim_order: Callable[[list[int], np.ndarray], list[int]] = oldest_first):
        if not isinstance(model, ModelConfig):
            raise TypeError(f"model must be a ModelConfig, got {type(model).__name__}")
        if not isinstance(cache, CacheConfig):
            raise TypeError(f"cache must be a CacheConfig, got {type(cache).__name__}")
        self.model_cfg, self.cache = model, cache
        self.spec = StoreSpec.create(model, cache)
        self.budget_spec = StoreSpec.create(model, cache.replace(capacity=None))
        check_account("the host bookkeeping", bookkeeping_costs(self.spec))  # before its arrays exist
        self.pool = PagePool(self.budget_spec.device_pages, self.budget_spec.index_pages, self.budget_spec.host_pages)
        self.requests: dict[int, RequestPages] = {}
        self.lengths: dict[int, int] = {}
        self.victim_order, self.evicted_pages = victim_order, 0
        # page loads (swap-ins, host-only prefix pages) and prompt rows written to the host; a step's decode misses
        # and mirror bytes are in the step stats
        self.h2d_bytes = self.d2h_bytes = 0
        self.resident_only: set[int] = set()  # slots that must stay fully resident (being prefilled, or policy says so)
        self.swapped: set[int] = set()  # slots swapped out whole (no device page until swap_in)
        # evict single cold pages under pressure (HiSparse); off = a request is resident whole or not at all
        self.partial_eviction = True
        self.prefix_hashes: dict[int, list[int]] = {}  # slot -> hash chain of its registered / shared pages
        self.cached_tokens: dict[int, int] = {}  # slot -> prompt tokens shared at admission (not recomputed)
        self.updates: list[Update] = []  # device-table updates decided and not yet applied, in order
        # host copy of the device's indexer-recency stamps (per slot and logical page), for "recency" coldness
        self.page_stamps = np.full((self.spec.max_seqs, self.spec.max_pages), -1, np.int32)
        self._growing: tuple[int, int] | None = None  # (slot, pages being added) during _grow
        self._synced_hot: dict[int, tuple[int, ...]] = {}  # slot -> hot pages last sent to the device

    @property
    def prefix_caching(self) -> bool:
        """Register written full pages and share them at admission; freed registered pages stay cached."""
        return self.pool.retain_prefix

    @prefix_caching.setter
    def prefix_caching(self, on: bool) -> None:
        self.pool.set_retain_prefix(on)

    @property
    def releasable(self) -> bool:
        """Whether single pages can be evicted (a host mirror, and partial eviction on): `check_batch_fits`'s rule."""
        return self.budget_spec.mirror_to_host and self.partial_eviction

    @property
    def all_layers_page_bytes(self) -> int:
        """Bytes of one logical page's KV in every layer (what a whole-page copy between the tiers moves)."""
        return self.spec.num_layers * self.spec.page_bytes

    def free_slots(self) -> list[int]:
        return [s for s in range(self.budget_spec.max_seqs) if s not in self.requests]

    def growing(self, slot: int) -> int:
        """Pages a growth of `slot` in progress is about to add (0 outside `reserve` / `admit`)."""
        return self._growing[1] if self._growing and self._growing[0] == slot else 0

    def admit(self, num_tokens: int, *, resident: bool = False, tokens=None) -> int:
        """Reserve a slot and pages for a prompt of `num_tokens` tokens; returns the slot. With `resident`, every
        page is placed on the device (else older pages may start on the host when the device is short). With `tokens`
        (the prompt's ids) and `prefix_caching` on, the longest run of registered full pages of `tokens` is shared
        instead of allocated (`cached_tokens[slot]` tokens; the slot's length is at least that). Raises BudgetError
        (never fits), or OutOfPages / PoolError when it does not fit *now* (nothing changed)."""
        check_batch_fits(self.budget_spec, [max(num_tokens, 0 if tokens is None else len(tokens))],
                         releasable=self.releasable)
        if not (slots := self.free_slots()):
            raise PoolError(f"all {self.budget_spec.max_seqs} request slots are in use")
        slot = slots[0]
        self.requests[slot], self.lengths[slot], self.cached_tokens[slot] = RequestPages(), 0, 0
        if resident:
            self.resident_only.add(slot)
        try:
            if tokens is not None and self.prefix_caching:
                self._share_prefix(slot, self.match_prefix(tokens))
            num_tokens = max(num_tokens, self.cached_tokens[slot])
            self._grow(slot, num_tokens)
        except Exception:
            self.release(slot)
            raise
        finally:
            if resident:
                self.resident_only.discard(slot)
        self.lengths[slot] = num_tokens
        self.record_tables(slot)
        return slot

    def record_prefill(self, slot: int, length: int, start: int = 0, rows: int | None = None,
                       offset: int = 0) -> None:
        """Check a prompt write of positions start..length-1 into `slot` (before the device writes it: the slot
        was admitted for `length` tokens; `start` is not below its shared prefix, whose pages are never written)
        and count the rows it mirrors to the host. `rows`: rows the write carries (default `length`), for
        positions from `offset` on."""
        if slot not in self.requests:
            raise PoolError(f"slot {slot} holds no request")
        if length != self.lengths[slot]:
            raise ValueError(f"slot {slot} was admitted for {self.lengths[slot]} tokens, got {length}")
        if not self.cached_tokens.get(slot, 0) <= start <= length:
            raise PoolError(f"slot {slot}: write_prefill start {start} must lie in [{self.cached_tokens.get(slot, 0)} "
                            f"(its shared prefix tokens), {length}]; shared pages are never written")
        host = np.asarray(self.requests[slot].host, np.int64)
        end = min(length, length if rows is None else offset + rows, self.spec.max_pages * PAGE_SIZE)
        pos = np.arange(max(start, offset), max(end, max(start, offset)))
        written = int(np.count_nonzero(host[pos // PAGE_SIZE] != INVALID)) if pos.size else 0
        self.d2h_bytes += written * self.spec.num_layers * self.spec.row_bytes

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Make positions < num_tokens writable (tail pages resident; every page when `slot` is resident-only)
        before a step writes them."""
        check_batch_fits(self.budget_spec, [num_tokens], releasable=self.releasable)
        self._grow(slot, num_tokens)

    def can_reserve(self, slot: int, num_tokens: int) -> bool:
        """Whether `reserve` would succeed now without evicting anything."""
        new = max(-(-num_tokens // PAGE_SIZE) - self.requests[slot].num_pages, 0)
        return all(self.pool.num_free(t) >= new for t in (Tier.DEVICE, Tier.INDEX)
                   + ((Tier.HOST,) if self.spec.mirror_to_host else ()))

    def keep_resident(self, slot: int) -> None:
        """Mark `slot` resident-only (a prompt being written chunk by chunk): none of its pages is evicted."""
        self.resident_only.add(slot)

    def allow_eviction(self, slot: int) -> None:
        """Undo `keep_resident`."""
        self.resident_only.discard(slot)

    def advance(self, slots, n: int = 1) -> None:
        """Record that a step (or `n` steps) appended one token to each of `slots`."""
        for s in slots:
            self.lengths[s] += n

    def set_length(self, slot: int, length: int) -> None:
        """Record that the device store now holds `length` positions of `slot` (a step wrote a prompt chunk)."""
        if slot not in self.requests:
            raise PoolError(f"slot {slot} holds no request")
        self.lengths[slot] = length

    def release(self, slot: int) -> None:
        """Free every page of a finished or aborted request and clear its tables."""
        r = self.requests.pop(slot)
        self.resident_only.discard(slot)
        self.swapped.discard(slot)
        r.release(self.pool)
        for d in (self.lengths, self._synced_hot, self.prefix_hashes, self.cached_tokens):
            d.pop(slot, None)
        mp = self.spec.max_pages
        self.updates.append(SetTables(slot, table_row([], mp), table_row([], mp), table_row([], mp), 0,
                                      table_row([], self.spec.hot_pages), 0))
        self.updates.append(ClearStamps(slot))
        self.page_stamps[slot] = -1

    def _grow(self, slot: int, num_tokens: int) -> None:
        r, n, mirror = self.requests[slot], -(-num_tokens // PAGE_SIZE), self.spec.mirror_to_host
        if (new := n - r.num_pages) <= 0:
            return
        for t in (Tier.INDEX, Tier.HOST) if mirror else (Tier.INDEX,):
            if not self.pool.can_allocate(t, new):
                raise OutOfPages(t, new, self.pool.num_free(t), self.pool.budget(t))
        # device pages for the new pages: at most the last TAIL_PAGES must be resident; older ones may start
        # on the host (as if written and evicted) when the device is short — unless the slot is resident-only
        must = new if slot in self.resident_only else min(new, TAIL_PAGES)
        self._growing = (slot, new)
        try:
            self._make_room(slot, new, must, n)
        finally:
            self._growing = None
        # all resident when the pool has room (a request with host-only pages already has its hot buffer); else
        # the oldest new pages start on the host and the request needs its hot buffer
        free = self.pool.num_free(Tier.DEVICE)
        k = new if free >= new else min(new, free - (0 if r.hot else self.budget_spec.hot_pages))
        if k < must or (k < new and not mirror):
            raise OutOfPages(Tier.DEVICE, new, free, self.budget_spec.device_pages)
        index = self.pool.allocate(Tier.INDEX, new)
        host = self.pool.allocate(Tier.HOST, new) if mirror else [INVALID] * new
        if k < new:
            self._ensure_hot(slot)
        device = [INVALID] * (new - k) + self.pool.allocate(Tier.DEVICE, k)
        for x, d, h in zip(index, device, host):
            r.append(index=x, device=d, host=h)
        self.record_tables(slot)

    def _make_room(self, slot: int, new: int, must: int, n_total: int) -> None:
        """Evict cold pages (other requests first) until `must` new device pages (plus this request's hot
        buffer if it will need one) can be allocated; best effort up to `new`. Raises OutOfPages, changing
        nothing, when even `must` cannot be had (or partial eviction is off and the pool is short)."""
        def need(goal):
            r = self.requests[slot]
            hot = 0 if r.hot or len(r.resident_pages()) + goal >= n_total else self.budget_spec.hot_pages
            return goal + hot

        if self.partial_eviction and self.spec.mirror_to_host:
            for goal in (new, must):
                if self.pool.num_free(Tier.DEVICE) >= need(goal):
                    break
                self.evict_until(need(goal), exclude=slot if goal == new and goal != must else None)
        if self.pool.num_free(Tier.DEVICE) < min(need(new), need(must)):
            raise OutOfPages(Tier.DEVICE, need(must), self.pool.num_free(Tier.DEVICE), self.budget_spec.device_pages)

    def _ensure_hot(self, slot: int) -> None:
        if not (r := self.requests[slot]).hot:
            r.hot.extend(self.pool.allocate(Tier.DEVICE, self.budget_spec.hot_pages))
            self.record_tables(slot)

    def _sealed(self, slot: int) -> list[int]:
        """`slot`'s logical pages that are resident, sealed (not among the last `TAIL_PAGES`, counting the pages a
        growth in progress is about to add, which are not there yet) and have a host copy."""
        r = self.requests[slot]
        limit = min(r.num_pages + self.growing(slot) - TAIL_PAGES, r.num_pages)
        return [i for i in range(max(limit, 0)) if r.device[i] != INVALID and r.host[i] != INVALID]

    def evictable_pages(self, slot: int) -> list[int]:
        """Logical pages of `slot` that may be evicted now: resident, sealed, with a current host copy (`_sealed`),
        and held by this request alone (evicting a shared page frees nothing). Oldest first."""
        rc, device = self.pool.refcounts(Tier.DEVICE), self.requests[slot].device
        return [i for i in self._sealed(slot) if rc[device[i]] == 1]

    def _coldest_first(self, slot: int) -> list[int]:
        """`slot`'s evictable pages in the coldness's order, given a read-only view of its stamps."""
        (stamps := self.page_stamps[slot].view()).flags.writeable = False
        return self.victim_order(self.evictable_pages(slot), stamps)

    def evict_until(self, free_target: int, exclude: int | None = None) -> None:
        """Evict cold pages until `free_target` device pages are free (or nothing more can be evicted).
        Requests that already have a hot buffer give first (every eviction is a net gain); one without pays
        for its hot buffer out of the pages it evicts, so it is used only when it has more than that."""
        nh = self.budget_spec.hot_pages
        while self.pool.num_free(Tier.DEVICE) < free_target:
            cands = []
            for s, r in self.requests.items():
                n = 0 if s == exclude or s in self.resident_only else len(self.evictable_pages(s))
                if n and (r.hot or n > nh):
                    cands.append((bool(r.hot), n, s))
            if not cands:
                if not self._evict_shared_page(exclude):
                    return
                continue
            _, _, s = max(cands)
            if not self.requests[s].hot:  # the hot buffer is lent from the pages being evicted (evict allocates it)
                self.evict(s, self._coldest_first(s)[:nh])
            if (missing := free_target - self.pool.num_free(Tier.DEVICE)) > 0:
                self.evict(s, self._coldest_first(s)[:missing])

    def evictable_shared_pages(self, exclude: int | None = None) -> list[tuple[int, list[tuple[int, int]]]]:
        """Device pages held by several requests that all of them may evict now: sealed for every holder, with
        a host copy, no holder resident-only (or `exclude`). Returns [(page, [(slot, logical page)])], oldest
        (lowest logical page) first."""
        rc = self.pool.refcounts(Tier.DEVICE)
        holders: dict[int, list[tuple[int, int, bool]]] = {}
        for s, r in self.requests.items():
            ok = set(self._sealed(s)) if s not in self.resident_only and s != exclude else set()
            for i, d in enumerate(r.device):
                if d != INVALID and rc[d] > 1:
                    holders.setdefault(d, []).append((s, i, i in ok))
        out = [(d, [(s, i) for s, i, _ in hs]) for d, hs in holders.items()
               if len(hs) == rc[d] and all(ok for _, _, ok in hs)]
        return sorted(out, key=lambda x: (min(i for _, i in x[1]), x[0]))

    def _evict_shared_page(self, exclude: int | None) -> bool:
        """Evict one shared device page from every holder (HiSparse under pressure, once no request has a
        page of its own left to give). Holders without a hot buffer get one first, when the pool can lend
        it. Returns whether anything changed."""
        for d, holders in self.evictable_shared_pages(exclude):
            need = self.budget_spec.hot_pages * sum(1 for s, _ in holders if not self.requests[s].hot)
            if need > self.pool.num_free(Tier.DEVICE):
                continue
            for s, i in holders:
                self.evict(s, [i])
            return True
        return False

    def evict(self, slot: int, logical_pages: list[int]) -> None:
        """Evict the device copies of `slot`'s logical pages (their host copies must be current). A page shared
        with other requests loses only this request's reference. A request reads evicted pages through its hot
        buffer: one without gets it here, from the pages this frees or free ones (else PoolError, nothing changed)."""
        r, growing = self.requests[slot], self.growing(slot)
        if slot in self.swapped:
            raise PoolError(f"slot {slot} is swapped out: it has no device pages to evict")
        if len(set(logical_pages)) != len(logical_pages):
            raise PoolError(f"slot {slot}: repeated pages in {logical_pages}")
        for i in logical_pages:
            if not 0 <= i < r.num_pages + growing - TAIL_PAGES:
                raise PoolError(f"slot {slot}: page {i} is not an evictable page (one of the last {TAIL_PAGES} "
                                f"pages being written, or past the request's {r.num_pages})")
            if r.device[i] == INVALID or r.host[i] == INVALID:
                raise PoolError(f"slot {slot}: page {i} is not resident with a host copy")
        if not logical_pages:
            return
        if not r.hot:
            freed = sum(self.pool.refcount(Tier.DEVICE, r.device[i]) == 1 for i in logical_pages)
            free = self.pool.num_free(Tier.DEVICE)
            if free + freed < self.budget_spec.hot_pages:  # the hot buffer would not fit: change nothing
                raise OutOfPages(Tier.DEVICE, self.budget_spec.hot_pages - freed, free, self.budget_spec.device_pages)
        # every evicted page has a current host copy (checked above): the device copy is dropped, nothing copied
        self.updates.append(EvictPages(pad_pow2([slot] * len(logical_pages)), pad_pow2(list(logical_pages))))
        for i in logical_pages:
            self.pool.free(Tier.DEVICE, [r.device[i]])
            r.device[i] = INVALID
        self.evicted_pages += len(logical_pages)
        self._ensure_hot(slot)  # also syncs the tables when the buffer is new

    def swap_out(self, slot: int) -> int:
        """Evict every device page of `slot` and its hot buffer (host copies must be current: needs the eager
        mirror); the request keeps its indexer pages and host pages. Returns the number of pages evicted."""
        if not self.spec.mirror_to_host:
            raise PoolError("swap_out needs mirror_to_host (host copies of every page)")
        r = self.requests[slot]
        pages = r.resident_pages()
        self.pool.free(Tier.DEVICE, [r.device[i] for i in pages] + r.hot)
        for i in pages:
            r.device[i] = INVALID
        r.hot.clear()
        self.evicted_pages += len(pages)
        self.swapped.add(slot)
        self.record_tables(slot)
        return len(pages)

    def swap_in(self, slot: int) -> int:
        """Bring every host-only page of `slot` back to the device (whole-page H2D copies); prefix pages still on
        the device (another request's, or cached) are shared again instead of copied. Raises OutOfPages (nothing
        changed) when the device pool cannot hold them. Returns the pages loaded or shared."""
        r, chain = self.requests[slot], self.prefix_hashes.get(slot, [])
        found = {i: self.pool.lookup_prefix(Tier.DEVICE, chain[i]) for i in r.host_only_pages() if i < len(chain)}
        shared = {i: d for i, d in found.items() if d is not None}
        missing = [i for i in r.host_only_pages() if i not in shared]
        rc = self.pool.refcounts(Tier.DEVICE)
        need = len(missing) + sum(1 for d in shared.values() if rc[d] == 0)
        if not self.pool.can_allocate(Tier.DEVICE, need):
            raise OutOfPages(Tier.DEVICE, need, self.pool.num_free(Tier.DEVICE), self.budget_spec.device_pages)
        self.swapped.discard(slot)
        for i, d in shared.items():
            self.pool.incref(Tier.DEVICE, d)
            r.device[i] = d
        for i, d in zip(missing, self._load_pages([r.host[i] for i in missing])):
            r.device[i] = d
            if i < len(chain):
                self.pool.register_prefix(Tier.DEVICE, chain[i], d)
        self.record_tables(slot)
        return len(missing) + len(shared)

    def _load_pages(self, host_pages: list[int]) -> list[int]:
        """Fresh device pages for whole-page copies of `host_pages` (recorded as an update and counted)."""
        dev = self.pool.allocate(Tier.DEVICE, len(host_pages))
        if host_pages:
            self.updates.append(LoadPages(pad_pow2(host_pages), pad_pow2(dev)))
            self.h2d_bytes += len(host_pages) * self.all_layers_page_bytes
        return dev

    def match_prefix(self, tokens) -> list[PrefixHit]:
        """The registered pages `tokens` could share: the longest run of full pages from the start whose hash
        chain is registered with an indexer page and a KV copy (with the host mirror on: a host copy), never
        the page holding the last token. One `PrefixHit` per page, in order. Read-only."""
        tokens, mirror = np.asarray(tokens, np.int64).reshape(-1), self.spec.mirror_to_host
        out, h = [], None
        for i in range(max(len(tokens) - 1, 0) // PAGE_SIZE):
            h = page_hash(h, tokens[i * PAGE_SIZE:(i + 1) * PAGE_SIZE])
            x, d = self.pool.lookup_prefix(Tier.INDEX, h), self.pool.lookup_prefix(Tier.DEVICE, h)
            hp = self.pool.lookup_prefix(Tier.HOST, h) if mirror else None
            if x is None or (hp is None if mirror else d is None):
                break
            out.append(PrefixHit(h, x, INVALID if d is None else d, INVALID if hp is None else hp))
        return out

    def _share_prefix(self, slot: int, hits: list[PrefixHit]) -> None:
        """Take one reference on each hit page (reviving cached free ones) for the empty request `slot`; load
        host-only ones into fresh device pages (registered there)."""
        pool, r = self.pool, self.requests[slot]
        assert r.num_pages == 0, "prefix pages are shared into an empty request"
        rc = pool.refcounts(Tier.DEVICE)

        def free_after_revival():  # reviving cached device pages uses up free pages too
            return pool.num_free(Tier.DEVICE) - sum(1 for x in hits if x.device != INVALID and rc[x.device] == 0)

        loads = [i for i, x in enumerate(hits) if x.device == INVALID]
        if loads and free_after_revival() < len(loads) and self.partial_eviction:
            self.evict_until(pool.num_free(Tier.DEVICE) - free_after_revival() + len(loads), exclude=slot)
            # an eviction may have freed a hit page (it stays cached, and registered, unless reclaimed)
            hits = [x if x.device == INVALID or pool.lookup_prefix(Tier.DEVICE, x.hash) == x.device
                    else x._replace(device=INVALID) for x in hits]
            loads = [i for i, x in enumerate(hits) if x.device == INVALID]
        # share as far as the pages that must be loaded can be had (a shorter prefix is still a prefix)
        if len(loads) > (free := max(free_after_revival(), 0)):
            hits, loads = hits[:loads[free]], loads[:free]
        for x in hits:  # references first: a cached page must be revived before anything is allocated
            for tier, page in ((Tier.INDEX, x.index), (Tier.HOST, x.host), (Tier.DEVICE, x.device)):
                if page != INVALID:
                    pool.incref(tier, page)
        for i, d in zip(loads, self._load_pages([hits[i].host for i in loads])):
            hits[i] = hits[i]._replace(device=d)
            pool.register_prefix(Tier.DEVICE, hits[i].hash, d)
        for x in hits:
            r.append(index=x.index, device=x.device, host=x.host)
        self.prefix_hashes[slot] = [x.hash for x in hits]
        self.cached_tokens[slot] = len(hits) * PAGE_SIZE

    def register_prefix(self, slot: int, tokens) -> int:
        """Register `slot`'s full pages of `tokens` (whose rows must be written: positions < len(tokens)) as
        prefix pages in every tier that holds them; a hash already naming a page keeps it (no churn). Returns
        the number of pages registered. No-op unless `prefix_caching` is on."""
        if not self.prefix_caching:
            return 0
        tokens, r = np.asarray(tokens, np.int64).reshape(-1), self.requests[slot]
        n = min(len(tokens) // PAGE_SIZE, r.num_pages)
        chain = self.prefix_hashes.setdefault(slot, [])
        for i in range(n):
            if i == len(chain):
                chain.append(page_hash(chain[-1] if chain else None, tokens[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]))
            for tier, page in ((Tier.INDEX, r.index[i]), (Tier.DEVICE, r.device[i]), (Tier.HOST, r.host[i])):
                if page != INVALID and self.pool.lookup_prefix(tier, chain[i]) is None:
                    self.pool.register_prefix(tier, chain[i], page)
        return n

    def take_updates(self) -> list[Update]:
        """The device-table updates decided since the last call, in order (the caller applies them)."""
        out, self.updates = self.updates, []
        return out

    @property
    def needs_page_stamps(self) -> bool:
        """Whether the coldness reads `page_stamps` (the store's owner then refreshes them after each step)."""
        return bool(getattr(self.victim_order, "needs_page_stamps", False))

    def observe_page_stamps(self, stamps) -> None:
        """Take the device's indexer-recency stamps (int32[max_seqs, max_pages]) read after a step."""
        self.page_stamps = np.array(stamps, np.int32).reshape(self.spec.max_seqs, self.spec.max_pages)

    def check_live_slots(self, slots) -> list[int]:
        """`slots` as ints, refused (ValueError) unless distinct live request slots or -1 (padding)."""
        slots = [int(x) for x in slots]
        live = [x for x in slots if x >= 0]
        if any(x != -1 and x not in self.requests for x in slots) or len(set(live)) != len(live):
            raise ValueError(f"request slots must be distinct live slots (or -1); unknown or repeated: {slots}")
        return slots

    def record_tables(self, slot: int) -> None:
        """Record a table update for `slot` (its current pages, length and hot buffer)."""
        r, mp, hot = self.requests[slot], self.spec.max_pages, None
        if self._synced_hot.get(slot) != tuple(r.hot):  # new hot pages: their slots' tags are cleared too
            hot = self._hot_row(r.hot)
            self._synced_hot[slot] = tuple(r.hot)
        self.updates.append(SetTables(slot, table_row(r.device, mp), table_row(r.host, mp), table_row(r.index, mp),
                                      self.lengths.get(slot, 0), hot, self.budget_spec.hot_rows))

    def _hot_row(self, hot: list[int]) -> np.ndarray:
        """The device's hot-page row (the capacity's width) for lent pages `hot` (the budget's, or none): past them
        the first lent page again, in slots past the hot-row budget that `device.set_tables` stamps so that no miss
        claims one and no position is found there; the resolver sees every page of the capacity's slots lent."""
        row = table_row(hot, self.spec.hot_pages)
        if hot:
            row[len(hot):] = hot[0]
        return row
