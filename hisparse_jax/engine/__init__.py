"""The imperative shell: requests, continuous batching under a memory policy, metrics.

Glossary:

- cache: a `CacheConfig` (the KV store's configuration: pages per tier, hot rows, fetch); only that.
- manager: a `PageManager`, the host bookkeeping of a tiered store (pages, tables, lengths, prefix hashes);
  `Engine.manager`, `MeshEngine.managers` (one per rank).
- store: a `KVStore`, the device (and pinned-host) arrays a manager describes.
- kv: the carry threaded through the model's layers in a decode step (`TieredKV.init_kv`, `kv.dense.init_dense_kv`).
- request: a prompt and its `SamplingParams`; states WAITING (queued, or preempted), PREFILLING, RUNNING,
  SWAPPED (offload: all its KV on the host), FINISHED, ABORTED, FAILED (its own work raised in a step).
- policy: what happens when the device KV pool is full — "preempt" (drop the newest request's KV, recompute it
  later), "offload" (swap a request's whole KV to the host and back), "hisparse" (requests release cold pages and
  read them through hot buffers).
- admission: moving a waiting request in when its pages fit (`Scheduler`); the step plan (`StepPlan`) lists the
  decode rows, prompt chunks and whole-prompt prefills of one step.
- runner (`Runner`): the device side — the model split once, one jitted decode-and-sample call per step, one
  device→host read per step.
- bucket: the padded sizes a step compiles for — batch rows and indexer pages, both powers of two.
- step: one `Engine.step()`: schedule, each request's own work, one batched device call, commit.
- rank (`mesh.py`, `MeshEngine`): one device of a data-parallel mesh; each rank is an `Engine` with its own manager,
  scheduler and budgets over its slice of one stacked store; placement picks a new request's rank.
- import (`pd.py`, `Engine.import_request`): a request whose prompt KV was computed by another (prefill) run and
  arrives as a file; written into the store at admission instead of computed.
- snapshot (`snapshot.py`, `save_engine` / `load_engine`): an engine saved between steps (its store, bookkeeping,
  requests and queues) and resumed in any process with the uninterrupted run's tokens.
"""

from hisparse_jax.engine.engine import Engine
from hisparse_jax.engine.engine_config import EngineConfig
from hisparse_jax.engine.mesh import MeshEngine
from hisparse_jax.engine.request import Request, RequestState, SamplingParams
from hisparse_jax.engine.scheduler import POLICIES, device_budget
from hisparse_jax.engine.snapshot import load_engine, save_engine

__all__ = ["Engine", "EngineConfig", "MeshEngine", "device_budget", "Request", "RequestState", "SamplingParams",
           "POLICIES", "load_engine", "save_engine"]
