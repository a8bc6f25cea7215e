"""Exact paged lightning-indexer top-k: Pallas (Triton) kernels and their pure-jnp reference."""

from pallas_kernels.indexer_topk.kernel import MAX_TOPK, indexer_topk
from pallas_kernels.indexer_topk.reference import indexer_topk_reference, paged_index_scores

__all__ = ["MAX_TOPK", "indexer_topk", "indexer_topk_reference", "paged_index_scores"]
