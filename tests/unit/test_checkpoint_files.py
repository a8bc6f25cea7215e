"""Damaged and hostile checkpoint files: refused with a `CheckpointError` naming the file (and tensor).

Files are built by hand (8-byte length, header JSON, data bytes) or with `safetensors.numpy.save_file`. The
property test checks the reader against an oracle written here (bytes [8+N+begin, 8+N+end) viewed as the
dtype) and, where the reference (Rust) safetensors reader disagrees, only in the documented stricter cases.
No model, no jax compilation.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file

import hisparse_jax
from hisparse_jax.model.safetensors_io import read_safetensors
from hisparse_jax.model.weights import CheckpointError, read_checkpoint_tensors

INDEX = "model.safetensors.index.json"
# the oracle's own table: safetensors dtype name -> NumPy dtype
ORACLE_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}


def blob(header: bytes | str | dict, data: bytes = b"", n: int | None = None) -> bytes:
    """A safetensors file's bytes: u64 header length (default: the true one), header, data."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode()
    return struct.pack("<Q", len(header) if n is None else n) + header + data


def write(path, content: bytes) -> str:
    with open(path, "wb") as f:
        f.write(content)
    return str(path)


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def refuses(path, *fragments: str) -> str:
    """Assert reading `path` (a file or a folder) raises CheckpointError naming every fragment; the message."""
    read = read_safetensors if os.path.isfile(path) else read_checkpoint_tensors
    with pytest.raises(CheckpointError) as e:
        read(str(path))
    msg = str(e.value)
    for frag in (str(path),) + fragments:
        assert frag in msg, (frag, msg)
    return msg


# ----------------------------------------------------------------------------------------------------------
# valid files
# ----------------------------------------------------------------------------------------------------------

def test_valid_files_are_read_exactly_and_lazily(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"f32": rng.standard_normal((3, 5)).astype(np.float32), "i64": np.arange(7, dtype=np.int64),
               "u8": rng.integers(0, 255, (2, 2, 2), dtype=np.uint8), "bool": np.array([True, False]),
               "f16": np.ones((1, 4), np.float16), "empty": np.zeros((0, 3), np.float32), "scalar": np.array(2.5)}
    fn = str(tmp_path / "model.safetensors")
    save_file(tensors, fn, metadata={"format": "pt"})
    got = read_checkpoint_tensors(str(tmp_path))
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == np.shape(v) and np.array_equal(got[k], v), k
    assert isinstance(got["f32"], np.memmap)  # mapped, not read


def test_float8_and_bfloat16_by_hand(tmp_path):
    w8 = np.linspace(-2, 2, 6).astype(ml_dtypes.float8_e4m3fn).reshape(2, 3)
    bf = np.array([1.5, -3.0], ml_dtypes.bfloat16)
    fn = write(tmp_path / "a.safetensors", blob({"__metadata__": None, "w8": entry("F8_E4M3", [2, 3], 0, 6),
                                                 "bf": entry("BF16", [2], 6, 10)}, w8.tobytes() + bf.tobytes()))
    got = read_safetensors(fn)
    assert got["w8"].dtype == ml_dtypes.float8_e4m3fn and np.array_equal(got["w8"].view(np.uint8), w8.view(np.uint8))
    assert got["bf"].dtype == ml_dtypes.bfloat16 and np.array_equal(got["bf"], bf)


def test_symlink_inside_the_folder_is_followed(tmp_path):
    os.mkdir(tmp_path / "store")
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "store" / "real.safetensors"))
    os.symlink(os.path.join("store", "real.safetensors"), tmp_path / "model.safetensors")
    assert list(read_checkpoint_tensors(str(tmp_path))) == ["w"]


def test_hub_cache_snapshot_links_into_blobs(tmp_path):
    """A Hugging Face hub cache snapshot's files are symlinks into the repository's blobs/: they load; a link to
    anywhere else from the same snapshot does not."""
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    save_file({"w": np.arange(3, dtype=np.float32)}, str(repo / "blobs" / "0f1e2d"))
    os.symlink(os.path.join("..", "..", "blobs", "0f1e2d"), snap / "model.safetensors")
    np.testing.assert_array_equal(read_checkpoint_tensors(str(snap))["w"], np.arange(3, dtype=np.float32))
    save_file({"v": np.ones(1, np.float32)}, str(tmp_path / "elsewhere.safetensors"))
    os.symlink(str(tmp_path / "elsewhere.safetensors"), snap / "extra.safetensors")
    with pytest.raises(CheckpointError, match="outside the folder"):
        read_checkpoint_tensors(str(snap))


# ----------------------------------------------------------------------------------------------------------
# folders: confinement, the index honoured, no name in two files
# ----------------------------------------------------------------------------------------------------------

def sharded(folder, weight_map: dict, **files: dict) -> None:
    """Files (name without suffix -> tensors) and an index with `weight_map`."""
    os.makedirs(folder, exist_ok=True)
    for name, tensors in files.items():
        save_file(tensors, os.path.join(folder, name + ".safetensors"))
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.mark.parametrize("how", ["dotdot", "nested-dotdot", "absolute", "symlink-out", "symlinked-dir-out"])
def test_index_cannot_reach_outside_the_folder(tmp_path, how):
    outside = tmp_path / "outside.safetensors"
    save_file({"evil": np.full(2, 666, np.float32)}, str(outside))
    os.mkdir(tmp_path / "outdir")
    save_file({"evil": np.full(2, 666, np.float32)}, str(tmp_path / "outdir" / "x.safetensors"))
    d = tmp_path / "ckpt"
    d.mkdir()
    name = {"dotdot": "../outside.safetensors", "nested-dotdot": "sub/../../outside.safetensors",
            "absolute": str(outside), "symlink-out": "link.safetensors", "symlinked-dir-out": "sub/x.safetensors"}[how]
    if how == "symlink-out":
        os.symlink(outside, d / "link.safetensors")
    if how == "symlinked-dir-out":
        os.symlink(tmp_path / "outdir", d / "sub")
    sharded(d, {"good": "model-1.safetensors", "evil": name}, **{"model-1": {"good": np.ones(2, np.float32)}})
    refuses(d, INDEX, repr(name))


def test_symlink_out_refused_without_index(tmp_path):
    save_file({"evil": np.ones(1, np.float32)}, str(tmp_path / "outside.safetensors"))
    d = tmp_path / "ckpt"
    d.mkdir()
    os.symlink(tmp_path / "outside.safetensors", d / "model.safetensors")
    refuses(d, "'model.safetensors'", "outside the folder")


def test_tensor_in_two_files_without_index(tmp_path):
    save_file({"a": np.ones(2, np.float32), "w": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "stray.safetensors"))
    refuses(tmp_path, "'w'", str(tmp_path / "model.safetensors"), str(tmp_path / "stray.safetensors"))


@pytest.mark.parametrize("chosen", ["model-1", "stray"])
def test_index_assignment_is_honoured(tmp_path, chosen):
    """A tensor comes from the file the index names; tensors the index does not assign are not read."""
    files = {"model-1": {"w": np.full(3, 1, np.float32), "b": np.zeros(1, np.int32)},
             "stray": {"w": np.full(3, 2, np.float32), "extra": np.ones(1, np.float32)}}
    sharded(tmp_path, {"w": chosen + ".safetensors", "b": "model-1.safetensors"}, **files)
    got = read_checkpoint_tensors(str(tmp_path))
    assert sorted(got) == ["b", "w"]
    assert np.array_equal(got["w"], files[chosen]["w"])


def test_index_names_a_tensor_its_file_lacks(tmp_path):
    sharded(tmp_path, {"w": "model-1.safetensors", "gone": "model-1.safetensors"},
            **{"model-1": {"w": np.ones(1, np.float32)}})
    refuses(tmp_path, INDEX, "'gone'", str(tmp_path / "model-1.safetensors"))


def test_index_names_a_missing_file(tmp_path):
    sharded(tmp_path, {"w": "model-1.safetensors", "v": "model-2.safetensors"},
            **{"model-1": {"w": np.ones(1, np.float32)}})
    refuses(tmp_path, INDEX, "'model-2.safetensors'", "does not exist")


@pytest.mark.parametrize("index", [
    "not json", "[1, 2]", "{}", '{"weight_map": []}', '{"weight_map": {}}', '{"weight_map": {"w": 3}}',
    '{"weight_map": {"w": null}}', '{"weight_map": {"w": ""}}', '{"weight_map": {"w": "a", "w": "b"}}',
    b'\xff\xfe{', '{"weight_map": {"w": "x\\u0000.safetensors"}}',
], ids=lambda s: re.sub(r"\W+", "_", str(s))[:30])
def test_malformed_index(tmp_path, index):
    save_file({"w": np.ones(1, np.float32)}, str(tmp_path / "a.safetensors"))
    (tmp_path / INDEX).write_bytes(index if isinstance(index, bytes) else index.encode())
    refuses(tmp_path, INDEX)


def test_no_files_at_all(tmp_path):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        read_checkpoint_tensors(str(tmp_path))


def test_error_type_is_public():
    assert hisparse_jax.CheckpointError is CheckpointError and issubclass(CheckpointError, ValueError)


# ----------------------------------------------------------------------------------------------------------
# malformed headers, one class at a time
# ----------------------------------------------------------------------------------------------------------

F32x4 = np.arange(4, dtype=np.float32).tobytes()
GOOD = {"w": entry("F32", [4], 0, 16)}


def without(key: str) -> dict:
    return {"w": {k: v for k, v in GOOD["w"].items() if k != key}}


MALFORMED = {  # id -> (file bytes, fragments the message must contain besides the path)
    "empty-file": (b"", ["too short"]),
    "short-length": (b"\x10\x00\x00", ["too short"]),
    "huge-header-length": (blob(GOOD, F32x4, n=2 ** 62), ["header length 4611686018427387904", "limit"]),
    "header-past-eof": (blob(GOOD, F32x4, n=len(json.dumps(GOOD)) + 17), ["truncated"]),
    "header-length-short": (blob(GOOD, F32x4, n=len(json.dumps(GOOD)) - 1), ["not valid JSON"]),
    "zero-header": (blob(b"", F32x4), ["not valid JSON"]),
    "non-utf8": (blob(b'{"w\xff": 1}'), ["UTF-8"]),
    "not-json": (blob(b"{'w': 1}"), ["not valid JSON"]),
    "nan": (blob('{"w": {"dtype": "F32", "shape": [], "data_offsets": [0, 4], "x": NaN}}', F32x4[:4]),
            ["not valid JSON"]),
    "lone-surrogate": (blob('{"\\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', b"\1"),
                       ["not valid JSON", "surrogate"]),
    "deep-nesting": (blob(b"[" * 100_000), ["not valid JSON"]),
    "huge-integer": (blob(b'{"w": ' + b"9" * 5000 + b"}"), ["not valid JSON"]),
    "json-list": (blob(b"[]"), ["list, not an object"]),
    "json-string": (blob(b'"w"'), ["str, not an object"]),
    "repeated-name": (blob('{"w": %s, "w": %s}' % (json.dumps(GOOD["w"]), json.dumps(GOOD["w"])), F32x4),
                      ["repeats the key 'w'"]),
    "metadata-int": (blob({"__metadata__": {"format": 1}, **GOOD}, F32x4), ["__metadata__"]),
    "metadata-list": (blob({"__metadata__": ["pt"], **GOOD}, F32x4), ["__metadata__"]),
    "entry-not-object": (blob({"w": [1, 2]}), ["'w'", "not an object"]),
    "no-dtype": (blob(without("dtype"), F32x4), ["'w'", "'dtype'"]),
    "no-shape": (blob(without("shape"), F32x4), ["'w'", "'shape'"]),
    "no-offsets": (blob(without("data_offsets"), F32x4), ["'w'", "'data_offsets'"]),
    "unknown-dtype": (blob({"w": entry("Q7", [4], 0, 16)}, F32x4), ["'w'", "unsupported dtype 'Q7'"]),
    "unsupported-dtype": (blob({"w": entry("U16", [8], 0, 16)}, F32x4), ["'w'", "'U16'"]),
    "dtype-not-str": (blob({"w": entry(4, [4], 0, 16)}, F32x4), ["'w'", "unsupported dtype 4"]),
    "negative-dim": (blob({"w": entry("F32", [-4], 0, 16)}, F32x4), ["'w'", "shape [-4]"]),
    "float-dim": (blob({"w": entry("F32", [4.0], 0, 16)}, F32x4), ["'w'", "shape [4.0]"]),
    "bool-dim": (blob({"w": entry("F32", [True, 4], 0, 16)}, F32x4), ["'w'", "shape [True, 4]"]),
    "shape-not-list": (blob({"w": entry("F32", 4, 0, 16)}, F32x4), ["'w'", "shape 4"]),
    "too-many-dims": (blob({"w": entry("F32", [1] * 33 + [4], 0, 16)}, F32x4), ["'w'", "34 dimensions"]),
    "huge-empty-shape": (blob({"w": entry("F32", [0, 2 ** 40, 2 ** 40], 0, 0)}), ["'w'", "too large"]),
    "negative-offset": (blob({"w": entry("F32", [4], -16, 0)}, F32x4), ["'w'", "[-16, 0]"]),
    "begin-after-end": (blob({"w": entry("F32", [0], 16, 0)}, F32x4), ["'w'", "[16, 0]"]),
    "three-offsets": (blob({"w": {**GOOD["w"], "data_offsets": [0, 8, 16]}}, F32x4), ["'w'", "[0, 8, 16]"]),
    "bool-offset": (blob({"w": entry("F32", [1], False, 4)}, F32x4[:4]), ["'w'", "[False, 4]"]),
    "offsets-not-list": (blob({"w": {**GOOD["w"], "data_offsets": "0:16"}}, F32x4), ["'w'", "'0:16'"]),
    # F32 data declared I32 with a shape that does not fit its bytes
    "wrong-byte-count": (blob({"w": entry("I32", [3], 0, 16)}, F32x4), ["'w'", "16 bytes", "I32 [3] needs 12"]),
    "shifted": (blob({"w": entry("F32", [4], 4, 20)}, b"\0" * 4 + F32x4), ["'w'", "begins at 4", "unused"]),
    "overlap": (blob({"a": entry("F32", [4], 0, 16), "b": entry("F32", [2], 8, 16)}, F32x4), ["'a'", "'b'",
                                                                                           "overlaps"]),
    "empty-inside-another": (blob({"a": entry("F32", [4], 0, 16), "b": entry("F32", [0], 8, 8)}, F32x4),
                             ["'a'", "'b'", "overlaps"]),
    "gap": (blob({"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 12, 16)}, F32x4), ["'b'", "4 unused"]),
    "trailing-bytes": (blob(GOOD, F32x4 + b"\0"), ["trailing data"]),
    "data-truncated": (blob(GOOD, F32x4[:10]), ["truncated"]),
    "no-tensors-but-data": (blob({}, b"\0\0"), ["trailing data"]),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_header(tmp_path, case):
    content, fragments = MALFORMED[case]
    refuses(write(tmp_path / "bad.safetensors", content), *fragments)
    refuses(tmp_path, *fragments)  # and through the folder reader


def test_truncated_saved_file(tmp_path):
    fn = str(tmp_path / "model.safetensors")
    save_file({"a": np.ones((4, 4), np.float32), "b": np.ones(3, np.int64)}, fn)
    size = os.path.getsize(fn)
    for cut in (size - 1, size - 30, 100, 9, 7):
        with open(fn, "r+b") as f:
            f.truncate(cut)
        refuses(fn)


def test_empty_tensors_are_fine(tmp_path):
    fn = write(tmp_path / "z.safetensors", blob({"a": entry("F32", [0, 5], 0, 0), "b": entry("I8", [2], 0, 2),
                                                 "c": entry("BF16", [3, 0], 2, 2)}, b"\1\2"))
    got = read_safetensors(fn)
    assert {k: v.shape for k, v in got.items()} == {"a": (0, 5), "b": (2,), "c": (3, 0)}
    assert got["b"].tolist() == [1, 2]
    assert read_safetensors(write(tmp_path / "e.safetensors", blob({}))) == {}


# ----------------------------------------------------------------------------------------------------------
# property: random, often malformed, files
# ----------------------------------------------------------------------------------------------------------

def oracle(content: bytes) -> dict[str, tuple[np.dtype, tuple, bytes]]:
    """What a file the reader accepted must hold: per header entry, the bytes [8+N+begin, 8+N+end) as the dtype.

    Also checks, independently of the reader, that the entries cover the data section exactly once."""
    n = int.from_bytes(content[:8], "little")
    header = json.loads(content[8:8 + n])
    header.pop("__metadata__", None)
    data = content[8 + n:]
    cover = np.zeros(len(data), np.int64)
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        cover[b:end] += 1
        dt = ORACLE_DTYPES[e["dtype"]]
        assert end - b == dt.itemsize * math.prod(e["shape"])
        out[name] = (dt, tuple(e["shape"]), data[b:end])
    assert (cover == 1).all(), "accepted a file whose tensors do not tile the data"
    spans = [e["data_offsets"] for e in header.values()]
    for b, end in spans:  # empty tensors too: inside the data, never strictly within another tensor's bytes
        assert 0 <= b <= end <= len(data) and not any(b2 < b < e2 for b2, e2 in spans)
    return out


def reference_accepts(path: str) -> bool:
    try:
        with safe_open(path, "numpy"):
            return True
    except Exception:  # the reference's own error types vary by version
        return False


ENTRY_MUTATIONS = ["dtype", "shape", "shift", "begin", "end", "random-offsets", "offsets-form", "swap",
                   "drop-key", "not-object", "repeat-name", "huge-empty"]
FILE_MUTATIONS = ["metadata", "data-length", "header-length", "truncate", "garbage-header", "top-level"]


def well_formed(e) -> bool:
    """An entry still fit for further mutation (all keys, a list shape, two integer offsets)."""
    return (isinstance(e, dict) and isinstance(e.get("shape"), list) and "dtype" in e
            and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
            and all(type(o) is int for o in e["data_offsets"]))


@st.composite
def files(draw) -> tuple[bytes, bool, bool]:
    """(file bytes, clean: no mutation applied so it must be accepted, stricter: a header the reference reader
    accepts but we refuse on purpose: a repeated key, a dtype we do not support, a shape NumPy cannot hold)."""
    rnd = random.Random(draw(st.integers(0, 2 ** 32)))
    k = draw(st.sampled_from([3, 2, 4, 1, 0]))  # hypothesis favours the first: mostly several tensors
    names = draw(st.lists(st.sampled_from(["a", "b", "c", "d", "w.x", "é", "__meta"]), min_size=k, max_size=k,
                          unique=True))
    ents, pos = [], 0
    for name in names:
        dt = draw(st.sampled_from(sorted(ORACLE_DTYPES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        size = ORACLE_DTYPES[dt].itemsize * math.prod(shape)
        e = {"dtype": dt, "shape": shape, "data_offsets": [pos, pos + size]}
        if draw(st.integers(0, 9)) == 0:
            e["ignored"] = [1, {"x": None}]  # unknown keys are ignored, by the reference too
        ents.append([name, e])
        pos += size
    rnd.shuffle(ents)  # header order is not offset order
    meta = draw(st.sampled_from([None, "absent", {"format": "pt"}, {}]))
    data_len, stricter = pos, False
    mutate = draw(st.integers(0, 3)) < 3  # about a quarter of the files stay valid
    # kinds drawn uniformly (hypothesis' own choices favour the first of a list)
    muts = rnd.choices(ENTRY_MUTATIONS + FILE_MUTATIONS, k=draw(st.integers(1, 3))) if mutate else []
    top, garbage, n_field, cut = None, None, None, None
    for m in muts:
        event(f"mutation {m}")
        intact = [j for j, (_, e) in enumerate(ents) if well_formed(e)]
        if m in ENTRY_MUTATIONS and not intact:
            continue
        i = draw(st.sampled_from(intact)) if intact else 0
        e = ents[i][1] if intact else None
        if m == "dtype":
            e["dtype"] = draw(st.sampled_from(["U16", "XX", 3, None, "f32", *ORACLE_DTYPES]))
            stricter |= e["dtype"] == "U16"
        elif m == "shape":
            e["shape"] = draw(st.sampled_from([[-1], [True], [2.0], "3", 3, None, [[1]], e["shape"] + [2],
                                               e["shape"][:-1], [1] * 40]))
            stricter |= e["shape"] == [1] * 40
        elif m in ("shift", "begin", "end"):
            d = draw(st.integers(-3, 3))
            b, end = e["data_offsets"]
            e["data_offsets"] = [b + d * (m != "end"), end + d * (m != "begin")]
        elif m == "random-offsets":
            e["data_offsets"] = [draw(st.integers(-2, pos + 2)), draw(st.integers(-2, pos + 2))]
        elif m == "offsets-form":
            b, end = e["data_offsets"]
            e["data_offsets"] = draw(st.sampled_from([[b], [b, end, end], [float(b), end], [b, str(end)], None]))
        elif m == "swap":
            j = draw(st.sampled_from(intact))
            e["data_offsets"], ents[j][1]["data_offsets"] = ents[j][1]["data_offsets"], e["data_offsets"]
        elif m == "drop-key":
            e.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
        elif m == "not-object":
            ents[i][1] = draw(st.sampled_from([None, 1, "F32", [0, 4]]))
        elif m == "repeat-name":
            ents.append([ents[i][0], json.loads(json.dumps(e))])
            stricter = True
        elif m == "huge-empty":
            e["shape"] = [0, 2 ** 40, 2 ** 40]
            e["data_offsets"] = [0, 0]
            stricter = True
        elif m == "metadata":
            meta = draw(st.sampled_from([{"x": 1}, ["pt"], "pt", {"x": None}, {"x": "y", "z": "w"}]))
        elif m == "data-length":
            data_len = max(0, data_len + draw(st.integers(-3, 3)))
        elif m == "header-length":
            n_field = draw(st.one_of(st.sampled_from([2 ** 62, 2 ** 64 - 1, 100_000_001]), st.integers(-3, 3)))
        elif m == "truncate":
            cut = draw(st.integers(0, 64))
        elif m == "garbage-header":
            garbage = draw(st.sampled_from([b"", b"\xff\xfe", b"{", b"null", b"{}}", b"{\"a\":}"]))
        elif m == "top-level":
            top = draw(st.sampled_from(["[]", "1", '"s"', "null"]))
    items = ([["__metadata__", meta]] if meta != "absent" else []) + ents
    text = "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in items) + "}"
    text = " " * draw(st.integers(0, 2)) + text + " " * draw(st.integers(0, 7))  # padding is allowed
    header = garbage if garbage is not None else (top if top is not None else text).encode()
    content = bytearray(blob(header, rnd.randbytes(data_len)))
    if n_field is not None:
        content[:8] = struct.pack("<Q", n_field if n_field > 3 else max(0, len(header) + n_field))
    if cut is not None:
        del content[max(0, len(content) - cut):]
    return bytes(content), not muts, stricter


@settings(derandomize=True, max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=files())
def test_random_files_are_refused_or_read_exactly(tmp_path_factory, case):
    content, clean, stricter = case
    fn = write(tmp_path_factory.mktemp("prop") / "model.safetensors", content)
    try:
        got = read_safetensors(fn)
    except CheckpointError as e:  # any other exception type fails the test
        event("refused" + (" (stricter than the reference)" if stricter and reference_accepts(fn) else ""))
        assert not clean, f"refused a valid file: {e}"
        assert fn in str(e)
        assert stricter or not reference_accepts(fn), f"the reference reader accepts what we refuse: {e}"
        return
    event(f"accepted{'' if clean else ' despite mutations'}, {min(len(got), 2)}{'+' * (len(got) > 1)} tensor(s)")
    assert reference_accepts(fn), "accepted a file the reference reader refuses"
    want = oracle(content)
    assert sorted(got) == sorted(want)
    for name, (dt, shape, raw) in want.items():
        assert got[name].dtype == dt and got[name].shape == shape, name
        assert np.ascontiguousarray(got[name]).tobytes() == raw, name


@pytest.mark.parametrize("sums, words", [
    ("not json", "is not JSON"),
    ('{"w": 5}', "does not hold one checksum per tensor"),
    ('{"other": "00"}', "does not hold one checksum per tensor"),
    ('{"w": "00"}', r"checksum mismatch in 1 tensor\(s\): 'w'"),
])
def test_checksums_in_metadata_are_verified(tmp_path, sums, words):
    fn = str(tmp_path / "model.safetensors")
    save_file({"w": np.ones(3, np.float32)}, fn, metadata={"format": "pt", "hisparse_jax.sha256": sums})
    with pytest.raises(CheckpointError, match=re.escape(fn) + ".*" + words):
        read_checkpoint_tensors(str(tmp_path))
