"""Host-side page allocation of the tiered paged KV store: which page of which pool belongs to whom. Pure NumPy /
stdlib, no JAX; decided on the host between jitted steps. Three pools (`Tier`), every page `PAGE_SIZE` (64) tokens
long, a page id naming the same page in every layer: `DEVICE` (the device KV pool: latent + rope rows of every
layer), `INDEX` (the indexer-key pool, on the device or pinned host with index_tier="host"; never evicted) and
`HOST` (the pinned-host KV pool). `PagePool` hands out, shares and frees their pages and registers full pages under
the hash chain of their tokens (`page_hash`); `RequestPages` is one request's view of its pages."""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import heapq
import operator
from typing import Any, Iterable, Sequence

import numpy as np

from hisparse_jax.memory import Cost, check_account
from hisparse_jax.units import INVALID

_HASH_BITS = 63   # page hashes are non-negative and fit an int64 (and JSON) exactly
# host bytes per page of each pool: an int32 refcount, and an int64 count while the invariants are checked
POOL_BYTES_PER_PAGE = 4 + 8


class PoolError(RuntimeError):
    """A page-pool bookkeeping error: double free, bad page id, broken invariant, bad saved state."""


class OutOfPages(PoolError):
    """`allocate` asked for more pages than the tier has free. Nothing was changed."""

    def __init__(self, tier: "Tier", requested: int, free: int, budget: int):
        self.tier, self.requested, self.free, self.budget = tier, requested, free, budget
        super().__init__(f"out of {tier.value} pages: asked for {requested}, {free} free "
                         f"(budget {budget}, {budget - free} in use)")


class Tier(enum.Enum):
    """Which page pool: device KV, device indexer keys, or pinned-host KV."""

    DEVICE = "device"
    INDEX = "index"
    HOST = "host"


def _as_tier(tier: Tier | str) -> Tier:
    try:
        return Tier(tier)
    except ValueError:
        raise ValueError(f"unknown tier {tier!r}; expected one of {[t.value for t in Tier]}") from None


def _as_int(x: Any, what: str) -> int:
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got {x!r}")
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(x).__name__} {x!r}") from None


def page_hash(prev_hash: int | None, tokens: Sequence[int]) -> int:
    """Hash of one page of `tokens` (int32 ids, normally exactly `PAGE_SIZE` of them) chained onto `prev_hash`, the
    previous page's `page_hash` (None for the first page of a sequence). A 63-bit non-negative int, deterministic
    across processes and machines (blake2b over the previous hash and the little-endian int32 token bytes; Python's
    salted `hash` is never used), and different for a different prefix, token order or first-page marker."""
    toks = np.asarray(tokens)
    if toks.ndim != 1 or toks.size == 0:
        raise ValueError(f"tokens must be a non-empty 1-D sequence of ints, got shape {toks.shape}")
    if not np.issubdtype(toks.dtype, np.integer):
        raise TypeError(f"tokens must be integers, got dtype {toks.dtype}")
    if toks.min() < -2 ** 31 or toks.max() >= 2 ** 31:
        raise ValueError(f"token ids must fit int32, got range [{toks.min()}, {toks.max()}]")
    h = hashlib.blake2b(digest_size=8, person=b"hisparse-page")
    prev = None if prev_hash is None else _as_int(prev_hash, "prev_hash")
    if prev is not None and not 0 <= prev < 2 ** 64:
        raise ValueError(f"prev_hash must be a page_hash value (0 <= h < 2**64), got {prev}")
    h.update(b"\x00" if prev is None else b"\x01" + prev.to_bytes(8, "little"))
    h.update(toks.astype("<i4").tobytes())
    return int.from_bytes(h.digest(), "little") >> (64 - _HASH_BITS)


class _TierState:
    """One pool. Pages >= `next_fresh` have never been handed out (all free); freed pages below it wait in the
    min-heap `returned`, or in `cached` (free pages still registered, least recently freed first). So "lowest free
    id first" costs O(log n) and the free list grows only with the pages ever touched, not with the budget (a host
    pool may hold millions of pages); the refcounts are one int32 per page of the pool (`POOL_BYTES_PER_PAGE`,
    checked before they exist)."""

    def __init__(self, tier: Tier, budget: int):
        self.tier, self.budget, self.refcount = tier, budget, np.zeros(budget, np.int32)
        self.returned: list[int] = []
        self.next_fresh = self.used = 0
        self.hash_to_page: dict[int, int] = {}
        self.page_to_hash: dict[int, int] = {}
        self.cached: dict[int, None] = {}

    @property
    def free(self) -> int:
        return self.budget - self.used

    def page(self, page: Any) -> int:
        """`page` as an int, refused (PoolError) outside the pool."""
        p = _as_int(page, "page id")
        if not 0 <= p < self.budget:
            what = "INVALID (-1)" if p == INVALID else str(p)
            raise PoolError(f"{self.tier.value} page {what} is out of range [0, {self.budget})")
        return p

    def unregister(self, p: int) -> None:
        h = self.page_to_hash.pop(p, None)
        if h is not None:
            del self.hash_to_page[h]

    def drop_cached(self, p: int) -> None:
        del self.cached[p]
        self.unregister(p)
        heapq.heappush(self.returned, p)


class PagePool:
    """Refcounted page allocator for the three pools, after nano-vllm's `BlockManager`: `allocate` hands out pages
    with refcount 1 (lowest free id first, so runs are reproducible), `incref` / `decref` / `free` share and release
    them, and a full page registered under the hash chain of its tokens can be reused by a later request with the
    same prefix (`lookup_prefix`, then `incref`). Budgets (`device_pages` / `index_pages` / `host_pages`) are in
    pages; the device and index pools need at least one, the host pool may be empty (a device-only store). Every
    method taking a `tier` accepts a `Tier` or its string value ("device", "index", "host").

    Without `retain_prefix` a registration lives exactly as long as its page. With it (vLLM's prefix caching), a
    registered page whose last owner lets go stays registered as a *cached free* page: it counts as free,
    `lookup_prefix` still finds it and `incref` revives it with its contents; `allocate` hands out never-registered
    free pages first and only then reclaims cached ones, least recently freed first (dropping their registration).
    Turning it off (`set_retain_prefix(False)`) drops them."""

    def __init__(self, device_pages: int, index_pages: int, host_pages: int, *, retain_prefix: bool = False):
        caps = {}
        for tier, n, lo in ((Tier.DEVICE, device_pages, 1), (Tier.INDEX, index_pages, 1), (Tier.HOST, host_pages, 0)):
            caps[tier] = _as_int(n, f"{tier.value}_pages")
            if caps[tier] < lo:
                raise ValueError(f"{tier.value}_pages must be >= {lo}, got {caps[tier]}")
        pages = ", ".join(f"{t.value}_pages={n:,}" for t, n in caps.items())
        check_account("the page pools' bookkeeping", [Cost("the page pools' bookkeeping",
                                                            POOL_BYTES_PER_PAGE * sum(caps.values()), "host", pages)])
        self._t = {tier: _TierState(tier, n) for tier, n in caps.items()}
        self.retain_prefix = bool(retain_prefix)

    def _s(self, tier: Tier | str) -> _TierState:
        return self._t[_as_tier(tier)]

    def set_retain_prefix(self, retain: bool) -> None:
        """Switch retention of freed prefix pages; switching it off frees every cached page for good."""
        self.retain_prefix = bool(retain)
        if not retain:
            for s in self._t.values():
                for p in list(s.cached):
                    s.drop_cached(p)

    def budget(self, tier: Tier | str) -> int:
        """Pages in the tier's pool."""
        return self._s(tier).budget

    def num_used(self, tier: Tier | str) -> int:
        """Pages with refcount >= 1."""
        return self._s(tier).used

    def num_free(self, tier: Tier | str) -> int:
        """Pages with refcount 0."""
        return self._s(tier).free

    def num_cached(self, tier: Tier | str) -> int:
        """Free pages kept registered for their prefix (reclaimed by `allocate` when nothing else is free)."""
        return len(self._s(tier).cached)

    def stats(self) -> dict[str, dict[str, int]]:
        """{tier value: {"budget", "used", "free", "prefix", "cached"}} in pages ("prefix": registered pages,
        in use or cached; "cached": free pages kept for their prefix, part of "free")."""
        return {t.value: {"budget": s.budget, "used": s.used, "free": s.free, "prefix": len(s.page_to_hash),
                          "cached": len(s.cached)} for t, s in self._t.items()}

    def __repr__(self) -> str:
        return f"PagePool(used/budget: {', '.join(f'{t.value}={s.used}/{s.budget}' for t, s in self._t.items())})"

    def can_allocate(self, tier: Tier | str, n: int) -> bool:
        """Whether `allocate(tier, n)` would succeed."""
        if (n := _as_int(n, "n")) < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        return n <= self._s(tier).free

    def allocate(self, tier: Tier | str, n: int) -> list[int]:
        """`n` free pages of `tier`, lowest id first (cached prefix pages last, least recently freed first, their
        registration dropped), each with refcount 1. Raises OutOfPages (naming the tier, `n` and the free count)
        and changes nothing when fewer than `n` pages are free."""
        s = self._s(tier)
        if not self.can_allocate(s.tier, n):
            raise OutOfPages(s.tier, int(n), s.free, s.budget)
        n = int(n)
        pages = [heapq.heappop(s.returned) for _ in range(min(n, len(s.returned)))]
        k = min(n - len(pages), s.budget - s.next_fresh)
        pages.extend(range(s.next_fresh, s.next_fresh + k))
        s.next_fresh += k
        while len(pages) < n:  # reclaim cached prefix pages, least recently freed first
            pages.append(p := next(iter(s.cached)))
            del s.cached[p]
            s.unregister(p)
        s.refcount[pages] = 1
        s.used += n
        return pages

    def refcount(self, tier: Tier | str, page: int) -> int:
        """Owners of `page` (0 when free)."""
        s = self._s(tier)
        return int(s.refcount[s.page(page)])

    def refcounts(self, tier: Tier | str) -> np.ndarray:
        """Every page's refcount in `tier` (a read-only view: int32[budget])."""
        (rc := self._s(tier).refcount.view()).flags.writeable = False
        return rc

    def incref(self, tier: Tier | str, page: int) -> None:
        """One more owner of an in-use page (prefix sharing), or the first owner of a cached free prefix page
        (revived with its contents). Any other free page must be allocated instead."""
        s = self._s(tier)
        p = s.page(page)
        if s.refcount[p] == 0:
            if p not in s.cached:
                raise PoolError(f"incref of free {s.tier.value} page {p}; allocate it instead")
            del s.cached[p]
            s.used += 1
        s.refcount[p] += 1

    def decref(self, tier: Tier | str, page: int) -> bool:
        """One owner fewer. Returns True when the page became free (its prefix registration is dropped).
        Raises PoolError for a page that is already free (double free) or out of range."""
        s = self._s(tier)
        if s.refcount[p := s.page(page)] == 0:
            raise PoolError(f"double free: {s.tier.value} page {p} is already free")
        self.free(s.tier, [p])
        return bool(s.refcount[p] == 0)

    def free(self, tier: Tier | str, pages: Iterable[int]) -> None:
        """`decref` every page in `pages` (a page listed twice loses two references). All-or-nothing: if any
        id is out of range (INVALID included) or would be freed more often than it is referenced, raises
        PoolError before changing anything."""
        s = self._s(tier)
        counts = collections.Counter(s.page(p) for p in pages)
        for p, k in counts.items():
            if k > s.refcount[p]:
                state = "already free" if s.refcount[p] == 0 else f"refcount {s.refcount[p]}"
                raise PoolError(f"double free: {s.tier.value} page {p} freed {k} time(s) but {state}")
        for p, k in counts.items():
            s.refcount[p] -= k
            if s.refcount[p]:
                continue
            s.used -= 1
            if self.retain_prefix and p in s.page_to_hash:
                s.cached[p] = None  # most recently freed last
            else:
                heapq.heappush(s.returned, p)
                s.unregister(p)

    def register_prefix(self, tier: Tier | str, h: int, page: int) -> None:
        """Register the full, in-use `page` as holding the tokens whose hash chain ends in `h` (again: a no-op). If
        `h` already names another page, the newer page takes it (the old page stays allocated, unregistered). A page
        registered under another hash raises PoolError (a full page's content does not change). Registration holds
        no reference: it is dropped when the page is freed."""
        s = self._s(tier)
        p, h = s.page(page), _as_int(h, "prefix hash")
        if s.refcount[p] == 0:
            raise PoolError(f"cannot register free {s.tier.value} page {p} as a prefix page")
        if s.page_to_hash.get(p, h) != h:
            raise PoolError(f"{s.tier.value} page {p} is already registered under hash {s.page_to_hash[p]}, not {h}")
        old_p = s.hash_to_page.get(h, p)
        if old_p in s.cached:
            s.drop_cached(old_p)
        elif old_p != p:
            del s.page_to_hash[old_p]
        s.hash_to_page[h], s.page_to_hash[p] = p, h

    def lookup_prefix(self, tier: Tier | str, h: int) -> int | None:
        """The page registered under hash `h` (in use, or cached free with `retain_prefix`), or None. On a hit
        the caller must `incref` it before anything is allocated."""
        return self._s(tier).hash_to_page.get(_as_int(h, "prefix hash"))

    def prefix_maps(self, tier: Tier | str) -> tuple[dict[int, int], dict[int, int]]:
        """Copies of `tier`'s registrations both ways, ({hash: page}, {page: hash} by page id): every registered
        page, in use or cached free."""
        s = self._s(tier)
        return dict(s.hash_to_page), dict(sorted(s.page_to_hash.items()))

    def free_list(self, tier: Tier | str) -> tuple[list[int], int]:
        """(the freed pages below the watermark that wait for reuse, lowest id first, not counting the cached ones;
        the watermark: pages at or above it were never handed out), for `kv.audit`."""
        s = self._s(tier)
        return sorted(s.returned), s.next_fresh

    def cached_pages(self, tier: Tier | str) -> list[int]:
        """The cached free prefix pages of `tier`, in the order `allocate` reclaims them (least recently freed
        first)."""
        return list(self._s(tier).cached)

    def prefix_hash(self, tier: Tier | str, page: int) -> int | None:
        """The hash `page` is registered under, or None."""
        s = self._s(tier)
        return s.page_to_hash.get(s.page(page))


@dataclasses.dataclass
class RequestPages:
    """One request's pages. Index i of `device` / `host` / `index` is logical page i (tokens [i * PAGE_SIZE,
    (i + 1) * PAGE_SIZE)): `device` the device KV page holding it (INVALID when it lives only on the host), `host`
    the pinned-host KV page holding it (or INVALID), `index` its indexer-key page (never released). `hot`: device
    KV pages lent to the request's hot buffer (where host pages selected by top-k are loaded), of no logical page."""

    device: list[int] = dataclasses.field(default_factory=list)
    host: list[int] = dataclasses.field(default_factory=list)
    index: list[int] = dataclasses.field(default_factory=list)
    hot: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise PoolError unless device/host/index have one entry per logical page and every logical page has
        an indexer page and at least one KV copy (device or host)."""
        if not len(self.device) == len(self.host) == len(self.index):
            raise PoolError(f"RequestPages lists differ in length: device {len(self.device)}, "
                            f"host {len(self.host)}, index {len(self.index)}")
        for i, (d, h, x) in enumerate(zip(self.device, self.host, self.index)):
            if min(d, h, x) < INVALID:
                raise PoolError(f"logical page {i}: negative page id other than INVALID ({d}, {h}, {x})")
            if x == INVALID:
                raise PoolError(f"logical page {i} has no indexer page")
            if d == INVALID and h == INVALID:
                raise PoolError(f"logical page {i} has neither a device nor a host KV page")
        if min(self.hot, default=0) < 0:
            raise PoolError(f"hot buffer holds an invalid page id: {self.hot}")

    @property
    def num_pages(self) -> int:
        """Logical pages."""
        return len(self.device)

    def append(self, *, index: int, device: int = INVALID, host: int = INVALID) -> int:
        """Add one logical page; returns its logical index."""
        self.device.append(device), self.host.append(host), self.index.append(index)
        try:
            self.validate()
        except PoolError:
            del self.device[-1], self.host[-1], self.index[-1]
            raise
        return self.num_pages - 1

    def resident_pages(self) -> list[int]:
        """Logical page indices with a device KV page (readable without a host->device copy)."""
        return [i for i, d in enumerate(self.device) if d != INVALID]

    def host_only_pages(self) -> list[int]:
        """Logical page indices whose KV lives only on the host."""
        return [i for i, d in enumerate(self.device) if d == INVALID]

    def owned(self, tier: Tier | str) -> list[int]:
        """The valid page ids this request holds in `tier` (DEVICE: KV pages then hot-buffer pages), one entry
        per reference: what to pass to `PagePool.free` when the request finishes."""
        t = _as_tier(tier)
        pages = {Tier.DEVICE: self.device, Tier.HOST: self.host, Tier.INDEX: self.index}[t]
        return [p for p in pages if p != INVALID] + (list(self.hot) if t is Tier.DEVICE else [])

    def release(self, pool: PagePool) -> None:
        """Free every page the request holds in every tier and clear its lists."""
        owned = {t: self.owned(t) for t in Tier}
        for t in Tier:  # validate all tiers before freeing any: all-or-nothing per call of free, tier by tier
            rc = pool.refcounts(t)
            for p, k in collections.Counter(owned[t]).items():
                if not 0 <= p < rc.size or k > rc[p]:
                    raise PoolError(f"request holds {t.value} page {p} x{k}, but the pool does not agree "
                                    f"(budget {rc.size})")
        for t in Tier:
            pool.free(t, owned[t])
        self.device.clear(), self.host.clear(), self.index.clear(), self.hot.clear()
