"""gpu_check's `ceilings` section: the device's copy rates (device -> device, pinned_host -> device whole, in
chunks and page-sized blocks, device -> pinned_host) that the kernel and fetch sections' ratios divide by; and the
HLO facts that tell a host computation from a plain async copy in a compiled program (`hlo_facts`)."""

from __future__ import annotations

import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from experiments.gpu_sections.harness import Ctx
from experiments.gpu_sections.timing import MIB, block, bw, timeit


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
            out[name] = dict(t, bytes=nbytes, gb_per_s=bw(nbytes, t["median_s"]), **extra)
            ctx.log(f"ceiling {name}: {out[name]['gb_per_s']:.2f} GB/s ({nbytes / MIB:.0f} MiB, "
                    f"{t['median_s'] * 1e3:.3f} ms)")
        except Exception:  # noqa: BLE001
            out[name] = {"status": "error", "error": traceback.format_exc(limit=8)}
            errors.append(name)
            ctx.log(f"ceiling {name}: ERROR\n{out[name]['error']}")
        ctx.partial(**out)

    def drop(y):
        block(y)
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
            arrays["h"] = block(jax.device_put(jnp.ones((nh,), jnp.float32), host_s))
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
        hb = block(jax.device_put(jnp.ones((nb, 64, 576), jnp.bfloat16), host_s))

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
        xd = block(jax.device_put(jnp.ones((nh,), jnp.float32), dev_s))
        return (lambda: drop(jax.device_put(xd, host_s))), nh * 4, {
            "how": "jax.device_put(device array, pinned_host sharding)"}

    measure("d2h_device_put", d2h_put)
    if errors:
        out.update(status="error", error=f"failed: {', '.join(errors)}")
    return out
