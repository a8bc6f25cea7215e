"""Whether requests fit a store's limits at all (exact, checked before anything changes): the request slots,
`max_seq_len`, the indexer pool, the host pool (every page mirrored) and the device pool (all pages, or tail pages
+ a hot buffer when pages can be evicted). Pure functions of the limits (a `StoreSpec`: `TieredCache.budget`) and
of whether pages can be evicted (`TieredCache.releasable`); they know no bookkeeping."""

from __future__ import annotations

from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.units import PAGE_SIZE

TAIL_PAGES = 2  # a request's last pages (being written) are never evicted


class BudgetError(ValueError):
    """A request can never fit the configured budgets (raised before anything is changed)."""


def min_device_pages(limits: StoreSpec, num_pages: int, *, releasable: bool) -> int:
    """Device pages a request of `num_pages` logical pages needs at the least: all of them, or (when pages
    can be evicted to the host) its last `TAIL_PAGES` plus its hot buffer, whichever is fewer."""
    return min(num_pages, TAIL_PAGES + limits.hot_pages) if releasable else num_pages


def check_batch_fits(limits: StoreSpec, num_tokens: list[int], *, releasable: bool) -> None:
    """`num_tokens`: the KV positions each request will hold at its longest (prompt + new tokens - 1: the
    last sampled token is never written). Raise BudgetError (naming the budget, what is needed and by how
    much it falls short) unless requests of these lengths can all be held at once, each at its full length.
    Exact: every smaller budget of that tier fails, and a batch that passes decodes to the end (pages are
    only ever added, and the cheapest way to hold a request never grows by more than the page it adds)."""
    n = [-(-t // PAGE_SIZE) for t in num_tokens]
    if len(n) > limits.max_seqs:
        raise BudgetError(f"max_seqs is too small: {len(n)} requests need {len(n)} request slots; max_seqs is "
                          f"{limits.max_seqs}, {len(n) - limits.max_seqs} short")
    too_long = [t for t in num_tokens if t > limits.max_pages * PAGE_SIZE]
    if too_long:
        raise BudgetError(f"max_seq_len is too small: a request needs {too_long[0]} KV positions; the store "
                          f"holds {limits.max_pages * PAGE_SIZE} per request")

    def shortfall(name: str, have: int, need: list[int], how: str) -> None:
        if sum(need) > have:
            what = (f"a {num_tokens[0]}-token request ({n[0]} pages)" if len(n) == 1 else
                    f"{len(n)} requests of {num_tokens} tokens ({n} pages)")
            parts = " + ".join(str(x) for x in need)
            raise BudgetError(f"{name} is too small: {what} need{'s' if len(n) == 1 else ''} "
                              f"{parts + ' = ' if len(need) > 1 else ''}{sum(need)} {how}; {name} is {have}, "
                              f"{sum(need) - have} short")

    shortfall("index_pages", limits.index_pages, n, "indexer pages (every page's keys are kept, " +
              ("in the host tier)" if limits.index_tier == "host" else "on the device)"))
    if limits.mirror_to_host:
        shortfall("host_pages", limits.host_pages, n, "host pages (every page is mirrored to the host)")
    dev = [min_device_pages(limits, k, releasable=releasable) for k in n]
    how = ("device pages (no page can be released)" if dev == n and not releasable else
           f"device pages at the least (all pages, or {TAIL_PAGES} tail pages + "
           f"{limits.hot_pages} hot-buffer pages, whichever is fewer)")
    shortfall("device_pages", limits.device_pages, dev, how)
