"""Fused HiSparse resolver (top-k positions -> row addresses + hot-buffer LRU update) for one indexer group."""

from pallas_kernels.sparse_gather.kernel import sparse_gather
from pallas_kernels.sparse_gather.reference import sparse_gather_reference

__all__ = ["sparse_gather", "sparse_gather_reference"]
