"""Saved stores and P/D exports a careful user (or a damaged disk) hands back: each refused with one clear message,
or (a saved store) restored exactly as a new store is made. Fast: one small host-tier store, hand-built exports;
the resume in a fresh process is tests/e2e/test_resume.py."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.engine import pd
from hisparse_jax.integrity import CheckpointError
from hisparse_jax.kv import device as kv_device
from hisparse_jax.kv.manager import PageManager
from hisparse_jax.kv.persist import load_tiered, save_tiered
from tiny import model_cfg

HOST_KEYS = CacheConfig(kv_dtype="float32", index_tier="host", device_pages=16, host_pages=64, max_seqs=2,
                        max_seq_len=512)
N = 150  # tokens written: logical pages 0, 1 full, page 2 holds 22 rows


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A host-tier store with one request's rows written (random keys), its manager, and where it was saved."""
    cfg = model_cfg()
    tc = PageManager(cfg, HOST_KEYS)
    rng = np.random.default_rng(0)
    store = kv_device.new_store(tc)
    slot = tc.admit(N)

    def rows(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)
    store = kv_device.write_prefill(store, tc, slot, rows(cfg.num_hidden_layers, N, cfg.kv_lora_rank),
                                    rows(cfg.num_hidden_layers, N, cfg.qk_rope_head_dim),
                                    rows(tc.spec.num_indexer_layers, N, cfg.index_head_dim), N)
    path = str(tmp_path_factory.mktemp("saved") / "store")
    save_tiered(tc, store, path)
    return tc, store, slot, path


# ----- a restored store is a new store's twin ------------------------------------------------------------------

def test_restored_arrays_are_typed_and_placed_as_a_new_store_makes_them(saved):
    """Every array's type (memory space included: float32<host>[...]) and sharding are a new store's, which is what
    lets a fresh process compile the step for them (the regression: Orbax's arrays lacked the host memory space)."""
    tc, _, _, path = saved
    _, back = load_tiered(path)
    fresh = kv_device.new_store(PageManager(tc.model_cfg, tc.cache))
    for name in ("h_latent", "index_k", "index_lo", "latent", "block_table"):
        a, b = getattr(back, name), getattr(fresh, name)
        assert str(jax.typeof(a)) == str(jax.typeof(b)) and a.sharding == b.sharding, name
    assert "<host>" in str(jax.typeof(back.h_latent)) and "<host>" in str(jax.typeof(back.index_k))
    assert jax.tree.structure(back) == jax.tree.structure(fresh)


# ----- summaries checked against the keys ----------------------------------------------------------------------

def _edited(a, at, value):
    """A copy of array `a` (in its own memory) with a[at] = value, edited on the host."""
    b = np.array(a)
    b[at] = np.asarray(value)
    return jax.device_put(b, a.sharding)


def _save_with(tc, store, tmp_path, name, **arrays):
    path = str(tmp_path / name)
    save_tiered(tc, dataclasses.replace(store, **arrays), path)
    return path


@pytest.mark.parametrize("how", ["lo_raised", "hi_lowered", "left_empty"])
def test_summaries_that_do_not_bound_their_keys_are_refused_naming_the_page(saved, tmp_path, how):
    """index_lo / index_hi that do not bound a page's keys would make exact mode skip a page holding a top-k key:
    refused, naming the indexer layer and page (the summaries' checksums are consistent: only the check of the
    keys can tell)."""
    tc, store, slot, _ = saved
    page = tc.requests[slot].index[2]  # the partly written page: only its 22 written rows count
    lo, hi = store.index_lo, store.index_hi
    if how == "lo_raised":
        lo = _edited(lo, (1, page, 5), hi[1, page, 5])
    elif how == "hi_lowered":
        hi = _edited(hi, (1, page, 5), lo[1, page, 5])
    else:  # a written page whose summary says "nothing written": its bound is -inf, it would never be read
        lo, hi = _edited(lo, (1, page), np.inf), _edited(hi, (1, page), -np.inf)
    path = _save_with(tc, store, tmp_path, how, index_lo=lo, index_hi=hi)
    with pytest.raises(CheckpointError, match=rf"summary of indexer layer 1, page {page} does not bound its keys "
                                              r"\(dimension \d+: .* over 22 written rows"):
        load_tiered(path)


def test_wider_or_nan_summaries_are_accepted(saved, tmp_path):
    """A summary wider than its keys, or NaN (the reader treats a NaN bound as unbounded: the page is read), only
    costs reads: accepted. Rows past a page's written ones are not the summary's business."""
    tc, store, slot, _ = saved
    page = tc.requests[slot].index[0]
    lo = _edited(store.index_lo, (0, page), np.asarray(store.index_lo[0, page], np.float32) - 1)
    lo = _edited(lo, (1, page, 3), np.nan)
    tail = tc.requests[slot].index[2]
    keys = _edited(store.index_k, (0, tail, slice(40, None)), 1e6)  # unwritten rows of the last page: any value
    _, back = load_tiered(_save_with(tc, store, tmp_path, "wide", index_lo=lo, index_k=keys))
    assert np.isnan(np.asarray(back.index_lo[1, page, 3], np.float32))


def test_a_key_outside_its_summary_is_refused(saved, tmp_path):
    """The same check from the keys' side: a written key moved outside its page's summary."""
    tc, store, slot, _ = saved
    page = tc.requests[slot].index[0]
    keys = _edited(store.index_k, (1, page, 10, 7), 1e6)
    with pytest.raises(CheckpointError, match=rf"indexer layer 1, page {page} does not bound"):
        load_tiered(_save_with(tc, store, tmp_path, "key", index_k=keys))


# ----- index_summary="rvq": each written row's radius checked against its key ------------------------------------
@pytest.fixture(scope="module")
def saved_rvq(tmp_path_factory):
    """`saved`'s store with "rvq" summaries (random codebooks: any give true bounds)."""
    from hisparse_jax.kv.summary import IndexCodebooks

    cfg = model_cfg()
    tc = PageManager(cfg, HOST_KEYS.replace(index_summary="rvq"))
    rng = np.random.default_rng(1)
    books = IndexCodebooks(rng.normal(size=(tc.spec.num_indexer_layers, 1, 256, cfg.index_head_dim)),
                           1.0 / 10000.0 ** (np.arange(0, cfg.qk_rope_head_dim, 2) / cfg.qk_rope_head_dim))
    store = kv_device.new_store(tc, index_codebooks=books)
    slot = tc.admit(N)
    store = kv_device.write_prefill(store, tc, slot, jnp.zeros((cfg.num_hidden_layers, N, cfg.kv_lora_rank)),
                                    jnp.zeros((cfg.num_hidden_layers, N, cfg.qk_rope_head_dim)),
                                    jnp.asarray(rng.normal(size=(tc.spec.num_indexer_layers, N, cfg.index_head_dim)),
                                                jnp.float32), N)
    path = str(tmp_path_factory.mktemp("saved_rvq") / "store")
    save_tiered(tc, store, path)
    return tc, store, slot, path


def test_rvq_store_restores_its_codebooks_and_refuses_a_radius_below_its_key(saved_rvq, tmp_path):
    """The codebooks come back with the store; a written row's radius lowered below its key's distance from its
    codes' reconstruction is refused naming layer, page and row; a NaN radius (unbounded: the page is read) and
    rows past the written ones are accepted."""
    tc, store, slot, path = saved_rvq
    _, back = load_tiered(path)
    for name in ("index_codebooks", "index_rope_freq", "index_codes", "index_radius"):
        np.testing.assert_array_equal(np.asarray(getattr(back, name)).view(np.uint8),
                                      np.asarray(getattr(store, name)).view(np.uint8))
    page = tc.requests[slot].index[2]  # rows 0..21 written
    r = store.index_radius
    low = _edited(r, (1, page, 21), np.asarray(r[1, page, 21], np.float32) / 2)
    with pytest.raises(CheckpointError, match=rf"rvq radius of indexer layer 1, page {page}, row 21 is below"):
        load_tiered(_save_with(tc, store, tmp_path, "low", index_radius=low))
    fine = _edited(_edited(r, (0, page, 3), np.nan), (0, page, 30), 0.0)
    load_tiered(_save_with(tc, store, tmp_path, "fine", index_radius=fine))


# ----- a damaged Orbax file: one message, nothing else on stderr ------------------------------------------------

def _damaged(path, tmp_path, how):
    dst = str(tmp_path / how)
    shutil.copytree(path, dst)
    data = sorted(glob.glob(os.path.join(dst, "store", "**", "d", "*"), recursive=True), key=os.path.getsize)
    if how == "truncated":
        with open(data[-1], "r+b") as f:
            f.truncate(os.path.getsize(data[-1]) // 2)
    else:
        os.remove(data[-1])
    return dst


@pytest.mark.parametrize("how", ["truncated", "deleted"])
def test_a_damaged_array_file_is_one_short_message(saved, tmp_path, how):
    path = _damaged(saved[3], tmp_path, how)
    with pytest.raises(CheckpointError, match=r"store: the saved arrays could not be read — a file is damaged, "
                                              r"missing or truncated \(.*Error reading \"\w+/") as e:
        load_tiered(path)
    assert "TensorStore(" not in str(e.value) and len(str(e.value)) < 800
    assert e.value.__cause__ is None and e.value.__context__ is None  # no chained traceback under it


def test_a_damaged_array_file_prints_nothing_else(saved, tmp_path):
    """In a fresh process, four refusals caught and one left to reach the top: the uncaught one's traceback is all
    stderr shows — not Orbax's chained TensorStore dump, "Event loop is closed" tracebacks from TensorStore's
    threads calling into Orbax's closed event loop, or the reads Orbax left pending complaining at exit."""
    paths = [_damaged(saved[3], tmp_path, how) for how in ("truncated", "deleted")]
    code = ("import sys\nfrom hisparse_jax.kv.persist import load_tiered\nfrom hisparse_jax.integrity import "
            "CheckpointError\nimport jax; jax.devices()\nsys.stderr.write('<<load>>'); sys.stderr.flush()\n"
            f"for p in {paths * 2!r}:\n    try:\n        load_tiered(p)\n    except CheckpointError as e:\n"
            f"        print('refused:', e)\nload_tiered({paths[0]!r})\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    err = res.stderr.split("<<load>>", 1)[1]
    assert res.returncode == 1 and res.stdout.count("refused:") == 4, res.stderr[-3000:]
    assert err.count("Traceback") == 1 and err.strip().splitlines()[-1].startswith(
        "hisparse_jax.integrity.CheckpointError: "), err[-3000:]
    assert "TensorStore(" not in err + res.stdout and len(err.splitlines()) < 12, err[-3000:]


# ----- P/D exports ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def short_model():
    """A model whose positions end at 64 (no compile happens in these tests: every refusal comes first)."""
    return hj.SparseMLAModel(model_cfg(max_position_embeddings=64), rngs=nnx.Rngs(0))


def _export(cfg, T):
    """A hand-built export of T positions (zeros) carrying cfg."""
    shapes = pd._shapes(cfg, T)
    return pd.PrefillExport(tuple([1] * T), *(np.zeros(shapes[n], np.float32) for n in ("latent", "rope", "index_k",
                                                                                         "last_logits")),
                            pd.export_config(cfg))


def test_export_prefill_refuses_a_prompt_with_no_position_left(short_model, monkeypatch):
    """A prompt of max_position_embeddings tokens could never decode a token after import: refused at export,
    before the forward runs."""
    import hisparse_jax.engine.runner as runner

    monkeypatch.setattr(runner, "prefill_rows", lambda *a, **k: pytest.fail("the forward ran"))
    with pytest.raises(ValueError, match=r"prompt: 64 tokens leave no position for a new token "
                                         r"\(max_position_embeddings 64; a prompt has at most 63\)"):
        pd.export_prefill(short_model, [1] * 64)
    with pytest.raises(CheckpointError, match="prefill export: does not fit this model: 64 tokens leave no position"):
        pd.check_export(_export(short_model.cfg, 64), short_model.cfg)


def test_an_export_to_a_folder_names_the_folder(short_model, tmp_path, monkeypatch):
    import hisparse_jax.engine.runner as runner

    monkeypatch.setattr(runner, "prefill_rows", lambda *a, **k: pytest.fail("the forward ran"))
    for call in (lambda: pd.export_prefill(short_model, [1, 2, 3], tmp_path),
                 lambda: pd.save_export(_export(short_model.cfg, 3), short_model.cfg, tmp_path)):
        with pytest.raises(IsADirectoryError, match=f"cannot write a prefill export at {tmp_path}: it is a folder"):
            call()


def _sparse_export_file(path, cfg, T, **shape_over):
    """A safetensors file declaring an export of T positions (shapes from cfg, overridden by `shape_over`) whose
    payload is a hole: the file has its full size on paper and no data on disk."""
    shapes = {**pd._shapes(cfg, T), **shape_over}
    dtypes = {"tokens": "I32", "last_logits": "F32"}
    header, at = {}, 0
    for name, shape in shapes.items():
        n = 4 * int(np.prod(shape))
        header[name] = {"dtype": dtypes.get(name, "F32"), "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    header["__metadata__"] = {pd.META_KEY: json.dumps({"format": pd.FORMAT, "version": pd.VERSION,
                                                       "model": pd.export_config(cfg)}),
                              pd.CHECKSUM_KEY: json.dumps({n: "0" * 64 for n in shapes})}
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + at)
    return at


@pytest.mark.parametrize("case", ["past_positions", "wrong_width"])
def test_a_sparse_export_is_refused_from_its_header(short_model, tmp_path, monkeypatch, case):
    """A 1 GB export whose prompt is past max_position_embeddings (or whose shapes do not fit) is refused from its
    header: no payload byte is read or hashed."""
    cfg = short_model.cfg
    fn = str(tmp_path / "big.safetensors")
    if case == "past_positions":
        size = _sparse_export_file(fn, cfg, 2_000_000)
        words = "2000000 tokens leave no position for a new token"
    else:
        size = _sparse_export_file(fn, cfg, 63, latent=(cfg.num_hidden_layers, 63, 4_000_000))
        words = r"tensor 'latent' has shape \(4, 63, 4000000\), expected \(4, 63, 32\)"
    assert size > 2**30
    monkeypatch.setattr(pd, "read_safetensors", lambda *a, **k: pytest.fail("the payload was read"))
    with pytest.raises(CheckpointError, match=rf"{fn}: does not fit this model: .*({words})"):
        pd.load_export(fn, cfg)
