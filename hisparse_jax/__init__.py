"""hisparse-jax: sparse-MLA (DSA) decoding with a KV store tiered across device and pinned host memory.

The top-level names are imported on first use (PEP 562), so `import hisparse_jax.calc` and `hisparse calc`
(pure Python) work where jax is not installed; `hisparse_jax.SparseMLAModel` etc. import jax when touched.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from hisparse_jax.config import PRESETS, CacheConfig, ModelConfig, RopeConfig, get_preset
    from hisparse_jax.engine import Engine, EngineConfig, SamplingParams
    from hisparse_jax.generate import generate
    from hisparse_jax.model.decoder import SparseMLAModel, decode_step
    from hisparse_jax.model.weights import (CheckpointError, load_pretrained, restore_params, save_params,
                                            save_pretrained)

# name -> module it comes from (the attribute has the same name there)
_EXPORTS = {
    "PRESETS": "hisparse_jax.config",
    "CacheConfig": "hisparse_jax.config",
    "ModelConfig": "hisparse_jax.config",
    "RopeConfig": "hisparse_jax.config",
    "get_preset": "hisparse_jax.config",
    "SparseMLAModel": "hisparse_jax.model.decoder",
    "decode_step": "hisparse_jax.model.decoder",
    "generate": "hisparse_jax.generate",
    "CheckpointError": "hisparse_jax.model.weights",
    "load_pretrained": "hisparse_jax.model.weights",
    "save_pretrained": "hisparse_jax.model.weights",
    "save_params": "hisparse_jax.model.weights",
    "restore_params": "hisparse_jax.model.weights",
    "Engine": "hisparse_jax.engine",
    "EngineConfig": "hisparse_jax.engine",
    "MeshEngine": "hisparse_jax.engine",
    "SamplingParams": "hisparse_jax.engine",
}

__all__ = [
    "PRESETS", "ModelConfig", "RopeConfig", "CacheConfig", "get_preset", "SparseMLAModel", "decode_step", "generate",
    "CheckpointError", "load_pretrained", "save_pretrained", "save_params", "restore_params", "Engine",
    "EngineConfig", "MeshEngine", "SamplingParams",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """An exported name (imported now, then cached here) or a submodule (`hisparse_jax.kv`, ...)."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":  # the submodule exists but something it imports does not
                raise
        else:
            return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Importing a submodule binds it as an attribute of its package: `import hisparse_jax.generate` would make
    `hisparse_jax.generate` the module, hiding the exported function of that name. Keep the exported object under
    an exported name instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (name in _EXPORTS and isinstance(value, types.ModuleType)
                and value.__name__ == f"{__name__}.{name}" and hasattr(value, name)):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
