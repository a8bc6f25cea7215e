"""Training text that every machine has offline: the Python standard library's own sources, as bytes.

The corpus is the `.py` files under the running interpreter's stdlib directory (`sysconfig`), in sorted path
order, without `site-packages` and without test suites (`test`/`tests`/`idle_test` folders: long tables of
literals, not ordinary code). Each file becomes `BOS + its bytes`; the token of a byte is its value, so the
vocabulary is the 256 byte values and `BOS_ID` (0, the NUL byte, which no source file here contains: files with
one are skipped). A file is held out when the first byte of the SHA-256 of its relative path is below
`HELD_OUT_BELOW` (about 1 file in 20): a split that does not move when another Python adds or drops files.

`CorpusInfo` records what was read (Python version, file counts, bytes, a digest of the whole corpus), so a
model card can say exactly what a model saw.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import sysconfig
from typing import Iterator

import numpy as np

BOS_ID = 0
VOCAB_SIZE = 256
HELD_OUT_BELOW = 13  # of 256: 5.1% of files
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


@dataclasses.dataclass(frozen=True)
class CorpusInfo:
    python: str
    root: str
    train_files: int
    held_out_files: int
    train_bytes: int
    held_out_bytes: int
    sha256: str  # of every (relative path, bytes) in order, both splits

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def source_files(root: str | None = None) -> list[str]:
    """Relative paths of the corpus's `.py` files under `root` (the stdlib), sorted."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


def is_held_out(relpath: str) -> bool:
    return hashlib.sha256(relpath.replace(os.sep, "/").encode()).digest()[0] < HELD_OUT_BELOW


def load_corpus(root: str | None = None) -> tuple[np.ndarray, np.ndarray, CorpusInfo]:
    """-> (train tokens uint8[N], held-out tokens uint8[M], info): every file as BOS + its bytes, concatenated."""
    root = root or stdlib_root()
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    digest = hashlib.sha256()
    for rel in source_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        if not data or b"\0" in data:
            continue
        digest.update(rel.encode() + b"\0" + data)
        parts[is_held_out(rel)].append(bytes([BOS_ID]) + data)
    if not parts[False] or not parts[True]:
        raise RuntimeError(f"no Python sources found under {root!r} (needs both a training and a held-out file)")
    train, held = (np.frombuffer(b"".join(parts[k]), np.uint8) for k in (False, True))
    info = CorpusInfo(python="%d.%d.%d" % sys.version_info[:3], root=root, train_files=len(parts[False]),
                      held_out_files=len(parts[True]), train_bytes=int(train.size), held_out_bytes=int(held.size),
                      sha256=digest.hexdigest())
    return train, held, info


def random_windows(tokens: np.ndarray, seq_len: int, batch: int, seed: int) -> Iterator[np.ndarray]:
    """Endless int32[batch, seq_len] windows at uniformly random offsets of `tokens` (numpy's PCG64, `seed`)."""
    if tokens.size < seq_len:
        raise ValueError(f"the text has {tokens.size} tokens, fewer than seq_len={seq_len}")
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, tokens.size - seq_len + 1, size=batch)
        yield np.stack([tokens[s:s + seq_len] for s in starts]).astype(np.int32)


def fixed_windows(tokens: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """`count` windows int32[count, seq_len] spread evenly over `tokens` (the same ones every time: evaluation)."""
    if tokens.size < seq_len * count:
        raise ValueError(f"the text has {tokens.size} tokens, fewer than {count} windows of {seq_len}")
    starts = np.linspace(0, tokens.size - seq_len, count).astype(np.int64)
    return np.stack([tokens[s:s + seq_len] for s in starts]).astype(np.int32)


def document_prompts(tokens: np.ndarray, lengths, seed: int, repeat: bool = False) -> list[list[int]]:
    """One prompt per length: `length` tokens of `tokens` from the start of a document (a BOS), documents drawn
    without repetition (numpy's PCG64, `seed`); a prompt longer than its document runs on into the next one, as
    the training windows do. The demo's text workload (on the held-out text).

    With more prompts than documents the documents are drawn again, pass after pass: with `repeat` from their
    starts (later prompts then begin as earlier ones do: shared prefixes); otherwise (the default) the k-th pass
    starts k / passes of the way into each document, and no two prompts start at the same position (a start
    clamped to the end of the text moves back past the ones used), so no prompt repeats another's beginning."""
    lengths = [int(n) for n in lengths]
    if lengths and max(lengths) > tokens.size:
        raise ValueError(f"the text has {tokens.size} tokens, fewer than a prompt of {max(lengths)}")
    starts = np.flatnonzero(tokens == BOS_ID)
    if not starts.size:
        raise ValueError("the text has no document start (BOS)")
    ends = np.append(starts[1:], tokens.size)
    rng = np.random.default_rng(seed)
    passes = -(-len(lengths) // starts.size)
    order = np.concatenate([rng.permutation(starts.size) for _ in range(passes)]) if lengths else []
    out, used = [], set()
    for i, (n, d) in enumerate(zip(lengths, order)):
        k, s = i // starts.size, int(starts[d])
        if k and not repeat:
            s += max(k * int(ends[d] - starts[d]) // passes, k)
        s = min(s, tokens.size - n)
        while not repeat and s in used:
            s -= 1
        if s < 0:
            raise ValueError(f"the text has {tokens.size} tokens, too few for {len(lengths)} prompts at distinct "
                             "starts")
        used.add(s)
        out.append(tokens[s:s + n].astype(int).tolist())
    return out
