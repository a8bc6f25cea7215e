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
from typing import Any, Iterable, Mapping, Sequence

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

    def registrations(self, tier: Tier | str) -> dict[int, int]:
        """{page: hash} of every registered page of `tier` (in use, or cached free), by page id."""
        return dict(sorted(self._s(tier).page_to_hash.items()))

    def cached_pages(self, tier: Tier | str) -> list[int]:
        """The cached free prefix pages of `tier`, in the order `allocate` reclaims them (least recently freed
        first)."""
        return list(self._s(tier).cached)

    def prefix_hash(self, tier: Tier | str, page: int) -> int | None:
        """The hash `page` is registered under, or None."""
        s = self._s(tier)
        return s.page_to_hash.get(s.page(page))

    def check_invariants(self, owners: Mapping[Tier | str, Iterable[Iterable[int]]] | None = None) -> None:
        """Raise PoolError (with the tier, the page and the numbers) if the bookkeeping is inconsistent. Always
        checked, per tier: refcounts >= 0; a page is free iff its refcount is 0; the free list has no duplicates and
        no out-of-range ids; used + free == budget; prefix registrations are one-to-one, on in-use pages.

        owners: for some or all tiers, an iterable of per-owner page lists (per-request block tables, hot buffers...;
        INVALID entries are skipped). For each tier given, every page's refcount must equal the number of times the
        owners reference it (prefix sharing: k > 1): fewer is a leak, more is double ownership, and a referenced
        page must not be free."""
        for s in self._t.values():
            self._check_tier(s)
        for tier, lists in (owners or {}).items():
            s = self._s(tier)
            refs = np.zeros(s.budget, np.int64)
            for i, lst in enumerate(lists):
                arr = np.asarray(lst if isinstance(lst, np.ndarray) else list(lst)).reshape(-1)
                if arr.size and not np.issubdtype(arr.dtype, np.integer):
                    raise PoolError(f"owner {i} of tier {s.tier.value} holds non-integer page ids ({arr.dtype})")
                arr = arr[arr != INVALID].astype(np.int64)
                if (bad := arr[(arr < 0) | (arr >= s.budget)]).size:
                    raise PoolError(f"owner {i} references {s.tier.value} page {int(bad[0])}, out of range "
                                    f"[0, {s.budget})")
                np.add.at(refs, arr, 1)
            if (bad := np.flatnonzero(refs != s.refcount)).size == 0:
                continue
            msgs = [f"page {p} is referenced by {k} owner(s) but is free" if r == 0 else
                    f"page {p} is referenced {k} times but has refcount {r} (double ownership)" if k > r else
                    f"page {p} has refcount {r} but only {k} owner reference(s) (leaked)"
                    for p, k, r in zip(bad[:5].tolist(), refs[bad[:5]].tolist(), s.refcount[bad[:5]].tolist())]
            more = f" (+{bad.size - 5} more)" if bad.size > 5 else ""
            raise PoolError(f"{s.tier.value} pool disagrees with its owners: " + "; ".join(msgs) + more)

    def _check_tier(self, s: _TierState) -> None:
        name, rc, nf = s.tier.value, s.refcount, s.next_fresh
        if rc.shape != (s.budget,):
            raise PoolError(f"{name}: refcount table has shape {rc.shape}, budget is {s.budget}")
        if (rc < 0).any():
            raise PoolError(f"{name}: page {(p := int(np.argmax(rc < 0)))} has negative refcount {int(rc[p])}")
        if not 0 <= nf <= s.budget:
            raise PoolError(f"{name}: fresh-page watermark {nf} outside [0, {s.budget}]")
        if (rc[nf:] != 0).any():
            raise PoolError(f"{name}: never-allocated page {(p := nf + int(np.argmax(rc[nf:] != 0)))} has refcount "
                            f"{int(rc[p])}")
        # the free pages below the watermark: each once in the free list, either returned or cached
        free = np.asarray(s.returned + list(s.cached), np.int64)
        if (out := free[(free < 0) | (free >= nf)]).size:
            raise PoolError(f"{name}: free list holds page ids outside [0, {nf}): {sorted(out.tolist())[:5]}")
        if (bad := np.flatnonzero((times := np.bincount(free, minlength=nf)) != (rc[:nf] == 0))).size:
            p = int(bad[0])
            raise PoolError(f"{name}: page {p} " + ("is in the free list more than once" if times[p] > 1 else
                                                   f"is in the free list but has refcount {int(rc[p])}" if times[p]
                                                   else "has refcount 0 but is not in the free list (lost page)"))
        if s.cached and not self.retain_prefix:
            raise PoolError(f"{name}: {len(s.cached)} cached free pages but retain_prefix is off")
        if unreg := [p for p in s.cached if p not in s.page_to_hash]:
            raise PoolError(f"{name}: cached free page {unreg[0]} has no prefix registration")
        used, nfree = int(np.count_nonzero(rc)), free.size + (s.budget - nf)
        if used != s.used or used + nfree != s.budget:
            raise PoolError(f"{name}: used {used} (counter {s.used}) + free {nfree} != budget {s.budget}")
        if len(s.hash_to_page) != len(s.page_to_hash):
            raise PoolError(f"{name}: prefix maps disagree ({len(s.hash_to_page)} hashes, "
                            f"{len(s.page_to_hash)} pages)")
        for h, p in s.hash_to_page.items():
            if s.page_to_hash.get(p) != h:
                raise PoolError(f"{name}: hash {h} -> page {p}, but page {p} -> hash {s.page_to_hash.get(p)}")
            if not 0 <= p < s.budget or (rc[p] == 0 and p not in s.cached):
                raise PoolError(f"{name}: prefix hash {h} names page {p}, which is free (not cached) or out of range")


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


def owners_of(requests: Iterable[RequestPages]) -> dict[Tier, list[list[int]]]:
    """The `owners` argument of `PagePool.check_invariants` for a batch of requests: per tier, one page list
    per request (DEVICE includes hot-buffer pages)."""
    reqs = list(requests)
    return {t: [r.owned(t) for r in reqs] for t in Tier}
