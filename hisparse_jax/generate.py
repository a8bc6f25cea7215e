"""Batched generation: a prefill forward, then a jitted decode step with fixed shapes, per step.

The host loop lives here, one for every path (`_Run.loop`: sample, collect, check eos; the contiguous, tiered and mesh
paths differ in their setup and their step); every jitted program it runs is the runner's
(`hisparse_jax.engine.runner`). Tokens are sampled by the engine's rule, keyed on (seed, position). Shapes are
bucketed (batch to a power of two, prompt length to a power of two >= 16, KV length to a multiple of 64) so a
decode loop compiles once, whatever the step: every trace of a program increments `runner.TRACE_COUNTS`, which the
tests use to prove there is no recompilation per step. The contiguous step updates its donated KV arrays in place
(one row per layer and sequence): its cost per token follows the work, not copies of the arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax import parallel
from hisparse_jax.config import CacheConfig
from hisparse_jax.engine.runner import (Runner, bucket_pow2, check_prefill_memory, jitted_dense_decode,
                                        jitted_prefill, jitted_sharded_step, pad, sampler)
from hisparse_jax.engine.sampling import prompt_seeds
from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv.account import check_store_memory
from hisparse_jax.kv.dense import DenseKV, init_dense_kv
from hisparse_jax.kv.manager import PageManager
from hisparse_jax.kv.spec import check_batch_fits
from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.kv.tiered import check_backend, check_kernels, empty_stats, index_span, stats_bytes
from hisparse_jax.model.decoder import SparseMLAModel
from hisparse_jax.results import GenerateStats
from hisparse_jax.validation import check_eos, check_float, check_int, check_prompt, check_token_list


def validate_prompts(model: SparseMLAModel, prompts, max_new_tokens: int) -> list[list[int]]:
    """prompts: a non-empty list of 1-D token-id sequences (lists, tuples or arrays of integers in range) ->
    lists of ints. Refuses (ValueError naming the prompt) anything else; nothing is coerced."""
    cfg = model.cfg
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, lo=1)
    out = []
    for i, p in enumerate(prompts):
        p = check_prompt(f"prompt {i}", p, cfg.vocab_size)
        if len(p) + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it exceeds the "
                             f"model's max_position_embeddings ({cfg.max_position_embeddings})")
        out.append(p)
    return out


def generate(model: SparseMLAModel, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, key: jax.Array | None = None, eos_token_id: int | Sequence[int] | None = None,
             cache: CacheConfig | None = None, return_stats: bool = False, return_logits: bool = False,
             kernels: str = "reference", mesh: jax.sharding.Mesh | None = None, index_codebooks=None):
    """Generate `max_new_tokens` tokens for each prompt; returns the new tokens (list per prompt).

    Greedy by default. temperature > 0 samples (optionally with nucleus `top_p`) and needs an explicit
    PRNG `key`. With `eos_token_id`, a sequence's output stops after its first EOS (decoding of the batch
    stops once every sequence has finished).

    Sampling is the engine's rule (`sampling.sample_rows`): a token's draw depends only on its prompt's seed and its
    position (the first new token is at position len(prompt)) besides its logits. `key` gives prompt i the seed
    `sampling.prompt_seeds(key, n)[i]`, a uint32 drawn from `fold_in(key, i)`: prompt i's tokens are those an
    `Engine` gives the same prompt with `SamplingParams(seed=that seed, temperature=, top_p=)`, they do not depend
    on the other prompts of the call, and every path (contiguous, tiered, mesh) draws them with the same keys.

    cache: None decodes from contiguous all-resident KV arrays; a `CacheConfig` decodes through the tiered
    paged store (device + pinned host pools, hot buffers) under its budgets. With `return_stats=True`
    (tiered only) the result is `(tokens, stats)`, stats a `results.GenerateStats` of totals over the run: hits,
    misses, resident (rows read per path), h2d_bytes, h2d_transfer_bytes, d2h_bytes, evicted_pages, steps
    (attributes: `stats.hits`; `stats.to_json()` for JSON).
    With `return_logits=True` the logits come last: `(tokens, [stats,] logits)`, logits[i] float32
    [len(tokens[i]), V] — the distribution each new token was drawn from.

    kernels (tiered only): "reference" (jnp), "pallas" (the Pallas GPU kernels for the indexer top-k, the fused
    resolver and the sparse MLA decode), "pallas_mosaic" (the same with the sparse MLA decode and the indexer's
    scores on the Mosaic GPU backend; jax >= 0.11), or either interpreted ("pallas_interpret",
    "pallas_mosaic_interpret"; e.g. on a CPU). The Mosaic kernels need bf16 or fp8 KV, a latent width that is a
    multiple of 256, a rope width that is a multiple of 64 and an indexer head dim that is a multiple of 32.

    mesh (tiered only): attention data parallelism over a one-axis `jax.sharding.Mesh` (`parallel.data_mesh(n)`).
    Prompt i is served by rank i % n (round-robin); each rank has its own tiered store slice on its device and
    its own bookkeeping, so the CacheConfig's budgets (pages, max_seqs) are per device. Prompts are prefilled on
    the default device and their rows written into their rank's slice; every decode step is one sharded step
    (`runner.jitted_sharded_step`) in which each device decodes its own requests. Tokens come back in prompt order and
    are those of the one-device run (sampled ones included: a prompt's seed does not depend on its rank);
    stats are summed over ranks. Multi-process (`jax.distributed.initialize`): the mesh may span every process's
    devices; every process calls `generate` with the same arguments and returns all the tokens.

    index_codebooks (tiered, one device): the store's codebooks with CacheConfig(index_summary="rvq")
    (`index_codebooks.fit_index_codebooks`).
    """
    if not isinstance(model, SparseMLAModel):
        raise TypeError(f"generate: model must be a SparseMLAModel, got {type(model).__name__}")
    if cache is not None and not isinstance(cache, CacheConfig):
        raise TypeError(f"generate: cache must be a CacheConfig or None (contiguous KV), got {type(cache).__name__}")
    prompts = validate_prompts(model, prompts, max_new_tokens)
    temperature, top_p = check_float("temperature", temperature), check_float("top_p", top_p)
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1 (got {temperature}, {top_p})")
    if temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs an explicit PRNG key: key=jax.random.key(seed)")
    eos = set(check_token_list("eos_token_id", eos_token_id))
    check_eos("eos_token_id", eos, model.cfg.vocab_size)
    n = len(prompts)
    B = bucket_pow2(n)  # every path's batch bucket (its rows past n: padding, their tokens dropped)
    seeds = prompt_seeds(key, n) if temperature > 0 else [0] * n
    sampling = {"seed": jnp.asarray(np.array(seeds + [0] * (B - n), np.uint32)),
                "temperature": jnp.full((B,), temperature, jnp.float32), "top_p": jnp.full((B,), top_p, jnp.float32)}
    lens = np.array([len(p) for p in prompts] + [1] * (B - n), np.int32)
    run = _Run(lens, sampling, n, max_new_tokens, eos, return_logits)
    if mesh is not None:
        if cache is None:
            raise ValueError("mesh needs the tiered store: pass cache=CacheConfig(...) (its budgets are per device)")
        if cache.index_summary == "rvq":
            raise ValueError("index_summary='rvq' runs on one device: a mesh's stores are not given codebooks")
        return _generate_mesh(model, prompts, cache, check_kernels(kernels), mesh, run, return_stats)
    if cache is not None:
        return _generate_tiered(model, prompts, cache, check_kernels(kernels), run, return_stats, index_codebooks)
    if return_stats or kernels != "reference":
        raise ValueError("return_stats and kernels need the tiered store: pass cache=CacheConfig(...)")
    cfg = model.cfg
    T = bucket_pow2(int(lens.max()), 16)
    S = -(-(int(lens.max()) + max_new_tokens) // 64) * 64
    ids = np.zeros((B, T), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(ids)
    check_prefill_memory(cfg, graphdef, state, ids)
    logits_all, aux = jitted_prefill(graphdef)(state, ids)
    first_logits = logits_all[jnp.arange(B), jnp.asarray(lens - 1)].astype(jnp.float32)
    kv = _kv_from_prefill(cfg, aux, B, S, T, model.dtype)
    step = jitted_dense_decode(graphdef, DenseKV(topk=cfg.index_topk, index_dtype=model.index_dtype))

    def decode(tokens, pos):  # decode and sample in one call
        nonlocal kv
        tokens, logits, kv = step(state, tokens, pos - 1, kv, sampling)
        return tokens, logits

    out_tokens, out_logits = run.loop(first_logits, decode)
    return _results(out_tokens, out_logits, run, False, None, None, [])


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every `generate` path's host loop needs: the prompt lengths (int32[B], B the batch bucket), the rows'
    sampling arrays ({"seed", "temperature", "top_p"}, [B] each, on the device), n real prompts, the new tokens
    asked for, the eos ids, whether the logits are returned."""

    lens: np.ndarray
    sampling: dict
    n: int
    max_new_tokens: int
    eos: set
    return_logits: bool

    def sample(self, logits, pos):
        """The rows' tokens drawn from logits [B, V] at positions `pos` (`sample_rows`, jitted: `runner.sampler`)."""
        return sampler()(logits, self.sampling["seed"], pos, self.sampling["temperature"], self.sampling["top_p"])

    def loop(self, first_logits, step):
        """The host loop. The first new token is drawn from `first_logits` [B, V] at position `lens`; then
        `step(tokens, pos) -> (tokens, logits)` (the path's) decodes the previous tokens (at pos - 1) and samples the
        next ones at `pos`, once per further token. Tokens stay on the device; with eos ids, every 16 steps the host
        checks whether every sequence has finished. -> (the tokens of each step, int32[B], and the logits they were
        drawn from, f32[B, V], when return_logits)."""
        pos = jnp.asarray(self.lens)
        tokens = self.sample(first_logits, pos)
        out_tokens, out_logits = [tokens], [first_logits] if self.return_logits else []
        for t in range(1, self.max_new_tokens):
            pos = pos + 1
            tokens, logits = step(tokens, pos)
            out_tokens.append(tokens)
            if self.return_logits:
                out_logits.append(logits)
            if self.eos and t % 16 == 0 and _all_finished(out_tokens, self.n, self.eos):
                break
        return out_tokens, out_logits


def _truncate_at_eos(toks: np.ndarray, eos) -> list[list[int]]:
    result = []
    for row in toks.tolist():
        for j, tok in enumerate(row):
            if tok in eos:
                row = row[:j + 1]
                break
        result.append(row)
    return result


def _generate_tiered(model, prompts, cache, kernels, run, return_stats, index_codebooks=None):
    cfg = model.cfg
    runner = Runner(model, kernels=kernels)  # the model split once for the whole run
    n, max_new_tokens = len(prompts), run.max_new_tokens
    check_store_memory(StoreSpec.create(cfg, cache), step_rows=bucket_pow2(n),  # before any of it exists
                       index_heads=cfg.index_n_heads)
    manager = PageManager(cfg, cache)
    check_backend(manager.spec, kernels)
    # the last new token is sampled, never written: the store holds prompt + max_new_tokens - 1 positions
    check_batch_fits(manager.budget_spec, [len(p) + max_new_tokens - 1 for p in prompts], releasable=manager.releasable)
    store = kv_device.new_store(manager, index_codebooks=index_codebooks)
    store, slots, first = runner.admit_prompts(store, manager, prompts)
    B = bucket_pow2(n)
    req = jnp.asarray(pad({"req": slots}, B)["req"])  # idle rows past the n prompts
    totals = None

    def decode(tokens, pos):
        nonlocal store, totals
        store = kv_device.reserve_next(store, manager, slots)
        span = index_span(manager.spec, max(manager.lengths[s] for s in slots) + 1)  # the indexer's work: this context
        logits, store, stats = runner.decode(store, {"tokens": tokens, "req": req, "index_span": span})
        manager.advance(slots)
        totals = stats if totals is None else jax.tree_util.tree_map(jnp.add, totals, stats)
        return run.sample(logits, pos), logits

    out_tokens, out_logits = run.loop(jnp.stack(first + [first[0]] * (B - n)), decode)
    out = _results(out_tokens, out_logits, run, return_stats, manager.spec, totals, [manager])
    for s in slots:
        manager.release(s)
    return out


def _generate_mesh(model, prompts, cache, kernels, mesh, run, return_stats):
    """`_generate_tiered` with one store slice and one `PageManager` per data-parallel rank (`parallel`)."""
    parallel.check_mesh(mesh)
    cfg = model.cfg
    N, n, max_new_tokens = parallel.num_ranks(mesh), len(prompts), run.max_new_tokens
    runner = Runner(model, kernels=kernels)
    placed = parallel.place_round_robin(n, N)  # placed[r]: the prompts rank r serves
    Bl = bucket_pow2(max(len(idx) for idx in placed))  # each rank's step rows
    # every device's store, step and model copy, checked before any rank's bookkeeping or store exists
    check_store_memory(StoreSpec.create(cfg, cache), step_rows=Bl, index_heads=cfg.index_n_heads, ranks=N,
                       also=(parallel.replica_cost(runner.state, mesh),))
    managers = [PageManager(cfg, cache) for _ in range(N)]
    spec = managers[0].spec
    check_backend(spec, kernels)
    for c, idx in zip(managers, placed):  # the last new token is sampled, never written
        if idx:
            check_batch_fits(c.budget_spec, [len(prompts[i]) + max_new_tokens - 1 for i in idx],
                             releasable=c.releasable)
    store = parallel.new_stacked_store(managers, mesh)
    slots = [[] for _ in range(N)]
    first = [None] * n
    for k in range(max(len(idx) for idx in placed)):  # round k: every rank's k-th prompt, written in one call
        rows = {}
        for r, idx in enumerate(placed):
            if k < len(idx):
                last, latent, rope, index_k = runner.prefill_rows(prompts[idx[k]])
                first[idx[k]] = last
                rows[r] = (latent, rope, index_k, len(prompts[idx[k]]))
        store, got = parallel.admit_prefilled_ranks(store, managers, rows)
        for r, s in got.items():
            slots[r].append(s)
    B = bucket_pow2(n)
    req = np.stack([pad({"req": ss}, Bl)["req"] for ss in slots])  # each rank's slots, then idle rows
    where = np.zeros(n, np.int64)  # prompt i's row in the flattened [N * Bl] step batch
    for r, idx in enumerate(placed):
        for k, i in enumerate(idx):
            where[i] = r * Bl + k
    step = jitted_sharded_step(runner.graphdef, mesh, kernels)
    state = parallel.replicate(runner.state, mesh)
    totals = None

    def decode(tokens, pos):
        nonlocal store, totals
        store = parallel.reserve_next_ranks(store, managers, slots)
        longest = max(c.lengths[s] for c, ss in zip(managers, slots) for s in ss) + 1
        span = index_span(spec, longest)
        tok = np.zeros(N * Bl, np.int32)
        tok[where] = np.asarray(tokens)[:n]
        batch = parallel.put_batch(mesh, {"tokens": tok.reshape(N, Bl), "req": req,
                                          "index_span": np.broadcast_to(span, (N,) + span.shape)})
        logits, store, stats = step(state, store, batch)
        for c, ss in zip(managers, slots):
            c.advance(ss)
        totals = stats if totals is None else jax.tree_util.tree_map(jnp.add, totals, stats)
        # prompt order, on the host (across processes: every rank's logits gathered to every process)
        lg = parallel.to_host(logits).reshape(N * Bl, -1)[where]
        logits = jnp.asarray(np.concatenate([lg, np.repeat(lg[:1], B - n, axis=0)]))
        return run.sample(logits, pos), logits

    out_tokens, out_logits = run.loop(jnp.stack(first + [first[0]] * (B - n)), decode)
    if totals is not None:
        totals = {k: parallel.to_host(v).sum(axis=0) for k, v in totals.items()}  # summed over ranks
    out = _results(out_tokens, out_logits, run, return_stats, spec, totals, managers)
    for c, ss in zip(managers, slots):
        for s in ss:
            c.release(s)
    return out


def _results(out_tokens, out_logits, run: _Run, return_stats, spec, totals, managers):
    """What `generate` returns: the tokens (cut at eos), then (tiered) the run's `GenerateStats` (the steps'
    `totals` plus the managers' page loads and prompt writes) and the logits, when asked for."""
    n, return_logits = run.n, run.return_logits
    result = _truncate_at_eos(np.asarray(jnp.stack(out_tokens, axis=1))[:n], run.eos)
    out = [result]
    if return_stats:
        totals = totals if totals is not None else empty_stats(spec)
        summary = stats_bytes(spec, totals)
        summary.update(per_layer={k: np.asarray(totals[k]).tolist() for k in ("resident", "hits", "misses")},
                       evicted_pages=sum(c.evicted_pages for c in managers), steps=len(out_tokens) - 1,
                       d2h_bytes=summary["d2h_bytes"] + sum(c.d2h_bytes for c in managers),
                       h2d_bytes=summary["h2d_bytes"] + sum(c.h2d_bytes for c in managers))
        out.append(GenerateStats(**summary))
    if return_logits:
        lg = np.asarray(jnp.stack(out_logits, axis=1))
        out.append([lg[i, :len(result[i])] for i in range(n)])
    return out[0] if len(out) == 1 else tuple(out)


def _all_finished(out_tokens, n, eos) -> bool:
    toks = np.asarray(jnp.stack(out_tokens, axis=1))[:n]
    return all(any(t in eos for t in row) for row in toks.tolist())


def _kv_from_prefill(cfg, aux, B, S, T, dtype):
    kv = init_dense_kv(cfg, B, S, dtype)
    t = min(T, S)
    return {
        "latent": kv["latent"].at[:, :, :t].set(jnp.stack(aux["latent"])[:, :, :t].astype(dtype)),
        "rope": kv["rope"].at[:, :, :t].set(jnp.stack(aux["rope"])[:, :, :t].astype(dtype)),
        "index_k": kv["index_k"].at[:, :, :t].set(jnp.stack(aux["index_k"])[:, :, :t].astype(dtype)),
    }
