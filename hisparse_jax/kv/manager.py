"""`TieredCache`: the host-side owner of a `KVStore` — admission, tail-page reservation, eviction, release.

Everything here runs between jitted steps, on the host, in NumPy: it decides which pages exist where
(`PagePool`), mirrors the decisions into the device tables with small jitted updates, and never reads a
pool. The device step never allocates.

Residency rule: a request's pages stay on the device until the pool runs low. Then sealed pages (never
the last two, which are being written) whose host copy is current are released, coldest first; a
request with a released page first gets its hot buffer (`hot_rows` slots, lent from the same device
pool). Coldness is pluggable (`victim_order`): the default releases the oldest logical pages first.

Prefix caching (`prefix_caching = True`): a full page of tokens whose rows are written is registered under
the hash chain of its tokens (`page_hash`) in every tier that holds it — its indexer-key page, its device
page, its host page. A request admitted with `tokens=` shares the longest run of registered pages (one
reference more on each: `incref`), never the page of its last token (whose logits must be computed), and
skips writing them; `cached_tokens[slot]` says how many tokens that covers. Shared pages are immutable (only
full pages are shared; decode writes past them). A request releases a shared page by dropping its own
reference. When the last reference goes the page is free but stays registered, as a cached page that later
requests can still share, until the pool needs it (cached pages are reclaimed last, least recently freed
first, and then lose their registration). Under pressure a device page held by several requests is not
released by one of them alone (that frees nothing): requests give their own cold pages first, then shared
pages are released from all their holders at once (each holder reading them through its hot buffer). A
prefix page found only on the host is loaded into a fresh device page of the new request (and registered
there), since a prompt is resident while it is prefilled.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.config import PAGE_SIZE, CacheConfig, ModelConfig
from hisparse_jax.kv import ops
from hisparse_jax.kv.pool import (INVALID, OutOfPages, PagePool, PoolError, RequestPages, Tier, owners_of,
                                  page_hash)
from hisparse_jax.kv.state import KVStore, StoreSpec, init_store

TAIL_PAGES = 2


class PrefixHit(NamedTuple):
    """One registered page a prompt can share: its hash and its page in each tier (INVALID where none)."""

    hash: int
    index: int
    device: int
    host: int


class BudgetError(ValueError):
    """A request can never fit the configured budgets (raised before anything is changed)."""


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_tables(store, req, block_row, host_row, index_row, seq_len, hot_row):
    return ops.set_tables(store, req, block_row, host_row, index_row, seq_len, hot_row)


@functools.partial(jax.jit, donate_argnums=(0,))
def _clear_page_stamps(store, req):
    return ops._replace(store, page_stamp=store.page_stamp.at[req].set(-1))


@functools.partial(jax.jit, donate_argnums=(0,))
def _evict(store, req, page_idx):
    return ops.evict_pages(store.spec, store, req, page_idx)


@functools.partial(jax.jit, donate_argnums=(0,))
def _load_pages(store, hpages, dpages):
    return ops.load_pages(store.spec, store, hpages, dpages)


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_prefill(store, req, latent, rope, index_k, length, start):
    return ops.write_prefill(store.spec, store, req, latent, rope, index_k, length, start)


def _pad_pow2(values: list[int], fill: int = -1) -> np.ndarray:
    n = max(1, 1 << max(len(values) - 1, 0).bit_length())
    out = np.full(n, fill, np.int32)
    out[:len(values)] = values
    return out


def oldest_first(cache: "TieredCache", slot: int) -> list[int]:
    """Default coldness: a request's evictable logical pages, oldest first (vLLM's release order)."""
    return cache.evictable_pages(slot)


def least_recently_selected(cache: "TieredCache", slot: int) -> list[int]:
    """Indexer-recency coldness: evictable pages ordered by the last step the indexer selected any of their
    positions (never selected first; ties -> older page first). Reads one small table from the device."""
    stamps = np.asarray(cache.store.page_stamp[slot])
    pages = cache.evictable_pages(slot)
    return sorted(pages, key=lambda i: (int(stamps[i]), i))


COLDNESS = {"oldest": oldest_first, "recency": least_recently_selected}


class TieredCache:
    """Owns a `KVStore` (`.store`, device + pinned host) and its `PagePool` (`.pool`)."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, *, device=None,
                 victim_order: Callable[["TieredCache", int], list[int]] = oldest_first):
        self.model_cfg, self.cache_cfg = model, cache
        self.spec = StoreSpec.create(model, cache)
        self.store: KVStore = init_store(self.spec, device)
        self.pool = PagePool(self.spec.device_pages, self.spec.index_pages, self.spec.host_pages)
        self.requests: dict[int, RequestPages] = {}
        self.lengths: dict[int, int] = {}
        self.victim_order = victim_order
        self.evicted_pages = 0
        self.h2d_bytes = 0  # swap-ins (decode misses are in the step stats)
        self.pinned: set[int] = set()
        self.swapped: set[int] = set()  # slots swapped out whole (no device page until swap_in)
        self._growing: tuple[int, int] | None = None  # (slot, pages being added) during _grow
        # release single cold pages under pressure (HiSparse); off = a request is resident whole or not at all
        self.partial_eviction = True  # slots that must stay fully resident (being prefilled, or policy says so)
        self._synced_hot: dict[int, tuple[int, ...]] = {}
        self.d2h_bytes = 0  # prefill host writes + write-backs (decode mirror bytes are in the step stats)
        self.prefix_hashes: dict[int, list[int]] = {}  # slot -> hash chain of its registered / shared pages
        self.cached_tokens: dict[int, int] = {}  # slot -> prompt tokens shared at admission (not recomputed)

    @property
    def prefix_caching(self) -> bool:
        """Register written full pages and share them at admission (`admit(..., tokens=...)`); freed registered
        pages stay cached (reclaimed last) so a later request can still find them."""
        return self.pool.retain_prefix

    @prefix_caching.setter
    def prefix_caching(self, on: bool) -> None:
        self.pool.set_retain_prefix(on)

    # ----- sizes ---------------------------------------------------------------------------------
    @property
    def hot_pages_per_request(self) -> int:
        return self.spec.hot_pages

    def min_device_pages(self, num_pages: int) -> int:
        """Device pages a request of `num_pages` logical pages needs at the least: all of them, or (when pages
        can be released to the host) its last `TAIL_PAGES` plus its hot buffer, whichever is fewer."""
        if not self.spec.mirror_to_host or not self.partial_eviction:
            return num_pages
        return min(num_pages, TAIL_PAGES + self.hot_pages_per_request)

    def free_slots(self) -> list[int]:
        return [s for s in range(self.spec.max_seqs) if s not in self.requests]

    # ----- admission -----------------------------------------------------------------------------
    def check_fits(self, num_tokens: int) -> None:
        """Raise BudgetError when a request of `num_tokens` tokens can never be held, even alone."""
        self.check_batch_fits([num_tokens])

    def check_batch_fits(self, num_tokens: list[int]) -> None:
        """`num_tokens`: the cache positions each request will hold at its longest (prompt + new tokens - 1: the
        last sampled token is never written). Raise BudgetError (naming the budget, what is needed and by how
        much it falls short) unless requests of these lengths can all be held at once, each at its full length. Exact: every smaller budget of that
        tier fails, and a batch that passes decodes to the end (pages are only ever added, and the cheapest way
        to hold a request never grows by more than the page it adds)."""
        spec = self.spec
        n = [-(-t // PAGE_SIZE) for t in num_tokens]
        if len(n) > spec.max_seqs:
            raise BudgetError(f"max_seqs is too small: {len(n)} requests need {len(n)} request slots; max_seqs is "
                              f"{spec.max_seqs}, {len(n) - spec.max_seqs} short")
        too_long = [t for t in num_tokens if t > spec.max_pages * PAGE_SIZE]
        if too_long:
            raise BudgetError(f"max_seq_len is too small: a request needs {too_long[0]} cache positions; the store "
                              f"holds {spec.max_pages * PAGE_SIZE} per request")

        def shortfall(name: str, have: int, need: list[int], how: str) -> None:
            if sum(need) > have:
                what = (f"a {num_tokens[0]}-token request ({n[0]} pages)" if len(n) == 1 else
                        f"{len(n)} requests of {num_tokens} tokens ({n} pages)")
                parts = " + ".join(str(x) for x in need)
                raise BudgetError(f"{name} is too small: {what} need{'s' if len(n) == 1 else ''} "
                                  f"{parts + ' = ' if len(need) > 1 else ''}{sum(need)} {how}; {name} is {have}, "
                                  f"{sum(need) - have} short")

        shortfall("index_pages", spec.index_pages, n, "indexer pages (every page's keys stay on the device)")
        if spec.mirror_to_host:
            shortfall("host_pages", spec.host_pages, n, "host pages (every page is mirrored to the host)")
        dev = [self.min_device_pages(k) for k in n]
        how = ("device pages (no page can be released)" if dev == n and not
               (spec.mirror_to_host and self.partial_eviction) else
               f"device pages at the least (all pages, or {TAIL_PAGES} tail pages + "
               f"{self.hot_pages_per_request} hot-buffer pages, whichever is fewer)")
        shortfall("device_pages", spec.device_pages, dev, how)

    def admit(self, num_tokens: int, *, resident: bool = False, tokens=None) -> int:
        """Reserve a slot and pages for a prompt of `num_tokens` tokens; returns the slot. With `resident`, every
        page is placed on the device (else older pages may start on the host when the device is short).

        tokens: the prompt's token ids. With `prefix_caching` on, the longest run of registered full pages of
        `tokens` is shared (made resident) instead of allocated; `cached_tokens[slot]` is the tokens it covers
        and the slot's length is at least that. Without `tokens` nothing is shared.
        Raises BudgetError (never fits), or OutOfPages / PoolError when it does not fit *now* (nothing changed).
        """
        self.check_fits(max(num_tokens, len(tokens) if tokens is not None else 0))
        slots = self.free_slots()
        if not slots:
            raise PoolError(f"all {self.spec.max_seqs} request slots are in use")
        slot = slots[0]
        self.requests[slot] = RequestPages()
        self.lengths[slot] = 0
        self.cached_tokens[slot] = 0
        if resident:
            self.pinned.add(slot)
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
                self.pinned.discard(slot)
        self.lengths[slot] = num_tokens
        self._sync(slot)
        return slot

    # ----- prefix caching ------------------------------------------------------------------------
    def match_prefix(self, tokens) -> list[PrefixHit]:
        """The registered pages `tokens` could share: the longest run of full pages from the start whose hash
        chain is registered with an indexer page and a KV copy (with the host mirror on: a host copy), never
        the page holding the last token. One `PrefixHit` per page, in order. Read-only."""
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        out, h = [], None
        for i in range(max(len(tokens) - 1, 0) // PAGE_SIZE):
            h = page_hash(h, tokens[i * PAGE_SIZE:(i + 1) * PAGE_SIZE])
            x = self.pool.lookup_prefix(Tier.INDEX, h)
            d = self.pool.lookup_prefix(Tier.DEVICE, h)
            hp = self.pool.lookup_prefix(Tier.HOST, h) if self.spec.mirror_to_host else None
            if x is None or (hp is None if self.spec.mirror_to_host else d is None):
                break
            out.append(PrefixHit(h, x, INVALID if d is None else d, INVALID if hp is None else hp))
        return out

    def _share_prefix(self, slot: int, hits: list[PrefixHit]) -> None:
        """Take one reference on each hit page (reviving cached free ones); load host-only ones into fresh device
        pages (registered there)."""
        r = self.requests[slot]
        assert r.num_pages == 0, "prefix pages are shared into an empty request"
        rc = self.pool.refcounts(Tier.DEVICE)

        def free_after_revival():  # reviving cached device pages uses up free pages too
            return self.pool.num_free(Tier.DEVICE) - sum(1 for x in hits if x.device != INVALID and rc[x.device] == 0)

        loads = [i for i, x in enumerate(hits) if x.device == INVALID]
        if loads and free_after_revival() < len(loads) and self.partial_eviction:
            self._evict_until(self.pool.num_free(Tier.DEVICE) - free_after_revival() + len(loads), exclude=slot)
            # an eviction may have freed a hit page (it stays cached, and registered, unless reclaimed)
            hits = [x if x.device == INVALID or self.pool.lookup_prefix(Tier.DEVICE, x.hash) == x.device
                    else x._replace(device=INVALID) for x in hits]
            loads = [i for i, x in enumerate(hits) if x.device == INVALID]
        # share as far as the pages that must be loaded can be had (a shorter prefix is still a prefix)
        free = max(free_after_revival(), 0)
        if len(loads) > free:
            hits, loads = hits[:loads[free]], loads[:free]
        for x in hits:  # references first: a cached page must be revived before anything is allocated
            self.pool.incref(Tier.INDEX, x.index)
            if x.host != INVALID:
                self.pool.incref(Tier.HOST, x.host)
            if x.device != INVALID:
                self.pool.incref(Tier.DEVICE, x.device)
        fresh = self.pool.allocate(Tier.DEVICE, len(loads))
        for i, d in zip(loads, fresh):
            hits[i] = hits[i]._replace(device=d)
            self.pool.register_prefix(Tier.DEVICE, hits[i].hash, d)
        for x in hits:
            r.append(index=x.index, device=x.device, host=x.host)
        if loads:
            hpg = _pad_pow2([hits[i].host for i in loads])
            self.store, rows = _load_pages(self.store, jnp.asarray(hpg), jnp.asarray(_pad_pow2(fresh)))
            self.h2d_bytes += int(rows) * self.spec.row_bytes
        self.prefix_hashes[slot] = [x.hash for x in hits]
        self.cached_tokens[slot] = len(hits) * PAGE_SIZE

    def register_prefix(self, slot: int, tokens) -> int:
        """Register `slot`'s full pages of `tokens` (whose rows must be written: positions < len(tokens)) as
        prefix pages in every tier that holds them. Returns the number of pages registered. No-op unless
        `prefix_caching` is on."""
        if not self.prefix_caching:
            return 0
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        r = self.requests[slot]
        n = min(len(tokens) // PAGE_SIZE, r.num_pages)
        chain = self.prefix_hashes.setdefault(slot, [])
        for i in range(n):
            if i == len(chain):
                chain.append(page_hash(chain[-1] if chain else None, tokens[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]))
            h = chain[i]
            for tier, page in ((Tier.INDEX, r.index[i]), (Tier.DEVICE, r.device[i]), (Tier.HOST, r.host[i])):
                # a hash already naming a page (another request's, or cached) keeps it: no churn
                if page != INVALID and self.pool.lookup_prefix(tier, h) is None:
                    self.pool.register_prefix(tier, h, page)
        return n

    def write_prefill(self, slot: int, latent, rope, index_k, length: int, start: int = 0) -> None:
        """Write a prompt's rows (latent [L, T, C], rope [L, T, R], index_k [LI, T, dI]; row t is position t)
        for positions start..length-1 into `slot`. `start` must not be below the slot's shared prefix
        (`cached_tokens[slot]`): shared pages are never written."""
        if length != self.lengths[slot]:
            raise ValueError(f"slot {slot} was admitted for {self.lengths[slot]} tokens, got {length}")
        if not self.cached_tokens.get(slot, 0) <= start <= length:
            raise PoolError(f"slot {slot}: write_prefill start {start} must lie in [{self.cached_tokens.get(slot, 0)} "
                            f"(its shared prefix tokens), {length}]; shared pages are never written")
        self.store, rows = _write_prefill(self.store, jnp.int32(slot), latent, rope, index_k, jnp.int32(length),
                                          jnp.int32(start))
        self.d2h_bytes += int(rows) * self.spec.row_bytes

    def admit_prefilled(self, latent, rope, index_k, length: int, *, tokens=None) -> int:
        """`admit` a prompt of `length` tokens and `write_prefill` its rows computed outside the store (e.g. by
        `generate.prefill_rows`); with `tokens` (and `prefix_caching` on) its full pages are registered for later
        requests. Returns the slot."""
        slot = self.admit(length)
        self.write_prefill(slot, latent, rope, index_k, length)
        if tokens is not None:
            self.register_prefix(slot, tokens)
        return slot

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Make positions < num_tokens writable (tail pages resident; every page when `slot` is pinned)
        before a step writes them."""
        self.check_fits(num_tokens)
        self._grow(slot, num_tokens)

    def can_reserve(self, slot: int, num_tokens: int) -> bool:
        """Whether `reserve` would succeed now without evicting anything."""
        r = self.requests[slot]
        new = max(-(-num_tokens // PAGE_SIZE) - r.num_pages, 0)
        return (self.pool.num_free(Tier.DEVICE) >= new and self.pool.num_free(Tier.INDEX) >= new
                and (not self.spec.mirror_to_host or self.pool.num_free(Tier.HOST) >= new))

    def swap_out(self, slot: int) -> int:
        """Release every device page of `slot` (host copies must be current: needs the eager mirror); the
        request keeps its indexer pages and host pages. Returns the number of pages released."""
        if not self.spec.mirror_to_host:
            raise PoolError("swap_out needs mirror_to_host (host copies of every page)")
        r = self.requests[slot]
        pages = [i for i in range(r.num_pages) if r.device[i] != INVALID]
        for i in pages:
            self.pool.free(Tier.DEVICE, [r.device[i]])
            r.device[i] = INVALID
        if r.hot:
            self.pool.free(Tier.DEVICE, r.hot)
            r.hot.clear()
        self.evicted_pages += len(pages)
        self.swapped.add(slot)
        self._sync(slot)
        return len(pages)

    def swap_in(self, slot: int) -> int:
        """Bring every host-only page of `slot` back to the device (whole-page H2D copies). Raises OutOfPages
        (nothing changed) when the device pool cannot hold them. Returns the pages loaded."""
        r = self.requests[slot]
        chain = self.prefix_hashes.get(slot, [])
        shared = {}  # prefix pages still on the device (another request's, or cached): take a reference, no copy
        for i in r.host_only_pages():
            d = self.pool.lookup_prefix(Tier.DEVICE, chain[i]) if i < len(chain) else None
            if d is not None:
                shared[i] = d
        missing = [i for i in r.host_only_pages() if i not in shared]
        rc = self.pool.refcounts(Tier.DEVICE)
        need = len(missing) + sum(1 for d in shared.values() if rc[d] == 0)
        if not self.pool.can_allocate(Tier.DEVICE, need):
            raise OutOfPages(Tier.DEVICE, need, self.pool.num_free(Tier.DEVICE), self.spec.device_pages)
        self.swapped.discard(slot)
        for i, d in shared.items():
            self.pool.incref(Tier.DEVICE, d)
            r.device[i] = d
        if missing:
            dev = self.pool.allocate(Tier.DEVICE, len(missing))
            hp = _pad_pow2([r.host[i] for i in missing])
            dp = _pad_pow2(dev)
            self.store, rows = _load_pages(self.store, jnp.asarray(hp), jnp.asarray(dp))
            self.h2d_bytes += int(rows) * self.spec.row_bytes
            for i, d in zip(missing, dev):
                r.device[i] = d
                if i < len(chain):
                    self.pool.register_prefix(Tier.DEVICE, chain[i], d)
        self._sync(slot)
        return len(missing) + len(shared)

    def resident_pages_needed(self, slot: int) -> int:
        """Device pages `slot` would need to be fully resident."""
        return len(self.requests[slot].host_only_pages())

    def advance(self, slots, n: int = 1) -> None:
        """Record that a step (or `n` steps) appended one token to each of `slots`."""
        for s in slots:
            self.lengths[s] += n

    def release(self, slot: int) -> None:
        """Free every page of a finished or aborted request and clear its tables."""
        r = self.requests.pop(slot)
        self.pinned.discard(slot)
        self.swapped.discard(slot)
        r.release(self.pool)
        self.lengths.pop(slot, None)
        self._synced_hot.pop(slot, None)
        self.prefix_hashes.pop(slot, None)
        self.cached_tokens.pop(slot, None)
        mp = self.spec.max_pages
        self.store = _set_tables(self.store, jnp.int32(slot), jnp.full((mp,), -1, jnp.int32),
                                 jnp.full((mp,), -1, jnp.int32), jnp.full((mp,), -1, jnp.int32), jnp.int32(0),
                                 jnp.full((self.spec.hot_pages,), -1, jnp.int32))
        self.store = _clear_page_stamps(self.store, jnp.int32(slot))

    # ----- growth and eviction -------------------------------------------------------------------
    def _grow(self, slot: int, num_tokens: int) -> None:
        r = self.requests[slot]
        n = -(-num_tokens // PAGE_SIZE)
        new = n - r.num_pages
        if new <= 0:
            return
        mirror = self.spec.mirror_to_host
        if not self.pool.can_allocate(Tier.INDEX, new):
            raise OutOfPages(Tier.INDEX, new, self.pool.num_free(Tier.INDEX), self.pool.capacity(Tier.INDEX))
        if mirror and not self.pool.can_allocate(Tier.HOST, new):
            raise OutOfPages(Tier.HOST, new, self.pool.num_free(Tier.HOST), self.pool.capacity(Tier.HOST))
        # device pages for the new pages: at most the last TAIL_PAGES must be resident; older ones may start
        # on the host (as if written and evicted) when the device is short — unless the slot is pinned
        must = new if slot in self.pinned else min(new, TAIL_PAGES)
        self._growing = (slot, new)
        try:
            self._make_room(slot, new, must, n)
        finally:
            self._growing = None
        free = self.pool.num_free(Tier.DEVICE)
        if free >= new:
            k = new  # all resident (a request with host-only pages already has its hot buffer)
        else:  # the oldest new pages start on the host; the request needs its hot buffer
            k = min(new, free - (0 if r.hot else self.hot_pages_per_request))
            if k < must or not mirror:
                raise OutOfPages(Tier.DEVICE, new, free, self.spec.device_pages)
        index = self.pool.allocate(Tier.INDEX, new)
        host = self.pool.allocate(Tier.HOST, new) if mirror else [INVALID] * new
        if k < new:
            self._ensure_hot(slot)
        device = [INVALID] * (new - k) + self.pool.allocate(Tier.DEVICE, k)
        for i in range(new):
            r.append(index=index[i], device=device[i], host=host[i])
        self._sync(slot)

    def _make_room(self, slot: int, new: int, must: int, n_total: int) -> None:
        """Evict cold pages (other requests first) until `must` new device pages (plus this request's hot
        buffer if it will need one) can be allocated; best effort up to `new`. Raises OutOfPages, changing
        nothing, when even `must` cannot be had (or partial eviction is off and the pool is short)."""
        def need(goal):
            r = self.requests[slot]
            resident_after = len(r.resident_pages()) + goal
            hot = 0 if r.hot or resident_after >= n_total else self.hot_pages_per_request
            return goal + hot

        if self.partial_eviction and self.spec.mirror_to_host:
            for goal in (new, must):
                if self.pool.num_free(Tier.DEVICE) >= need(goal):
                    break
                self._evict_until(need(goal), exclude=slot if goal == new and goal != must else None)
        if self.pool.num_free(Tier.DEVICE) < min(need(new), need(must)):
            raise OutOfPages(Tier.DEVICE, need(must), self.pool.num_free(Tier.DEVICE), self.spec.device_pages)

    def evictable_pages(self, slot: int) -> list[int]:
        """Logical pages of `slot` that may be released now: resident, sealed (not among the last two — counting
        the pages a growth in progress is about to add), with a current host copy, and held by this request
        alone (releasing a shared page frees nothing). Oldest first."""
        r = self.requests[slot]
        growing = self._growing[1] if self._growing and self._growing[0] == slot else 0
        limit = min(r.num_pages + growing - TAIL_PAGES, r.num_pages)  # pages being added are not there yet
        rc = self.pool.refcounts(Tier.DEVICE)
        return [i for i in range(max(limit, 0)) if r.device[i] != INVALID and r.host[i] != INVALID
                and rc[r.device[i]] == 1]

    def _evict_until(self, free_target: int, exclude: int | None = None) -> None:
        """Release cold pages until `free_target` device pages are free (or nothing more can be released).
        Requests that already have a hot buffer give first (every release is a net gain); one without pays
        for its hot buffer out of the pages it releases, so it is used only when it has more than that."""
        nh = self.hot_pages_per_request
        while self.pool.num_free(Tier.DEVICE) < free_target:
            cands = []
            for s in self.requests:
                if s == exclude or s in self.pinned:
                    continue
                n = len(self.evictable_pages(s))
                has_hot = bool(self.requests[s].hot)
                if n and (has_hot or n > nh):
                    cands.append((has_hot, n, s))
            if not cands:
                if not self._release_shared_page(exclude):
                    return
                continue
            _, _, s = max(cands)
            r = self.requests[s]
            if not r.hot:  # the hot buffer is lent from the pages being released (evict allocates it)
                self.evict(s, self.victim_order(self, s)[:nh])
            missing = free_target - self.pool.num_free(Tier.DEVICE)
            if missing > 0:
                self.evict(s, self.victim_order(self, s)[:missing])

    def shared_release_candidates(self, exclude: int | None = None) -> list[tuple[int, list[tuple[int, int]]]]:
        """Device pages held by several requests that all of them may release now: sealed for every holder,
        with a host copy, no holder pinned (or `exclude`). Returns [(page, [(slot, logical page)])], oldest
        (lowest logical page) first."""
        rc = self.pool.refcounts(Tier.DEVICE)
        holders: dict[int, list[tuple[int, int, bool]]] = {}
        for s, r in self.requests.items():
            growing = self._growing[1] if self._growing and self._growing[0] == s else 0
            limit = r.num_pages + growing - TAIL_PAGES
            for i, d in enumerate(r.device):
                if d != INVALID and rc[d] > 1:
                    ok = i < limit and r.host[i] != INVALID and s not in self.pinned and s != exclude
                    holders.setdefault(d, []).append((s, i, ok))
        out = [(d, [(s, i) for s, i, _ in hs]) for d, hs in holders.items()
               if len(hs) == rc[d] and all(ok for _, _, ok in hs)]
        return sorted(out, key=lambda x: (min(i for _, i in x[1]), x[0]))

    def _release_shared_page(self, exclude: int | None) -> bool:
        """Release one shared device page from every holder (HiSparse under pressure, once no request has a
        page of its own left to give). Holders without a hot buffer get one first, when the pool can lend
        it. Returns whether anything changed."""
        nh = self.hot_pages_per_request
        for d, holders in self.shared_release_candidates(exclude):
            need = nh * sum(1 for s, _ in holders if not self.requests[s].hot)
            if need > self.pool.num_free(Tier.DEVICE):
                continue
            for s, i in holders:
                self.evict(s, [i])
            return True
        return False

    def _ensure_hot(self, slot: int) -> None:
        r = self.requests[slot]
        if r.hot:
            return
        r.hot.extend(self.pool.allocate(Tier.DEVICE, self.hot_pages_per_request))
        self._sync(slot)

    def evict(self, slot: int, logical_pages: list[int]) -> None:
        """Release the device copies of `slot`'s logical pages (their host copies must be current). A page
        shared with other requests loses only this request's reference (it stays resident for them).

        A request reads released pages through its hot buffer, so one without a hot buffer gets it here, from
        the device pages this frees or the free ones; if they cannot hold it, PoolError and nothing changes."""
        r = self.requests[slot]
        growing = self._growing[1] if self._growing and self._growing[0] == slot else 0
        if slot in self.swapped:
            raise PoolError(f"slot {slot} is swapped out: it has no device pages to release")
        if len(set(logical_pages)) != len(logical_pages):
            raise PoolError(f"slot {slot}: repeated pages in {logical_pages}")
        for i in logical_pages:
            if not 0 <= i < r.num_pages + growing - TAIL_PAGES:
                raise PoolError(f"slot {slot}: page {i} is not a released-able page (one of the last {TAIL_PAGES} "
                                f"pages being written, or past the request's {r.num_pages})")
            if r.device[i] == INVALID or r.host[i] == INVALID:
                raise PoolError(f"slot {slot}: page {i} is not resident with a host copy")
        if not logical_pages:
            return
        if not r.hot:
            freed = sum(self.pool.refcount(Tier.DEVICE, r.device[i]) == 1 for i in logical_pages)
            free = self.pool.num_free(Tier.DEVICE)
            if free + freed < self.hot_pages_per_request:  # the hot buffer would not fit: change nothing
                raise OutOfPages(Tier.DEVICE, self.hot_pages_per_request - freed, free, self.spec.device_pages)
        req = _pad_pow2([slot] * len(logical_pages))
        idx = _pad_pow2(list(logical_pages))
        self.store, d2h = _evict(self.store, jnp.asarray(req), jnp.asarray(idx))
        self.d2h_bytes += int(d2h) * self.spec.row_bytes
        for i in logical_pages:
            self.pool.free(Tier.DEVICE, [r.device[i]])
            r.device[i] = INVALID
        self.evicted_pages += len(logical_pages)
        self._ensure_hot(slot)  # also syncs the tables when the buffer is new

    # ----- checked row-level access (trace replays, tests) ----------------------------------------
    def _req_array(self, slots) -> jnp.ndarray:
        slots = [int(x) for x in slots]
        unknown = [x for x in slots if x != -1 and x not in self.requests]
        if unknown or len(set(x for x in slots if x >= 0)) != len([x for x in slots if x >= 0]):
            raise ValueError(f"request slots must be distinct live slots (or -1); unknown or repeated: {slots}")
        return jnp.asarray(slots, jnp.int32)

    def append(self, slots, latent, rope, index_k) -> None:
        """Append one token to each of `slots` (all layers): latent [L, B, C], rope [L, B, R], index_k [LI, B, dI].
        Reserves tail pages (evicting if needed), writes the device pages and the host mirror."""
        req = self._req_array(slots)
        for s in slots:
            if s >= 0:
                self.reserve(s, self.lengths[s] + 1)
        self.store = _append_all(self.store, req, latent, rope, index_k)
        self.advance([s for s in slots if s >= 0])

    def gather(self, slots, topk):
        """Resolve `topk` (int32[B, K]: positions, -1 padding) for each slot in every indexer group — resident
        reads, hot hits, misses fetched from host — and return the rows of every layer:
        (latent f32[L, B, K, C], rope f32[L, B, K, R], valid bool[B, K], payload_h2d_bytes).
        Advances the LRU clock like a decode step. Raises ValueError on positions outside [0, seq_len)."""
        req = self._req_array(slots)
        swapped = [x for x in slots if x in self.swapped]
        if swapped:
            raise ValueError(f"slots {swapped} are swapped out (no device pages, no hot buffer): swap_in first")
        topk = np.asarray(topk, np.int32)
        if topk.ndim != 2 or topk.shape[0] != len(slots):
            raise ValueError(f"topk must be int32[{len(slots)}, K], got shape {topk.shape}")
        if topk.shape[1] > self.spec.hot_rows:
            raise ValueError(f"K={topk.shape[1]} exceeds hot_rows={self.spec.hot_rows}")
        for b, s in enumerate(slots):
            row = topk[b][topk[b] != -1]
            bad = row[(row < 0) | (row >= (self.lengths[s] if s >= 0 else 0))]
            if bad.size:
                raise ValueError(f"slot {s}: top-k positions {bad[:8].tolist()} are outside [0, "
                                 f"{self.lengths.get(s, 0)})")
            if len(set(row.tolist())) != row.size:
                raise ValueError(f"slot {s}: repeated top-k positions")
        self.store, lat, rope, valid, rows = _gather_all(self.store, req, jnp.asarray(topk))
        return lat, rope, valid, int(rows) * self.spec.row_bytes

    # ----- device tables -------------------------------------------------------------------------
    def _sync(self, slot: int) -> None:
        r = self.requests[slot]
        mp = self.spec.max_pages

        def row(v):
            out = np.full(mp, -1, np.int32)
            out[:len(v)] = v
            return jnp.asarray(out)

        hot = np.full(self.spec.hot_pages, -1, np.int32)
        hot[:len(r.hot)] = r.hot
        # set_tables also clears the hot-slot tags: only when the hot buffer itself changed
        if self._synced_hot.get(slot) == tuple(r.hot):
            self.store = _set_rows(self.store, jnp.int32(slot), row(r.device), row(r.host), row(r.index),
                                   jnp.int32(self.lengths.get(slot, 0)))
        else:
            self.store = _set_tables(self.store, jnp.int32(slot), row(r.device), row(r.host), row(r.index),
                                     jnp.int32(self.lengths.get(slot, 0)), jnp.asarray(hot))
            self._synced_hot[slot] = tuple(r.hot)

    # ----- checks --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Pool consistent with the requests (no leak, no double ownership); device tables equal the host's
        view; every released page has a host copy; the store's lengths match."""
        self.pool.check_invariants(owners_of(self.requests.values()))
        bt, ht, it = (np.asarray(x) for x in (self.store.block_table, self.store.host_table, self.store.index_table))
        hp, sl = np.asarray(self.store.hot_pages), np.asarray(self.store.seq_lens)
        for s in range(self.spec.max_seqs):
            r = self.requests.get(s)
            n = r.num_pages if r else 0
            for name, table, want in (("block", bt, r.device if r else []), ("host", ht, r.host if r else []),
                                      ("index", it, r.index if r else [])):
                if list(table[s, :n]) != list(want) or np.any(table[s, n:] != -1):
                    raise PoolError(f"slot {s}: device {name} table {table[s, :n + 1].tolist()} != host view {want}")
            if r:
                released = [i for i in range(n) if r.device[i] == INVALID]
                if released and not r.hot and s not in self.swapped:
                    raise PoolError(f"slot {s}: pages {released[:8]} are released but the request has no hot buffer "
                                    "to read them through")
                if sorted(hp[s][hp[s] >= 0].tolist()) != sorted(r.hot):
                    raise PoolError(f"slot {s}: hot pages {hp[s].tolist()} != {r.hot}")
                if sl[s] != self.lengths[s]:
                    raise PoolError(f"slot {s}: store seq_len {sl[s]} != {self.lengths[s]}")
                for i in range(n):
                    if r.device[i] == INVALID and r.host[i] == INVALID:
                        raise PoolError(f"slot {s}: page {i} has no copy anywhere")
                chain = self.prefix_hashes.get(s, [])
                if len(chain) > n:
                    raise PoolError(f"slot {s}: {len(chain)} prefix hashes for {n} pages")
                for i, h in enumerate(chain):  # a registered page holds the tokens its hash names
                    for tier, page in ((Tier.INDEX, r.index[i]), (Tier.DEVICE, r.device[i]), (Tier.HOST, r.host[i])):
                        got = self.pool.prefix_hash(tier, page) if page != INVALID else None
                        if got is not None and got != h:
                            raise PoolError(f"slot {s}: {tier.value} page {page} (logical {i}) is registered under "
                                            f"hash {got}, but the slot's page {i} has hash {h}")
                if n < -(-self.lengths[s] // PAGE_SIZE):
                    raise PoolError(f"slot {s}: {self.lengths[s]} tokens but only {n} pages")
                for i in range(max(n - TAIL_PAGES, 0), n):
                    if self.lengths[s] > i * PAGE_SIZE and r.device[i] == INVALID and s not in self.swapped:
                        raise PoolError(f"slot {s}: tail page {i} is not resident")


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_rows(store, slot, block_row, host_row, index_row, seq_len):
    return ops._replace(store, block_table=store.block_table.at[slot].set(block_row),
                        host_table=store.host_table.at[slot].set(host_row),
                        index_table=store.index_table.at[slot].set(index_row),
                        seq_lens=store.seq_lens.at[slot].set(seq_len))


@functools.partial(jax.jit, donate_argnums=(0,))
def _append_all(store, req, latent, rope, index_k):
    spec = store.spec
    positions = jnp.where(req >= 0, store.seq_lens[jnp.maximum(req, 0)], -1)
    slot = 0
    for layer, kind in enumerate(_indexer_kinds(spec)):
        k = index_k[slot] if kind else None
        store, _ = ops.append_rows(spec, store, layer, slot if kind else None, req, positions, latent[layer],
                                   rope[layer], k)
        slot += kind
    if spec.mirror_to_host:
        store, _ = ops.mirror_rows(spec, store, req, positions)
    seq_lens = store.seq_lens.at[jnp.where(req >= 0, req, spec.max_seqs)].add(1, mode="drop")
    return ops._replace(store, seq_lens=seq_lens)


def _indexer_kinds(spec):
    """1 for the leader (full indexer) layer of each group, else 0."""
    leaders = {g[0] for g in spec.groups}
    return [int(layer in leaders) for layer in range(spec.num_layers)]


@functools.partial(jax.jit, donate_argnums=(0,))
def _gather_all(store, req, topk):
    spec = store.spec
    lats, ropes, valid, total = [None] * spec.num_layers, [None] * spec.num_layers, None, 0
    for g, layers in enumerate(spec.groups):
        plan, store = ops.resolve(spec, store, g, req, topk)
        store, payload, _ = ops.fetch_misses(spec, store, layers, plan)
        total = total + payload
        for layer in layers:
            lats[layer], ropes[layer] = ops.gather_rows(spec, store, layer, plan)
        # the next group's fetch updates the pools in place: its reads must come first, or XLA copies the pools
        store, lats, ropes = jax.lax.optimization_barrier((store, lats, ropes))
        valid = plan.valid
    store = ops._replace(store, clock=store.clock + 1)
    return store, jnp.stack(lats), jnp.stack(ropes), valid, total
