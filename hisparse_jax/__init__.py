"""hisparse-jax: sparse-MLA (DSA) decoding with a KV cache tiered across device and pinned host memory."""

from hisparse_jax.config import PRESETS, ModelConfig, RopeConfig, get_preset
from hisparse_jax.generate import generate
from hisparse_jax.model.decoder import SparseMLAModel, decode_step
from hisparse_jax.model.weights import (CheckpointError, load_pretrained, restore_params, save_params,
                                        save_pretrained)

__all__ = [
    "PRESETS", "ModelConfig", "RopeConfig", "get_preset", "SparseMLAModel", "decode_step", "generate", "CheckpointError",
    "load_pretrained", "save_pretrained", "save_params", "restore_params",
]
__version__ = "0.1.0"
