"""Save and restore a whole tiered store (a `TieredCache` and its `KVStore`): device pools, pinned-host pools,
tables, hot buffers and the host-side bookkeeping, so decoding continues exactly where it stopped.

Layout of `path`: `store/` (an Orbax checkpoint of the `KVStore` arrays) and `manager.json` (configs, the
`PagePool` snapshot, each request's pages and length, and a manifest of every array's dtype, shape and SHA-256).
Restored host pools are `pinned_host` arrays again.

Integrity: `load_tiered` refuses (`CheckpointError`, naming the file and array) a `manager.json` that was edited or
damaged (it carries its own checksum), arrays whose saved dtype or shape differ from what the described configs
imply (checked before anything is read), arrays whose bytes differ from their checksums, and bookkeeping that
fails the allocator's invariants.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax

from hisparse_jax import integrity
from hisparse_jax.config import CacheConfig, ModelConfig, RopeConfig
from hisparse_jax.integrity import CheckpointError
from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv.manager import TieredCache
from hisparse_jax.kv.pool import PagePool, PoolError, RequestPages
from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.kv.state import KVStore, init_store, store_shardings

FORMAT = "hisparse_jax.TieredCache"
VERSION = 2  # 2: array manifest + metadata checksum


def _arrays(store: KVStore) -> dict:
    return {f.name: getattr(store, f.name) for f in dataclasses.fields(KVStore)
            if f.name != "spec" and getattr(store, f.name) is not None}


def save_tiered(manager: TieredCache, store: KVStore, path: str | os.PathLike) -> None:
    """Write `manager` and its `store` to the directory `path` (created; must not hold a previous checkpoint). The
    manager's pending table updates must have been applied to the store (`kv.device.apply_updates`). A write
    error names `path`."""
    import orbax.checkpoint as ocp

    if manager.updates:
        raise ValueError(f"{len(manager.updates)} table updates of this manager are not applied to the store yet: "
                         "store = kv.device.apply_updates(store, manager) first")
    path = os.path.abspath(os.fspath(path))
    with integrity.writing("a tiered store", path):
        os.makedirs(path, exist_ok=True)
        arrays = _arrays(store)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(path, "store"), arrays)
        _write_manager(manager, arrays, path)


def _write_manager(manager: TieredCache, arrays: dict, path: str) -> None:
    meta = {
        "format": FORMAT, "version": VERSION, "arrays": integrity.manifest(arrays),
        "model": dataclasses.asdict(manager.model_cfg), "cache": dataclasses.asdict(manager.cache),
        "pool": manager.pool.snapshot(),
        "requests": {str(s): dataclasses.asdict(r) for s, r in manager.requests.items()},
        "lengths": {str(s): n for s, n in manager.lengths.items()},
        "evicted_pages": manager.evicted_pages, "d2h_bytes": manager.d2h_bytes,
        "prefix_caching": manager.prefix_caching, "swapped": sorted(manager.swapped),
        "prefix_hashes": {str(s): h for s, h in manager.prefix_hashes.items()},
        "cached_tokens": {str(s): n for s, n in manager.cached_tokens.items()},
    }
    meta["meta_sha256"] = integrity.json_digest(meta)
    with open(os.path.join(path, "manager.json"), "w") as f:
        json.dump(meta, f)


def _model_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    d["rope"] = RopeConfig(**d["rope"])
    for k in ("mlp_layer_types", "indexer_types", "eos_token_id"):
        d[k] = tuple(d[k])
    return ModelConfig(**d)


def load_tiered(path: str | os.PathLike, device=None) -> tuple[TieredCache, KVStore]:
    """Restore a `TieredCache` and its `KVStore` written by `save_tiered` (host pools land in pinned_host memory);
    refuses a damaged or mismatched one with `CheckpointError` (see the module docstring)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    fn = os.path.join(path, "manager.json")
    if not os.path.exists(fn):
        raise FileNotFoundError(f"no saved TieredCache at {path} (no manager.json)")
    try:
        with open(fn) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{fn}: not readable JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a saved TieredCache (format "
                              f"{meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{fn}: saved by format version {meta.get('version')!r}; this version reads {VERSION} "
                              "(version 1 carried no checksums: save it again with the version that wrote it)")
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    if meta.get("meta_sha256") != integrity.json_digest(body):
        raise CheckpointError(f"{fn}: checksum mismatch — the description (configs, page tables, lengths) was "
                              "edited or damaged")
    try:
        model_cfg, cache = _model_from_dict(meta["model"]), _cache_from_dict(meta["cache"])
        spec = StoreSpec.create(model_cfg, cache)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{fn}: the saved configs are invalid ({type(e).__name__}: {e})") from None
    expected = _arrays(jax.eval_shape(lambda: init_store(spec)))
    integrity.check_description(meta["arrays"], expected, os.path.join(path, "store"), "manager.json's configs")
    shardings = _arrays(store_shardings(spec, device))
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in expected.items()}
    try:
        with ocp.StandardCheckpointer() as ckptr:
            arrays = ckptr.restore(os.path.join(path, "store"), target)
    except Exception as e:  # Orbax/TensorStore errors do not say which array or why
        raise CheckpointError(f"{path}/store: the arrays could not be restored ({type(e).__name__}: {e})") from e
    integrity.verify(meta["arrays"], arrays, os.path.join(path, "store"))
    store = KVStore(spec=spec, **{f.name: arrays.get(f.name) for f in dataclasses.fields(KVStore) if f.name != "spec"})
    try:
        manager = TieredCache.restore(
            model_cfg, cache, pool=PagePool.from_snapshot(meta["pool"]),
            requests={int(s): RequestPages(**r) for s, r in meta["requests"].items()},
            lengths={int(s): n for s, n in meta["lengths"].items()},
            evicted_pages=meta["evicted_pages"], d2h_bytes=meta["d2h_bytes"],
            prefix_caching=meta.get("prefix_caching", False), swapped=meta.get("swapped", []),
            prefix_hashes={int(s): h for s, h in meta.get("prefix_hashes", {}).items()},
            cached_tokens={int(s): n for s, n in meta.get("cached_tokens", {}).items()})
        kv_device.check_tables(store, manager)
    except PoolError as e:
        raise CheckpointError(f"{fn}: the saved bookkeeping is inconsistent ({e})") from None
    return manager, store


def _cache_from_dict(d: dict) -> CacheConfig:
    """A `CacheConfig` from its `dataclasses.asdict` (the capacity, when there is one, nested the same way)."""
    d = dict(d)
    if d.get("capacity") is not None:
        d["capacity"] = CacheConfig(**d["capacity"])
    return CacheConfig(**d)
