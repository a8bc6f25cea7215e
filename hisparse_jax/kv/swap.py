"""Whole-request swap for a `TieredCache` (the "offload" policy): every device page of a request released to
the host (`swap_out`), and loaded back in whole-page copies (`swap_in`); prefix pages still on the device are
shared again instead of copied."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hisparse_jax.kv.pool import OutOfPages, PoolError, Tier
from hisparse_jax.units import INVALID
from hisparse_jax.kv.updates import LoadPages, pad_pow2

if TYPE_CHECKING:
    from hisparse_jax.kv.manager import TieredCache


def swap_out(manager: "TieredCache", slot: int) -> int:
    """Release every device page of `slot` (host copies must be current: needs the eager mirror); the
    request keeps its indexer pages and host pages. Returns the number of pages released."""
    if not manager.spec.mirror_to_host:
        raise PoolError("swap_out needs mirror_to_host (host copies of every page)")
    r = manager.requests[slot]
    pages = [i for i in range(r.num_pages) if r.device[i] != INVALID]
    for i in pages:
        manager.pool.free(Tier.DEVICE, [r.device[i]])
        r.device[i] = INVALID
    if r.hot:
        manager.pool.free(Tier.DEVICE, r.hot)
        r.hot.clear()
    manager.evicted_pages += len(pages)
    manager.swapped.add(slot)
    manager.record_tables(slot)
    return len(pages)


def swap_in(manager: "TieredCache", slot: int) -> int:
    """Bring every host-only page of `slot` back to the device (whole-page H2D copies). Raises OutOfPages
    (nothing changed) when the device pool cannot hold them. Returns the pages loaded."""
    r = manager.requests[slot]
    chain = manager.prefix_hashes.get(slot, [])
    shared = {}  # prefix pages still on the device (another request's, or cached): take a reference, no copy
    for i in r.host_only_pages():
        d = manager.pool.lookup_prefix(Tier.DEVICE, chain[i]) if i < len(chain) else None
        if d is not None:
            shared[i] = d
    missing = [i for i in r.host_only_pages() if i not in shared]
    rc = manager.pool.refcounts(Tier.DEVICE)
    need = len(missing) + sum(1 for d in shared.values() if rc[d] == 0)
    if not manager.pool.can_allocate(Tier.DEVICE, need):
        raise OutOfPages(Tier.DEVICE, need, manager.pool.num_free(Tier.DEVICE), manager.budget.device_pages)
    manager.swapped.discard(slot)
    for i, d in shared.items():
        manager.pool.incref(Tier.DEVICE, d)
        r.device[i] = d
    if missing:
        dev = manager.pool.allocate(Tier.DEVICE, len(missing))
        manager.updates.append(LoadPages(pad_pow2([r.host[i] for i in missing]), pad_pow2(dev)))
        manager.h2d_bytes += len(missing) * manager.all_layers_page_bytes
        for i, d in zip(missing, dev):
            r.device[i] = d
            if i < len(chain):
                manager.pool.register_prefix(Tier.DEVICE, chain[i], d)
    manager.record_tables(slot)
    return len(missing) + len(shared)
