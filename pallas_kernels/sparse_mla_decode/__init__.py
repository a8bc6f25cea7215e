"""Sparse absorbed-MLA decode over rows addressed in the paged pools (FlashMLA-sparse style)."""

from pallas_kernels.sparse_mla_decode.kernel import sparse_mla_decode
from pallas_kernels.sparse_mla_decode.reference import sparse_mla_decode_reference

__all__ = ["sparse_mla_decode", "sparse_mla_decode_reference"]
