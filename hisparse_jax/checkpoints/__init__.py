"""Checkpoints that ship with the package (Hugging Face layout: config.json + model.safetensors + a model card).

    from hisparse_jax import checkpoints
    model = checkpoints.load("stdlib-dsa")     # = load_pretrained(checkpoints.path("stdlib-dsa"))

`stdlib-dsa`: the small DSA model trained on the Python standard library's sources
(`experiments/train_locality_model.py`; its card is `stdlib-dsa/README.md`, its log `training_log.json`). It is
what `hisparse demo` runs by default, so that hit rates come from attention that has learned real text.
`stdlib-dsa-8k`: the same model taught an 8K-byte context, where top-k 128 is 1.6 % of it (GLM-5's 2048 of 128K):
`--recipe long8k`, its card `stdlib-dsa-8k/README.md`.
"""

from __future__ import annotations

import os

SHIPPED = ("stdlib-dsa", "stdlib-dsa-8k")
DEFAULT = "stdlib-dsa"
_HERE = os.path.dirname(os.path.abspath(__file__))


def path(name: str = DEFAULT) -> str:
    """The folder of shipped checkpoint `name`; ValueError for an unknown name, FileNotFoundError when the
    package was installed without its data."""
    if name not in SHIPPED:
        raise ValueError(f"unknown shipped checkpoint {name!r}; shipped: {', '.join(SHIPPED)}")
    folder = os.path.join(_HERE, name)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"the shipped checkpoint {name!r} is missing ({folder} has no config.json): "
                                "reinstall hisparse-jax, or train it with experiments/train_locality_model.py")
    return folder


def resolve(name_or_dir: str) -> str:
    """A shipped checkpoint's name or a checkpoint folder (one with a config.json) -> the folder; ValueError
    saying which was expected otherwise."""
    if not isinstance(name_or_dir, (str, os.PathLike)):
        raise ValueError(f"expected a shipped checkpoint's name ({', '.join(SHIPPED)}) or a checkpoint folder, got "
                         f"{type(name_or_dir).__name__}")
    if name_or_dir in SHIPPED:
        return path(name_or_dir)
    if os.path.isfile(os.path.join(name_or_dir, "config.json")):
        return name_or_dir
    raise ValueError(f"{name_or_dir!r} is neither a shipped checkpoint ({', '.join(SHIPPED)}) nor a folder with a "
                     "config.json")


def load(name_or_dir: str = DEFAULT, dtype=None, **kwargs):
    """`load_pretrained` of a shipped checkpoint (by name) or a checkpoint folder."""
    from hisparse_jax.model.weights import load_pretrained

    return load_pretrained(resolve(name_or_dir), dtype, **kwargs)
