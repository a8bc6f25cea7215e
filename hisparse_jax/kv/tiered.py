"""Decoding through the tiered store: the `TieredKV` backend, `decode_step` and `decode_loop`.

`decode_step(model, store, batch) -> (logits, store, stats)` is one jitted step with the store donated
and fixed shapes: `batch = {"tokens": int32[B], "req": int32[B]}` with B a bucket and req = -1 for idle
rows. Positions come from `store.seq_lens`. Per step it appends every layer's new rows (device tail page,
then one host mirror write for all layers), runs each full indexer over the request's paged keys, resolves
the top-k per indexer group (resident | hot hit | miss fetched from host), and attends over the rows.
Shared-index layers replay their leader's plan. The host must have reserved the tail pages first.

Stats (per step, int32 arrays): resident / hits / misses [L] (rows read per layer by each path; a miss moves
the row of every layer of its group), h2d_rows (payload layer-rows: == sum(misses)), h2d_transfer_rows (what
the fetch mechanism moved), d2h_rows (host mirror writes), append_dropped (rows whose tail page was not
resident: a scheduling bug when non-zero). Bytes are rows x `spec.row_bytes`, computed on the host
(`stats_bytes`) so counters cannot overflow int32 at production sizes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax.kv import ops
from hisparse_jax.kv.state import KVStore, StoreSpec
from hisparse_jax.model.decoder import SparseMLAModel
from hisparse_jax.model.decoder import decode_step as model_decode_step
from hisparse_jax.model.mla import sparse_mla_decode_reference

TRACE_COUNTS: dict[str, int] = {"decode_step": 0, "decode_loop": 0}


def empty_stats(spec: StoreSpec) -> dict:
    L = spec.num_layers
    z = jnp.zeros((), jnp.int32)
    return {"resident": jnp.zeros((L,), jnp.int32), "hits": jnp.zeros((L,), jnp.int32),
            "misses": jnp.zeros((L,), jnp.int32), "h2d_rows": z, "h2d_transfer_rows": z, "d2h_rows": z,
            "append_dropped": z}


def stats_bytes(spec: StoreSpec, stats: dict) -> dict:
    """Host-side totals of step stats (one step or stacked / summed steps) as Python ints, with bytes."""
    out = {k: int(np.sum(v)) for k, v in stats.items()}
    for k in ("h2d", "h2d_transfer", "d2h"):
        out[f"{k}_bytes"] = out.pop(f"{k}_rows") * spec.row_bytes
    return out


KERNELS = ("reference", "pallas", "pallas_interpret")


def check_kernels(kernels: str) -> str:
    """Validate the kernel choice: "reference" (jnp), "pallas" (GPU kernels; needs a GPU backend), or
    "pallas_interpret" (the same kernels in Pallas interpret mode, on any backend). Never a silent fallback."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}; choose one of {', '.join(KERNELS)}")
    if kernels == "pallas" and jax.default_backend() != "gpu":
        raise ValueError(f"kernels='pallas' needs a GPU backend (this one is {jax.default_backend()!r}); "
                         "use kernels='pallas_interpret' to run the kernels on the CPU")
    return kernels


@dataclasses.dataclass(frozen=True)
class TieredKV:
    """`KVBackend` over a `KVStore`. The cache threaded through the model is
    {"store": KVStore, "req": int32[B], "plan": ops.Plan | None, "stats": dict}.

    kernels: "reference" (jnp ops), "pallas" / "pallas_interpret": the indexer top-k, the fused resolver
    and the sparse MLA decode run as Pallas kernels (`pallas_kernels`)."""

    spec: StoreSpec
    kernels: str = "reference"
    index_pages: int | None = None  # pages of each request the indexer scores (None: all MP)

    @property
    def _pallas(self) -> bool:
        return self.kernels != "reference"

    @property
    def _interpret(self) -> bool:
        return self.kernels == "pallas_interpret"

    def append(self, cache, layer, slot, positions, c, k_rope, k_index):
        store, dropped = ops.append_rows(self.spec, cache["store"], layer, slot, cache["req"], positions, c, k_rope,
                                         k_index)
        stats = dict(cache["stats"], append_dropped=cache["stats"]["append_dropped"] + dropped)
        return dict(cache, store=store, stats=stats)

    def select(self, cache, slot, positions, q_index, w):
        if not self._pallas:
            return ops.index_select(self.spec, cache["store"], slot, cache["req"], positions, q_index, w,
                                    self.index_pages), cache
        from pallas_kernels import indexer_topk

        spec, store, req = self.spec, cache["store"], cache["req"]
        seq = jnp.where(req >= 0, positions + 1, 0)
        table = store.index_table[jnp.maximum(req, 0)][:, :self.index_pages]
        topk = indexer_topk(q_index, w, store.index_k[slot], table, seq, topk=spec.topk,
                            k_scale=store.index_scale[slot] if spec.fp8 else None, interpret=self._interpret)
        return ops.pad_topk(spec, topk[:, :min(spec.topk, table.shape[1] * 64)]), cache

    def attend(self, cache, layer, topk, q_lat, q_rope, tau):
        spec = self.spec
        store, stats = cache["store"], dict(cache["stats"])
        g = spec.group_of_layer[layer]
        if layer == spec.groups[g][0]:  # the group's leader resolves and fetches for every layer of the group
            plan, store = ops.resolve(spec, store, g, cache["req"], topk, resolver=self._resolver())
            store, payload, transfer = ops.fetch_misses(spec, store, spec.groups[g], plan)
            stats["h2d_rows"] = stats["h2d_rows"] + payload
            stats["h2d_transfer_rows"] = stats["h2d_transfer_rows"] + transfer
        else:
            plan = cache["plan"]
        # The barrier pins the attention's inputs: XLA then compiles the math identically whatever the pool
        # sizes, so tiered and all-resident runs agree bit for bit (fusing the gather into the attention
        # would let the reduction order depend on the store's shape).
        if self._pallas:
            from pallas_kernels import sparse_mla_decode

            o_lat = sparse_mla_decode(q_lat, q_rope, store.latent, store.rope, plan.page, plan.row, plan.valid,
                                      tau=tau, latent_scale=store.latent_scale, layer=layer,
                                      interpret=self._interpret)
        else:
            rows_c, rows_r = jax.lax.optimization_barrier(ops.gather_rows(spec, store, layer, plan))
            o_lat = sparse_mla_decode_reference(q_lat, q_rope, rows_c, rows_r, plan.valid, tau)
        n_res = jnp.sum(plan.resident).astype(jnp.int32)
        n_miss = jnp.sum(plan.miss).astype(jnp.int32)
        n_hit = jnp.sum(plan.valid & ~plan.resident & ~plan.miss).astype(jnp.int32)
        stats["resident"] = stats["resident"].at[layer].add(n_res)
        stats["hits"] = stats["hits"].at[layer].add(n_hit)
        stats["misses"] = stats["misses"].at[layer].add(n_miss)
        return o_lat, dict(cache, store=store, plan=plan, stats=stats)


    def _resolver(self):
        """The resolver rule's implementation for `ops.resolve`: None (its jnp spec) or the Pallas kernel."""
        if not self._pallas:
            return None
        from pallas_kernels import sparse_gather

        return functools.partial(sparse_gather, interpret=self._interpret)


def index_span(spec: StoreSpec, longest: int):
    """The batch entry bounding the indexer's work by the batch's longest live sequence (`longest` positions,
    the row being written included): int32[P], P = that many pages rounded up to a power of two (at most MP),
    so a decode loop compiles once per doubling of its context, not once per page."""
    need = max(1, -(-longest // 64))
    return np.zeros(min(spec.max_pages, 1 << (need - 1).bit_length()), np.int32)


def _positions(store: KVStore, req):
    return jnp.where(req >= 0, store.seq_lens[jnp.maximum(req, 0)], -1)


def step_impl(model: SparseMLAModel, store: KVStore, batch: dict, kernels: str = "reference"):
    """The un-jitted step (composable inside a user's own jit / scan).

    batch: tokens int32[B], req int32[B]; optional pos int32[B] — explicit positions, which lets several rows
    of one request form a prefill chunk (that request must then be fully resident: its rows share no hot
    buffer state). Without `pos`, each row decodes at its request's seq_len. Optional index_span int32[P]
    (only its shape is used): the indexer scores each request's first P pages, P >= the pages of the batch's
    longest live sequence (`index_span(...)` makes it; without it, all MP)."""
    spec = store.spec
    index_pages = batch["index_span"].shape[0] if "index_span" in batch else None
    req = batch["req"].astype(jnp.int32)
    positions = _positions(store, req) if "pos" not in batch else jnp.where(req >= 0, batch["pos"], -1)
    cache = {"store": store, "req": req, "plan": None, "stats": empty_stats(spec)}
    logits, cache, _ = model_decode_step(model, batch["tokens"].astype(jnp.int32), positions, cache,
                                         TieredKV(spec, kernels, index_pages))
    store, stats = cache["store"], cache["stats"]
    if spec.mirror_to_host:
        store, d2h = ops.mirror_rows(spec, store, req, positions)
        stats["d2h_rows"] = stats["d2h_rows"] + d2h
    live = req >= 0
    seq_lens = store.seq_lens.at[jnp.where(live, req, spec.max_seqs)].max(positions + 1, mode="drop")
    store = dataclasses.replace(store, seq_lens=seq_lens, clock=store.clock + 1)
    return logits, store, stats


@functools.lru_cache(maxsize=32)
def _jitted_step(graphdef, kernels: str):
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, store, batch):
        TRACE_COUNTS["decode_step"] += 1
        return step_impl(nnx.merge(graphdef, state), store, batch, kernels)

    return step


@functools.lru_cache(maxsize=32)
def _jitted_loop(graphdef, num_steps: int, kernels: str):
    @functools.partial(jax.jit, donate_argnums=(1,))
    def loop(state, store, batch):
        TRACE_COUNTS["decode_loop"] += 1
        model = nnx.merge(graphdef, state)

        def body(carry, _):
            store, tokens = carry
            logits, store, stats = step_impl(model, store, {"tokens": tokens, "req": batch["req"]}, kernels)
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return (store, nxt), (nxt, logits, stats)

        (store, _), (tokens, logits, stats) = jax.lax.scan(body, (store, batch["tokens"]), None, length=num_steps)
        return tokens, logits, store, stats

    return loop


def decode_step(model: SparseMLAModel, store: KVStore, batch: dict, *, kernels: str = "reference"):
    """One jitted decode step; the store is donated. Returns (logits f32[B, V], store, stats).
    kernels: "reference" | "pallas" | "pallas_interpret" (see `TieredKV`)."""
    graphdef, state = nnx.split(model)
    return _jitted_step(graphdef, check_kernels(kernels))(state, store, _commit(store, batch))


def decode_step_split(graphdef, state, store: KVStore, batch: dict, *, kernels: str = "reference"):
    """`decode_step` for a model already split (`nnx.split`): a caller that keeps it split splits it once."""
    return _jitted_step(graphdef, check_kernels(kernels))(state, store, _commit(store, batch))


def make_decode_step(model: SparseMLAModel, *, kernels: str = "reference"):
    """`decode_step` bound to `model` with the model split once: step(store, batch) -> (logits, store, stats).
    Saves the per-call `nnx.split` (milliseconds of host time) in tight loops; do not mutate `model` after."""
    graphdef, state = nnx.split(model)
    jitted = _jitted_step(graphdef, check_kernels(kernels))

    def step(store: KVStore, batch: dict):
        return jitted(state, store, _commit(store, batch))

    return step


def decode_loop(model: SparseMLAModel, store: KVStore, batch: dict, num_steps: int, *,
                kernels: str = "reference"):
    """`num_steps` greedy decode steps in one `lax.scan` (each step feeds its argmax to the next).

    The host must have reserved the tail pages of all `num_steps` positions first. Returns
    (tokens int32[num_steps, B] (the token *produced* by each step), logits f32[num_steps, B, V], store,
    stats stacked over steps) — bit-identical to `num_steps` calls of `decode_step`.
    """
    graphdef, state = nnx.split(model)
    return _jitted_loop(graphdef, int(num_steps), check_kernels(kernels))(state, store, _commit(store, batch))


def _commit(store: KVStore, batch: dict) -> dict:
    """Put the batch on the store's device: committed and uncommitted arguments compile separately."""
    dev = store.seq_lens.sharding
    return {k: jax.device_put(v, dev) for k, v in batch.items()}
