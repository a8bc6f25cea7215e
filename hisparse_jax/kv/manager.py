"""`TieredCache`: the host-side bookkeeping of a tiered KV store — admission, tail-page reservation, release
under pressure, swap, prefix sharing. NumPy only: it never calls jit and never reads a device array.

It decides which pages exist where (`PagePool`) and records what the device tables must become as ordered
`updates` (`kv.updates`); the owner of the `KVStore` applies them (`kv.device.apply_updates`) before the next
device call. Byte counts (host→device page loads, device→host prompt writes) follow from the page lists.

Residency rule: a request's pages stay on the device until the pool runs low. Then sealed pages (never the last
two, which are being written) whose host copy is current are released, coldest first (`kv.eviction`); a
request with a released page first gets its hot buffer (`hot_rows` slots, lent from the same device pool).

Prefix caching (`prefix_caching = True`, `kv.prefix`): full pages of prompt tokens are registered under the
hash chain of their tokens and shared (refcounted) by later requests; a freed registered page stays cached until
the pool needs it. Under pressure a device page held by several requests is released from all its holders at
once (each reading it through its hot buffer).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from hisparse_jax.config import CacheConfig, ModelConfig
from hisparse_jax.units import PAGE_SIZE
from hisparse_jax.kv import budget, eviction, invariants, prefix, swap
from hisparse_jax.kv.eviction import TAIL_PAGES, oldest_first
from hisparse_jax.kv.pool import OutOfPages, PagePool, PoolError, RequestPages, Tier
from hisparse_jax.units import INVALID
from hisparse_jax.kv.prefix import PrefixHit
from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.kv.account import bookkeeping_costs
from hisparse_jax.memory import check_account
from hisparse_jax.kv.updates import ClearStamps, ReleasePages, SetTables, Update, pad_pow2, table_row


class TieredCache:
    """The page bookkeeping of one tiered store: its `PagePool` (`.pool`), each request slot's pages (`.requests`)
    and length (`.lengths`), and the device-table `updates` not yet applied.

    `.spec` is the store's geometry (its arrays' shapes: the `CacheConfig`'s capacity when it has one) and `.budget`
    the limits this bookkeeping enforces inside it (the `CacheConfig`'s own numbers): the pools hand out
    `budget.device_pages` / `host_pages` / `index_pages` pages, `budget.max_seqs` slots take requests of up to
    `budget.max_pages` pages, and a hot buffer has `budget.hot_rows` slots. Without a capacity the two are equal."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, *,
                 victim_order: Callable[["TieredCache", int], list[int]] = oldest_first):
        """The bookkeeping's own arrays are checked against the RAM before they exist (`kv.account`); the store's
        device and host arrays, and the step's temporaries, are the caller's account (`generate`, the engines:
        `kv.account.check_store_memory`, before they make this)."""
        if not isinstance(model, ModelConfig):
            raise TypeError(f"model must be a ModelConfig, got {type(model).__name__}")
        if not isinstance(cache, CacheConfig):
            raise TypeError(f"cache must be a CacheConfig, got {type(cache).__name__}")
        self.model_cfg, self.cache = model, cache
        self.spec = StoreSpec.create(model, cache)
        self.budget = StoreSpec.create(model, cache.replace(capacity=None))
        check_account("the host bookkeeping", bookkeeping_costs(self.spec))  # before its arrays exist
        self.pool = PagePool(self.budget.device_pages, self.budget.index_pages, self.budget.host_pages)
        self.requests: dict[int, RequestPages] = {}
        self.lengths: dict[int, int] = {}
        self.victim_order = victim_order
        self.evicted_pages = 0
        self.h2d_bytes = 0  # page loads (swap-ins, host-only prefix pages); decode misses are in the step stats
        self.d2h_bytes = 0  # prompt rows written to the host (decode mirror bytes are in the step stats)
        self.resident_only: set[int] = set()  # slots that must stay fully resident (being prefilled, or policy says so)
        self.swapped: set[int] = set()  # slots swapped out whole (no device page until swap_in)
        # release single cold pages under pressure (HiSparse); off = a request is resident whole or not at all
        self.partial_eviction = True
        self.prefix_hashes: dict[int, list[int]] = {}  # slot -> hash chain of its registered / shared pages
        self.cached_tokens: dict[int, int] = {}  # slot -> prompt tokens shared at admission (not recomputed)
        self.updates: list[Update] = []  # device-table updates decided and not yet applied, in order
        # host copy of the device's indexer-recency stamps (per slot and logical page), for "recency" coldness
        self.page_stamps = np.full((self.spec.max_seqs, self.spec.max_pages), -1, np.int32)
        self._growing: tuple[int, int] | None = None  # (slot, pages being added) during _grow
        self._synced_hot: dict[int, tuple[int, ...]] = {}  # slot -> hot pages last sent to the device

    @classmethod
    def restore(cls, model: ModelConfig, cache: CacheConfig, *, pool: PagePool, requests: dict[int, RequestPages],
                lengths: dict[int, int], evicted_pages: int = 0, d2h_bytes: int = 0, prefix_caching: bool = False,
                swapped=(), prefix_hashes: dict | None = None, cached_tokens: dict | None = None) -> "TieredCache":
        """A manager in a saved state (`kv.persist`) whose tables are already on the device: no updates pending.
        Raises PoolError when the state is inconsistent."""
        c = cls(model, cache)
        c.pool, c.requests, c.lengths = pool, dict(requests), dict(lengths)
        c.evicted_pages, c.d2h_bytes = evicted_pages, d2h_bytes
        c.prefix_caching = prefix_caching
        c.swapped = set(swapped)
        c.prefix_hashes = {s: list(h) for s, h in (prefix_hashes or {}).items()}
        c.cached_tokens = dict(cached_tokens or {})
        c._synced_hot = {s: tuple(r.hot) for s, r in c.requests.items()}
        c.check_invariants()
        return c

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
        return self.budget.hot_pages

    @property
    def all_layers_page_bytes(self) -> int:
        """Bytes of one logical page's KV in every layer (what a whole-page copy between the tiers moves)."""
        return self.spec.num_layers * self.spec.page_bytes

    def min_device_pages(self, num_pages: int) -> int:
        """See `kv.budget.min_device_pages`."""
        return budget.min_device_pages(self, num_pages)

    def free_slots(self) -> list[int]:
        return [s for s in range(self.budget.max_seqs) if s not in self.requests]

    def growing(self, slot: int) -> int:
        """Pages a growth of `slot` in progress is about to add (0 outside `reserve` / `admit`)."""
        return self._growing[1] if self._growing and self._growing[0] == slot else 0

    # ----- admission -----------------------------------------------------------------------------
    def check_fits(self, num_tokens: int) -> None:
        """See `kv.budget.check_fits`."""
        budget.check_fits(self, num_tokens)

    def check_batch_fits(self, num_tokens: list[int]) -> None:
        """See `kv.budget.check_batch_fits`."""
        budget.check_batch_fits(self, num_tokens)

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
            raise PoolError(f"all {self.budget.max_seqs} request slots are in use")
        slot = slots[0]
        self.requests[slot] = RequestPages()
        self.lengths[slot] = 0
        self.cached_tokens[slot] = 0
        if resident:
            self.resident_only.add(slot)
        try:
            if tokens is not None and self.prefix_caching:
                prefix.share_prefix(self, slot, prefix.match_prefix(self, tokens))
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

    def match_prefix(self, tokens) -> list[PrefixHit]:
        """See `kv.prefix.match_prefix`."""
        return prefix.match_prefix(self, tokens)

    def register_prefix(self, slot: int, tokens) -> int:
        """See `kv.prefix.register_prefix`."""
        return prefix.register_prefix(self, slot, tokens)

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
        self.check_fits(num_tokens)
        self._grow(slot, num_tokens)

    def can_reserve(self, slot: int, num_tokens: int) -> bool:
        """Whether `reserve` would succeed now without evicting anything."""
        r = self.requests[slot]
        new = max(-(-num_tokens // PAGE_SIZE) - r.num_pages, 0)
        return (self.pool.num_free(Tier.DEVICE) >= new and self.pool.num_free(Tier.INDEX) >= new
                and (not self.spec.mirror_to_host or self.pool.num_free(Tier.HOST) >= new))

    def keep_resident(self, slot: int) -> None:
        """Keep every page of `slot` resident (a prompt being written chunk by chunk): none is released."""
        self.resident_only.add(slot)

    def allow_release(self, slot: int) -> None:
        """Undo `keep_resident`: `slot`'s sealed pages may be released again."""
        self.resident_only.discard(slot)

    # ----- swap ----------------------------------------------------------------------------------
    def swap_out(self, slot: int) -> int:
        """See `kv.swap.swap_out`."""
        return swap.swap_out(self, slot)

    def swap_in(self, slot: int) -> int:
        """See `kv.swap.swap_in`."""
        return swap.swap_in(self, slot)

    def resident_pages_needed(self, slot: int) -> int:
        """Device pages `slot` would need to be fully resident."""
        return len(self.requests[slot].host_only_pages())

    # ----- lengths and release -------------------------------------------------------------------
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
        self.lengths.pop(slot, None)
        self._synced_hot.pop(slot, None)
        self.prefix_hashes.pop(slot, None)
        self.cached_tokens.pop(slot, None)
        mp = self.spec.max_pages
        self.updates.append(SetTables(slot, table_row([], mp), table_row([], mp), table_row([], mp), 0,
                                      table_row([], self.spec.hot_pages), 0))
        self.updates.append(ClearStamps(slot))
        self.page_stamps[slot] = -1

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
        # on the host (as if written and evicted) when the device is short — unless the slot is resident-only
        must = new if slot in self.resident_only else min(new, TAIL_PAGES)
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
                raise OutOfPages(Tier.DEVICE, new, free, self.budget.device_pages)
        index = self.pool.allocate(Tier.INDEX, new)
        host = self.pool.allocate(Tier.HOST, new) if mirror else [INVALID] * new
        if k < new:
            self._ensure_hot(slot)
        device = [INVALID] * (new - k) + self.pool.allocate(Tier.DEVICE, k)
        for i in range(new):
            r.append(index=index[i], device=device[i], host=host[i])
        self.record_tables(slot)

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
                eviction.evict_until(self, need(goal), exclude=slot if goal == new and goal != must else None)
        if self.pool.num_free(Tier.DEVICE) < min(need(new), need(must)):
            raise OutOfPages(Tier.DEVICE, need(must), self.pool.num_free(Tier.DEVICE), self.budget.device_pages)

    def evictable_pages(self, slot: int) -> list[int]:
        """See `kv.eviction.evictable_pages`."""
        return eviction.evictable_pages(self, slot)

    def evict_until(self, free_target: int, exclude: int | None = None) -> None:
        """See `kv.eviction.evict_until`."""
        eviction.evict_until(self, free_target, exclude)

    def shared_release_candidates(self, exclude: int | None = None) -> list[tuple[int, list[tuple[int, int]]]]:
        """See `kv.eviction.shared_release_candidates`."""
        return eviction.shared_release_candidates(self, exclude)

    def _ensure_hot(self, slot: int) -> None:
        r = self.requests[slot]
        if r.hot:
            return
        r.hot.extend(self.pool.allocate(Tier.DEVICE, self.hot_pages_per_request))
        self.record_tables(slot)

    def evict(self, slot: int, logical_pages: list[int]) -> None:
        """Release the device copies of `slot`'s logical pages (their host copies must be current). A page
        shared with other requests loses only this request's reference (it stays resident for them).

        A request reads released pages through its hot buffer, so one without a hot buffer gets it here, from
        the device pages this frees or the free ones; if they cannot hold it, PoolError and nothing changes."""
        r = self.requests[slot]
        growing = self.growing(slot)
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
                raise OutOfPages(Tier.DEVICE, self.hot_pages_per_request - freed, free, self.budget.device_pages)
        # every released page has a current host copy (checked above): the device copy is dropped, nothing copied
        self.updates.append(ReleasePages(pad_pow2([slot] * len(logical_pages)), pad_pow2(list(logical_pages))))
        for i in logical_pages:
            self.pool.free(Tier.DEVICE, [r.device[i]])
            r.device[i] = INVALID
        self.evicted_pages += len(logical_pages)
        self._ensure_hot(slot)  # also syncs the tables when the buffer is new

    # ----- device tables -------------------------------------------------------------------------
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
        unknown = [x for x in slots if x != -1 and x not in self.requests]
        if unknown or len(set(live)) != len(live):
            raise ValueError(f"request slots must be distinct live slots (or -1); unknown or repeated: {slots}")
        return slots

    def record_tables(self, slot: int) -> None:
        """Record a table update for `slot` (its current pages, length and hot buffer)."""
        r = self.requests[slot]
        mp = self.spec.max_pages
        hot = None
        if self._synced_hot.get(slot) != tuple(r.hot):  # new hot pages: their slots' tags are cleared too
            hot = self._hot_row(r.hot)
            self._synced_hot[slot] = tuple(r.hot)
        self.updates.append(SetTables(slot, table_row(r.device, mp), table_row(r.host, mp), table_row(r.index, mp),
                                      self.lengths.get(slot, 0), hot, self.budget.hot_rows))

    def _hot_row(self, hot: list[int]) -> np.ndarray:
        """The device's hot-page row (the capacity's width) for lent pages `hot` (the budget's, or none): past them
        the first lent page again. The slots there are past the hot-row budget: `ops.set_tables` stamps them so
        that no miss ever claims one and no position is ever found there, so that page is never written or read
        through them; the resolver sees every page of the capacity's slots lent."""
        row = table_row(hot, self.spec.hot_pages)
        if hot:
            row[len(hot):] = hot[0]
        return row

    # ----- checks --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The host bookkeeping is consistent (`kv.invariants.check_manager`); the device tables are checked
        against it by `kv.device.check_tables`."""
        invariants.check_manager(self)
