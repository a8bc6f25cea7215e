"""What the library under test says about itself when a gpu_check section runs: the public entry points' defaults
(which decode variant a caller gets) and the store's fetch options. Other work changes them under the script, so
a section records them rather than assuming them."""

from __future__ import annotations

import dataclasses
import inspect


def entry_defaults(fn) -> dict:
    """A public entry point's keyword defaults: name -> repr(default)."""
    return {k: repr(p.default) for k, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def fetch_defaults() -> dict:
    """CacheConfig's fetch options (every field named fetch*) and their defaults."""
    from hisparse_jax.config import CacheConfig

    return {f.name: f.default for f in dataclasses.fields(CacheConfig) if f.name.startswith("fetch")}


def decode_and_fetch() -> dict:
    """The public sparse MLA decode's defaults and the fetch options, for a section's record."""
    from pallas_kernels.sparse_mla_decode import sparse_mla_decode

    return {"sparse_mla_decode": entry_defaults(sparse_mla_decode), "cache_fetch": fetch_defaults()}
