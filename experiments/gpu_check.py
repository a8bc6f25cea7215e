#!/usr/bin/env python3
"""One prepared, unattended check of the tiered KV store and the Pallas kernels on a GPU (and, with
--cpu-smoke, the same structure at tiny sizes on a CPU).

    PYTHONPATH=. python3 experiments/gpu_check.py --out DIR [--cpu-smoke] [--only NAME,...] [--budget-s 480]

Contract: shared/gpu/README.md. It imports nothing beyond the standard library, numpy, jax and flax (through
the package itself), so it runs on the GPU image as it is.

Every section runs in its own subprocess (`python3 gpu_check.py --section NAME ...`) with its own timeout:
a Triton abort or an illegal address poisons the CUDA context and cannot be caught by `try`, so the parent
process never touches the accelerator; it starts one child per section, streams its output, kills its
process group when its timeout passes, records a timeout / crash (exit code, signal, stderr tail) and goes
on with the next section. A child writes DIR/sections/NAME.json as soon as it has something (status
"running" with what it has so far, then the final record); the parent merges every section file into
DIR/gpu_check.json after each section and every few seconds while one runs, so a kill at any moment
leaves everything measured so far. Child logs: DIR/logs/NAME.log (stdout) and NAME.stderr.log.

The plan (`SECTIONS`: name -> soft budget on a GPU, start-up and compiles included; `PLAN`, the sections without
an `only_because`, in table order, sums to at most PLAN_LIMIT_S = 480 s, 8 minutes of a 15-minute lease, most
important first; the parent stops starting sections once --budget-s (default 480) is spent and trims the last
one's timeout to what remains; a section skips a check that would end past its soft budget):

* engine (190 s): the engine's three policies on a GLM-5-shaped model, fp8 KV, 32 x 16,000-token prompts
  (whole-prompt prefill), a device budget of a quarter of their need: tokens/s, inter-token latency, running requests, hit rate, H2D bytes
  per step, the host's share of the step time, identical tokens (`gpu_sections/engine.py`).
* ceilings (20 s): device-to-device copy bandwidth and pinned_host -> device copy bandwidth (device_put,
  inside jit whole / in chunks / page-sized blocks) plus device -> pinned_host; median after warm-up.
* kernel_mla (60 s): the public `sparse_mla_decode` (the library's default variant; its keyword defaults are
  recorded) at H 128 with fp8 then bf16 pools, then the other shapes while the budget lasts.
* fetch (55 s): `kv.fetch.fetch_misses` per mechanism (`config.FETCH_MECHANISMS`) and row format (bf16, fp8) at
  10/20/30 % misses on a store with the real cache geometry, verified byte for byte against the host pool (every
  other device row must keep its NaN poison); the `fetch*` options recorded; HLO facts (DIR/hlo_fetch.txt).
* kernel_indexer (50 s): indexer_topk against its reference and against the host's float64 top-k of the same
  dequantized inputs (a difference counts only beyond TIE_RTOL of the k-th score).
* mosaic_matrix (60 s): the Mosaic GPU decode's bisection matrix (`gpu_sections/mosaic_matrix.py`), each cell
  in a worker process.

Behind --only (each with its reason in the table): compile (every kernel and the tiered decode step once at tiny
shapes), decode (`runner.decode_step` on "tiny-glm", all resident vs under pressure), decode_kernels
(`decode_loop` with the references vs the Pallas kernels), kernel_gather, kernel_mla_mosaic, mla_big_pool
(sparse_mla_decode on stacked fp8 pools of > 4 GiB read with `layer=`), mosaic_probes (the Mosaic decode on
inputs that isolate its stages, `MOSAIC_PROBES`). A wrong top-k is explained by the reference's scores
(`mismatch`); a wrong decode by where it is wrong (`error_pattern`).

Every kernel run also carries the traffic model's bytes for its shapes and plan (`pallas_kernels/traffic.py`:
model_bytes, model_ideal_bytes, traffic_model) and, when timed with the ceilings known, the model's time at
the measured device-copy read+write rate (model_s_at_d2d) and model time / measured time (roofline_fraction).

Kernel and decode times are N calls chained inside one jitted `lax.fori_loop` (each call's input depends on
the previous call's output, so nothing is hoisted) divided by N: per-call dispatch (20-60 us) is larger than
a kernel's ideal time. Ceilings and fetches are large enough to be timed per call.

--cpu-smoke runs every section (the plan, then the rest), every check the installed jax can run: before jax 0.11
(no Mosaic GPU Pallas API) each Mosaic GPU kernel check is recorded as passed with `skipped` saying why (and listed in its section's `unavailable`),
the Triton ones run. Its section timeouts are hang guards sized for two idle cores, stretched on a busier machine
by its load average per core (at most SMOKE_TIMEOUT_MAX_SCALE; a section's `timeout_scale`).

Units in the JSON: *_s seconds, *_bytes bytes, *_gb_per_s 1e9 bytes per second, *_mib 2**20 bytes.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import datetime
import faulthandler
import json
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.gpu_sections import library, mosaic_matrix
from experiments.gpu_sections.engine import section_engine

GB = 1e9
MIB = 2 ** 20

# ----- sizes ------------------------------------------------------------------------------------------
# The compile pass: the same tiny shapes on a GPU and on a CPU (Triton minimums: dims >= 16, pages of 64).
TINY = dict(
    idx_B=2, idx_heads=16, idx_dim=32, idx_topk=32, idx_context=256,
    gather_B=2, gather_K=32, gather_hot_rows=64, gather_ctx=512,
    mla_B=2, mla_C=128, mla_R=64, mla_K=32, mla_H=16, mla_layers=3,
    decode_prompts=(250, 190), decode_new=3,
)
SIZES = {
    "full": dict(
        d2d_bytes=2 << 30, h2d_bytes=2 << 30, h2d_chunk_bytes=64 << 20, small_blocks=2048, warmup=2, reps=7,
        fetch_layers=4, fetch_requests=4, fetch_topk=2048, fetch_ctx=32768, fetch_fracs=(0.1, 0.2, 0.3),
        fetch_dtypes=("bf16", "fp8"), fetch_warmup=2, fetch_reps=7, compile_decode_fetches=("row", "page"),
        fetch_pool_scaling=(("bf16", "row"), ("bf16", "page"), ("fp8", "row"), ("fp8", "page")),
        decode_model={}, decode_requests=4, decode_prompt=2048, decode_warmup=2, decode_steps=12,
        decode_mechanisms=("row", "page"), decode_public_steps=4, decode_loop_steps=8, decode_loop_reps=2,
        kernels_time=True, loop_n=50, loop_reps=5, timed_variants=None,
        idx_B=4, idx_heads=64, idx_dim=128, idx_topk=2048, idx_contexts=(131072,),  # (32K ran out of time)
        # fp8 first (the next run's goal: >= 2 TB/s of keys, the host's float64 top-k), bf16, then int4 if time is
        # left; the Mosaic GPU scores (matched Triton's time on the H200) behind them: not in the plan's 50 s
        idx_dtypes=("fp8", "bf16", "int4"),
        idx_mosaic_contexts=(),
        gather_B=32, gather_K=2048, gather_hot_rows=4096, gather_ctx=32768,
        mla_B=32, mla_C=512, mla_R=64, mla_K=2048,
        # (H, pool, q[, backend]): the Mosaic GPU decode (jax >= 0.11) right after the Triton one at the same shapes
        # (a section that runs out of time skips its last variants)
        mla_variants=((128, "fp8", "bf16"), (128, "fp8", "bf16", "mosaic"), (128, "bf16", "bf16"),
                      (128, "bf16", "bf16", "mosaic"), (64, "fp8", "bf16"), (64, "fp8", "bf16", "mosaic"),
                      (64, "bf16", "bf16"), (128, "bf16", "f32")),
        big_layers=40, big_pages=4096, big_H=128, big_B=32, big_K=2048,  # 40 x 4096 x 64 x 512 B = 5 GiB fp8
        mosaic_probes=None,  # all of MOSAIC_PROBES
    ),
    "smoke": dict(
        d2d_bytes=16 << 20, h2d_bytes=8 << 20, h2d_chunk_bytes=2 << 20, small_blocks=32, warmup=1, reps=3,
        fetch_layers=2, fetch_requests=2, fetch_topk=64, fetch_ctx=512, fetch_fracs=(0.1, 0.3),
        fetch_dtypes=("bf16", "fp8"), fetch_warmup=0, fetch_reps=1, fetch_pool_scaling=(("bf16", "row"),),
        compile_decode_fetches=("row",),
        # the test suite's tiny geometry, 2 dense layers (a full indexer + a shared one): CPU compiles are the cost
        decode_model=dict(num_hidden_layers=2, indexer_types=("full", "shared"), mlp_layer_types=("dense", "dense"),
                          hidden_size=48, intermediate_size=64, num_attention_heads=3, q_lora_rank=40,
                          kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=12, vocab_size=97,
                          index_n_heads=16, index_head_dim=32, index_topk=16),
        decode_requests=2, decode_prompt=512, decode_warmup=1, decode_steps=2, decode_mechanisms=("row",),
        decode_public_steps=1, decode_loop_steps=2, decode_loop_reps=1,
        # the kernel sections at the compile pass's shapes (its compiles come from the persistent cache), only the
        # first variant of each timed (a timing loop is one more compile of the interpreted kernel)
        kernels_time=True, loop_n=2, loop_reps=1, timed_variants=1,
        idx_B=TINY["idx_B"], idx_heads=TINY["idx_heads"], idx_dim=TINY["idx_dim"], idx_topk=TINY["idx_topk"],
        idx_contexts=(TINY["idx_context"],), idx_dtypes=("bf16", "fp8", "int4"), idx_mosaic_contexts=(TINY["idx_context"],),
        gather_B=TINY["gather_B"], gather_K=TINY["gather_K"], gather_hot_rows=TINY["gather_hot_rows"],
        gather_ctx=TINY["gather_ctx"],
        mla_B=TINY["mla_B"], mla_C=TINY["mla_C"], mla_R=TINY["mla_R"], mla_K=TINY["mla_K"],
        mla_variants=((TINY["mla_H"], "bf16", "bf16"), (TINY["mla_H"], "fp8", "bf16"),
                      (TINY["mla_H"], "fp8", "bf16", "mosaic")),
        big_layers=TINY["mla_layers"], big_pages=2 * TINY["mla_B"] * max(2 * TINY["mla_K"] // 64, 1),
        big_H=TINY["mla_H"], big_B=TINY["mla_B"], big_K=TINY["mla_K"],
        mosaic_probes=2,  # interpreted, each probe is seconds: the first two prove the section runs
    ),
}
# the fetch mechanisms the sections compare: the library's own list (`config.FETCH_MECHANISMS`)
from hisparse_jax.config import FETCH_MECHANISMS as MECHANISMS  # noqa: E402
POOL_SCALE = 4


class Ctx:
    """A section's context (in its child process): sizes, a soft deadline, and its JSON file."""

    def __init__(self, args, sizes_name: str, section: str, soft_budget_s: float):
        self.args = args
        self.sizes_name = sizes_name
        self.sz = SIZES[sizes_name]
        self.t0 = time.perf_counter()
        self.budget_s = soft_budget_s
        self.out_dir = args.out
        self.section = section
        self.interpret = jax.default_backend() != "gpu"
        self.record: dict = {}
        self.hlo_texts: list[tuple[str, str]] = []
        # what other sections measured already (the ceilings, for bandwidth ratios)
        self.report: dict = {"sections": read_section_files(args.out)}

    def with_sizes(self, **over) -> "Ctx":
        c = copy.copy(self)
        c.sz = dict(self.sz, **over)
        return c

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def log(self, *a):
        print(f"[{self.section} {self.elapsed():6.1f}s]", *a, flush=True)

    @property
    def device(self):
        return jax.devices()[0]

    def sharding(self, kind: str):
        return jax.sharding.SingleDeviceSharding(self.device, memory_kind=kind)

    def checkpoint(self, rec: dict) -> None:
        """Called by a kernel check with its correctness record before it is timed (set by `_run_variants`)."""

    def partial(self, **kv):
        """Record results so far (status stays "running") and write them out at once."""
        self.record.update(kv)
        self.write()

    def write(self):
        self.record["section_elapsed_s"] = self.elapsed()
        write_json(section_path(self.out_dir, self.section), self.record)
        if self.hlo_texts:
            with open(os.path.join(self.out_dir, f"hlo_{self.section}.txt"), "w") as f:
                for name, text in self.hlo_texts:
                    f.write(f"\n\n===== {name} =====\n{text}")


def section_path(out_dir: str, name: str) -> str:
    return os.path.join(out_dir, "sections", f"{name}.json")


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1, default=_jsonable)
    os.replace(path + ".tmp", path)


def read_section_files(out_dir: str) -> dict:
    out = {}
    d = os.path.join(out_dir, "sections")
    for name in SECTIONS if os.path.isdir(d) else ():
        try:
            with open(section_path(out_dir, name)) as f:
                out[name] = json.load(f)
        except (OSError, ValueError):
            pass
    return out
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
def parent_env() -> dict:
    """What the parent can say without touching the accelerator (no jax backend is initialized here)."""
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "platform": platform.platform(), "numpy": np.__version__,
           "jax": jax.__version__, "parent_pid": os.getpid(),
           "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                  "XLA_PYTHON_CLIENT_PREALLOCATE", "JAX_PLATFORMS")
                   if os.environ.get(k) is not None}}
    try:
        import jaxlib

        env["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.current,"
                            "pcie.link.width.current", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=15)
        env["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
    except Exception as e:  # noqa: BLE001
        env["nvidia_smi"] = f"unavailable: {type(e).__name__}"
    return env


def device_env(sizes_name: str) -> dict:
    """The device as one child sees it (recorded by every section; the parent keeps the first)."""
    d = jax.devices()[0]
    env = {"backend": jax.default_backend(), "devices": [str(x) for x in jax.devices()],
           "device_kind": d.device_kind, "sizes": sizes_name, "jax": jax.__version__,
           "memory_kinds": [m.kind for m in d.addressable_memories()], "default_memory_kind": d.default_memory().kind}
    try:
        import flax

        env["flax"] = flax.__version__
    except Exception as e:  # noqa: BLE001
        env["flax"] = f"unavailable: {e}"
    try:
        env["device_memory_bytes_limit"] = (d.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001
        pass
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
        ctx.partial(**out)

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


# ----- ceilings of this run (for the kernels and fetch sections) ------------------------------------
def d2d_ceiling(ctx: Ctx) -> dict | None:
    """The device-copy ceiling of this run: {copy_gb_per_s, rw_gb_per_s (read + write traffic)}, or None."""
    c = ctx.report.get("sections", {}).get("ceilings", {}).get("d2d_copy")
    if not (isinstance(c, dict) and c.get("gb_per_s")):
        return None
    return {"copy_gb_per_s": c["gb_per_s"], "rw_gb_per_s": c.get("rw_gb_per_s") or 2 * c["gb_per_s"]}


def traffic_fields(ctx: Ctx, rec: dict, model: Callable[[], object]) -> dict:
    """The traffic model's bytes for a kernel run (`pallas_kernels/traffic.py`: bytes the kernel reads and
    writes from its grid, blocks and passes, and the ideal) and, when the run was timed and the ceilings are
    known, the model's time at the measured device-copy traffic rate and model time / measured time (the
    roofline fraction). `model()` returns a `traffic.Traffic`; a failure is recorded, never raised."""
    try:
        t = model()
    except Exception:  # noqa: BLE001
        return {"traffic_model_error": traceback.format_exc(limit=4)}
    out = {"traffic_model": t.to_json(), "model_read_bytes": t.read_bytes, "model_write_bytes": t.write_bytes,
           "model_bytes": t.total_bytes, "model_ideal_bytes": t.ideal_bytes, "model_vs_ideal": t.ratio}
    ceil = d2d_ceiling(ctx)
    if rec.get("timed") and ceil and rec.get("kernel_s"):
        rate = ceil["rw_gb_per_s"] * GB
        out.update(model_s_at_d2d=t.total_bytes / rate, ideal_s_at_d2d=t.ideal_bytes / rate,
                   roofline_fraction=t.total_bytes / rate / rec["kernel_s"],
                   ideal_roofline_fraction=t.ideal_bytes / rate / rec["kernel_s"])
    return out



# ----- timing inside one jitted loop ------------------------------------------------------------------
def nudge(v, out):
    """v + 0 * (a scalar of the previous call's output): the same values, but a data dependence XLA cannot
    remove (x * 0.0 is not folded for floats: NaN / inf semantics), so no call is hoisted out of the loop."""
    leaf = jax.tree_util.tree_leaves(out)[0]
    return v + (leaf.reshape(-1)[0].astype(jnp.float32) * 0.0).astype(v.dtype)


def loop_time(call, v0, const, step, n: int, reps: int, max_s: float = 10.0) -> dict:
    """Time per call of `call(v, const)` from n calls chained in one jitted `fori_loop`: call i+1 gets
    `step(v_i, out_i)`, and each call's whole output is the loop carry (nothing is dead or loop-invariant).
    Median of `reps` runs of the loop after one run that compiles; `const` (pools, tables) are arguments,
    never constants baked into the program."""
    out0 = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(call, v0, const))

    @jax.jit
    def looped(v, out, c):
        def body(_, carry):
            v, _ = carry
            o = call(v, c)
            return step(v, o), o

        return jax.lax.fori_loop(0, n, body, (v, out))

    t = time.perf_counter()
    _block(looped(v0, out0, const))
    first = time.perf_counter() - t
    times = []
    for _ in range(max(reps, 1)):
        t = time.perf_counter()
        _block(looped(v0, out0, const))
        times.append(time.perf_counter() - t)
        if sum(times) > max_s:
            break
    med = statistics.median(times)
    return {"per_call_s": med / n, "calls_per_loop": n, "loop_median_s": med, "loop_min_s": min(times),
            "loop_runs": len(times), "first_loop_s": first}


def _time_pair(ctx, kernel_call, ref_call, v0, const, step, nbytes=None) -> dict:
    """Kernel and reference time per call, each from `loop_time` (N chained calls in one jitted loop / N)."""
    sz = ctx.sz
    if not sz["kernels_time"]:
        return {"timed": False}
    tk = loop_time(kernel_call, v0, const, step, sz["loop_n"], sz["loop_reps"])
    tr = loop_time(ref_call, v0, const, step, sz["loop_n"], sz["loop_reps"])
    rec = {"timed": True, "timed_as": f"{sz['loop_n']} chained calls in one jitted fori_loop / {sz['loop_n']}",
           "kernel_time": tk, "reference_time": tr, "kernel_s": tk["per_call_s"],
           "reference_s": tr["per_call_s"], "speedup_vs_reference": tr["per_call_s"] / tk["per_call_s"]}
    if nbytes:
        ceil = d2d_ceiling(ctx)
        rec.update(bytes_read=nbytes, kernel_gb_per_s=_bw(nbytes, tk["per_call_s"]),
                   reference_gb_per_s=_bw(nbytes, tr["per_call_s"]))
        if ceil:
            rec["kernel_vs_d2d_copy"] = rec["kernel_gb_per_s"] / ceil["copy_gb_per_s"]
            rec["kernel_vs_d2d_rw"] = rec["kernel_gb_per_s"] / ceil["rw_gb_per_s"]
    return rec

def _indexer_case(seed: int, B: int, I: int, D: int, S: int, kd: str):
    """Integer-valued q / k (every score exact in f32, many ties: order compared slot by slot), a permuted
    block table, NaN in every pool row no valid position reads, -1 in some unused block-table entries."""
    from pallas_kernels.common import hadamard
    from pallas_kernels.indexer_topk.reference import quantize_index_keys, quantize_index_keys_int4
    from pallas_kernels.traffic import index_key_bytes

    PAGE = 64
    MP = S // PAGE
    P = B * MP + 16
    rng = np.random.default_rng(seed)
    lens = [S, S - 1, max(S - 65, 1), S // 2 + 3]
    seq_lens = np.array([lens[b % 4] for b in range(B)], np.int32)
    # built with NumPy (eager jax ops would each compile a small program: seconds on a CPU)
    q = rng.integers(-3, 4, (B, I, D)).astype(np.float32)
    k = rng.integers(-3, 4, (B, S, D)).astype(np.float32)
    w = rng.integers(-4, 9, (B, I)).astype(np.float32) / 8
    quantized = kd in ("fp8", "int4")  # e4m3 + f32 scales, or MXFP4 codes (uint8, two per byte) + UE8M0 scales
    if quantized:  # the rotation is an involution: quantized operands come back as exact small integers
        quantize = quantize_index_keys if kd == "fp8" else quantize_index_keys_int4
        rot = jax.jit(lambda q, k: (hadamard(q), *quantize(hadamard(k))))
        q, stored, scale = (np.asarray(x) for x in rot(q, k))
    else:
        q, stored, scale = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), None
    del k
    live = np.arange(S)[None, :] < seq_lens[:, None]  # [B, S]
    # unused rows poisoned: NaN, or for MXFP4 codes 0xFF with scale bytes 255 (infinite scales: NaN or inf dots)
    poison = 0xFF if kd == "int4" else np.nan
    stored = stored.copy()
    stored[~live] = poison
    pages = rng.permutation(P)[:B * MP].reshape(B, MP)
    k_pages = np.full((P, PAGE, stored.shape[-1]), poison, stored.dtype)
    k_pages[pages.reshape(-1)] = stored.reshape(B * MP, PAGE, stored.shape[-1])
    kw = {}
    if quantized:
        scale = scale.copy() if kd == "int4" else scale.astype(np.float32)
        scale[~live] = poison
        kw["k_scale"] = np.full((P, PAGE, *scale.shape[2:]), poison, scale.dtype)
        kw["k_scale"][pages.reshape(-1)] = scale.reshape(B * MP, PAGE, *scale.shape[2:])
        kw = {key: jnp.asarray(v) for key, v in kw.items()}
    q, w, k_pages = jnp.asarray(q), jnp.asarray(w), jnp.asarray(k_pages)
    bt = pages.copy()
    for b, n in enumerate(seq_lens):
        for j in range(MP):
            if j * PAGE >= n and j % 2:
                bt[b, j] = -1
    args = (q, w, k_pages, jnp.asarray(bt, jnp.int32), jnp.asarray(seq_lens))
    key_bytes = int(seq_lens.sum()) * index_key_bytes(kd, D)  # live keys (+ their scales)
    return _block(args), _block(kw), seq_lens, key_bytes


def _kernel_indexer(ctx, S: int, kd: str, seed: int, backend: str = "triton") -> dict:
    """One indexer_topk variant against its reference. backend "mosaic": the Mosaic GPU scores and XLA's top-k
    (jax >= 0.11)."""
    from functools import partial

    from pallas_kernels.indexer_topk import indexer_topk, indexer_topk_reference

    if backend == "mosaic":
        from pallas_kernels.backends import mosaic_unavailable_reason

        if (why := mosaic_unavailable_reason()) is not None:
            return {"kernel": "indexer_topk", "backend": backend, "variant": kd, "context": S, "passed": True,
                    "skipped": why}
    sz = ctx.sz
    B, I, D, topk = sz["idx_B"], sz["idx_heads"], sz["idx_dim"], sz["idx_topk"]
    args, kw, seq_lens, key_bytes = _indexer_case(seed, B, I, D, S, kd)
    kern = jax.jit(partial(indexer_topk, topk=topk, interpret=ctx.interpret, backend=backend))
    ref = jax.jit(partial(indexer_topk_reference, topk=topk))
    got, want = np.asarray(kern(*args, **kw)), np.asarray(ref(*args, **kw))
    well_formed = True
    for row, n in zip(got, seq_lens):
        m = min(int(n), topk)
        well_formed &= bool((row[m:] == -1).all() and ((row[:m] >= 0) & (row[:m] < n)).all()
                            and len(set(row[:m].tolist())) == m)
    sets_equal = all(set(a.tolist()) == set(b.tolist()) for a, b in zip(got, want))
    order_equal = bool(np.array_equal(got, want))
    rec = {"kernel": "indexer_topk", "backend": backend, "variant": kd, "q_dtype": str(args[0].dtype),
           "key_dtype": str(args[2].dtype),
           "B": B, "heads": I, "dim": D, "context": S, "pages": S // 64, "topk": topk,
           "seq_lens": seq_lens.tolist(), "interpret": ctx.interpret,
           "correct": {"sets_equal": sets_equal, "order_equal": order_equal, "well_formed": well_formed,
                       "slots_differing": int((got != want).sum())},
           "passed": sets_equal and order_equal and well_formed}
    host = rec["correct"]["host_f64"] = _host_topk_check(args, kw, seq_lens, got, kd)
    if not rec["passed"]:
        rec["mismatch"] = _indexer_mismatch(args, kw, seq_lens, got, want)
        # the reference's own order is f32: a kernel that differs from it only at near ties of the float64 scores
        # is correct (the H200's fp8 top-k); the record keeps both verdicts
        rec["passed"] = bool(well_formed and host["checked"] and host["mismatches_beyond_tie_tol"] == 0)
        rec["passed_by"] = "host float64 top-k within the tie tolerance" if rec["passed"] else None
    ctx.checkpoint(rec)
    call = lambda f: lambda v, c: f(v, *c[0], **c[1])  # noqa: E731  (v: q, nudged per call)
    rec.update(_time_pair(ctx, call(kern), call(ref), args[0], (args[1:], kw), nudge))
    ceil = d2d_ceiling(ctx)
    rec["key_bytes"] = key_bytes
    if rec.get("timed"):  # the next run's goal: >= 2 TB/s of keys read
        rec["keys_gb_per_s"] = _bw(key_bytes, rec["kernel_s"])
    if rec.get("timed") and ceil:
        t_read = key_bytes / (ceil["rw_gb_per_s"] * GB)
        rec["keys_read_once_s_at_d2d"] = t_read
        rec["kernel_vs_keys_read_once"] = rec["kernel_s"] / t_read
        rec["reference_vs_keys_read_once"] = rec["reference_s"] / t_read
    from pallas_kernels import traffic

    model = traffic.indexer_topk_mosaic_traffic if backend == "mosaic" else traffic.indexer_topk_traffic
    rec.update(traffic_fields(ctx, rec, lambda: model(
        B, I, D, S, topk, key_dtype=kd, query_dtype=str(args[0].dtype), seq_lens=seq_lens.tolist())))
    return rec


# A kernel's pick that the host's float64 top-k does not hold (or the reverse) is a near tie, not an error, when its
# float64 score is within this relative distance of the k-th best float64 score: float32 sums of 128-term dots and
# of the heads' weighted ReLUs round to ~1e-6 of the score, and the fp8 indexer's k-th score on 128K positions
# has hundreds of neighbours closer than 1e-3 (the H200's 10-14 % of slots off)
TIE_RTOL = 1e-3


def _host_scores_f64(args, kw, kd: str) -> np.ndarray | None:
    """Indexer scores [B, S] in float64 on the host from the same dequantized inputs the kernel reads: keys
    (bf16, or e4m3 x their fp32 scale) and the query as the scoring quantizes it (fp8: Hadamard-rotated e4m3 x its
    per-head scale, `index_scores_fp8`'s own quantization run on the CPU). None for int4 (not modelled here)."""
    from pallas_kernels.common import FP8_BLOCK, fp8_quantize, hadamard

    q, w, k_pages, bt, _ = (np.asarray(a) for a in args)
    if kd == "int4":
        return None
    w = w.astype(np.float64)
    if kd == "fp8":
        cpu = jax.devices("cpu")[0]
        qq, qs = jax.jit(lambda x: fp8_quantize(hadamard(x), block=max(x.shape[-1], FP8_BLOCK)), device=cpu)(
            jax.device_put(q.astype(np.float32), cpu))
        qd, w = np.asarray(qq).astype(np.float64), w * np.asarray(qs, np.float64)
        ks = np.asarray(kw["k_scale"]).astype(np.float64)
    else:
        qd, ks = q.astype(np.float64), None
    page = k_pages.shape[1]
    B, MP = bt.shape
    out = np.empty((B, MP * page))
    for b in range(B):
        pg = np.maximum(bt[b], 0)
        keys = k_pages[pg].reshape(MP * page, -1).astype(np.float64)  # [S, D]
        s = np.maximum(qd[b] @ keys.T, 0.0)  # [I, S]
        out[b] = w[b] @ s
        if ks is not None:
            out[b] *= ks[pg].reshape(-1)
    return out


def _host_topk_check(args, kw, seq_lens, got, kd: str) -> dict:
    """The kernel's top-k sets against the host's float64 top-k of the same inputs (`_host_scores_f64`), counting
    only mismatches beyond a near tie: a pick the host's top-k lacks whose float64 score is below kth - tol, or a
    host pick the kernel lacks above kth + tol (tol = TIE_RTOL x |kth|)."""
    scores = _host_scores_f64(args, kw, kd)
    if scores is None:
        return {"checked": False, "why": f"no float64 host model of {kd} scores here"}
    rows, beyond_total = [], 0
    for b, n in enumerate(seq_lens):
        n = int(n)
        m = min(n, got.shape[1])
        sc = scores[b, :n]
        order = np.lexsort((np.arange(n), -sc))[:m]  # descending, the lower position first in a tie
        kth = float(sc[order[-1]]) if m else 0.0
        tol = TIE_RTOL * abs(kth)
        g = {int(p) for p in got[b, :m] if 0 <= p < n}
        host = set(order.tolist())
        extra, missing = sorted(g - host), sorted(host - g)
        far_extra = [p for p in extra if sc[p] < kth - tol]
        far_missing = [p for p in missing if sc[p] > kth + tol]
        beyond = len(far_extra) + len(far_missing)
        beyond_total += beyond
        rel = [abs(sc[p] - kth) / max(abs(kth), 1e-30) for p in far_extra + far_missing]
        rows.append({"kernel_not_host": len(extra), "host_not_kernel": len(missing), "within_tie_tol": len(extra)
                     + len(missing) - beyond, "beyond_tie_tol": beyond, "kth_f64": kth,
                     "max_rel_distance_beyond": max(rel) if rel else 0.0,
                     "host_positions_within_tol_of_kth": int(np.sum(np.abs(sc - kth) <= tol))})
    return {"checked": True, "tie_rtol": TIE_RTOL, "rows": rows, "mismatches_beyond_tie_tol": beyond_total,
            "rule": "kernel picks vs the host's float64 top-k of the same dequantized inputs; a difference counts "
                    "only beyond tie_rtol x |k-th score| of the k-th score"}


def _indexer_mismatch(args, kw, seq_lens, got, want) -> dict:
    """What a top-k mismatch is, by the reference's own scores (`paged_index_scores`, on this device): a
    tie-break difference (the kernel's picks have the scores of the reference's picks, slot by slot) or different
    positions (some pick scores below the reference's k-th: the kernel's scores are not the reference's)."""
    from pallas_kernels.indexer_topk.reference import paged_index_scores

    q, w, k_pages, bt, _ = args
    scores = np.asarray(jax.jit(paged_index_scores)(q, w, k_pages, bt, **kw))
    # the same reference on the host CPU: a GPU-only difference of the reference itself (its rotation, scales or
    # sums) shows as gpu_vs_cpu_reference; the kernel's picks are judged by both
    cpu = jax.devices("cpu")[0]
    on_cpu = jax.device_put((q, w, k_pages, bt, kw), cpu)
    cpu_scores = np.asarray(jax.jit(paged_index_scores)(*on_cpu[:4], **on_cpu[4]))
    out = {"rows": [], "gpu_vs_cpu_reference_max_abs": float(np.nanmax(np.abs(
        np.where(np.isfinite(scores) & np.isfinite(cpu_scores), scores - cpu_scores, 0.0))))}
    for b, n in enumerate(seq_lens):
        m = min(int(n), got.shape[1])
        g, r = got[b, :m], want[b, :m]
        sg, sr = scores[b, g], scores[b, r]
        kth = float(sr.min()) if m else None
        live = np.arange(scores.shape[1]) < n
        cpu_kth = float(np.sort(np.where(live, cpu_scores[b], -np.inf))[::-1][m - 1]) if m else None
        out["rows"].append({
            "slots_differing": int((g != r).sum()),
            "picks_below_cpu_reference_kth": int((cpu_scores[b, g] < cpu_kth).sum()) if m else 0,
            "reference_picks_below_cpu_reference_kth": int((cpu_scores[b, r] < cpu_kth).sum()) if m else 0,
            "max_score": float(np.max(np.abs(sr))) if m else 0.0,
            "same_scores_slot_by_slot": bool(np.array_equal(sg, sr)),
            "picks_below_reference_kth": int((sg < kth).sum()) if m else 0,
            "picks_tied_at_kth": int((sg == kth).sum()) if m else 0,
            "reference_sorted": bool(np.all(np.diff(sr) <= 0)),
            "max_score_gap": float(np.max(np.abs(sg - sr))) if m else 0.0})
    out["tie_break_only"] = all(r["same_scores_slot_by_slot"] for r in out["rows"])
    return out


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
    ctx.checkpoint(rec)
    # chained calls carry the hot state (hot_token, hot_stamp) from one call to the next, clock + 1 per call
    call = lambda f: lambda v, c: f(*c, *v)  # noqa: E731
    step = lambda v, o: (o[7], o[8], v[2] + 1)  # noqa: E731
    rec.update(_time_pair(ctx, call(kern), call(ref), tuple(args[5:]), tuple(args[:5]), step, nbytes))
    rec["timing_note"] = "later calls see the hot state the previous call left (more hits than the first)"
    rec.update(traffic_fields(ctx, rec, lambda: _gather_loop_traffic(ref, args, want, HR, S // 64, sz["loop_n"])))
    return rec


def _gather_loop_traffic(ref, args, want, HR: int, MP: int, n: int):
    """The traffic model of one call of the timing loop: its first call (the case's state: random stamps, maybe
    radix passes to select the victims) and n - 1 calls on the state the previous call left, averaged per call."""
    from pallas_kernels import traffic

    B, K = args[0].shape
    first = traffic.gather_plan_counts(*args[:3], args[4], args[5], args[6], args[7], *want[2:5], hot_rows=HR)
    nxt = [np.asarray(x) for x in ref(*args[:5], want[7], want[8], args[7] + 1)]
    later = traffic.gather_plan_counts(*args[:3], args[4], want[7], want[8], args[7] + 1, *nxt[2:5], hot_rows=HR)
    t1 = traffic.sparse_gather_traffic(B, K, HR, MP, **first)
    t2 = traffic.sparse_gather_traffic(B, K, HR, MP, **later)
    mean = lambda a, b: (a + (n - 1) * b) // max(n, 1)  # noqa: E731
    return traffic.Traffic(mean(t1.read_bytes, t2.read_bytes), mean(t1.write_bytes, t2.write_bytes),
                           mean(t1.ideal_bytes, t2.ideal_bytes), t2.launches,
                           f"mean of 1 first call ({first}) and {n - 1} later calls ({later}); later: {t2.notes}",
                           t2.passes, t2.reference_bytes)


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
    vp, vr = page[valid], row[valid]
    n = int(valid.sum())
    # built with NumPy (eager jax ops would each compile a small program: seconds on a CPU)
    rope = np.full((P, 64, R), np.nan, jnp.bfloat16)
    rope[vp, vr] = rng.standard_normal((n, R), np.float32).astype(jnp.bfloat16)
    lat_vals = rng.standard_normal((n, C), np.float32)
    kw = {}
    lat_dtype = jnp.float8_e4m3fn if pool == "fp8" else jnp.bfloat16
    latent = np.full((P, 64, C), np.nan, lat_dtype)
    latent[vp, vr] = lat_vals.astype(lat_dtype)
    if pool == "fp8":
        sc = np.full((P, 64, C // 128), np.nan, np.float32)
        sc[vp, vr] = 2.0 ** rng.integers(-4, 2, (n, C // 128)).astype(np.float32)
        kw["latent_scale"] = jnp.asarray(sc)
    q_lat = rng.standard_normal((B, H, C), np.float32).astype(q_dtype)
    q_rope = rng.standard_normal((B, H, R), np.float32).astype(q_dtype)
    args = tuple(jnp.asarray(x) for x in (q_lat, q_rope, latent, rope, page, row, valid))
    row_bytes = C * (1 if pool == "fp8" else 2) + R * 2 + (C // 128 * 4 if pool == "fp8" else 0)
    return _block(args), _block(kw), n, row_bytes, P


def _kernel_mla(ctx, H: int, pool: str, q_name: str, seed: int, backend: str = "triton") -> dict:
    """One sparse_mla_decode variant against its reference. backend "mosaic": the Mosaic GPU kernel (jax >= 0.11;
    bf16 operands, so the bf16 tolerance; at least 256 latent columns, the smallest it takes)."""
    from functools import partial

    from pallas_kernels.sparse_mla_decode import sparse_mla_decode, sparse_mla_decode_reference

    sz = ctx.sz
    B, C, R, K = sz["mla_B"], sz["mla_C"], sz["mla_R"], sz["mla_K"]
    variant = f"H{H} {pool} pool, q {q_name}" + (f", {backend}" if backend != "triton" else "")
    if backend == "mosaic":
        from pallas_kernels.backends import mosaic_unavailable_reason

        if (why := mosaic_unavailable_reason()) is not None:
            return {"kernel": "sparse_mla_decode", "backend": backend, "variant": variant, "H": H, "pool": pool,
                    "q_dtype": q_name, "passed": True, "skipped": why}
        C = max(C, 256)
    q_dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[q_name]
    tol = {"bf16": 2e-2, "f32": 1e-4}["bf16" if backend == "mosaic" else q_name]
    tau = float(1 / np.sqrt(192))
    args, kw, n_valid, row_bytes, P = _mla_case(seed, B, H, C, R, K, pool, q_dtype)
    kern = jax.jit(partial(sparse_mla_decode, tau=tau, interpret=ctx.interpret, backend=backend))
    ref = jax.jit(partial(sparse_mla_decode_reference, tau=tau))
    got = np.asarray(kern(*args, **kw))
    want = np.asarray(ref(*args, **kw))
    finite = bool(np.all(np.isfinite(got)) and np.all(np.isfinite(want)))
    max_abs = float(np.max(np.abs(got - want))) if finite else None
    rel = max_abs / max(float(np.max(np.abs(want))), 1e-30) if finite else None
    rec = {"kernel": "sparse_mla_decode", "backend": backend,
           "variant": variant,
           "B": B, "H": H, "C": C, "R": R,
           "K": K, "pool": pool, "q_dtype": q_name, "pool_pages": P, "valid_rows": n_valid, "row_bytes": row_bytes,
           "interpret": ctx.interpret,
           "correct": {"finite": finite, "shape_dtype_ok": got.shape == want.shape and got.dtype == np.float32,
                       "max_abs_err": max_abs, "max_rel_err": rel, "rel_tol": tol,
                       "rel_err_is": "max |kernel - reference| / max |reference|"},
           "passed": finite and got.shape == want.shape and rel is not None and rel <= tol,
           "bytes_note": "bytes_read = valid rows x (latent + rope + fp8 scales) bytes"}
    if not rec["passed"] and got.shape == want.shape:
        rec["error_pattern"] = _error_pattern(got, want)
    ctx.checkpoint(rec)
    call = lambda f: lambda v, c: f(c[0], v, *c[1], **c[2])  # noqa: E731  (v: q_rope, nudged per call)
    rec.update(_time_pair(ctx, call(kern), call(ref), args[1], (args[0], args[2:], kw), nudge,
                          n_valid * row_bytes))
    # every slot's score (C + R dims) and value (C) MMAs, the count issue 49 states (18.3 GFLOP at B 32, H 128, K 2048)
    rec["flops"] = 2 * B * H * K * (2 * C + R)
    if rec.get("timed"):
        rec["tflops"] = rec["flops"] / rec["kernel_s"] / 1e12
    from pallas_kernels import traffic

    model = traffic.sparse_mla_decode_mosaic_traffic if backend == "mosaic" else traffic.sparse_mla_decode_traffic
    rec.update(traffic_fields(ctx, rec, lambda: model(B, H, C, R, K, kv_dtype=pool, query_dtype=q_name,
                                                      valid_rows=n_valid)))
    return rec

def _error_pattern(got: np.ndarray, want: np.ndarray) -> dict:
    """Where a wrong decode output [B, H, C] is wrong: the relative error per 128-column chunk (the Mosaic kernel's
    warpgroups own halves of C), per group of 16 heads and per sequence, and how the rows compare (norms, cosine):
    a scale error, a permutation and noise look different here."""
    a, b = got.astype(np.float64), want.astype(np.float64)
    B, H, C = a.shape
    scale = max(float(np.nanmax(np.abs(b))), 1e-30)
    err = np.abs(np.nan_to_num(a - b, nan=np.inf)) / scale
    chunks = [float(err[..., c:c + 128].max()) for c in range(0, C, 128)]
    heads = [float(err[:, h:h + 16].max()) for h in range(0, H, 16)]
    cos = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
    return {"rel_err_by_128_columns": chunks, "rel_err_by_16_heads": heads,
            "rel_err_by_sequence": [float(err[i].max()) for i in range(B)],
            "nan_outputs": int(np.isnan(a).sum()), "zero_rows": int((np.abs(a).max(-1) == 0).sum()),
            "norm_ratio_median": float(np.median(np.linalg.norm(a, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1),
                                                                                         1e-30))),
            "cosine_median": float(np.nanmedian(cos)), "cosine_min": float(np.nanmin(cos))}


def _kernel_line(r: dict) -> str:
    """One table line of a kernels run (after the name)."""
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
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
    if r.get("roofline_fraction") is not None:
        s += f"  model {r['model_bytes'] / MIB:.1f} MiB: {r['model_s_at_d2d'] * 1e3:.3f} ms, roofline " \
             f"{100 * r['roofline_fraction']:.0f}%"
    return s




def _pallas_kind() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"


def _run_variants(ctx, plan) -> dict:
    """Run (name, fn(ctx) -> record) checks one after another; every record is written as soon as it exists
    (its correctness before its timing), an exception is recorded and the next check runs."""
    runs, errors, failed = [], [], []
    longest = 0.0  # the longest check so far: one that would end past the soft deadline is not started (a
    # timeout kills a compile mid-way and loses its record; the H200 lost kernel_mla's third variant so)
    for name, fn in plan:
        if ctx.over_budget() or (not ctx.interpret and ctx.elapsed() + longest > ctx.budget_s):
            runs.append({"name": name, "status": "skipped", "reason": "section soft deadline" + (
                f" (the longest check so far took {longest:.1f} s)" if longest else "")})
            ctx.log(f"{name}: skipped (deadline)")
            ctx.partial(runs=runs)
            continue
        t = time.perf_counter()
        cur = {"name": name, "status": "running"}
        limit = ctx.sz.get("timed_variants")
        vctx = ctx if limit is None or len(runs) < limit or not ctx.sz["kernels_time"] else ctx.with_sizes(
            kernels_time=False)
        runs.append(cur)
        ctx.partial(runs=runs)
        vctx.checkpoint = lambda rec, cur=cur: (cur.update(rec), ctx.partial(runs=runs))
        try:
            rec = fn(vctx)
            cur.update(rec)
            cur["status"] = "ok"
        except Exception:  # noqa: BLE001
            cur.update(status="error", error=traceback.format_exc(limit=12))
            errors.append(name)
            ctx.log(f"{name}: ERROR\n{cur['error']}")
        cur["variant_s"] = time.perf_counter() - t
        longest = max(longest, cur["variant_s"])
        if cur["status"] == "ok":
            if not cur.get("passed"):
                failed.append(name)
            ctx.log(f"{name}: correct={cur.get('passed')} {_kernel_line(cur) if 'kernel' in cur else ''}")
        ctx.partial(runs=runs)
    ok_runs = [r for r in runs if r["status"] == "ok"]
    out = {"interpret": ctx.interpret, "d2d_ceiling": d2d_ceiling(ctx), "runs": runs,
           "all_correct": bool(ok_runs) and not failed and not errors,
           "skipped": [r["name"] for r in runs if r["status"] == "skipped"],
           # checks this jax cannot run (the Mosaic GPU kernels before jax 0.11): name -> why
           "unavailable": {r["name"]: r["skipped"] for r in runs if r["status"] == "ok" and r.get("skipped")}}
    if errors or failed:
        out.update(status="error", error=f"errors: {', '.join(errors) or '-'}; incorrect: {', '.join(failed) or '-'}")
    return out


KERNEL_CONVENTION = ("kernel_s / reference_s: time per call from N chained calls in one jitted fori_loop / N; "
                     "kernel_gb_per_s = bytes the kernel must read / time per call; kernel_vs_d2d_rw compares it with "
                     "the d2d copy's read+write traffic rate (kernel_vs_d2d_copy: with bytes copied / s); indexer: "
                     "kernel time / time to read the keys once at the d2d traffic rate; model_bytes = the "
                     "traffic model's bytes read + written per call (pallas_kernels/traffic.py), model_s_at_d2d = "
                     "model_bytes / the d2d read+write rate, roofline_fraction = model_s_at_d2d / kernel_s "
                     "(ideal_*: the model's ideal bytes, each input read once)")


# ----- sections: kernels ------------------------------------------------------------------------------
def section_kernel_indexer(ctx: Ctx) -> dict:
    sz = ctx.sz
    plan = [(f"indexer_topk {kd} ctx={S}" + (f" {be[0]}" if be else ""),
             lambda c, S=S, kd=kd, s=10 * i + j, be=be: _kernel_indexer(c, S, kd, s, *be))
            for i, S in enumerate(sz["idx_contexts"]) for j, kd in enumerate(sz["idx_dtypes"])
            for be in ((), ("mosaic",)) if not be or S in sz["idx_mosaic_contexts"]]
    return dict(_run_variants(ctx, plan), convention=KERNEL_CONVENTION)


def section_kernel_gather(ctx: Ctx) -> dict:
    return dict(_run_variants(ctx, [("sparse_gather mixed", lambda c: _kernel_gather(c, 100))]),
                convention=KERNEL_CONVENTION)


def _mla_plan(ctx: Ctx, mosaic: bool) -> list:
    return [(f"sparse_mla_decode H={H} {pool} q={qn}" + (f" {be[0]}" if be else ""),
             lambda c, H=H, pool=pool, qn=qn, be=be, s=200 + i: _kernel_mla(c, H, pool, qn, s, *be))
            for i, (H, pool, qn, *be) in enumerate(ctx.sz["mla_variants"]) if bool(be) == mosaic]


def section_kernel_mla(ctx: Ctx) -> dict:
    """The Triton decode (the library's default variant, through the public `sparse_mla_decode`) at H 128 with
    fp8 and bf16 pools first; the other shapes while the soft budget lasts."""
    from pallas_kernels.sparse_mla_decode import sparse_mla_decode

    return dict(_run_variants(ctx, _mla_plan(ctx, mosaic=False)), convention=KERNEL_CONVENTION,
                entry_point="pallas_kernels.sparse_mla_decode.sparse_mla_decode",
                entry_defaults=library.entry_defaults(sparse_mla_decode))


def section_kernel_mla_mosaic(ctx: Ctx) -> dict:
    """The Mosaic GPU decode in its own process: a fault there (an illegal address poisons the CUDA context) costs
    no other kernel's result."""
    c = ctx.with_sizes(kernels_time=False) if ctx.interpret else ctx  # interpreted: its timing loop is a slow compile
    return dict(_run_variants(c, _mla_plan(ctx, mosaic=True)), convention=KERNEL_CONVENTION)


def _stacked_pool(ctx, L: int, P: int, H: int, B: int, K: int, C: int, R: int, seed: int) -> dict:
    """sparse_mla_decode on stacked fp8 pools [L, P, 64, C] read at the last layer (`layer=` traced), the
    selected rows in the top pages of that layer (the largest byte offsets of the pool); every other row NaN."""
    from functools import partial

    from pallas_kernels.sparse_mla_decode import sparse_mla_decode, sparse_mla_decode_reference

    rng = np.random.default_rng(seed)
    own = max(2 * K // 64, 1)
    if B * own > P:
        raise ValueError(f"{B} sequences x {own} pages > {P} pages")
    top = P - B * own + rng.permutation(B * own)
    page = rng.integers(0, P, (B, K)).astype(np.int32)  # invalid slots point at junk addresses
    row = rng.integers(0, 64, (B, K)).astype(np.int32)
    valid = rng.random((B, K)) >= 1 / 32
    valid[:, 0] = True
    for b in range(B):
        sel = rng.choice(own * 64, K, replace=False)
        page[b] = np.where(valid[b], top[b * own:(b + 1) * own][sel // 64], page[b])
        row[b] = np.where(valid[b], sel % 64, row[b])
    layer = L - 1
    vp, vr = jnp.asarray(page[valid]), jnp.asarray(row[valid])
    n = int(valid.sum())
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(seed), 5)
    nan_pools = jax.jit(lambda: (jnp.full((L, P, 64, C), jnp.nan, jnp.float8_e4m3fn),
                                 jnp.full((L, P, 64, R), jnp.nan, jnp.bfloat16),
                                 jnp.full((L, P, 64, C // 128), jnp.nan, jnp.float32)))

    @partial(jax.jit, donate_argnums=(0, 1, 2))
    def fill(lat, rope, scale, vp, vr):
        return (lat.at[layer, vp, vr].set(jax.random.normal(k1, (n, C)).astype(lat.dtype)),
                rope.at[layer, vp, vr].set(jax.random.normal(k2, (n, R)).astype(rope.dtype)),
                scale.at[layer, vp, vr].set(2.0 ** jax.random.randint(k3, (n, C // 128), -4, 2).astype(jnp.float32)))

    t = time.perf_counter()
    lat, rope, scale = _block(fill(*nan_pools(), vp, vr))
    build_s = time.perf_counter() - t
    pool_bytes = sum(int(a.size) * a.dtype.itemsize for a in (lat, rope, scale))
    max_offset = ((layer * P + int(vp.max())) * 64 + 63) * C  # last byte row start of the latent pool read (fp8)
    q_lat = jax.random.normal(k4, (B, H, C)).astype(jnp.bfloat16)
    q_rope = jax.random.normal(k5, (B, H, R)).astype(jnp.bfloat16)
    tau = float(1 / np.sqrt(192))
    pools = (lat, rope, jnp.asarray(page), jnp.asarray(row), jnp.asarray(valid))
    kw = {"latent_scale": scale, "layer": jnp.int32(layer)}
    kern = jax.jit(partial(sparse_mla_decode, tau=tau, interpret=ctx.interpret))
    ref = jax.jit(partial(sparse_mla_decode_reference, tau=tau))
    got = np.asarray(kern(q_lat, q_rope, *pools, **kw))
    want = np.asarray(ref(q_lat, q_rope, *pools, **kw))
    finite = bool(np.all(np.isfinite(got)) and np.all(np.isfinite(want)))
    max_abs = float(np.max(np.abs(got - want))) if finite else None
    rel = max_abs / max(float(np.max(np.abs(want))), 1e-30) if finite else None
    row_bytes = C + 2 * R + 4 * (C // 128)
    rec = {"kernel": "sparse_mla_decode", "variant": f"stacked fp8 pools, layer={layer} of {L}", "pool": "fp8",
           "layers": L, "pages_per_layer": P, "B": B, "H": H, "C": C, "R": R, "K": K, "layer": layer,
           "pool_bytes": pool_bytes, "pool_gib": pool_bytes / 2 ** 30, "latent_pool_bytes": int(lat.size),
           "max_latent_byte_offset_read": max_offset, "reads_beyond_4gib": max_offset >= 2 ** 32,
           "valid_rows": n, "row_bytes": row_bytes, "build_s": build_s, "interpret": ctx.interpret,
           "correct": {"finite": finite, "max_abs_err": max_abs, "max_rel_err": rel, "rel_tol": 2e-2,
                       "rows_compared": f"all {B} x {H} outputs ({n} selected pool rows)"},
           "passed": finite and rel is not None and rel <= 2e-2}
    ctx.checkpoint(rec)
    call = lambda f: lambda v, c: f(c[0], v, *c[1], **c[2])  # noqa: E731
    rec.update(_time_pair(ctx, call(kern), call(ref), q_rope, (q_lat, pools, kw), nudge, n * row_bytes))
    from pallas_kernels import traffic

    rec.update(traffic_fields(ctx, rec, lambda: traffic.sparse_mla_decode_traffic(
        B, H, C, R, K, kv_dtype="fp8", query_dtype="bf16", valid_rows=n)))
    return rec


# Probes of the Mosaic GPU decode, one head block (H 64: no cluster), one split, K 32: each isolates a stage.
# (name, pool, what the queries are, valid slots, sequences)
MOSAIC_PROBES = (
    ("one valid row", "bf16", "random", 1, 1),  # softmax over one row: the output is that row's latent (copy + values)
    ("uniform scores", "bf16", "zero", 32, 1),  # q = 0: every score 0, the output is the rows' mean (values, sums)
    ("rope scores only", "bf16", "rope", 32, 1),  # q_lat = 0: the rope MMA and the softmax
    ("latent scores only", "bf16", "latent", 32, 1),  # q_rope = 0: the latent MMAs, the warpgroups' score exchange
    ("random, half the slots valid", "bf16", "random", 16, 1),
    # the kernel stores its registers to the outputs at (split, b, heads) offsets: one sequence hides a wrong one
    ("random, two sequences", "bf16", "random", 32, 2),
    ("one valid row, fp8 pool", "fp8", "random", 1, 1),  # the fp8 conversion (and its scale rows) alone
)


def _mosaic_probe(ctx, name: str, pool: str, queries: str, n_valid: int, B: int, seed: int) -> dict:
    from functools import partial

    from pallas_kernels.backends import mosaic_unavailable_reason
    from pallas_kernels.sparse_mla_decode import sparse_mla_decode_reference

    rec = {"kernel": "sparse_mla_decode", "backend": "mosaic", "variant": f"probe: {name}", "pool": pool}
    if (why := mosaic_unavailable_reason()) is not None:
        return dict(rec, passed=True, skipped=why)
    H, C, R, K = 64, 512, 64, 32
    args, kw, _, _, _ = _mla_case(seed, B, H, C, R, K, pool, jnp.bfloat16)
    q_lat, q_rope, latent, rope, page, row, valid = args
    v = np.zeros((B, K), bool)
    v[:, :n_valid] = True
    valid = jnp.asarray(v & np.asarray(valid) | (np.arange(K) == 0)[None])
    if queries in ("zero", "rope"):
        q_lat = jnp.zeros_like(q_lat)
    if queries in ("zero", "latent"):
        q_rope = jnp.zeros_like(q_rope)
    args = (q_lat, q_rope, latent, rope, page, row, valid)
    tau = float(1 / np.sqrt(192))
    from pallas_kernels.sparse_mla_decode.kernel_mosaic import sparse_mla_decode_mosaic

    kern = jax.jit(partial(sparse_mla_decode_mosaic, tau=tau, interpret=ctx.interpret, splits=1, cluster=1))
    want = np.asarray(jax.jit(partial(sparse_mla_decode_reference, tau=tau))(*args, **kw))
    got = np.asarray(kern(*args, **kw))
    finite = bool(np.all(np.isfinite(got)))
    rel = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30)) if finite else None
    rec.update(B=B, H=H, C=C, R=R, K=K, queries=queries, valid_rows=int(np.asarray(valid).sum()),
               interpret=ctx.interpret, correct={"finite": finite, "max_rel_err": rel, "rel_tol": 2e-2},
               passed=finite and rel is not None and rel <= 2e-2)
    if not rec["passed"]:
        rec["error_pattern"] = _error_pattern(got, want)
    return rec


def section_mosaic_probes(ctx: Ctx) -> dict:
    """The Mosaic GPU decode on inputs that isolate its stages (`MOSAIC_PROBES`), after everything else: it was
    wrong on an H200 (relative error ~1) while interpret mode matched; which probes fail says where."""
    plan = [(f"mosaic probe: {probe[0]}", lambda c, probe=probe, i=i: _mosaic_probe(c, *probe, 400 + i))
            for i, probe in enumerate(MOSAIC_PROBES)
            if ctx.sz["mosaic_probes"] is None or i < ctx.sz["mosaic_probes"]]
    return _run_variants(ctx.with_sizes(kernels_time=False), plan)


def section_mosaic_matrix(ctx: Ctx) -> dict:
    """The Mosaic decode's bisection matrix (`gpu_sections.mosaic_matrix`), its cells in worker processes."""
    return mosaic_matrix.section_mosaic_matrix(ctx, os.path.abspath(__file__))


def section_mla_big_pool(ctx: Ctx) -> dict:
    sz = ctx.sz
    return _run_variants(ctx, [(f"sparse_mla_decode stacked fp8 L={sz['big_layers']} P={sz['big_pages']}",
                                lambda c: _stacked_pool(c, sz["big_layers"], sz["big_pages"], sz["big_H"],
                                                        sz["big_B"], sz["big_K"], sz["mla_C"], sz["mla_R"], 300))])


# ----- section: compile (tiny shapes, everything once) ------------------------------------------------
def _tiny_model_cfg():
    """The test suite's tiny geometry, two layers (a full indexer and a shared one; one MoE layer)."""
    from hisparse_jax.config import ModelConfig, RopeConfig

    return ModelConfig(model_type="glm_moe_dsa", vocab_size=97, hidden_size=48, intermediate_size=64,
                       moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=3, q_lora_rank=40,
                       kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=12, n_routed_experts=6,
                       n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                       mlp_layer_types=("dense", "sparse"), max_position_embeddings=4096,
                       rope=RopeConfig(theta=10000.0), index_n_heads=16, index_head_dim=32, index_topk=16,
                       indexer_rope_interleaved=True, indexer_types=("full", "shared"),
                       dtype="float32")


def _tiny_decode(ctx, state: dict, fetch: str, kernels: str) -> dict:
    """`generate` through the tiered store under pressure (misses from host) with `kernels`; the tokens are
    compared with the first (reference, row) run."""
    from flax import nnx

    from hisparse_jax.config import CacheConfig
    from hisparse_jax.generate import generate
    from hisparse_jax.model.decoder import SparseMLAModel

    if "model" not in state:
        state["model"] = SparseMLAModel(_tiny_model_cfg(), rngs=nnx.Rngs(0))
        rng = np.random.default_rng(7)
        state["prompts"] = [rng.integers(0, 97, n).tolist() for n in TINY["decode_prompts"]]
    cc = CacheConfig(kv_dtype="bf16", device_pages=6, host_pages=16, max_seqs=2, max_seq_len=320, fetch=fetch)
    t = time.perf_counter()
    toks, stats = generate(state["model"], state["prompts"], TINY["decode_new"], cache=cc, return_stats=True,
                           kernels=kernels)
    rec = {"kernels": kernels, "fetch": fetch, "kv_dtype": "bf16", "tokens": toks, "misses": stats.misses,
           "hits": stats.hits, "wall_s": time.perf_counter() - t}
    base = state.setdefault("tokens", toks)
    rec["tokens_equal_reference_row"] = toks == base
    rec["passed"] = bool(toks == base and stats.misses > 0)
    return rec


def section_compile(ctx: Ctx) -> dict:
    """Every kernel and the decode step compiled and run once at tiny shapes, checked against the reference."""
    tiny = ctx.with_sizes(kernels_time=False, **TINY)
    T = TINY
    pallas = _pallas_kind()
    st: dict = {}
    plan = [
        ("indexer_topk bf16", lambda c: _kernel_indexer(c, T["idx_context"], "bf16", 1)),
        ("indexer_topk fp8", lambda c: _kernel_indexer(c, T["idx_context"], "fp8", 2)),
        ("indexer_topk fp8 mosaic", lambda c: _kernel_indexer(c, T["idx_context"], "fp8", 9, "mosaic")),
        ("sparse_gather", lambda c: _kernel_gather(c, 3)),
        ("sparse_mla_decode bf16", lambda c: _kernel_mla(c, T["mla_H"], "bf16", "bf16", 4)),
        ("sparse_mla_decode fp8", lambda c: _kernel_mla(c, T["mla_H"], "fp8", "bf16", 5)),
        ("sparse_mla_decode fp8 stacked layer=", lambda c: _stacked_pool(
            c, T["mla_layers"], 2 * T["mla_B"] * max(2 * T["mla_K"] // 64, 1), T["mla_H"], T["mla_B"], T["mla_K"],
            T["mla_C"], T["mla_R"], 6)),
    ] + [(f"decode_step reference fetch={fetch}", lambda c, fetch=fetch: _tiny_decode(c, st, fetch, "reference"))
         for fetch in ctx.sz["compile_decode_fetches"]] + [
        (f"decode_step {pallas} fetch=row", lambda c: _tiny_decode(c, st, "row", pallas)),
        # the Mosaic GPU decode last: a fault in it poisons this process's CUDA context for every later check
        ("sparse_mla_decode bf16 mosaic", lambda c: _kernel_mla(c, T["mla_H"], "bf16", "bf16", 10, "mosaic")),
        ("sparse_mla_decode fp8 mosaic", lambda c: _kernel_mla(c, T["mla_H"], "fp8", "bf16", 7, "mosaic")),
        ("sparse_mla_decode bf16 mosaic H=128 (cluster of 2)",
         lambda c: _kernel_mla(c, 128, "bf16", "bf16", 8, "mosaic")),
    ]
    out = _run_variants(tiny, plan)  # (`with_sizes` shares the section's record)
    return dict(out, shapes=dict(TINY), pallas=pallas)

# ----- section: fetch ---------------------------------------------------------------------------------
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
    return _block(dataclasses.replace(store, **upd))


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
                 "runs": [], "pool_scaling": [], "all_exact": True, "mechanisms": list(MECHANISMS),
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
        for mech in MECHANISMS:
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
    from hisparse_jax.kv.fetch import fetch_misses
    from hisparse_jax.kv.resolve import Plan

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
            _block(store)
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
def _decode_setup(ctx: Ctx) -> dict:
    """The decode sections' model ("tiny-glm", smaller in the smoke), prompts prefilled once, and the store
    configurations: all resident, and under pressure per fetch mechanism."""
    from flax import nnx

    from hisparse_jax.config import PRESETS, CacheConfig
    from hisparse_jax.units import PAGE_SIZE
    from hisparse_jax.model.decoder import SparseMLAModel

    sz = ctx.sz
    cfg = PRESETS["tiny-glm"].replace(**sz["decode_model"])
    R, P = sz["decode_requests"], sz["decode_prompt"]
    total = (P + sz["decode_warmup"] + sz["decode_steps"] + sz["decode_public_steps"]
             + sz["decode_loop_steps"] * (1 + sz["decode_loop_reps"]) + 1)
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
    for mech in MECHANISMS:  # under pressure: 2 tail pages + the hot buffer + 2 per request
        configs[f"pressure_{mech}"] = CacheConfig(device_pages=R * (2 + hot_pages + 2), fetch=mech, **common)
    return dict(cfg=cfg, model=model, prompts=prompts, rows=rows, first=first, prefill_s=prefill_s,
                hot_rows=hot_rows, configs=configs)


def _admit(ctx, d: dict, cc):
    from hisparse_jax.kv import device as kv_device
    from hisparse_jax.kv.manager import TieredCache

    tc = TieredCache(d["cfg"], cc)
    store, slots = kv_device.new_store(tc, ctx.device), []
    for p, (lat, rope, ik) in zip(d["prompts"], d["rows"]):
        store, slot = kv_device.admit_prefilled(store, tc, lat, rope, ik, len(p))
        slots.append(slot)
    return tc, store, slots


def section_decode(ctx: Ctx) -> dict:
    from hisparse_jax.kv import device as kv_device
    from hisparse_jax.engine.runner import decode_step

    sz = ctx.sz
    d = _decode_setup(ctx)
    cfg, model, prompts, rows, first, prefill_s, hot_rows = (d[k] for k in ("cfg", "model", "prompts", "rows",
                                                                          "first", "prefill_s", "hot_rows"))
    R, P = sz["decode_requests"], sz["decode_prompt"]
    configs = {k: v for k, v in d["configs"].items()
               if k == "resident" or k.removeprefix("pressure_") in sz["decode_mechanisms"]}
    dev = ctx.device
    runs = {}
    for name, cc in configs.items():
        t = time.perf_counter()
        tc, store, slots = _admit(ctx, d, cc)
        runs[name] = {"tc": tc, "store": store, "slots": slots, "times": [], "stats": [], "compile_s": [],
                      "tokens": jax.device_put(jnp.asarray(first, jnp.int32), dev),
                      "req": jax.device_put(jnp.asarray(slots, jnp.int32), dev),
                      "device_pages": cc.device_pages, "evicted_at_admission": tc.evicted_pages,
                      "build_s": time.perf_counter() - t}

    # Time the step as the engine and generate run it: through the `Runner` (the model split once). The public
    # `decode_step(model, ...)` also splits the model (nnx.split) and hashes its graphdef on every call, host
    # time that would blur the device-side ratio; it is measured separately below ("public_decode_step").
    from hisparse_jax.engine.runner import Runner

    step_fn, step_how = Runner(model).decode, "engine.runner.Runner(model).decode: split once"

    def one_step(r, fn=step_fn):
        tc = r["tc"]
        store = kv_device.reserve_next(r["store"], tc, r["slots"])
        t = time.perf_counter()
        logits, r["store"], stats = fn(store, {"tokens": r["tokens"], "req": r["req"]})
        _block(logits)
        dt = time.perf_counter() - t
        tc.advance(r["slots"])
        r["tokens"] = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return dt, stats

    for _ in range(sz["decode_warmup"]):
        for name, r in runs.items():
            dt, _ = one_step(r)
            r["compile_s"].append(dt)
    ctx.partial(prefill_s=prefill_s, warmup_step_s={name: r["compile_s"] for name, r in runs.items()})
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
    out: dict = {"model": "tiny-glm" + (f" with {sz['decode_model']}" if sz["decode_model"] else ""), "layers": cfg.num_hidden_layers, "topk": cfg.index_topk, "requests": R,
                 "prompt_tokens": P, "kv_dtype": "bf16", "hot_rows": hot_rows, "prefill_s": prefill_s,
                 "timed_steps": len(runs["resident"]["times"]), "skipped_steps_budget": skipped, "stores": {},
                 "step_timed_as": step_how,
                 "public_decode_step": {"how": "hisparse_jax.engine.runner.decode_step(model, store, batch), resident",
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



def section_decode_kernels(ctx: Ctx) -> dict:
    """`decode_loop` (n steps in one lax.scan) under pressure with kernels="reference" and with the Pallas
    kernels: the same tokens, close logits, and the time per step of each (scan time / n)."""
    from hisparse_jax.kv import device as kv_device
    from hisparse_jax.engine.runner import decode_loop
    from hisparse_jax.kv.tiered import stats_bytes

    sz = ctx.sz
    d = _decode_setup(ctx)
    cc = d["configs"]["pressure_row"]
    n, reps = sz["decode_loop_steps"], sz["decode_loop_reps"]
    kinds = ("reference", _pallas_kind())
    out: dict = {"model": "tiny-glm" + (f" with {sz['decode_model']}" if sz["decode_model"] else ""),
                 "requests": sz["decode_requests"], "prompt_tokens": sz["decode_prompt"], "kv_dtype": cc.kv_dtype,
                 "fetch": cc.fetch, "device_pages": cc.device_pages, "steps_per_loop": n, "kernels": {},
                 "timed_as": f"decode_loop of {n} steps (one jitted lax.scan) / {n}; median of {reps} loops after "
                             "the first (compiling) loop, whose tokens and logits are compared"}
    got = {}
    for kind in kinds:
        tc, store, slots = _admit(ctx, d, cc)
        store = kv_device.reserve_next(store, tc, slots, n * (1 + reps))  # tail pages for every position written
        req = jax.device_put(jnp.asarray(slots, jnp.int32), ctx.device)
        tokens = jax.device_put(jnp.asarray(d["first"], jnp.int32), ctx.device)
        t = time.perf_counter()
        toks, logits, store, stats = decode_loop(d["model"], store, {"tokens": tokens, "req": req}, n,
                                                 kernels=kind)
        _block((toks, logits))
        first_s = time.perf_counter() - t
        tc.advance(slots, n)
        got[kind] = (np.asarray(toks), np.asarray(logits, np.float32))
        st = stats_bytes(tc.spec, stats)
        rec = {"first_loop_s": first_s, "misses": st["misses"], "hits": st["hits"], "resident": st["resident"],
               "h2d_bytes": st["h2d_bytes"], "append_dropped": st["append_dropped"]}
        out["kernels"][kind] = rec
        ctx.partial(**out)
        times = []
        for _ in range(reps):
            if ctx.over_budget():
                break
            t = time.perf_counter()
            toks, logits, store, _ = decode_loop(d["model"], store, {"tokens": toks[-1], "req": req}, n,
                                                 kernels=kind)
            _block((toks, logits))
            times.append(time.perf_counter() - t)
            tc.advance(slots, n)
        rec.update(loops_timed=len(times), step_s=statistics.median(times) / n if times else None)
        if reps and not times:
            rec["untimed"] = "section soft deadline"  # the first loop took the section's time (a busy machine)
        for s in slots:
            tc.release(s)
        ctx.log(f"decode_loop kernels={kind}: first loop {first_s:.2f} s, "
                f"{rec['step_s'] * 1e3 if rec['step_s'] else float('nan'):.3f} ms/step, misses {st['misses']}")
        ctx.partial(**out)
    (t_ref, l_ref), (t_ker, l_ker) = got[kinds[0]], got[kinds[1]]
    diff = float(np.max(np.abs(l_ref - l_ker)))
    scale = float(np.max(np.abs(l_ref)))
    ref_s, ker_s = out["kernels"][kinds[0]]["step_s"], out["kernels"][kinds[1]]["step_s"]
    out.update(tokens_equal=bool(np.array_equal(t_ref, t_ker)), max_abs_logit_diff=diff,
               max_rel_logit_diff=diff / max(scale, 1e-30), logit_rel_tol=2e-2,
               kernel_step_vs_reference=ker_s / ref_s if ker_s and ref_s else None)
    out["passed"] = out["tokens_equal"] and out["max_rel_logit_diff"] <= out["logit_rel_tol"]
    if not out["passed"]:
        out.update(status="error", error=f"kernels disagree with the reference: tokens_equal={out['tokens_equal']}, "
                                         f"max_rel_logit_diff={out['max_rel_logit_diff']:.2e}")
    elif not out["kernels"][kinds[0]]["misses"]:
        out.update(status="error", error="no misses: the store was not under pressure (sizes)")
    return out


# ----- the sections and the plan ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Section:
    fn: Callable[[Ctx], dict]
    # on a GPU: the section's soft budget and its timeout (the process, from its start: interpreter, jax import,
    # device init and compiles included), sized from the H200 runs of 2026-12-04
    budget_s: float
    smoke_timeout_s: float  # --cpu-smoke
    # why a section is not in the default plan (None: it is): run it with --only
    only_because: str | None = None


# The default plan runs the sections with only_because None, in this order (most important first: a lease that
# ends early loses the least); its budgets sum to at most PLAN_LIMIT_S, start-up and compiles included (8 minutes
# of a 15-minute lease, at most 10 per command). --cpu-smoke runs every section, the plan first.
SECTIONS: dict[str, Section] = {
    "engine": Section(section_engine, 190, 120),
    "ceilings": Section(section_ceilings, 20, 30),  # the copy rates the next sections' ratios divide by
    "kernel_mla": Section(section_kernel_mla, 60, 45),
    "fetch": Section(section_fetch, 55, 45),
    "kernel_indexer": Section(section_kernel_indexer, 50, 45),
    "mosaic_matrix": Section(section_mosaic_matrix, 60, 60),
    "compile": Section(section_compile, 70, 90, only_because=(
        "every kernel once at tiny shapes before anything big: the plan's sections check their kernels "
        "themselves, each in its own process, and the CPU proves the sm_90 builds")),
    "decode": Section(section_decode, 60, 45, only_because=(
        "the tiny-glm step under pressure vs all resident: the engine section measures the real step")),
    "decode_kernels": Section(section_decode_kernels, 50, 45, only_because=(
        "Pallas vs reference tokens in decode_loop: equal on the H200 twice (2026-12-04 run1 and run2)")),
    "kernel_gather": Section(section_kernel_gather, 25, 30, only_because=(
        "the resolver kernel: correct on the H200 twice, not on the hot path's critical list")),
    "kernel_mla_mosaic": Section(section_kernel_mla_mosaic, 40, 45, only_because=(
        "the Mosaic decode at full size: wrong on the H200; mosaic_matrix bisects it first")),
    "mla_big_pool": Section(section_mla_big_pool, 40, 30, only_because=(
        "stacked pools past 4 GiB read with layer=: correct on the H200 (run2), same kernel as kernel_mla")),
    "mosaic_probes": Section(section_mosaic_probes, 35, 45, only_because=(
        "the Mosaic decode's stage probes: after the matrix names the failing feature")),
}
PLAN = [n for n, s in SECTIONS.items() if s.only_because is None]
PLAN_LIMIT_S = 480.0  # the default plan's budgets, summed, at most this
MIN_SECTION_S = 12.0  # a section is not started with less time than this left in the budget
# --cpu-smoke's timeouts are hang guards for two idle cores; on a busier machine each section's timeout (and so its
# soft budget) is stretched by how many cores' worth of work the machine runs per core (load average / cores) when
# it starts, at most this much. Timeouts given with --timeouts are taken as they are.
SMOKE_TIMEOUT_MAX_SCALE = 3.0


def _contention() -> float:
    """Runnable work per core (1-minute load average / cores), at least 1."""
    try:
        return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except OSError:  # no load average on this platform
        return 1.0


# ----- summary table ----------------------------------------------------------------------------------
def summary_table(report: dict) -> str:
    env = report.get("environment", {})
    secs = report.get("sections", {})
    lines = [f"== gpu_check: {env.get('device_kind')} ({env.get('backend')}), jax {env.get('jax')}, "
             f"{env.get('date_utc')}, sizes={env.get('sizes')}, {report.get('elapsed_s', 0):.0f} s =="]

    def f(v, fmt):
        return format(v, fmt) if v is not None else format("-", ">" + re.match(r"\d*", fmt).group())

    def run_lines(prefix, runs):
        for r in runs:
            if r.get("status") == "ok":
                body = _kernel_line(r) if "kernel" in r else ("tokens equal" if r.get("passed") else "DIFFERENT")
                lines.append(f"{prefix} {r['name']:38s} {'ok' if r.get('passed') else 'WRONG'}  {body}")
            else:
                err = (r.get("error") or "").strip().splitlines()
                lines.append(f"{prefix} {r['name']:38s} {r.get('status')} {r.get('reason', '')}"
                             + (f" {err[-1][:120]}" if err else ""))

    en = secs.get("engine", {})
    if en.get("policies"):
        w = en.get("workload", {})
        lines.append(f"engine   {w.get('requests')} x {w.get('prompt')} tokens + {w.get('new_tokens')}, "
                     f"{w.get('kv_dtype')} KV, kernels {w.get('kernels')}, device {en.get('budget', {}).get('device_bytes', 0) / MIB:.0f} "
                     "MiB  (tok/s  ITL p50 / p99 ms  running  hit  H2D MiB/step  host share)")
        for pol, r in en["policies"].items():
            ms = [r.get("itl_median_s"), r.get("itl_p99_s")]
            lines.append(f"engine   {pol:9s} {f(r.get('tokens_per_s'), '9.1f')}  "
                         f"{f(ms[0] * 1e3 if ms[0] else None, '7.2f')} / {f(ms[1] * 1e3 if ms[1] else None, '7.2f')}  "
                         f"{r.get('mean_running', 0):6.2f}  {r.get('hit_rate', 0):.3f}  "
                         f"{r.get('h2d_bytes_per_step', 0) / MIB:9.3f}  {f(r.get('host_share'), '5.2f')}"
                         + ("" if r.get("complete") else f"  (stopped at step {r.get('stopped_at_step')})"))
        if "tokens_identical" in en:
            lines.append(f"engine   tokens identical across policies: {en['tokens_identical']} "
                         f"({en.get('tokens_compared')} tokens); hisparse / offload tok/s "
                         f"{f(en.get('hisparse_vs_offload_tokens_per_s'), '.2f')} (sustained "
                         f"{f(en.get('hisparse_vs_offload_sustained_tokens_per_s'), '.2f')}), ITL p99 "
                         f"{f(en.get('hisparse_vs_offload_itl_p99'), '.2f')}")
    mm = secs.get("mosaic_matrix", {})
    for r in mm.get("runs", []):
        c = r.get("correct", {})
        body = (f"skipped: {r['skipped']}" if r.get("skipped") else
                f"rel {c.get('max_rel_err')}" if r.get("status") == "ok" else
                (r.get("error") or r.get("tail") or r.get("reason") or "").strip().splitlines()[-1:] or "")
        state = "ok" if r.get("passed") else "WRONG" if r.get("status") == "ok" else r.get("status")
        lines.append(f"mosaic   {r['name']:38s} {state}  {body if isinstance(body, str) else ' '.join(body)[:120]}")
    if mm.get("verdict", {}).get("features_failing_everywhere"):
        lines.append(f"mosaic   fails wherever it is on: {', '.join(mm['verdict']['features_failing_everywhere'])}")
    run_lines("compile ", secs.get("compile", {}).get("runs", []))
    c = secs.get("ceilings", {})
    for name in ("d2d_copy", "h2d_device_put", "h2d_jit_whole", "h2d_jit_chunked", "h2d_jit_page_blocks",
                 "d2h_device_put"):
        v = c.get(name)
        if isinstance(v, dict) and v.get("gb_per_s"):
            lines.append(f"ceiling  {name:22s} {v['gb_per_s']:9.2f} GB/s  ({v['bytes'] / MIB:.0f} MiB, "
                         f"{v['median_s'] * 1e3:.3f} ms)")
        elif isinstance(v, dict):
            lines.append(f"ceiling  {name:22s} {v.get('status')} {v.get('reason', '')}")
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
        for r in fe["runs"]:
            if r.get("hlo"):
                h, cnt = r["hlo"], r["hlo"]["counts"]
                lines.append(f"hlo      {r['kv_dtype']:5s} {r['mechanism']:4s} host-compute instrs "
                             f"{cnt['host_compute_attr']:4d}  copy-start {cnt['copy_start']:3d}  custom-calls "
                             f"{sum(h['custom_call_targets'].values()):3d}  host ops: "
                             f"{','.join(h['host_compute_ops'][:6]) or '-'}")
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
    dk = secs.get("decode_kernels", {})
    for kind, r in dk.get("kernels", {}).items():
        lines.append(f"decode   decode_loop kernels={kind:16s} {f(r['step_s'] * 1e3 if r.get('step_s') else None, '9.3f')}"
                     f" ms/step  misses {r.get('misses')}")
    if "tokens_equal" in dk:
        lines.append(f"decode   pallas vs reference: tokens equal {dk['tokens_equal']}, max rel logit diff "
                     f"{dk['max_rel_logit_diff']:.1e}, step time ratio {f(dk.get('kernel_step_vs_reference'), '.2f')}")
    for name in ("kernel_indexer", "kernel_gather", "kernel_mla", "kernel_mla_mosaic", "mla_big_pool", "mosaic_probes"):
        run_lines("kernels ", secs.get(name, {}).get("runs", []))
    for name, s in secs.items():
        err = s.get("error", "").strip().splitlines() if s.get("status") not in ("ok", "skipped") else []
        if s.get("status") in ("timeout", "crashed") and not err:
            err = (s.get("stderr_tail") or "").strip().splitlines()
        lines.append(f"section  {name:15s} {s.get('status'):8s} {f(s.get('wall_s'), '6.1f')} s of "
                     f"{f(s.get('timeout_s'), '4.0f')} s  rc {s.get('rc')}" + (f"  {err[-1][:140]}" if err else ""))
    return "\n".join(lines)


# ----- child: one section -----------------------------------------------------------------------------
def child_main(args) -> int:
    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
        # on a CPU the run is compile-bound: sections share compiles (the kernel sections run the compile pass's
        # shapes, both decode sections the same prefill) through a persistent cache private to this run
        jax.config.update("jax_compilation_cache_dir", os.path.join(args.out, "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    elif args.section == "engine":  # its programs are the run's largest compiles: a rerun into the same DIR (one
        # lease, after a timeout) reads them back (the parent keeps this cache; it clears only the smoke's)
        jax.config.update("jax_compilation_cache_dir", os.path.join(args.out, "jax_cache_engine"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    name, timeout = args.section, args.timeout_s
    faulthandler.enable()  # a fatal signal (abort, segfault) prints the Python stacks into the stderr log
    # the stacks go to the stderr log a little before the parent kills a hung section
    faulthandler.dump_traceback_later(max(timeout - 4.0, 1.0), exit=False)
    rec: dict = {"status": "running", "pid": os.getpid(), "parent_pid": os.getppid(), "timeout_s": timeout}
    write_json(section_path(args.out, name), rec)
    sizes = "smoke" if args.cpu_smoke or jax.default_backend() == "cpu" else "full"
    # a soft deadline well inside the timeout: a section stops timing and returns what it has
    ctx = Ctx(args, sizes, name, soft_budget_s=max(0.8 * timeout - 3.0, 1.0))
    ctx.record = rec
    rec["soft_budget_s"] = ctx.budget_s
    try:
        rec["env"] = device_env(sizes)
    except Exception:  # noqa: BLE001
        rec["env"] = {"status": "error", "error": traceback.format_exc(limit=4)}
    ctx.write()
    ctx.log(f"jax {jax.__version__} backend {jax.default_backend()} pid {os.getpid()}")
    # tests: GPU_CHECK_FAULT="NAME=abort|hang,..." makes a section die the way a Triton abort / a hang would
    fault = dict(f.split("=", 1) for f in os.environ.get("GPU_CHECK_FAULT", "").split(",") if "=" in f).get(name)
    if fault:
        ctx.partial(injected_fault=fault)
        if fault == "abort":
            os.abort()
        time.sleep(10 * timeout)
    t = time.perf_counter()
    try:
        res = dict(SECTIONS[name].fn(ctx))
        res.setdefault("status", "ok")
    except Exception:  # noqa: BLE001
        res = {"status": "error", "error": traceback.format_exc()}
        ctx.log(f"ERROR\n{res['error']}")
    rec.update(res)
    rec["section_s"] = time.perf_counter() - t
    ctx.write()
    faulthandler.cancel_dump_traceback_later()
    return 0


# ----- parent: every section in its own process -------------------------------------------------------
def _pump(stream, sinks, log, tail, lock):
    for line in iter(stream.readline, ""):
        log.write(line)
        log.flush()
        if tail is not None:
            tail.append(line)
        with lock:
            for s in sinks:
                s.write(line)
                s.flush()
    stream.close()


def run_section(args, name: str, timeout: float, tick: Callable[[float], None]) -> dict:
    """Run one section in a child process (own process group) for at most `timeout` seconds and return its
    record: what the child wrote, plus rc / signal / wall time / stderr tail; "timeout" or "crashed" when the
    child did not finish its record."""
    cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--out", args.out,
           "--timeout-s", f"{timeout:.1f}"] + (["--cpu-smoke"] if args.cpu_smoke else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if name == "engine" and not args.cpu_smoke:  # its 16K-token prompt forward needs 69.4 GiB (`gpu_sections.engine`)
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    if args.cpu_smoke:  # compile-bound on a CPU: LLVM at -O0 compiles faster (the smoke's timings mean nothing)
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    try:
        os.remove(section_path(args.out, name))
    except OSError:
        pass
    print(f"== section {name} (timeout {timeout:.0f} s) ==", flush=True)
    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True, bufsize=1,
                            errors="replace", start_new_session=True)
    tail: collections.deque = collections.deque(maxlen=80)
    lock = threading.Lock()
    logs = [open(os.path.join(args.out, "logs", f"{name}{ext}.log"), "w") for ext in ("", ".stderr")]
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, [sys.stdout], logs[0], None, lock), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, [sys.stderr], logs[1], tail, lock), daemon=True)]
    for th in pumps:
        th.start()
    timed_out = False
    deadline = t0 + timeout
    while True:
        try:
            rc = proc.wait(timeout=max(min(5.0, deadline - time.perf_counter()), 0.05))
            break
        except subprocess.TimeoutExpired:
            if time.perf_counter() >= deadline:
                timed_out = True
                for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 10.0)):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        pass
                    try:
                        proc.wait(timeout=grace)
                        break
                    except subprocess.TimeoutExpired:
                        continue
                rc = proc.poll()
                break
            tick(time.perf_counter() - t0)
    for th in pumps:
        th.join(timeout=5)
    for lg in logs:
        lg.close()
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    rec = read_section_files(args.out).get(name) or {}
    finished = rec.get("status") not in (None, "running")
    if timed_out:
        rec.update(status="timeout", reason=f"killed after {timeout:.0f} s" + (
            " (it had finished its record)" if finished else "; what it recorded so far is kept"))
    elif rc != 0:
        rec.update(status="crashed", reason=f"exit code {rc}" + (f" (signal {-rc})" if rc and rc < 0 else ""))
    elif not finished:
        rec.update(status="crashed", reason="exited 0 without a final record")
    rec.update(child_pid=proc.pid, rc=rc, wall_s=wall, timeout_s=timeout,
               cpu_s=ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime)
    text = "".join(tail)
    rec["stderr_tail"] = text[-4000:] if rec["status"] not in ("ok",) else text[-600:]
    print(f"== section {name}: {rec['status']} in {wall:.1f} s (rc {rc}) ==", flush=True)
    return rec


def parent_main(args, only: list[str]) -> int:
    t0 = time.perf_counter()
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    os.makedirs(os.path.join(args.out, "sections"), exist_ok=True)
    shutil.rmtree(os.path.join(args.out, "jax_cache"), ignore_errors=True)  # --cpu-smoke's compile cache
    for name in SECTIONS:  # stale results of an earlier run in the same DIR are not this run's
        for path in (section_path(args.out, name), os.path.join(args.out, f"hlo_{name}.txt")):
            if os.path.exists(path):
                os.remove(path)
    # --only: those sections in table order; else the plan (--cpu-smoke: every section, the plan first)
    plan = [n for n in SECTIONS if n in only] if only else PLAN + (
        [n for n in SECTIONS if n not in PLAN] if args.cpu_smoke else [])
    timeouts = {n: SECTIONS[n].smoke_timeout_s if args.cpu_smoke else SECTIONS[n].budget_s for n in plan}
    overridden = {n: float(v) for n, v in (t.split("=", 1) for t in args.timeouts.split(",") if t) if n in timeouts}
    timeouts.update(overridden)
    report = {"tool": "experiments/gpu_check.py", "argv": sys.argv[1:], "budget_s": args.budget_s,
              "parent_pid": os.getpid(), "mode": "cpu-smoke" if args.cpu_smoke else "full",
              "plan": [{"section": n, "timeout_s": timeouts[n]} for n in plan],
              "default_plan": {"sections": PLAN, "budget_s": {n: SECTIONS[n].budget_s for n in PLAN},
                               "sum_s": sum(SECTIONS[n].budget_s for n in PLAN), "limit_s": PLAN_LIMIT_S},
              "only_sections": {n: s.only_because for n, s in SECTIONS.items() if s.only_because},
              "units": {"*_s": "seconds", "*_bytes": "bytes", "*_gb_per_s": "1e9 bytes / s", "*_mib": "2**20 bytes",
                        "miss_fraction": "fraction of the B x K top-k rows fetched from host"},
              "environment": parent_env(), "sections": {}}
    report["sizes"] = {"tiny_compile": TINY}
    path = os.path.join(args.out, "gpu_check.json")

    def write(running: str | None = None, running_s: float = 0.0):
        if running:  # what the running section has written so far
            part = read_section_files(args.out).get(running)
            if part:
                report["sections"][running] = dict(part, wall_s=running_s, timeout_s=timeouts[running])
        report["elapsed_s"] = time.perf_counter() - t0
        write_json(path, report)

    write()
    print(f"gpu_check: {len(plan)} sections, each in its own process; budget {args.budget_s:.0f} s; "
          f"JSON in {path}", flush=True)
    for name in plan:
        remaining = args.budget_s - (time.perf_counter() - t0)
        if remaining < min(MIN_SECTION_S, timeouts[name]):
            report["sections"][name] = {"status": "skipped", "reason": f"budget {args.budget_s:.0f} s spent",
                                        "timeout_s": timeouts[name]}
            write()
            continue
        scale = min(_contention(), SMOKE_TIMEOUT_MAX_SCALE) if args.cpu_smoke and name not in overridden else 1.0
        rec = run_section(args, name, min(timeouts[name] * scale, remaining), lambda s, name=name: write(name, s))
        if scale > 1.0:
            rec["timeout_scale"] = scale  # the machine was busy: the smoke timeout stretched by this much
        report["sections"][name] = rec
        child_env = rec.get("env")
        if isinstance(child_env, dict) and "backend" in child_env and "backend" not in report["environment"]:
            report["environment"].update(child_env)
            report["sizes"][child_env.get("sizes", "?")] = SIZES.get(child_env.get("sizes"), {})
        write()
    report["ok"] = all(s.get("status") == "ok" for s in report["sections"].values()) and bool(plan)
    report["cpu_s"] = sum(s.get("cpu_s", 0.0) for s in report["sections"].values())
    write()
    print(summary_table(report), flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for gpu_check.json, sections/, logs/ and hlo_*.txt")
    p.add_argument("--cpu-smoke", action="store_true", help="run on the CPU with tiny sizes (< 60 s)")
    p.add_argument("--only", default="", help=f"comma-separated sections out of {','.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=PLAN_LIMIT_S,
                   help="no section starts after this much time; the last one's timeout is trimmed to what is left")
    p.add_argument("--section", default="", help=argparse.SUPPRESS)  # internal: run one section (child)
    p.add_argument("--timeout-s", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--timeouts", default="", help="override section timeouts: NAME=SECONDS,... (tests)")
    p.add_argument("--matrix-cells", default="", help=argparse.SUPPRESS)  # internal: a mosaic_matrix worker
    p.add_argument("--matrix-out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.matrix_cells:
        if args.cpu_smoke:
            jax.config.update("jax_platforms", "cpu")
        interpret = jax.default_backend() != "gpu"
        return mosaic_matrix.worker([int(i) for i in args.matrix_cells.split(",")], args.matrix_out,
                                    mosaic_matrix.SHAPES["smoke" if interpret else "full"], interpret, _mla_case,
                                    _error_pattern)
    if args.section:
        if args.section not in SECTIONS:
            p.error(f"unknown section {args.section!r}")
        return child_main(args)
    if args.cpu_smoke:  # the sections' children inherit it: Mosaic GPU's interpreter needs a large XLA:CPU pool
        from hisparse_jax.cpu_pool import request_interpret_threads

        request_interpret_threads()
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
    return parent_main(args, only)


if __name__ == "__main__":
    sys.exit(main())
