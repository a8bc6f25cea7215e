"""The tiered paged KV store.

Modules: `spec.py` (`StoreSpec`, the static geometry), `state.py` (`KVStore`, the arrays: device pools, pinned-host
pools, tables), the jitted store operations the decode step uses, one idea each: `codec.py` (value formats, host
memory moves), `writes.py` (row writes), `scoring.py` (the indexer's top-k), `summary.py` (the host key tier's
page summaries: written with the keys, ranked for the reads), `resolve.py` (top-k -> `Plan`, the hot
buffer's victim order, misses host -> device, reads); `tiered.py` (the `TieredKV` backend and the decode-step entry
points), `pool.py` (`PagePool`: page ids, refcounts, prefix registrations); the host bookkeeping `manager.py`
(`PageManager`, one class: admission, eviction and its coldness orders, swap, prefix sharing) and its consistency
checks `audit.py` — NumPy only (whether requests fit at all: `spec.check_batch_fits`); `updates.py` (what the
bookkeeping asks of the device tables) and `device.py` (carrying those updates out on a `KVStore`: table changes,
write-back, swap-in; checked row writes and reads); `persist.py` (save / restore); `dense.py` (the contiguous
all-resident KV arrays behind plain `generate`).

Glossary (one word, one thing; where the code still uses a word for two things, the second meaning is named):

- page: 64 consecutive token positions of one request (`PAGE_SIZE`); a *logical page* i covers positions
  64i..64i+63 of a request, and lives in up to three *tiers* (`pool.Tier`): a device KV page (latent + rope of
  every layer), a pinned-host KV page, and an indexer-key page (device or, with index_tier="host", pinned host).
- pool: the pages of one tier (`KVStore` arrays) and their bookkeeping (`pool.PagePool`: refcounts, free lists,
  prefix registrations).
- request slot (`slot` on the host, `req` in jitted code): a request's row in the store's tables, 0..max_seqs-1.
- indexer layer (`index_layer`): a full-indexer layer's number among the full-indexer layers (its row of the
  indexer-key pool); not a slot.
- resident: a logical page with a device copy. *evicted*: its device copy given back, the host copy kept.
  *released*: a whole request's pages freed. *tail pages*: the last two pages of a request, never evicted.
- hot buffer: per request and indexer group, `hot_rows` *hot slots* on pages lent from the device pool, holding
  rows of evicted pages; *hit*: a selected row found there; *miss*: fetched from the host into the least
  recently used hot slot (the LRU order: `pallas_kernels/sparse_gather/reference.py`).
- indexer group: a full indexer layer and the shared-index layers after it; they read the same top-k rows.
- mirror: every appended row is written to its host page in the same step (`mirror_to_host`), so evicting a
  page copies nothing.
- updates (`PageManager.updates`, `updates.py`): the host's decisions about the device tables, in order, applied by
  whoever holds the `KVStore` (`device.apply_updates`) before the next device call.
- resident-only (`PageManager.resident_only`, `keep_resident` / `allow_eviction`): request slots whose pages must all
  stay resident (a prompt being written chunk by chunk). "Pinned" always means pinned host memory, the host tier.
- plan: the resolver's per-row result (`resolve.Plan`: page, row, valid, resident, miss, source); the engine's
  scheduler has its own `StepPlan`.
- coldness: which pages a request evicts first (`manager.COLDNESS`: "oldest" or indexer-"recency"), a pure order
  of its evictable pages given a read-only view of its indexer-recency stamps.
"""
