"""Prefix caching for a `TieredCache`: find, share and register full prompt pages by the hash chain of their
tokens (`pool.page_hash`), in every tier that holds them.

A full page of tokens whose rows are written is registered under its hash in every tier that holds it — its
indexer-key page, its device page, its host page. A request admitted with `tokens=` shares the longest run of
registered pages (one reference more on each: `incref`), never the page of its last token (whose logits must
be computed), and skips writing them. Shared pages are immutable (only full pages are shared; decode writes
past them). A prefix page found only on the host is loaded into a fresh device page of the new request (and
registered there), since a prompt is resident while it is prefilled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from hisparse_jax.units import PAGE_SIZE
from hisparse_jax.kv import eviction
from hisparse_jax.kv.pool import Tier, page_hash
from hisparse_jax.units import INVALID
from hisparse_jax.kv.updates import LoadPages, pad_pow2

if TYPE_CHECKING:
    from hisparse_jax.kv.manager import TieredCache


class PrefixHit(NamedTuple):
    """One registered page a prompt can share: its hash and its page in each tier (INVALID where none)."""

    hash: int
    index: int
    device: int
    host: int


def match_prefix(manager: "TieredCache", tokens) -> list[PrefixHit]:
    """The registered pages `tokens` could share: the longest run of full pages from the start whose hash
    chain is registered with an indexer page and a KV copy (with the host mirror on: a host copy), never
    the page holding the last token. One `PrefixHit` per page, in order. Read-only."""
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    mirror = manager.spec.mirror_to_host
    out, h = [], None
    for i in range(max(len(tokens) - 1, 0) // PAGE_SIZE):
        h = page_hash(h, tokens[i * PAGE_SIZE:(i + 1) * PAGE_SIZE])
        x = manager.pool.lookup_prefix(Tier.INDEX, h)
        d = manager.pool.lookup_prefix(Tier.DEVICE, h)
        hp = manager.pool.lookup_prefix(Tier.HOST, h) if mirror else None
        if x is None or (hp is None if mirror else d is None):
            break
        out.append(PrefixHit(h, x, INVALID if d is None else d, INVALID if hp is None else hp))
    return out


def share_prefix(manager: "TieredCache", slot: int, hits: list[PrefixHit]) -> None:
    """Take one reference on each hit page (reviving cached free ones) for the empty request `slot`; load
    host-only ones into fresh device pages (registered there)."""
    pool = manager.pool
    r = manager.requests[slot]
    assert r.num_pages == 0, "prefix pages are shared into an empty request"
    rc = pool.refcounts(Tier.DEVICE)

    def free_after_revival():  # reviving cached device pages uses up free pages too
        return pool.num_free(Tier.DEVICE) - sum(1 for x in hits if x.device != INVALID and rc[x.device] == 0)

    loads = [i for i, x in enumerate(hits) if x.device == INVALID]
    if loads and free_after_revival() < len(loads) and manager.partial_eviction:
        eviction.evict_until(manager, pool.num_free(Tier.DEVICE) - free_after_revival() + len(loads), exclude=slot)
        # an eviction may have freed a hit page (it stays cached, and registered, unless reclaimed)
        hits = [x if x.device == INVALID or pool.lookup_prefix(Tier.DEVICE, x.hash) == x.device
                else x._replace(device=INVALID) for x in hits]
        loads = [i for i, x in enumerate(hits) if x.device == INVALID]
    # share as far as the pages that must be loaded can be had (a shorter prefix is still a prefix)
    free = max(free_after_revival(), 0)
    if len(loads) > free:
        hits, loads = hits[:loads[free]], loads[:free]
    for x in hits:  # references first: a cached page must be revived before anything is allocated
        pool.incref(Tier.INDEX, x.index)
        if x.host != INVALID:
            pool.incref(Tier.HOST, x.host)
        if x.device != INVALID:
            pool.incref(Tier.DEVICE, x.device)
    fresh = pool.allocate(Tier.DEVICE, len(loads))
    for i, d in zip(loads, fresh):
        hits[i] = hits[i]._replace(device=d)
        pool.register_prefix(Tier.DEVICE, hits[i].hash, d)
    for x in hits:
        r.append(index=x.index, device=x.device, host=x.host)
    if loads:
        manager.updates.append(LoadPages(pad_pow2([hits[i].host for i in loads]), pad_pow2(fresh)))
        manager.h2d_bytes += len(loads) * manager.all_layers_page_bytes
    manager.prefix_hashes[slot] = [x.hash for x in hits]
    manager.cached_tokens[slot] = len(hits) * PAGE_SIZE


def register_prefix(manager: "TieredCache", slot: int, tokens) -> int:
    """Register `slot`'s full pages of `tokens` (whose rows must be written: positions < len(tokens)) as
    prefix pages in every tier that holds them. Returns the number of pages registered. No-op unless
    `prefix_caching` is on."""
    if not manager.prefix_caching:
        return 0
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    r = manager.requests[slot]
    n = min(len(tokens) // PAGE_SIZE, r.num_pages)
    chain = manager.prefix_hashes.setdefault(slot, [])
    for i in range(n):
        if i == len(chain):
            chain.append(page_hash(chain[-1] if chain else None, tokens[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]))
        h = chain[i]
        for tier, page in ((Tier.INDEX, r.index[i]), (Tier.DEVICE, r.device[i]), (Tier.HOST, r.host[i])):
            # a hash already naming a page (another request's, or cached) keeps it: no churn
            if page != INVALID and manager.pool.lookup_prefix(tier, h) is None:
                manager.pool.register_prefix(tier, h, page)
    return n
