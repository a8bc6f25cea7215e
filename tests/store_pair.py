"""Tests' shorthand: a `PageManager` (host bookkeeping) and its `KVStore` threaded together, so a test reads like
the sequence of operations it checks. Bookkeeping calls and attributes go to the manager; row writes and reads go
through `kv.device` with the pair's store."""

from __future__ import annotations

from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv.manager import PageManager


class StorePair:
    _own = ("manager", "store")

    def __init__(self, model_cfg, cache, **kw):
        object.__setattr__(self, "manager", PageManager(model_cfg, cache, **kw))
        object.__setattr__(self, "store", kv_device.new_store(self.manager))

    def __getattr__(self, name):
        return getattr(self.manager, name)

    def __setattr__(self, name, value):
        if name in self._own:
            object.__setattr__(self, name, value)
        else:
            setattr(self.manager, name, value)

    @classmethod
    def of(cls, manager, store):
        """A pair around an existing manager and store (e.g. `load_tiered`'s)."""
        pair = cls.__new__(cls)
        object.__setattr__(pair, "manager", manager)
        object.__setattr__(pair, "store", store)
        return pair

    def sync(self):
        """Apply the manager's pending table updates; returns the store."""
        self.store = kv_device.apply_updates(self.store, self.manager)
        return self.store

    def write_prefill(self, slot, latent, rope, index_k, length, start=0):
        self.store = kv_device.write_prefill(self.store, self.manager, slot, latent, rope, index_k, length, start)

    def admit_prefilled(self, latent, rope, index_k, length, **kw):
        self.store, slot = kv_device.admit_prefilled(self.store, self.manager, latent, rope, index_k, length, **kw)
        return slot

    def append(self, slots, latent, rope, index_k):
        self.store = kv_device.append(self.store, self.manager, slots, latent, rope, index_k)

    def gather(self, slots, topk):
        self.store, *out = kv_device.gather(self.store, self.manager, slots, topk)
        return tuple(out)

    def check_invariants(self):
        kv_device.check_tables(self.sync(), self.manager)
