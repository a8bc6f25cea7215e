"""Whether requests fit a `TieredCache`'s budgets at all (exact, checked before anything changes): the request
slots, `max_seq_len`, the indexer pool, the host pool (every page mirrored) and the device pool (all pages, or
tail pages + a hot buffer when pages can be released)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hisparse_jax.units import PAGE_SIZE
from hisparse_jax.kv.eviction import TAIL_PAGES

if TYPE_CHECKING:
    from hisparse_jax.kv.manager import TieredCache


class BudgetError(ValueError):
    """A request can never fit the configured budgets (raised before anything is changed)."""


def min_device_pages(manager: "TieredCache", num_pages: int) -> int:
    """Device pages a request of `num_pages` logical pages needs at the least: all of them, or (when pages
    can be released to the host) its last `TAIL_PAGES` plus its hot buffer, whichever is fewer."""
    if not manager.budget.mirror_to_host or not manager.partial_eviction:
        return num_pages
    return min(num_pages, TAIL_PAGES + manager.hot_pages_per_request)


def check_fits(manager: "TieredCache", num_tokens: int) -> None:
    """Raise BudgetError when a request of `num_tokens` tokens can never be held, even alone."""
    manager.check_batch_fits([num_tokens])


def check_batch_fits(manager: "TieredCache", num_tokens: list[int]) -> None:
    """`num_tokens`: the KV positions each request will hold at its longest (prompt + new tokens - 1: the
    last sampled token is never written). Raise BudgetError (naming the budget, what is needed and by how
    much it falls short) unless requests of these lengths can all be held at once, each at its full length.
    Exact: every smaller budget of that tier fails, and a batch that passes decodes to the end (pages are
    only ever added, and the cheapest way to hold a request never grows by more than the page it adds)."""
    spec = manager.budget
    n = [-(-t // PAGE_SIZE) for t in num_tokens]
    if len(n) > spec.max_seqs:
        raise BudgetError(f"max_seqs is too small: {len(n)} requests need {len(n)} request slots; max_seqs is "
                          f"{spec.max_seqs}, {len(n) - spec.max_seqs} short")
    too_long = [t for t in num_tokens if t > spec.max_pages * PAGE_SIZE]
    if too_long:
        raise BudgetError(f"max_seq_len is too small: a request needs {too_long[0]} KV positions; the store "
                          f"holds {spec.max_pages * PAGE_SIZE} per request")

    def shortfall(name: str, have: int, need: list[int], how: str) -> None:
        if sum(need) > have:
            what = (f"a {num_tokens[0]}-token request ({n[0]} pages)" if len(n) == 1 else
                    f"{len(n)} requests of {num_tokens} tokens ({n} pages)")
            parts = " + ".join(str(x) for x in need)
            raise BudgetError(f"{name} is too small: {what} need{'s' if len(n) == 1 else ''} "
                              f"{parts + ' = ' if len(need) > 1 else ''}{sum(need)} {how}; {name} is {have}, "
                              f"{sum(need) - have} short")

    shortfall("index_pages", spec.index_pages, n, "indexer pages (every page's keys are kept, " +
              ("in the host tier)" if spec.index_tier == "host" else "on the device)"))
    if spec.mirror_to_host:
        shortfall("host_pages", spec.host_pages, n, "host pages (every page is mirrored to the host)")
    dev = [manager.min_device_pages(k) for k in n]
    how = ("device pages (no page can be released)" if dev == n and not
           (spec.mirror_to_host and manager.partial_eviction) else
           f"device pages at the least (all pages, or {TAIL_PAGES} tail pages + "
           f"{manager.hot_pages_per_request} hot-buffer pages, whichever is fewer)")
    shortfall("device_pages", spec.device_pages, dev, how)
