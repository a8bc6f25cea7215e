"""Kernels stand alone, and the one resolver rule never turns a missing page into an address.

* `pallas_kernels` imports only jax / numpy (and itself): importing a kernel does not import the library.
* A request whose pages were released without a hot buffer (hot page -1): its non-resident positions are
  invalid, nothing is fetched for them, and no other request's device page changes (bit for bit) — through
  the store's public path (`TieredKV.attend`: resolve, fetch, attention) with the jnp reference and with the
  Pallas kernels in interpret mode, for both fetch mechanisms.
* A position with no copy anywhere (not resident, not in the hot buffer, no host page, or past the table) is
  invalid and claims no hot slot; the kernel and the reference agree on random states with such holes.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.kv.state import StoreSpec, init_store
from hisparse_jax.kv.tiered import TieredKV
from hisparse_jax.model.block import LayerIds
from pallas_kernels.sparse_gather import sparse_gather, sparse_gather_reference
from pallas_kernels.sparse_mla_decode.reference import sparse_mla_decode_rows
from test_kernel_sparse_gather import FIELDS, assert_same, make_case, run

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ----- kernels stand alone ----------------------------------------------------------------------
def test_kernels_import_without_the_library():
    code = ("import pallas_kernels, pallas_kernels.indexer_topk, pallas_kernels.sparse_gather, "
            "pallas_kernels.sparse_mla_decode; import sys; "
            "loaded = [m for m in sys.modules if m.startswith('hisparse_jax')]; assert not loaded, loaded")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


def test_kernel_sources_import_only_jax_and_numpy():
    # jax and numpy, the package itself, and pure standard-library helpers (the traffic model's dataclass)
    allowed = {"__future__", "dataclasses", "functools", "math", "typing", "jax", "numpy", "pallas_kernels"}
    for path in sorted((ROOT / "pallas_kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad = [n for n in names if n.split(".")[0] not in allowed]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


# ----- a hand-built store: a live request, a released one without hot buffer, holes --------------
C = R = 16
HR, K, MP, CLOCK = 64, 8, 2, 5
TOPK = np.array([[3, 70, 5, 100, -1, -1, -1, -1],  # request 0: all resident (device pages 0, 1)
                 [1, 2, 65, 90, 10, -1, -1, -1],  # request 1: pages released to host, no hot buffer
                 [4, 70, 9, 127, 130, 63, -1, -1]], np.int32)  # request 2: page 0 on host, page 1 nowhere
REQ = np.array([0, 1, 2], np.int32)
VALID = np.array([[1, 1, 1, 1, 0, 0, 0, 0],
                  [0, 0, 0, 0, 0, 0, 0, 0],
                  [1, 0, 1, 0, 0, 1, 0, 0]], bool)  # 70, 127: no copy anywhere; 130: past the table
MISS = np.array([[0] * 8, [0] * 8, [1, 0, 1, 0, 0, 1, 0, 0]], bool)


def tiny_store(fetch: str):
    spec = StoreSpec(num_layers=1, num_indexer_layers=1, groups=((0,),), latent_dim=C, rope_dim=R, index_dim=16,
                     device_pages=4, index_pages=1, host_pages=4, max_seqs=3, max_pages=MP, hot_rows=HR,
                     kv_dtype="float32", fetch=fetch, fetch_min_rows=4, mirror_to_host=True, topk=K)
    store = init_store(spec)
    rng = np.random.default_rng(0)
    pools = {}
    for name in ("latent", "rope", "h_latent", "h_rope"):
        x = rng.standard_normal(getattr(store, name).shape).astype(np.float32)
        if not name.startswith("h_"):
            x[:, 3] = np.nan  # a page nobody owns: any read of it would show
        pools[name] = jax.device_put(jnp.asarray(x), getattr(store, name).sharding)
    tables = dict(block_table=[[0, 1], [-1, -1], [-1, -1]], host_table=[[-1, -1], [0, 1], [2, -1]],
                  hot_pages=[[-1], [-1], [2]], seq_lens=[128, 128, 128])
    store = dataclasses.replace(store, **pools, **{k: jnp.asarray(v, jnp.int32) for k, v in tables.items()},
                                clock=jnp.asarray(CLOCK, jnp.int32))
    return spec, store


def bits(x):
    return np.asarray(x).view(np.uint32)


@pytest.mark.parametrize("fetch", ["row", "page"])
@pytest.mark.parametrize("kernels", ["reference", "pallas_interpret"])
def test_released_request_without_hot_buffer_is_never_an_address(kernels, fetch):
    spec, store = tiny_store(fetch)
    before = {k: np.array(getattr(store, k)) for k in ("latent", "rope", "h_latent", "h_rope", "hot_token",
                                                        "hot_stamp", "page_stamp")}
    rng = np.random.default_rng(1)
    q_lat = jnp.asarray(rng.standard_normal((3, 2, C)), jnp.float32)
    q_rope = jnp.asarray(rng.standard_normal((3, 2, R)), jnp.float32)

    @jax.jit
    def attend(store):
        backend = TieredKV(spec, kernels)
        kv = backend.init_kv(store, jnp.asarray(REQ))
        o, kv = backend.attend(kv, LayerIds(layer=0, index=0, owns_index=True, group_size=1),
                                  jnp.asarray(TOPK), q_lat, q_rope, 0.25)
        return o, kv["store"], kv["plan"], kv["stats"]

    o, out, plan, stats = attend(store)
    np.testing.assert_array_equal(np.asarray(plan.valid), VALID)
    np.testing.assert_array_equal(np.asarray(plan.miss), MISS)
    np.testing.assert_array_equal(np.asarray(plan.src_page), np.where(MISS, 2, -1))
    assert int(stats["h2d_rows"]) == MISS.sum()

    # device pages 0, 1 (request 0's) and 3 (nobody's, NaN) bit for bit; page 2 (request 2's hot page) gets
    # exactly the three misses, in LRU slots 0, 1, 2, copied from host page 2; the host pools are untouched
    for name in ("latent", "rope"):
        now, was = np.asarray(getattr(out, name)), before[name]
        np.testing.assert_array_equal(bits(now[:, [0, 1, 3]]), bits(was[:, [0, 1, 3]]), err_msg=name)
        want = was[:, 2].copy()
        want[:, :3] = before["h_" + name][:, 2, [4, 9, 63]]
        np.testing.assert_array_equal(bits(now[:, 2]), bits(want), err_msg=name)
        np.testing.assert_array_equal(bits(getattr(out, "h_" + name)), bits(before["h_" + name]))

    # hot state: request 1 (no buffer) untouched; request 2 holds only its valid misses
    tok = np.asarray(out.hot_token)
    np.testing.assert_array_equal(tok[:2], before["hot_token"][:2])
    np.testing.assert_array_equal(np.asarray(out.hot_stamp)[:2], before["hot_stamp"][:2])
    np.testing.assert_array_equal(tok[2, 0, :4], [4, 9, 63, -1])
    assert (tok[2, 0, 3:] == -1).all()
    stamp = np.asarray(out.page_stamp)
    np.testing.assert_array_equal(stamp, [[CLOCK, CLOCK], [-1, -1], [CLOCK, -1]])

    # the attention read the valid rows only (request 1: none -> zeros)
    lat, rope = np.asarray(out.latent)[0], np.asarray(out.rope)[0]
    page, row = np.zeros((3, K), int), np.zeros((3, K), int)
    page[0], row[0] = np.maximum(TOPK[0], 0) // 64, np.maximum(TOPK[0], 0) % 64  # device page i = logical page i
    page[2], row[2] = 2, np.where(MISS[2], np.cumsum(MISS[2]) - 1, 0)  # request 2's misses: hot slots 0, 1, 2
    rows_c = np.where(VALID[..., None], lat[page, row], 0.0)
    rows_r = np.where(VALID[..., None], rope[page, row], 0.0)
    expect = sparse_mla_decode_rows(q_lat, q_rope, jnp.asarray(rows_c), jnp.asarray(rows_r), jnp.asarray(VALID),
                                    0.25)
    assert np.isfinite(np.asarray(o)).all()
    np.testing.assert_allclose(np.asarray(o), np.asarray(expect), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(o)[1], 0.0)


# ----- positions with no copy anywhere: the kernel == the reference == a plain-Python oracle ------
def with_holes(seed):
    """A random resolver state where some host pages are missing, some requests have no hot buffer
    (whole row or one page of -1), and some top-k positions lie past the tables."""
    case = make_case(seed, scenario="mixed")
    rng = np.random.default_rng(100 + seed)
    case["host_table"] = np.where(rng.random(case["host_table"].shape) < 0.35, -1, case["host_table"]).astype(np.int32)
    case["hot_pages"][0] = -1
    case["hot_pages"][1, 0] = -1
    S = case["block_table"].shape[1] * 64
    topk = case["topk"]
    topk[:, -2:] = np.where(topk[:, -2:] >= 0, S + topk[:, -2:] % 64, -1)  # past the tables
    return case


def oracle(case):
    """valid / miss [B, K] by the rule, one position at a time."""
    topk, req, bt, ht, hp, tok = (case[k] for k in ("topk", "req", "block_table", "host_table", "hot_pages",
                                                    "hot_token"))
    MP, HR = bt.shape[1], tok.shape[1]
    valid, miss = np.zeros(topk.shape, bool), np.zeros(topk.shape, bool)
    for b, k in np.ndindex(*topk.shape):
        t, r = topk[b, k], req[b]
        if t < 0 or r < 0:
            continue
        lp = t // 64
        if lp < MP and bt[r, lp] >= 0:
            valid[b, k] = True
        elif (hp[r, :-(-HR // 64)] >= 0).all():
            if t in tok[r]:
                valid[b, k] = True
            elif lp < MP and ht[r, lp] >= 0:
                valid[b, k] = miss[b, k] = True
    return valid, miss


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_positions_without_any_copy_are_invalid(seed):
    case = with_holes(seed)
    ref = run(sparse_gather_reference, case)
    assert_same(run(sparse_gather, case, interpret=True), ref)
    out = dict(zip(FIELDS, ref))
    valid, miss = oracle(case)
    np.testing.assert_array_equal(out["valid"], valid)
    np.testing.assert_array_equal(out["miss"], miss)
    assert (out["src_page"][miss] >= 0).all() and (out["src_page"][~miss] == -1).all()
    assert (out["page"][~valid] == 0).all() and (out["row"][~valid] == 0).all()
    # slots are claimed only by valid misses; requests without a hot buffer keep their state
    for b, r in enumerate(case["req"]):
        if r < 0:
            continue
        new = set(out["hot_token"][r].tolist()) - set(case["hot_token"][r].tolist())
        assert new <= set(case["topk"][b][miss[b]].tolist())
        if not (case["hot_pages"][r] >= 0).all():
            np.testing.assert_array_equal(out["hot_token"][r], case["hot_token"][r])
            np.testing.assert_array_equal(out["hot_stamp"][r], case["hot_stamp"][r])


def test_holes_exercise_every_path():
    """The states above really contain all five outcomes."""
    kinds = np.zeros(5, int)
    for seed in range(3):
        case = with_holes(seed)
        out = dict(zip(FIELDS, run(sparse_gather_reference, case)))
        live = (case["topk"] >= 0) & (case["req"] >= 0)[:, None]
        no_hot = live & ~out["resident"] & ~(case["hot_pages"][np.maximum(case["req"], 0)] >= 0).all(axis=1)[:, None]
        kinds += [out["resident"].sum(), (out["valid"] & ~out["resident"] & ~out["miss"]).sum(), out["miss"].sum(),
                  no_hot.sum(), (live & ~out["valid"] & ~no_hot).sum()]  # resident hit miss no-buffer no-copy
    assert (kinds > 0).all(), kinds
