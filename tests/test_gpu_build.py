"""The GPU program is BUILT for an H100 / H200 (sm_90) on every CI run, on a CPU-only machine.

XLA's deviceless AOT compilation (`tests/deviceless.py`) runs the whole XLA:GPU pipeline: HLO passes
(host offloading included), Triton for the Pallas kernels, LLVM -> PTX, ptxas. Lowering alone
(`tests/test_kernel_*.py::test_lowers_for_cuda*`) stops before all of that.

1. every Pallas kernel variant at production shapes (DeepSeek-V3.2 / GLM-5 geometry) compiles;
2. the whole jitted tiered decode step (`hisparse_jax.engine.runner._jitted_step`, the function
   `decode_step` runs, store donated) of a 4-layer GLM-5 compiles for both fetch mechanisms, bf16 and
   fp8 KV, reference and Pallas kernels, and its compiled HLO shows that
   (a) every store buffer is donated (an input_output_alias from each store parameter to its result),
   (b) the pinned-host pools stay in host memory (S(5)) as parameters and as results,
   (c) no instruction materializes a whole-pool-sized buffer besides the aliased parameter / result;
   2b. the same (a)-(c) for the jitted store programs that apply `TieredCache`'s decisions (kv/device.py:
   write_prefill bf16 / fp8, evict_pages with and without write-back, load_pages, the table updates,
   append_all; gather_all with HISPARSE_GPU_BUILD_ALL=1);
3. a Pallas kernel whose block does not fit in shared memory fails to build (errors are real).

Compile seconds per case are printed at the end of the module (and written as JSON to
$HISPARSE_GPU_BUILD_JSON when set). Skips, with the reason, without the CUDA plugin / ptxas / libdevice.
It proves a program builds, not what it computes (the interpret-mode tests do) nor how fast it runs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import pytest

import deviceless as dl
from pallas_kernels.backends import mosaic_unavailable_reason

pytestmark = pytest.mark.skipif(dl.unavailable_reason() is not None, reason=str(dl.unavailable_reason()))

TAU = 0.13523378
MOSAIC = mosaic_unavailable_reason() is None  # the Mosaic GPU kernels need jax >= 0.11
sds = dl.abstract_on_cpu


# ----- compile-time record ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def build_log(request):
    log: list[dict] = []
    yield log
    if not log:
        return
    lines = [f"sm_90 deviceless builds (jax {jax.__version__}, target {dl.gpu_target().device_kind}):"]
    lines += [f"  {r['status']:4s} {r['seconds']:6.1f} s  {r['case']}" for r in log]
    lines.append(f"  total {sum(r['seconds'] for r in log):.1f} s of compilation")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        (reporter.write_line if reporter else print)(line)
    path = os.environ.get("HISPARSE_GPU_BUILD_JSON")
    if path:
        with open(path, "w") as f:
            json.dump({"jax": jax.__version__, "target": dl.gpu_target().device_kind, "cases": log}, f, indent=1)


def timed_build(log, case, build, **extra):
    t = time.perf_counter()
    try:
        exe = build()
    except Exception:
        log.append(dict(case=case, status="FAIL", seconds=round(time.perf_counter() - t, 2), **extra))
        raise
    log.append(dict(case=case, status="OK", seconds=round(time.perf_counter() - t, 2), **extra))
    return exe


# ----- 1. kernels at production shapes ---------------------------------------------------------
def _mla_case(H, kv, q_dtype, backend="triton", *, B=32, C=512, R=64, K=2048, P=4096):
    pool_dt = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[kv]
    args = [sds((B, H, C), q_dtype), sds((B, H, R), q_dtype), sds((P, 64, C), pool_dt), sds((P, 64, R), jnp.bfloat16),
            sds((B, K), jnp.int32), sds((B, K), jnp.int32), sds((B, K), jnp.bool_)]
    if kv == "fp8":
        args.append(sds((P, 64, C // 128), jnp.float32))
        return (lambda *a: sparse_mla_decode()(*a[:7], tau=TAU, latent_scale=a[7], backend=backend)), args, {}
    return (lambda *a: sparse_mla_decode()(*a, tau=TAU, backend=backend)), args, {}


def _mla_stacked_case(backend="triton", H=64, B=32, C=512, R=64, K=2048, P=4096, L=78):
    """The store's whole fp8 pools (78 layers x 4096 pages: 8.6 GB of latent, > 4 GiB so 64-bit offsets)
    read in place at a traced layer."""
    args = [sds((B, H, C), jnp.bfloat16), sds((B, H, R), jnp.bfloat16), sds((L, P, 64, C), jnp.float8_e4m3fn),
            sds((L, P, 64, R), jnp.bfloat16), sds((B, K), jnp.int32), sds((B, K), jnp.int32), sds((B, K), jnp.bool_),
            sds((L, P, 64, C // 128), jnp.float32), sds((), jnp.int32)]
    return (lambda *a: sparse_mla_decode()(*a[:7], tau=TAU, latent_scale=a[7], layer=a[8], backend=backend)), args, {}


def _gather_case(HR, B=32, K=2048, Rq=64, MP=2048):
    from pallas_kernels.sparse_gather import sparse_gather

    i32 = lambda *s: sds(s, jnp.int32)  # noqa: E731
    args = [i32(B, K), i32(B), i32(Rq, MP), i32(Rq, MP), i32(Rq, HR // 64), i32(Rq, HR), i32(Rq, HR), i32()]
    return functools.partial(sparse_gather, hot_rows=HR), args, {}


def _indexer_case(q_dtype, k_dtype, backend="triton", B=32, I=64, D=128, MP=2048, P=20480, L=None):
    from pallas_kernels.indexer_topk import indexer_topk

    stack = () if L is None else (L,)
    args = [sds((B, I, D), q_dtype), sds((B, I), jnp.float32), sds((*stack, P, 64, D), k_dtype),
            sds((B, MP), jnp.int32), sds((B,), jnp.int32)]
    kw = dict(k_scale=sds((*stack, P, 64), jnp.float32)) if k_dtype == jnp.float8_e4m3fn else {}
    if L is not None:
        kw["layer"] = sds((), jnp.int32)
    return functools.partial(indexer_topk, topk=2048, backend=backend), args, kw


def sparse_mla_decode():
    from pallas_kernels.sparse_mla_decode import sparse_mla_decode as f
    return f


_BF, _F32, _FP8 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
KERNEL_CASES = {
    **{f"sparse_mla_decode H={H} kv={kv} q={jnp.dtype(q).name} (B=32 K=2048 P=4096)": functools.partial(_mla_case, H, kv, q)
       for H in (128, 16) for kv in ("bf16", "fp8") for q in (_BF, _F32)},
    "sparse_mla_decode stacked fp8 pools L=78 (8.6 GB latent), layer= traced, H=64": _mla_stacked_case,
    # the Mosaic GPU backend (jax >= 0.11): bf16 queries (it rounds f32 ones to bf16 in the wrapper)
    **{f"sparse_mla_decode mosaic H={H} kv={kv} (B=32 K=2048 P=4096)": functools.partial(_mla_case, H, kv, _BF, "mosaic")
       for H in (128, 16) for kv in ("bf16", "fp8")},
    "sparse_mla_decode mosaic B=1 (66 splits) H=128 kv=fp8": functools.partial(_mla_case, 128, "fp8", _BF, "mosaic", B=1),
    "sparse_mla_decode mosaic K=16384 B=128 H=64 (4 splits of 128 row blocks)": functools.partial(
        _mla_case, 64, "bf16", _BF, "mosaic", B=128, K=16384),
    "sparse_mla_decode mosaic stacked fp8 pools L=78 (8.6 GB latent), layer= traced, H=128":
        functools.partial(_mla_stacked_case, "mosaic", H=128),
    **{f"sparse_gather hot_rows={HR} (B=32 K=2048 MP=2048)": functools.partial(_gather_case, HR) for HR in (4096, 10240)},
    **{f"indexer_topk q={jnp.dtype(q).name} k={jnp.dtype(k).name} (B=32 I=64 128K ctx top-2048)":
       functools.partial(_indexer_case, q, k) for q, k in ((_F32, _BF), (_BF, _BF), (_F32, _FP8), (_BF, _FP8))},
    # the Mosaic GPU scores (the selection is XLA's top-k): DeepSeek-V3.2's 64 heads and GLM-5's 32 (padded to 64)
    **{f"indexer_topk mosaic I={I} k={jnp.dtype(k).name} (B=32 128K ctx top-2048)":
       functools.partial(_indexer_case, _BF, k, "mosaic", I=I) for I in (64, 32) for k in (_BF, _FP8)},
    "indexer_topk mosaic q=float32 k=bfloat16 (three bf16 query parts)": functools.partial(
        _indexer_case, _F32, _BF, "mosaic"),
    "indexer_topk mosaic stacked fp8 index pool L=21 x 100000 pages (17 GB), layer= traced": functools.partial(
        _indexer_case, _BF, _FP8, "mosaic", P=100_000, L=21),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_builds_for_sm90(case, build_log):
    fn, args, kw = KERNEL_CASES[case]()
    if " mosaic " in case and not MOSAIC:
        pytest.skip(f"the Mosaic GPU backend needs jax >= 0.11 (this is jax {jax.__version__})")
    exe = timed_build(build_log, case, lambda: dl.compile_for_gpu(fn, *args, **kw))
    text = dl.hlo_text(exe)
    if " mosaic " in case:
        assert 'custom_call_target="mosaic_gpu' in text, "no Mosaic GPU kernel in the compiled module"
        # (XLA's own GEMM fusions may be emitted through Triton, e.g. the fp8 query's Hadamard rotation: only a
        # Pallas-Triton custom call would be a Triton kernel of ours)
        assert "__gpu$xla.gpu.triton" not in text, "a Pallas-Triton kernel in the Mosaic build"
    else:
        assert "__triton" in text or "triton" in text, "no Triton kernel in the compiled module"


# ----- 2. the whole tiered decode step ---------------------------------------------------------
NUM_LAYERS = 4  # GLM-5 layers 0-3: three dense layers with full indexers, one MoE layer sharing layer 2's index
BATCH = 32
HOST_POOLS = ("h_latent", "h_rope", "h_latent_scale")


def glm5_layers(n: int):
    from hisparse_jax.config import PRESETS

    base = PRESETS["glm-5"]
    return base.replace(num_hidden_layers=n, indexer_types=base.indexer_types[:n],
                        mlp_layer_types=base.mlp_layer_types[:n])


def abstract_step_args(cfg, cache):
    """(graphdef, params, store, batch): every array an abstract ShapeDtypeStruct (nothing is allocated);
    the pinned-host pools with a pinned_host memory kind."""
    from flax import nnx

    from hisparse_jax.kv.state import StoreSpec
    from hisparse_jax.model.decoder import SparseMLAModel

    graphdef, params = nnx.split(nnx.eval_shape(lambda: SparseMLAModel(cfg, rngs=nnx.Rngs(0))))
    store = abstract_store(StoreSpec.create(cfg, cache))
    batch = {"tokens": sds((BATCH,), jnp.int32), "req": sds((BATCH,), jnp.int32)}
    return graphdef, dl.abstractify(params), store, batch


def abstract_store(spec):
    """A KVStore of abstract ShapeDtypeStructs (host pools with a pinned_host memory kind)."""
    from hisparse_jax.kv.state import init_store, store_shardings

    cpu = jax.devices("cpu")[0]
    shapes = jax.eval_shape(functools.partial(init_store, spec, cpu))
    return jax.tree.map(lambda s, sh: sds(s.shape, s.dtype, sh.memory_kind), shapes, store_shardings(spec, cpu))


# A pairwise covering set of (kv, fetch, kernels): every pair of values of two axes is built once. Each
# build takes 20-50 s on a 2-core machine; HISPARSE_GPU_BUILD_ALL=1 builds all 8 combinations.
STEP_CASES = [("bf16", "row", "reference"), ("fp8", "page", "reference"), ("bf16", "page", "pallas"),
              ("fp8", "row", "pallas")]
if os.environ.get("HISPARSE_GPU_BUILD_ALL"):
    STEP_CASES = [(kv, fetch, kernels) for kernels in ("reference", "pallas") for kv in ("bf16", "fp8")
                  for fetch in ("row", "page")]
if MOSAIC:  # the Mosaic decode inside the step (GLM-5: 64 heads, one block each; bf16 queries, so bf16 output)
    STEP_CASES.append(("fp8", "row", "pallas_mosaic"))


@pytest.fixture(scope="module", params=STEP_CASES, ids=lambda c: "-".join(c))
def built_step(request, build_log):
    """(case, store, compiled HLO text, memory stats) of tiered decode_step's jitted function."""
    from hisparse_jax.config import CacheConfig
    from hisparse_jax.engine import runner

    kv, fetch, kernels = request.param
    cfg = glm5_layers(NUM_LAYERS)
    cache = CacheConfig(kv_dtype=kv, device_pages=4096, host_pages=16384, max_seqs=32, max_seq_len=131072,
                        fetch=fetch)
    graphdef, params, store, batch = abstract_step_args(cfg, cache)
    # The jitted function decode_step / make_decode_step call (donate_argnums=(1,): the store). Taken from the
    # cache directly because kv.tiered.check_kernels refuses kernels="pallas" on a CPU backend, rightly.
    step = runner._jitted_step(graphdef, kernels)
    case = f"tiered decode_step glm-5[{NUM_LAYERS} layers] kv={kv} fetch={fetch} kernels={kernels} (B={BATCH})"
    exe = timed_build(build_log, case, lambda: dl.compile_lowered(dl.lower_for_gpu(step, params, store, batch)))
    text = dl.hlo_text(exe)
    return request.param, store, text, exe.get_compiled_memory_stats()


def test_speculative_step_builds_for_sm90(build_log):
    """The MTP speculative step (`engine.speculative`, k = 2: 3 verified rows per request resolved as one union,
    the MTP layer's pass and a recursive draft; the Pallas kernels) compiles for sm_90 with its store donated and
    its pinned-host pools in host memory."""
    from flax import nnx

    from hisparse_jax.config import CacheConfig
    from hisparse_jax.engine import speculative
    from hisparse_jax.kv.state import StoreSpec
    from hisparse_jax.model.decoder import SparseMLAModel

    k, G = 2, BATCH // 4
    cfg = glm5_layers(NUM_LAYERS).replace(num_nextn_predict_layers=1)
    cache = CacheConfig(kv_dtype="bf16", device_pages=4096, host_pages=16384, max_seqs=32, max_seq_len=131072,
                        speculative_tokens=k)
    spec = StoreSpec.create(cfg, cache)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: SparseMLAModel(cfg, rngs=nnx.Rngs(0), mtp=True)))
    store = abstract_store(spec)
    rows = G * (k + 1)
    batch = {name: sds((rows,), jnp.int32) for name in ("tokens", "req", "pos", "draft_ok")}
    batch["index_span"] = sds((spec.max_pages,), jnp.int32)
    sampling = {"seed": sds((G,), jnp.uint32), "temperature": sds((G,), jnp.float32), "top_p": sds((G,), jnp.float32)}
    step = speculative.jitted_spec_step(graphdef, "pallas", k)
    case = f"speculative step glm-5[{NUM_LAYERS} layers + MTP] k={k} kv=bf16 kernels=pallas (G={G})"
    exe = timed_build(build_log, case, lambda: dl.compile_lowered(dl.lower_for_gpu(
        step, dl.abstractify(params), store, batch, sampling)))
    text = dl.hlo_text(exe)
    check_store_donated(case, store, text)
    check_host_pools_in_host_memory(case, store, text)


def store_fields(store):
    return [f.name for f in dataclasses.fields(store) if f.name != "spec" and getattr(store, f.name) is not None]


def entry_parameters(text: str) -> dict[str, int]:
    """{store field: entry parameter number}, from the parameters' metadata op_name="store.<field>"."""
    entry = text[text.index("\nENTRY "):]
    out = {}
    for m in re.finditer(r"parameter\((\d+)\)[^\n]*?op_name=\"store\.(\w+)\"", entry):
        out[m.group(2)] = int(m.group(1))
    return out


def entry_signature(text: str):
    """(entry parameters, entry results, {parameter: aliased output}, {store field: parameter})."""
    params, results = dl.entry_layout(text)
    by_param = {p: out for out, (p, _) in dl.input_output_aliases(text).items()}
    return params, results, by_param, entry_parameters(text)


def test_step_store_is_donated(built_step):
    """(a) every store buffer (pools, host pools, tables, hot-buffer state) aliases an output of its shape."""
    case, store, text, _ = built_step
    check_store_donated("-".join(case), store, text)


def test_step_runs_the_chosen_decode_kernel(built_step):
    """kernels="pallas_mosaic" builds the decode and the indexer's scores as Mosaic GPU kernels (the resolver stays
    a Pallas-Triton kernel); the other choices build no Mosaic kernel."""
    (_, _, kernels), _, text, _ = built_step
    mosaic = text.count('custom_call_target="mosaic_gpu')
    # 4 layers: 3 full indexers' scores, 4 decodes
    assert mosaic == (3 + NUM_LAYERS if kernels == "pallas_mosaic" else 0), (kernels, mosaic)
    if kernels != "reference":
        assert "__gpu$xla.gpu.triton" in text, f"no Pallas-Triton kernel in the {kernels} step"


def check_store_donated(label, store, text):
    params, results, by_param, pnum = entry_signature(text)
    report, missing = [], []
    for name in store_fields(store):
        leaf = getattr(store, name)
        assert name in pnum, f"store.{name} is not an entry parameter (pruned as unused?)"
        p = pnum[name]
        assert params[p]["dims"] == tuple(leaf.shape), (name, params[p], leaf.shape)
        out = by_param.get(p)
        if out is None or results[out]["dims"] != tuple(leaf.shape):
            missing.append(name)
        report.append(f"store.{name}: param {p} -> output {out}")
    print(f"\n[{label}] input_output_alias:", "; ".join(report))
    assert not missing, f"store buffers not donated (no input_output_alias): {missing}"


def test_step_host_pools_stay_in_host_memory(built_step):
    """(b) each pinned-host pool is an S(5) (host memory space) parameter and result; device pools are not."""
    case, store, text, _ = built_step
    check_host_pools_in_host_memory("-".join(case), store, text)


def check_host_pools_in_host_memory(label, store, text):
    params, results, by_param, pnum = entry_signature(text)
    report = []
    for name in store_fields(store):
        p = pnum[name]
        want = 5 if name in HOST_POOLS else 0
        got_in = params[p]["memory_space"]
        got_out = results[by_param[p]]["memory_space"] if p in by_param else None
        report.append(f"store.{name}: in S({got_in}) out S({got_out})")
        assert (got_in, got_out) == (want, want), f"store.{name}: {params[p]['text']} -> " \
            f"{results[by_param[p]]['text'] if p in by_param else 'not aliased'}; want S({want})"
    print(f"\n[{label}] memory spaces:", "; ".join(report))


# Opcodes that make no new buffer of their result shape (views, or in-place updates of their operand).
VIEW_OPS = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
            "dynamic-update-slice", "scatter", "optimization-barrier"}


def pool_sized_instructions(text: str, pool_dims: dict[str, tuple]):
    """Every instruction outside fused computations whose result has a pool's full dims, classified:
    (kind, pool, computation, line) with kind "view" (no new buffer), "in-place" (a fusion rooted at a
    scatter / dynamic-update-slice, a custom call aliasing an operand) or "NEW" (a new pool-sized buffer)."""
    fused = set(re.findall(r"calls=(%[\w.\-]+)", text))
    roots = {}  # fused computation -> opcode of its root
    comp = None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?(%[\w.\-]+)\s.*\{$", line)
        if m:
            comp = m.group(1)
        r = re.match(r"^\s*ROOT\s+%[\w.\-]+\s*=\s*\S+\s+([a-z][\w\-]*)\(", line)
        if r and comp:
            roots[comp] = r.group(1)
    async_calls = {m.group(1): m.group(2) for m in re.finditer(
        r"^\s*(%[\w.\-]+) = [^\n]*? fusion-start\([^\n]*?calls=(%[\w.\-]+)", text, re.M)}
    by_dims = {}
    for name, dims in pool_dims.items():
        by_dims.setdefault(dims, []).append(name)
    found = []
    for comp, name, shape, op, line in dl.instructions(text):
        if comp in fused:
            continue
        try:
            dims = dl.parse_shape(shape)["dims"]
        except ValueError:
            continue
        if dims not in by_dims:
            continue
        if op in VIEW_OPS:
            kind = "view"
        elif op == "fusion" and roots.get(re.search(r"calls=(%[\w.\-]+)", line).group(1)) in (
                "scatter", "dynamic-update-slice"):
            kind = "in-place"
        elif op == "custom-call" and "output_to_operand_aliasing" in line:
            kind = "in-place"
        elif op == "fusion-done" and roots.get(async_calls.get(re.search(r"fusion-done\((%[\w.\-]+)", line).group(1))) in (
                "scatter", "dynamic-update-slice"):
            kind = "in-place"  # an async dynamic-update-slice (host offloading: the D2H row write into a host pool)
        else:
            kind = "NEW"
        found.append((kind, "/".join(by_dims[dims]), comp, line[:300]))
    # Tuple-valued custom-call-done / async-done (host calls) return fresh buffers: a pool-sized element is one.
    for m in re.finditer(r"^\s*(%[\w.\-]+) = \(([^\n]*?)\) (custom-call-done|async-done)\(", text, re.M):
        for el in dl.split_top(m.group(2)):
            try:
                dims = dl.parse_shape(el)["dims"]
            except ValueError:
                continue
            if dims in by_dims:
                found.append(("NEW", "/".join(by_dims[dims]), "host call output", m.group(0)[:300]))
    return found


def test_step_makes_no_pool_sized_temporary(built_step):
    """(c) no copy / convert / fusion / host-call result of a whole pool's shape: the step touches rows."""
    case, store, text, mem = built_step
    check_no_pool_sized_temporary("-".join(case), store, text, mem)


def check_no_pool_sized_temporary(label, store, text, mem):
    pools = {n: tuple(getattr(store, n).shape) for n in store_fields(store)
             if n in ("latent", "rope", "index_k", "latent_scale", "index_scale") + HOST_POOLS}
    found = pool_sized_instructions(text, pools)
    new = [f for f in found if f[0] == "NEW"]
    print(f"\n[{label}] pool-sized instructions: "
          f"{sum(f[0] == 'view' for f in found)} views, {sum(f[0] == 'in-place' for f in found)} in-place, "
          f"{len(new)} new buffers; device temp {mem.temp_size_in_bytes / 2**20:.0f} MiB, "
          f"host temp {mem.host_temp_size_in_bytes / 2**20:.0f} MiB")
    for f in new:
        print("   NEW", f[1], "in", f[2], ":", f[3])
    smallest_host = min(getattr(store, n).size * getattr(store, n).dtype.itemsize for n in HOST_POOLS
                        if getattr(store, n, None) is not None)
    assert not new, f"{len(new)} whole-pool-sized buffers, e.g. {new[0][3]}"
    assert mem.host_temp_size_in_bytes < smallest_host, \
        f"host temp {mem.host_temp_size_in_bytes} B >= a host pool ({smallest_host} B)"


# ----- 2b. the store programs TieredCache runs between decode steps ----------------------------
# The jitted functions of hisparse_jax/kv/device.py, which apply TieredCache's decisions to the store (all donate
# it): prompt admission (write_prefill),
# eviction (with the write-back that runs when rows are not mirrored eagerly), swap-in / prefix loads
# (load_pages), table updates, and the checked row-level append / gather. Same checks (a)-(c) as the step,
# same GLM-5 geometry: a program that copies a 4 GiB host pool to admit a prompt is as wrong as a step that does.
PREFILL_T = 8192  # the prompt bucket (rows per layer) written by write_prefill
NPAGES = 64  # pages per evict_pages / load_pages call (the bookkeeping pads the list to a power of two)


def _store(kv, *, mirror=True, fetch="row"):
    from hisparse_jax.config import CacheConfig
    from hisparse_jax.kv.state import StoreSpec

    cache = CacheConfig(kv_dtype=kv, device_pages=4096, host_pages=16384, max_seqs=32, max_seq_len=131072,
                        fetch=fetch, mirror_to_host=mirror)
    return abstract_store(StoreSpec.create(glm5_layers(NUM_LAYERS), cache))


def _i32(*shape):
    return sds(shape, jnp.int32)


def _store_program(name, kv, **store_kw):
    """(the store program's jitted function, its abstract args)."""
    from hisparse_jax.kv import device as m

    store = _store(kv, **store_kw)
    spec = store.spec
    L, LI, C, R, dI, MP = (spec.num_layers, spec.num_index_layers, spec.latent_dim, spec.rope_dim, spec.index_dim,
                           spec.max_pages)

    def kv_rows(T):  # latent [L, T, C], rope [L, T, R], index_k [LI, T, dI] as the model makes them
        return [sds((n, T, d), jnp.bfloat16) for n, d in ((L, C), (L, R), (LI, dI))]

    return {
        "write_prefill": lambda: (m._write_prefill, (store, _i32(), *kv_rows(PREFILL_T), _i32(), _i32(), _i32())),
        "evict_pages": lambda: (m._release, (store, _i32(NPAGES), _i32(NPAGES))),
        "load_pages": lambda: (m._load_pages, (store, _i32(NPAGES), _i32(NPAGES))),
        "set_tables": lambda: (m._set_tables, (store, _i32(), _i32(MP), _i32(MP), _i32(MP), _i32(),
                                               _i32(spec.hot_pages))),
        "set_rows": lambda: (m._set_rows, (store, _i32(), _i32(MP), _i32(MP), _i32(MP), _i32())),
        "clear_page_stamps": lambda: (m._clear_page_stamps, (store, _i32())),
        "append_all": lambda: (m._append_all, (store, _i32(BATCH), *kv_rows(BATCH))),
        "gather_all": lambda: (m._gather_all, (store, _i32(BATCH), _i32(BATCH, spec.topk))),
    }[name]()


STORE_CASES = {
    f"write_prefill kv=bf16 (T={PREFILL_T})": ("write_prefill", "bf16", {}),
    f"write_prefill kv=fp8 (T={PREFILL_T})": ("write_prefill", "fp8", {}),
    f"evict_pages with write-back (mirror_to_host=False) kv=bf16 (N={NPAGES})":
        ("evict_pages", "bf16", dict(mirror=False)),
    f"evict_pages with write-back (mirror_to_host=False) kv=fp8 (N={NPAGES})":
        ("evict_pages", "fp8", dict(mirror=False)),
    f"evict_pages mirrored (tables only) kv=fp8 (N={NPAGES})": ("evict_pages", "fp8", {}),
    f"load_pages kv=bf16 (N={NPAGES})": ("load_pages", "bf16", {}),
    f"load_pages kv=fp8 (N={NPAGES})": ("load_pages", "fp8", {}),
    "set_tables kv=fp8": ("set_tables", "fp8", {}),
    "set_rows kv=fp8": ("set_rows", "fp8", {}),
    "clear_page_stamps kv=fp8": ("clear_page_stamps", "fp8", {}),
    f"append_all (+ mirror_rows) kv=fp8 (B={BATCH})": ("append_all", "fp8", {}),
}
# gather_all (TieredCache.gather: trace replays and tests, not the engine) takes ~20 s to build on 2 cores.
GATHER_CASE = f"gather_all kv=bf16 fetch=page (B={BATCH} K=2048)"
if os.environ.get("HISPARSE_GPU_BUILD_ALL"):
    STORE_CASES[GATHER_CASE] = ("gather_all", "bf16", dict(fetch="page"))
# Known whole-pool temporaries, {case: why}; check (c) xfails on them and fails once they are gone. (gather_all's
# copies of the device pools, one per indexer group, went with an optimization_barrier after each group's reads.)
KNOWN_POOL_COPIES: dict[str, str] = {}


@pytest.fixture(scope="module", params=list(STORE_CASES))
def built_store_program(request, build_log):
    """(label, store, compiled HLO text, memory stats) of one of TieredCache's jitted store programs."""
    name, kv, kw = STORE_CASES[request.param]
    fn, args = _store_program(name, kv, **kw)
    case = f"TieredCache {request.param} glm-5[{NUM_LAYERS} layers]"
    exe = timed_build(build_log, case, lambda: dl.compile_lowered(dl.lower_for_gpu(fn, *args)))
    return request.param, args[0], dl.hlo_text(exe), exe.get_compiled_memory_stats()


def test_store_program_store_is_donated(built_store_program):
    """(a) as for the step: every store buffer aliases an output of its shape."""
    label, store, text, _ = built_store_program
    check_store_donated(label, store, text)


def test_store_program_host_pools_stay_in_host_memory(built_store_program):
    """(b) as for the step: the pinned-host pools are S(5) parameters and results."""
    label, store, text, _ = built_store_program
    check_host_pools_in_host_memory(label, store, text)


def test_store_program_makes_no_pool_sized_temporary(built_store_program):
    """(c) as for the step: pages and rows are written in place, no pool is copied."""
    label, store, text, mem = built_store_program
    if label not in KNOWN_POOL_COPIES:
        check_no_pool_sized_temporary(label, store, text, mem)
        return
    try:
        check_no_pool_sized_temporary(label, store, text, mem)
    except AssertionError as err:
        pytest.xfail(f"known: {KNOWN_POOL_COPIES[label]} ({str(err).splitlines()[0][:200]})")
    pytest.fail(f"{label} no longer makes a pool-sized temporary: remove it from KNOWN_POOL_COPIES")


# ----- 3. errors are real ----------------------------------------------------------------------
def _triton_matmul(bm: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    def kernel(x_ref, y_ref, o_ref):
        def body(k, acc):
            return acc + jnp.dot(x_ref[:, pl.ds(k * bm, bm)], y_ref[pl.ds(k * bm, bm), :],
                                 preferred_element_type=jnp.float32)
        o_ref[...] = jax.lax.fori_loop(0, x_ref.shape[1] // bm, body, jnp.zeros((bm, bm), jnp.float32))

    def f(x, y):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), jnp.float32),
                              grid=(x.shape[0] // bm, y.shape[1] // bm),
                              in_specs=[pl.BlockSpec((bm, x.shape[1]), lambda i, j: (i, 0)),
                                        pl.BlockSpec((x.shape[1], bm), lambda i, j: (0, j))],
                              out_specs=pl.BlockSpec((bm, bm), lambda i, j: (i, j)),
                              compiler_params=plt.CompilerParams(num_warps=4, num_stages=4))(x, y)
    return f


def test_oversized_block_fails_to_build(build_log):
    """A 512x512-block bf16 matmul needs > 227 KiB of shared memory per block: the build must fail."""
    x = sds((2048, 2048), jnp.bfloat16)
    timed_build(build_log, "control: Pallas-Triton matmul, 64x64 blocks", lambda: dl.compile_for_gpu(_triton_matmul(64), x, x))
    with pytest.raises(Exception, match=r"(?i)shared memory") as err:
        dl.compile_for_gpu(_triton_matmul(512), x, x)
    print("\nexpected failure:", str(err.value).splitlines()[0][:300])
