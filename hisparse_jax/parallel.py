"""Attention data parallelism over a device mesh: one tiered store per data-parallel rank, stacked.

    mesh = data_mesh(8)                                   # the first 8 devices, axis "data"
    managers = [PageManager(model_cfg, cache) for _ in range(8)]   # host bookkeeping, one per rank
    store = new_stacked_store(managers, mesh)             # every leaf [N, ...], rank r's slice on device r
    store, slots = admit_prefilled_ranks(store, managers, {r: (latent, rope, index_k, length), ...})
    store = reserve_next_ranks(store, managers, slots_per_rank)
    step = runner.jitted_sharded_step(graphdef, mesh)     # runner.step_impl per rank, params replicated
    logits, store, stats = step(replicate(state, mesh), store, batch)   # batch leaves [N, B]; logits [N, B, V]

Layout: the N ranks' stores have one `StoreSpec` and are stacked on a new leading axis, placed with
`NamedSharding(mesh, P("data"))` — device pools, indexer pools, tables and hot buffers in device memory, the host
pools with the pinned-host memory kind — so each device holds exactly its rank's slice: 1/N of every leaf. Each
rank has its own `PageManager` (its own page ids, request slots and budgets: the `CacheConfig`'s budgets are per
device). Everything that touches the store runs as one `shard_map` over the data axis: each device runs the
one-store program (`kv.device`'s jitted updates, `runner.step_impl` in `runner.jitted_sharded_step`) on its own
slice with its own arguments, so no KV crosses devices. Ranks with nothing to do in a call get no-op arguments (an
out-of-range slot, -1 page lists, a zero-length prompt write), which the one-store functions already skip. This
module builds the per-rank form of `kv.device`'s store programs (`apply_rank_updates`, `write_prompt_rows`) and
the stacked store in place; the mesh step that runs the model is built in `engine.runner`.

Multi-controller (`jax.distributed.initialize`, one process per host): the mesh spans every process's devices
(`data_mesh` takes `jax.devices()`), every process runs the same program with the same host bookkeeping for all
ranks (the per-rank managers are deterministic), and each process creates only the shards of its own
(addressable) devices: `new_stacked_store` builds the local ranks' empty stores, stacked arguments are placed
with `jax.make_array_from_callback` (each process fills its devices' rows from the same full host array), and
`to_host` reads a sharded result back with `multihost_utils.process_allgather` (a collective every process
joins) so every process sees all ranks' logits and samples the same tokens.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv.state import KVStore, StoreSpec, empty_arrays, filled, store_shardings
from hisparse_jax.memory import Cost
from hisparse_jax.model import moe


def shard_map(f, mesh, in_specs, out_specs):
    """`jax.shard_map` of `f` over `mesh`, without the replication check (every rank runs its own slice)."""
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def data_mesh(n: int | None = None, axis: str = "data") -> Mesh:
    """A one-axis mesh over the first `n` devices (all of them by default)."""
    devices = jax.devices()
    n = len(devices) if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= len(devices):
        raise ValueError(f"n must be an int in [1, {len(devices)}] (the devices jax sees), got {n!r}")
    return Mesh(np.array(devices[:n]), (axis,))


def check_mesh(mesh) -> str:
    if not isinstance(mesh, Mesh) or len(mesh.axis_names) != 1:
        raise ValueError(f"mesh must be a one-axis jax.sharding.Mesh (e.g. parallel.data_mesh(n)), got {mesh!r}")
    return mesh.axis_names[0]


def replica_cost(state, mesh: Mesh, *, expert_parallel: bool = False) -> Cost:
    """The memory account's entry for the model's parameters (`state`: the split model's arrays) on each device of
    `mesh`: a replica each, or with `expert_parallel` the routed experts' 1/N share and the rest replicated."""
    n = num_ranks(mesh)
    total = sum(int(x.nbytes) for x in jax.tree.leaves(state))
    if expert_parallel:
        experts = sum(int(x.nbytes) for path, x in jax.tree_util.tree_leaves_with_path(state)
                      if "experts" in jax.tree_util.keystr(path))
        total -= experts - experts // n
    return Cost("the model's parameters (one copy per device)", total, "device", f"{n} devices of the mesh")


def is_local(mesh: Mesh) -> bool:
    """Whether this process addresses every device of `mesh` (always true without `jax.distributed`)."""
    me = jax.process_index()
    return all(d.process_index == me for d in mesh.devices.flat)


def store_mesh(store: KVStore) -> Mesh:
    return store.seq_lens.sharding.mesh


def num_ranks(mesh: Mesh) -> int:
    return int(mesh.devices.size)


def stacked_shardings(spec: StoreSpec, mesh: Mesh) -> KVStore:
    """A KVStore of `NamedSharding(mesh, P(axis))`, each with the memory kind of the one-device store's leaf
    (`state.store_shardings`: the host pools pinned_host, the rest device)."""
    axis = check_mesh(mesh)
    one = store_shardings(spec, mesh.devices.flat[0])
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, P(axis), memory_kind=s.memory_kind), one)


def squeeze_rank(tree):
    """A rank's [1, ...] slices of a stacked tree -> its own leaves."""
    return jax.tree_util.tree_map(lambda x: x[0], tree)


def expand_rank(tree):
    """The inverse of `squeeze_rank`."""
    return jax.tree_util.tree_map(lambda x: x[None], tree)


def new_stacked_store(managers, mesh: Mesh) -> KVStore:
    """The stacked store of `managers` (one `PageManager` per rank, all with one `StoreSpec`): every rank's empty
    store (`state.empty_arrays`) made where it lives, each device filling only its own slice (no rank's store is
    made whole and then copied into place); then each rank's pending updates applied."""
    n = num_ranks(mesh)
    check_mesh(mesh)
    if len(managers) != n:
        raise ValueError(f"need one PageManager per rank: {n} ranks, {len(managers)} managers")
    spec = managers[0].spec
    if any(c.spec != spec for c in managers):
        raise ValueError("every rank's PageManager must have the same StoreSpec")
    shardings = stacked_shardings(spec, mesh)
    out = {name: filled((n,) + tuple(shape), fill, dt, getattr(shardings, name))
           for name, (shape, fill, dt) in empty_arrays(spec).items()}
    return apply_rank_updates(KVStore(spec=spec, **out), managers)


# ----- the one-store functions, run per rank -------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _per_rank(fn, mesh: Mesh):
    """fn(store, *args) -> store (one store), as a jitted shard_map over the stacked store (donated) and stacked
    args ([N, ...] each, rank r's on device r)."""
    axis = check_mesh(mesh)

    def body(store, *args):
        return expand_rank(fn(squeeze_rank(store), *(a[0] for a in args)))

    def call(store, *args):
        specs = (P(axis),) * (1 + len(args))
        return shard_map(body, mesh, specs, P(axis))(store, *args)

    return jax.jit(call, donate_argnums=(0,))


def _place(x, sharding: NamedSharding) -> jax.Array:
    """Host array `x` (the same full value in every process) as a global array with `sharding`: one
    `device_put` in one process; across processes each creates only its own devices' shards."""
    if is_local(sharding.mesh):
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(x) -> np.ndarray:
    """The full value of a (possibly multi-process) array as NumPy: a plain read when this process addresses
    every shard, else `multihost_utils.process_allgather` (every process must call it, in the same order)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _put(mesh: Mesh, arrays) -> jax.Array:
    """Stack per-rank arrays (equal shapes) on a new axis 0, rank r's part on device r."""
    return _place(np.stack(arrays), NamedSharding(mesh, P(check_mesh(mesh))))


def _noop(kind: str, spec: StoreSpec, like: list) -> list:
    """Arguments for which the one-store function changes nothing: an out-of-range slot (its scatters drop the
    row) or page lists of -1 (skipped)."""
    if kind in ("rows", "tables", "stamps"):
        return [np.int32(spec.max_seqs)] + [np.asarray(a) for a in like[1:]]
    return [np.full_like(a, -1) for a in like]


def _pad(a: np.ndarray, n: int) -> np.ndarray:
    return a if a.shape[0] == n else np.concatenate([a, np.full(n - a.shape[0], -1, a.dtype)])


def apply_rank_updates(store: KVStore, managers) -> KVStore:
    """Apply (and clear) each rank's pending `manager.updates` to its slice, each rank in its own order: round k
    applies every rank's k-th update, one shard_map call per kind of update in the round (ranks without one
    of that kind get no-op arguments)."""
    mesh = store_mesh(store)
    spec = store.spec
    pending = [[kv_device.update_call(u) for u in c.take_updates()] for c in managers]
    for k in range(max((len(p) for p in pending), default=0)):
        kinds = {p[k][0] for p in pending if len(p) > k}
        for kind in sorted(kinds):
            mine = {r: p[k][1] for r, p in enumerate(pending) if len(p) > k and p[k][0] == kind}
            like = next(iter(mine.values()))
            if kind in ("evict", "load"):  # page lists: pad every rank's to the longest
                width = max(a[0].shape[0] for a in mine.values())
                mine = {r: [_pad(a, width) for a in args] for r, args in mine.items()}
                like = next(iter(mine.values()))
            args = [mine.get(r) or _noop(kind, spec, like) for r in range(len(managers))]
            stacked = [_put(mesh, [a[i] for a in args]) for i in range(len(like))]
            store = _per_rank(kv_device.STORE_PROGRAMS[kind], mesh)(store, *stacked)
    return store


def reserve_next_ranks(store: KVStore, managers, slots, n: int = 1) -> KVStore:
    """`kv.device.reserve_next` per rank: slots[r] are rank r's request slots (-1: padding) about to append `n`
    tokens each; their pages are reserved in rank r's manager and every rank's updates applied."""
    for manager, rank_slots in zip(managers, slots):
        for s in rank_slots:
            if s >= 0:
                manager.reserve(s, manager.lengths[s] + n)
    return apply_rank_updates(store, managers)


def admit_prefilled_ranks(store: KVStore, managers, prompts: dict) -> tuple[KVStore, dict]:
    """Admit at most one prompt per rank and write its rows into that rank's slice, all ranks in one call:
    prompts {rank: (latent [L, T, C], rope [L, T, R], index_k [LI, T, dI], length)} (rows as from
    `generate.prefill_rows`; T may differ between ranks). Returns (store, {rank: slot})."""
    slots = {}
    for r, (latent, _, _, length) in prompts.items():
        slots[r] = managers[r].admit(length)
        managers[r].record_prefill(slots[r], length, 0, rows=latent.shape[1])
    store = apply_rank_updates(store, managers)
    return write_prompt_rows(store, {r: (slots[r], *v) for r, v in prompts.items()}), slots


def write_prompt_rows(store: KVStore, writes: dict) -> KVStore:
    """Write prompt rows into several ranks' slices in one call (`kv.device`'s "prefill" program per rank):
    writes {rank: (slot, latent [L, T, C], rope [L, T, R], index_k [LI, T, dI], length[, start[, offset]])}, row t
    being position offset + t, positions start..length-1 written (the slots admitted and their prefill recorded
    in the ranks' managers, their updates applied: `kv.device.write_prefill`'s contract, per rank)."""
    mesh = store_mesh(store)
    spec = store.spec
    T = max(v[1].shape[1] for v in writes.values())
    first = next(iter(writes.values()))

    def rows(r, i):
        if r not in writes:
            return np.zeros(first[i].shape[:1] + (T,) + first[i].shape[2:], first[i].dtype)
        a = np.asarray(writes[r][i])
        return np.pad(a, ((0, 0), (0, T - a.shape[1])) + ((0, 0),) * (a.ndim - 2))

    def scalar(r, i, default):
        v = writes.get(r, ())
        return np.int32(v[i] if len(v) > i else default)

    n = num_ranks(mesh)
    # a rank without rows writes 0 rows into the out-of-range slot: nothing
    req = _put(mesh, [scalar(r, 0, spec.max_seqs) for r in range(n)])
    length = _put(mesh, [scalar(r, 4, 0) for r in range(n)])
    start, offset = (_put(mesh, [scalar(r, i, 0) for r in range(n)]) for i in (5, 6))
    latent, rope, index_k = (_put(mesh, [rows(r, i) for r in range(n)]) for i in (1, 2, 3))
    return _per_rank(kv_device.STORE_PROGRAMS["prefill"], mesh)(store, req, latent, rope, index_k, length, start,
                                                                 offset)


def rank_store(store: KVStore, rank: int) -> KVStore:
    """Rank `rank`'s slice of the stacked store as a one-device KVStore (its arrays on that rank's device; this
    process must address it). For reading (tests, `kv.device.check_tables`), not for stepping."""
    def one(x):
        for shard in x.addressable_shards:
            if (shard.index[0].start or 0) == rank:  # slice(r, r + 1), or slice(None) on a one-device mesh
                return shard.data[0]
        raise ValueError(f"rank {rank}'s slice is not addressable from process {jax.process_index()}")

    return jax.tree_util.tree_map(one, store)


# ----- the sharded decode step -------------------------------------------------------------------------------
def _is_routed_expert(path) -> bool:
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return "experts" in keys  # `MoE.experts` (gate / up / down [E, ...]); `shared_experts` is another key


def param_specs(state, axis: str | None):
    """The PartitionSpec of each parameter: routed-expert weights split on their expert axis over `axis` (expert
    parallelism), everything else replicated (`P()`); axis None: all replicated. The main layers' parameters are
    stacked (`model.stacks`: [repeats, E, ...]), so their expert axis is the second; the MTP layers' is the first."""
    def spec(path, _):
        if axis is None or not _is_routed_expert(path):
            return P()
        stacked = getattr(path[0], "key", getattr(path[0], "name", None)) == "stacks"
        return P(None, axis) if stacked else P(axis)

    return jax.tree_util.tree_map_with_path(spec, state)


def check_expert_parallel(cfg, mesh: Mesh) -> None:
    """Expert parallelism splits the routed experts evenly over the mesh's devices: refuse a count that does not
    divide."""
    n = num_ranks(mesh)
    if cfg.n_routed_experts % n:
        raise ValueError(f"expert parallelism needs n_routed_experts ({cfg.n_routed_experts}) divisible by the mesh's "
                         f"{n} devices")


def place_params(state, mesh: Mesh, *, expert_parallel: bool = False):
    """Put a model's parameters (`nnx.split` state) on `mesh`: replicated, or with the routed experts split over
    the devices (`expert_parallel`: each device holds 1/N of every MoE layer's experts)."""
    specs = param_specs(state, check_mesh(mesh) if expert_parallel else None)
    return jax.tree_util.tree_map(lambda x, spec: _place(jax.device_get(x) if not is_local(mesh) else x,
                                                        NamedSharding(mesh, spec)), state, specs)


def replicate(tree, mesh: Mesh):
    """Put `tree` (e.g. a model's `nnx.split` state) on every device of `mesh`: `NamedSharding(mesh, P())`."""
    sh = NamedSharding(mesh, P())
    if is_local(mesh):
        return jax.device_put(tree, sh)
    return jax.tree_util.tree_map(lambda x: _place(jax.device_get(x), sh), tree)


def moe_context(axis: str | None):
    """The MoE layers' expert-parallel context over mesh axis `axis` (nothing when None)."""
    return moe.expert_parallel(axis) if axis is not None else contextlib.nullcontext()


def put_batch(mesh: Mesh, batch: dict) -> dict:
    """Place a batch of [N, ...] NumPy arrays with axis 0 on the mesh's axis (rank r's rows on device r)."""
    sh = NamedSharding(mesh, P(check_mesh(mesh)))
    return {k: _place(np.asarray(v), sh) for k, v in batch.items()}


def place_round_robin(num_prompts: int, n: int) -> list[list[int]]:
    """The prompts each rank serves: prompt i on rank i % n (in prompt order within a rank)."""
    return [list(range(r, num_prompts, n)) for r in range(n)]


__all__ = ["data_mesh", "stacked_shardings", "new_stacked_store", "apply_rank_updates", "reserve_next_ranks",
           "admit_prefilled_ranks", "write_prompt_rows", "rank_store", "replicate", "shard_map", "squeeze_rank",
           "expand_rank", "moe_context", "param_specs", "place_params", "check_expert_parallel", "put_batch",
           "place_round_robin", "store_mesh", "num_ranks", "is_local", "to_host", "check_mesh"]

