"""gpu_check's sparse MLA decode sections: `kernel_mla` (the public decode, Triton), `kernel_mla_mosaic` (the
Mosaic GPU decode in its own process), `mla_big_pool` (stacked fp8 pools past 4 GiB read with `layer=`) and
`mosaic_probes` (the Mosaic decode on inputs that isolate its stages, `MOSAIC_PROBES`)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.gpu_sections import library
from experiments.gpu_sections.checks import KERNEL_CONVENTION, error_pattern, run_variants, time_pair, traffic_fields
from experiments.gpu_sections.harness import Ctx
from experiments.gpu_sections.timing import block, nudge
from hisparse_jax.kernel_cases import mla_case


def section_case(seed: int, B: int, H: int, C: int, R: int, K: int, pool: str, q_dtype):
    """The sections' decode case (`kernel_cases.mla_case`): each sequence selects K distinct rows of its 2K
    positions, ~1/32 of the slots invalid, a `pool` ("bf16" or "fp8") latent. Returns (args, kwargs, valid rows,
    bytes per row read, pool pages)."""
    args, kw = mla_case(seed, B=B, H=H, C=C, R=R, K=K, kv="fp8" if pool == "fp8" else "bfloat16", q_dtype=q_dtype,
                        invalid=1 / 32)
    row_bytes = C * (1 if pool == "fp8" else 2) + R * 2 + (C // 128 * 4 if pool == "fp8" else 0)
    return block(args), block(kw), int(np.asarray(args[6]).sum()), row_bytes, args[2].shape[0]


def kernel_mla(ctx, H: int, pool: str, q_name: str, seed: int, backend: str = "triton") -> dict:
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
    args, kw, n_valid, row_bytes, P = section_case(seed, B, H, C, R, K, pool, q_dtype)
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
        rec["error_pattern"] = error_pattern(got, want)
    ctx.checkpoint(rec)
    call = lambda f: lambda v, c: f(c[0], v, *c[1], **c[2])  # noqa: E731  (v: q_rope, nudged per call)
    rec.update(time_pair(ctx, call(kern), call(ref), args[1], (args[0], args[2:], kw), nudge,
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


def _mla_plan(ctx: Ctx, mosaic: bool) -> list:
    return [(f"sparse_mla_decode H={H} {pool} q={qn}" + (f" {be[0]}" if be else ""),
             lambda c, H=H, pool=pool, qn=qn, be=be, s=200 + i: kernel_mla(c, H, pool, qn, s, *be))
            for i, (H, pool, qn, *be) in enumerate(ctx.sz["mla_variants"]) if bool(be) == mosaic]


def section_kernel_mla(ctx: Ctx) -> dict:
    """The Triton decode (the library's default variant, through the public `sparse_mla_decode`) at H 128 with
    fp8 and bf16 pools first; the other shapes while the soft budget lasts."""
    from pallas_kernels.sparse_mla_decode import sparse_mla_decode

    return dict(run_variants(ctx, _mla_plan(ctx, mosaic=False)), convention=KERNEL_CONVENTION,
                entry_point="pallas_kernels.sparse_mla_decode.sparse_mla_decode",
                entry_defaults=library.entry_defaults(sparse_mla_decode))


def section_kernel_mla_mosaic(ctx: Ctx) -> dict:
    """The Mosaic GPU decode in its own process: a fault there (an illegal address poisons the CUDA context) costs
    no other kernel's result."""
    c = ctx.with_sizes(kernels_time=False) if ctx.interpret else ctx  # interpreted: its timing loop is a slow compile
    return dict(run_variants(c, _mla_plan(ctx, mosaic=True)), convention=KERNEL_CONVENTION)


def stacked_pool(ctx, L: int, P: int, H: int, B: int, K: int, C: int, R: int, seed: int) -> dict:
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
    lat, rope, scale = block(fill(*nan_pools(), vp, vr))
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
    rec.update(time_pair(ctx, call(kern), call(ref), q_rope, (q_lat, pools, kw), nudge, n * row_bytes))
    from pallas_kernels import traffic

    rec.update(traffic_fields(ctx, rec, lambda: traffic.sparse_mla_decode_traffic(
        B, H, C, R, K, kv_dtype="fp8", query_dtype="bf16", valid_rows=n)))
    return rec


def section_mla_big_pool(ctx: Ctx) -> dict:
    sz = ctx.sz
    return run_variants(ctx, [(f"sparse_mla_decode stacked fp8 L={sz['big_layers']} P={sz['big_pages']}",
                                lambda c: stacked_pool(c, sz["big_layers"], sz["big_pages"], sz["big_H"],
                                                        sz["big_B"], sz["big_K"], sz["mla_C"], sz["mla_R"], 300))])


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
    args, kw, _, _, _ = section_case(seed, B, H, C, R, K, pool, jnp.bfloat16)
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
        rec["error_pattern"] = error_pattern(got, want)
    return rec


def section_mosaic_probes(ctx: Ctx) -> dict:
    """The Mosaic GPU decode on inputs that isolate its stages (`MOSAIC_PROBES`), after everything else: it was
    wrong on an H200 (relative error ~1) while interpret mode matched; which probes fail says where."""
    plan = [(f"mosaic probe: {probe[0]}", lambda c, probe=probe, i=i: _mosaic_probe(c, *probe, 400 + i))
            for i, probe in enumerate(MOSAIC_PROBES)
            if ctx.sz["mosaic_probes"] is None or i < ctx.sz["mosaic_probes"]]
    return run_variants(ctx.with_sizes(kernels_time=False), plan)
