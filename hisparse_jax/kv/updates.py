"""What the host's bookkeeping (`PageManager`) asks of the device store, as plain records in the order decided.

`PageManager` never touches a device array: each operation that changes which page holds what appends records
here (`PageManager.updates`); the owner of the `KVStore` applies them in order (`kv.device.apply_updates`)
before the next device call reads the tables. Order matters: a released device page may be handed to another
request in the same scheduling pass and loaded from the host right after.

Rows are NumPy int32 arrays: table rows int32[max_pages] (-1 = none), hot rows int32[hot_pages], page lists
padded with -1 to a power of two (so the jitted updates compile once per size bucket).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class SetTables(NamedTuple):
    """Replace one request slot's page tables and length. `hot_row` is None when the hot buffer did not change
    (its slots' tags are kept); otherwise the hot pages are replaced and their tags cleared, and only the first
    `hot_rows` slots (the hot-row budget) may ever be claimed."""

    slot: int
    block_row: np.ndarray
    host_row: np.ndarray
    index_row: np.ndarray
    seq_len: int
    hot_row: np.ndarray | None
    hot_rows: int = 0


class ClearStamps(NamedTuple):
    """Forget a request slot's indexer-recency stamps (its request left)."""

    slot: int


class EvictPages(NamedTuple):
    """Drop the device copies of logical pages (req[i], page_idx[i]); their host copies are current."""

    req: np.ndarray
    page_idx: np.ndarray


class LoadPages(NamedTuple):
    """Copy whole host pages into device pages (host_pages[i] -> device_pages[i], all layers)."""

    host_pages: np.ndarray
    device_pages: np.ndarray


Update = SetTables | ClearStamps | EvictPages | LoadPages


def pad_pow2(values: list[int], fill: int = -1) -> np.ndarray:
    """`values` as int32, padded with `fill` to the next power of two (at least 1)."""
    n = max(1, 1 << max(len(values) - 1, 0).bit_length())
    out = np.full(n, fill, np.int32)
    out[:len(values)] = values
    return out


def table_row(values: list[int], width: int) -> np.ndarray:
    """A table row: `values` then -1 up to `width`."""
    out = np.full(width, -1, np.int32)
    out[:len(values)] = values
    return out
