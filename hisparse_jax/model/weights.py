"""Hugging Face checkpoints <-> `SparseMLAModel`, and Orbax save/restore of the parameters.

Checkpoint layout: a directory with `config.json` and one or many `*.safetensors` files (with or
without `model.safetensors.index.json`), tensors named as transformers names them. Routed experts
are read either per expert (`mlp.experts.{j}.gate_proj.weight`, the released checkpoints and what
`save_pretrained` writes) or fused (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj`
[E, D, F], transformers' in-memory layout).

MTP: the released checkpoints store `num_nextn_predict_layers` multi-token-prediction layers after the main
ones, as `model.layers.{L + i}.*` (L = num_hidden_layers). They are ignored unless asked for
(`load_pretrained(..., mtp=True)`); then `mtp.{i}.block.X` reads `model.layers.{L+i}.X` (FP8 and expert layouts
as for the main layers), `mtp.{i}.{enorm,hnorm,eh_proj}` read `model.layers.{L+i}.{enorm,hnorm,eh_proj}.weight`,
`mtp.{i}.shared_head` / `mtp.{i}.shared_head_norm` read `model.layers.{L+i}.shared_head.head.weight` /
`model.layers.{L+i}.shared_head.norm.weight`, and the layer's `embed_tokens.weight` — a copy of the main
embedding, which the model uses — is checked to equal it. `save_pretrained` writes them back (with that copy)
for a model that has MTP layers.

FP8: a `*.weight` stored as float8_e4m3fn with a sibling `*.weight_scale_inv` float32
[ceil(out/128), ceil(in/128)] is dequantized as weight * scale, block by block.

Values, not only bytes: every tensor read into a parameter must have a floating dtype (an `I32` or `BOOL` tensor
where the model expects a float weight would otherwise load its bytes reinterpreted), and an FP8 weight's
`*_scale_inv` must be floating and finite (a NaN or Inf block scale would load NaN / Inf weights). Scales are
small, so checking them is cheap; weights are not scanned for finiteness.

safetensors 0.8's numpy/flax loaders cannot materialize float8 tensors (NumPy has no float8 type),
so files are read by memory-mapping them after their JSON header and viewing the bytes with the
`ml_dtypes` types jax ships; writing uses `safetensors.numpy.save_file`.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from hisparse_jax import integrity
from hisparse_jax.config import ModelConfig
from hisparse_jax.hf_config import from_hf_config, to_hf_config
from hisparse_jax.model.decoder import SparseMLAModel
from hisparse_jax.model.safetensors_io import (CHECKSUM_KEY, CheckpointError,  # noqa: F401
                                              read_checkpoint_tensors)

FP8_BLOCK = 128


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """float8 w [out, in] with per-block scales [ceil(out/block), ceil(in/block)] -> float32 [out, in]."""
    o, i = w.shape
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block, 0), block, 1)[:o, :i]
    return np.asarray(w, np.float32) * s


def quantize_fp8(w: np.ndarray, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """The inverse used to build test checkpoints: float [out, in] -> (e4m3 [out, in], scale_inv f32 blocks)."""
    w = np.asarray(w, np.float32)
    o, i = w.shape
    bo, bi = -(-o // block), -(-i // block)
    pad = np.zeros((bo * block, bi * block), np.float32)
    pad[:o, :i] = w
    amax = np.abs(pad.reshape(bo, block, bi, block)).max(axis=(1, 3))
    scale = np.maximum(amax, 1e-12) / 448.0
    s = np.repeat(np.repeat(scale, block, 0), block, 1)[:o, :i]
    return (w / s).astype(ml_dtypes.float8_e4m3fn), scale.astype(np.float32)


def layer_param_paths(model: SparseMLAModel) -> Iterator[tuple[tuple, tuple, int | None, nnx.Param]]:
    """Every parameter as checkpoints name it: (per-layer path, the model's path, index, variable).

    The main layers' parameters are stacked by runs of identical blocks (`decoder.layer_runs`): the model's path
    `("stacks", r, p, *rest)` holds [repeats, ...], and its slice j is layer `first + j * size + p`, whose
    per-layer path is `("layers", i, *rest)` and index j. Every other parameter is its own path, index None."""
    runs = model.runs
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param):
            continue
        if path[0] != "stacks":
            yield path, path, None, var
            continue
        run, p = runs[int(path[1])], int(path[2])
        for j in range(run.repeats):
            yield ("layers", run.first + j * run.size + p, *path[3:]), path, j, var


# an MTP layer's own parameters -> their names under `model.layers.{L + i}` (the rest is its decoder block)
_MTP_OWN = {"enorm": ["enorm"], "hnorm": ["hnorm"], "eh_proj": ["eh_proj"], "shared_head": ["shared_head", "head"],
            "shared_head_norm": ["shared_head", "norm"]}


def checkpoint_keys(path: tuple, num_hidden_layers: int | None = None) -> list[str]:
    """Our parameter path -> its path in the checkpoint's module tree (without "model."): the main model's as is,
    an MTP layer's (`mtp.{i}...`) moved under `layers.{num_hidden_layers + i}` as the checkpoints store it."""
    keys = [str(p) for p in path]
    if keys[0] != "mtp":
        return keys
    if num_hidden_layers is None:
        raise ValueError(f"naming MTP parameter {'.'.join(keys)} needs num_hidden_layers")
    layer = ["layers", str(num_hidden_layers + int(keys[1]))]
    if keys[2] == "block":
        return layer + keys[3:]
    return layer + _MTP_OWN[keys[2]] + keys[3:]


def hf_names(path: tuple, num_hidden_layers: int | None = None) -> list[tuple[str, bool, int | None, str | None]]:
    """Our parameter path -> [(HF name, transpose, expert index or None, part)]. Experts map to many names.
    `num_hidden_layers` is needed for an MTP layer's parameters (see `checkpoint_keys`)."""
    keys = checkpoint_keys(path, num_hidden_layers)
    if keys == ["embed_tokens"]:
        return [("model.embed_tokens.weight", False, None, None)]
    if keys[0] == "lm_head":
        return [("lm_head.weight", True, None, None)]
    prefix = "model." + ".".join(keys[:-1])
    leaf = keys[-1]
    if leaf == "kernel":
        return [(prefix + ".weight", True, None, None)]
    if keys[-2:] == ["gate", "weight"] and "mlp" in keys:  # router [D, E] <- [E, D]
        return [(prefix + ".weight", True, None, None)]
    return [(prefix + "." + leaf, False, None, None)]


def _expert_part_names(prefix: str, part: str, e: int) -> list[str]:
    proj = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}[part]
    return [f"{prefix}.{j}.{proj}.weight" for j in range(e)]


def load_pretrained(path: str | os.PathLike, dtype=None, *, mtp: bool = False, **model_kwargs) -> SparseMLAModel:
    """Read a Hugging Face checkpoint directory into a `SparseMLAModel`.

    dtype: parameter dtype (default: the checkpoint's `dtype`/`torch_dtype`, else bfloat16). The router
    and the indexer's `weights_proj` stay float32 as in transformers. mtp: also build and read the checkpoint's
    `num_nextn_predict_layers` MTP layers (`model.layers.{L + i}.*`; ignored otherwise). Raises `CheckpointError`
    listing every missing or mis-shaped tensor, every tensor stored with a non-floating dtype where the model
    expects a floating weight (and FP8 block scales that are not floating), every FP8 block scale holding NaN or
    Inf (with the number of such blocks), and an MTP layer's `embed_tokens` copy that differs from the main
    embedding.
    """
    path = os.fspath(path)
    cfg = from_hf_config(path)
    if dtype is not None:
        cfg = cfg.replace(dtype=jnp.dtype(dtype).name)
    if mtp and cfg.num_nextn_predict_layers < 1:
        raise CheckpointError(f"checkpoint {path} has no MTP layers (num_nextn_predict_layers is "
                              f"{cfg.num_nextn_predict_layers} in its config.json); load it with mtp=False")
    tensors = read_checkpoint_tensors(path)
    model = nnx.eval_shape(lambda: SparseMLAModel(cfg, rngs=nnx.Rngs(0), mtp=mtp, **model_kwargs))
    L = cfg.num_hidden_layers
    used, missing, misshaped, differing = set(), [], [], []
    mistyped, nonfinite = [], []  # bytes that read fine but mean nothing as a weight / as a block scale

    def fetch(name: str, expect=None) -> np.ndarray | None:
        """The tensor `name` as a floating array for a parameter of dtype `expect` (FP8 dequantized), or None
        after recording why it cannot be used."""
        if name not in tensors:
            missing.append(name)
            return None
        used.add(name)
        w = tensors[name]
        if not jnp.issubdtype(w.dtype, jnp.floating):  # e.g. an F32 weight's bytes declared as I32
            mistyped.append(f"{name}: stored as {np.dtype(w.dtype).name}, but the model expects a floating "
                            f"weight ({np.dtype(expect).name if expect is not None else 'float'})")
            return None
        if w.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
            sname = name + "_scale_inv"
            if sname not in tensors:
                missing.append(sname)
                return None
            used.add(sname)
            scale = tensors[sname]
            want = tuple(-(-n // FP8_BLOCK) for n in w.shape)
            if w.ndim != 2 or tuple(scale.shape) != want:
                misshaped.append(f"{sname}: expected {want} block scales for weight {tuple(w.shape)}, "
                                 f"got {tuple(scale.shape)}")
                return None
            if not jnp.issubdtype(scale.dtype, jnp.floating):
                mistyped.append(f"{sname}: FP8 block scale stored as {np.dtype(scale.dtype).name}, expected a "
                                "floating dtype (float32)")
                return None
            bad = int(np.count_nonzero(~np.isfinite(np.asarray(scale, np.float32))))  # scales are small
            if bad:
                nonfinite.append(f"{sname}: {bad} of {scale.size} FP8 block scale(s) are not finite (NaN/Inf), "
                                 f"which would make weight {name} NaN/Inf")
                return None
            return dequantize_fp8(w, scale)
        return np.asarray(w)

    values: dict[tuple, dict] = {}  # the model's path -> {index in the stack (None: not stacked): value}
    for path_, model_path, j, var in layer_param_paths(model):
        keys = checkpoint_keys(path_, L)
        want = var.get_value().shape if j is None else var.get_value().shape[1:]
        pdtype = var.get_value().dtype
        if keys[-2:-1] == ["experts"] and keys[-1] in ("gate", "up", "down"):
            value = _load_experts(keys, tensors, lambda n, d=pdtype: fetch(n, d), used, want)
        else:
            [(name, transpose, _, _)] = hf_names(path_, L)
            value = fetch(name, pdtype)
            if value is not None and transpose:
                value = value.T
        if value is None:
            continue
        if tuple(value.shape) != tuple(want):
            misshaped.append(f"{'.'.join(keys)}: expected {tuple(want)}, got {tuple(value.shape)}")
            continue
        values.setdefault(model_path, {})[j] = value.astype(var.get_value().dtype)
    main_embed = "model.embed_tokens.weight"
    for i in range(_num_mtp(model)):  # the MTP layers' embedding copies, when stored, must be the main embedding
        name = f"model.layers.{L + i}.embed_tokens.weight"
        if name in tensors and main_embed in tensors:
            edtype = model.embed_tokens.get_value().dtype
            copy = fetch(name, edtype)
            main = fetch(main_embed, edtype) if copy is not None else None  # None: unusable, already reported
            if copy is not None and main is not None and not _same_values(copy, main):
                differing.append(f"{name} differs from {main_embed} (an MTP layer's embedding must be a copy of "
                                 "the main one, which the model uses)")
    if missing or misshaped or differing or mistyped or nonfinite:
        mistyped = list(dict.fromkeys(mistyped))  # the main embedding is fetched twice when MTP copies it
        lines = []
        if missing:
            lines.append(f"{len(missing)} missing tensor(s): " + ", ".join(missing[:20])
                         + (" ..." if len(missing) > 20 else ""))
        if misshaped:
            lines.append(f"{len(misshaped)} mis-shaped tensor(s): " + "; ".join(misshaped[:20]))
        if mistyped:
            lines.append(f"{len(mistyped)} tensor(s) with a non-floating dtype: " + "; ".join(mistyped[:20])
                         + (" ..." if len(mistyped) > 20 else ""))
        if nonfinite:
            lines.append(f"{len(nonfinite)} non-finite FP8 scale tensor(s): " + "; ".join(nonfinite[:20])
                         + (" ..." if len(nonfinite) > 20 else ""))
        if differing:
            lines.append("; ".join(differing))
        what = ("does not match its config" if missing or misshaped or differing or mistyped
                else "holds unusable values")
        raise CheckpointError(f"checkpoint {path} {what}: " + " | ".join(lines))
    state = nnx.state(model)
    flat = dict(nnx.to_flat_state(state))
    for p, parts in values.items():
        v = parts[None] if None in parts else np.stack([parts[j] for j in range(len(parts))])
        flat[p] = flat[p].replace(jnp.asarray(v))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def _same_values(a: np.ndarray, b: np.ndarray, rows: int = 4096) -> bool:
    """Equal shapes and values, compared a block of rows at a time (the arrays may be memory-mapped)."""
    if a.shape != b.shape:
        return False
    return all(np.array_equal(np.asarray(a[r:r + rows]), np.asarray(b[r:r + rows]))
               for r in range(0, a.shape[0], rows))


def _load_experts(keys, tensors, fetch, used, want):
    """Stack per-expert matrices (or split the fused layout) into gate/up [E, D, F] / down [E, F, D]."""
    prefix = "model." + ".".join(keys[:-1])
    part = keys[-1]
    e = want[0]
    per = _expert_part_names(prefix, part, e)
    if per[0] in tensors:
        mats = [fetch(n) for n in per]
        if any(m is None for m in mats):
            return None
        return np.stack([m.T for m in mats])
    fused = prefix + (".down_proj" if part == "down" else ".gate_up_proj")
    w = fetch(fused)  # gate_up [E, 2F, D] or down [E, D, F]
    if w is None:
        return None
    if part == "down":
        return np.swapaxes(w, 1, 2)
    f = w.shape[1] // 2
    return np.swapaxes(w[:, :f] if part == "gate" else w[:, f:], 1, 2)


def _num_mtp(model: SparseMLAModel) -> int:
    mtp = getattr(model, "mtp", None)
    return 0 if mtp is None else len(mtp)


def model_to_hf_tensors(model: SparseMLAModel) -> dict[str, np.ndarray]:
    """Every parameter under its Hugging Face name; a model with MTP layers also gets each MTP layer's
    `embed_tokens.weight` copy of the main embedding, as the released checkpoints store it."""
    out = {}
    L = model.cfg.num_hidden_layers
    for path_, _, j, var in layer_param_paths(model):
        keys = checkpoint_keys(path_, L)
        value = np.asarray(jax.device_get(var.get_value() if j is None else var.get_value()[j]))
        if keys[-2:-1] == ["experts"] and keys[-1] in ("gate", "up", "down"):
            for j, name in enumerate(_expert_part_names("model." + ".".join(keys[:-1]), keys[-1], value.shape[0])):
                out[name] = np.ascontiguousarray(value[j].T)
            continue
        [(name, transpose, _, _)] = hf_names(path_, L)
        out[name] = np.ascontiguousarray(value.T if transpose else value)
    for i in range(_num_mtp(model)):
        out[f"model.layers.{L + i}.embed_tokens.weight"] = out["model.embed_tokens.weight"].copy()
    return out


def save_pretrained(model: SparseMLAModel, path: str | os.PathLike, max_shard_bytes: int = 4 << 30) -> None:
    """Write `config.json` and safetensors shards (+ index when sharded) with Hugging Face names. Each shard's
    `__metadata__` carries every tensor's SHA-256 (`hisparse_jax.sha256`), which reading it back verifies.
    The MTP layers the model has are written too; config.json's `num_nextn_predict_layers` is their number (0 for
    a model built without them, whatever its config said: the file describes the tensors written). A write error
    names `path`."""
    with integrity.writing("a Hugging Face checkpoint", path) as path:
        os.makedirs(path, exist_ok=True)
        _write_hf(model, path, max_shard_bytes)


def _write_hf(model: SparseMLAModel, path: str, max_shard_bytes: int) -> None:
    from safetensors.numpy import save_file

    cfg = model.cfg.replace(dtype=jnp.dtype(model.dtype).name, num_nextn_predict_layers=_num_mtp(model))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_config(cfg), f, indent=2)
    tensors = model_to_hf_tensors(model)
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = tensors[name]
        size += nbytes
    shards.append(cur)
    for old in glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "*.safetensors.index.json")):
        os.remove(old)

    def meta(shard: dict) -> dict[str, str]:  # a checksum per tensor, verified when the file is read back
        return {"format": "pt", CHECKSUM_KEY: json.dumps({n: integrity.digest(t) for n, t in shard.items()})}

    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata=meta(shards[0]))
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        fn = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fn), metadata=meta(shard))
        weight_map.update({n: fn for n in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map},
                  f, indent=2)


PARAMS_MANIFEST = "hisparse_manifest.json"  # next to Orbax's files: dtype, shape and SHA-256 of every parameter
PARAMS_FORMAT = "hisparse_jax.params"


def save_params(model: SparseMLAModel, path: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Orbax checkpoint of the parameters (directory `path`), with a manifest of every parameter's dtype, shape
    and checksum that `restore_params` verifies.

    `path` must not exist (FileExistsError naming it), unless `overwrite=True`: then an existing save_params
    checkpoint there (a folder holding `hisparse_manifest.json` or Orbax's `_CHECKPOINT_METADATA`), or an empty
    folder, is removed first; anything else (another folder, a file, a symbolic link) is refused, never deleted. A
    write error names `path` (not Orbax's temporary folder next to it)."""
    import shutil

    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if os.path.lexists(path):
        if not overwrite:
            raise FileExistsError(f"{path} already exists; save_params(..., overwrite=True) replaces a checkpoint "
                                  "it wrote there")
        if os.path.islink(path) or not os.path.isdir(path):
            what = "a symbolic link" if os.path.islink(path) else "not a folder"
            raise FileExistsError(f"{path} exists and is {what}; not removing it, even with overwrite=True")
        entries = os.listdir(path)
        if entries and not {PARAMS_MANIFEST, "_CHECKPOINT_METADATA"} & set(entries):
            raise FileExistsError(f"{path} exists and is not a save_params checkpoint (it has no {PARAMS_MANIFEST} "
                                  "or _CHECKPOINT_METADATA); not removing it, even with overwrite=True")
        shutil.rmtree(path)
    state = nnx.state(model, nnx.Param)
    with integrity.writing("a parameter checkpoint", path):
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(path, state)
        with open(os.path.join(path, PARAMS_MANIFEST), "w") as f:
            json.dump({"format": PARAMS_FORMAT, "version": 1,
                       "arrays": integrity.manifest(integrity.named_leaves(state))}, f)


def restore_params(path: str | os.PathLike, cfg: ModelConfig, verify: bool = True, **model_kwargs) -> SparseMLAModel:
    """A `SparseMLAModel` for `cfg` with the parameters of an Orbax checkpoint written by `save_params`.

    Before reading, the saved parameters' dtypes and shapes are compared with those `cfg` implies; after, every
    parameter's checksum. A difference, a missing manifest or data Orbax cannot read is a `CheckpointError`
    naming the parameter. `verify=False` skips the checks (for checkpoints written without a manifest)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no parameter checkpoint at {path}")
    abstract = nnx.eval_shape(lambda: SparseMLAModel(cfg, rngs=nnx.Rngs(0), **model_kwargs))
    target = nnx.state(abstract, nnx.Param)
    man = _read_params_manifest(path) if verify else None
    if man is not None:
        integrity.check_description(man, integrity.named_leaves(target), path, "the model config")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(path, target)
    except Exception as e:  # Orbax/TensorStore errors name neither the cause nor the parameter clearly
        # a damaged compressed chunk fails to decode before any checksum can be compared; TensorStore's message
        # holds the array's path ('path': 'layers.2.self_attn.q_a_proj.kernel.value/'), which names the parameter
        m = re.search(r"'path': '([A-Za-z_][\w.]*?)(?:\.value)?/'", str(e))
        what = f"parameter {m.group(1)} could not be read" if m else "the parameters could not be restored"
        raise CheckpointError(f"{path}: {what}: the checkpoint is damaged or was not written by save_params "
                              f"({type(e).__name__}: {str(e)[:400]})") from e
    if man is not None:
        integrity.verify(man, integrity.named_leaves(restored), path)
    nnx.update(abstract, restored)
    return abstract


def _read_params_manifest(path: str) -> dict:
    fn = os.path.join(path, PARAMS_MANIFEST)
    if not os.path.exists(fn):
        raise CheckpointError(f"{path}: no {PARAMS_MANIFEST}, so the parameters cannot be verified (written by "
                              "an older save_params, or not a save_params checkpoint); restore_params(..., "
                              "verify=False) skips the checks")
    try:
        with open(fn) as f:
            meta = json.load(f)
        if meta.get("format") != PARAMS_FORMAT or not isinstance(meta.get("arrays"), dict):
            raise ValueError(f"format {meta.get('format')!r}")
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"{fn}: not a readable parameter manifest ({e})") from None
    return meta["arrays"]
