"""gpu_check's `fetch` section: the store's miss fetch per mechanism and row format at several miss fractions on a
store with the real cache geometry, verified byte for byte against the host pool (every other device row keeps its
NaN poison), timed, its bytes checked, its compiled program's HLO facts recorded; then again with both pools
POOL_SCALE x larger (a fetch should not touch whole pools)."""

from __future__ import annotations

import dataclasses
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from experiments.gpu_sections import library
from experiments.gpu_sections.ceilings import hlo_facts
from experiments.gpu_sections.harness import Ctx
from experiments.gpu_sections.sizes import POOL_SCALE
from experiments.gpu_sections.timing import MIB, block, bw, h2d_ceiling, timeit
from hisparse_jax.config import FETCH_MECHANISMS


def _fetch_model(sz):
    from hisparse_jax.config import PRESETS

    L = sz["fetch_layers"]
    return PRESETS["tiny-glm"].replace(num_hidden_layers=L, indexer_types=("full",) + ("shared",) * (L - 1),
                                       mlp_layer_types=("dense",) * L, index_topk=sz["fetch_topk"])


def _build_plan(spec, sz, frac: float, seed: int):
    """A Plan for B requests x K top-k positions, `frac` of them misses with distinct hot-slot destinations."""
    from hisparse_jax.units import PAGE_SIZE

    rng = np.random.default_rng(seed)
    B, K, ctx_len, HR = sz["fetch_requests"], sz["fetch_topk"], sz["fetch_ctx"], spec.hot_rows
    pages_per_req = ctx_len // PAGE_SIZE
    host_of = rng.permutation(spec.host_pages)[:B * pages_per_req].reshape(B, pages_per_req)
    NH = spec.hot_pages
    hot_pages = np.arange(B * NH, dtype=np.int32).reshape(B, NH)  # device pages lent to the hot buffers
    f = {k: np.zeros((B, K), np.int32) for k in ("page", "row", "src_page", "src_row")}
    miss = np.zeros((B, K), bool)
    n_miss = int(round(frac * K))
    for b in range(B):
        pos = np.sort(rng.choice(ctx_len, K, replace=False))
        miss[b, rng.choice(K, n_miss, replace=False)] = True
        slots = rng.choice(HR, K, replace=False)
        f["page"][b] = hot_pages[b, slots // PAGE_SIZE]
        f["row"][b] = slots % PAGE_SIZE
        f["src_page"][b] = np.where(miss[b], host_of[b, pos // PAGE_SIZE], -1)
        f["src_row"][b] = pos % PAGE_SIZE
    valid = np.ones((B, K), bool)
    return f, miss, valid


def _expected_bytes(spec, f, miss, nl: int) -> dict:
    """The bytes a fetch must report: the payload (misses x layers x row bytes) exactly; what it moves exactly for
    "page" (each needed page once), for the row mechanisms at least the payload (their staging size is the
    library's choice, recorded with its `fetch*` fields)."""
    n = int(miss.sum())
    n_pages = len(np.unique(f["src_page"][miss]))
    return {"misses": n, "distinct_host_pages": n_pages, "payload_bytes": n * nl * spec.row_bytes,
            "page_transfer_bytes": n_pages * nl * spec.page_bytes}


def _poison_device_pools(ctx, spec, store):
    """Every device KV pool (latent, rope, latent scales) filled with NaN: a row not copied stays NaN."""
    upd = {}
    for name in ("latent", "rope") + (("latent_scale",) if spec.fp8 else ()):
        a = getattr(store, name)
        upd[name] = jax.device_put(jnp.full(a.shape, jnp.nan, a.dtype), ctx.sharding("device"))
    return block(dataclasses.replace(store, **upd))


def _fill_store(ctx, spec, seed: int):
    """init_store, then random host pools (no NaN; stored as bits, `state.to_host_bits`) and NaN-poisoned device
    pools."""
    from hisparse_jax.kv.state import init_store, to_host_bits

    store = init_store(spec, ctx.device)
    host_s = ctx.sharding("pinned_host")
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)

    def rnd(k, like, dtype, lo=None):  # random values of the device pool's `dtype`, as host-pool bits
        if lo is not None:  # positive scales
            v = jax.random.uniform(k, like.shape, jnp.float32, lo, 2 * lo)
        else:
            v = jax.random.normal(k, like.shape, jnp.float32)
        return jax.device_put(to_host_bits(v.astype(dtype)), host_s)

    upd = {"h_latent": rnd(k1, store.h_latent, store.latent.dtype), "h_rope": rnd(k2, store.h_rope, store.rope.dtype)}
    if spec.fp8:
        upd["h_latent_scale"] = rnd(k3, store.h_latent_scale, store.latent_scale.dtype, lo=0.25)
    return block(dataclasses.replace(store, **upd))


def _as_bytes(a: np.ndarray) -> np.ndarray:
    """[..., X] of any dtype -> uint8 [..., X * itemsize] (exact comparison, NaN included)."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(*a.shape[:-1], -1)


def _verify(spec, store_np: dict, host_np: dict, f, miss, layers) -> dict:
    """Every miss's destination row == its host row (all pools, all layers of the group), byte for byte;
    every other row of the device pools still holds the NaN poison."""
    lo, hi = min(layers), max(layers) + 1
    bi, ki = np.nonzero(miss)
    dp, dr = f["page"][bi, ki], f["row"][bi, ki]
    sp, sr = f["src_page"][bi, ki], f["src_row"][bi, ki]
    pairs = [("latent", "h_latent"), ("rope", "h_rope")] + ([("latent_scale", "h_latent_scale")] if spec.fp8 else [])
    rows_exact = np.ones(len(bi), bool)
    untouched_ok = True
    stray = 0
    for dn, hn in pairs:
        dev = _as_bytes(store_np[dn])  # [L, P, 64, X]
        host = _as_bytes(host_np[hn])
        got = dev[lo:hi, dp, dr]  # [nl, M, X]
        want = host[lo:hi, sp, sr]
        rows_exact &= np.all(got == want, axis=(0, 2))
        # everything that is not a destination must still be the poison pattern
        poison = _as_bytes(np.full((store_np[dn].shape[-1],), np.nan, store_np[dn].dtype))
        is_poison = np.all(dev == poison, axis=-1)  # [L, P, 64]
        mask = np.ones(is_poison.shape, bool)
        mask[lo:hi, dp, dr] = False
        stray_here = int(np.sum(mask & ~is_poison))
        stray += stray_here
        untouched_ok &= stray_here == 0
    return {"rows_checked": int(len(bi)), "rows_exact": int(rows_exact.sum()), "all_exact": bool(rows_exact.all()),
            "stray_rows_changed": stray, "others_untouched": bool(untouched_ok),
            "layers_checked": [lo, hi - 1]}


def section_fetch(ctx: Ctx) -> dict:
    from hisparse_jax.config import CacheConfig
    from hisparse_jax.kv.state import StoreSpec

    sz = ctx.sz
    model = _fetch_model(sz)
    B, K = sz["fetch_requests"], sz["fetch_topk"]
    pages_per_req = sz["fetch_ctx"] // 64
    ceiling = h2d_ceiling(ctx)
    out: dict = {"geometry": {"layers_in_group": model.num_hidden_layers, "latent": model.kv_lora_rank,
                              "rope": model.qk_rope_head_dim, "index_dim": model.index_head_dim, "requests": B,
                              "topk": K, "context_tokens_per_request": sz["fetch_ctx"],
                              "positions": "uniform random distinct positions per request, sorted",
                              "host_pages": "random permutation of the host pool"},
                 "h2d_ceiling": {"name": ceiling[0], "gb_per_s": ceiling[1]} if ceiling else None,
                 "runs": [], "pool_scaling": [], "all_exact": True, "mechanisms": list(FETCH_MECHANISMS),
                 "cache_fetch_defaults": library.fetch_defaults(),
                 "pool_scaling_note": f"first miss fraction again with host and device pools {POOL_SCALE}x larger "
                                      "(same misses): time_ratio_vs_base ~1 means the fetch does not touch "
                                      "whole pools"}
    layers = None
    scaled = set(map(tuple, sz["fetch_pool_scaling"]))
    for kvd in sz["fetch_dtypes"]:
        hot_pages = -(-2 * K // 64)  # the default hot buffer: 2 x top-k rows
        cache = CacheConfig(kv_dtype=kvd, device_pages=B * hot_pages + 8, host_pages=B * pages_per_req + 8,
                            max_seqs=B, max_seq_len=sz["fetch_ctx"])
        spec0 = StoreSpec.create(model, cache)
        layers = spec0.groups[0]
        out["geometry"][f"{kvd}_row_bytes"] = spec0.row_bytes
        out["geometry"][f"{kvd}_page_bytes"] = spec0.page_bytes
        out["geometry"]["hot_rows"] = spec0.hot_rows
        for mech in FETCH_MECHANISMS:
            if ctx.over_budget():
                out["runs"].append({"kv_dtype": kvd, "mechanism": mech, "status": "skipped", "reason": "budget"})
                continue
            spec = dataclasses.replace(spec0, fetch=mech)
            try:
                out["runs"].extend(_fetch_one(ctx, spec, layers, kvd, mech, ceiling, sz["fetch_fracs"]))
                ctx.partial(**out)
            except Exception:  # noqa: BLE001
                out["runs"].append({"kv_dtype": kvd, "mechanism": mech, "status": "error",
                                    "error": traceback.format_exc(limit=8)})
                ctx.log(f"fetch {kvd} {mech}: ERROR\n{out['runs'][-1]['error']}")
                continue
            # the same misses with both pools POOL_SCALE x larger: a fetch should not cost more
            base = next((r for r in out["runs"] if r.get("status") == "ok" and r["kv_dtype"] == kvd
                         and r["mechanism"] == mech and r["miss_fraction"] == sz["fetch_fracs"][0]), None)
            if base is None or ctx.over_budget() or (kvd, mech) not in scaled:
                continue
            big = dataclasses.replace(spec, host_pages=spec.host_pages * POOL_SCALE,
                                      device_pages=spec.device_pages * POOL_SCALE,
                                      index_pages=spec.index_pages * POOL_SCALE)
            try:
                (r,) = _fetch_one(ctx, big, layers, kvd, mech, ceiling, sz["fetch_fracs"][:1])
                r["pool_scale"] = POOL_SCALE
                r["base_time_s"] = base["time_s"]
                r["time_ratio_vs_base"] = r["time_s"] / base["time_s"] if r.get("time_s") else None
                out["pool_scaling"].append(r)
                ctx.partial(**out)
            except Exception:  # noqa: BLE001
                out["pool_scaling"].append({"kv_dtype": kvd, "mechanism": mech, "status": "error",
                                            "error": traceback.format_exc(limit=8)})
    done = [r for r in out["runs"] + out["pool_scaling"] if r.get("status") == "ok"]
    out["all_exact"] = bool(done) and all(r["verify"]["all_exact"] and r["verify"]["others_untouched"]
                                          and r["bytes_match"] for r in done)
    out["verified_runs"] = len(done)
    bad = [r for r in out["runs"] + out["pool_scaling"] if r.get("status") == "error"]
    if bad:  # keep the runs that worked; the section counts as failed
        out.update(status="error", error=f"{len(bad)} fetch run(s) failed; first:\n{bad[0]['error']}")
    return out


def _fetch_one(ctx, spec, layers, kvd, mech, ceiling, fracs) -> list[dict]:
    from hisparse_jax.kv.resolve import Plan, fetch_misses

    sz = ctx.sz
    store = _fill_store(ctx, spec, seed=1)
    dev_s = ctx.sharding("device")
    # read through a device copy: np.asarray of a pinned_host array is a view of its buffer, which jax keeps
    # (cached on the array); a buffer with such an external reference cannot be donated (on a GPU the call fails:
    # "Donation requested for buffer with external reference"; XLA:CPU silently copies instead)
    host_np = {n: np.asarray(jax.device_put(getattr(store, n), dev_s)) for n in ("h_latent", "h_rope",
                                                                                 "h_latent_scale")
               if getattr(store, n) is not None}

    lo, nl = layers[0], len(layers)
    assert tuple(layers) == tuple(range(lo, lo + nl)), layers  # an indexer group: a contiguous layer range

    def fn(s, plan):
        return fetch_misses(s, lo, nl, plan)

    runs = []
    compiled = None
    for frac in fracs:
        if ctx.over_budget():
            runs.append({"kv_dtype": kvd, "mechanism": mech, "miss_fraction": frac, "status": "skipped",
                         "reason": "budget"})
            continue
        f, miss, valid = _build_plan(spec, sz, frac, seed=int(frac * 1000) + 7)
        plan = Plan(page=f["page"], row=f["row"], valid=valid, resident=np.zeros_like(valid), miss=miss,
                    src_page=f["src_page"], src_row=f["src_row"])
        plan = jax.device_put(plan, dev_s)
        store = _poison_device_pools(ctx, spec, store)
        rec = {"kv_dtype": kvd, "mechanism": mech, "miss_fraction": frac, "status": "ok",
               "host_pages": spec.host_pages, "device_pages": spec.device_pages}
        with warnings.catch_warnings(record=True) as wlog:
            warnings.simplefilter("always")
            if compiled is None:
                t = time.perf_counter()
                lowered = jax.jit(fn, donate_argnums=0).lower(store, plan)
                compiled = lowered.compile()
                rec["compile_s"] = time.perf_counter() - t
                text = compiled.as_text()
                ctx.hlo_texts.append((f"fetch kv_dtype={kvd} mechanism={mech} host_pages={spec.host_pages} "
                                      f"device_pages={spec.device_pages}", text))
                rec["hlo"] = hlo_facts(text)
            before = jax.tree.leaves(store)
            store, payload, transfer = compiled(store, plan)
            block(store)
            kept = [i for i, a in enumerate(before) if not a.is_deleted()]
            if kept:  # the store is donated: every buffer of it must be consumed, host pools included
                raise RuntimeError(f"fetch_misses did not consume {len(kept)} of the donated store's {len(before)} "
                                   "buffers (an external reference, e.g. a NumPy view of a pinned_host pool?)")
            del before
        rec["warnings"] = sorted({str(w.message)[:300] for w in wlog})
        rec["out_memory_kinds"] = {n: getattr(store, n).sharding.memory_kind for n in ("latent", "h_latent")}
        exp = _expected_bytes(spec, f, miss, len(layers))
        rec.update(misses=exp["misses"], distinct_host_pages=exp["distinct_host_pages"],
                   payload_bytes=int(payload) * spec.row_bytes, transfer_bytes=int(transfer) * spec.row_bytes,
                   expected_payload_bytes=exp["payload_bytes"],
                   expected_transfer_bytes=exp.get(f"{mech}_transfer_bytes"),
                   fetch_fields={fl.name: getattr(spec, fl.name) for fl in dataclasses.fields(spec)
                                 if fl.name.startswith("fetch")})
        rec["bytes_match"] = (rec["payload_bytes"] == exp["payload_bytes"]
                              and (rec["transfer_bytes"] == rec["expected_transfer_bytes"]
                                   if rec["expected_transfer_bytes"] is not None
                                   else rec["transfer_bytes"] >= rec["payload_bytes"]))
        store_np = {n: np.asarray(getattr(store, n)) for n in ("latent", "rope", "latent_scale")
                    if getattr(store, n) is not None}
        rec["verify"] = _verify(spec, store_np, host_np, f, miss, layers)
        del store_np

        def step():
            nonlocal store
            store, p, tr = compiled(store, plan)
            block((store, p, tr))

        t = timeit(step, sz["fetch_warmup"], sz["fetch_reps"], max_s=20.0)
        rec.update(time=t, time_s=t["median_s"],
                   payload_gb_per_s=bw(rec["payload_bytes"], t["median_s"]),
                   transfer_gb_per_s=bw(rec["transfer_bytes"], t["median_s"]))
        if ceiling:
            rec["payload_vs_h2d_ceiling"] = rec["payload_gb_per_s"] / ceiling[1]
            rec["transfer_vs_h2d_ceiling"] = rec["transfer_gb_per_s"] / ceiling[1]
        v = rec["verify"]
        ctx.log(f"fetch {kvd:4s} {mech:4s} {frac:.0%}: {t['median_s'] * 1e3:8.3f} ms  payload "
                f"{rec['payload_bytes'] / MIB:7.2f} MiB  moved {rec['transfer_bytes'] / MIB:8.2f} MiB  "
                f"exact {v['rows_exact']}/{v['rows_checked']} untouched={v['others_untouched']} "
                f"bytes_match={rec['bytes_match']}")
        runs.append(rec)
    del store
    return runs
