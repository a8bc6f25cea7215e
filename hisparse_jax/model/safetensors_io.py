"""Strict reading of safetensors checkpoints (single files and Hugging Face checkpoint folders).

safetensors' numpy loader cannot materialize float8 tensors (NumPy has no float8 type), so files are
memory-mapped after their JSON header and the bytes viewed with the `ml_dtypes` types jax ships. Because
that bypasses the reference (Rust) reader, the same header validation is done here, and every failure is a
`CheckpointError` naming the file and, where there is one, the tensor.

One file (`read_safetensors`), in order:
  - at least 8 bytes; the little-endian u64 header length N is at most 100 MB (the reference reader's cap)
    and at most the file size - 8;
  - the N header bytes are UTF-8 JSON (surrounding whitespace allowed; no NaN/Infinity) whose top level is
    an object; no object in it repeats a key (the reference reader would silently keep the last one) or
    holds a lone surrogate escape in a key or string value;
  - `__metadata__`, if present, is null or a string -> string object;
  - every other entry is an object with `dtype` (one of `_ST_DTYPES`), `shape` (a list of at most
    `_MAX_NDIM` non-negative integers; booleans and floats are not integers) and `data_offsets` (a list of
    two integers 0 <= begin <= end); other keys are ignored, as the reference reader ignores them;
  - end - begin == itemsize * prod(shape), and the shape is one NumPy can represent;
  - when `__metadata__` holds `hisparse_jax.sha256` (the files `save_pretrained` writes), every tensor's bytes
    match their SHA-256 there;
  - sorted by offsets, the tensors tile the data section exactly: the first begins at 0, each begins where
    the previous ends (no gap, no overlap), and the last ends at the end of the file (file size - 8 - N).

A folder (`read_checkpoint_tensors`):
  - with `model.safetensors.index.json`: the index is a JSON object whose `weight_map` maps tensor names to
    file names (strings); a file name is relative, has no `..` part, and resolves (symlinks followed)
    inside the folder to an existing regular file (in a Hugging Face hub cache snapshot,
    `<repo>/snapshots/<rev>/`, inside `<repo>/blobs/`, where the hub keeps the files its links point to); each tensor is read from the file the index assigns it,
    which must contain it; tensors a file holds but the index does not assign to it are not read;
  - without an index: every `*.safetensors` file in the folder (confined the same way); a tensor name
    found in two files is an error naming both.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

from hisparse_jax.integrity import CheckpointError

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
MAX_HEADER_BYTES = 100_000_000  # the reference reader's limit
_MAX_NDIM = 32  # the smallest NumPy limit (NumPy 1.x); NumPy 2 allows 64
_MAX_INTP = np.iinfo(np.intp).max
INDEX_NAME = "model.safetensors.index.json"
CHECKSUM_KEY = "hisparse_jax.sha256"  # __metadata__ entry of the files save_pretrained writes


class _RepeatedKey(ValueError):
    pass


def _no_constant(name: str) -> Any:
    """json parse_constant: refuse NaN / Infinity, which are not JSON (the reference reader refuses them)."""
    raise ValueError(f"{name} is not a JSON value")


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object_pairs_hook: a dict, refusing a key given twice (the last would silently win) and keys or
    string values that are not Unicode (a lone surrogate escape such as \\ud800 raises UnicodeEncodeError)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        k.encode("utf-8")
        if isinstance(v, str):
            v.encode("utf-8")
        if k in out:
            raise _RepeatedKey(k)
        out[k] = v
    return out


def _load_json(text: str | bytes, where: str, what: str) -> Any:
    """Parse JSON text or raise CheckpointError('{where}: {what} ...')."""
    try:
        return json.loads(text, object_pairs_hook=_unique_object, parse_constant=_no_constant)
    except _RepeatedKey as e:
        raise CheckpointError(f"{where}: {what} repeats the key {e.args[0]!r}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{where}: {what} is not valid JSON ({e})") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_entry(path: str, name: str, info: Any) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, checked on its own (not against the others)."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: header entry is a {type(info).__name__}, not an object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise CheckpointError(f"{where}: header entry has no {key!r}")
    st_dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(st_dtype, str) or st_dtype not in _ST_DTYPES:
        raise CheckpointError(f"{where} has unsupported dtype {st_dtype!r} (supported: {', '.join(_ST_DTYPES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if len(shape) > _MAX_NDIM:
        raise CheckpointError(f"{where}: shape has {len(shape)} dimensions (at most {_MAX_NDIM})")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    dtype = np.dtype(_ST_DTYPES[st_dtype])
    if math.prod(d for d in shape if d) * dtype.itemsize > _MAX_INTP:
        raise CheckpointError(f"{where}: shape {shape} is too large for an array")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise CheckpointError(f"{where}: data_offsets {offsets} span {end - begin} bytes, but {st_dtype} "
                              f"{shape} needs {nbytes}")
    return dtype, tuple(shape), begin, end


def read_safetensors(path: str, *, with_metadata: bool = False):
    """The tensors of one .safetensors file, lazily memory-mapped, after checking its header (module doc); with
    `with_metadata`, (tensors, its `__metadata__` dict of strings)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: file of {size} bytes is too short for the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
            if n > size - 8:
                raise CheckpointError(f"{path}: header length {n} exceeds the {size - 8} bytes after it "
                                      "(truncated file?)")
            raw = f.read(n)
            if len(raw) != n:
                raise CheckpointError(f"{path}: read {len(raw)} of {n} header bytes (file changed?)")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CheckpointError(f"{path}: header is not valid UTF-8 ({e})") from None
            header = _load_json(text, path, "header")
            if not isinstance(header, dict):
                raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, not an object")
            meta = header.pop("__metadata__", None)
            if meta is not None and not (isinstance(meta, dict)
                                         and all(isinstance(v, str) for v in meta.values())):
                raise CheckpointError(f"{path}: __metadata__ is not an object of strings")
            entries = {name: _check_entry(path, name, info) for name, info in header.items()}
            data_len = size - 8 - n
            pos, prev = 0, None
            for name, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: kv[1][2:]):
                if begin > pos:
                    raise CheckpointError(f"{path}: tensor {name!r} begins at {begin}, leaving {begin - pos} "
                                          f"unused bytes after {'the header' if prev is None else repr(prev)}")
                if begin < pos:
                    raise CheckpointError(f"{path}: tensor {name!r} (bytes {begin}..{end}) overlaps "
                                          f"tensor {prev!r} (ending at {pos})")
                pos, prev = end, name
            if pos != data_len:
                raise CheckpointError(f"{path}: tensors end at byte {pos} of the data section, but it has "
                                      f"{data_len} bytes ({'truncated' if pos > data_len else 'trailing data'})")
            data = (np.memmap(f, dtype=np.uint8, mode="r", offset=8 + n, shape=(data_len,)) if data_len
                    else np.zeros(0, np.uint8))
            sums = _checksums(path, meta or {}, entries)
            if sums:
                bad = [name for name, (_, _, begin, end) in entries.items()
                       if hashlib.sha256(memoryview(data[begin:end])).hexdigest() != sums[name]]
                if bad:
                    raise CheckpointError(f"{path}: checksum mismatch in {len(bad)} tensor(s): "
                                          f"{', '.join(map(repr, bad[:10]))}{' ...' if len(bad) > 10 else ''} — "
                                          "the file is damaged")
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    tensors = {name: data[begin:end].view(dtype).reshape(shape)
               for name, (dtype, shape, begin, end) in entries.items()}
    return (tensors, dict(meta or {})) if with_metadata else tensors


def _checksums(path: str, meta: dict, entries: dict) -> dict[str, str]:
    """The per-tensor SHA-256s `save_pretrained` writes into `__metadata__[CHECKSUM_KEY]` (a JSON object of
    every tensor's hex digest); {} for files without them (e.g. the released checkpoints)."""
    if CHECKSUM_KEY not in meta:
        return {}
    try:
        sums = json.loads(meta[CHECKSUM_KEY])
    except ValueError as e:
        raise CheckpointError(f"{path}: __metadata__[{CHECKSUM_KEY!r}] is not JSON ({e})") from None
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()) or set(sums) != set(entries):
        raise CheckpointError(f"{path}: __metadata__[{CHECKSUM_KEY!r}] does not hold one checksum per tensor")
    return sums


def _roots(root: str) -> list[str]:
    """Where a checkpoint folder's files may live: the folder itself, and for a Hugging Face hub cache snapshot
    (`<repo>/snapshots/<revision>`, whose files are symlinks into `<repo>/blobs`) that repository's blobs."""
    parent = os.path.dirname(root)
    if os.path.basename(parent) == "snapshots":
        return [root, os.path.join(os.path.dirname(parent), "blobs")]
    return [root]


def _confined_file(folder: str, name: str, where: str) -> str:
    """folder/name, checked to be a relative name resolving to a regular file inside `folder`."""
    if (not name or "\0" in name or os.path.isabs(name)
            or ".." in name.replace(os.sep, "/").split("/")):
        raise CheckpointError(f"{where}: file name {name!r} is not a relative name inside the folder")
    full = os.path.join(folder, name)
    root, real = os.path.realpath(folder), os.path.realpath(full)
    if not any(real != r and os.path.commonpath([r, real]) == r for r in _roots(root)):
        raise CheckpointError(f"{where}: file {name!r} resolves to {real}, outside the folder {root}")
    if not os.path.isfile(real):
        raise CheckpointError(f"{where}: file {name!r} does not exist or is not a regular file")
    return full


def read_checkpoint_tensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint folder (lazily mapped), by Hugging Face name (checks: module doc).

    Raises FileNotFoundError when the folder has neither an index nor a `*.safetensors` file, and
    CheckpointError for everything else that is wrong.
    """
    path = os.fspath(path)
    index = os.path.join(path, INDEX_NAME)
    if not os.path.exists(index):
        files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        tensors: dict[str, np.ndarray] = {}
        source: dict[str, str] = {}
        for fn in files:
            fn = _confined_file(path, os.path.basename(fn), path)
            for name, t in read_safetensors(fn).items():
                if name in source:
                    raise CheckpointError(f"{path}: tensor {name!r} is in both {source[name]} and {fn} "
                                          f"(and no {INDEX_NAME} says which to use)")
                tensors[name], source[name] = t, fn
        return tensors
    try:
        with open(index, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"{index}: cannot read ({e})") from None
    doc = _load_json(raw, index, "index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: not a JSON object with a non-empty 'weight_map' object")
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        if not isinstance(fname, str):
            raise CheckpointError(f"{index}: tensor {name!r} maps to {fname!r}, not a file name")
        by_file.setdefault(fname, []).append(name)
    tensors = {}
    for fname, names in sorted(by_file.items()):
        fn = _confined_file(path, fname, index)
        found = read_safetensors(fn)
        absent = [n for n in names if n not in found]
        if absent:
            raise CheckpointError(f"{index} assigns {len(absent)} tensor(s) to {fn}, which does not contain "
                                  f"them: {', '.join(map(repr, absent[:10]))}{' ...' if len(absent) > 10 else ''}")
        tensors.update({n: found[n] for n in names})
    return tensors
