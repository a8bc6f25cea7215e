"""An engine saved between steps and resumed in another process with exactly the tokens the uninterrupted run gives.

    save_engine(engine, path)            # between steps; path must not hold a previous snapshot
    engine = load_engine(path, model)    # any process: the same weights, the saved configs
    engine.run()

`path/store` is the store and its bookkeeping as `kv.persist.save_tiered` writes them (checksummed arrays, page
tables, prefix hashes, summaries verified on load); `path/engine.json` holds what the engine adds: its configs (the
`CacheConfig` the engine was given, before its policy sized it), every request (prompt, output so far, state, slot,
prompt progress, counters, speculative drafts), the scheduler's queue and admission order, the step counter and the
per-step metrics, under a SHA-256 of the whole description. Sampling needs no saved state: a token's randomness
follows (seed, position) (`engine.sampling`).

Refused with a clear message: a `MeshEngine` (its ranks share one stacked store; save a one-device `Engine`), a
request that still holds a P/D import not written to the store (step until it is admitted, or abort it), an engine
whose store was lost to a failed step, a model whose config is not the saved one, and a damaged or edited
description (`integrity.CheckpointError`)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections import deque

from hisparse_jax import integrity
from hisparse_jax.config import CacheConfig
from hisparse_jax.engine.engine import Engine
from hisparse_jax.engine.engine_config import EngineConfig
from hisparse_jax.engine.request import Request, RequestState, SamplingParams
from hisparse_jax.integrity import CheckpointError
from hisparse_jax.kv.persist import load_tiered, save_tiered
from hisparse_jax.model.decoder import SparseMLAModel
from hisparse_jax.results import StepMetrics

FORMAT = "hisparse_jax.Engine"
VERSION = 1


def save_engine(engine: Engine, path: str | os.PathLike) -> None:
    """Write `engine` (between steps) to the folder `path`: `path/store` (`save_tiered`) and `path/engine.json`.
    Pending table decisions are applied to the store first, as the next step would."""
    if not isinstance(engine, Engine):
        raise TypeError(f"save_engine saves a one-device Engine, got {type(engine).__name__} (a MeshEngine's ranks "
                        "share one stacked store and cannot be saved yet)")
    if engine.store_lost:
        raise ValueError("this engine's store was lost to a failed step (its arrays were donated): nothing to save")
    pending = [r.request_id for r in engine.requests.values() if r.imported is not None]
    if pending:
        raise ValueError(f"request(s) {', '.join(pending)} hold a P/D import not yet written to the store: step the "
                         "engine until they are admitted, or abort them, then save")
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(os.path.join(path, "engine.json")) or os.path.exists(os.path.join(path, "store")):
        raise FileExistsError(f"{path} already holds a saved engine: save into a new folder")
    engine.stores.apply_updates(engine.manager)
    save_tiered(engine.manager, engine.store, os.path.join(path, "store"))
    sched = engine.scheduler
    meta = {"format": FORMAT, "version": VERSION,
            "model": dataclasses.asdict(engine.model.cfg), "cache": dataclasses.asdict(engine.cache),
            "config": dataclasses.asdict(engine.config),
            "requests": [_request_to_dict(r) for r in engine.requests.values()],
            "waiting": [r.request_id for r in sched.waiting], "active": [r.request_id for r in sched.active],
            "admission_out_of_pages": sched.admission_out_of_pages, "step_count": engine.step_count,
            "import_bytes": engine.import_bytes, "history": [dataclasses.asdict(m) for m in engine.history]}
    with integrity.writing("an engine snapshot", os.path.join(path, "engine.json")) as fn:
        integrity.write_description(fn, meta)


def load_engine(path: str | os.PathLike, model: SparseMLAModel) -> Engine:
    """The engine `save_engine` wrote at `path`, over `model` (the same config; its weights are the caller's to
    match), ready to `step` / `run` from where it stopped."""
    path = os.path.abspath(os.fspath(path))
    fn = os.path.join(path, "engine.json")
    meta = integrity.read_description(fn, "engine", FORMAT, VERSION, holds="configs, requests, queues")
    if meta["model"] != json.loads(json.dumps(dataclasses.asdict(model.cfg))):
        diff = sorted(k for k, v in dataclasses.asdict(model.cfg).items()
                      if json.loads(json.dumps(v)) != meta["model"].get(k))
        raise ValueError(f"the model's config differs from the saved engine's in {', '.join(diff)}: load it with "
                         "the model it was saved with")
    try:
        cache = CacheConfig(**_tuples(meta["cache"]))
        config = EngineConfig(**meta["config"])
        requests = [_request_from_dict(d) for d in meta["requests"]]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{fn}: the saved configs or requests are invalid ({type(e).__name__}: {e})") from None
    manager, store = load_tiered(os.path.join(path, "store"))
    engine = Engine(model, cache, config, restored=(manager, store))
    by_id = {r.request_id: r for r in requests}
    unknown = [i for i in meta["waiting"] + meta["active"] if i not in by_id]
    if unknown:
        raise CheckpointError(f"{fn}: the queues name requests it does not hold: {', '.join(unknown)}")
    engine.requests = {r.request_id: r for r in requests}  # in the saved (arrival) order
    engine.scheduler.waiting = deque(by_id[i] for i in meta["waiting"])
    engine.scheduler.active = [by_id[i] for i in meta["active"]]
    engine.scheduler.admission_out_of_pages = meta["admission_out_of_pages"]
    engine.step_count, engine.import_bytes = meta["step_count"], meta["import_bytes"]
    engine.history = [StepMetrics(**m) for m in meta["history"]]
    return engine


def _tuples(d: dict) -> dict:
    """A config's JSON fields as its dataclass takes them (JSON has no tuples)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def _request_to_dict(r: Request) -> dict:
    d = dataclasses.asdict(dataclasses.replace(r, imported=None))
    d.pop("imported")
    d["state"] = r.state.value
    return d


def _request_from_dict(d: dict) -> Request:
    d = dict(d)
    d["params"] = SamplingParams(**_tuples(d["params"]))
    d["state"] = RequestState(d["state"])
    return Request(**d)
