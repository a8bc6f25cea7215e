"""The device side of serving: a model's decode steps through a tiered store, and the `Runner`.

`decode_step(model, store, batch)` / `decode_loop(model, store, batch, n)` (and `step_impl`, un-jitted) run the
model with the store as its `KVBackend` (`kv.tiered.TieredKV`). `Runner` is what the engine and `generate` use:
the model split once, the kernels choice, and one jitted call per step that decodes a batch through the store
*and* samples its tokens, read back in one device→host transfer (the tokens and the step's counters together).

    runner = Runner(model, kernels="reference")
    last, latent, rope, index_k = runner.prefill_rows(tokens)       # one causal forward (bucketed length)
    out = runner.step(store, batch, sampling)                         # StepOutput: tokens, store, stats

`batch` is the store's step batch ({"tokens", "req", "pos"}: int32[B], B a bucket); `sampling` says which rows
emit a token and how: {"rows", "seed", "pos", "temperature", "top_p"}, each of length B (pad with row 0 and
any parameters; only the first `n_emit` tokens are returned). The store is donated.

Sampling depends only on (seed, position) — `sample_rows` — so a request's tokens do not depend on batching or
scheduling. The whole-prompt prefill path samples its first token with the same function.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax.generate import prefill_rows_split
from hisparse_jax.kv import ops, tiered
from hisparse_jax.kv.state import KVStore, StoreSpec
from hisparse_jax.model.decoder import SparseMLAModel
from hisparse_jax.model.decoder import decode_step as model_decode_step

COUNTS: collections.Counter = collections.Counter()  # "split": model splits; "step"/"sampler": traces
TRACE_COUNTS: dict[str, int] = {"decode_step": 0, "decode_loop": 0}  # traces of the store-level steps


# ----- a model's decode steps through a tiered store --------------------------------------------------------
def _positions(store: KVStore, req):
    return jnp.where(req >= 0, store.seq_lens[jnp.maximum(req, 0)], -1)


def step_impl(model: SparseMLAModel, store: KVStore, batch: dict, kernels: str = "reference",
              rows_per_request: int = 1):
    """The un-jitted step (composable inside a user's own jit / scan).

    batch: tokens int32[B], req int32[B]; optional pos int32[B] — explicit positions, which lets several rows
    of one request form a prefill chunk (that request must then be fully resident: its rows share no hot
    buffer state). Without `pos`, each row decodes at its request's seq_len. Optional index_span int32[P]
    (only its shape is used): the indexer scores each request's first P pages, P >= the pages of the batch's
    longest live sequence (`index_span(...)` makes it; without it, all MP). rows_per_request S > 1: the rows are
    groups of S consecutive rows of one request at consecutive `pos` (speculative verification), each group
    resolved once over the union of its rows' top-k (see `tiered.TieredKV`)."""
    spec = store.spec
    index_pages = batch["index_span"].shape[0] if "index_span" in batch else None
    req = batch["req"].astype(jnp.int32)
    positions = _positions(store, req) if "pos" not in batch else jnp.where(req >= 0, batch["pos"], -1)
    backend = tiered.TieredKV(spec, kernels, index_pages, rows_per_request)
    logits, cache, _ = model_decode_step(model, batch["tokens"].astype(jnp.int32), positions,
                                         backend.init_cache(store, req), backend)
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
    kernels: one of `tiered.KERNELS` (see `tiered.check_kernels`)."""
    graphdef, state = nnx.split(model)
    return _jitted_step(graphdef, tiered.check_kernels(kernels))(state, store, _commit(store, batch))


def decode_step_split(graphdef, state, store: KVStore, batch: dict, *, kernels: str = "reference"):
    """`decode_step` for a model already split (`nnx.split`): a caller that keeps it split splits it once."""
    return _jitted_step(graphdef, tiered.check_kernels(kernels))(state, store, _commit(store, batch))


def make_decode_step(model: SparseMLAModel, *, kernels: str = "reference"):
    """`decode_step` bound to `model` with the model split once: step(store, batch) -> (logits, store, stats).
    Saves the per-call `nnx.split` (milliseconds of host time) in tight loops; do not mutate `model` after."""
    graphdef, state = nnx.split(model)
    jitted = _jitted_step(graphdef, tiered.check_kernels(kernels))

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
    return _jitted_loop(graphdef, int(num_steps), tiered.check_kernels(kernels))(state, store, _commit(store, batch))


def _commit(store: KVStore, batch: dict) -> dict:
    """Put the batch on the store's device: committed and uncommitted arguments compile separately."""
    dev = store.seq_lens.sharding
    return {k: jax.device_put(v, dev) for k, v in batch.items()}


# ----- the runner: the model split once, decode + sample in one call ---------------------------------------


def nucleus_logits(lg, t, p):
    """The distribution a token is drawn from, as logits: lg [V] / temperature t with everything outside the top-p
    nucleus at -inf (t > 0; at t == 0 the draw is greedy and this is unused)."""
    scaled = lg / jnp.maximum(t, 1e-6)
    sorted_l = jnp.sort(scaled)[::-1]
    cum = jnp.cumsum(jax.nn.softmax(sorted_l))
    cutoff = sorted_l[jnp.sum(cum < p)]
    return jnp.where(scaled < cutoff, -jnp.inf, scaled)


def token_key(seed, pos):
    """The PRNG key of the token at position `pos` of the request with `seed`."""
    return jax.random.fold_in(jax.random.key(seed), pos)


def sample_rows(logits, seeds, positions, temperatures, top_ps):
    """One token per row of logits [n, V]: greedy where temperature == 0, else temperature + nucleus (top-p)
    drawn from the key (seed, position)."""

    def one(lg, seed, pos, t, p):
        greedy = jnp.argmax(lg).astype(jnp.int32)
        drawn = jax.random.categorical(token_key(seed, pos), nucleus_logits(lg, t, p)).astype(jnp.int32)
        return jnp.where(t > 0, drawn, greedy)

    return jax.vmap(one)(logits, seeds, positions, temperatures, top_ps)


@functools.lru_cache(maxsize=8)
def sampler():
    """`sample_rows`, jitted on its own (for logits that do not come from a step: whole-prompt prefills)."""

    @jax.jit
    def sample(logits, seeds, positions, temperatures, top_ps):
        COUNTS["sampler"] += 1
        return sample_rows(logits, seeds, positions, temperatures, top_ps)

    return sample


@dataclasses.dataclass
class StepOutput:
    tokens: list[int]  # one per emitting row, in the order of `sampling["rows"]`
    store: KVStore
    stats: dict  # Python ints (per-layer counters as lists) and bytes: see `kv.tiered.stats_bytes`
    page_stamps: np.ndarray | None = None  # the store's indexer-recency stamps after the step, when asked for


@functools.lru_cache(maxsize=32)
def _jitted_step_and_sample(graphdef, kernels: str):
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, store, batch, sampling):
        COUNTS["step"] += 1
        TRACE_COUNTS["decode_step"] += 1
        logits, store, stats = step_impl(nnx.merge(graphdef, state), store, batch, kernels)
        tokens = sample_rows(logits[sampling["rows"]], sampling["seed"], sampling["pos"], sampling["temperature"],
                             sampling["top_p"])
        return tokens, store, stats

    return step


class Runner:
    """Owns what runs on the device for a model: its parameters split once (`nnx.split`), the kernels, and the
    jitted step. The model must not be mutated while a runner uses it."""

    def __init__(self, model: SparseMLAModel, *, kernels: str = "reference"):
        self.kernels = tiered.check_kernels(kernels)
        self.graphdef, self.state = nnx.split(model)
        COUNTS["split"] += 1
        self._step = _jitted_step_and_sample(self.graphdef, self.kernels)

    def prefill_rows(self, tokens, *, with_hidden: bool = False):
        """One causal forward over `tokens` (length bucketed to a power of two >= 16): (last logits f32[V],
        latent [L, T, C], rope [L, T, R], index_k [LI, T, dI]), as `generate.prefill_rows`; with_hidden: and the
        final hidden states [T, D] (what the MTP layer reads)."""
        return prefill_rows_split(self.graphdef, self.state, tokens, with_hidden=with_hidden)

    def mtp_prefill_rows(self, hidden, next_tokens):
        """The MTP layer's rows over a prompt and its first draft: `speculative.mtp_prefill_rows`."""
        from hisparse_jax.engine import speculative

        return speculative.mtp_prefill_rows(self.graphdef, self.state, hidden, next_tokens)

    def admit_prompts(self, store: KVStore, cache, prompts) -> tuple[KVStore, list[int], list]:
        """Prefill each prompt (one causal forward) and admit it with its rows into `cache` (a `TieredCache`) and
        `store`: (store, slots, the logits each prompt's first new token is drawn from)."""
        from hisparse_jax.kv import device as kv_device

        slots, first = [], []
        for p in prompts:
            last, latent, rope, index_k = self.prefill_rows(p)
            store, slot = kv_device.admit_prefilled(store, cache, latent, rope, index_k, len(p))
            slots.append(slot)
            first.append(last)
        return store, slots, first

    def decode(self, store: KVStore, batch: dict):
        """One decode step without sampling (the caller samples): (logits f32[B, V], store, stats), as
        `decode_step` but with this runner's split parameters."""
        return decode_step_split(self.graphdef, self.state, store, batch, kernels=self.kernels)

    def step(self, spec: StoreSpec, store: KVStore, batch: dict, sampling: dict, n_emit: int, *,
             read_page_stamps: bool = False) -> StepOutput:
        """Decode `batch` through `store` (donated) and sample the emitting rows; one device→host read (with
        `read_page_stamps`, the store's per-page indexer-recency stamps come back in the same read)."""
        dev = store.seq_lens.sharding
        batch = {k: jax.device_put(np.asarray(v), dev) for k, v in batch.items()}
        sampling = {k: jax.device_put(np.asarray(v), dev) for k, v in sampling.items()}
        tokens, store, stats = self._step(self.state, store, batch, sampling)
        stamps = store.page_stamp if read_page_stamps else None
        tokens, stats, stamps = jax.device_get((tokens, stats, stamps))  # the step's one device→host transfer
        return StepOutput(np.asarray(tokens)[:n_emit].tolist(), store, tiered.stats_bytes(spec, stats), stamps)

    def spec_step(self, spec: StoreSpec, store: KVStore, batch: dict, sampling: dict, k: int,
                  acceptance: str = "match", *, read_page_stamps: bool = False) -> "SpecStepOutput":
        """One speculative step (`speculative.spec_step_impl`: verify k + 1 rows per request, accept, draft k)
        through `store` (donated); one device→host read."""
        from hisparse_jax.engine import speculative

        dev = store.seq_lens.sharding
        batch = {key: jax.device_put(np.asarray(v), dev) for key, v in batch.items()}
        sampling = {key: jax.device_put(np.asarray(v), dev) for key, v in sampling.items()}
        out = speculative.jitted_spec_step(self.graphdef, self.kernels, int(k), acceptance)(self.state, store, batch,
                                                                                        sampling)
        target, accepted, drafts, store, stats = out
        stamps = store.page_stamp if read_page_stamps else None
        target, accepted, drafts, stats, stamps = jax.device_get((target, accepted, drafts, stats, stamps))
        return SpecStepOutput(np.asarray(target), np.asarray(accepted), np.asarray(drafts), store,
                              tiered.stats_bytes(spec, stats), stamps)


@dataclasses.dataclass
class SpecStepOutput:
    target: np.ndarray  # int32[G, k + 1]: each verified row's sampled next token
    accepted: np.ndarray  # int32[G]: drafts accepted per request (the request emits target[g, :accepted + 1])
    drafts: np.ndarray  # int32[G, k]: the next step's drafts
    store: KVStore
    stats: dict
    page_stamps: np.ndarray | None = None
