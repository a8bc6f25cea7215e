"""Prefill / decode disaggregation: a prefill-only run exports a request's KV to a file, a decode engine imports
it (`Engine.import_request`) instead of computing the prompt.

    export = export_prefill(model, prompt_ids, "req-7.safetensors")      # on the prefill side
    engine.import_request("req-7", "req-7.safetensors", SamplingParams(max_new_tokens=64))   # decode side

The file is one safetensors file (read back by the project's strict reader; every tensor carries its SHA-256):

    tokens       int32[T]      the prompt's token ids; row t of every tensor below is position t
    latent       [L, T, C]     the MLA latent of every layer (the model's dtype)
    rope         [L, T, R]     the rope key of every layer
    index_k      [LI, T, dI]   the indexer keys of every full-indexer layer
    last_logits  float32[V]    the logits the first new token is drawn from (sampled on the decode side with
                               the request's own `SamplingParams`, so tokens do not depend on where it ran)

and `__metadata__["hisparse_jax.prefill"]`, a JSON object {"format", "version", "model": the exporting model's
config}. The in-memory `PrefillExport` carries the same config (`PrefillExport.config`, filled by `export_prefill`
and `load_export`).

Importing refuses (`CheckpointError`, naming the file — or "prefill export" for an object — and what is wrong) a
damaged file, another format or version, tensors of the wrong count; and, from a file or an object alike (one
check, `check_export`): an export made by a model whose config differs from the engine's (naming the differing
fields) or that carries no config, tensors of the wrong shape or dtype (tokens not int32, KV rows not one
floating dtype — integer latents would be truncated silently —, last_logits not float32), token ids outside the
vocabulary, a prompt that leaves no position for a new token (max_position_embeddings), and NaN / Inf in the KV
rows or in `last_logits` (naming the tensor, the count and the first place). A file's shapes and prompt length are
checked from its header before any payload is read or hashed. `export_prefill` refuses such a prompt, and a
destination that is a folder (naming it), before it runs the forward.

The decode engine admits an imported request like a whole-prompt prefill: under "hisparse" its pages land all
resident when the device pool has room, otherwise its older pages go straight to the host tier (only the tail
pages, the hot buffer and the indexer keys on the device); under "preempt" / "offload" all resident. Rows are
written through a bounded device staging area of `IMPORT_CHUNK` tokens at a time. Host and device page ids are
the store's own, allocated by `PageManager` — the file carries positions, never page ids.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import struct

import numpy as np

from hisparse_jax.config import ModelConfig
from hisparse_jax.integrity import CheckpointError, digest, writing
from hisparse_jax.model.safetensors_io import CHECKSUM_KEY, MAX_HEADER_BYTES, read_safetensors
from hisparse_jax.validation import check_prompt

FORMAT = "hisparse_jax.prefill_export"
VERSION = 1
META_KEY = "hisparse_jax.prefill"
IMPORT_CHUNK = 1024  # prompt tokens per device staging write (a multiple of the 64-token page)


@dataclasses.dataclass(frozen=True)
class PrefillExport:
    """One request's prompt KV as a prefill run computed it (the file's tensors; see the module docstring)."""

    tokens: tuple[int, ...]
    latent: np.ndarray
    rope: np.ndarray
    index_k: np.ndarray
    last_logits: np.ndarray
    config: dict | None = None  # the exporting model's config (`export_config`), compared with the importer's

    @property
    def nbytes(self) -> int:
        """Bytes of KV rows the import moves to the device (latent, rope, indexer keys)."""
        return self.latent.nbytes + self.rope.nbytes + self.index_k.nbytes


def _shapes(cfg: ModelConfig, T: int) -> dict[str, tuple[int, ...]]:
    return {"tokens": (T,), "latent": (cfg.num_hidden_layers, T, cfg.kv_lora_rank),
            "rope": (cfg.num_hidden_layers, T, cfg.qk_rope_head_dim),
            "index_k": (cfg.num_indexer_layers, T, cfg.index_head_dim), "last_logits": (cfg.vocab_size,)}


def export_config(cfg: ModelConfig) -> dict:
    """What `PrefillExport.config` holds: a model config as JSON reads it back."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples as lists, as read back from JSON




KV_DTYPES = ("float32", "bfloat16", "float16")


def _nonfinite(a) -> tuple[int, tuple[int, ...]] | None:
    """(count, index of the first) of the NaN / Inf values of a floating array, or None; a layer at a time."""
    count, first = 0, None
    for i in range(a.shape[0]) if a.ndim > 1 else [None]:
        part = np.asarray(a if i is None else a[i])
        bad = ~np.isfinite(part)
        n = int(np.count_nonzero(bad))
        if n and first is None:
            at = tuple(int(x) for x in np.unravel_index(int(np.argmax(bad.reshape(-1))), part.shape))
            first = at if i is None else (i, *at)
        count += n
    return (count, first) if count else None


def _check_export(where: str, tokens, arrays: dict, config, cfg: ModelConfig) -> tuple[int, ...]:
    """The one check of an export (from a file or an object) against a model of config `cfg`: its token ids, or
    `CheckpointError('{where}: ...')`. `tokens` is a sequence of ids or an int32 array; `arrays` holds latent, rope,
    index_k and last_logits; `config` the exporting model's config (a `export_config` or a `ModelConfig`)."""
    ours = export_config(cfg)
    theirs = export_config(config) if isinstance(config, ModelConfig) else config
    if theirs is None:
        raise CheckpointError(f"{where}: carries no model config, so it cannot be told to fit this model; make it "
                              "with export_prefill or load_export (or set config=pd.export_config(cfg) of the "
                              "model that computed it)")
    if theirs != ours:
        diff = sorted(k for k in set(ours) | set(theirs if isinstance(theirs, dict) else {})
                      if not isinstance(theirs, dict) or theirs.get(k) != ours.get(k))
        raise CheckpointError(f"{where}: exported by a model with a different config (differing: "
                              f"{', '.join(diff[:8])}{' ...' if len(diff) > 8 else ''}); import it into an engine "
                              "running the model that exported it")
    array_tokens = hasattr(tokens, "dtype") and hasattr(tokens, "shape")
    if array_tokens:
        T = tokens.shape[0] if len(tokens.shape) == 1 else -1
        got = {"tokens": tuple(tokens.shape)}
    else:
        T = len(tokens) if isinstance(tokens, (list, tuple)) else -1
        got = {"tokens": (T,)}
    for name in ("latent", "rope", "index_k", "last_logits"):
        a = arrays[name]
        if not (hasattr(a, "dtype") and hasattr(a, "shape")):
            raise CheckpointError(f"{where}: {name} is a {type(a).__name__}, not an array")
        got[name] = tuple(a.shape)
    bad = [f"tensor {k!r} has shape {got[k]}, expected {v}" for k, v in _shapes(cfg, T).items() if got[k] != v]
    problem = "; ".join(bad) or ("no tokens" if T < 1 else _positions_problem(T, cfg))
    if problem:
        raise CheckpointError(f"{where}: does not fit this model: {problem}")
    logits_dtype = np.dtype(arrays["last_logits"].dtype)
    if (array_tokens and np.dtype(tokens.dtype) != np.int32) or logits_dtype != np.float32:
        raise CheckpointError(f"{where}: tokens must be int32 and last_logits float32 (got "
                              f"{np.dtype(tokens.dtype) if array_tokens else 'a sequence'}, {logits_dtype})")
    kinds = {np.dtype(arrays[n].dtype) for n in ("latent", "rope", "index_k")}
    if len(kinds) != 1 or not all(k.name in KV_DTYPES for k in kinds):
        raise CheckpointError(f"{where}: KV tensors must share one floating dtype ({', '.join(KV_DTYPES)}), got "
                              f"{sorted(map(str, kinds))}")
    try:
        ids = check_prompt(f"{where}: tokens", tokens.tolist() if array_tokens else tokens, cfg.vocab_size)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    for name in ("latent", "rope", "index_k", "last_logits"):
        found = _nonfinite(arrays[name])
        if found:
            n, at = found
            raise CheckpointError(f"{where}: tensor {name!r} holds {n} non-finite value(s) (NaN/Inf), the first at "
                                  f"index {list(at)}; the export is corrupt (or its prefill overflowed)")
    return tuple(ids)


def check_export(export: PrefillExport, cfg: ModelConfig) -> None:
    """Refuse (`CheckpointError`, a ValueError) an export object that does not fit a model of config `cfg`: the
    check `load_export` applies to a file (see the module docstring)."""
    if not isinstance(export, PrefillExport):
        raise CheckpointError(f"prefill export: expected a PrefillExport, got {type(export).__name__}")
    _check_export("prefill export", export.tokens, {n: getattr(export, n) for n in _shapes(cfg, 0) if n != "tokens"},
                  export.config, cfg)


def export_prefill(model, tokens, path: str | os.PathLike | None = None) -> PrefillExport:
    """Run the prompt's causal forward (`runner.prefill_rows`) and return its `PrefillExport`; with `path`,
    also write it there (`save_export`)."""
    from hisparse_jax.engine.runner import prefill_rows

    tokens = check_prompt("prompt", tokens, model.cfg.vocab_size)
    problem = _positions_problem(len(tokens), model.cfg)
    if problem:
        raise ValueError(f"prompt: {problem}")
    if path is not None:
        _check_target(path)  # before the forward, not after it
    last, latent, rope, index_k = prefill_rows(model, tokens)
    T = len(tokens)
    export = PrefillExport(tuple(int(t) for t in tokens), np.asarray(latent)[:, :T], np.asarray(rope)[:, :T],
                           np.asarray(index_k)[:, :T], np.asarray(last, np.float32), export_config(model.cfg))
    if path is not None:
        save_export(export, model.cfg, path)
    return export


def save_export(export: PrefillExport, cfg: ModelConfig, path: str | os.PathLike) -> None:
    """Write `export` (made by a model of config `cfg`) as one safetensors file at `path`. An export carrying
    another model's config is refused (ValueError): the file would claim the wrong model."""
    from safetensors.numpy import save_file

    theirs = export_config(export.config) if isinstance(export.config, ModelConfig) else export.config
    if theirs is not None and theirs != export_config(cfg):
        raise ValueError("save_export: the export carries the config of another model than `cfg`; save it with the "
                         "config of the model that computed it")

    tensors = {"tokens": np.asarray(export.tokens, np.int32), "latent": np.ascontiguousarray(export.latent),
               "rope": np.ascontiguousarray(export.rope), "index_k": np.ascontiguousarray(export.index_k),
               "last_logits": np.ascontiguousarray(export.last_logits, np.float32)}
    meta = {META_KEY: json.dumps({"format": FORMAT, "version": VERSION, "model": export_config(cfg)}),
            CHECKSUM_KEY: json.dumps({n: digest(t) for n, t in tensors.items()})}
    _check_target(path)
    with writing("a prefill export", path) as path:
        save_file(tensors, path, metadata=meta)


def _check_target(path) -> None:
    """Refuse (IsADirectoryError, naming it) a destination that is a folder: safetensors' own error names no
    path."""
    if os.path.isdir(os.fspath(path)):
        raise IsADirectoryError(errno.EISDIR, f"cannot write a prefill export at {os.fspath(path)}: it is a folder "
                                "(give a file name, e.g. <folder>/request.safetensors)")


def _positions_problem(T: int, cfg: ModelConfig) -> str | None:
    """What is wrong with a prompt of `T` tokens that leaves no position for a new token under the model's
    max_position_embeddings (an import of it could never decode), or None."""
    if T < cfg.max_position_embeddings:
        return None
    return (f"{T} tokens leave no position for a new token (max_position_embeddings {cfg.max_position_embeddings}; "
            f"a prompt has at most {cfg.max_position_embeddings - 1})")


def _check_header(path: str, cfg: ModelConfig) -> None:
    """Refuse (`CheckpointError`) from the safetensors header alone an export whose tensors' shapes do not fit a
    model of config `cfg` or whose prompt leaves no position for a new token. A header this cannot parse is left
    to the strict reader (`read_safetensors`), which names what is wrong with it."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(MAX_HEADER_BYTES, os.fstat(f.fileno()).st_size - 8):
                return
            header = json.loads(f.read(n))
        shapes = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
        T = int(shapes["tokens"][0]) if len(shapes.get("tokens", ())) == 1 else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, struct.error):
        return
    if T is None or set(shapes) != set(_shapes(cfg, 0)):
        return  # the full check names it
    bad = [f"tensor {k!r} has shape {shapes[k]}, expected {v}" for k, v in _shapes(cfg, T).items() if shapes[k] != v]
    problem = "; ".join(bad) or _positions_problem(T, cfg)
    if problem:
        raise CheckpointError(f"{path}: does not fit this model: {problem}")


def load_export(path: str | os.PathLike, cfg: ModelConfig) -> PrefillExport:
    """Read and check an export for a model of config `cfg` (`CheckpointError` on anything wrong)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no prefill export at {path}")
    _check_header(path, cfg)  # what the header alone tells, before any payload is read or hashed
    tensors, meta = read_safetensors(path, with_metadata=True)  # header and checksums checked
    if CHECKSUM_KEY not in meta:
        raise CheckpointError(f"{path}: no per-tensor checksums ({CHECKSUM_KEY}): not a prefill export")
    try:
        info = json.loads(meta[META_KEY])
    except (KeyError, ValueError):
        raise CheckpointError(f"{path}: not a prefill export (no valid {META_KEY!r} metadata)") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {info.get('format') if isinstance(info, dict) else None!r}, "
                              f"expected {FORMAT!r}")
    if info.get("version") != VERSION:
        raise CheckpointError(f"{path}: export format version {info.get('version')!r}; this version reads {VERSION}")
    if set(tensors) != set(_shapes(cfg, 0)):
        raise CheckpointError(f"{path}: tensors {sorted(tensors)}, expected {sorted(_shapes(cfg, 0))}")
    config = info.get("model")
    tokens = _check_export(path, tensors["tokens"], tensors, config, cfg)  # the check objects get too
    return PrefillExport(tokens, np.asarray(tensors["latent"]), np.asarray(tensors["rope"]),
                         np.asarray(tensors["index_k"]), np.asarray(tensors["last_logits"]), config)
