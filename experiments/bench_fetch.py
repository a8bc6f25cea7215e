#!/usr/bin/env python3
"""Benchmark: the row fetch of a step's misses, the chunked loop it replaced and the packed one-copy fetch.

    PYTHONPATH=. python3 experiments/bench_fetch.py [--requests 4] [--topk 2048] [--layers 4] [--ctx 16384]
                                                    [--fracs 0.05,0.1,0.3] [--min-rows 256] [--repeats 5]
                                                    [--out experiments/results/bench_fetch.json]

One indexer group of `--layers` layers, `--requests` decode rows of `--topk` top-k slots each, `--fracs` of them
misses (random positions of a `--ctx`-token context in random host pages, distinct hot-slot destinations), for
fp8 rows (656 bytes: 512 e4m3 + 4 fp32 scales + 64 bf16 rope) and bf16 rows (1152 bytes). Side by side, each
jitted with the store donated, on NaN-poisoned device pools:

* "chunked": the row fetch before the packed one (a standalone copy of kv/ops.py's `_fetch_rows` at commit 6210d22,
  kept here only for this comparison): a `fori_loop` over chunks of 256 misses, each chunk one host computation
  and one host -> device copy per host pool (latent, rope, scales), then one scatter per pool;
* "packed": `kv.resolve.fetch_misses` with fetch="row" (the store's): one host computation gathers every miss's row
  of every pool into one buffer (`resolve.gather_packed`), one copy, one scatter per pool, at the smallest of the
  static sizes `resolve.fetch_sizes(--min-rows, B x K)` that holds the misses (a `lax.switch`);
* "static": the same at the one size B x K (fetch_min_rows = B x K: the size the issue first asked for);
* "page": fetch="page" (each distinct host page sliced and copied once, its needed rows kept).

Per mechanism and miss fraction: median seconds per fetch, payload GB/s (misses x layers x row bytes / time),
the bytes it moved, and its host computations and copies per group and step. Also the host-side gather's own
rate (`resolve.gather_packed` under `compute_on("device_host")` alone), every mechanism's fetched rows checked equal
to the host pools' rows (bits; the device pools start NaN), and a bytes model at the GPU geometry (B 32, top-k
2048, 4 layers).

On a CPU the host and device pools are the same memory: this measures the host-side work (the gather, the loop,
the scatter) that XLA:CPU runs as the GPU machine's host does, not PCIe. Progress to stderr, JSON to --out.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.report import run_to_json

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_fetch.json")
MECHANISMS = ("chunked", "packed", "static", "page")
OLD_CHUNK = 256  # the chunked fetch's default chunk (CacheConfig.fetch_chunk before the packed fetch)
GPU_GEOMETRY = {"requests": 32, "topk": 2048, "layers": 4}  # the H200 case, for the bytes model


def log(t0, *a):
    print(f"[{time.perf_counter() - t0:6.1f}s]", *a, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4, help="decode rows (default 4)")
    p.add_argument("--topk", type=int, default=2048, help="top-k slots per row (default 2048)")
    p.add_argument("--layers", type=int, default=4, help="layers of the indexer group (default 4)")
    p.add_argument("--ctx", type=int, default=16384, help="context tokens per request (default 16384)")
    p.add_argument("--fracs", default="0.05,0.1,0.3", help="miss fractions, comma-separated (default 0.05,0.1,0.3)")
    p.add_argument("--kv-dtypes", default="fp8,bf16", help="row formats (default fp8,bf16)")
    p.add_argument("--mechanisms", default=",".join(MECHANISMS), help=f"default {','.join(MECHANISMS)}")
    p.add_argument("--min-rows", type=int, default=256,
                   help="the packed fetch's smallest staging size, CacheConfig.fetch_min_rows (default 256)")
    p.add_argument("--repeats", type=int, default=5, help="timed fetches per case, median (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output (default {os.path.relpath(DEFAULT_OUT)})")
    args = p.parse_args(argv)
    args.fracs = [float(f) for f in args.fracs.split(",")]
    args.kv_dtypes = args.kv_dtypes.split(",")
    args.mechanisms = args.mechanisms.split(",")
    if (args.requests < 1 or args.min_rows < 1 or args.topk < 64 or args.topk % 64 or args.layers < 1
            or args.repeats < 1 or args.ctx < 2 * args.topk or args.ctx % 64):
        p.error("need --requests >= 1, --min-rows >= 1, --topk a multiple of 64, --layers >= 1, --repeats >= 1, "
                "--ctx a multiple of 64 and >= 2 x --topk")
    if not all(0 < f <= 1 for f in args.fracs):
        p.error(f"--fracs must be in (0, 1], got {args.fracs}")
    if not set(args.kv_dtypes) <= {"fp8", "bf16"} or not set(args.mechanisms) <= set(MECHANISMS):
        p.error(f"--kv-dtypes from fp8,bf16 and --mechanisms from {','.join(MECHANISMS)}")
    return args


# ----- the chunked row fetch (kv/ops.py at 6210d22), standalone -----------------------------------
def chunked_fetch(spec, store, lo, nl, plan, chunk=OLD_CHUNK):
    """The row fetch before the packed one: per chunk of `chunk` misses one host gather and one host -> device
    copy per host pool in a `fori_loop`, then one scatter per pool. Returns (store, payload rows, moved rows)."""
    import dataclasses

    from hisparse_jax.compat import DEVICE, HOST, on_host
    from hisparse_jax.kv.codec import set_rows
    from hisparse_jax.kv.state import from_host_bits

    miss = (plan.miss & plan.valid & (plan.src_page >= 0)).reshape(-1)
    order = jnp.argsort(jnp.where(miss, plan.src_page.reshape(-1), jnp.iinfo(jnp.int32).max), stable=True)
    sp, sr, dp, dr = (a.reshape(-1)[order] for a in (plan.src_page, plan.src_row, plan.page, plan.row))
    n = jnp.sum(miss).astype(jnp.int32)
    names = [f for f in ("latent", "rope", "latent_scale") if getattr(store, f) is not None]
    pools = [getattr(store, f) for f in names]
    hosts = [getattr(store, "h_" + f) for f in names]
    chunk = min(chunk, sp.shape[0])
    n_chunks = (n + chunk - 1) // chunk

    def body(i, staging):
        sl = lambda a: jax.lax.dynamic_slice(a, (i * chunk,), (chunk,))  # noqa: E731
        ok = i * chunk + jnp.arange(chunk) < n
        hp, hr = jax.device_put(jnp.where(ok, sl(sp), 0), HOST), jax.device_put(sl(sr), HOST)
        hlo = jax.device_put(jnp.asarray(lo, jnp.int32), HOST)
        out = []
        for buf, host in zip(staging, hosts):
            rows = on_host(lambda h, first, p, r: jax.lax.dynamic_slice_in_dim(h, first, nl, axis=0)[:, p, r],
                           host, hlo, hp, hr)
            rows = from_host_bits(jax.device_put(rows, DEVICE), buf.dtype)
            out.append(jax.lax.dynamic_update_slice_in_dim(buf, rows, i * chunk, axis=1))
        return tuple(out)

    staging = tuple(jnp.zeros((nl, sp.shape[0]) + p.shape[3:], p.dtype) for p in pools)
    staging = jax.lax.fori_loop(0, n_chunks, body, staging)
    dpage = jnp.where(jnp.arange(sp.shape[0]) < n, dp, spec.device_pages)
    layer = lo + jnp.arange(nl, dtype=jnp.int32)[:, None]
    new = {f: set_rows(p, (layer, dpage[None], dr[None]), b) for f, p, b in zip(names, pools, staging)}
    return dataclasses.replace(store, **new), n * nl, n_chunks * chunk * nl


# ----- the case ---------------------------------------------------------------------------------
def make_spec(args, kv_dtype: str, fetch: str, min_rows: int):
    from hisparse_jax.kv.spec import StoreSpec
    from hisparse_jax.units import PAGE_SIZE

    R, K, L = args.requests, args.topk, args.layers
    hot_rows = 2 * K
    hot_pages = -(-hot_rows // PAGE_SIZE)
    pages = args.ctx // PAGE_SIZE
    return StoreSpec(num_layers=L, num_indexer_layers=1, groups=(tuple(range(L)),), latent_dim=512, rope_dim=64,
                     index_dim=128, device_pages=R * hot_pages + 1, index_pages=1, host_pages=R * pages,
                     max_seqs=R, max_pages=pages, hot_rows=hot_rows, kv_dtype=kv_dtype, fetch=fetch,
                     fetch_min_rows=min_rows, mirror_to_host=True, topk=K)


def make_plan(spec, frac: float, rng):
    """A Plan of B rows x K slots, `frac` of each row's slots misses (random positions of the context, host pages
    a random permutation), each miss to a distinct hot slot; the other slots resident hits (no copy)."""
    from hisparse_jax.kv.resolve import Plan
    from hisparse_jax.units import PAGE_SIZE

    B, K, HR, NH = spec.max_seqs, spec.topk, spec.hot_rows, spec.hot_pages
    ctx = spec.max_pages * PAGE_SIZE
    host_of = rng.permutation(spec.host_pages).reshape(B, spec.max_pages)
    f = {k: np.zeros((B, K), np.int32) for k in ("page", "row", "src_page", "src_row")}
    miss = np.zeros((B, K), bool)
    for b in range(B):
        pos = np.sort(rng.choice(ctx, K, replace=False))
        miss[b, rng.choice(K, int(round(frac * K)), replace=False)] = True
        slots = rng.choice(HR, K, replace=False)
        f["page"][b] = b * NH + slots // PAGE_SIZE
        f["row"][b] = slots % PAGE_SIZE
        f["src_page"][b] = np.where(miss[b], host_of[b, pos // PAGE_SIZE], -1)
        f["src_row"][b] = pos % PAGE_SIZE
    return Plan(page=jnp.asarray(f["page"]), row=jnp.asarray(f["row"]), valid=jnp.ones((B, K), bool),
                resident=jnp.asarray(~miss), miss=jnp.asarray(miss), src_page=jnp.asarray(f["src_page"]),
                src_row=jnp.asarray(f["src_row"]))


def fill_store(spec, seed: int):
    """init_store; host pools random (as host-pool bits; scales positive), device pools NaN."""
    import dataclasses

    from hisparse_jax.compat import HOST
    from hisparse_jax.kv.state import init_store, to_host_bits

    store = init_store(spec, jax.devices()[0])
    keys = jax.random.split(jax.random.key(seed), 3)
    upd = {}
    for k, f in zip(keys, ("latent", "rope", "latent_scale")):
        dev = getattr(store, f)
        if dev is None:
            continue
        host = getattr(store, "h_" + f)
        v = (jax.random.uniform(k, host.shape, jnp.float32, 0.5, 1.0) if f == "latent_scale"
             else jax.random.normal(k, host.shape, jnp.float32))
        upd["h_" + f] = jax.device_put(to_host_bits(v.astype(dev.dtype)), HOST)
        upd[f] = jnp.full(dev.shape, jnp.nan, dev.dtype)
    return dataclasses.replace(store, **upd)


DEVICE_POOLS = ("latent", "rope", "latent_scale")


def fetch_program(name: str, spec):
    """jit(device pools, rest of the store, plan) -> (device pools, payload rows, moved rows), the device pools
    donated: the fetch writes them in place, and the host pools are neither copied nor returned."""
    import dataclasses

    from hisparse_jax.kv.resolve import fetch_misses

    nl = spec.num_layers
    fn = functools.partial(chunked_fetch, spec) if name == "chunked" else fetch_misses

    def prog(pools, rest, plan):
        store, payload, moved = fn(dataclasses.replace(rest, **pools), 0, nl, plan)
        return {f: getattr(store, f) for f in pools}, payload, moved

    return jax.jit(prog, donate_argnums=(0,))


def split_store(store):
    """(device pools {field: array}, the store with those fields replaced by scalars)."""
    import dataclasses

    pools = {f: getattr(store, f) for f in DEVICE_POOLS if getattr(store, f) is not None}
    return pools, dataclasses.replace(store, **{f: jnp.zeros((), jnp.int8) for f in pools})


def fetched_rows(pools: dict, plan, store=None):
    """Bits of the misses' rows, per pool [layers, misses, X]: in the device `pools` at their hot slots, or with
    `store` in its host pools at their source (what must arrive)."""
    m = np.asarray(plan.miss)
    if store is not None:
        page, row = np.asarray(plan.src_page)[m], np.asarray(plan.src_row)[m]
        pools = {f: getattr(store, "h_" + f) for f in pools}
    else:
        page, row = np.asarray(plan.page)[m], np.asarray(plan.row)[m]
    out = []
    for f in DEVICE_POOLS:
        if f in pools:
            a = np.asarray(pools[f])[:, page, row]
            out.append(a.view(f"u{a.dtype.itemsize}"))
    return out


def ops_per_step(mech: str, n: int, pools: int, pages: int) -> dict:
    """Host computations and host -> device copies one group's fetch makes per step (from the programs)."""
    if mech == "chunked":
        c = -(-n // OLD_CHUNK)
        return {"host_computations": c * pools, "h2d_copies": c * pools}
    if mech == "page":
        return {"host_computations": 0, "h2d_copies": pages * pools}
    return {"host_computations": int(n > 0), "h2d_copies": int(n > 0)}


def bytes_model(row_bytes: int, fracs, geometry: dict) -> dict:
    """Rows moved per group and step at `geometry` by each row-fetch design (payload, chunked, packed, static)."""
    from hisparse_jax.kv.resolve import fetch_sizes

    BK, L = geometry["requests"] * geometry["topk"], geometry["layers"]
    sizes = fetch_sizes(OLD_CHUNK, BK)
    out = {}
    for frac in fracs:
        n = int(round(frac * geometry["topk"])) * geometry["requests"]
        rows = {"payload": n, "chunked": -(-n // OLD_CHUNK) * OLD_CHUNK, "packed": min(s for s in sizes if s >= n),
                "static": BK}
        out[str(frac)] = {k: {"bytes": v * L * row_bytes, "x_payload": v / n} for k, v in rows.items()}
    return out


def time_fetches(progs: dict, stores: dict, plan, repeats: int):
    """Each mechanism's fetch compiled and run once, then `repeats` rounds running each once in turn (a shared
    machine's load falls on all alike). Returns ({mechanism: (device pools, payload rows, moved rows)},
    {mechanism: [seconds]})."""
    out, times, rest = {}, {m: [] for m in progs}, {}
    for m, prog in progs.items():
        pools, rest[m] = split_store(stores[m])
        out[m] = prog(pools, rest[m], plan)
        jax.block_until_ready(out[m][0])
    for _ in range(repeats):
        for m, prog in progs.items():
            t = time.perf_counter()
            out[m] = prog(out[m][0], rest[m], plan)
            jax.block_until_ready(out[m][0])
            times[m].append(time.perf_counter() - t)
    return {m: (o[0], int(o[1]), int(o[2])) for m, o in out.items()}, times


def time_host_gather(spec, store, plan, repeats: int):
    """The packed fetch's host-side gather alone: (seconds, bytes) for the plan's misses at their exact count."""
    from hisparse_jax.compat import HOST, on_host
    from hisparse_jax.kv.resolve import gather_packed

    m = np.asarray(plan.miss).reshape(-1)
    index = np.concatenate([np.arange(spec.num_layers), np.asarray(plan.src_page).reshape(-1)[m],
                            np.asarray(plan.src_row).reshape(-1)[m]]).astype(np.int32)
    hosts = [getattr(store, "h_" + f) for f in ("latent", "rope", "latent_scale") if getattr(store, f) is not None]
    prog = jax.jit(lambda idx, *h: on_host(functools.partial(gather_packed, spec.num_layers), idx, *h))
    idx = jax.device_put(jnp.asarray(index), HOST)
    jax.block_until_ready(prog(idx, *hosts))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = jax.block_until_ready(prog(idx, *hosts))
        times.append(time.perf_counter() - t)
    return statistics.median(times), int(out.size)


def run(args) -> dict:
    from hisparse_jax.units import PAGE_SIZE

    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    BK = args.requests * args.topk
    results, host_gather, checks = [], [], []
    for kv in args.kv_dtypes:
        specs = {"chunked": make_spec(args, kv, "row", OLD_CHUNK),
                 "packed": make_spec(args, kv, "row", args.min_rows),
                 "static": make_spec(args, kv, "row", BK), "page": make_spec(args, kv, "page", OLD_CHUNK)}
        row_bytes = specs["packed"].row_bytes
        progs = {m: fetch_program(m, specs[m]) for m in args.mechanisms}
        for frac in args.fracs:
            plan = make_plan(specs["packed"], frac, rng)
            miss = np.asarray(plan.miss)
            n = int(miss.sum())
            pages = len(np.unique(np.asarray(plan.src_page)[miss]))
            stores = {m: fill_store(specs[m], args.seed) for m in args.mechanisms}
            first = stores[args.mechanisms[0]]
            want = fetched_rows(split_store(first)[0], plan, store=first)
            done, times = time_fetches(progs, stores, plan, args.repeats)
            del stores, first
            for mech in args.mechanisms:
                pools, payload, moved = done[mech]
                same = all(np.array_equal(a, b) for a, b in zip(fetched_rows(pools, plan), want))
                checks.append({"kv_dtype": kv, "frac": frac, "mechanism": mech, "equal_to_host_rows": same})
                pb, sec = payload * row_bytes, statistics.median(times[mech])
                results.append({"kv_dtype": kv, "row_bytes": row_bytes, "frac": frac, "mechanism": mech,
                                "misses": n, "distinct_host_pages": pages, "payload_bytes": pb,
                                "moved_bytes": moved * row_bytes, "seconds": sec, "min_seconds": min(times[mech]),
                                "payload_gb_s": pb / sec / 1e9,
                                **ops_per_step(mech, n, 3 if kv == "fp8" else 2, pages)})
                log(t0, f"{kv} frac={frac} {mech:8s} {n:6d} misses: {sec * 1e3:8.2f} ms (min "
                        f"{min(times[mech]) * 1e3:8.2f}), {pb / sec / 1e9:6.2f} GB/s payload, equal={same}")
            del done
            sec, nbytes = time_host_gather(specs["packed"], fill_store(specs["packed"], args.seed), plan,
                                           args.repeats)
            host_gather.append({"kv_dtype": kv, "frac": frac, "bytes": nbytes, "seconds": sec,
                                "gb_s": nbytes / sec / 1e9})
            log(t0, f"{kv} frac={frac} host gather alone: {nbytes / sec / 1e9:6.2f} GB/s")
    speedup = {}
    for r in results:
        if r["mechanism"] == "packed":
            old = next(o for o in results if o["mechanism"] == "chunked" and o["kv_dtype"] == r["kv_dtype"]
                       and o["frac"] == r["frac"]) if "chunked" in args.mechanisms else None
            if old:
                speedup[f"{r['kv_dtype']} {r['frac']}"] = old["seconds"] / r["seconds"]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "jax": jax.__version__,
                    "backend": jax.default_backend(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count()},
        "config": {"requests": args.requests, "topk": args.topk, "layers": args.layers, "ctx": args.ctx,
                   "page_size": PAGE_SIZE, "fracs": args.fracs, "repeats": args.repeats,
                   "old_chunk": OLD_CHUNK, "min_rows": args.min_rows, "mechanisms": args.mechanisms},
        "fetch": results, "host_gather": host_gather, "equal_rows": checks,
        "packed_speedup_vs_chunked": speedup,
        "bytes_model_gpu_geometry": {"geometry": GPU_GEOMETRY,
                                     **{kv: bytes_model(b, args.fracs, GPU_GEOMETRY)
                                        for kv, b in (("fp8", 656), ("bf16", 1152))}},
        "units": {"seconds": "median seconds per fetch of one group (min_seconds: the fastest round)",
                  "*_bytes": "bytes", "*_gb_s": "1e9 B/s"},
        "elapsed_s": time.perf_counter() - t0,
    }


def main(argv=None) -> int:
    return run_to_json(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
