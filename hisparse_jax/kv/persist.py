"""Save and restore a whole tiered store (a `PageManager` and its `KVStore`): device pools, pinned-host pools,
tables, hot buffers and the host-side bookkeeping, so decoding continues exactly where it stopped.

Layout of `path`: `store/` (an Orbax checkpoint of the `KVStore` arrays) and `manager.json` (configs, the
`PagePool`'s state (`pool_state`), each request's pages and length, and a manifest of every array's dtype, shape
and SHA-256).
Restored host pools are `pinned_host` arrays again.

The restored arrays are what `init_store` makes: each is put in the sharding a new store's array has (memory kind
in its type, donatable), so the jitted step, `generate` and the engine's programs accept them in a fresh process.

Integrity: `load_tiered` refuses (`CheckpointError`, naming the file and array) a `manager.json` that was edited or
damaged (it carries its own checksum), arrays whose saved dtype or shape differ from what the described configs
imply (checked before anything is read), array files Orbax cannot read (one message naming the array; the reads
still in flight are closed without printing), arrays whose bytes differ from their checksums, bookkeeping that
fails the allocator's invariants, and (index_tier="host") page summaries that do not bound their page's keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys
import tempfile
import time

import jax
import numpy as np

from hisparse_jax import integrity
from hisparse_jax.config import CacheConfig, ModelConfig, RopeConfig
from hisparse_jax.integrity import CheckpointError
from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv.audit import check_manager, check_pool
from hisparse_jax.kv.codec import scored_keys
from hisparse_jax.kv.manager import PageManager
from hisparse_jax.kv.pool import PagePool, PoolError, RequestPages, Tier
from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.kv.state import KVStore, from_host_bits, init_store, store_shardings
from hisparse_jax.kv.summary import rvq_residuals
from hisparse_jax.units import PAGE_SIZE

FORMAT = "hisparse_jax.PageManager"
VERSION = 2  # 2: array manifest + metadata checksum
POOL_FORMAT, POOL_VERSION = "hisparse_jax.kv.PagePool", 1


def pool_state(pool: PagePool) -> dict:
    """A `PagePool` as JSON-serializable data: budgets, in-use pages with refcounts, prefix registrations, cached
    free pages in their reclaim order. Not the free list: "every other page with refcount 0", handed out lowest
    first, so the pool `restore_pool` rebuilds allocates exactly as this one would."""
    def tier(t: Tier) -> dict:
        rc = pool.refcounts(t)
        return {"budget": pool.budget(t), "used": [[p, int(rc[p])] for p in np.flatnonzero(rc).tolist()],
                "prefix": [[h, p] for p, h in pool.prefix_maps(t)[1].items()], "cached": pool.cached_pages(t)}

    return {"format": POOL_FORMAT, "version": POOL_VERSION, "retain_prefix": pool.retain_prefix,
            "tiers": {t.value: tier(t) for t in Tier}}


def restore_pool(state: dict) -> PagePool:
    """The `PagePool` that `pool_state` described (also after a JSON round trip), rebuilt through its own methods:
    pages 0..n-1 allocated (n: past the highest in-use or cached page), shared to their refcounts, registered, and
    the rest freed (the cached pages last, in their reclaim order). Raises PoolError on a malformed or inconsistent
    state, naming the tier and entry."""
    if not isinstance(state, dict) or state.get("format") != POOL_FORMAT:
        raise PoolError(f"not a PagePool state (format {state.get('format') if isinstance(state, dict) else state!r})")
    if state.get("version") != POOL_VERSION:
        raise PoolError(f"unsupported PagePool state version {state.get('version')!r}; this code reads "
                        f"version {POOL_VERSION}")
    tiers = state.get("tiers")
    if not isinstance(tiers, dict) or set(tiers) != {t.value for t in Tier}:
        raise PoolError(f"the pool state's tiers must be exactly {[t.value for t in Tier]}, got "
                        f"{list(tiers) if isinstance(tiers, dict) else tiers!r}")
    try:
        pool = PagePool(*(tiers[t.value]["budget"] for t in Tier), retain_prefix=True)
        for t in Tier:
            _restore_tier(pool, t, tiers[t.value])
    except (TypeError, ValueError, KeyError, IndexError) as e:
        raise PoolError(f"bad pool state: {type(e).__name__}: {e}") from None
    if (retain := bool(state.get("retain_prefix", False))) is False and any(pool.num_cached(t) for t in Tier):
        raise PoolError("the pool state has cached free pages but retain_prefix is off")
    pool.set_retain_prefix(retain)
    check_pool(pool)
    return pool


def _page(pool: PagePool, t: Tier, page) -> int:
    pool.refcount(t, page)  # PoolError for an id outside the tier's pool, TypeError for a non-int
    return int(page)


def _restore_tier(pool: PagePool, t: Tier, state: dict) -> None:
    used = {_page(pool, t, p): int(r) for p, r in state.get("used", [])}
    cached = [_page(pool, t, p) for p in state.get("cached", [])]
    prefix = [(int(h), _page(pool, t, p)) for h, p in state.get("prefix", [])]
    if len(used) != len(state.get("used", [])) or min(used.values(), default=1) < 1:
        raise PoolError(f"pool state {t.value}: in-use entries must name distinct pages with refcount >= 1")
    if len({h for h, _ in prefix}) != len(prefix) or len(registered := {p for _, p in prefix}) != len(prefix):
        raise PoolError(f"pool state {t.value}: repeated prefix entries in {prefix[:5]}")
    if len(set(cached)) != len(cached) or set(cached) & set(used) or not set(cached) <= registered:
        raise PoolError(f"pool state {t.value}: cached pages must be distinct, free and registered, got {cached[:5]}")
    if unheld := [p for _, p in prefix if p not in used and p not in cached]:
        raise PoolError(f"pool state {t.value}: prefix page {unheld[0]} is neither in use nor cached")
    n = max([*used, *cached], default=-1) + 1
    pool.allocate(t, n)  # pages 0..n-1: a new pool hands out its lowest pages first
    for p, r in used.items():
        for _ in range(r - 1):
            pool.incref(t, p)
    for h, p in prefix:
        pool.register_prefix(t, h, p)
    pool.free(t, [p for p in range(n) if p not in used and p not in cached])
    pool.free(t, cached)  # in their order: the reclaim order


def _arrays(store: KVStore) -> dict:
    return {f.name: getattr(store, f.name) for f in dataclasses.fields(KVStore)
            if f.name != "spec" and getattr(store, f.name) is not None}


def save_tiered(manager: PageManager, store: KVStore, path: str | os.PathLike) -> None:
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


def _write_manager(manager: PageManager, arrays: dict, path: str) -> None:
    meta = {
        "format": FORMAT, "version": VERSION, "arrays": integrity.manifest(arrays),
        "model": dataclasses.asdict(manager.model_cfg), "cache": dataclasses.asdict(manager.cache),
        "pool": pool_state(manager.pool),
        "requests": {str(s): dataclasses.asdict(r) for s, r in manager.requests.items()},
        "lengths": {str(s): n for s, n in manager.lengths.items()},
        "evicted_pages": manager.evicted_pages, "d2h_bytes": manager.d2h_bytes, "h2d_bytes": manager.h2d_bytes,
        "resident_only": sorted(manager.resident_only),
        "page_stamps": {str(s): manager.page_stamps[s].tolist() for s in manager.requests},
        "prefix_caching": manager.prefix_caching, "swapped": sorted(manager.swapped),
        "prefix_hashes": {str(s): h for s, h in manager.prefix_hashes.items()},
        "cached_tokens": {str(s): n for s, n in manager.cached_tokens.items()},
    }
    integrity.write_description(os.path.join(path, "manager.json"), meta)


def _read_manager(model_cfg: ModelConfig, cache: CacheConfig, meta: dict) -> PageManager:
    """The bookkeeping `_write_manager` saved, whose tables are already on the device: no updates pending. Raises
    PoolError when it is inconsistent."""
    c = PageManager(model_cfg, cache)
    c.pool = restore_pool(meta["pool"])
    c.requests = {int(s): RequestPages(**r) for s, r in meta["requests"].items()}
    c.lengths = {int(s): n for s, n in meta["lengths"].items()}
    c.evicted_pages, c.d2h_bytes, c.h2d_bytes = meta["evicted_pages"], meta["d2h_bytes"], meta.get("h2d_bytes", 0)
    c.resident_only = set(meta.get("resident_only", []))  # being prefilled: no page of theirs may be evicted
    for s, stamps in meta.get("page_stamps", {}).items():  # the recency coldness's view of the device's stamps
        c.page_stamps[int(s)] = stamps
    c.prefix_caching = meta.get("prefix_caching", False)
    c.swapped = set(meta.get("swapped", []))
    c.prefix_hashes = {int(s): list(h) for s, h in meta.get("prefix_hashes", {}).items()}
    c.cached_tokens = {int(s): n for s, n in meta.get("cached_tokens", {}).items()}
    for s in c.requests:  # the manager learns which hot pages the device's tables hold; the updates are dropped,
        c.record_tables(s)  # the tables being on the device already
    c.take_updates()
    check_manager(c)
    return c


def _model_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    d["rope"] = RopeConfig(**d["rope"])
    for k in ("mlp_layer_types", "indexer_types", "eos_token_id"):
        d[k] = tuple(d[k])
    return ModelConfig(**d)


def load_tiered(path: str | os.PathLike, device=None) -> tuple[PageManager, KVStore]:
    """Restore a `PageManager` and its `KVStore` written by `save_tiered`: arrays typed and placed as `init_store`
    makes them (host pools in pinned_host memory), ready for the jitted step in any process. Refuses a damaged or
    mismatched one with `CheckpointError` (see the module docstring)."""
    path = os.path.abspath(os.fspath(path))
    fn = os.path.join(path, "manager.json")
    meta = integrity.read_description(fn, "PageManager", FORMAT, VERSION, holds="configs, page tables, lengths",
                                      versions="version 1 carried no checksums: save it again with the version "
                                               "that wrote it")
    try:
        model_cfg, cache = _model_from_dict(meta["model"]), _cache_from_dict(meta["cache"])
        spec = StoreSpec.create(model_cfg, cache)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{fn}: the saved configs are invalid ({type(e).__name__}: {e})") from None
    expected = _arrays(jax.eval_shape(lambda: init_store(spec)))
    integrity.check_description(meta["arrays"], expected, os.path.join(path, "store"), "manager.json's configs")
    shardings = _arrays(store_shardings(spec, device))
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in expected.items()}
    arrays = _restore(os.path.join(path, "store"), target)
    # Orbax's arrays carry the sharding's memory kind but not the memory space in their type (a host pool's type
    # reads float32[...], a new store's float32<host>[...]): a step compiled for them gathers across memory spaces
    # and is refused. A donated device_put into the same sharding retypes each one without copying its buffer.
    arrays = {k: jax.device_put(v, shardings[k], donate=True, may_alias=False) for k, v in arrays.items()}
    integrity.verify(meta["arrays"], arrays, os.path.join(path, "store"))
    store = KVStore(spec=spec, **{f.name: arrays.get(f.name) for f in dataclasses.fields(KVStore) if f.name != "spec"})
    try:
        manager = _read_manager(model_cfg, cache, meta)
        kv_device.check_tables(store, manager)
    except PoolError as e:
        raise CheckpointError(f"{fn}: the saved bookkeeping is inconsistent ({e})") from None
    check_summaries(store, manager, os.path.join(path, "store"))
    return manager, store


def _restore(where: str, target: dict) -> dict:
    """Orbax's restore of `target` ({name: ShapeDtypeStruct with sharding}) from `where`. A file it cannot read is
    one `CheckpointError` naming `where` and the array (TensorStore's first line, not its spec dump); the reads
    still in flight when Orbax gives up finish with nothing printed (their late callbacks into Orbax's closed event
    loop would print tracebacks, on stderr, from TensorStore's threads)."""
    import orbax.checkpoint as ocp

    with _stderr_held() as held:
        try:
            with ocp.StandardCheckpointer() as ckptr:
                return ckptr.restore(where, target)
        except Exception as e:  # Orbax/TensorStore errors bury which array and why under a spec dump
            held.discard = True
            reason = _first_line(e)
    raise CheckpointError(f"{where}: the saved arrays could not be read — a file is damaged, missing or truncated "
                          f"({reason})")


def _first_line(e: BaseException) -> str:
    """The first line of the innermost cause of `e` (TensorStore's: names the array and what failed), cut short."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ if e.__cause__ is not None else e.__context__
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return f"{type(e).__name__}: {line[:300]}"


class _Held:
    discard = False


@contextlib.contextmanager
def _stderr_held(settle_s: float = 0.2, max_wait_s: float = 5.0):
    """Within the block, file descriptor 2 (and Python's unraisable-exception hook) go to a temporary file; after it
    the file is copied to stderr, or, with `held.discard` set (a failed restore), thrown away once the in-flight
    work has been quiet for `settle_s` (at most `max_wait_s`): collected first, so that coroutines Orbax left
    pending are closed now rather than at exit."""
    held = _Held()
    sys.stderr.flush()
    try:
        saved_fd = os.dup(2)
    except OSError:  # no file descriptor 2 to hold
        yield held
        return
    saved_hook = sys.unraisablehook
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        sys.unraisablehook = lambda _: None
        try:
            yield held
        finally:
            try:
                if held.discard:
                    gc.collect()
                    end, last = time.monotonic() + max_wait_s, -1
                    while time.monotonic() < end and os.fstat(tmp.fileno()).st_size != last:
                        last = os.fstat(tmp.fileno()).st_size
                        time.sleep(settle_s)
                        gc.collect()
                sys.stderr.flush()
            finally:
                os.dup2(saved_fd, 2)
                os.close(saved_fd)
                sys.unraisablehook = saved_hook
            if not held.discard:
                tmp.seek(0)
                sys.stderr.write(tmp.read().decode(errors="replace"))


def written_rows(manager: PageManager) -> dict[int, tuple[int, int | None]]:
    """{indexer page: (rows of it written, its first position or None)} over the manager's requests (a logical
    page i of a request of length n holds min(64, n - 64 i) rows from position 64 i) and its registered prefix
    pages (full; a cached one no request holds has no position the bookkeeping knows)."""
    rows: dict[int, tuple[int, int | None]] = {}
    for page in manager.pool.prefix_maps(Tier.INDEX)[1]:
        rows[page] = (PAGE_SIZE, None)
    for s, r in manager.requests.items():
        n = manager.lengths[s]
        for i, page in enumerate(r.index):
            k = min(PAGE_SIZE, max(0, n - i * PAGE_SIZE))
            if k and page >= 0:
                rows[page] = (max(rows.get(page, (0, None))[0], k), i * PAGE_SIZE)
    return rows


def check_summaries(store: KVStore, manager: PageManager, where: str, chunk_bytes: int = 64 << 20) -> None:
    """Refuse (`CheckpointError`, naming the first (layer, page)) a host-tier store whose page summaries
    (`index_lo` / `index_hi`, bf16[LI, PI, dI]) do not bound, in every dimension, the scored keys (`codec.scored_keys`)
    of the rows written to the page (`written_rows`), or with index_summary="rvq" whose radii (`index_radius`) are
    below a written key's distance from its codes' reconstruction (`summary.rvq_residuals`; a page's position is
    needed for that, so a cached prefix page no request holds is not checked): exact mode would skip a page
    holding a top-k key. A NaN summary bound or radius is accepted (the reader treats it as unbounded: the page is
    always read). No-op for device keys. Reads the key pool once, `chunk_bytes` of scored keys at a time."""
    spec = store.spec
    if spec.index_tier != "host":
        return
    rows = written_rows(manager)
    if spec.index_summary == "rvq":
        rows = {p: v for p, v in rows.items() if v[1] is not None}
    if not rows:
        return
    pages = np.array(sorted(rows), np.int64)
    count = np.array([rows[p][0] for p in pages.tolist()])
    first = np.array([rows[p][1] or 0 for p in pages.tolist()])
    if spec.index_summary == "rvq":
        _check_radii(store, pages, count, first, where, chunk_bytes)
        return
    lo_all = np.asarray(jax.device_get(store.index_lo)).astype(np.float32)
    hi_all = np.asarray(jax.device_get(store.index_hi)).astype(np.float32)
    for layer, at, pp, k in _scored_key_chunks(store, pages, chunk_bytes):
        n = count[at:at + len(pp)]
        written = (np.arange(PAGE_SIZE)[None, :] < n[:, None])[..., None]
        kmin = np.where(written, k, np.inf).min(axis=1)
        kmax = np.where(written, k, -np.inf).max(axis=1)
        lo, hi = lo_all[layer, pp], hi_all[layer, pp]
        ok = ((lo <= kmin) | np.isnan(lo)) & ((kmax <= hi) | np.isnan(hi))
        bad = np.flatnonzero(~ok.all(axis=-1))
        if bad.size:
            j = int(bad[0])
            d = int(np.flatnonzero(~ok[j])[0])
            raise CheckpointError(
                f"{where}: the summary of indexer layer {layer}, page {int(pp[j])} does not bound its keys "
                f"(dimension {d}: keys in [{kmin[j, d]}, {kmax[j, d]}] over {int(n[j])} written rows, summary "
                f"[{lo[j, d]}, {hi[j, d]}]; {bad.size} page(s) of this layer wrong) — exact top-k would skip it")


def _scored_key_chunks(store: KVStore, pages, chunk_bytes: int):
    """(index layer, offset into `pages`, a chunk of `pages`, their scored keys f32[c, 64, dI]) over every index
    layer, `chunk_bytes` of keys at a time, reading the key pool once."""
    spec = store.spec
    kdt, sdt = spec.index_dtypes
    keys = np.asarray(jax.device_get(store.index_k))
    scales = None if store.index_scale is None else np.asarray(jax.device_get(store.index_scale))
    step = max(1, chunk_bytes // (PAGE_SIZE * spec.index_dim * 4))
    for layer in range(spec.num_indexer_layers):
        for at in range(0, len(pages), step):
            pp = pages[at:at + step]
            kv = from_host_bits(keys[layer, pp], kdt)
            ks = None if scales is None else from_host_bits(scales[layer, pp], sdt)
            yield layer, at, pp, np.asarray(scored_keys(spec, kv, ks), np.float32)


def _check_radii(store: KVStore, pages, count, first, where: str, chunk_bytes: int) -> None:
    """`check_summaries` for index_summary="rvq": pages int[N] whose first `count` rows are written, from positions
    `first` on."""
    spec = store.spec
    codes_all = np.asarray(jax.device_get(store.index_codes))
    radius_all = np.asarray(jax.device_get(store.index_radius)).astype(np.float32)
    for layer, at, pp, k in _scored_key_chunks(store, pages, chunk_bytes):
        n = count[at:at + len(pp)]
        pos = first[at:at + len(pp), None] + np.arange(PAGE_SIZE)[None]
        e = np.asarray(rvq_residuals(store, layer, k.reshape(-1, spec.index_dim), pos.reshape(-1),
                                     codes_all[layer, pp].reshape(-1, spec.index_stages))).reshape(pos.shape)
        r = radius_all[layer, pp]
        bad = (np.arange(PAGE_SIZE)[None] < n[:, None]) & ~((e <= r) | np.isnan(r))
        if bad.any():
            j, row = (int(x) for x in np.argwhere(bad)[0])
            raise CheckpointError(
                f"{where}: the rvq radius of indexer layer {layer}, page {int(pp[j])}, row {row} is below its "
                f"key's distance from its codes' reconstruction ({r[j, row]} < {e[j, row]}; {int(bad.sum())} "
                f"row(s) of this layer wrong) — exact top-k would skip its page")


def _cache_from_dict(d: dict) -> CacheConfig:
    """A `CacheConfig` from its `dataclasses.asdict` (the capacity, when there is one, nested the same way)."""
    d = dict(d)
    if d.get("capacity") is not None:
        d["capacity"] = CacheConfig(**d["capacity"])
    return CacheConfig(**d)
