"""`Runner`: the device side of serving — the model split once, the kernels choice, and one jitted call per
step that decodes a batch through the tiered store *and* samples its tokens, read back in one device→host
transfer (the tokens and the step's counters together).

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
from hisparse_jax.kv import tiered
from hisparse_jax.kv.state import KVStore, StoreSpec
from hisparse_jax.model.decoder import SparseMLAModel

COUNTS: collections.Counter = collections.Counter()  # "split": model splits; "step"/"sampler": traces


def sample_rows(logits, seeds, positions, temperatures, top_ps):
    """One token per row of logits [n, V]: greedy where temperature == 0, else temperature + nucleus (top-p)
    drawn from the key (seed, position)."""

    def one(lg, seed, pos, t, p):
        key = jax.random.fold_in(jax.random.key(seed), pos)
        greedy = jnp.argmax(lg).astype(jnp.int32)
        scaled = lg / jnp.maximum(t, 1e-6)
        sorted_l = jnp.sort(scaled)[::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_l))
        cutoff = sorted_l[jnp.sum(cum < p)]
        masked = jnp.where(scaled < cutoff, -jnp.inf, scaled)
        drawn = jax.random.categorical(key, masked).astype(jnp.int32)
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
def _jitted_step(graphdef, kernels: str):
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, store, batch, sampling):
        COUNTS["step"] += 1
        tiered.TRACE_COUNTS["decode_step"] += 1
        logits, store, stats = tiered.step_impl(nnx.merge(graphdef, state), store, batch, kernels)
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
        self._step = _jitted_step(self.graphdef, self.kernels)

    def prefill_rows(self, tokens):
        """One causal forward over `tokens` (length bucketed to a power of two >= 16): (last logits f32[V],
        latent [L, T, C], rope [L, T, R], index_k [LI, T, dI]), as `generate.prefill_rows`."""
        return prefill_rows_split(self.graphdef, self.state, tokens)

    def decode(self, store: KVStore, batch: dict):
        """One decode step without sampling (the caller samples): (logits f32[B, V], store, stats), as
        `kv.tiered.decode_step` but with this runner's split parameters."""
        return tiered.decode_step_split(self.graphdef, self.state, store, batch, kernels=self.kernels)

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
