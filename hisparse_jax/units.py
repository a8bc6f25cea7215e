"""The store's two constants, stated once for the library (it imports nothing, so the pure-Python calculator can use
it where numpy and jax are not installed). The kernels, which import only jax, state their own (`pallas_kernels.
common.PAGE` / `INVALID`); tests/unit/test_import_graph.py checks that the two agree and that nothing else defines
them."""

PAGE_SIZE = 64  # tokens per KV page, in every pool (FlashMLA / vLLM use 64)
INVALID = -1  # "no page / no position / no slot" in every page table, page list and top-k list
