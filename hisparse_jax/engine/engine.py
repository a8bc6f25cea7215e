"""`Engine`: requests in, tokens out, through the tiered store under a memory policy.

    engine = Engine(model, CacheConfig(...), EngineConfig(policy="hisparse"))
    engine.add_request("a", prompt_ids, SamplingParams(max_new_tokens=64))
    while engine.has_unfinished():
        engine.step()
    engine.outputs()["a"], engine.metrics()

Each `step` is one jitted call of fixed bucketed shape that carries every running request's decode row
and up to `prefill_chunk` prompt rows (chunked prefill through the store). Sampling depends only on
(seed, position), so outputs do not depend on scheduling: the three policies produce the same tokens.

A step is `begin_step` (schedule, each request's own work, the batch: host only), the one batched call, then
`finish_step` (commit: host only) — the schedule / postprocess split that lets `engine.mesh.MeshEngine` run every
rank's batch in one sharded call. Everything that touches the KV store goes through the engine's store seam
(`store_owner`: `OneStore` here, a rank of a stacked store on a mesh).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax.numpy as jnp
import numpy as np

from hisparse_jax.config import CacheConfig
from hisparse_jax.engine import speculative
from hisparse_jax.engine.engine_config import EngineConfig
from hisparse_jax.engine.metrics import step_metrics, summarize
from hisparse_jax.engine.pd import IMPORT_CHUNK, PrefillExport, check_export, load_export
from hisparse_jax.engine.request import Request, RequestState, SamplingParams
from hisparse_jax.engine.runner import SAMPLING_PAD, TRACE_COUNTS, Runner, StepRows, call_on_store, pad
from hisparse_jax.engine.scheduler import Scheduler, pages, policy_cache
from hisparse_jax.kv import device as kv_device, tiered
from hisparse_jax.kv.account import check_store_memory
from hisparse_jax.kv.manager import COLDNESS, PageManager
from hisparse_jax.kv.spec import BudgetError, check_batch_fits
from hisparse_jax.kv.state import StoreSpec
from hisparse_jax.kv.summary import IndexCodebooks
from hisparse_jax.model.decoder import SparseMLAModel
from hisparse_jax.results import EngineMetrics, StepMetrics
from hisparse_jax.validation import check_eos, check_prompt


class UnknownRequest(KeyError):
    """A request id this engine never saw."""

    def __str__(self) -> str:
        return str(self.args[0])


class OneStore:
    """The engine's store seam on one device: owns the `KVStore` and applies the engine's host decisions to it
    (`kv.device`). `engine.mesh` puts a rank of a stacked store behind the same four methods."""

    def __init__(self, manager: PageManager, store=None, index_codebooks=None):
        # the manager's KVStore (device pools + pinned-host pools): a new one (with index_summary="rvq"'s codebooks),
        # or a restored one (`engine.snapshot`)
        self.store = kv_device.new_store(manager, index_codebooks=index_codebooks) if store is None else store

    def apply_updates(self, manager: PageManager) -> None:
        self.store = kv_device.apply_updates(self.store, manager)

    def write_prefill(self, manager: PageManager, slot: int, latent, rope, index_k, length: int, offset: int = 0):
        self.store = kv_device.write_prefill(self.store, manager, slot, latent, rope, index_k, length, offset=offset)

    def check_tables(self, manager: PageManager) -> None:
        kv_device.check_tables(self.store, manager)


@dataclasses.dataclass
class StepWork:
    """One engine step between `Engine.begin_step` (schedule, per-request work, the batch built) and
    `Engine.finish_step` (commit): `batch` / `sampling` / `n_emit` are the batched device call's arguments
    (None: no call this step), `out` its `StepOutput` once run."""

    plan: object
    failed: list
    t0: float
    traces: int
    new_tokens: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0  # of which tokens computed before, dropped by a preemption
    emit: list = dataclasses.field(default_factory=list)
    completed: list = dataclasses.field(default_factory=list)
    batch: dict | None = None
    sampling: dict | None = None
    n_emit: int = 0
    out: object = None
    speculative: bool = False  # this step's decode rows go through `_speculative_step` (one device only)


def check_engine_args(model, cache, config) -> None:
    """The Engine's (and MeshEngine's) arguments by type, and a speculative_tokens given twice in conflict: the
    engine's `EngineConfig.speculative_tokens` is the one that counts (it sets its store's); a CacheConfig that
    says otherwise is refused rather than silently replaced."""
    for name, value, kind in (("model", model, SparseMLAModel), ("cache", cache, CacheConfig),
                              ("config", config, EngineConfig)):
        if not isinstance(value, kind):
            raise TypeError(f"Engine: {name} must be a {kind.__name__}, got {type(value).__name__}")
    if cache.speculative_tokens not in (0, config.speculative_tokens):
        raise ValueError(f"CacheConfig.speculative_tokens={cache.speculative_tokens} conflicts with "
                         f"EngineConfig.speculative_tokens={config.speculative_tokens}: an engine's speculative "
                         f"decoding is set by its EngineConfig (which sets its store's); set "
                         f"EngineConfig(speculative_tokens={cache.speculative_tokens}) or leave the CacheConfig's 0")


class Engine:
    def __init__(self, model: SparseMLAModel, cache: CacheConfig, config: EngineConfig = EngineConfig(), *,
                 store_owner=OneStore, restored=None, index_codebooks: IndexCodebooks | None = None):
        """store_owner(manager) -> the object that holds this engine's KVStore (`OneStore`, or a rank of a
        `MeshEngine`'s stacked store); restored: a saved engine's (PageManager, KVStore) in place of new ones
        (`engine.snapshot.load_engine`); index_codebooks: the store's codebooks with
        CacheConfig(index_summary="rvq") (`index_codebooks.fit_index_codebooks`; a restored store has its own)."""
        check_engine_args(model, cache, config)
        # the device side: the model split once, the kernels ("pallas" needs a GPU backend: refused here, never a
        # silent fallback), one jitted decode-and-sample call per step
        runner = Runner(model, kernels=config.kernels)
        k = config.speculative_tokens
        if k and not len(getattr(model, "mtp", None) or ()):
            raise ValueError(f"speculative_tokens={k} needs the model's MTP layer: build it with "
                             "SparseMLAModel(cfg, mtp=True) or load_pretrained(path, mtp=True)")
        # the store, its bookkeeping and the largest step's temporaries, before any of them exists
        shape = policy_cache(cache, config.policy, config.max_running, k, config.admission)
        check_store_memory(StoreSpec.create(model.cfg, shape), step_rows=config.max_step_rows,
                           index_heads=model.cfg.index_n_heads)
        self.model = model
        if index_codebooks is not None and restored is not None:
            raise ValueError("a restored store keeps the codebooks it was made with: leave index_codebooks None")
        if index_codebooks is not None:
            store_owner = functools.partial(store_owner, index_codebooks=index_codebooks)
        self._build(runner, cache, config, store_owner, restored)

    def _build(self, runner, cache: CacheConfig, config: EngineConfig, store_owner, restored=None) -> None:
        """The engine's parts around `runner` (what runs the model: a `Runner`, or `fake_compute.FakeRunner`):
        the bookkeeping sized by `cache` under the policy, the store seam, the scheduler, the request table."""
        self.runner, self.config, self.k, self.cache = runner, config, config.speculative_tokens, cache
        device_keys = cache.num_index_pages  # the device's key budget (offload under "vllm" grows the pool)
        cache = policy_cache(cache, config.policy, config.max_running, self.k, config.admission)
        self.manager = PageManager(runner.cfg, cache, victim_order=COLDNESS[config.coldness]) if restored is None \
            else restored[0]
        if self.manager.cache != cache:
            raise ValueError("the restored store was not made for this CacheConfig and EngineConfig")
        self.manager.victim_order = COLDNESS[config.coldness]
        tiered.check_backend(self.manager.spec, config.kernels)
        self.manager.partial_eviction = config.policy == "hisparse"
        self.manager.prefix_caching = config.prefix_caching
        self.stores = store_owner(self.manager) if restored is None else OneStore(self.manager, restored[1])
        self.scheduler = Scheduler(self.manager, config.policy, max_running=config.max_running,
                                   prefill_chunk=config.prefill_chunk, prefill=config.prefill,
                                   admission=config.admission, device_keys=device_keys)
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self.history: list[StepMetrics] = []
        self._log = open(config.log_path, "a") if config.log_path else None
        self.store_lost = False
        self.import_bytes = 0  # KV bytes of imported prompts moved to the device (`import_request`)

    @property
    def spec(self) -> StoreSpec:
        """The store's frozen layout (`StoreSpec`)."""
        return self.manager.spec

    @property
    def store(self):
        """The engine's KVStore (one device)."""
        return self.stores.store

    @store.setter
    def store(self, value):
        self.stores.store = value

    # ----- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams = SamplingParams()) -> Request:
        """Queue a request. Refused at the door (`ValueError`, naming what was wrong): a non-string or reused id, a
        prompt that is not a non-empty 1-D sequence of integer token ids in range, params that are not
        `SamplingParams`, a length past max_position_embeddings, or budgets it could never run under
        (`BudgetError`)."""
        return self._add(request_id, prompt, params)

    def _add(self, request_id: str, prompt, params: SamplingParams, imported=None) -> Request:
        cfg = self.runner.cfg
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}")
        prompt = check_prompt(f"request {request_id!r}: prompt", prompt, cfg.vocab_size)
        check_eos(f"request {request_id!r}: eos_token_id", params.eos_token_id, cfg.vocab_size)
        total = len(prompt) + params.max_new_tokens
        if total > cfg.max_position_embeddings:
            raise ValueError(f"request {request_id!r}: {len(prompt)} prompt + {params.max_new_tokens} new tokens "
                             f"exceed max_position_embeddings ({cfg.max_position_embeddings})")
        la = speculative.lookahead(self.k)
        # the last new token is never written; an import's prompt arrives whole, never written through the store
        self._check_ever_fits(request_id, total - 1 + la, len(prompt), chunked=imported is None)
        r = Request(request_id, prompt, params, arrival=self.step_count, lookahead=la, imported=imported)
        self.requests[request_id] = r
        self.scheduler.waiting.append(r)
        return r

    def _check_ever_fits(self, rid: str, kv_len: int, prompt_len: int, chunked: bool = True) -> None:
        """Refuse (BudgetError) a request that could not run even alone: `check_batch_fits` under this policy (all pages
        resident unless HiSparse may release them; indexer pages; host pages when pages are mirrored), and a
        prompt written through the store ("chunked" prefill) must be resident while it is written. An imported
        prompt (`chunked=False`) arrives whole: under HiSparse its older pages land in the host tier, and HiSparse
        never preempts, so it is never written through the store (preempt, which recomputes a readmitted prompt,
        holds every page resident anyway)."""
        c, spec = self.manager, self.manager.budget_spec
        try:
            check_batch_fits(spec, [kv_len], releasable=c.releasable)
        except BudgetError as e:
            raise BudgetError(f"request {rid!r} can never be admitted under {self.config.policy!r}: {e}") from None
        self.scheduler.check_ever_fits(rid, kv_len)
        if chunked and self.config.prefill == "chunked" and pages(prompt_len) > spec.device_pages:
            raise BudgetError(f"request {rid!r} can never be admitted: device_pages is too small: its prompt is "
                              f"written through the store and must be resident meanwhile, {pages(prompt_len)} "
                              f"pages; device_pages is {spec.device_pages}, {pages(prompt_len) - spec.device_pages} "
                              f"short")

    def abort(self, request_id: str) -> None:
        """Finish a request now (its pages are freed); a finished one is left as it is."""
        r = self._request(request_id)
        if not r.finished:
            self.scheduler.finish(r, RequestState.ABORTED)
            r.finished_at = self.step_count

    def _request(self, request_id: str) -> Request:
        try:
            return self.requests[request_id]
        except (KeyError, TypeError):
            known = ", ".join(map(repr, list(self.requests)[:8])) + (" ..." if len(self.requests) > 8 else "")
            raise UnknownRequest(f"no request {request_id!r} in this engine (known: {known or 'none'})") from None

    def has_unfinished(self) -> bool:
        return any(not r.finished for r in self.requests.values())

    def outputs(self) -> dict[str, list[int]]:
        return {rid: list(r.output) for rid, r in self.requests.items()}

    # ----- one step ------------------------------------------------------------------------------
    def step(self) -> StepMetrics:
        """One engine step: schedule, each request's own work, one batched device call, then commit.

        All-or-nothing: a request whose own work raises (its sampling arguments, its whole-prompt prefill) is
        finished with state FAILED and `error` set, its pages freed, and the other requests go on in the same
        step. If the batched call (or the sampling after it) raises, nothing of it is committed: lengths,
        outputs and prompt progress are as before, the exception propagates and `step()` can be called again —
        unless the call consumed the store it was given (donated buffers), after which every step refuses."""
        return self.finish_step(self.call_model(self.begin_step()))

    def call_model(self, w: StepWork) -> StepWork:
        """The step's one batched call on `w.batch` (none: nothing to run), its `StepOutput` into `w.out`."""
        if w.batch is not None:
            w.out = self._device_call(self.runner.step, w.batch, w.sampling, w.n_emit)
        return w

    def begin_step(self) -> StepWork:
        """The host half of a step before its batched call: schedule, each request's own checks, whole-prompt
        prefills (each committed on its own) and the batch of decode rows and prompt chunks (`StepWork.batch`,
        None when there is none). `step()` runs the call and `finish_step`; a `MeshEngine` runs one call for
        all its ranks' batches."""
        if self.store_lost:
            raise RuntimeError("a failed decode step consumed the KV store; this engine cannot continue "
                               "(its requests' outputs so far are in outputs())")
        sched = self.scheduler
        w = StepWork(plan=None, failed=[], t0=time.perf_counter(), traces=TRACE_COUNTS["store_decode_step"])
        plan = w.plan = sched.schedule(self.step_count)
        failed = w.failed
        # 1. each request's own checks: what would only fail inside the batched call fails here, for that request
        for r in plan.decode + plan.whole + [r for r, _, _ in plan.prefill]:
            if not r.finished:
                self._guard(r, failed, self._sampling_row, r)
        plan.decode[:] = [r for r in plan.decode if not r.finished]
        plan.whole[:] = [r for r in plan.whole if not r.finished]
        plan.prefill[:] = [x for x in plan.prefill if not x[0].finished]
        # 2. whole-prompt prefills, one request at a time (each commits on its own)
        emit_logits = []
        for r in list(plan.whole):
            ok, lg = self._guard(r, failed, self._prefill_whole, r)
            if not ok:
                plan.whole.remove(r)
                continue
            w.prefill_tokens += len(r.kv_tokens)
            w.recomputed_tokens += len(r.kv_tokens) if r.preemptions else 0
            r.computed = len(r.kv_tokens)
            r.state = RequestState.RUNNING
            if not r.output:
                emit_logits.append((lg, r))
        if emit_logits:
            rs = [r for _, r in emit_logits]
            w.new_tokens += self._commit_tokens(rs, self._sample([lg for lg, _ in emit_logits], rs))
        if self.k and plan.decode:  # speculative: verify + accept + draft (prompts are prefilled whole)
            w.speculative = True
            return w
        # 3. the batch of one call: every decode row and this step's prompt chunks
        rows = StepRows()
        for r in plan.decode:
            rows.add(r.slot, [r.output[-1]], len(r.prompt) + len(r.output) - 1, emit=self._sampling_row(r))
            w.emit.append(r)
        for r, start, n in plan.prefill:
            w.prefill_tokens += n
            w.recomputed_tokens += n if r.preemptions else 0  # (a victim is always running: its KV was computed)
            last = start + n == len(r.kv_tokens)  # its last chunk is in this batch
            if last:
                w.completed.append(r)
            emit = self._sampling_row(r) if last and not r.output else None
            rows.add(r.slot, r.kv_tokens[start:start + n], start, emit=emit)
            if emit is not None:
                w.emit.append(r)
        if len(rows):
            w.batch, w.sampling, w.n_emit = rows.build(self.manager.spec, self.config.min_bucket)
        return w

    def finish_step(self, w: StepWork) -> StepMetrics:
        """The host half of a step after its batched call (`w.out`): commit lengths, prompt progress and tokens,
        apply the releases decided at commit, record the step's metrics."""
        plan, new_tokens = w.plan, w.new_tokens
        stats, B, scored_pages, drafted, accepted, decode_tokens = {}, 0, 0, 0, 0, 0
        if w.speculative:
            B, scored_pages, stats, decode_tokens, drafted, accepted = self._speculative_step(plan.decode)
            new_tokens += decode_tokens
        elif w.batch is not None:
            B, scored_pages = len(w.batch["tokens"]), len(w.batch["index_span"])
            # 4. commit (host bookkeeping only)
            toks, stats = w.out.tokens, w.out.stats
            for r, start, n in plan.prefill:
                r.computed = start + n
                self.manager.set_length(r.slot, r.computed)
            for r in w.completed:
                self.manager.allow_eviction(r.slot)
                self.manager.register_prefix(r.slot, r.kv_tokens)
                r.state = RequestState.RUNNING
            self.manager.advance([r.slot for r in plan.decode])
            decode_tokens = len(plan.decode)
            new_tokens += self._commit_tokens(w.emit, toks)
        if self.manager.updates:  # releases decided at commit: the store matches the manager between steps
            self.stores.apply_updates(self.manager)
        if self.config.check_invariants:
            self.stores.check_tables(self.manager)
        m = step_metrics(self, w, bucket=B, scored_pages=scored_pages, stats=stats, new_tokens=new_tokens,
                         decode_tokens=decode_tokens, drafted=drafted, accepted=accepted)
        self.history.append(m)
        if self._log:
            self._log.write(json.dumps(m.to_json()) + "\n")
            self._log.flush()
        self.step_count += 1
        return m

    def _device_call(self, fn, *args):
        """The step's one batched call `fn(spec, store, *args, read_page_stamps=...)` (`Runner.step` or
        `Runner.speculative_step`) through `runner.call_on_store`: this step's table decisions applied first, its
        output's store the engine's; if it raises, nothing is committed."""
        def call(store):
            out = fn(self.manager.spec, store, *args, read_page_stamps=self.manager.needs_page_stamps)
            return out.store, out

        return self.observe_output(call_on_store(self, lambda: self.stores.apply_updates(self.manager), call))

    def observe_output(self, out):
        """`out` (a step's `StepOutput`), its page stamps (when read with it) handed to the manager."""
        if out.page_stamps is not None and self.manager.needs_page_stamps:
            self.manager.observe_page_stamps(out.page_stamps)
        return out

    def _speculative_step(self, decode: list[Request]) -> tuple[int, int, dict, int, int, int]:
        """One speculative step for the `decode` requests (`engine.speculative`), committed: each request's length
        becomes n + accepted + 1 and it emits its accepted drafts and the token after them. Returns (batch rows,
        indexer pages scored, stats, new tokens, drafts verified, drafts accepted)."""
        k, spec = self.k, self.manager.spec
        rows = StepRows()
        for r in decode:
            n, drafts = len(r.prompt) + len(r.output) - 1, r.drafts or [-1] * k
            rows.add(r.slot, [r.output[-1]] + [max(d, 0) for d in drafts], n,
                     draft_ok=[1] + [int(d >= 0) for d in drafts])
        # the indexer scores pages up to the longest position the step writes (n + 2k - 1)
        batch, _, _ = rows.build(spec, self.config.min_bucket, group=k + 1, span_to=max(rows.columns["pos"]) + k)
        G = len(batch["tokens"]) // (k + 1)
        seed, _, t, p = zip(*(self._sampling_row(r) for r in decode))
        sampling = pad({"seed": seed, "temperature": t, "top_p": p}, G, SAMPLING_PAD)
        out = self._device_call(self.runner.speculative_step, batch, sampling, k, self.config.speculative_acceptance)
        new = drafted = accepted = 0
        for g, r in enumerate(decode):
            a = int(out.accepted[g])
            offered = int(batch["draft_ok"][g * (k + 1) + 1:(g + 1) * (k + 1)].sum())
            r.drafted, r.accepted = r.drafted + offered, r.accepted + a
            drafted, accepted = drafted + offered, accepted + a
            self.manager.set_length(r.slot, len(r.prompt) + len(r.output) + a)
            r.drafts = out.drafts[g].tolist()
            for tok in out.target[g, :a + 1].tolist():  # stops early at eos / max_new_tokens
                if r.finished:
                    break
                new += self._commit_tokens([r], [tok])
        return G * (k + 1), len(batch["index_span"]), out.stats, new, drafted, accepted

    def _guard(self, r: Request, failed: list[Request], fn, *args) -> tuple[bool, object]:
        """(True, fn(*args)); if it raises, `r` is finished FAILED with the error kept and (False, None)."""
        try:
            return True, fn(*args)
        except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
            self.scheduler.finish(r, RequestState.FAILED)
            r.error = f"{type(e).__name__}: {e}"
            r.finished_at = self.step_count
            failed.append(r)
            return False, None

    @staticmethod
    def _sampling_row(r: Request) -> tuple:
        """(seed, position, temperature, top_p) of r's next token, in the sampler's dtypes (raises if one does not
        fit, e.g. a seed outside uint32)."""
        p = r.params
        return (np.uint32(p.seed), np.int32(len(r.prompt) + len(r.output)), np.float32(p.temperature),
                np.float32(p.top_p))

    def _sample(self, logits: list, rs: list[Request]) -> list[int]:
        """One token per request from its logits [V] (checked by `_sampling_row` earlier in the step)."""
        seeds, pos, temps, top_ps = (np.asarray(c) for c in zip(*(self._sampling_row(r) for r in rs)))
        return self.runner.sample(logits, seeds, pos, temps, top_ps)

    def _commit_tokens(self, rs: list[Request], toks: list[int]) -> int:
        """Append each request's new token; finish those that are done."""
        for r, tok in zip(rs, toks):
            r.output.append(int(tok))
            if r.first_token_step is None:
                r.first_token_step = self.step_count
            if r.done_generating():
                self.scheduler.finish(r, RequestState.FINISHED)
                r.finished_at = self.step_count
        return len(rs)

    def _prefill_whole(self, r: Request):
        """One full causal forward over r's KV tokens, written into its pages; returns the last logits [V]. An
        imported request's rows come from its export instead, a bounded chunk at a time."""
        toks = r.kv_tokens
        if r.imported is not None:
            return self._write_import(r)
        if not self.k:
            last, latent, rope, index_k = self.runner.prefill_rows(toks)
        else:  # and the MTP layer's rows: it reads each position's hidden state and the token after it
            last, latent, rope, index_k, hidden = self.runner.prefill_rows(toks, with_hidden=True)
            nxt = r.output[-1] if r.output else self._sample([last], [r])[0]  # (seed, position): same draw later
            mtp = self.runner.mtp_prefill_rows(hidden, list(toks[1:]) + [nxt])
            latent, rope, index_k = (jnp.concatenate([a, b.astype(a.dtype)]) for a, b in
                                     zip((latent, rope, index_k), mtp[:3]))
            r.drafts = [mtp[3]] + [-1] * (self.k - 1)
        self.stores.write_prefill(self.manager, r.slot, latent, rope, index_k, len(toks))
        self.manager.register_prefix(r.slot, toks)
        return last

    def _write_import(self, r: Request):
        ex, T, ch = r.imported, len(r.kv_tokens), IMPORT_CHUNK
        m = self.manager.spec.mtp_layers  # an export carries no MTP rows: zeros (they only shape the drafts)
        r.drafts = [-1] * self.k
        for off in range(0, T, ch):
            rows = [np.asarray(a[:, off:off + ch]) for a in (ex.latent, ex.rope, ex.index_k)]
            rows = [np.pad(a, ((0, m), (0, ch - a.shape[1]), (0, 0))) for a in rows]  # one staging shape
            self.stores.write_prefill(self.manager, r.slot, *map(jnp.asarray, rows), T, offset=off)
        self.manager.register_prefix(r.slot, r.kv_tokens)
        self.import_bytes += ex.nbytes
        r.imported = None  # written: a later readmission (after a preemption) computes its tokens as usual
        return jnp.asarray(ex.last_logits)

    def import_request(self, request_id: str, export, params: SamplingParams = SamplingParams()) -> Request:
        """Queue a request whose prompt was prefilled elsewhere: `export` is a `pd.PrefillExport` or the path of
        one (`pd.export_prefill` writes it). Its prompt's rows are written from the export at admission instead
        of computed; everything else (budgets, sampling, policies) is as `add_request`. Refused like
        `add_request`, and with `CheckpointError` for a damaged or mismatched export."""
        if isinstance(export, PrefillExport):
            check_export(export, self.runner.cfg)
        elif not isinstance(export, (str, os.PathLike)):
            raise ValueError(f"request {request_id!r}: export must be a pd.PrefillExport or the path of one, got "
                             f"{type(export).__name__}")
        else:  # load_export applies the same check
            export = load_export(export, self.runner.cfg)
        return self._add(request_id, list(export.tokens), params, imported=export)

    def run(self, progress=None) -> None:
        """Step until every request has finished. `progress(engine)` is called after each step."""
        run_steps(self, progress)

    def stall_report(self, m: StepMetrics) -> str:
        """Why step `m` moved nothing: what is admitted and waiting, and on what (`run_steps`' error)."""
        w = self.scheduler.waiting
        return (f"{len(self.scheduler.active)} admitted, {len(w)} waiting (first: {w[0].request_id if w else None}); "
                f"waiting for {m.wait_reasons}; pool {self.manager.pool.stats()}")

    def generate(self, prompts: list[list[int]], params: SamplingParams = SamplingParams()) -> list[list[int]]:
        """Add `prompts`, run to completion, return their outputs in order."""
        return run_prompts(self, prompts, params)

    # ----- metrics -------------------------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        """Totals and per-step series (`history`: `StepMetrics`) for the run so far; `.to_json()` for JSON."""
        c = self.manager
        return summarize(self.history, list(self.requests.values()), policy=self.config.policy,
                         admission=self.config.admission, speculative_tokens=self.k, extra_h2d_bytes=c.h2d_bytes,
                         extra_d2h_bytes=c.d2h_bytes,
                         evicted_pages=c.evicted_pages, import_bytes=self.import_bytes)

    def close(self) -> None:
        if self._log:
            self._log.close()
            self._log = None


def run_steps(engine, progress=None) -> None:
    """`run` of an `Engine` or `MeshEngine`: step until every request has finished, `progress(engine)` after each
    step. A step in which nothing moved (no token, prompt chunk, swap, preemption or failure) would repeat forever:
    it raises RuntimeError with the engine's `stall_report`."""
    while engine.has_unfinished():
        m = engine.step()
        if not (m.running or m.prefill_tokens or m.swaps_in or m.preemptions or m.swaps_out or m.failed):
            raise RuntimeError(f"no progress at step {m.step}: {engine.stall_report(m)}")
        if progress:
            progress(engine)


def run_prompts(engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """`generate` of an `Engine` or `MeshEngine`: add `prompts` as "gen-<n>", run to completion, return their
    outputs in order."""
    base = len(engine.requests)
    ids = [f"gen-{base + i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    engine.run()
    reqs = engine.requests
    return [reqs[rid].output for rid in ids]
