"""Save and restore a whole tiered cache: device pools, pinned-host pools, tables, hot buffers and the
host-side bookkeeping, so decoding continues exactly where it stopped.

Layout of `path`: `store/` (an Orbax checkpoint of the `KVStore` arrays) and `cache.json` (configs, the
`PagePool` snapshot, each request's pages and length). Restored host pools are `pinned_host` arrays again.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax

from hisparse_jax.config import CacheConfig, ModelConfig, RopeConfig
from hisparse_jax.kv.manager import TieredCache
from hisparse_jax.kv.pool import PagePool, RequestPages
from hisparse_jax.kv.state import KVStore, store_shardings

FORMAT = "hisparse_jax.TieredCache"


def _arrays(store: KVStore) -> dict:
    return {f.name: getattr(store, f.name) for f in dataclasses.fields(KVStore)
            if f.name != "spec" and getattr(store, f.name) is not None}


def save_cache(cache: TieredCache, path: str | os.PathLike) -> None:
    """Write `cache` to the directory `path` (created; must not hold a previous checkpoint)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "store"), _arrays(cache.store))
    meta = {
        "format": FORMAT, "version": 1,
        "model": dataclasses.asdict(cache.model_cfg), "cache": dataclasses.asdict(cache.cache_cfg),
        "pool": cache.pool.snapshot(),
        "requests": {str(s): dataclasses.asdict(r) for s, r in cache.requests.items()},
        "lengths": {str(s): n for s, n in cache.lengths.items()},
        "evicted_pages": cache.evicted_pages, "d2h_bytes": cache.d2h_bytes,
        "prefix_caching": cache.prefix_caching, "swapped": sorted(cache.swapped),
        "prefix_hashes": {str(s): h for s, h in cache.prefix_hashes.items()},
        "cached_tokens": {str(s): n for s, n in cache.cached_tokens.items()},
    }
    with open(os.path.join(path, "cache.json"), "w") as f:
        json.dump(meta, f)


def _model_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    d["rope"] = RopeConfig(**d["rope"])
    for k in ("mlp_layer_types", "indexer_types", "eos_token_id"):
        d[k] = tuple(d[k])
    return ModelConfig(**d)


def load_cache(path: str | os.PathLike, device=None) -> TieredCache:
    """Restore a `TieredCache` written by `save_cache` (host pools land in pinned_host memory)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    with open(os.path.join(path, "cache.json")) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a saved TieredCache (format {meta.get('format')!r})")
    cache = TieredCache(_model_from_dict(meta["model"]), CacheConfig(**meta["cache"]), device=device)
    shardings = _arrays(store_shardings(cache.spec, device))
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in _arrays(cache.store).items()}
    with ocp.StandardCheckpointer() as ckptr:
        arrays = ckptr.restore(os.path.join(path, "store"), target)
    cache.store = dataclasses.replace(cache.store, **arrays)
    cache.pool = PagePool.from_snapshot(meta["pool"])
    cache.requests = {int(s): RequestPages(**r) for s, r in meta["requests"].items()}
    cache.lengths = {int(s): n for s, n in meta["lengths"].items()}
    cache._synced_hot = {s: tuple(r.hot) for s, r in cache.requests.items()}
    cache.evicted_pages, cache.d2h_bytes = meta["evicted_pages"], meta["d2h_bytes"]
    cache.prefix_caching = meta.get("prefix_caching", False)
    cache.swapped = set(meta.get("swapped", []))
    cache.prefix_hashes = {int(s): list(h) for s, h in meta.get("prefix_hashes", {}).items()}
    cache.cached_tokens = {int(s): n for s, n in meta.get("cached_tokens", {}).items()}
    cache.check_invariants()
    return cache
