"""The tiered store as the model's `KVBackend` (`TieredKV`), the step counters, and `index_span`.

The model drives the store, never the other way round: the jitted steps that run a model through a store
(`store_decode_step`, `decode_loop`, `step_impl`) live with the runner, `hisparse_jax.engine.runner`.
`store_decode_step(model, store, batch) -> (logits, store, stats)` is one jitted step with the store donated and
fixed shapes: `batch = {"tokens": int32[B], "req": int32[B]}` with B a bucket and req = -1 for idle rows.
Positions come from `store.seq_lens`. Per step it appends every layer's new rows (device tail page, then one host
mirror write for all layers), runs each full indexer over the request's paged keys, resolves the top-k per indexer
group (resident | hot hit | miss fetched from host), and attends over the rows.
Shared-index layers replay their leader's plan. The host must have reserved the tail pages first.

Several query rows per request (speculative verification, `TieredKV(rows_per_request=S)`): the batch is groups of S
consecutive rows of one request (or idle), and each indexer group resolves once per request over the union of
its rows' top-k (`resolve.union_topk` / `resolve.row_plan`): each distinct missing row is fetched once, no row evicts a
hot slot another row of the step reads, and each row attends over its own top-k, in its own order.

Stats (per step, int32 arrays): resident / hits / misses [L] (distinct rows read per layer and request by each
path — with S rows per request, those of the union of their top-k; a miss moves the row of every layer of its
group), row_misses [L] (misses counted per query row: a position missed by two rows of a group counts twice;
== misses when S == 1, so row_misses - misses is the duplicate fetches the union avoided), h2d_rows (payload
layer-rows: == sum(misses)), h2d_transfer_rows (what the fetch mechanism moved), d2h_rows (host mirror writes),
append_dropped (rows whose tail page was not resident: a scheduling bug when non-zero). Bytes are rows x
`spec.row_bytes`, computed on the host (`stats_bytes`) so counters cannot overflow int32 at production sizes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.kv.resolve import (Plan, fetch_misses, gather_rows, group_req, resolve, row_plan, union_topk,
                                     update_index_ema)
from hisparse_jax.kv.scoring import index_scores_paged, index_select_read, pad_topk, topk_of_scores
from hisparse_jax.kv.writes import append_rows
from hisparse_jax.kv.state import StoreSpec
from hisparse_jax.units import PAGE_SIZE
from pallas_kernels.sparse_mla_decode.reference import (merge_partial_attention, sparse_mla_decode_rows,
                                                         sparse_mla_decode_rows_lse)


def empty_stats(spec: StoreSpec) -> dict:
    L = spec.num_layers
    z = jnp.zeros((), jnp.int32)
    return {"resident": jnp.zeros((L,), jnp.int32), "hits": jnp.zeros((L,), jnp.int32),
            "misses": jnp.zeros((L,), jnp.int32), "row_misses": jnp.zeros((L,), jnp.int32), "h2d_rows": z,
            "h2d_transfer_rows": z, "d2h_rows": z, "append_dropped": z, "index_h2d_pages": z}


def stats_bytes(spec: StoreSpec, stats: dict) -> dict:
    """Host-side totals of step stats (one step or stacked / summed steps) as Python ints, with bytes."""
    out = {k: int(np.sum(v)) for k, v in stats.items()}
    for k in ("h2d", "h2d_transfer", "d2h"):
        out[f"{k}_bytes"] = out.pop(f"{k}_rows") * spec.row_bytes
    out["index_h2d_bytes"] = out.pop("index_h2d_pages") * PAGE_SIZE * spec.index_key_bytes
    return out


KERNELS = ("reference", "pallas", "pallas_interpret", "pallas_mosaic", "pallas_mosaic_interpret")


MOSAIC_INTERPRET_THREADS = 5  # XLA:CPU pool threads the interpreted Mosaic decode holds at once inside the step


def check_kernels(kernels: str) -> str:
    """Validate the kernel choice (never a silent fallback):
      "reference"                 the jnp ops;
      "pallas"                    the Pallas GPU kernels on the Triton backend (needs a GPU backend);
      "pallas_mosaic"             the same, with the kernels that have a Mosaic GPU implementation (the sparse MLA
                                  decode, the indexer's scores with XLA's top-k over them) on that backend (a GPU
                                  backend and jax >= 0.11); the resolver stays on Triton. Refused on a GPU for
                                  now: its decode was wrong on an H200 (MOSAIC_DECODE_ON_GPU);
      "..._interpret"             either, interpreted (Pallas interpret mode / Mosaic GPU's interpret mode) on
                                  any backend."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}; choose one of {', '.join(KERNELS)}")
    if kernels.startswith("pallas_mosaic"):
        from pallas_kernels.backends import mosaic_unavailable_reason

        if (why := mosaic_unavailable_reason()) is not None:
            raise ValueError(f"kernels={kernels!r}: {why}")
    if kernels == "pallas_mosaic_interpret" and jax.default_backend() == "cpu":
        from hisparse_jax.cpu_pool import interpret_pool_short_reason

        if jax.config.values.get("jax_cpu_enable_async_dispatch", False):
            raise ValueError(
                "kernels='pallas_mosaic_interpret' on the CPU needs synchronous dispatch, set before jax's first use: "
                "jax.config.update('jax_cpu_enable_async_dispatch', False) (the interpreted kernel runs from a host "
                "callback of the decode step)")
        # the step's host callback holds one XLA:CPU pool thread, a cluster of 2 blocks' warpgroups four more
        if (why := interpret_pool_short_reason(MOSAIC_INTERPRET_THREADS)) is not None:
            raise ValueError(f"kernels='pallas_mosaic_interpret': {why}")
    if kernels in ("pallas", "pallas_mosaic") and jax.default_backend() != "gpu":
        raise ValueError(f"kernels={kernels!r} needs a GPU backend (this one is {jax.default_backend()!r}); "
                         f"use kernels='{kernels}_interpret' to run the kernels on the CPU")
    if kernels == "pallas_mosaic":
        raise ValueError(MOSAIC_DECODE_ON_GPU)
    return kernels


# Why kernels="pallas_mosaic" is refused on a GPU (the interpreted kernels stay available, the sm_90 builds stay tested)
MOSAIC_DECODE_ON_GPU = (
    "kernels='pallas_mosaic': the Mosaic GPU sparse-MLA decode equals its reference in interpret mode but not on an "
    "H200 (experiments/results/gpu/2026-12-04-h200-run2.json: relative error ~1 at H 16 and 128, bf16 and fp8 "
    "pools; an illegal instruction with fp8 pools at H 16), so it cannot run a decode step; use kernels='pallas' "
    "(Triton), which matched the reference there (docs/limitations.md)")


def kernel_backend(kernels: str) -> str:
    """The Pallas backend (`pallas_kernels.backends.BACKENDS`) a `kernels` choice builds its kernels with
    ("triton" for "reference" too, which builds none)."""
    return "mosaic" if kernels.startswith("pallas_mosaic") else "triton"


def check_backend(spec: StoreSpec, kernels: str) -> None:
    """Refuse a store / kernels pairing that has no implementation (ValueError, before anything runs)."""
    if spec.index_tier == "host" and kernels != "reference":
        raise ValueError(f"index_tier='host' needs kernels='reference' (got {kernels!r}): the Pallas indexer top-k "
                         "reads device-resident keys")
    if spec.miss_attention == "split" and kernels != "reference":
        raise ValueError(f"miss_attention='split' needs kernels='reference' (got {kernels!r}): the Pallas sparse "
                         "MLA kernel returns no log-sum-exp to merge the two parts with")
    if kernel_backend(kernels) == "mosaic":
        from pallas_kernels.indexer_topk.kernel_mosaic import MAX_DIM, MAX_DIM_INT4
        from pallas_kernels.sparse_mla_decode.kernel_mosaic import CHUNK

        if spec.kv_dtype not in ("bf16", "fp8") or spec.latent_dim % (2 * CHUNK) or spec.rope_dim % 64:
            raise ValueError(f"kernels={kernels!r}: the Mosaic sparse MLA decode reads bfloat16 or fp8 KV with a latent "
                             f"width that is a multiple of {2 * CHUNK} and a rope width that is a multiple of 64 (this "
                             f"store: kv_dtype {spec.kv_dtype!r}, latent {spec.latent_dim}, rope {spec.rope_dim}); "
                             "use kernels='pallas' / 'pallas_interpret' (Triton) for it")
        if spec.index_dim % 32 or spec.index_dim > MAX_DIM:
            raise ValueError(f"kernels={kernels!r}: the Mosaic indexer top-k needs an indexer head dim that is a "
                             f"multiple of 32 and at most {MAX_DIM} (this store: {spec.index_dim}); use kernels="
                             "'pallas' / 'pallas_interpret' (Triton) for it")
        if spec.index_dtype == "int4" and spec.index_dim > MAX_DIM_INT4:
            raise ValueError(f"kernels={kernels!r}: the Mosaic indexer top-k reads int4 (MXFP4) keys of an indexer "
                             f"head dim of at most {MAX_DIM_INT4} (this store: {spec.index_dim}); use kernels="
                             "'pallas' / 'pallas_interpret' (Triton) or kernels='reference' for it")


@dataclasses.dataclass(frozen=True)
class TieredKV:
    """`KVBackend` over a `KVStore`. The carry threaded through the model (`kv`) is `init_kv(store, req)`:
    {"store": KVStore, "req": int32[B], "plan": resolve.Plan, "plan_counts": 4 x int32[], "stats": dict}; a group's
    leader writes its plan and its resident / hit / miss / row-miss counts there, which the group's shared-index
    layers read (and count again). With hot_policy="score_ema" a leader's `select` also folds its scores into the
    store's `index_ema` (`resolve.update_index_ema`), which its `attend`'s resolve orders the hot slots by.

    kernels: "reference" (jnp ops), or one of the Pallas choices of `check_kernels`: the indexer top-k, the fused
    resolver and the sparse MLA decode run as Pallas kernels (`pallas_kernels`), the decode and the indexer's scores
    on the Mosaic GPU backend with "pallas_mosaic*" (its top-k reads the stacked indexer pool in place).

    rows_per_request: S, the query rows of one request in a step (speculative verification: k + 1). The batch's
    B rows are then B/S groups of S consecutive rows, each group's rows at the positions of one request (n..n+k)
    or idle (req -1); a group's request is that of its live rows. Rows of one group naming different live
    requests, or a request in two groups, are a caller bug (not detected inside jit; `resolve.check_groups` checks a
    batch on the host). Each indexer group's leader resolves the union of a group's top-k once (`resolve.union_topk`,
    one resolver call over [B/S, S*K]), fetches its distinct misses once, and gives each row its own plan
    (`resolve.row_plan`), so every attention path reads exactly that row's top-k, in its order. Needs
    hot_rows >= S * K (a step may miss every row of the union)."""

    spec: StoreSpec
    kernels: str = "reference"
    scored_pages: int | None = None  # pages of each request the indexer scores (None: all MP)
    rows_per_request: int = 1

    def __post_init__(self):
        check_backend(self.spec, self.kernels)
        S = self.rows_per_request
        if not isinstance(S, int) or isinstance(S, bool) or S < 1:
            raise ValueError(f"rows_per_request must be an int >= 1, got {S!r}")
        K = min(self.spec.topk, self.spec.max_pages * 64)  # the step's top-k width (`scoring.pad_topk`)
        if self.spec.hot_rows < S * K:
            raise ValueError(f"hot_rows ({self.spec.hot_rows}) must be >= rows_per_request ({S}) x topk ({K}) = "
                             f"{S * K}: one step resolves the union of a request's {S} rows' top-k and may miss "
                             "every row of it")

    @property
    def _pallas(self) -> bool:
        return self.kernels != "reference"

    @property
    def _interpret(self) -> bool:
        return self.kernels.endswith("_interpret")

    def init_kv(self, store, req) -> dict:
        """The carry (`kv`) this backend threads through a decode step for the batch's rows `req` int32[B]."""
        B, K = req.shape[0], min(self.spec.topk, self.spec.max_pages * 64)
        zeros = jnp.zeros((B, K), jnp.int32)
        no = jnp.zeros((B, K), bool)
        plan = Plan(page=zeros, row=zeros, valid=no, resident=no, miss=no, src_page=zeros, src_row=zeros)
        count = jnp.zeros((), jnp.int32)
        return {"store": store, "req": req, "plan": plan, "plan_counts": (count,) * 4,
                "stats": empty_stats(self.spec)}

    def append(self, kv, ids, positions, c, k_rope, k_index):
        store, dropped = append_rows(kv["store"], ids.layer, ids.index if ids.owns_index else None, kv["req"],
                                     positions, c, k_rope, k_index)
        stats = dict(kv["stats"], append_dropped=kv["stats"]["append_dropped"] + dropped)
        return dict(kv, store=store, stats=stats)

    def select(self, kv, ids, positions, q_index, w):
        index_layer = ids.index
        if self.spec.hot_policy == "score_ema":
            # every position's score, for its moving average (the Pallas indexer keeps its scores to itself: with
            # it this is one more scoring pass over the keys)
            scores, valid, pages = index_scores_paged(kv["store"], index_layer, kv["req"], positions, q_index, w,
                                                      self.scored_pages)
            kv = dict(kv, store=update_index_ema(kv["store"], index_layer, kv["req"], scores, valid, pages,
                                                 self.rows_per_request))
            if not self._pallas:
                return topk_of_scores(self.spec, scores, valid), kv
        if not self._pallas:
            topk, read = index_select_read(kv["store"], index_layer, kv["req"], positions, q_index, w,
                                           self.scored_pages)
            return topk, dict(kv, stats=dict(kv["stats"], index_h2d_pages=kv["stats"]["index_h2d_pages"] + read))
        from pallas_kernels import indexer_topk

        spec, store, req = self.spec, kv["store"], kv["req"]
        seq = jnp.where(req >= 0, positions + 1, 0)
        table = store.index_table[jnp.maximum(req, 0)][:, :self.scored_pages]
        backend = kernel_backend(self.kernels)

        def select(*a):  # the stacked pools read in place at the layer, an argument: it may be traced
            return indexer_topk(*a[:5], topk=spec.topk, k_scale=a[5], layer=a[6], backend=backend,
                                interpret=self._interpret)
        args = (q_index, w, store.index_k, table, seq, store.index_scale if spec.index_scaled else None,
                jnp.asarray(index_layer, jnp.int32))
        if backend == "mosaic" and self._interpret:  # the interpreted Mosaic call is a host callback
            out = jax.ShapeDtypeStruct((req.shape[0], spec.topk), jnp.int32)
            topk = _outside_this_program(select, out, *args)
        else:
            topk = select(*args)
        return pad_topk(spec, topk[:, :min(spec.topk, table.shape[1] * 64)]), kv

    def attend(self, kv, ids, topk, q_lat, q_rope, tau):
        spec = self.spec
        store, stats = kv["store"], dict(kv["stats"])
        layer, g = ids.layer, ids.index  # indexer group g is led by full-indexer layer g
        split = spec.miss_attention == "split"
        if ids.owns_index:  # the group's leader resolves and fetches for every layer of the group
            plan, fetch_plan, store = self._resolve(store, g, kv["req"], topk)
            if split:  # the rows already on the device, read before the fetch: nothing waits for the copy
                on_device = self._attend_part(store, layer, plan, plan.valid & ~plan.miss, q_lat, q_rope, tau)
            store, payload, transfer = fetch_misses(store, layer, ids.group_size, fetch_plan)
            stats["h2d_rows"] = stats["h2d_rows"] + payload
            stats["h2d_transfer_rows"] = stats["h2d_transfer_rows"] + transfer
            count = lambda m: jnp.sum(m).astype(jnp.int32)  # noqa: E731
            counts = (count(fetch_plan.resident), count(fetch_plan.valid & ~fetch_plan.resident & ~fetch_plan.miss),
                      count(fetch_plan.miss), count(plan.miss))
        else:  # shared-index layers replay the leader's plan (the rows were fetched for every layer of the group)
            plan, counts = kv["plan"], kv["plan_counts"]
        # The barrier pins the attention's inputs: XLA then compiles the math identically whatever the pool
        # sizes, so tiered and all-resident runs agree bit for bit (fusing the gather into the attention
        # would let the reduction order depend on the store's shape).
        if split:
            if not ids.owns_index:
                on_device = self._attend_part(store, layer, plan, plan.valid & ~plan.miss, q_lat, q_rope, tau)
            fetched = self._attend_part(store, layer, plan, plan.miss, q_lat, q_rope, tau)
            o_lat = merge_partial_attention(*on_device, *fetched)
        elif self._pallas:
            from pallas_kernels import sparse_mla_decode

            backend = kernel_backend(self.kernels)
            # Both kernels write bf16 themselves when the queries are bf16 (half the output bytes): the model
            # rounds o_lat to its compute dtype before W_UV, so the f32 view below costs nothing (XLA folds the
            # bf16 -> f32 -> bf16 round trip) and changes no value the model uses.
            out_dtype = jnp.bfloat16 if q_lat.dtype == jnp.bfloat16 else jnp.float32

            def decode(*a):  # the layer is an argument: it may be traced, and the interpreted call is a callback
                return sparse_mla_decode(*a[:7], latent_scale=a[7], tau=tau, layer=a[8], interpret=self._interpret,
                                         backend=backend, out_dtype=out_dtype)
            args = (q_lat, q_rope, store.latent, store.rope, plan.page, plan.row, plan.valid, store.latent_scale,
                    jnp.asarray(layer, jnp.int32))
            if self._interpret and backend == "mosaic":
                o_lat = _outside_this_program(decode, jax.ShapeDtypeStruct(q_lat.shape, out_dtype), *args)
            else:
                o_lat = decode(*args)
            o_lat = o_lat.astype(jnp.float32)
        else:
            rows_c, rows_r = jax.lax.optimization_barrier(gather_rows(store, layer, plan))
            o_lat = sparse_mla_decode_rows(q_lat, q_rope, rows_c, rows_r, plan.valid, tau)
        for name, n in zip(("resident", "hits", "misses", "row_misses"), counts):
            stats[name] = stats[name].at[layer].add(n)
        return o_lat, dict(kv, store=store, plan=plan, plan_counts=counts, stats=stats)

    def _resolve(self, store, g, req, topk):
        """Resolve indexer group g's top-k [B, K]: (each row's plan [B, K], the plan to fetch, store). One row per
        request: both are the resolver's plan. S rows per request: the fetch plan is the union's ([B/S, S*K], each
        distinct position of a request once) and each row's plan is looked up in it."""
        S = self.rows_per_request
        if S == 1:
            plan, store = resolve(store, g, req, topk, resolver=self._resolver())
            return plan, plan, store
        if req.shape[0] % S:
            raise ValueError(f"a batch of {req.shape[0]} rows is not groups of rows_per_request={S} rows")
        topk = jnp.where((req >= 0)[:, None], topk, -1)  # idle rows of a live group select nothing
        union = union_topk(topk, S)
        union_plan, store = resolve(store, g, group_req(req, S), union, resolver=self._resolver())
        return row_plan(union_plan, union, topk, S), union_plan, store

    def _attend_part(self, store, layer, plan, valid, q_lat, q_rope, tau):
        """(o_lat, lse) of the attention over the selected rows in `valid` (a subset of `plan.valid`)."""
        rows_c, rows_r = jax.lax.optimization_barrier(gather_rows(store, layer, plan))
        return sparse_mla_decode_rows_lse(q_lat, q_rope, rows_c, rows_r, valid, tau)

    def _resolver(self):
        """The resolver rule's implementation for `resolve.resolve`: None (its jnp spec) or the Pallas kernel."""
        if not self._pallas:
            return None
        from pallas_kernels import sparse_gather

        return functools.partial(sparse_gather, interpret=self._interpret)


def _outside_this_program(fn, out_shape, *args):
    """fn(*args), run eagerly from an (unordered) host callback instead of inside the calling program.

    For Mosaic GPU's interpret mode in the tiered step: the interpreted kernel orders itself with ordered I/O
    callbacks, and jax (0.12.0.1) cannot lower a program that has both ordered effects and outputs in a non-default
    memory (the store's pinned_host pools): "safe_zip() argument 1 has length 24 but argument 0 has length 23"
    (the effect tokens are not counted in the propagated output memory kinds). Run as its own program, the
    interpreted kernel is the same computation; only the interpreted (CPU) path takes this detour."""
    def call(*a):
        return np.asarray(fn(*a))
    return jax.pure_callback(call, out_shape, *args)


def index_span(spec: StoreSpec, longest: int):
    """The batch entry bounding the indexer's work by the batch's longest live sequence (`longest` positions,
    the row being written included): int32[P], P = that many pages rounded up to a power of two (at most MP),
    so a decode loop compiles once per doubling of its context, not once per page."""
    need = max(1, -(-longest // 64))
    return np.zeros(min(spec.max_pages, 1 << (need - 1).bit_length()), np.int32)
