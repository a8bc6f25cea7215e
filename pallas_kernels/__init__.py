"""Pallas GPU kernels, each with a pure-jnp reference of the same signature (the spec).

* `indexer_topk`      exact paged indexer top-k (scores + radix select in the kernel)
* `sparse_gather`     the fused HiSparse resolver: resident | hot hit (LRU touch) | miss (LRU slot claim)
* `sparse_mla_decode` absorbed MLA decode over the selected rows, read from the pools by address

Kernels use the Triton backend unless told otherwise (`sparse_mla_decode(..., backend="mosaic")`: Mosaic GPU, jax >=
0.11; `backends`); pass `interpret=True` to run them on a CPU.
"""

from pallas_kernels.indexer_topk import indexer_topk, indexer_topk_reference
from pallas_kernels.sparse_gather import sparse_gather, sparse_gather_reference
from pallas_kernels.sparse_mla_decode import sparse_mla_decode, sparse_mla_decode_reference

__all__ = ["indexer_topk", "indexer_topk_reference", "sparse_gather", "sparse_gather_reference",
           "sparse_mla_decode", "sparse_mla_decode_reference"]
