"""The device side: every jitted program that runs the model, and the batch they run on (`StepRows`). `generate`,
`Engine`, `MeshEngine`, speculation, the experiments and the benchmarks are its clients and build none of their own.

Who builds the other jitted programs, and why not here: the store's own programs (`kv.device.STORE_PROGRAMS`:
table updates and prompt writes; its checked appends and gathers) are built in `kv.device`, because the kv package
imports no model and no engine (this module reaches them through `kv.device`); their per-rank form over a mesh (a
`shard_map` of a `STORE_PROGRAMS` entry) and the stacked store made in place are built in `hisparse_jax.parallel`,
which this module imports for the mesh step. Outside these three: the kernels' own wrappers (`pallas_kernels/`),
training (`train/dsa.py`) and the kernel test cases' input preparation (`kernel_cases.py`).

* the tiered decode step: `step_impl` (un-jitted: the model through the store as its `KVBackend`, then the step's
  last writes to the store, `kv.writes.end_step`), `store_decode_step` / `decode_loop` (jitted, store donated);
* `Runner`: a model split once, the kernels choice, and one jitted call per step that decodes a batch through the
  store *and* samples its tokens, read back in one device->host transfer (the tokens and the step's counters);
* the causal forward (`jitted_prefill`, `prefill_rows`) and the contiguous KV arrays' decode-and-sample step
  (`jitted_dense_decode`), used by `generate` without a store; `sampler`, the sampler jitted on its own (logits
  that do not come from a sampling step: whole-prompt prefills, `generate`'s tiered and mesh paths);
* speculative decoding's step and MTP prefill (`jitted_speculative_step`, `mtp_prefill_rows`; the math in
  `engine.speculative`);
* the per-rank step over a mesh (`jitted_sharded_step`; placement in `hisparse_jax.parallel`) and
  `MeshRunner`, `MeshEngine`'s device side: every rank's batch padded to one bucket, decoded and sampled in one
  sharded call, read back in one transfer.

    runner = Runner(model, kernels="reference")
    last, latent, rope, index_k = runner.prefill_rows(tokens)       # one causal forward (bucketed length)
    out = runner.step(spec, store, batch, sampling, n_emit)           # StepOutput: tokens, store, stats

The step's batch is built in one place, `StepRows`, from the scheduled rows. A row is one token of one request at
one position: a decode row (the request's last token), a prompt row (a chunk of its prompt written through the
store) or a verified row (speculative decoding: the pending token and the drafts). `StepRows` collects a step's rows
request by request and which of them emit a token, and builds

    batch     {"tokens", "req", "pos"} int32[B] (+ "draft_ok" int32[B] when drafts were added), "index_span"
              int32[P] (only its shape is read: the indexer scores pages up to the batch's longest position);
    sampling  {"rows", "seed", "pos", "temperature", "top_p"} [B]: the emitting rows, in order, and their draws
              (only the first `n_emit` tokens are returned);

B a power-of-two bucket (of groups of `group` rows each, >= min_bucket groups). Rows past the real ones are idle
(`ROW_PAD`: slot -1). `pad` fills columns to a length with the same idle values: the mesh pads every rank's batch
to one bucket with it, `generate` its request column. The store is donated.

    rows = StepRows()
    rows.add(slot, [token], position, emit=(seed, position + 1, temperature, top_p))
    batch, sampling, n_emit = rows.build(spec, min_bucket=8)

Every program that samples uses one rule, `sampling.sample_rows`: a token depends only on (seed, position), so a
request's tokens do not depend on batching, scheduling or the path (`generate`, `Engine`, `MeshEngine`). Every
trace of a program increments `TRACE_COUNTS` (the tests' proof of no recompilation).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from hisparse_jax import parallel
from hisparse_jax.engine import speculative
from hisparse_jax.engine.sampling import sample_rows
from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv import tiered
from hisparse_jax.kv.state import KVStore, StoreSpec
from hisparse_jax.kv.writes import end_step
from hisparse_jax.model.decoder import SparseMLAModel
from hisparse_jax.model.decoder import decode_step as model_decode_step
from hisparse_jax.model.mtp import mtp_forward

COUNTS: collections.Counter = collections.Counter()  # "split": model splits; "step"/"sampler": traces
# traces of each program: "prefill", "decode" (the contiguous step), "store_decode_step" (a store step: plain, sampled,
# speculative or sharded), "decode_loop"
TRACE_COUNTS: collections.Counter = collections.Counter()


# ----- the step's batch: the arrays one call runs on ---------------------------------------------------------
# what a batch's rows past the real ones hold (idle rows), and an emitting row's sampling columns, in their dtypes
ROW_PAD = {"tokens": (0, np.int32), "req": (-1, np.int32), "pos": (-1, np.int32), "draft_ok": (0, np.int32)}
SAMPLING_PAD = {"rows": (0, np.int32), "seed": (0, np.uint32), "pos": (0, np.int32), "temperature": (0, np.float32),
                "top_p": (1, np.float32)}


def bucket_pow2(n: int, minimum: int = 1) -> int:
    """The power of two >= n and >= minimum: the sizes a step compiles for."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def pad(columns: dict, length: int, pads: dict = ROW_PAD) -> dict[str, np.ndarray]:
    """Each column (a sequence of n <= length values) as an array [length] of its `pads` dtype: its values, then
    the column's pad value."""
    out = {}
    for name, values in columns.items():
        value, dtype = pads[name]
        a = np.full(length, value, dtype)
        a[:len(values)] = values
        out[name] = a
    return out


class StepRows:
    """One step's rows, added request by request; `build` makes the batched call's arrays (module docstring)."""

    def __init__(self):
        self.columns: dict[str, list] = {"tokens": [], "req": [], "pos": []}
        self.emits: list[tuple] = []  # (row, seed, position, temperature, top_p) of each emitting row

    def __len__(self) -> int:
        return len(self.columns["tokens"])

    def add(self, slot: int, tokens, start: int, *, emit: tuple | None = None, draft_ok=None) -> int:
        """Rows for `tokens` of the request in `slot` at positions start, start + 1, ...; `emit` (seed, position,
        temperature, top_p): the last of them emits a token drawn so; `draft_ok` (one 0 / 1 per row): which rows
        carry a real draft. Returns the index of the last row."""
        n = len(tokens)
        c = self.columns
        c["tokens"] += list(tokens)
        c["req"] += [slot] * n
        c["pos"] += list(range(start, start + n))
        if draft_ok is not None:
            c.setdefault("draft_ok", []).extend(draft_ok)
        if emit is not None:
            self.emits.append((len(self) - 1, *emit))
        return len(self) - 1

    def build(self, spec, min_bucket: int = 1, *, group: int = 1, span_to: int | None = None):
        """(batch, sampling, n_emit) padded to B rows: `group` rows per group, a power-of-two number of groups >=
        min_bucket. The indexer's span covers positions < span_to (default: the longest row's position + 1)."""
        B = bucket_pow2(-(-len(self) // group), min_bucket) * group
        batch = pad(self.columns, B)
        batch["index_span"] = tiered.index_span(spec, max(self.columns["pos"]) + 1 if span_to is None else span_to)
        sampling = pad(dict(zip(("rows", "seed", "pos", "temperature", "top_p"), zip(*self.emits))), B,
                       SAMPLING_PAD) if self.emits else pad(dict.fromkeys(SAMPLING_PAD, ()), B, SAMPLING_PAD)
        return batch, sampling, len(self.emits)


# ----- the causal forward, and the contiguous arrays' step -----------------------------------------------
@functools.lru_cache(maxsize=32)
def jitted_prefill(graphdef):
    @jax.jit
    def prefill(state, ids):
        TRACE_COUNTS["prefill"] += 1
        model = nnx.merge(graphdef, state)
        return model.forward(ids)

    return prefill


# (graphdef, ids shape, device) -> (bytes a causal forward needs, of which temporaries) from XLA's memory analysis,
# or None where the backend gives none: `check_prefill_memory` compiles each such program ahead of time once
_PREFILL_BYTES: dict = {}


def check_prefill_memory(cfg, graphdef, state, ids) -> None:
    """Refuse (ValueError), before running it, a causal forward over `ids` [B, T] whose activations cannot fit the
    memory of the device the parameters are on: its attention and indexer scores grow as B x T^2 per head (at
    T = 65536 the 4-head tiny-glm needs ~700 GB, which XLA reported as an out-of-memory error at run time). When the
    scores of one head and one index head per attention head (`B T^2 (H + H_I)` float32, below what the forward
    materialises) fit a quarter of that memory there is nothing to check; otherwise the program is compiled ahead
    of time and XLA's own memory analysis (arguments + temporaries + outputs) decides."""
    from hisparse_jax.memory import device_memory_bytes, memory_name

    B, T = ids.shape
    leaves = jax.tree.leaves(state)
    device = next(iter(leaves[0].devices())) if leaves and hasattr(leaves[0], "devices") else None
    limit = device_memory_bytes(device) if device is not None else None
    if limit is None or 4 * B * T * T * (cfg.num_attention_heads + cfg.index_n_heads) <= limit // 4:
        return
    key = (graphdef, ids.shape, device)
    if key not in _PREFILL_BYTES:  # one ahead-of-time compile per program, shape and device
        stats = jitted_prefill(graphdef).lower(state, ids).compile().memory_analysis()
        _PREFILL_BYTES[key] = None if stats is None else (  # None: a backend without memory analysis
            stats.argument_size_in_bytes + stats.temp_size_in_bytes + stats.output_size_in_bytes,
            stats.temp_size_in_bytes)
    if _PREFILL_BYTES[key] is None or _PREFILL_BYTES[key][0] <= limit:
        return
    need, temps = _PREFILL_BYTES[key]
    raise ValueError(f"a whole-prompt forward over {T} positions (the prompt's length bucket) needs {need:,} bytes "
                     f"({need / 2 ** 30:,.1f} GiB; XLA's memory analysis: {temps / 2 ** 30:,.1f} GiB of temporaries, "
                     f"mostly attention and indexer scores, which grow with the square of the length), more than the "
                     f"{limit / 2 ** 30:,.1f} GiB of {memory_name(device)}; use a shorter prompt, or the engine's "
                     f"prefill='chunked' (prompt rows written through the store, {cfg.index_topk} rows attended per "
                     f"position)")


def prefill_rows(model: SparseMLAModel, tokens: Sequence[int]):
    """One causal forward over `tokens` (length bucketed to a power of two, so prompts share compiles).

    Returns (last logits f32[V], latent [L, T, C], rope [L, T, R], index_k [LI, T, dI]) with T the bucket length
    (the first len(tokens) rows are real; `kv.device.write_prefill(store, manager, slot, ..., len(tokens))` stores
    those, and keeping T bucketed keeps its compiles bounded too) and the logits the first new token is drawn from."""
    return prefill_rows_split(model.cfg, *nnx.split(model), tokens)


def prefill_rows_split(cfg, graphdef, state, tokens: Sequence[int], *, with_hidden: bool = False):
    """`prefill_rows` for a model (of config `cfg`) already split (`nnx.split`), so a caller that keeps it split
    splits it once. with_hidden: also return the final hidden states [T, D] (after the final norm: what an MTP layer
    reads). A forward whose activations cannot fit the device is refused first (`check_prefill_memory`)."""
    n = len(tokens)
    ids = np.zeros((1, bucket_pow2(n, 16)), np.int32)
    ids[0, :n] = tokens
    ids = jnp.asarray(ids)
    check_prefill_memory(cfg, graphdef, state, ids)
    logits, aux = jitted_prefill(graphdef)(state, ids)
    rows = (jnp.stack(aux[k])[:, 0] for k in ("latent", "rope", "index_k"))
    out = (logits[0, n - 1].astype(jnp.float32), *rows)
    return out + (aux["hidden"][0],) if with_hidden else out


@functools.lru_cache(maxsize=32)
def jitted_dense_decode(graphdef, backend):
    """The contiguous decode step: step(state, tokens, positions, kv, sampling) -> (tokens, logits, kv).
    Decodes `tokens` at `positions` (int32[B]) and samples each row's next token (`sample_rows`, at position
    positions + 1); sampling: {"seed", "temperature", "top_p"}, [B] each (arrays: one compile for every temperature).
    `kv` (`init_dense_kv`'s arrays) is donated and updated in place (`DenseKV` writes one row per layer and
    sequence)."""

    @functools.partial(jax.jit, donate_argnums=(3,))
    def step(state, tokens, positions, kv, sampling):
        TRACE_COUNTS["decode"] += 1
        model = nnx.merge(graphdef, state)
        logits, kv, _ = model_decode_step(model, tokens, positions, kv, backend)
        nxt = sample_rows(logits, sampling["seed"], positions + 1, sampling["temperature"], sampling["top_p"])
        return nxt, logits, kv

    return step


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
    scored_pages = batch["index_span"].shape[0] if "index_span" in batch else None
    req = batch["req"].astype(jnp.int32)
    positions = _positions(store, req) if "pos" not in batch else jnp.where(req >= 0, batch["pos"], -1)
    backend = tiered.TieredKV(spec, kernels, scored_pages, rows_per_request)
    logits, kv, _ = model_decode_step(model, batch["tokens"].astype(jnp.int32), positions,
                                      backend.init_kv(store, req), backend)
    store, stats = end_step(kv["store"], kv["stats"], (req, positions), (req, positions + 1))
    return logits, store, stats


@functools.lru_cache(maxsize=32)
def _jitted_step(graphdef, kernels: str):
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, store, batch):
        TRACE_COUNTS["store_decode_step"] += 1
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


def store_decode_step(model: SparseMLAModel, store: KVStore, batch: dict, *, kernels: str = "reference"):
    """One jitted decode step; the store is donated. Returns (logits f32[B, V], store, stats).
    kernels: one of `tiered.KERNELS` (see `tiered.check_kernels`)."""
    graphdef, state = nnx.split(model)
    return _jitted_step(graphdef, tiered.check_kernels(kernels))(state, store, _commit(store, batch))


def decode_loop(model: SparseMLAModel, store: KVStore, batch: dict, num_steps: int, *,
                kernels: str = "reference"):
    """`num_steps` greedy decode steps in one `lax.scan` (each step feeds its argmax to the next).

    The host must have reserved the tail pages of all `num_steps` positions first. Returns
    (tokens int32[num_steps, B] (the token *produced* by each step), logits f32[num_steps, B, V], store,
    stats stacked over steps) — bit-identical to `num_steps` calls of `store_decode_step`.
    """
    graphdef, state = nnx.split(model)
    return _jitted_loop(graphdef, int(num_steps), tiered.check_kernels(kernels))(state, store, _commit(store, batch))


def _commit(store: KVStore, batch: dict) -> dict:
    """Put the batch (arrays, or host sequences) on the store's device: committed and uncommitted arguments compile
    separately."""
    dev = store.seq_lens.sharding
    return {k: jax.device_put(v if isinstance(v, jax.Array) else np.asarray(v), dev) for k, v in batch.items()}


# ----- the runner: the model split once, decode + sample in one call ---------------------------------------


@functools.lru_cache(maxsize=8)
def sampler():
    """`sample_rows`, jitted on its own (for logits that do not come from a step: whole-prompt prefills)."""

    @jax.jit
    def sample(logits, seeds, positions, temperatures, top_ps):
        COUNTS["sampler"] += 1
        return sample_rows(logits, seeds, positions, temperatures, top_ps)

    return sample


def call_on_store(owner, apply_updates, call):
    """The step's one batched call on a store that its call donates: `apply_updates()` (this step's table
    decisions) then `call(owner.store) -> (store, out)`; the returned store becomes `owner.store` and `out` is
    returned. If either raises, `owner.store` is left as it was and `owner.store_lost` says whether the call
    consumed it (donated buffers deleted: the owner cannot step again). `Engine` and `MeshEngine` step through it."""
    store = owner.store
    try:
        apply_updates()
        store = owner.store
        store, out = call(store)
    except Exception:
        owner.store_lost = any(x.is_deleted() for x in jax.tree.leaves(store))
        raise
    owner.store = store
    return out


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
        TRACE_COUNTS["store_decode_step"] += 1
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
        self.cfg = model.cfg
        self.graphdef, self.state = nnx.split(model)
        COUNTS["split"] += 1
        self._step = _jitted_step_and_sample(self.graphdef, self.kernels)

    def prefill_rows(self, tokens, *, with_hidden: bool = False):
        """One causal forward over `tokens` (length bucketed to a power of two >= 16): (last logits f32[V],
        latent [L, T, C], rope [L, T, R], index_k [LI, T, dI]), as `generate.prefill_rows`; with_hidden: and the
        final hidden states [T, D] (what the MTP layer reads)."""
        return prefill_rows_split(self.cfg, self.graphdef, self.state, tokens, with_hidden=with_hidden)

    def mtp_prefill_rows(self, hidden, next_tokens):
        """The MTP layer's rows over a prompt and its first draft: `mtp_prefill_rows`."""
        return mtp_prefill_rows(self.graphdef, self.state, hidden, next_tokens)

    def sample(self, logits: list, seeds, positions, temperatures, top_ps) -> list[int]:
        """One token per row from logits[i] f32[V] (those that do not come from a step: whole-prompt prefills),
        drawn by `sample_rows` (jitted: `sampler`); seeds / positions / temperatures / top_ps [n] in its dtypes."""
        return np.asarray(sampler()(jnp.stack(logits), seeds, positions, temperatures, top_ps)).tolist()

    def admit_prompts(self, store: KVStore, manager, prompts) -> tuple[KVStore, list[int], list]:
        """Prefill each prompt (one causal forward) and admit it with its rows into `manager` (a `PageManager`) and
        `store`: (store, slots, the logits each prompt's first new token is drawn from)."""
        slots, first = [], []
        for p in prompts:
            last, latent, rope, index_k = self.prefill_rows(p)
            store, slot = kv_device.admit_prefilled(store, manager, latent, rope, index_k, len(p))
            slots.append(slot)
            first.append(last)
        return store, slots, first

    def decode(self, store: KVStore, batch: dict):
        """One decode step without sampling (the caller samples): (logits f32[B, V], store, stats), as
        `store_decode_step` but with this runner's parameters split once (no per-call `nnx.split`)."""
        return _jitted_step(self.graphdef, self.kernels)(self.state, store, _commit(store, batch))

    def step(self, spec: StoreSpec, store: KVStore, batch: dict, sampling: dict, n_emit: int, *,
             read_page_stamps: bool = False) -> StepOutput:
        """Decode `batch` through `store` (donated) and sample the emitting rows; one device→host read (with
        `read_page_stamps`, the store's per-page indexer-recency stamps come back in the same read)."""
        tokens, store, stats = self._step(self.state, store, _commit(store, batch), _commit(store, sampling))
        stamps = store.page_stamp if read_page_stamps else None
        tokens, stats, stamps = jax.device_get((tokens, stats, stamps))  # the step's one device→host transfer
        return StepOutput(np.asarray(tokens)[:n_emit].tolist(), store, tiered.stats_bytes(spec, stats), stamps)

    def speculative_step(self, spec: StoreSpec, store: KVStore, batch: dict, sampling: dict, k: int,
                  acceptance: str = "match", *, read_page_stamps: bool = False) -> "SpeculativeStepOutput":
        """One speculative step (`speculative.speculative_step_impl`: verify k + 1 rows per request, accept, draft k)
        through `store` (donated); one device→host read."""
        step = jitted_speculative_step(self.graphdef, self.kernels, int(k), acceptance)
        out = step(self.state, store, _commit(store, batch), _commit(store, sampling))
        target, accepted, drafts, store, stats = out
        stamps = store.page_stamp if read_page_stamps else None
        target, accepted, drafts, stats, stamps = jax.device_get((target, accepted, drafts, stats, stamps))
        return SpeculativeStepOutput(np.asarray(target), np.asarray(accepted), np.asarray(drafts), store,
                              tiered.stats_bytes(spec, stats), stamps)


@dataclasses.dataclass
class SpeculativeStepOutput:
    target: np.ndarray  # int32[G, k + 1]: each verified row's sampled next token
    accepted: np.ndarray  # int32[G]: drafts accepted per request (the request emits target[g, :accepted + 1])
    drafts: np.ndarray  # int32[G, k]: the next step's drafts
    store: KVStore
    stats: dict
    page_stamps: np.ndarray | None = None


# ----- speculative decoding's programs (`engine.speculative`) --------------------------------------------------
@functools.lru_cache(maxsize=32)
def jitted_speculative_step(graphdef, kernels: str, k: int, acceptance: str = "match"):
    """`speculative.speculative_step_impl` jitted (store donated): step(state, store, batch, sampling)."""
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, store, batch, sampling):
        COUNTS["step"] += 1
        TRACE_COUNTS["store_decode_step"] += 1
        return speculative.speculative_step_impl(nnx.merge(graphdef, state), store, batch, sampling, kernels, k,
                                                 acceptance)

    return step


@functools.lru_cache(maxsize=32)
def jitted_mtp_prefill(graphdef):
    @jax.jit
    def prefill(state, hidden, next_ids, n):
        TRACE_COUNTS["prefill"] += 1
        logits, aux = mtp_forward(nnx.merge(graphdef, state), hidden[None], next_ids[None])
        draft = jnp.argmax(logits[0, n - 1]).astype(jnp.int32)
        return aux["latent"][0], aux["rope"][0], aux["index_k"][0], draft

    return prefill


def mtp_prefill_rows(graphdef, state, hidden, next_tokens):
    """The MTP layer over a prompt: hidden [T, D] (the main forward's final hidden, T a bucket), next_tokens
    (the token after each of the n real positions: the prompt shifted by one plus the first sampled token) ->
    (latent [1, T, C], rope [1, T, R], index_k [1, T, dI], the first draft token)."""
    n, T = len(next_tokens), hidden.shape[0]
    ids = np.zeros((T,), np.int32)
    ids[:n] = next_tokens
    lat, rope, idx, draft = jitted_mtp_prefill(graphdef)(state, hidden, jnp.asarray(ids), jnp.int32(n))
    return lat[None], rope[None], idx[None], int(draft)


# ----- data parallelism: one step per rank over a mesh (`hisparse_jax.parallel`) ----------------------------------
def jitted_sharded_step(graphdef, mesh: Mesh, kernels: str = "reference", expert_parallel: bool = False, *,
                        sample: bool = False):
    """`step_impl` per rank as one jitted shard_map over the mesh's axis:
    step(state, store, batch) -> (logits f32[N, B, V], store, stats with a leading [N]); with `sample`, each rank's
    emitting rows sampled as `Runner.step` does on one device: step(state, store, batch, sampling) -> (tokens
    int32[N, B], store, stats), sampling's leaves ("rows", "seed", "pos", "temperature", "top_p") [N, B], rank r's
    rows indexing its own batch.

    state: the model's parameters (`nnx.split`), replicated (`P()`), or with expert_parallel the routed experts
    split over the axis (`parallel.place_params(..., expert_parallel=True)`; each MoE layer then gathers the ranks'
    tokens and scatters the sums back: `model.moe.expert_parallel`); store: the stacked store (donated);
    batch: {"tokens", "req"} int32[N, B] and optionally "index_span" int32[N, P], sharded on the axis — rank r
    decodes rows batch[.][r] against its own slice."""
    return _jitted_sharded(graphdef, mesh, tiered.check_kernels(kernels), expert_parallel, bool(sample))


class MeshRunner:
    """A `Runner`'s model over a one-axis mesh, one data-parallel rank per device (`MeshEngine`'s device side): the
    parameters placed once (replicated, or with expert_parallel the routed experts split over the axis:
    `parallel.place_params`) and one jitted `shard_map` call per step that decodes and samples every rank's batch
    against its own slice of the stacked store, read back in one device→host transfer."""

    def __init__(self, runner: Runner, mesh: Mesh, *, expert_parallel: bool = False):
        self.mesh, self.n = mesh, parallel.num_ranks(mesh)
        self.params = parallel.place_params(runner.state, mesh, expert_parallel=expert_parallel)
        self._step = jitted_sharded_step(runner.graphdef, mesh, runner.kernels, expert_parallel, sample=True)

    def step(self, spec: StoreSpec, store: KVStore, batches: list, samplings: list, n_emits: list, *,
             read_page_stamps: bool = False) -> tuple[KVStore, list]:
        """`Runner.step` for every rank at once. batches[r] / samplings[r] / n_emits[r]: rank r's arguments as
        `Runner.step` takes them (batch {"tokens", "req", "pos", "index_span"}), or batches[r] None: rank r has
        nothing to run. The batches are padded to the largest (idle rows) and every rank's indexer span to the
        longest, for one call; the stacked store is donated. Returns (store, outputs): outputs[r] rank r's
        `StepOutput` (its `store` None: the stacked store is returned once) or None for an idle rank."""
        live = [b for b in batches if b is not None]
        B = max(len(b["tokens"]) for b in live)
        span = max(len(b["index_span"]) for b in live)
        rows = [pad({k: () if b is None else b[k] for k in ("tokens", "req", "pos")}, B) for b in batches]
        draws = [pad(dict.fromkeys(SAMPLING_PAD, ()) if b is None else smp, B, SAMPLING_PAD)
                 for b, smp in zip(batches, samplings)]
        batch, sampling = ({k: np.stack([x[k] for x in xs]) for k in xs[0]} for xs in (rows, draws))
        batch["index_span"] = np.zeros((self.n, span), np.int32)  # (its shape is what the step reads)
        tokens, store, stats = self._step(self.params, store, parallel.put_batch(self.mesh, batch),
                                          parallel.put_batch(self.mesh, sampling))
        stamps = store.page_stamp if read_page_stamps else None
        tokens, stats, stamps = jax.device_get((tokens, stats, stamps))  # the step's one device→host transfer
        outs = [None if b is None else
                StepOutput(np.asarray(tokens[r])[:n_emits[r]].tolist(), None,
                           tiered.stats_bytes(spec, jax.tree.map(lambda x: x[r], stats)),
                           None if stamps is None else np.asarray(stamps[r]))
                for r, b in enumerate(batches)]
        return store, outs


@functools.lru_cache(maxsize=32)
def _jitted_sharded(graphdef, mesh: Mesh, kernels: str, expert_parallel: bool, sample: bool):
    axis = parallel.check_mesh(mesh)
    ep = axis if expert_parallel else None
    one = parallel.squeeze_rank

    def body(state, store, batch, *sampling):
        TRACE_COUNTS["store_decode_step"] += 1
        with parallel.moe_context(ep):
            logits, store, stats = step_impl(nnx.merge(graphdef, state), one(store), one(batch), kernels)
        if sample:
            s = one(sampling[0])
            logits = sample_rows(logits[s["rows"]], s["seed"], s["pos"], s["temperature"], s["top_p"])
        return logits[None], parallel.expand_rank(store), parallel.expand_rank(stats)

    def step(state, store, batch, *sampling):
        specs = (parallel.param_specs(state, ep), P(axis), P(axis)) + (P(axis),) * len(sampling)
        return parallel.shard_map(body, mesh, specs, P(axis))(state, store, batch, *sampling)

    return jax.jit(step, donate_argnums=(1,))
