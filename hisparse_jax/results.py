"""Typed results: what `generate(..., return_stats=True)`, `Engine.step()` and `Engine.metrics()` return.

Each is a frozen dataclass (attributes, documented fields, IDE completion): read its fields as attributes
(`m.hits`); `to_json()` gives plain JSON-ready data (a dict of the fields, nested records converted).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


def jsonable(x):
    """`x` with every result record turned into a dict and NumPy scalars / arrays into Python numbers / lists."""
    if isinstance(x, Record):
        return x.to_json()
    if isinstance(x, Mapping):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "tolist"):  # NumPy scalars and arrays
        return x.tolist()
    return x


class Record:
    """Base of the result dataclasses: `to_json()`."""

    __slots__ = ()

    def to_json(self) -> dict:
        """The fields as JSON-ready data (nested records and arrays converted)."""
        return {f: jsonable(getattr(self, f)) for f in self.__dataclass_fields__}


@dataclasses.dataclass(frozen=True, eq=True)
class GenerateStats(Record):
    """Totals of a tiered `generate` run over its decode steps (`steps`; the first token comes from the prefill).

    resident / hits / misses: selected rows read from resident pages / found in a hot buffer / fetched from the host,
    summed over layers and steps (`per_layer` keeps them per layer). h2d_bytes: host→device bytes (misses, page
    loads); h2d_transfer_bytes: bytes the fetch mechanism actually moved (whole chunks or pages); d2h_bytes:
    device→host bytes (prompt rows and decode rows mirrored to the host). append_dropped: rows a step could not
    write (must be 0). evicted_pages: device pages released to the host. row_misses: misses counted per query row
    (several rows of one request in a step — speculative verification — count a row they both miss twice; equal
    to misses otherwise). index_h2d_bytes: indexer-key bytes read from the host (index_tier="host"; counted apart
    from h2d_bytes)."""

    resident: int
    hits: int
    misses: int
    h2d_bytes: int
    h2d_transfer_bytes: int
    d2h_bytes: int
    append_dropped: int
    evicted_pages: int
    steps: int
    per_layer: dict
    row_misses: int = 0
    index_h2d_bytes: int = 0


@dataclasses.dataclass(frozen=True, eq=True)
class StepMetrics(Record):
    """One `Engine.step()`. running: requests that decoded a token; admitted / prefilling / swapped / waiting:
    requests in those states after scheduling; preemptions / swaps_out / swaps_in: policy actions this step;
    tokens: new tokens; prefill_tokens: prompt tokens computed; cached_tokens: prompt tokens served by
    prefix caching; failed: requests whose own work raised; bucket: padded batch rows (0: no batched call);
    scored_pages: indexer pages scored; decode_tokens: tokens the running requests emitted (= running without
    speculation); drafted / accepted: speculative drafts verified / accepted; duplicate_misses: misses the rows of
    one request would have fetched twice had each resolved alone (speculative verification resolves their union
    once); hits / misses / resident / h2d_bytes / d2h_bytes / index_h2d_bytes: as in `GenerateStats`;
    device_pages_used: after the step; step_time_s: wall time; compiled: whether the step compiled;
    wait_reasons: requests that made no progress this step, per reason (`engine.scheduler.WAIT_REASONS`: waiting
    for max_running / the device, indexer or host budget / a prompt being written / behind the first waiting one,
    preempted, swapped out or not yet back, no prompt tokens left this step); recomputed_tokens: of prefill_tokens,
    those computed before and dropped by a preemption; preempted_waiting: preempted requests back in the queue after
    scheduling; swap_out_pages / swap_in_pages: KV pages swapped out to the host / back in; swap_out_bytes /
    swap_in_bytes: their bytes (every layer) plus the indexer keys' that leave / re-enter the device budget."""

    step: int
    running: int
    admitted: int
    prefilling: int
    swapped: int
    waiting: int
    preemptions: int
    swaps_out: int
    swaps_in: int
    tokens: int
    prefill_tokens: int
    cached_tokens: int
    failed: int
    bucket: int
    scored_pages: int
    decode_tokens: int
    drafted: int
    accepted: int
    duplicate_misses: int
    hits: int
    misses: int
    resident: int
    h2d_bytes: int
    d2h_bytes: int
    index_h2d_bytes: int
    device_pages_used: int
    step_time_s: float
    compiled: bool
    wait_reasons: dict = dataclasses.field(default_factory=dict)
    recomputed_tokens: int = 0
    preempted_waiting: int = 0
    swap_out_pages: int = 0
    swap_in_pages: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0


@dataclasses.dataclass(frozen=True, eq=True)
class EngineMetrics(Record):
    """Totals of an engine run so far, and its per-step `history`.

    mean_running: requests decoding per decode step (the published table's "running requests"); max_running;
    preemptions; swaps (swap-outs); failed requests; tokens (new) and prefill_tokens (computed prompt tokens);
    cached_tokens and prefix_hit_rate (their share of prompt tokens admitted); time_s, compile_steps,
    compile_time_s; tokens_per_s over steps that did not compile; hits / misses / hit_rate of hot buffers, resident
    (selected rows read from resident pages, which the hit rate leaves out);
    h2d_bytes / d2h_bytes (steps plus page loads and prompt writes); index_h2d_bytes (indexer keys read from the
    host, index_tier="host"); evicted_pages; import_bytes (KV rows of
    imported prompts moved to the device, `Engine.import_request`); speculative_tokens (k), acceptance_rate
    (drafts accepted / verified), duplicate_misses (fetches the union resolve saved) and tokens_per_step (tokens a running request gains per decode step: 1 without
    speculation); mean_ttft_steps and
    mean_latency_steps (finished requests, in steps from arrival to first / last token). ranks: a `MeshEngine`'s
    per-rank `EngineMetrics` (its totals and `history` are summed over ranks step by step); empty on one device.
    wait_reasons: request-steps without progress per reason, summed over the steps (`StepMetrics.wait_reasons`).
    admission: preempt / offload's admission rule (`EngineConfig.admission`; "hisparse" for HiSparse's own);
    recomputed_tokens: prompt and generated tokens prefilled again after preemptions; preempted_steps /
    swapped_steps: request-steps spent preempted (in the queue) / swapped out; swap_out_pages / swap_in_pages and
    swap_out_bytes / swap_in_bytes: pages swapped each way and their bytes (KV of every layer — already on the host
    by the eager mirror when swapped out; loaded back in whole — plus the indexer keys, whose copy is counted, not
    made: `engine.scheduler`)."""

    policy: str
    steps: int
    mean_running: float
    max_running: int
    preemptions: int
    swaps: int
    failed: int
    tokens: int
    prefill_tokens: int
    cached_tokens: int
    prefix_hit_rate: float
    time_s: float
    compile_steps: int
    compile_time_s: float
    tokens_per_s: float
    hits: int
    misses: int
    hit_rate: float
    resident: int
    h2d_bytes: int
    d2h_bytes: int
    index_h2d_bytes: int
    evicted_pages: int
    import_bytes: int
    speculative_tokens: int
    acceptance_rate: float
    duplicate_misses: int
    tokens_per_step: float
    mean_ttft_steps: float
    mean_latency_steps: float
    history: list
    ranks: list = dataclasses.field(default_factory=list)
    wait_reasons: dict = dataclasses.field(default_factory=dict)
    admission: str = "vllm"
    recomputed_tokens: int = 0
    preempted_steps: int = 0
    swapped_steps: int = 0
    swap_out_pages: int = 0
    swap_in_pages: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
