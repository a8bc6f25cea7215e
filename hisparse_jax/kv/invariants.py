"""Consistency checks of a `TieredCache` (tests, debugging, `EngineConfig(check_invariants=True)`, restore):
the host bookkeeping alone (`check_manager`), and the device tables against it (`check_tables`, given the
tables read back from a `KVStore`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hisparse_jax.units import PAGE_SIZE
from hisparse_jax.kv.eviction import TAIL_PAGES
from hisparse_jax.kv.pool import PoolError, Tier, owners_of
from hisparse_jax.units import INVALID

if TYPE_CHECKING:
    from hisparse_jax.kv.manager import TieredCache


def check_manager(manager: "TieredCache") -> None:
    """Pool consistent with the requests (no leak, no double ownership); every page has a copy somewhere; a
    request with released pages has a hot buffer (unless swapped out whole); tail pages resident; prefix
    registrations name the pages' own hashes; lengths covered by pages."""
    manager.pool.check_invariants(owners_of(manager.requests.values()))
    for s, r in manager.requests.items():
        n = r.num_pages
        released = [i for i in range(n) if r.device[i] == INVALID]
        if released and not r.hot and s not in manager.swapped:
            raise PoolError(f"slot {s}: pages {released[:8]} are released but the request has no hot buffer "
                            "to read them through")
        for i in range(n):
            if r.device[i] == INVALID and r.host[i] == INVALID:
                raise PoolError(f"slot {s}: page {i} has no copy anywhere")
        chain = manager.prefix_hashes.get(s, [])
        if len(chain) > n:
            raise PoolError(f"slot {s}: {len(chain)} prefix hashes for {n} pages")
        for i, h in enumerate(chain):  # a registered page holds the tokens its hash names
            for tier, page in ((Tier.INDEX, r.index[i]), (Tier.DEVICE, r.device[i]), (Tier.HOST, r.host[i])):
                got = manager.pool.prefix_hash(tier, page) if page != INVALID else None
                if got is not None and got != h:
                    raise PoolError(f"slot {s}: {tier.value} page {page} (logical {i}) is registered under "
                                    f"hash {got}, but the slot's page {i} has hash {h}")
        length = manager.lengths[s]
        if n < -(-length // PAGE_SIZE):
            raise PoolError(f"slot {s}: {length} tokens but only {n} pages")
        for i in range(max(n - TAIL_PAGES, 0), n):
            if length > i * PAGE_SIZE and r.device[i] == INVALID and s not in manager.swapped:
                raise PoolError(f"slot {s}: tail page {i} is not resident")


def check_tables(manager: "TieredCache", block_table, host_table, index_table, hot_pages, seq_lens) -> None:
    """The device tables (NumPy copies) equal the host's view: page rows, hot pages, lengths."""
    for s in range(manager.spec.max_seqs):
        r = manager.requests.get(s)
        n = r.num_pages if r else 0
        for name, table, want in (("block", block_table, r.device if r else []),
                                  ("host", host_table, r.host if r else []),
                                  ("index", index_table, r.index if r else [])):
            if list(table[s, :n]) != list(want) or np.any(table[s, n:] != -1):
                raise PoolError(f"slot {s}: device {name} table {table[s, :n + 1].tolist()} != host view {want}")
        if r:
            # the row is the capacity's width: the budget's lent pages, then (slots past the hot-row budget) the
            # first lent page again, or -1 throughout while none is lent
            row, k = hot_pages[s].tolist(), len(r.hot)
            past = r.hot[0] if r.hot else INVALID
            if sorted(row[:k]) != sorted(r.hot) or any(x != past for x in row[k:]):
                raise PoolError(f"slot {s}: hot pages {row} != {r.hot} (then {past} past the budget's)")
            if seq_lens[s] != manager.lengths[s]:
                raise PoolError(f"slot {s}: store seq_len {seq_lens[s]} != {manager.lengths[s]}")
