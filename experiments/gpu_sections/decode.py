"""gpu_check's decode-step sections: `compile` (every kernel and the tiered decode step once at tiny shapes),
`decode` (`runner.store_decode_step` on "tiny-glm", all resident vs under pressure per fetch mechanism) and
`decode_kernels` (`decode_loop` with the references vs the Pallas kernels)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.gpu_sections.checks import pallas_kind, run_variants
from experiments.gpu_sections.harness import Ctx
from experiments.gpu_sections.kernel_gather import kernel_gather
from experiments.gpu_sections.kernel_indexer import kernel_indexer
from experiments.gpu_sections.kernel_mla import kernel_mla, stacked_pool
from experiments.gpu_sections.sizes import TINY
from experiments.gpu_sections.timing import block
from hisparse_jax.config import FETCH_MECHANISMS


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
    pallas = pallas_kind()
    st: dict = {}
    plan = [
        ("indexer_topk bf16", lambda c: kernel_indexer(c, T["idx_context"], "bf16", 1)),
        ("indexer_topk fp8", lambda c: kernel_indexer(c, T["idx_context"], "fp8", 2)),
        ("indexer_topk fp8 mosaic", lambda c: kernel_indexer(c, T["idx_context"], "fp8", 9, "mosaic")),
        ("sparse_gather", lambda c: kernel_gather(c, 3)),
        ("sparse_mla_decode bf16", lambda c: kernel_mla(c, T["mla_H"], "bf16", "bf16", 4)),
        ("sparse_mla_decode fp8", lambda c: kernel_mla(c, T["mla_H"], "fp8", "bf16", 5)),
        ("sparse_mla_decode fp8 stacked layer=", lambda c: stacked_pool(
            c, T["mla_layers"], 2 * T["mla_B"] * max(2 * T["mla_K"] // 64, 1), T["mla_H"], T["mla_B"], T["mla_K"],
            T["mla_C"], T["mla_R"], 6)),
    ] + [(f"store_decode_step reference fetch={fetch}", lambda c, fetch=fetch: _tiny_decode(c, st, fetch, "reference"))
         for fetch in ctx.sz["compile_decode_fetches"]] + [
        (f"store_decode_step {pallas} fetch=row", lambda c: _tiny_decode(c, st, "row", pallas)),
        # the Mosaic GPU decode last: a fault in it poisons this process's CUDA context for every later check
        ("sparse_mla_decode bf16 mosaic", lambda c: kernel_mla(c, T["mla_H"], "bf16", "bf16", 10, "mosaic")),
        ("sparse_mla_decode fp8 mosaic", lambda c: kernel_mla(c, T["mla_H"], "fp8", "bf16", 7, "mosaic")),
        ("sparse_mla_decode bf16 mosaic H=128 (cluster of 2)",
         lambda c: kernel_mla(c, 128, "bf16", "bf16", 8, "mosaic")),
    ]
    out = run_variants(tiny, plan)  # (`with_sizes` shares the section's record)
    return dict(out, shapes=dict(TINY), pallas=pallas)


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
    for mech in FETCH_MECHANISMS:  # under pressure: 2 tail pages + the hot buffer + 2 per request
        configs[f"pressure_{mech}"] = CacheConfig(device_pages=R * (2 + hot_pages + 2), fetch=mech, **common)
    return dict(cfg=cfg, model=model, prompts=prompts, rows=rows, first=first, prefill_s=prefill_s,
                hot_rows=hot_rows, configs=configs)


def _admit(ctx, d: dict, cc):
    from hisparse_jax.kv import device as kv_device
    from hisparse_jax.kv.manager import PageManager

    tc = PageManager(d["cfg"], cc)
    store, slots = kv_device.new_store(tc, ctx.device), []
    for p, (lat, rope, ik) in zip(d["prompts"], d["rows"]):
        store, slot = kv_device.admit_prefilled(store, tc, lat, rope, ik, len(p))
        slots.append(slot)
    return tc, store, slots


def section_decode(ctx: Ctx) -> dict:
    from hisparse_jax.kv import device as kv_device
    from hisparse_jax.engine.runner import store_decode_step

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
    # `store_decode_step(model, ...)` also splits the model (nnx.split) and hashes its graphdef on every call, host
    # time that would blur the device-side ratio; it is measured separately below ("public_decode_step").
    from hisparse_jax.engine.runner import Runner

    step_fn, step_how = Runner(model).decode, "engine.runner.Runner(model).decode: split once"

    def one_step(r, fn=step_fn):
        tc = r["tc"]
        store = kv_device.reserve_next(r["store"], tc, r["slots"])
        t = time.perf_counter()
        logits, r["store"], stats = fn(store, {"tokens": r["tokens"], "req": r["req"]})
        block(logits)
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
    public = [one_step(runs["resident"], lambda store, batch: store_decode_step(model, store, batch))[0]
              for _ in range(sz["decode_public_steps"])]
    out: dict = {"model": "tiny-glm" + (f" with {sz['decode_model']}" if sz["decode_model"] else ""), "layers": cfg.num_hidden_layers, "topk": cfg.index_topk, "requests": R,
                 "prompt_tokens": P, "kv_dtype": "bf16", "hot_rows": hot_rows, "prefill_s": prefill_s,
                 "timed_steps": len(runs["resident"]["times"]), "skipped_steps_budget": skipped, "stores": {},
                 "step_timed_as": step_how,
                 "public_decode_step": {"how": "hisparse_jax.engine.runner.store_decode_step(model, store, batch), "
                                               "resident",
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
    kinds = ("reference", pallas_kind())
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
        block((toks, logits))
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
            block((toks, logits))
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
