"""`MeshEngine`: the engine over a device mesh, attention data-parallel — each rank serves its own requests.

    mesh = parallel.data_mesh(4)                              # 4 devices, axis "data"
    engine = MeshEngine(model, CacheConfig(...), EngineConfig(policy="hisparse"), mesh=mesh)
    engine.add_request("a", prompt_ids, SamplingParams(max_new_tokens=64))   # placed on a rank
    engine.run()
    engine.outputs()["a"], engine.rank_of("a"), engine.metrics().ranks[r]

One rank = one `Engine` (its own `PageManager`, `Scheduler` and policy, the `CacheConfig`'s budgets per device)
whose store is its slice of one stacked store (`hisparse_jax.parallel`: every leaf [N, ...] on
`NamedSharding(mesh, P("data"))`, host pools pinned_host). A mesh step runs every rank's host half
(`Engine.begin_step`: schedule, whole-prompt prefills, the batch), applies every rank's table updates, then one
jitted `shard_map` call (`runner.MeshRunner`, the device side) decodes and samples all ranks' batches (padded to
one bucket), each device against its own slice — no KV crosses devices — and every rank commits
(`Engine.finish_step`).

Placement ("balanced", the default): a new request goes to the rank already holding (prefix caching) the most
of its prompt's pages, then to the rank with the fewest unfinished requests, then the fewest outstanding KV tokens, then
the lowest rank; "round_robin": request i on rank i % N. Sampling depends only on (seed, position), so outputs do
not depend on the placement or the number of ranks. Not carried yet: speculative decoding (`speculative_tokens`
> 0 is refused) and multi-process meshes (`generate(..., mesh=)` runs across processes).
"""

from __future__ import annotations

import dataclasses
import json
import time
import weakref

import jax
from flax import nnx

from hisparse_jax import parallel
from hisparse_jax.config import CacheConfig
from hisparse_jax.engine.engine import Engine, UnknownRequest, check_engine_args, run_prompts, run_steps
from hisparse_jax.engine.engine_config import EngineConfig
from hisparse_jax.engine.metrics import combine_steps, summarize
from hisparse_jax.engine.request import Request, SamplingParams
from hisparse_jax.engine.runner import TRACE_COUNTS, MeshRunner, call_on_store
from hisparse_jax.engine.scheduler import policy_cache
from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv.account import check_store_memory
from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.model.decoder import SparseMLAModel
from hisparse_jax.results import EngineMetrics, StepMetrics


class RankStore:
    """A rank engine's store seam (`Engine(store_owner=)`): its store is slice `rank` of the `MeshEngine`'s
    stacked store. Table updates are applied by the mesh for every rank at once; prompt rows are written through
    the mesh."""

    def __init__(self, mesh_engine: "MeshEngine", rank: int):
        # a weak reference: the mesh owns its ranks, and a closed mesh's stacked store is freed as soon as the
        # caller drops it (no cycle left for the garbage collector while the next engine allocates its own)
        self._mesh, self.rank = weakref.proxy(mesh_engine), rank

    @property
    def store(self):
        raise RuntimeError(f"rank {self.rank}'s store is a slice of the MeshEngine's stacked store "
                           "(MeshEngine.store; parallel.rank_store reads one): step the MeshEngine, not a rank")

    @store.setter
    def store(self, value):
        raise RuntimeError(f"rank {self.rank}'s store is a slice of the MeshEngine's stacked store")

    def apply_updates(self, manager) -> None:
        pass  # pending in `manager`: the MeshEngine applies every rank's updates in one pass (`flush`)

    def write_prefill(self, manager, slot: int, latent, rope, index_k, length: int, offset: int = 0) -> None:
        self._mesh.write_prefill(self.rank, slot, latent, rope, index_k, length, offset)

    def check_tables(self, manager) -> None:
        self._mesh.check_tables(self.rank)


class MeshEngine:
    """`Engine`'s interface (add_request, import_request, abort, step, run, generate, outputs, metrics, close)
    over a one-axis mesh (`parallel.data_mesh(n)`), one rank per device; see the module docstring.

    config.max_running and `cache`'s budgets are per rank; `config.placement` chooses the rank of each new
    request. metrics(): totals over ranks (running requests, tokens, hits, ... summed step by step) and `ranks`,
    each rank's own `EngineMetrics`; config.log_path gets one JSON line per mesh step (the totals, and each
    rank's step under "ranks")."""

    def __init__(self, model: SparseMLAModel, cache: CacheConfig, config: EngineConfig = EngineConfig(), *,
                 mesh: jax.sharding.Mesh):
        parallel.check_mesh(mesh)
        if not parallel.is_local(mesh):
            raise ValueError("MeshEngine runs in one process (every device of the mesh addressable); across "
                             "processes use generate(..., mesh=)")
        if config.speculative_tokens:
            raise ValueError(f"speculative_tokens={config.speculative_tokens}: MeshEngine does not carry speculative "
                             "decoding yet (use Engine on one device)")
        if isinstance(cache, CacheConfig) and cache.index_summary == "rvq":
            raise ValueError("index_summary='rvq': MeshEngine does not give its stores codebooks yet (use Engine on "
                             "one device)")
        check_engine_args(model, cache, config)
        self.model, self.config, self.mesh = model, config, mesh
        self.n = parallel.num_ranks(mesh)
        # every device's store, step and model copy, checked before any rank's bookkeeping or store exists
        shape = policy_cache(cache, config.policy, config.max_running, admission=config.admission)
        check_store_memory(StoreSpec.create(model.cfg, shape),
                           step_rows=config.max_step_rows, index_heads=model.cfg.index_n_heads, ranks=self.n,
                           also=(parallel.replica_cost(nnx.state(model), mesh,
                                                       expert_parallel=config.expert_parallel),))
        rank_config = dataclasses.replace(config, log_path=None)  # the mesh logs one line per step, ranks inside
        self.engines = [Engine(model, cache, rank_config, store_owner=lambda c, r=r: RankStore(self, r))
                        for r in range(self.n)]
        self.managers = [e.manager for e in self.engines]
        self.spec = self.managers[0].spec
        self.store = parallel.new_stacked_store(self.managers, mesh)
        if config.expert_parallel:
            parallel.check_expert_parallel(model.cfg, mesh)
        self.runner = MeshRunner(self.engines[0].runner, mesh, expert_parallel=config.expert_parallel)
        self._placed = 0  # requests the mesh has placed (round-robin's counter)
        self.history: list[StepMetrics] = []
        self.store_lost = False
        self._log = open(config.log_path, "a") if config.log_path else None

    @property
    def step_count(self) -> int:
        """Mesh steps so far (every rank's own `step_count`; setting it moves every rank's clock, e.g. to idle
        until a later arrival)."""
        return self.engines[0].step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        for e in self.engines:
            e.step_count = value

    # ----- requests ------------------------------------------------------------------------------
    def place(self, prompt) -> int:
        """The rank a request with `prompt` would be placed on now (`config.placement`)."""
        if self.config.placement == "round_robin":
            return self._placed % self.n

        def key(r):
            e = self.engines[r]
            unfinished = [q for q in e.requests.values() if not q.finished]
            cached = len(e.manager.match_prefix(prompt)) if e.config.prefix_caching else 0
            outstanding = sum(len(q.prompt) + q.params.max_new_tokens for q in unfinished)
            return (-cached, len(unfinished), outstanding, r)

        return min(range(self.n), key=key)

    def add_request(self, request_id: str, prompt, params: SamplingParams = SamplingParams()) -> Request:
        """`Engine.add_request` on the rank `place` picks (the same checks; ids are unique across ranks)."""
        return self._add(request_id, prompt, lambda e: e.add_request(request_id, prompt, params))

    def import_request(self, request_id: str, export, params: SamplingParams = SamplingParams()) -> Request:
        """`Engine.import_request` on the rank `place` picks for the export's prompt."""
        from hisparse_jax.engine.pd import PrefillExport, load_export

        if not isinstance(export, PrefillExport):
            export = load_export(export, self.model.cfg)
        return self._add(request_id, list(export.tokens), lambda e: e.import_request(request_id, export, params))

    def _add(self, request_id, prompt, add) -> Request:
        if isinstance(request_id, str) and any(request_id in e.requests for e in self.engines):
            raise ValueError(f"request id {request_id!r} is already in use")
        try:
            r = self.place(prompt)
        except Exception:  # a prompt the rank engine will refuse with its own message
            r = 0
        req = add(self.engines[r])
        self._placed += 1
        return req

    def rank_of(self, request_id: str) -> int:
        """The rank holding `request_id`: placed by the mesh, or added to `engines[r]` directly (a placement of
        one's own; the mesh steps, reports and aborts it like the others)."""
        for r, e in enumerate(self.engines):
            if isinstance(request_id, str) and request_id in e.requests:
                return r
        raise UnknownRequest(f"no request {request_id!r} in this engine")

    @property
    def requests(self) -> dict[str, Request]:
        """Every rank's requests (ids are unique across ranks: `add_request` refuses one in use on any rank)."""
        return {rid: q for e in self.engines for rid, q in e.requests.items()}

    def abort(self, request_id: str) -> None:
        self.engines[self.rank_of(request_id)].abort(request_id)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    def outputs(self) -> dict[str, list[int]]:
        return {rid: list(q.output) for rid, q in self.requests.items()}

    # ----- the store, through the ranks' seams ------------------------------------------------------
    def flush(self) -> None:
        """Apply every rank's pending table updates to its slice."""
        if any(c.updates for c in self.managers):
            self.store = parallel.apply_rank_updates(self.store, self.managers)

    def write_prefill(self, rank: int, slot: int, latent, rope, index_k, length: int, offset: int = 0) -> None:
        """`kv.device.write_prefill` into rank `rank`'s slice."""
        if offset % 64 or offset < 0:
            raise ValueError(f"offset must be a non-negative multiple of 64 (a page boundary), got {offset}")
        self.managers[rank].record_prefill(slot, length, 0, rows=latent.shape[1], offset=offset)
        self.flush()
        self.store = parallel.write_prompt_rows(self.store, {rank: (slot, latent, rope, index_k, length, 0, offset)})

    def check_tables(self, rank: int) -> None:
        """`kv.device.check_tables` of rank `rank`'s slice against its manager."""
        self.flush()
        kv_device.check_tables(parallel.rank_store(self.store, rank), self.managers[rank])

    # ----- one step ------------------------------------------------------------------------------
    def step(self) -> StepMetrics:
        """One mesh step: every rank's host half, one sharded decode-and-sample call, every rank's commit.
        Returns the step's metrics summed over ranks (each rank's are in `engines[r].history`). As on one device:
        a failing request fails alone; a failing call commits nothing (and a consumed store stops the engine)."""
        if self.store_lost:
            raise RuntimeError("a failed decode step consumed the stacked KV store; this engine cannot continue "
                               "(its requests' outputs so far are in outputs())")
        t0, traces = time.perf_counter(), TRACE_COUNTS["store_decode_step"]
        works = [e.begin_step() for e in self.engines]
        if any(w.batch is not None for w in works):
            self._call(works)
        ms = [e.finish_step(w) for e, w in zip(self.engines, works)]
        self.flush()
        m = combine_steps(ms, time.perf_counter() - t0, TRACE_COUNTS["store_decode_step"] > traces)
        self.history.append(m)
        if self._log:
            self._log.write(json.dumps({**m.to_json(), "ranks": [x.to_json() for x in ms]}) + "\n")
            self._log.flush()
        return m  # (every rank's finish_step advanced its step_count)

    def _call(self, works) -> None:
        """Every rank's batch in one sharded call (`MeshRunner.step`) through `runner.call_on_store`, as
        `Engine`'s call: every rank's table decisions applied first, a consumed stacked store remembered; each
        rank's `StepOutput` into its work (`Engine.observe_output`)."""
        def call(store):
            return self.runner.step(self.spec, store, [w.batch for w in works], [w.sampling for w in works],
                                    [w.n_emit for w in works],
                                    read_page_stamps=any(c.needs_page_stamps for c in self.managers))

        outs = call_on_store(self, self.flush, call)
        for e, w, out in zip(self.engines, works, outs):
            if out is not None:
                w.out = e.observe_output(out)

    def run(self, progress=None) -> None:
        """Step until every request has finished. `progress(engine)` is called after each step."""
        run_steps(self, progress)

    def stall_report(self, m: StepMetrics) -> str:
        """Why step `m` moved nothing on any rank: each rank's `Engine.stall_report` of its part of the step."""
        return "; ".join(f"rank {r}: {e.stall_report(e.history[-1])}" for r, e in enumerate(self.engines))

    def generate(self, prompts: list[list[int]], params: SamplingParams = SamplingParams()) -> list[list[int]]:
        """Add `prompts`, run to completion, return their outputs in order."""
        return run_prompts(self, prompts, params)

    # ----- metrics -------------------------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        """Totals over ranks (per-step sums in `history`) and `ranks`: each rank's `Engine.metrics()`."""
        ranks = [e.metrics() for e in self.engines]
        return summarize(self.history, list(self.requests.values()), policy=self.config.policy,
                         admission=self.config.admission,
                         extra_h2d_bytes=sum(c.h2d_bytes for c in self.managers),
                         extra_d2h_bytes=sum(c.d2h_bytes for c in self.managers),
                         evicted_pages=sum(c.evicted_pages for c in self.managers),
                         import_bytes=sum(e.import_bytes for e in self.engines), ranks=ranks)

    def close(self) -> None:
        for e in self.engines:
            e.close()
        if self._log:
            self._log.close()
            self._log = None


__all__ = ["MeshEngine", "RankStore"]
