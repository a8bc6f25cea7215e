#!/usr/bin/env python3
"""One prepared, unattended check of the tiered KV store on a GPU (and, with --cpu-smoke, on a CPU).

    PYTHONPATH=. python3 experiments/gpu_check.py --out DIR [--cpu-smoke] [--only NAME,...] [--budget-s 240]

Contract: shared/gpu/README.md. It imports nothing beyond the standard library, numpy, jax and flax
(through the package itself), so it runs on the GPU image as it is. Every section is independent: an
exception is recorded in the JSON (with its traceback) and the next section runs. Sections are skipped
once the elapsed time passes --budget-s, and a watchdog (--hard-timeout-s) dumps the stacks and exits if
something hangs. The JSON is rewritten after every section, so a run cut short still leaves what it had.

Sections (`SECTIONS`, in order; extend by adding a function `f(ctx) -> dict` to the dict):

* ceilings: device-to-device copy bandwidth and pinned_host -> device copy bandwidth (plain `device_put`,
  and inside `jit` as `dynamic_slice(host) -> device_put(Device)`, whole / in chunks / page-sized blocks),
  plus device -> pinned_host; median of several runs after warm-up, each run ends in `block_until_ready`.
* kernels: every Pallas kernel (indexer_topk, sparse_gather, sparse_mla_decode) against its jnp reference on
  fresh random inputs (NaN-poisoned unused rows, permuted tables): exact for the top-k and the resolver, max
  abs / rel error for MLA decode; then kernel vs jitted reference times and bandwidth against the d2d ceiling
  measured in the same run (interpret=True on the CPU).
* fetch: a `KVStore` with the real cache geometry (latent 512, rope 64, indexer 128) and one indexer group
  of a few layers; host pools filled with random rows, device pools poisoned with NaN; a hand-built
  `ops.Plan` with 10 / 20 / 30 % of the top-k rows missing; `ops.fetch_misses` timed per mechanism
  ("row", "page") and row format (bf16, fp8) inside one jitted function with the store donated. Each fetched
  row is checked byte-for-byte against a NumPy gather of the host pool, and no other row may change.
  The compiled HLO of each fetch is scanned for host-compute regions vs. plain async copies (recorded as
  facts, not asserted); the texts go to DIR/hlo_fetch.txt.
* decode: `hisparse_jax.kv.tiered.decode_step` on the "tiny-glm" preset, side by side through an
  all-resident store and through stores under pressure (hot buffers + misses from host, both mechanisms).

Units in the JSON: *_s seconds, *_bytes bytes, *_gb_per_s 1e9 bytes per second, *_mib 2**20 bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

GB = 1e9
MIB = 2 ** 20

# ----- sizes ------------------------------------------------------------------------------------------
SIZES = {
    "full": dict(
        d2d_bytes=2 << 30, h2d_bytes=2 << 30, h2d_chunk_bytes=64 << 20, small_blocks=2048, warmup=2, reps=7,
        fetch_layers=4, fetch_requests=4, fetch_topk=2048, fetch_ctx=32768, fetch_fracs=(0.1, 0.2, 0.3),
        fetch_dtypes=("bf16", "fp8"), fetch_warmup=2, fetch_reps=7,
        decode_requests=4, decode_prompt=4096, decode_warmup=2, decode_steps=20, decode_mechanisms=("row", "page"),
        decode_public_steps=5,
        kernels_max_s=110.0, kernels_time=True, kernels_warmup=2, kernels_reps=10,
        idx_B=4, idx_heads=64, idx_dim=128, idx_topk=2048, idx_contexts=(131072, 32768), idx_dtypes=("bf16", "fp8"),
        gather_B=32, gather_K=2048, gather_hot_rows=4096, gather_ctx=32768,
        mla_B=32, mla_C=512, mla_R=64, mla_K=2048,
        mla_variants=((128, "bf16", "bf16"), (128, "fp8", "bf16"), (64, "bf16", "bf16"), (64, "fp8", "bf16"),
                      (128, "bf16", "f32")),
        kernels_order=("indexer_topk bf16 ctx=131072", "sparse_gather", "sparse_mla_decode H=128 bf16 q=bf16",
                       "sparse_mla_decode H=128 fp8", "indexer_topk fp8 ctx=131072", "indexer_topk"),
    ),
    "smoke": dict(
        d2d_bytes=64 << 20, h2d_bytes=32 << 20, h2d_chunk_bytes=4 << 20, small_blocks=128, warmup=1, reps=3,
        fetch_layers=2, fetch_requests=2, fetch_topk=128, fetch_ctx=1024, fetch_fracs=(0.1, 0.2, 0.3),
        fetch_dtypes=("bf16", "fp8"), fetch_warmup=0, fetch_reps=2,
        decode_requests=2, decode_prompt=1024, decode_warmup=1, decode_steps=3, decode_mechanisms=("row",),
        decode_public_steps=2,
        kernels_max_s=150.0, kernels_time=True, kernels_warmup=0, kernels_reps=1,
        idx_B=4, idx_heads=8, idx_dim=32, idx_topk=64, idx_contexts=(256,), idx_dtypes=("bf16", "fp8"),
        gather_B=2, gather_K=64, gather_hot_rows=128, gather_ctx=1024,
        mla_B=2, mla_C=128, mla_R=64, mla_K=64,
        mla_variants=((16, "bf16", "bf16"), (16, "fp8", "f32")),
        kernels_order=(),
    ),
}
MECHANISMS = ("row", "page")
POOL_SCALE = 4


class Ctx:
    def __init__(self, args, sizes_name: str):
        self.args = args
        self.sizes_name = sizes_name
        self.sz = SIZES[sizes_name]
        self.t0 = time.perf_counter()
        self.budget_s = args.budget_s
        self.out_dir = args.out
        self.report: dict = {}
        self.hlo_texts: list[tuple[str, str]] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def log(self, *a):
        print(f"[{self.elapsed():6.1f}s]", *a, flush=True)

    @property
    def device(self):
        return jax.devices()[0]

    def sharding(self, kind: str):
        return jax.sharding.SingleDeviceSharding(self.device, memory_kind=kind)

    def write(self):
        os.makedirs(self.out_dir, exist_ok=True)
        self.report["elapsed_s"] = self.elapsed()
        path = os.path.join(self.out_dir, "gpu_check.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.report, f, indent=1, default=_jsonable)
        os.replace(path + ".tmp", path)
        if self.hlo_texts:
            with open(os.path.join(self.out_dir, "hlo_fetch.txt"), "w") as f:
                for name, text in self.hlo_texts:
                    f.write(f"\n\n===== {name} =====\n{text}")


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (np.bool_,)):
        return bool(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def _block(x):
    return jax.block_until_ready(x)


def timeit(fn, warmup: int, reps: int, max_s: float = 30.0) -> dict:
    """Median wall time of fn() (fn must block). Stops early once the timed runs exceed max_s."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(reps, 1)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if sum(times) > max_s:
            break
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs": len(times)}


def _bw(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds / GB if seconds and seconds > 0 else None


# ----- environment ------------------------------------------------------------------------------------
def environment(ctx: Ctx) -> dict:
    d = ctx.device
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "platform": platform.platform(), "numpy": np.__version__,
        "jax": jax.__version__, "jaxlib": getattr(getattr(jax, "lib", None), "__version__", None),
        "backend": jax.default_backend(), "devices": [str(x) for x in jax.devices()],
        "device_kind": d.device_kind, "sizes": ctx.sizes_name,
        "memory_kinds": [m.kind for m in d.addressable_memories()],
        "default_memory_kind": d.default_memory().kind,
        "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                              "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "JAX_PLATFORMS")
                if os.environ.get(k) is not None},
    }
    try:
        import jaxlib

        env["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        import flax

        env["flax"] = flax.__version__
    except Exception as e:  # noqa: BLE001
        env["flax"] = f"unavailable: {e}"
    try:
        ms = d.memory_stats() or {}
        env["device_memory_bytes_limit"] = ms.get("bytes_limit")
    except Exception:  # noqa: BLE001
        pass
    if jax.default_backend() == "gpu":
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.current,"
                                "pcie.link.width.current", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            env["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
        except Exception as e:  # noqa: BLE001
            env["nvidia_smi"] = f"unavailable: {e}"
    return env


# ----- HLO facts --------------------------------------------------------------------------------------
HLO_PATTERNS = {  # op names are matched as " name(" (instruction names start with "%", so they never match)
    "host_compute_attr": r'_xla_compute_type="host"',
    "host_execution_thread": r'execution_thread="host"',
    "copy_start": r"\scopy-start\(",
    "copy_done": r"\scopy-done\(",
    "async_start": r"\sasync-start\(",
    "host_memory_space_S5": r"S\(5\)",
    "host_transfer_send_recv": r"is_host_transfer=true",
    "while": r"\swhile\(",
    "gather": r"\sgather\(",
    "scatter": r"\sscatter\(",
    "dynamic_slice": r"\sdynamic-slice\(",
    "dynamic_update_slice": r"\sdynamic-update-slice\(",
    "custom_call": r"\scustom-call\(",
    "fusion": r"\sfusion\(",
}


def hlo_facts(text: str) -> dict:
    """Counts of the instructions that tell host compute from plain async copies (facts, not verdicts)."""
    counts = {k: len(re.findall(p, text)) for k, p in HLO_PATTERNS.items()}
    targets: dict[str, int] = {}
    for t in re.findall(r'custom_call_target="([^"]+)"', text):
        targets[t] = targets.get(t, 0) + 1
    host_lines = [ln.strip()[:240] for ln in text.splitlines()
                  if '_xla_compute_type="host"' in ln or 'execution_thread="host"' in ln]
    host_ops = sorted({m.group(1) for ln in host_lines for m in [re.search(r"=\s.*?\s([a-z][a-z0-9-]*)\(", ln)] if m})
    return {
        "counts": counts, "custom_call_targets": targets, "host_compute_ops": host_ops,
        "host_compute_examples": host_lines[:6], "hlo_chars": len(text),
        "host_compute_present": bool(counts["host_compute_attr"] or counts["host_execution_thread"]),
        "async_copies_present": bool(counts["copy_start"]),
        "host_custom_calls": {t: n for t, n in targets.items() if "host" in t.lower()},
    }


# ----- section: ceilings ------------------------------------------------------------------------------
def section_ceilings(ctx: Ctx) -> dict:
    sz = ctx.sz
    dev_s, host_s = ctx.sharding("device"), ctx.sharding("pinned_host")
    space = getattr(getattr(jax, "memory", None), "Space", None)
    to_dev = space.Device if space is not None else dev_s
    out: dict = {"convention": "bandwidth = bytes copied / median time (a copy reads and writes each byte once; "
                               "d2d also reports read+write traffic)"}
    errors = []

    def measure(name, setup):
        """setup() -> (fn, nbytes, extra); fn() runs one blocking copy. Any failure is recorded, not raised."""
        if ctx.over_budget():
            out[name] = {"status": "skipped", "reason": "budget"}
            return
        try:
            fn, nbytes, extra = setup()
            t = timeit(fn, sz["warmup"], sz["reps"])
            out[name] = dict(t, bytes=nbytes, gb_per_s=_bw(nbytes, t["median_s"]), **extra)
            ctx.log(f"ceiling {name}: {out[name]['gb_per_s']:.2f} GB/s ({nbytes / MIB:.0f} MiB, "
                    f"{t['median_s'] * 1e3:.3f} ms)")
        except Exception:  # noqa: BLE001
            out[name] = {"status": "error", "error": traceback.format_exc(limit=8)}
            errors.append(name)
            ctx.log(f"ceiling {name}: ERROR\n{out[name]['error']}")

    def drop(y):
        _block(y)
        y.delete()

    # (a) device -> device: an elementwise copy kernel (x + 1 on f32: one read and one write per byte)
    arrays = {}

    def d2d():
        n = sz["d2d_bytes"] // 4
        arrays["x"] = jax.device_put(jnp.zeros((n,), jnp.float32), dev_s)
        copy = jax.jit(lambda a: a + 1.0)
        return (lambda: drop(copy(arrays["x"]))), n * 4, {"kernel": "jit(x + 1), float32"}

    measure("d2d_copy", d2d)
    arrays.pop("x", None)
    if out.get("d2d_copy", {}).get("gb_per_s"):
        out["d2d_copy"]["rw_gb_per_s"] = 2 * out["d2d_copy"]["gb_per_s"]

    # (b) pinned_host -> device, a large array
    nh = sz["h2d_bytes"] // 4

    def host_array():
        if "h" not in arrays:
            arrays["h"] = _block(jax.device_put(jnp.ones((nh,), jnp.float32), host_s))
            out["pinned_host_array"] = {"memory_kind": arrays["h"].sharding.memory_kind, "bytes": nh * 4}
        return arrays["h"]

    def h2d_put():
        h = host_array()
        return (lambda: drop(jax.device_put(h, dev_s))), nh * 4, {
            "how": "jax.device_put(pinned_host array, device sharding)"}

    measure("h2d_device_put", h2d_put)

    def h2d_whole():
        h = host_array()
        whole = jax.jit(lambda a, i: jax.device_put(jax.lax.dynamic_slice(a, (i,), (a.shape[0],)), to_dev))
        i0 = jax.device_put(jnp.int32(0), dev_s)
        compiled = whole.lower(h, i0).compile()
        text = compiled.as_text()
        ctx.hlo_texts.append(("ceiling h2d_jit_whole", text))
        y = compiled(h, i0)
        extra = {"how": "jit: dynamic_slice(host, whole array) -> device_put(Device)",
                 "out_memory_kind": y.sharding.memory_kind, "hlo": hlo_facts(text)}
        drop(y)
        return (lambda: drop(compiled(h, i0))), nh * 4, extra

    measure("h2d_jit_whole", h2d_whole)

    def h2d_chunked():
        h = host_array()
        chunk = sz["h2d_chunk_bytes"] // 4
        n_chunks = nh // chunk

        @jax.jit
        def chunked(a):
            def body(i, acc):
                blk = jax.device_put(jax.lax.dynamic_slice(a, (i * chunk,), (chunk,)), to_dev)
                return jax.lax.dynamic_update_slice(acc, blk, (i * chunk,))

            return jax.lax.fori_loop(0, n_chunks, body, jnp.zeros((n_chunks * chunk,), a.dtype))

        y = chunked(h)
        ok = bool(np.all(np.asarray(y[:: max(1, chunk // 7)]) == 1.0))  # the host array is all ones
        drop(y)
        return (lambda: drop(chunked(h))), n_chunks * chunk * 4, {
            "how": f"jit: fori_loop of {n_chunks} x dynamic_slice({chunk * 4 / MIB:.0f} MiB) -> device_put -> "
                   "dynamic_update_slice", "values_ok": ok}

    measure("h2d_jit_chunked", h2d_chunked)
    arrays.pop("h", None)

    # page-sized blocks: one KV page of one layer in bf16 (64 x 576 x 2 = 73,728 B), one H2D copy each
    def h2d_blocks():
        nb = sz["small_blocks"]
        hb = _block(jax.device_put(jnp.ones((nb, 64, 576), jnp.bfloat16), host_s))

        @jax.jit
        def blocks(a):
            def body(i, acc):
                blk = jax.device_put(jax.lax.dynamic_slice(a, (i, 0, 0), (1, 64, 576)), to_dev)
                return jax.lax.dynamic_update_slice(acc, blk, (i, 0, 0))

            return jax.lax.fori_loop(0, a.shape[0], body, jnp.zeros(a.shape, a.dtype))

        return (lambda: drop(blocks(hb))), nb * 64 * 576 * 2, {
            "how": f"jit: fori_loop of {nb} x (one 73,728-byte page block -> device_put)", "block_bytes": 64 * 576 * 2}

    measure("h2d_jit_page_blocks", h2d_blocks)

    # device -> pinned_host (the mirror-write direction)
    def d2h_put():
        xd = _block(jax.device_put(jnp.ones((nh,), jnp.float32), dev_s))
        return (lambda: drop(jax.device_put(xd, host_s))), nh * 4, {
            "how": "jax.device_put(device array, pinned_host sharding)"}

    measure("d2h_device_put", d2h_put)
    if errors:
        out.update(status="error", error=f"failed: {', '.join(errors)}")
    return out


def h2d_ceiling(ctx: Ctx) -> tuple[str, float] | None:
    """The best large pinned_host -> device copy measured (name, GB/s), or None without the ceilings."""
    c = ctx.report.get("sections", {}).get("ceilings", {})
    got = [(v["gb_per_s"], name) for name in ("h2d_device_put", "h2d_jit_whole", "h2d_jit_chunked")
           for v in [c.get(name)] if isinstance(v, dict) and v.get("gb_per_s")]
    if not got:
        return None
    bw, name = max(got)
    return name, bw


# ----- section: kernels -------------------------------------------------------------------------------
def d2d_ceiling(ctx: Ctx) -> dict | None:
    """The device-copy ceiling of this run: {copy_gb_per_s, rw_gb_per_s (read + write traffic)}, or None."""
    c = ctx.report.get("sections", {}).get("ceilings", {}).get("d2d_copy")
    if not (isinstance(c, dict) and c.get("gb_per_s")):
        return None
    return {"copy_gb_per_s": c["gb_per_s"], "rw_gb_per_s": c.get("rw_gb_per_s") or 2 * c["gb_per_s"]}


def _time_pair(ctx, kernel_fn, ref_fn, nbytes=None) -> dict:
    """Median times of kernel_fn() and ref_fn() (jitted; both already compiled by the correctness run)."""
    sz = ctx.sz
    if not sz["kernels_time"]:
        return {"timed": False}
    tk = timeit(lambda: _block(kernel_fn()), sz["kernels_warmup"], sz["kernels_reps"], max_s=8.0)
    tr = timeit(lambda: _block(ref_fn()), sz["kernels_warmup"], sz["kernels_reps"], max_s=8.0)
    rec = {"timed": True, "kernel_time": tk, "reference_time": tr, "kernel_s": tk["median_s"],
           "reference_s": tr["median_s"], "speedup_vs_reference": tr["median_s"] / tk["median_s"]}
    if nbytes:
        ceil = d2d_ceiling(ctx)
        rec.update(bytes_read=nbytes, kernel_gb_per_s=_bw(nbytes, tk["median_s"]),
                   reference_gb_per_s=_bw(nbytes, tr["median_s"]))
        if ceil:
            rec["kernel_vs_d2d_copy"] = rec["kernel_gb_per_s"] / ceil["copy_gb_per_s"]
            rec["kernel_vs_d2d_rw"] = rec["kernel_gb_per_s"] / ceil["rw_gb_per_s"]
    return rec


def _indexer_case(seed: int, B: int, I: int, D: int, S: int, kd: str):
    """Integer-valued q / k (every score exact in f32, many ties: order compared slot by slot), a permuted
    block table, NaN in every pool row no valid position reads, -1 in some unused block-table entries."""
    from hisparse_jax.model.indexer import hadamard, quantize_index_keys

    PAGE = 64
    MP = S // PAGE
    P = B * MP + 16
    rng = np.random.default_rng(seed)
    lens = [S, S - 1, max(S - 65, 1), S // 2 + 3]
    seq_lens = np.array([lens[b % 4] for b in range(B)], np.int32)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.randint(k1, (B, I, D), -3, 4).astype(jnp.float32)
    k = jax.random.randint(k2, (B, S, D), -3, 4).astype(jnp.float32)
    w = jax.random.randint(k3, (B, I), -4, 9).astype(jnp.float32) / 8
    fp8 = kd == "fp8"
    if fp8:  # the rotation is an involution: quantized operands come back as exact small integers
        q, k = hadamard(q), hadamard(k)
        stored, scale = quantize_index_keys(k)
    else:
        q, stored, scale = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), None
    del k
    live = jnp.arange(S)[None, :] < jnp.asarray(seq_lens)[:, None]  # [B, S]
    stored = jnp.where(live[..., None], stored, jnp.asarray(jnp.nan, stored.dtype))
    pages = rng.permutation(P)[:B * MP].reshape(B, MP)
    k_pages = jnp.full((P, PAGE, D), jnp.nan, stored.dtype).at[pages.reshape(-1)].set(
        stored.reshape(B * MP, PAGE, D))
    kw = {}
    if fp8:
        scale = jnp.where(live, scale, jnp.nan)
        kw["k_scale"] = jnp.full((P, PAGE), jnp.nan, jnp.float32).at[pages.reshape(-1)].set(
            scale.reshape(B * MP, PAGE))
    bt = pages.copy()
    for b, n in enumerate(seq_lens):
        for j in range(MP):
            if j * PAGE >= n and j % 2:
                bt[b, j] = -1
    args = (q, w, k_pages, jnp.asarray(bt, jnp.int32), jnp.asarray(seq_lens))
    key_bytes = int(seq_lens.sum()) * (D * (1 if fp8 else 2) + (4 if fp8 else 0))  # live keys (+ fp8 scales)
    return _block(args), _block(kw), seq_lens, key_bytes


def _kernel_indexer(ctx, S: int, kd: str, seed: int) -> dict:
    from functools import partial

    from pallas_kernels.indexer_topk import indexer_topk, indexer_topk_reference

    sz = ctx.sz
    B, I, D, topk = sz["idx_B"], sz["idx_heads"], sz["idx_dim"], sz["idx_topk"]
    args, kw, seq_lens, key_bytes = _indexer_case(seed, B, I, D, S, kd)
    kern = jax.jit(partial(indexer_topk, topk=topk, interpret=ctx.interpret))
    ref = jax.jit(partial(indexer_topk_reference, topk=topk))
    got, want = np.asarray(kern(*args, **kw)), np.asarray(ref(*args, **kw))
    well_formed = True
    for row, n in zip(got, seq_lens):
        m = min(int(n), topk)
        well_formed &= bool((row[m:] == -1).all() and ((row[:m] >= 0) & (row[:m] < n)).all()
                            and len(set(row[:m].tolist())) == m)
    sets_equal = all(set(a.tolist()) == set(b.tolist()) for a, b in zip(got, want))
    order_equal = bool(np.array_equal(got, want))
    rec = {"kernel": "indexer_topk", "variant": kd, "q_dtype": str(args[0].dtype), "key_dtype": str(args[2].dtype),
           "B": B, "heads": I, "dim": D, "context": S, "pages": S // 64, "topk": topk,
           "seq_lens": seq_lens.tolist(), "interpret": ctx.interpret,
           "correct": {"sets_equal": sets_equal, "order_equal": order_equal, "well_formed": well_formed,
                       "slots_differing": int((got != want).sum())},
           "passed": sets_equal and order_equal and well_formed}
    rec.update(_time_pair(ctx, lambda: kern(*args, **kw), lambda: ref(*args, **kw)))
    ceil = d2d_ceiling(ctx)
    rec["key_bytes"] = key_bytes
    if rec.get("timed") and ceil:
        t_read = key_bytes / (ceil["rw_gb_per_s"] * GB)
        rec["keys_read_once_s_at_d2d"] = t_read
        rec["kernel_vs_keys_read_once"] = rec["kernel_s"] / t_read
        rec["reference_vs_keys_read_once"] = rec["reference_s"] / t_read
    return rec


def _gather_case(seed: int, B: int, K: int, HR: int, S: int, hit_frac=0.5, resident_p=0.25, fill=0.75, clock=1000):
    """Resolver inputs with resident pages, hot-buffer hits (about hit_frac of the non-resident top-k
    positions are held) and misses; permuted tables, LRU stamps random, some empty slots (-1)."""
    rng = np.random.default_rng(seed)
    PAGE = 64
    MP, Rq, NH = S // PAGE, B + 2, -(-HR // PAGE)
    topk = np.stack([rng.choice(S, K, replace=False) for _ in range(B)]).astype(np.int32)
    req = rng.permutation(Rq)[:B].astype(np.int32)
    block_table = np.where(rng.random((Rq, MP)) < resident_p,
                           rng.permutation(4 * Rq * MP)[:Rq * MP].reshape(Rq, MP), -1).astype(np.int32)
    host_table = rng.permutation(4 * Rq * MP)[:Rq * MP].reshape(Rq, MP).astype(np.int32)
    hot_pages = rng.permutation(2 * Rq * NH)[:Rq * NH].reshape(Rq, NH).astype(np.int32)
    tok = np.full((Rq, HR), -1, np.int32)
    stamp = np.full((Rq, HR), -1, np.int32)
    owner = {int(r): b for b, r in enumerate(req)}
    for r in range(Rq):
        if r in owner:
            t = topk[owner[r]]
            nonres = t[block_table[r, t // PAGE] < 0]
            held = nonres[rng.random(nonres.size) < hit_frac]
            others = np.setdiff1d(np.arange(S), t)
        else:
            held, others = np.zeros(0, np.int64), np.arange(S)
        n_other = max(int(fill * HR) - held.size, 0)
        tags = np.concatenate([held, rng.choice(others, n_other, replace=False)])[:HR]
        slots = rng.permutation(HR)[:tags.size]
        tok[r, slots], stamp[r, slots] = tags, rng.integers(0, clock, tags.size)
    case = (topk, req, block_table, host_table, hot_pages, tok, stamp, np.int32(clock))
    return tuple(jnp.asarray(x) for x in case)


GATHER_FIELDS = ("page", "row", "valid", "resident", "miss", "src_page", "src_row", "hot_token", "hot_stamp")


def _kernel_gather(ctx, seed: int) -> dict:
    from functools import partial

    from pallas_kernels.sparse_gather import sparse_gather, sparse_gather_reference

    sz = ctx.sz
    B, K, HR, S = sz["gather_B"], sz["gather_K"], sz["gather_hot_rows"], sz["gather_ctx"]
    args = _block(_gather_case(seed, B, K, HR, S))
    kern = jax.jit(partial(sparse_gather, hot_rows=HR, interpret=ctx.interpret))
    ref = jax.jit(partial(sparse_gather_reference, hot_rows=HR))
    got = [np.asarray(x) for x in kern(*args)]
    want = [np.asarray(x) for x in ref(*args)]
    fields = {name: bool(a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b))
              for name, a, b in zip(GATHER_FIELDS, got, want)}
    valid, resident, miss = want[2], want[3], want[4]
    counts = {"slots": int(valid.size), "valid": int(valid.sum()), "resident": int(resident.sum()),
              "hits": int((valid & ~resident & ~miss).sum()), "misses": int(miss.sum())}
    MP, NH = S // 64, -(-HR // 64)
    # bytes one call must touch: top-k, the B rows of both tables, of hot_pages and of the hot state (read and
    # written), and the plan (4 int32 + 3 bool per slot)
    nbytes = B * K * 4 + B * 4 + 2 * B * MP * 4 + B * NH * 4 + 2 * 2 * B * HR * 4 + B * K * (4 * 4 + 3)
    rec = {"kernel": "sparse_gather", "variant": "mixed", "B": B, "K": K, "hot_rows": HR, "context": S,
           "interpret": ctx.interpret, "counts": counts,
           "correct": {"fields_identical": fields, "plan_identical": all(fields[f] for f in GATHER_FIELDS[:7]),
                       "hot_state_identical": fields["hot_token"] and fields["hot_stamp"]},
           "passed": all(fields.values()) and counts["hits"] > 0 and counts["misses"] > 0,
           "bytes_note": "bytes_read = top-k + the B rows of block/host tables and hot_pages + hot state read and "
                         "written + the plan written (the resolver is compare-bound, not bandwidth-bound)"}
    rec.update(_time_pair(ctx, lambda: kern(*args), lambda: ref(*args), nbytes))
    return rec


def _mla_case(seed: int, B: int, H: int, C: int, R: int, K: int, pool: str, q_dtype):
    """Each sequence owns 2K/64 pages of a permuted pool and selects K distinct rows of them; ~1/32 of the
    slots are invalid and point at junk addresses. Every pool row no valid slot selects is NaN."""
    rng = np.random.default_rng(seed)
    own = max(2 * K // 64, 1)
    P = B * own + 8
    perm = rng.permutation(P)
    page = rng.integers(0, P, (B, K)).astype(np.int32)
    row = rng.integers(0, 64, (B, K)).astype(np.int32)
    valid = rng.random((B, K)) >= 1 / 32
    valid[:, 0] = True
    for b in range(B):
        table = perm[b * own:(b + 1) * own]
        sel = rng.choice(own * 64, K, replace=False)
        page[b] = np.where(valid[b], table[sel // 64], page[b])
        row[b] = np.where(valid[b], sel % 64, row[b])
    vp, vr = jnp.asarray(page[valid]), jnp.asarray(row[valid])
    n = int(valid.sum())
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(seed), 5)
    rope = jnp.full((P, 64, R), jnp.nan, jnp.bfloat16).at[vp, vr].set(
        jax.random.normal(k2, (n, R)).astype(jnp.bfloat16))
    lat_vals = jax.random.normal(k1, (n, C))
    kw = {}
    if pool == "fp8":
        latent = jnp.full((P, 64, C), jnp.nan, jnp.float8_e4m3fn).at[vp, vr].set(lat_vals.astype(jnp.float8_e4m3fn))
        sc = 2.0 ** jax.random.randint(k3, (n, C // 128), -4, 2).astype(jnp.float32)
        kw["latent_scale"] = jnp.full((P, 64, C // 128), jnp.nan, jnp.float32).at[vp, vr].set(sc)
    else:
        latent = jnp.full((P, 64, C), jnp.nan, jnp.bfloat16).at[vp, vr].set(lat_vals.astype(jnp.bfloat16))
    q_lat = jax.random.normal(k4, (B, H, C)).astype(q_dtype)
    q_rope = jax.random.normal(k5, (B, H, R)).astype(q_dtype)
    args = (q_lat, q_rope, latent, rope, jnp.asarray(page), jnp.asarray(row), jnp.asarray(valid))
    row_bytes = C * (1 if pool == "fp8" else 2) + R * 2 + (C // 128 * 4 if pool == "fp8" else 0)
    return _block(args), _block(kw), n, row_bytes, P


def _kernel_mla(ctx, H: int, pool: str, q_name: str, seed: int) -> dict:
    from functools import partial

    from pallas_kernels.sparse_mla_decode import sparse_mla_decode, sparse_mla_decode_reference

    sz = ctx.sz
    B, C, R, K = sz["mla_B"], sz["mla_C"], sz["mla_R"], sz["mla_K"]
    q_dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[q_name]
    tol = {"bf16": 2e-2, "f32": 1e-4}[q_name]
    tau = float(1 / np.sqrt(192))
    args, kw, n_valid, row_bytes, P = _mla_case(seed, B, H, C, R, K, pool, q_dtype)
    kern = jax.jit(partial(sparse_mla_decode, tau=tau, interpret=ctx.interpret))
    ref = jax.jit(partial(sparse_mla_decode_reference, tau=tau))
    got = np.asarray(kern(*args, **kw))
    want = np.asarray(ref(*args, **kw))
    finite = bool(np.all(np.isfinite(got)) and np.all(np.isfinite(want)))
    max_abs = float(np.max(np.abs(got - want))) if finite else None
    rel = max_abs / max(float(np.max(np.abs(want))), 1e-30) if finite else None
    rec = {"kernel": "sparse_mla_decode", "variant": f"H{H} {pool} pool, q {q_name}", "B": B, "H": H, "C": C, "R": R,
           "K": K, "pool": pool, "q_dtype": q_name, "pool_pages": P, "valid_rows": n_valid, "row_bytes": row_bytes,
           "interpret": ctx.interpret,
           "correct": {"finite": finite, "shape_dtype_ok": got.shape == want.shape and got.dtype == np.float32,
                       "max_abs_err": max_abs, "max_rel_err": rel, "rel_tol": tol,
                       "rel_err_is": "max |kernel - reference| / max |reference|"},
           "passed": finite and got.shape == want.shape and rel is not None and rel <= tol,
           "bytes_note": "bytes_read = valid rows x (latent + rope + fp8 scales) bytes"}
    rec.update(_time_pair(ctx, lambda: kern(*args, **kw), lambda: ref(*args, **kw), n_valid * row_bytes))
    return rec


def section_kernels(ctx: Ctx) -> dict:
    """Each Pallas kernel against its reference: correctness on fresh random inputs, then kernel vs reference
    times, and bandwidth against the device-copy ceiling of this run."""
    sz = ctx.sz
    ctx.interpret = jax.default_backend() != "gpu"
    deadline = ctx.elapsed() + sz["kernels_max_s"]
    plan = []
    for i, S in enumerate(sz["idx_contexts"]):
        for j, kd in enumerate(sz["idx_dtypes"]):
            plan.append((f"indexer_topk {kd} ctx={S}", lambda S=S, kd=kd, s=10 * i + j: _kernel_indexer(ctx, S, kd, s)))
    plan.append(("sparse_gather mixed", lambda: _kernel_gather(ctx, 100)))
    for i, (H, pool, qn) in enumerate(sz["mla_variants"]):
        plan.append((f"sparse_mla_decode H={H} {pool} q={qn}",
                     lambda H=H, pool=pool, qn=qn, s=200 + i: _kernel_mla(ctx, H, pool, qn, s)))
    order = sz["kernels_order"]
    plan.sort(key=lambda p: next((k for k, pre in enumerate(order) if p[0].startswith(pre)), len(order)))
    runs, errors, failed = [], [], []
    for name, fn in plan:
        if ctx.over_budget() or ctx.elapsed() > deadline:
            runs.append({"name": name, "status": "skipped", "reason": "budget"})
            ctx.log(f"kernels {name}: skipped (budget)")
            continue
        t = time.perf_counter()
        try:
            rec = {"name": name, "status": "ok", **fn()}
        except Exception:  # noqa: BLE001
            rec = {"name": name, "status": "error", "error": traceback.format_exc(limit=12)}
            errors.append(name)
            ctx.log(f"kernels {name}: ERROR\n{rec['error']}")
        rec["variant_s"] = time.perf_counter() - t
        runs.append(rec)
        if rec["status"] == "ok":
            if not rec["passed"]:
                failed.append(name)
            ctx.log(f"kernels {name}: correct={rec['passed']} {_kernel_line(rec)}")
        ctx.report["sections"]["kernels"] = {"status": "running", "runs": runs}  # a cut-short run keeps these
        ctx.write()
    ok_runs = [r for r in runs if r["status"] == "ok"]
    out = {"interpret": ctx.interpret, "d2d_ceiling": d2d_ceiling(ctx), "runs": runs,
           "all_correct": bool(ok_runs) and not failed and not errors,
           "skipped": [r["name"] for r in runs if r["status"] == "skipped"],
           "convention": "kernel_gb_per_s = bytes the kernel must read / median time; kernel_vs_d2d_rw compares it "
                         "with the d2d copy's read+write traffic rate (kernel_vs_d2d_copy: with bytes copied / s); "
                         "indexer: kernel time / time to read the keys once at the d2d traffic rate"}
    if errors or failed:
        out.update(status="error", error=f"errors: {', '.join(errors) or '-'}; incorrect: {', '.join(failed) or '-'}")
    return out


def _kernel_line(r: dict) -> str:
    """One table line of a kernels run (after the name)."""
    c = r.get("correct", {})
    if r["kernel"] == "sparse_mla_decode":
        rel = c.get("max_rel_err")
        acc = f"rel {rel if rel is not None else float('nan'):.1e}"
    elif r["kernel"] == "indexer_topk":
        acc = f"diff {c.get('slots_differing')}"
    else:
        acc = f"hit {r['counts']['hits']} miss {r['counts']['misses']}"
    if not r.get("timed"):
        return acc
    s = f"{acc:16s} kernel {r['kernel_s'] * 1e3:8.3f} ms  ref {r['reference_s'] * 1e3:8.3f} ms  x{r['speedup_vs_reference']:.2f}"
    if r.get("kernel_gb_per_s") is not None:
        s += f"  {r['kernel_gb_per_s']:8.1f} GB/s"
        if r.get("kernel_vs_d2d_rw") is not None:
            s += f" ({100 * r['kernel_vs_d2d_rw']:.1f}% d2d)"
    if r.get("kernel_vs_keys_read_once") is not None:
        s += f"  x{r['kernel_vs_keys_read_once']:.1f} of keys-read-once"
    return s


# ----- section: fetch ---------------------------------------------------------------------------------
def _fetch_model(sz):
    from hisparse_jax.config import PRESETS

    L = sz["fetch_layers"]
    return PRESETS["tiny-glm"].replace(num_hidden_layers=L, indexer_types=("full",) + ("shared",) * (L - 1),
                                       mlp_layer_types=("dense",) * L, index_topk=sz["fetch_topk"])


def _build_plan(spec, sz, frac: float, seed: int):
    """A Plan for B requests x K top-k positions, `frac` of them misses with distinct hot-slot destinations."""
    from hisparse_jax.config import PAGE_SIZE

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
    n = int(miss.sum())
    chunk = min(spec.fetch_chunk, miss.size)
    n_pages = len(np.unique(f["src_page"][miss]))
    return {"misses": n, "distinct_host_pages": n_pages, "payload_bytes": n * nl * spec.row_bytes,
            "row_transfer_bytes": -(-n // chunk) * chunk * nl * spec.row_bytes,
            "page_transfer_bytes": n_pages * nl * spec.page_bytes}


def _poison_device_pools(ctx, spec, store):
    """Every device KV pool (latent, rope, latent scales) filled with NaN: a row not copied stays NaN."""
    upd = {}
    for name in ("latent", "rope") + (("latent_scale",) if spec.fp8 else ()):
        a = getattr(store, name)
        upd[name] = jax.device_put(jnp.full(a.shape, jnp.nan, a.dtype), ctx.sharding("device"))
    return _block(dataclasses.replace(store, **upd))


def _fill_store(ctx, spec, seed: int):
    """init_store, then random host pools (no NaN) and NaN-poisoned device pools."""
    from hisparse_jax.kv.state import init_store

    store = init_store(spec, ctx.device)
    host_s = ctx.sharding("pinned_host")
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)

    def rnd(k, like, lo=None):
        if lo is not None:  # positive scales
            v = jax.random.uniform(k, like.shape, jnp.float32, lo, 2 * lo)
        else:
            v = jax.random.normal(k, like.shape, jnp.float32)
        return jax.device_put(v.astype(like.dtype), host_s)

    upd = {"h_latent": rnd(k1, store.h_latent), "h_rope": rnd(k2, store.h_rope)}
    if spec.fp8:
        upd["h_latent_scale"] = rnd(k3, store.h_latent_scale, lo=0.25)
    return _block(dataclasses.replace(store, **upd))


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
    from hisparse_jax.kv import ops
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
                 "runs": [], "pool_scaling": [], "all_exact": True,
                 "pool_scaling_note": f"first miss fraction again with host and device pools {POOL_SCALE}x larger "
                                      "(same misses): time_ratio_vs_base ~1 means the fetch does not touch "
                                      "whole pools"}
    layers = None
    for kvd in sz["fetch_dtypes"]:
        hot_pages = -(-2 * K // 64)  # the default hot buffer: 2 x top-k rows
        cache = CacheConfig(kv_dtype=kvd, device_pages=B * hot_pages + 8, host_pages=B * pages_per_req + 8,
                            max_seqs=B, max_seq_len=sz["fetch_ctx"])
        spec0 = StoreSpec.create(model, cache)
        layers = spec0.groups[0]
        out["geometry"][f"{kvd}_row_bytes"] = spec0.row_bytes
        out["geometry"][f"{kvd}_page_bytes"] = spec0.page_bytes
        out["geometry"]["hot_rows"] = spec0.hot_rows
        for mech in MECHANISMS:
            if ctx.over_budget():
                out["runs"].append({"kv_dtype": kvd, "mechanism": mech, "status": "skipped", "reason": "budget"})
                continue
            spec = dataclasses.replace(spec0, fetch=mech)
            try:
                out["runs"].extend(_fetch_one(ctx, ops, spec, layers, kvd, mech, ceiling, sz["fetch_fracs"]))
            except Exception:  # noqa: BLE001
                out["runs"].append({"kv_dtype": kvd, "mechanism": mech, "status": "error",
                                    "error": traceback.format_exc(limit=8)})
                ctx.log(f"fetch {kvd} {mech}: ERROR\n{out['runs'][-1]['error']}")
                continue
            # the same misses with both pools POOL_SCALE x larger: a fetch should not cost more
            base = next((r for r in out["runs"] if r.get("status") == "ok" and r["kv_dtype"] == kvd
                         and r["mechanism"] == mech and r["miss_fraction"] == sz["fetch_fracs"][0]), None)
            if base is None or ctx.over_budget():
                continue
            big = dataclasses.replace(spec, host_pages=spec.host_pages * POOL_SCALE,
                                      device_pages=spec.device_pages * POOL_SCALE,
                                      index_pages=spec.index_pages * POOL_SCALE)
            try:
                (r,) = _fetch_one(ctx, ops, big, layers, kvd, mech, ceiling, sz["fetch_fracs"][:1])
                r["pool_scale"] = POOL_SCALE
                r["base_time_s"] = base["time_s"]
                r["time_ratio_vs_base"] = r["time_s"] / base["time_s"] if r.get("time_s") else None
                out["pool_scaling"].append(r)
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


def _fetch_one(ctx, ops, spec, layers, kvd, mech, ceiling, fracs) -> list[dict]:
    sz = ctx.sz
    store = _fill_store(ctx, spec, seed=1)
    host_np = {n: np.asarray(getattr(store, n)) for n in ("h_latent", "h_rope", "h_latent_scale")
               if getattr(store, n) is not None}
    dev_s = ctx.sharding("device")

    def fn(s, plan):
        return ops.fetch_misses(s.spec, s, layers, plan)

    runs = []
    compiled = None
    for frac in fracs:
        if ctx.over_budget():
            runs.append({"kv_dtype": kvd, "mechanism": mech, "miss_fraction": frac, "status": "skipped",
                         "reason": "budget"})
            continue
        f, miss, valid = _build_plan(spec, sz, frac, seed=int(frac * 1000) + 7)
        plan = ops.Plan(page=f["page"], row=f["row"], valid=valid, resident=np.zeros_like(valid), miss=miss,
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
            store, payload, transfer = compiled(store, plan)
            _block(store)
        rec["warnings"] = sorted({str(w.message)[:300] for w in wlog})
        rec["out_memory_kinds"] = {n: getattr(store, n).sharding.memory_kind for n in ("latent", "h_latent")}
        exp = _expected_bytes(spec, f, miss, len(layers))
        rec.update(misses=exp["misses"], distinct_host_pages=exp["distinct_host_pages"],
                   payload_bytes=int(payload) * spec.row_bytes, transfer_bytes=int(transfer) * spec.row_bytes,
                   expected_payload_bytes=exp["payload_bytes"],
                   expected_transfer_bytes=exp[f"{mech}_transfer_bytes"])
        rec["bytes_match"] = (rec["payload_bytes"] == exp["payload_bytes"]
                              and rec["transfer_bytes"] == rec["expected_transfer_bytes"])
        store_np = {n: np.asarray(getattr(store, n)) for n in ("latent", "rope", "latent_scale")
                    if getattr(store, n) is not None}
        rec["verify"] = _verify(spec, store_np, host_np, f, miss, layers)
        del store_np

        def step():
            nonlocal store
            store, p, tr = compiled(store, plan)
            _block((store, p, tr))

        t = timeit(step, sz["fetch_warmup"], sz["fetch_reps"], max_s=20.0)
        rec.update(time=t, time_s=t["median_s"],
                   payload_gb_per_s=_bw(rec["payload_bytes"], t["median_s"]),
                   transfer_gb_per_s=_bw(rec["transfer_bytes"], t["median_s"]))
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


# ----- section: decode --------------------------------------------------------------------------------
def section_decode(ctx: Ctx) -> dict:
    from flax import nnx

    from hisparse_jax.config import PAGE_SIZE, PRESETS, CacheConfig
    from hisparse_jax.kv.manager import TieredCache
    from hisparse_jax.kv.tiered import decode_step
    from hisparse_jax.model.decoder import SparseMLAModel

    sz = ctx.sz
    cfg = PRESETS["tiny-glm"]
    R, P = sz["decode_requests"], sz["decode_prompt"]
    total = P + sz["decode_warmup"] + sz["decode_steps"] + sz["decode_public_steps"] + 1
    pages = -(-total // PAGE_SIZE)
    model = SparseMLAModel(cfg, rngs=nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), ctx.device))  # committed parameters (one compile per step)
    graphdef, state = nnx.split(model)
    prefill = jax.jit(lambda st, ids: nnx.merge(graphdef, st).forward(ids))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, P).tolist() for _ in range(R)]
    t = time.perf_counter()
    rows, first = [], []
    for p in prompts:
        T = max(16, 1 << (len(p) - 1).bit_length())  # generate.py's prompt bucket
        ids = np.zeros((1, T), np.int32)
        ids[0, :len(p)] = p
        logits, aux = prefill(state, jnp.asarray(ids))
        rows.append((jnp.stack(aux["latent"])[:, 0], jnp.stack(aux["rope"])[:, 0], jnp.stack(aux["index_k"])[:, 0]))
        first.append(int(jnp.argmax(logits[0, len(p) - 1])))
    prefill_s = time.perf_counter() - t
    hot_rows = 2 * cfg.index_topk
    hot_pages = -(-hot_rows // PAGE_SIZE)
    common = dict(kv_dtype="bf16", host_pages=R * (pages + 1), max_seqs=R, max_seq_len=(pages + 1) * PAGE_SIZE)
    # the manager keeps room for a hot buffer when it admits: "resident" gets that slack too
    configs = {"resident": CacheConfig(device_pages=R * (pages + hot_pages + 1), **common)}
    for mech in sz["decode_mechanisms"]:  # under pressure: 2 tail pages + the hot buffer + 2 per request
        configs[f"pressure_{mech}"] = CacheConfig(device_pages=R * (2 + hot_pages + 2), fetch=mech, **common)
    dev = ctx.device
    runs = {}
    for name, cc in configs.items():
        t = time.perf_counter()
        tc = TieredCache(cfg, cc, device=dev)
        slots = []
        for p, (lat, rope, ik) in zip(prompts, rows):
            slots.append(tc.admit_prefilled(lat, rope, ik, len(p)))
        runs[name] = {"tc": tc, "slots": slots, "times": [], "stats": [], "compile_s": [],
                      "tokens": jax.device_put(jnp.asarray(first, jnp.int32), dev),
                      "req": jax.device_put(jnp.asarray(slots, jnp.int32), dev),
                      "device_pages": cc.device_pages, "evicted_at_admission": tc.evicted_pages,
                      "build_s": time.perf_counter() - t}

    # Time the library's jitted step with the model split once: `decode_step(model, ...)` also splits the
    # model (nnx.split) and hashes its graphdef on every call, host time that would blur the device-side
    # ratio. That per-call overhead is measured separately below ("public_decode_step").
    from hisparse_jax.kv import tiered as tiered_mod

    step_fn, step_how = tiered_mod.make_decode_step(model), "tiered.make_decode_step(model): split once"

    def one_step(r, fn=step_fn):
        tc = r["tc"]
        for s in r["slots"]:
            tc.reserve(s, tc.lengths[s] + 1)
        t = time.perf_counter()
        logits, tc.store, stats = fn(tc.store, {"tokens": r["tokens"], "req": r["req"]})
        _block(logits)
        dt = time.perf_counter() - t
        tc.advance(r["slots"])
        r["tokens"] = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return dt, stats

    for _ in range(sz["decode_warmup"]):
        for name, r in runs.items():
            dt, _ = one_step(r)
            r["compile_s"].append(dt)
    skipped = 0
    for i in range(sz["decode_steps"]):  # side by side: one step of each store per round
        if ctx.over_budget() and i >= 2:
            skipped = sz["decode_steps"] - i
            break
        for name, r in runs.items():
            dt, stats = one_step(r)
            r["times"].append(dt)
            r["stats"].append({k: np.asarray(v) for k, v in stats.items()})
    public = [one_step(runs["resident"], lambda store, batch: decode_step(model, store, batch))[0]
              for _ in range(sz["decode_public_steps"])]
    out: dict = {"model": "tiny-glm", "layers": cfg.num_hidden_layers, "topk": cfg.index_topk, "requests": R,
                 "prompt_tokens": P, "kv_dtype": "bf16", "hot_rows": hot_rows, "prefill_s": prefill_s,
                 "timed_steps": len(runs["resident"]["times"]), "skipped_steps_budget": skipped, "stores": {},
                 "step_timed_as": step_how,
                 "public_decode_step": {"how": "hisparse_jax.kv.tiered.decode_step(model, store, batch), resident",
                                        "step_median_s": statistics.median(public) if public else None,
                                        "steps": len(public)}}
    for name, r in runs.items():
        st = r["stats"]
        n = max(len(st), 1)
        spec = r["tc"].spec
        summ = {k: float(sum(int(np.sum(s[k])) * (spec.row_bytes if k.endswith("_rows") else 1) for s in st)) / n
                for k in ("resident", "hits", "misses", "h2d_rows", "h2d_transfer_rows", "d2h_rows",
                          "append_dropped")}
        for k in ("h2d", "h2d_transfer", "d2h"):
            summ[f"{k}_bytes"] = summ.pop(f"{k}_rows")
        out["stores"][name] = {
            "device_pages": r["device_pages"], "evicted_pages": r["tc"].evicted_pages,
            "evicted_at_admission": r["evicted_at_admission"], "build_s": r["build_s"],
            "warmup_step_s": r["compile_s"], "step_median_s": statistics.median(r["times"]) if r["times"] else None,
            "step_min_s": min(r["times"]) if r["times"] else None, "per_step_mean": summ,
        }
        for s in r["slots"]:
            r["tc"].release(s)
    res = out["stores"]["resident"]["per_step_mean"]
    out["resident_all_in_place"] = res["misses"] == 0 and res["hits"] == 0
    out["append_dropped_total"] = sum(s["per_step_mean"]["append_dropped"] for s in out["stores"].values())
    base = out["stores"]["resident"]["step_median_s"]
    for name in [n for n in out["stores"] if n != "resident"]:
        v = out["stores"][name]["step_median_s"]
        out[f"ratio_{name}_vs_resident"] = v / base if v and base else None
        ctx.log(f"decode {name}: {v * 1e3:.3f} ms/step vs resident {base * 1e3:.3f} ms/step "
                f"(x{v / base:.2f}); misses/step {out['stores'][name]['per_step_mean']['misses']:.0f}")
    return out


SECTIONS = {"ceilings": section_ceilings, "kernels": section_kernels, "fetch": section_fetch,
            "decode": section_decode}


# ----- summary table ----------------------------------------------------------------------------------
def summary_table(report: dict) -> str:
    env = report.get("environment", {})
    secs = report.get("sections", {})
    lines = [f"== gpu_check: {env.get('device_kind')} ({env.get('backend')}), jax {env.get('jax')}, "
             f"{env.get('date_utc')}, sizes={env.get('sizes')}, {report.get('elapsed_s', 0):.0f} s =="]

    def f(v, fmt):
        return format(v, fmt) if v is not None else format("-", ">" + re.match(r"\d*", fmt).group())

    c = secs.get("ceilings", {})
    for name in ("d2d_copy", "h2d_device_put", "h2d_jit_whole", "h2d_jit_chunked", "h2d_jit_page_blocks",
                 "d2h_device_put"):
        v = c.get(name)
        if isinstance(v, dict) and v.get("gb_per_s"):
            lines.append(f"ceiling  {name:22s} {v['gb_per_s']:9.2f} GB/s  ({v['bytes'] / MIB:.0f} MiB, "
                         f"{v['median_s'] * 1e3:.3f} ms)")
        elif isinstance(v, dict):
            lines.append(f"ceiling  {name:22s} {v.get('status')} {v.get('reason', '')}")
    ke = secs.get("kernels", {})
    for r in ke.get("runs", []):
        if r.get("status") == "ok":
            lines.append(f"kernels  {r['name']:38s} {'ok' if r['passed'] else 'WRONG'}  {_kernel_line(r)}")
        else:
            err = (r.get("error") or "").strip().splitlines()
            lines.append(f"kernels  {r['name']:38s} {r.get('status')} {r.get('reason', '')}"
                         + (f" {err[-1][:120]}" if err else ""))
    fe = secs.get("fetch", {})
    if fe.get("runs"):
        lines.append("fetch    dtype mech miss     ms   payload MiB  moved MiB  payload GB/s  moved GB/s  "
                     "%ceil  exact")
        for r in fe["runs"]:
            if r.get("status") != "ok":
                lines.append(f"fetch    {r.get('kv_dtype'):5s} {r.get('mechanism'):4s} "
                             f"{r.get('status')} {r.get('reason', '')}")
                continue
            ok = r["verify"]["all_exact"] and r["verify"]["others_untouched"] and r["bytes_match"]
            lines.append(
                f"fetch    {r['kv_dtype']:5s} {r['mechanism']:4s} {r['miss_fraction']:4.0%} {r['time_s'] * 1e3:8.3f} "
                f"{r['payload_bytes'] / MIB:11.2f} {r['transfer_bytes'] / MIB:10.2f} "
                f"{f(r['payload_gb_per_s'], '12.2f')} {f(r['transfer_gb_per_s'], '11.2f')} "
                f"{f(100 * r['payload_vs_h2d_ceiling'] if r.get('payload_vs_h2d_ceiling') else None, '6.1f')}  "
                f"{'yes' if ok else 'NO'}")
        for r in fe.get("pool_scaling", []):
            if r.get("status") == "ok":
                lines.append(f"fetch    {r['kv_dtype']:5s} {r['mechanism']:4s} pools x{r['pool_scale']}: "
                             f"{r['time_s'] * 1e3:.3f} ms vs {r['base_time_s'] * 1e3:.3f} ms "
                             f"(x{r['time_ratio_vs_base']:.2f}), exact "
                             f"{'yes' if r['verify']['all_exact'] and r['verify']['others_untouched'] else 'NO'}")
            else:
                lines.append(f"fetch    {r.get('kv_dtype')} {r.get('mechanism')} pools scaled: {r.get('status')}")
        hl = [(r["kv_dtype"], r["mechanism"], r["hlo"]) for r in fe["runs"] if r.get("hlo")]
        for kvd, mech, h in hl:
            cnt = h["counts"]
            lines.append(f"hlo      {kvd:5s} {mech:4s} host-compute instrs {cnt['host_compute_attr']:4d}  "
                         f"copy-start {cnt['copy_start']:3d}  custom-calls {sum(h['custom_call_targets'].values()):3d}"
                         f"  host ops: {','.join(h['host_compute_ops'][:6]) or '-'}")
    de = secs.get("decode", {})
    if de.get("stores"):
        for name, s in de["stores"].items():
            lines.append(f"decode   {name:14s} {f(s['step_median_s'] * 1e3 if s['step_median_s'] else None, '9.3f')} "
                         f"ms/step  misses/step {s['per_step_mean']['misses']:7.0f}  h2d/step "
                         f"{s['per_step_mean']['h2d_bytes'] / MIB:7.3f} MiB  device pages {s['device_pages']}")
        pub = de.get("public_decode_step", {}).get("step_median_s")
        lines.append(f"decode   resident via public decode_step (splits the model per call) "
                     f"{f(pub * 1e3 if pub else None, '.3f')} ms/step")
        for name in [n for n in de["stores"] if n != "resident"]:
            lines.append(f"decode   ratio {name} / resident = {f(de.get(f'ratio_{name}_vs_resident'), '.2f')}")
    for name, s in secs.items():
        err = s.get("error", "").strip().splitlines() if s.get("status") == "error" else []
        lines.append(f"section  {name:10s} {s.get('status')}" + (f"  {err[-1][:160]}" if err else ""))
    return "\n".join(lines)


# ----- main -------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for gpu_check.json (and hlo_fetch.txt)")
    p.add_argument("--cpu-smoke", action="store_true", help="run on the CPU with tiny sizes (< 60 s)")
    p.add_argument("--only", default="", help=f"comma-separated sections out of {','.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=240.0, help="skip what remains once this much time has passed")
    p.add_argument("--hard-timeout-s", type=float, default=290.0,
                   help="watchdog: dump every thread's stack and exit after this long (0 = off)")
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    if args.hard_timeout_s > 0:
        faulthandler.dump_traceback_later(args.hard_timeout_s, exit=True)
    sizes = "smoke" if args.cpu_smoke else "full"
    if not args.cpu_smoke and jax.default_backend() == "cpu":
        print("note: no accelerator found; using the smoke sizes (pass --cpu-smoke to say so)", flush=True)
        sizes = "smoke"
    ctx = Ctx(args, sizes)
    ctx.report = {"tool": "experiments/gpu_check.py", "argv": sys.argv[1:], "budget_s": args.budget_s,
                  "units": {"*_s": "seconds", "*_bytes": "bytes", "*_gb_per_s": "1e9 bytes / s", "*_mib": "2**20 bytes",
                            "miss_fraction": "fraction of the B x K top-k rows fetched from host"},
                  "sizes": dict(ctx.sz), "sections": {}}
    try:
        ctx.report["environment"] = environment(ctx)
    except Exception:  # noqa: BLE001
        ctx.report["environment"] = {"status": "error", "error": traceback.format_exc()}
    env = ctx.report["environment"]
    ctx.log(f"jax {env.get('jax')} backend {env.get('backend')} device {env.get('device_kind')} "
            f"memory kinds {env.get('memory_kinds')} python {env.get('python')}")
    ctx.write()
    for name, fn in SECTIONS.items():
        if only and name not in only:
            continue
        if ctx.over_budget():
            ctx.report["sections"][name] = {"status": "skipped", "reason": f"budget {args.budget_s:.0f} s passed"}
            ctx.log(f"section {name}: skipped (budget)")
            continue
        ctx.log(f"section {name} ...")
        t = time.perf_counter()
        try:
            res = dict(fn(ctx))
            res.setdefault("status", "ok")
        except Exception:  # noqa: BLE001
            res = {"status": "error", "error": traceback.format_exc()}
            ctx.log(f"section {name}: ERROR\n{res['error']}")
        res["section_s"] = time.perf_counter() - t
        ctx.report["sections"][name] = res
        ctx.write()
    statuses = {k: v.get("status") for k, v in ctx.report["sections"].items()}
    ctx.report["ok"] = all(s == "ok" for s in statuses.values())
    ctx.write()
    faulthandler.cancel_dump_traceback_later()
    print(summary_table(ctx.report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
