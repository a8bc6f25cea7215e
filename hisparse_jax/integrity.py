"""Integrity of what the project saves: a manifest of every array (dtype, shape, SHA-256 of its bytes) written at
save time and checked at restore time.

Orbax stores no checksums: a flipped byte in a saved array restores without error and decodes garbage. So
`save_params`, `save_tiered` and `save_pretrained` write a manifest next to the data, and their loaders
(1) compare the manifest's dtypes and shapes with what the description (model config, `CacheConfig`) expects, before
reading anything, and (2) hash every restored array and compare. Any difference is a `CheckpointError` naming
the file and the array.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from typing import Any, Iterator, Mapping

import jax
import numpy as np

ALGORITHM = "sha256"


class CheckpointError(ValueError):
    """A checkpoint, saved tiered store or exported file that is damaged or does not match its description; the message
    names the file and the tensor or array."""


def digest(x: Any) -> str:
    """SHA-256 of an array's bytes (C order), after fetching it to the host."""
    a = np.ascontiguousarray(jax.device_get(x))
    return hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest()


def json_digest(obj: Any) -> str:
    """SHA-256 of a JSON-serialisable object in canonical form (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def named_leaves(tree: Any) -> dict[str, Any]:
    """Leaves of a pytree by dotted key path ("layers.0.self_attn.q_b_proj.kernel"), the names manifests use (a
    Variable's own `.value` level is left out, so the names do not depend on how flax flattens variables)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = {}
    for path, leaf in leaves:
        parts = [str(next((getattr(k, a) for a in ("key", "idx", "name") if hasattr(k, a)), k)) for k in path]
        while parts and parts[-1] in ("value", "raw_value"):
            parts.pop()
        out[".".join(parts)] = leaf
    return out


def manifest(arrays: Mapping[str, Any]) -> dict[str, dict]:
    """{name: {"dtype", "shape", "sha256"}} of named arrays."""
    return {name: {"dtype": np.dtype(a.dtype).name, "shape": list(a.shape), ALGORITHM: digest(a)}
            for name, a in arrays.items()}


def check_description(man: Mapping[str, Mapping], expected: Mapping[str, Any], where: str, described_by: str) -> None:
    """Refuse a manifest whose arrays (names, dtypes, shapes) differ from `expected` ({name: array-like with
    .dtype/.shape}, derived from the description), before any data is read."""
    problems = []
    for name in sorted(set(expected) - set(man)):
        problems.append(f"array {name} is missing")
    for name in sorted(set(man) - set(expected)):
        problems.append(f"array {name} is not expected by {described_by}")
    for name in sorted(set(man) & set(expected)):
        m, e = man[name], expected[name]
        try:
            saved = (np.dtype(m["dtype"]).name, tuple(int(n) for n in m["shape"]))
        except (KeyError, TypeError, ValueError) as err:
            problems.append(f"array {name} has a malformed manifest entry {m!r} ({err})")
            continue
        want = (np.dtype(e.dtype).name, tuple(e.shape))
        if saved != want:
            problems.append(f"array {name} was saved as {saved[0]}{list(saved[1])}, expected {want[0]}{list(want[1])} "
                            f"from {described_by}")
    if problems:
        raise CheckpointError(f"{where}: does not match its description: " + "; ".join(problems[:12])
                              + (f" (and {len(problems) - 12} more)" if len(problems) > 12 else ""))


def verify(man: Mapping[str, Mapping], arrays: Mapping[str, Any], where: str) -> None:
    """Refuse restored arrays whose bytes differ from the checksums written at save time."""
    bad = [name for name, a in arrays.items() if digest(a) != man[name].get(ALGORITHM)]
    if bad:
        raise CheckpointError(f"{where}: checksum mismatch in {len(bad)} array(s): {', '.join(bad[:12])}"
                              + (" ..." if len(bad) > 12 else "") + " — the saved data is damaged")


@contextlib.contextmanager
def writing(what: str, path: str | os.PathLike) -> Iterator[str]:
    """Write `what` at `path` inside this block: its parent folder is made first, and an `OSError` while writing
    (a full disk, a parent that is a file, no permission) is raised again, of the same class, naming `path` — not
    the temporary file or folder a library writes next to it (Orbax writes `<path>.orbax-checkpoint-tmp` and
    renames it). Yields `path` as a string."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    try:
        if os.path.lexists(parent) and not os.path.isdir(parent):
            raise NotADirectoryError(errno.ENOTDIR, f"{parent} is not a folder")
        os.makedirs(parent, exist_ok=True)
        yield path
    except OSError as e:
        msg = f"cannot write {what} at {path}: {e.strerror or e}"
        try:
            err = type(e)(e.errno, msg) if e.errno is not None else type(e)(msg)
        except Exception:  # a subclass with a constructor of its own
            err = OSError(e.errno, msg)
        raise err from e


def write_description(fn: str, meta: dict) -> None:
    """Write the JSON description `meta` of a saved object to `fn` under its SHA-256 (`meta_sha256`, which
    `read_description` checks)."""
    with open(fn, "w") as f:
        json.dump({**meta, "meta_sha256": json_digest(meta)}, f)


def read_description(fn: str, what: str, fmt: str, version: int, *, holds: str, versions: str = "") -> dict:
    """The JSON description at `fn` of a saved `what` (e.g. "PageManager"), refused unless it exists
    (FileNotFoundError), is readable JSON of format `fmt` and `version`, and its checksum (`write_description`)
    matches: a `CheckpointError` naming the file, what it `holds` when edited, and `versions` (what older versions
    lacked) when another version wrote it."""
    path = os.path.dirname(fn)
    if not os.path.exists(fn):
        raise FileNotFoundError(f"no saved {what} at {path} (no {os.path.basename(fn)})")
    try:
        with open(fn) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{fn}: not readable JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        raise CheckpointError(f"{path} is not a saved {what} (format "
                              f"{meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") != version:
        raise CheckpointError(f"{fn}: saved by format version {meta.get('version')!r}; this version reads {version}"
                              + (f" ({versions})" if versions else ""))
    if meta.get("meta_sha256") != json_digest({k: v for k, v in meta.items() if k != "meta_sha256"}):
        raise CheckpointError(f"{fn}: checksum mismatch — the description ({holds}) was edited or damaged")
    return meta
