"""gpu_check's clocks: wall time of a blocking call (`timeit`), time per call of N calls chained in one jitted
loop (`loop_time`, with `nudge` making each call depend on the last), and the copy ceilings this run measured
(the ceilings section's records, for bandwidth ratios)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from experiments.gpu_sections.harness import Ctx


GB = 1e9
MIB = 2 ** 20


def block(x):
    """`x` once the device has computed it."""
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


def bw(nbytes: float, seconds: float) -> float | None:
    """GB/s (1e9 bytes per second), None without a time."""
    return nbytes / seconds / GB if seconds and seconds > 0 else None


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
    block(looped(v0, out0, const))
    first = time.perf_counter() - t
    times = []
    for _ in range(max(reps, 1)):
        t = time.perf_counter()
        block(looped(v0, out0, const))
        times.append(time.perf_counter() - t)
        if sum(times) > max_s:
            break
    med = statistics.median(times)
    return {"per_call_s": med / n, "calls_per_loop": n, "loop_median_s": med, "loop_min_s": min(times),
            "loop_runs": len(times), "first_loop_s": first}


def h2d_ceiling(ctx: Ctx) -> tuple[str, float] | None:
    """The best large pinned_host -> device copy measured (name, GB/s), or None without the ceilings."""
    c = ctx.report.get("sections", {}).get("ceilings", {})
    got = [(v["gb_per_s"], name) for name in ("h2d_device_put", "h2d_jit_whole", "h2d_jit_chunked")
           for v in [c.get(name)] if isinstance(v, dict) and v.get("gb_per_s")]
    if not got:
        return None
    bw, name = max(got)
    return name, bw


def d2d_ceiling(ctx: Ctx) -> dict | None:
    """The device-copy ceiling of this run: {copy_gb_per_s, rw_gb_per_s (read + write traffic)}, or None."""
    c = ctx.report.get("sections", {}).get("ceilings", {}).get("d2d_copy")
    if not (isinstance(c, dict) and c.get("gb_per_s")):
        return None
    return {"copy_gb_per_s": c["gb_per_s"], "rw_gb_per_s": c.get("rw_gb_per_s") or 2 * c["gb_per_s"]}
