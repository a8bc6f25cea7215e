"""The step's batch: the arrays one batched call runs on, built from the scheduled rows in one place.

A row is one token of one request at one position: a decode row (the request's last token), a prompt row (a chunk
of its prompt written through the store) or a verified row (speculative decoding: the pending token and the drafts).
`StepRows` collects a step's rows request by request and which of them emit a token, and builds

    batch     {"tokens", "req", "pos"} int32[B] (+ "draft_ok" int32[B] when drafts were added), "index_span"
              int32[P] (only its shape is read: the indexer scores pages up to the batch's longest position);
    sampling  {"rows", "seed", "pos", "temperature", "top_p"} [B]: the emitting rows, in order, and their draws;

B a power-of-two bucket (of groups of `group` rows each, >= min_bucket groups). Rows past the real ones are idle
(`ROW_PAD`: slot -1). `pad` fills columns to a length with the same idle values: the mesh pads every rank's batch
to one bucket with it, `generate` its request column.

    rows = StepRows()
    rows.add(slot, [token], position, emit=(seed, position + 1, temperature, top_p))
    batch, sampling, n_emit = rows.build(spec, min_bucket=8)
"""

from __future__ import annotations

import numpy as np

from hisparse_jax.kv import tiered

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
