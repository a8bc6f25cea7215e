"""The whole tiered decode step built for sm_90 without a GPU, and the checks its compiled HLO must pass.

`tests/e2e/test_gpu_build.py` and `experiments/bench_compile.py` build the jitted step (`engine.runner`'s, store
donated) of GLM-5 from abstract arrays (`abstract_step_args`: nothing is allocated; the pinned-host pools carry
their memory kind) with XLA's deviceless AOT compiler (`hisparse_jax.deviceless`) and check that
  (a) every store buffer is donated (`check_store_donated`: an input_output_alias from each store parameter),
  (b) the pinned-host pools stay in host memory, S(5), as parameters and results (`check_host_pools_in_host_memory`;
      which fields are host pools is the store's own `state.store_shardings`: `host_pools`),
  (c) no instruction materializes a whole-pool-sized buffer (`check_no_pool_sized_temporary`, over `POOLS`).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp

from hisparse_jax import deviceless as dl

BATCH = 32
# The store's per-page arrays (pool-sized: [L or LI, pages, ...]), device or pinned-host (`host_pools` says which).
POOLS = ("latent", "rope", "latent_scale", "h_latent", "h_rope", "h_latent_scale", "index_k", "index_scale",
         "index_ema", "index_lo", "index_hi", "index_codes", "index_radius")
sds = dl.abstract_on_cpu


def glm5_layers(n: int):
    from hisparse_jax.config import PRESETS

    base = PRESETS["glm-5"]
    return base.replace(num_hidden_layers=n, indexer_types=base.indexer_types[:n],
                        mlp_layer_types=base.mlp_layer_types[:n])


def abstract_step_args(cfg, cache, batch: int = BATCH):
    """(graphdef, params, store, batch): every array an abstract ShapeDtypeStruct (nothing is allocated);
    the pinned-host pools with a pinned_host memory kind."""
    from flax import nnx

    from hisparse_jax.kv.state import StoreSpec
    from hisparse_jax.model.decoder import SparseMLAModel

    graphdef, params = nnx.split(nnx.eval_shape(lambda: SparseMLAModel(cfg, rngs=nnx.Rngs(0))))
    store = abstract_store(StoreSpec.create(cfg, cache))
    rows = {"tokens": sds((batch,), jnp.int32), "req": sds((batch,), jnp.int32)}
    return graphdef, dl.abstractify(params), store, rows


def abstract_store(spec):
    """A KVStore of abstract ShapeDtypeStructs (host pools with a pinned_host memory kind)."""
    from hisparse_jax.kv.state import init_store, store_shardings

    cpu = jax.devices("cpu")[0]
    shapes = jax.eval_shape(functools.partial(init_store, spec, cpu))
    return jax.tree.map(lambda s, sh: sds(s.shape, s.dtype, sh.memory_kind), shapes, store_shardings(spec, cpu))



def store_fields(store):
    return [f.name for f in dataclasses.fields(store) if f.name != "spec" and getattr(store, f.name) is not None]


def host_pools(store) -> tuple[str, ...]:
    """The store's fields in pinned-host memory, from its own shardings (`state.store_shardings` of its spec): the
    KV host pools, and with index_tier="host" the indexer keys (`index_k`, `index_scale`)."""
    from hisparse_jax.kv.state import store_shardings

    shardings = store_shardings(store.spec, jax.devices("cpu")[0])
    return tuple(n for n in store_fields(store) if getattr(shardings, n).memory_kind == "pinned_host")


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



def check_host_pools_in_host_memory(label, store, text):
    params, results, by_param, pnum = entry_signature(text)
    host = host_pools(store)
    report = []
    for name in store_fields(store):
        p = pnum[name]
        want = 5 if name in host else 0
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



def check_no_pool_sized_temporary(label, store, text, mem):
    pools = {n: tuple(getattr(store, n).shape) for n in store_fields(store) if n in POOLS}
    found = pool_sized_instructions(text, pools)
    new = [f for f in found if f[0] == "NEW"]
    print(f"\n[{label}] pool-sized instructions: "
          f"{sum(f[0] == 'view' for f in found)} views, {sum(f[0] == 'in-place' for f in found)} in-place, "
          f"{len(new)} new buffers; device temp {mem.temp_size_in_bytes / 2**20:.0f} MiB, "
          f"host temp {mem.host_temp_size_in_bytes / 2**20:.0f} MiB")
    for f in new:
        print("   NEW", f[1], "in", f[2], ":", f[3])
    smallest_host = min(getattr(store, n).size * getattr(store, n).dtype.itemsize for n in host_pools(store))
    assert not new, f"{len(new)} whole-pool-sized buffers, e.g. {new[0][3]}"
    assert mem.host_temp_size_in_bytes < smallest_host, \
        f"host temp {mem.host_temp_size_in_bytes} B >= a host pool ({smallest_host} B)"


# ----- the miss fetch: host calls and copies per fetch ---------------------------------------------
def computations(text: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines} of an HLO module's text."""
    out, comp = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?(%[\w.\-]+)\s.*\{$", line)
        if m:
            comp = m.group(1)
            out[comp] = []
        elif line.startswith("}"):
            comp = None
        elif comp is not None:
            out[comp].append(line)
    return out


def host_call_outputs(lines) -> list[dict]:
    """The result (`deviceless.parse_shape`) of each host computation (an XLA:GPU "HostExecute" custom call, what
    `compat.on_host` compiles to) started in `lines`. A result outside the host memory space (S(5)) is written to
    the device: the call's own host -> device copy."""
    out = []
    for line in lines:
        m = re.match(r"^\s*%[\w.\-]+ = \((.*)\) custom-call-start\(", line)
        if m and 'custom_call_target="HostExecute"' in line:
            results = dl.split_top(m.group(1))[1:-1]  # (operands), results..., context
            out += [dl.parse_shape(r) for r in results]
    return out


def copies(lines) -> tuple[list[dict], list[dict]]:
    """(device -> host, host -> device) async copies started in `lines`: the destination's parsed shape."""
    d2h, h2d = [], []
    for line in lines:
        m = re.match(r"^\s*%[\w.\-]+ = \((.*)\) copy-start\(", line)
        if m:
            dst, src = (dl.parse_shape(s) for s in dl.split_top(m.group(1))[:2])
            if dst["memory_space"] == 5 and src["memory_space"] != 5:
                d2h.append(dst)
            elif src["memory_space"] == 5 and dst["memory_space"] != 5:
                h2d.append(dst)
    return d2h, h2d


def host_call_conditionals(text: str) -> list[list[dict]]:
    """Every conditional of which some branch makes a host computation (the row fetch's `lax.switch` over its
    staging sizes): per conditional, per branch, {"host_calls": results, "d2h": copies, "h2d": copies}."""
    comps = computations(text)
    out = []
    for lines in comps.values():
        for line in lines:
            m = re.search(r" conditional\(.*branch_computations=\{([^}]*)\}", line)
            if not m:
                continue
            branches = []
            for name in (b.strip() for b in m.group(1).split(",")):
                d2h, h2d = copies(comps[name])
                branches.append({"host_calls": host_call_outputs(comps[name]), "d2h": d2h, "h2d": h2d})
            if any(b["host_calls"] for b in branches):
                out.append(branches)
    return out
