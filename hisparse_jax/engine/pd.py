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
config}. Importing refuses (`CheckpointError`, naming the file and what is wrong) a damaged file, another format
or version, tensors of the wrong shape, dtype or count, and an export made by a model whose config differs from
the engine's (naming the differing fields).

The decode engine admits an imported request like a whole-prompt prefill: under "hisparse" its pages land all
resident when the device pool has room, otherwise its older pages go straight to the host tier (only the tail
pages, the hot buffer and the indexer keys on the device); under "preempt" / "offload" all resident. Rows are
written through a bounded device staging area of `IMPORT_CHUNK` tokens at a time. Host and device page ids are
the store's own, allocated by `TieredCache` — the file carries positions, never page ids.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from hisparse_jax.config import ModelConfig
from hisparse_jax.integrity import CheckpointError, digest
from hisparse_jax.model.safetensors_io import CHECKSUM_KEY, read_safetensors
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

    @property
    def nbytes(self) -> int:
        """Bytes of KV rows the import moves to the device (latent, rope, indexer keys)."""
        return self.latent.nbytes + self.rope.nbytes + self.index_k.nbytes


def _shapes(cfg: ModelConfig, T: int) -> dict[str, tuple[int, ...]]:
    return {"tokens": (T,), "latent": (cfg.num_hidden_layers, T, cfg.kv_lora_rank),
            "rope": (cfg.num_hidden_layers, T, cfg.qk_rope_head_dim),
            "index_k": (cfg.num_indexer_layers, T, cfg.index_head_dim), "last_logits": (cfg.vocab_size,)}


def _config_dict(cfg: ModelConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples as lists, as read back from JSON


def check_export(export: PrefillExport, cfg: ModelConfig) -> None:
    """Refuse (ValueError) an export whose tensors do not fit a model of config `cfg`."""
    T = len(export.tokens)
    got = {"tokens": (T,), "latent": export.latent.shape, "rope": export.rope.shape,
           "index_k": export.index_k.shape, "last_logits": export.last_logits.shape}
    bad = [f"{k} {tuple(got[k])} (expected {v})" for k, v in _shapes(cfg, T).items() if tuple(got[k]) != v]
    if T < 1 or bad:
        raise ValueError(f"prefill export does not fit this model: {'; '.join(bad) or 'no tokens'}")


def export_prefill(model, tokens, path: str | os.PathLike | None = None) -> PrefillExport:
    """Run the prompt's causal forward (`runner.prefill_rows`) and return its `PrefillExport`; with `path`,
    also write it there (`save_export`)."""
    from hisparse_jax.engine.runner import prefill_rows

    tokens = check_prompt("prompt", tokens, model.cfg.vocab_size)
    last, latent, rope, index_k = prefill_rows(model, tokens)
    T = len(tokens)
    export = PrefillExport(tuple(int(t) for t in tokens), np.asarray(latent)[:, :T], np.asarray(rope)[:, :T],
                           np.asarray(index_k)[:, :T], np.asarray(last, np.float32))
    if path is not None:
        save_export(export, model.cfg, path)
    return export


def save_export(export: PrefillExport, cfg: ModelConfig, path: str | os.PathLike) -> None:
    """Write `export` (made by a model of config `cfg`) as one safetensors file at `path`."""
    from safetensors.numpy import save_file

    tensors = {"tokens": np.asarray(export.tokens, np.int32), "latent": np.ascontiguousarray(export.latent),
               "rope": np.ascontiguousarray(export.rope), "index_k": np.ascontiguousarray(export.index_k),
               "last_logits": np.ascontiguousarray(export.last_logits, np.float32)}
    meta = {META_KEY: json.dumps({"format": FORMAT, "version": VERSION, "model": _config_dict(cfg)}),
            CHECKSUM_KEY: json.dumps({n: digest(t) for n, t in tensors.items()})}
    save_file(tensors, os.fspath(path), metadata=meta)


def load_export(path: str | os.PathLike, cfg: ModelConfig) -> PrefillExport:
    """Read and check an export for a model of config `cfg` (`CheckpointError` on anything wrong)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no prefill export at {path}")
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
    theirs, ours = info.get("model"), _config_dict(cfg)
    if theirs != ours:
        diff = sorted(k for k in set(ours) | set(theirs if isinstance(theirs, dict) else {})
                      if not isinstance(theirs, dict) or theirs.get(k) != ours.get(k))
        raise CheckpointError(f"{path}: exported by a model with a different config (differing: "
                              f"{', '.join(diff[:8])}{' ...' if len(diff) > 8 else ''}); import it into an engine "
                              "running the model that exported it")
    if set(tensors) != set(_shapes(cfg, 0)):
        raise CheckpointError(f"{path}: tensors {sorted(tensors)}, expected {sorted(_shapes(cfg, 0))}")
    T = tensors["tokens"].shape[0] if tensors["tokens"].ndim == 1 else -1
    want = _shapes(cfg, T)
    for name, shape in want.items():
        if T < 1 or tensors[name].shape != shape:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tensors[name].shape}, expected {shape}")
    if tensors["tokens"].dtype != np.int32 or tensors["last_logits"].dtype != np.float32:
        raise CheckpointError(f"{path}: tokens must be int32 and last_logits float32 (got "
                              f"{tensors['tokens'].dtype}, {tensors['last_logits'].dtype})")
    kinds = {tensors[n].dtype for n in ("latent", "rope", "index_k")}
    if len(kinds) != 1 or not all(k.name in ("float32", "bfloat16", "float16") for k in kinds):
        raise CheckpointError(f"{path}: KV tensors must share one floating dtype, got {sorted(map(str, kinds))}")
    try:
        tokens = check_prompt(f"{path}: tokens", tensors["tokens"].tolist(), cfg.vocab_size)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return PrefillExport(tuple(tokens), np.asarray(tensors["latent"]), np.asarray(tensors["rope"]),
                         np.asarray(tensors["index_k"]), np.asarray(tensors["last_logits"]))
