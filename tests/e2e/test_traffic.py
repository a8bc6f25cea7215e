"""The traffic model (`pallas_kernels/traffic.py`) agrees with the bytes the kernels actually move.

Independent count: each wrapper runs under `jax.disable_jit()` with `pl.pallas_call` replaced by a grid loop
that calls the kernel body once per program (row-major, as interpret mode does) on *recording refs*: NumPy
views of the program's BlockSpec blocks (or of whole arrays without specs) whose every read (`ref[idx]`)
and write (`ref[idx] = v`), and every `plgpu.load` / `plgpu.store` (masked lanes excluded), adds the bytes of
the elements it touches to the launch's count. `pl.program_id` returns the loop's indices; `lax.fori_loop`,
`lax.cond` and `pl.when` run in Python under disable_jit, so only the branch a GPU program would take is
counted. The emulated results must equal the reference's (the emulation runs the real kernel code), and the
bytes of every `pallas_call` must equal the model's "pallas" passes exactly.
"""

from __future__ import annotations

import collections
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from hisparse_jax.kernel_cases import indexer_case, mla_case
from pallas_kernels import traffic
from pallas_kernels.backends import mosaic_unavailable_reason
from pallas_kernels.indexer_topk.kernel import indexer_topk_chunked
from pallas_kernels.indexer_topk.reference import indexer_topk_reference
from pallas_kernels.sparse_gather.kernel import sparse_gather
from pallas_kernels.sparse_gather.reference import sparse_gather_reference
from pallas_kernels.sparse_mla_decode.kernel import decode_blocks, sparse_mla_decode
from pallas_kernels.sparse_mla_decode.reference import sparse_mla_decode_reference

# ----- the recording emulator -------------------------------------------------------------------------------


class Counter:
    def __init__(self):
        self.bytes = collections.defaultdict(lambda: [0, 0, 0])  # name -> [read, write, launches]
        self.current = None

    def read(self, n):
        self.bytes[self.current][0] += int(n)

    def write(self, n):
        self.bytes[self.current][1] += int(n)


def _index(idx, shape):
    """A ref index (ints, jax scalars, pl.ds Slices, slices, Ellipsis, index arrays) -> a NumPy index."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    out = []
    for i in idx:
        if i is Ellipsis or isinstance(i, slice):
            out.append(i)
        elif isinstance(i, pl.Slice):
            start = int(i.start)
            assert i.stride == 1
            out.append(slice(start, start + int(i.size)))
        else:
            a = np.asarray(i)
            out.append(int(a) if a.ndim == 0 else a.astype(np.int64))
    return tuple(out)


class RecRef:
    """A NumPy view standing for a kernel ref; reads and writes are counted in bytes."""

    def __init__(self, arr: np.ndarray, counter: Counter):
        self.arr, self.counter = arr, counter
        self.shape, self.dtype, self.ndim = arr.shape, arr.dtype, arr.ndim

    def __getitem__(self, idx):
        v = self.arr[_index(idx, self.shape)]
        self.counter.read(np.size(v) * self.arr.itemsize)
        return jnp.asarray(v)

    def __setitem__(self, idx, val):
        ix = _index(idx, self.shape)
        target_shape = np.shape(self.arr[ix])
        v = np.broadcast_to(np.asarray(val).astype(self.arr.dtype), target_shape)
        self.arr[ix] = v
        self.counter.write(v.size * self.arr.itemsize)

    @property
    def at(self):
        ref = self

        class _At:
            def __getitem__(self, idx):
                return (ref, idx)

        return _At()


def _gather_index(ref: RecRef, idx, mask):
    """Broadcast index arrays, clamp every index into the array (masked-off lanes may point anywhere)."""
    ix = _index(idx, ref.shape)
    assert all(isinstance(i, (int, np.ndarray)) for i in ix) and len(ix) == ref.ndim, ix
    arrays = np.broadcast_arrays(*[np.asarray(i) for i in ix])
    lanes = arrays[0].shape
    m = np.ones(lanes, bool) if mask is None else np.broadcast_to(np.asarray(mask), lanes)
    clamped = tuple(np.clip(a, 0, d - 1) for a, d in zip(arrays, ref.shape))
    return arrays, clamped, m


def fake_load(view, *, mask=None, other=None, **_):
    ref, idx = view
    _, clamped, m = _gather_index(ref, idx, mask)
    vals = ref.arr[clamped]
    ref.counter.read(int(m.sum()) * ref.arr.itemsize)
    fill = np.zeros((), ref.arr.dtype) if other is None else np.asarray(other).astype(ref.arr.dtype)
    return jnp.asarray(np.where(m, vals, fill))


def fake_store(view, val, *, mask=None, **_):
    ref, idx = view
    arrays, _, m = _gather_index(ref, idx, mask)
    v = np.broadcast_to(np.asarray(val).astype(ref.arr.dtype), m.shape)
    sel = tuple(a[m] for a in arrays)
    for a, d in zip(sel, ref.shape):
        assert ((a >= 0) & (a < d)).all(), "an active store lane is out of bounds"
    ref.arr[sel] = v[m]
    ref.counter.write(int(m.sum()) * ref.arr.itemsize)


def _block_view(arr: np.ndarray, spec, ids):
    """The program's block of `arr` under a BlockSpec (None dims squeezed), as a writable view."""
    if spec is None or spec.block_shape is None:
        return arr
    blocks = spec.index_map(*ids)
    if not isinstance(blocks, tuple):
        blocks = (blocks,)
    ix = []
    for size, b in zip(spec.block_shape, blocks):
        b = int(b)
        ix.append(b if size is None else slice(b * size, (b + 1) * size))
    view = arr[tuple(ix)]
    assert all(s is None or view.shape[k] == s
               for k, s in enumerate(d for d in spec.block_shape if d is not None)), "partial block"
    return view


def make_pallas_call(counter: Counter, grid_ids: list):
    def pallas_call(kernel, *, out_shape, grid=(), in_specs=None, out_specs=None, input_output_aliases=None,
                    name=None, **_):
        multi = isinstance(out_shape, (tuple, list))
        shapes = list(out_shape) if multi else [out_shape]
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)

        def call(*args):
            ins = [np.array(a) for a in args]
            outs = [np.zeros(s.shape, s.dtype) for s in shapes]
            for i, o in (input_output_aliases or {}).items():
                outs[o] = ins[i].copy()
            ispecs = in_specs if in_specs is not None else [None] * len(ins)
            ospecs = out_specs if out_specs is not None else [None] * len(outs)
            if not isinstance(ospecs, (tuple, list)):
                ospecs = [ospecs]
            counter.current = name
            counter.bytes[name][2] += 1
            for ids in itertools.product(*(range(g) for g in grid)):
                grid_ids[:] = ids
                refs = [RecRef(_block_view(a, s, ids), counter) for a, s in zip(ins, ispecs)]
                refs += [RecRef(_block_view(o, s, ids), counter) for o, s in zip(outs, ospecs)]
                kernel(*refs)
            res = [jnp.asarray(o) for o in outs]
            return res if multi else res[0]

        return call

    return pallas_call


@pytest.fixture
def emulate(monkeypatch):
    """emulate(fn, *args, **kw) -> (result, {pallas_call name: [read, write, launches]})."""

    def run(fn, *args, **kw):
        counter, ids = Counter(), []
        with monkeypatch.context() as m:
            m.setattr(pl, "pallas_call", make_pallas_call(counter, ids))
            m.setattr(pl, "program_id", lambda axis: jnp.int32(ids[axis]))
            m.setattr(pl, "multiple_of", lambda x, n: x)
            m.setattr(plgpu, "load", fake_load)
            m.setattr(plgpu, "store", fake_store)
            with jax.disable_jit():
                out = fn(*args, **kw)
        return out, {k: tuple(v) for k, v in counter.bytes.items()}

    return run


def _check_pallas(model: traffic.Traffic, counted: dict, names: dict):
    """Every pallas pass of the model equals the emulator's count of its pallas_call (read, write, launches)."""
    want = {}
    for p in model.passes:
        if p.kind == "pallas":
            r, w, n = want.get(names[p.name], (0, 0, 0))
            want[names[p.name]] = (r + p.read_bytes, w + p.write_bytes, n + p.launches)
    assert counted == want
    assert model.launches == sum(v[2] for v in counted.values())


# ----- indexer top-k ---------------------------------------------------------------------------------------
INDEXER_NAMES = {"scores": "indexer_scores", "radix count": "indexer_topk_count", "tie counts": "indexer_topk_ties",
                 "compact": "indexer_topk_compact", "rank": "indexer_topk_rank"}


# the traffic model's key dtype names -> `kernel_cases.INDEX_FORMATS` (bf16 keys: bf16 queries too)
CASE_FORMAT = {"fp8": "fp8", "bf16": "bf16q", "float32": "f32", "int4": "int4"}


@pytest.mark.parametrize("kd,I,D,MP,lens,topk,chunk", [
    ("fp8", 16, 32, 5, (320, 130, 0), 32, 64),  # 3 rows: full, partial, idle; 5 chunks of one page
    ("bf16", 12, 16, 4, (200, 256), 64, 128),  # padded heads (12 -> 16), 2 pages a chunk, topk > one chunk
    ("float32", 16, 32, 3, (150, 40), 16, 2048),  # one chunk (Sp rounded up to a power of two), table padded
    ("int4", 16, 64, 3, (150, 40), 16, 64),  # MXFP4 codes read as words of eight + two scale bytes per key
])
def test_indexer_model_matches_the_kernel(emulate, kd, I, D, MP, lens, topk, chunk):
    B = len(lens)
    case = indexer_case(3, lens, CASE_FORMAT[kd], heads=I, dim=D, pages_per_seq=MP, pool=B * MP + 3)
    args, kw = case.args, {} if case.k_scale is None else {"k_scale": case.k_scale}
    got, counted = emulate(indexer_topk_chunked, *args, topk=topk, max_chunk=chunk, interpret=True, **kw)
    want = indexer_topk_reference(*args, topk=topk, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # the emulation is the kernel
    qname = "bfloat16" if kd == "bf16" else "float32"
    model = traffic.indexer_topk_traffic(B, I, D, MP * 64, topk, key_dtype=kd, query_dtype=qname, seq_lens=lens,
                                         max_chunk=chunk)
    _check_pallas(model, counted, INDEXER_NAMES)
    assert model.ratio >= 1


# ----- sparse gather ---------------------------------------------------------------------------------------
GATHER_NAMES = {"lookup": "hisparse_lookup", "assign": "hisparse_assign"}


def _gather_case(seed, B, K, HR, MP, *, stamps="window", hot_for=None, idle=()):
    """Resolver inputs: mixed resident / hit / miss positions, an optional request without a hot buffer, an
    idle row; stamps in the selection window ending at the clock ("window"), or spread over the past (the
    extremes pass and radix passes: "spread"). Not `kernel_cases.gather_case`: the model's counts need what that
    case never has (invalid top-k slots, idle rows, a page with no copy anywhere, a request without a hot buffer,
    stamps placed for each selection path)."""
    rng = np.random.default_rng(seed)
    S, Rq = MP * 64, B + 1
    NH = -(-HR // 64)
    clock = 700
    topk = np.stack([np.sort(rng.choice(S, K, replace=False)) for _ in range(B)]).astype(np.int32)
    topk[0, -3:] = -1  # a few invalid slots
    req = rng.permutation(Rq)[:B].astype(np.int32)
    for b in idle:
        req[b] = -1
    block_table = np.where(rng.random((Rq, MP)) < 0.3, rng.permutation(4 * Rq * MP)[:Rq * MP].reshape(Rq, MP),
                           -1).astype(np.int32)
    host_table = rng.permutation(4 * Rq * MP)[:Rq * MP].reshape(Rq, MP).astype(np.int32)
    block_table[:, 1], host_table[:, 1] = -1, -1  # positions 64..127: no copy anywhere unless in the hot buffer
    hot_pages = rng.permutation(2 * Rq * NH)[:Rq * NH].reshape(Rq, NH).astype(np.int32)
    if hot_for is not None:  # this request has no hot buffer (one page not lent)
        hot_pages[req[hot_for], 0] = -1
    tok = np.full((Rq, HR), -1, np.int32)
    stamp = np.full((Rq, HR), -1, np.int32)
    for r in range(Rq):
        n = HR - 3  # three empty slots
        held = rng.choice(S, n, replace=False)
        slots = rng.permutation(HR)[:n]
        tok[r, slots] = held
        stamp[r, slots] = (rng.integers(2 * clock - 40, 2 * clock, n) if stamps == "window"
                           else rng.integers(0, 2 * clock - 100, n))
    if stamps == "window":
        stamp[tok == -1] = 2 * clock - 50  # no never-used slot: the victims' keys lie in the window
    return tuple(jnp.asarray(x) for x in (topk, req, block_table, host_table, hot_pages, tok, stamp,
                                          np.int32(clock)))


def _gather_counts(args, out, HR):
    """The plan counts the model takes, measured on the inputs and the reference's outputs (the selection
    passes by the kernel's rule, `traffic.selection_passes`, checked against the emulated kernel below)."""
    topk, req, block_table, host_table, hot_pages, tok, stamp, clock = (np.asarray(a) for a in args)
    valid, resident, miss = (np.asarray(x) for x in out[2:5])
    B, K = topk.shape
    TK = min(256, 1 << (K - 1).bit_length())
    Kp = -(-K // TK) * TK
    live = req >= 0
    hot_ok = live & np.all(hot_pages[np.maximum(req, 0), :-(-HR // 64)] >= 0, axis=1)
    pos = np.maximum(topk, 0)
    nonres = (topk >= 0) & live[:, None] & (block_table[np.maximum(req, 0)[:, None], pos // 64] < 0)
    want = nonres & hot_ok[:, None]
    wantp = np.pad(want, ((0, 0), (0, Kp - K)))
    hits = valid & ~resident & ~miss
    selecting = hot_ok & miss.any(axis=1)
    passes = 0
    for b in np.nonzero(selecting)[0]:
        r = req[b]
        untouched = ~np.isin(np.arange(HR), [np.argmax(tok[r] == t) for t in topk[b][hits[b]]])
        passes += traffic.selection_passes(stamp[r][untouched], int(miss[b].sum()), int(clock))
    return dict(resident=int(resident.sum()), hits=int(hits.sum()), misses=int(miss.sum()),
                no_copy=int((want & ~hits & ~miss).sum()), live_rows=int(live.sum()), hot_rows_live=int(hot_ok.sum()),
                scan_tiles=int(wantp.reshape(B, Kp // TK, TK).any(axis=2).sum()), select_rows=int(selecting.sum()),
                select_passes=passes)


@pytest.mark.parametrize("B,K,HR,MP,case", [
    (3, 40, 128, 6, dict()),  # K padded 40 -> 64 (one tile), victims in the window
    (3, 300, 320, 8, dict(hot_for=1, idle=(2,))),  # 2 tiles of 256, HR tiles of 64, no hot buffer, idle row
    (2, 64, 96, 4, dict(stamps="spread")),  # the extremes pass and radix passes; slot tile 32
])
def test_gather_model_matches_the_kernel(emulate, B, K, HR, MP, case):
    args = _gather_case(5, B, K, HR, MP, **case)
    got, counted = emulate(sparse_gather, *args, hot_rows=HR, interpret=True)
    want = sparse_gather_reference(*args, hot_rows=HR)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    c = _gather_counts(args, want, HR)
    assert (c["select_passes"] > c["select_rows"]) == (case.get("stamps") == "spread")
    assert c["hits"] > 0 and c["misses"] > 0 and c["resident"] > 0 and c["no_copy"] > 0
    t, r, bt, _, hp, tok, stamp, clock = args
    assert traffic.gather_plan_counts(t, r, bt, hp, tok, stamp, clock, *want[2:5], hot_rows=HR) == dict(
        c, out_of_range=0)
    model = traffic.sparse_gather_traffic(B, K, HR, MP, **c)
    _check_pallas(model, counted, GATHER_NAMES)
    assert model.ratio >= 1


# ----- sparse MLA decode -----------------------------------------------------------------------------------
@pytest.mark.parametrize("B,H,C,R,K,pool,qd,out", [
    (2, 16, 128, 16, 40, "fp8", jnp.float32, jnp.float32),  # K padded to the split blocks, one head block, 2 splits
    (1, 40, 256, 32, 64, "bf16", jnp.bfloat16, jnp.float32),  # one head block of 64 (24 heads masked), 2 splits
    (1, 100, 128, 16, 24, "fp8", jnp.bfloat16, jnp.bfloat16),  # 2 head blocks of 64 (28 masked), one split: the
    # kernel normalizes and writes bf16 itself
])
def test_mla_model_matches_the_kernel(emulate, B, H, C, R, K, pool, qd, out):
    args, kw = mla_case(7, B=B, H=H, C=C, R=R, K=K, kv={"fp8": "fp8", "bf16": "bfloat16"}[pool], q_dtype=qd,
                        invalid=0.2)
    n_valid = int(np.asarray(args[6]).sum())
    tau = 0.1
    got, counted = emulate(sparse_mla_decode, *args, tau=tau, interpret=True, out_dtype=out, **kw)
    want = sparse_mla_decode_reference(*args, tau=tau, **kw)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)
    qname = "float32" if qd == jnp.float32 else "bfloat16"
    model = traffic.sparse_mla_decode_traffic(B, H, C, R, K, kv_dtype=pool, query_dtype=qname, valid_rows=n_valid,
                                              out_dtype=jnp.dtype(out).name)
    _check_pallas(model, counted, {"sparse_mla_decode": "sparse_mla_decode"})
    assert model.ratio >= 1
    assert model.conversions == (decode_blocks(B, H, C, K)["hblocks"] if pool == "fp8" else 0)


def test_gpu_decode_reads_rows_at_most_twice():
    """The decode `kernels="pallas"` runs on a GPU, at B 32, H 128, C 512, R 64, top-k 2048, bf16 queries: <= 2x
    its ideal bytes with bf16 and fp8 pools, each fp8 row decoded by at most two programs (the old blocks of 32
    heads read 4.48x / 4.75x). The modelled gather-and-dequantize variant converts once but moves more."""
    for kv in ("bf16", "fp8"):
        t = traffic.sparse_mla_decode_traffic(32, 128, 512, 64, 2048, kv_dtype=kv, query_dtype="bfloat16")
        assert t.ratio <= 2.0, (kv, t.ratio)
        assert t.conversions == (2 if kv == "fp8" else 0)
        compact = traffic.sparse_mla_decode_compact_traffic(32, 128, 512, 64, 2048, kv_dtype=kv)
        assert compact.ideal_bytes == t.ideal_bytes and compact.total_bytes > t.total_bytes
        assert compact.conversions == (1 if kv == "fp8" else 0)


# ----- sanity at production shapes -------------------------------------------------------------------------
def test_linear_in_batch_and_ratios_at_least_one():
    for kernel, cases in traffic.production_shapes().items():
        fn = getattr(traffic, f"{kernel}_traffic")
        for kw in cases:
            t1 = fn(**kw)
            t2 = fn(**dict(kw, batch=2 * kw["batch"]))
            assert t1.ratio >= 1 and t1.launches >= 1 and t1.total_bytes == t1.read_bytes + t1.write_bytes
            if not kernel.startswith("sparse_mla_decode"):  # the decodes' split counts depend on the batch
                assert t2.read_bytes == 2 * t1.read_bytes and t2.write_bytes == 2 * t1.write_bytes, kernel
                assert t2.ideal_bytes == 2 * t1.ideal_bytes
            assert "Largest passes" in t1.notes
    # the decode at a batch where the split count stays (one split at B >= MIN_PROGRAMS / head blocks)
    a = traffic.sparse_mla_decode_traffic(128, 128, 512, 64, 2048)
    b = traffic.sparse_mla_decode_traffic(256, 128, 512, 64, 2048)
    assert decode_blocks(128, 128, 512, 2048)["splits"] == 1
    assert b.total_bytes == 2 * a.total_bytes and b.ideal_bytes == 2 * a.ideal_bytes


def _launched_mosaic_operands(fn, *args):
    """(operand avals, result avals) of the one Mosaic GPU kernel (`plgpu.kernel`: an mpmd_map) `fn` launches."""
    def find(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "mpmd_map":
                return e
            for p in e.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None and (hit := find(inner if hasattr(inner, "eqns") else inner.jaxpr)):
                    return hit
        return None

    eqn = find(jax.make_jaxpr(fn)(*args).jaxpr)
    assert eqn is not None, "no Mosaic GPU kernel launched"
    return [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars]


@pytest.mark.skipif(mosaic_unavailable_reason() is not None, reason=str(mosaic_unavailable_reason()))
@pytest.mark.parametrize("I,D,MP,kd,qd,lens", [
    (72, 64, 11, "bf16", "float32", (700, 64)),  # heads padded to 128, f32 q in 3 parts, 11 pages -> 2 blocks
    (64, 128, 16, "fp8", "bfloat16", (1024, 1, 0)),  # fp8 keys and scales, an idle row
    (3, 32, 5, "bf16", "bfloat16", (320,)),
    (64, 128, 9, "int4", "bfloat16", (576, 70)),  # MXFP4 codes, four scale bytes per key read as one word
])
def test_mosaic_indexer_model_matches_the_launched_kernel(I, D, MP, kd, qd, lens):
    """The model's scores pass == the bytes the launched kernel's body copies, from its operands: per block the
    row's seq_len, its block-table slice, q and w; per live page its keys (+ scales); the keys of every page out."""
    from pallas_kernels.indexer_topk import indexer_topk
    from pallas_kernels.indexer_topk.kernel_mosaic import PAGES_PER_BLOCK

    B, P = len(lens), 4 * MP * len(lens)
    kdt = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "int4": jnp.uint8}[kd]
    sds = jax.ShapeDtypeStruct
    args = [sds((B, I, D), jnp.dtype(qd)), sds((B, I), jnp.float32),
            sds((P, 64, D // 2 if kd == "int4" else D), kdt), sds((B, MP), jnp.int32), sds((B,), jnp.int32)]
    kw = {"fp8": dict(k_scale=sds((P, 64), jnp.float32)), "int4": dict(k_scale=sds((P, 64, D // 32), jnp.uint8))
          }.get(kd, {})
    ops, (out,) = _launched_mosaic_operands(
        lambda *a: indexer_topk(*a[:5], topk=64, backend="mosaic", **dict(zip(kw, a[5:]))), *args, *kw.values())
    seq, q, w, bt, keys = ops[:5]
    blocks = bt.shape[0] * bt.shape[1]
    assert bt.shape[2] == PAGES_PER_BLOCK and out.shape == (B, bt.shape[1] * PAGES_PER_BLOCK * 64)
    nbytes = lambda a: a.size * a.dtype.itemsize  # noqa: E731
    live_pages = sum(-(-n // 64) for n in lens)
    scales = ops[5] if kd != "bf16" else None  # the operand after the keys: fp8: f32 [P, 64]; MXFP4: each key's scale bytes as one word
    page_bytes = 64 * keys.shape[1] * keys.dtype.itemsize + (64 * scales.dtype.itemsize if scales is not None else 0)
    read = blocks * (4 + PAGES_PER_BLOCK * 4 + nbytes(q) // B + nbytes(w) // B) + live_pages * page_bytes
    model = traffic.indexer_topk_mosaic_traffic(B, I, D, MP * 64, 64, key_dtype=kd, query_dtype=qd, seq_lens=lens)
    (kernel,) = [p for p in model.passes if p.kind == "pallas"]
    assert (kernel.read_bytes, kernel.write_bytes) == (read, nbytes(out))
    assert model.launches == 1


def test_resolver_grows_with_hot_rows_and_decode_with_head_blocks():
    g = [traffic.sparse_gather_traffic(64, 2048, hr, 2048) for hr in (4096, 8192, 16384)]
    state = [t.reference_bytes for t in g]
    # the lookup re-reads the tag row per 256-position tile (8 x 4 B per slot at K 2048), victim selection
    # reads the stamps twice (8 B): 40 B per extra slot and request, 5x one read of the state (8 B + hot_pages)
    slope = (g[2].total_bytes - g[0].total_bytes) / (state[2] - state[0])
    assert slope == pytest.approx((40 + 4 / 64) / (8 + 4 / 64))  # (+ has_hot_buffer reading hot_pages)
    assert g[0].total_bytes < g[1].total_bytes < g[2].total_bytes
    # a radix pass adds one read of a row's stamps
    more = traffic.sparse_gather_traffic(64, 2048, 4096, 2048, select_passes=3)
    assert more.total_bytes - g[0].total_bytes == 3 * 4096 * 4
    # without hot buffers nothing scans or ranks: independent of HR except has_hot_buffer's hot_pages read
    idle = [traffic.sparse_gather_traffic(64, 2048, hr, 2048, hot_rows_live=0, scan_tiles=0, hits=0, misses=0,
                                          resident=64 * 2048) for hr in (4096, 16384)]
    assert idle[1].total_bytes - idle[0].total_bytes == 64 * (16384 - 4096) // 64 * 4
    # sparse MLA: H=128 reads every row twice (2 head blocks of 64), H=16 once
    h128 = traffic.sparse_mla_decode_traffic(64, 128, 512, 64, 2048).by_pass()["sparse_mla_decode"][0]
    h16 = traffic.sparse_mla_decode_traffic(64, 16, 512, 64, 2048).by_pass()["sparse_mla_decode"][0]
    rows = 64 * 2048 * (512 + 128 + 16)
    assert 2 * rows < h128 < 2.2 * rows and rows < h16 < 1.5 * rows
    # the indexer: the fp8 keys once plus ~10 passes over 4-byte scores and q per 512 positions
    t = traffic.indexer_topk_traffic(4, 64, 128, 131072, 2048)
    assert t.reference_bytes == 4 * 131072 * 132 and 1.2 < t.total_bytes / t.reference_bytes < 2.5


# ----- the Mosaic GPU decode (kernel_mosaic.py) ------------------------------------------------------------
def test_mosaic_decode_reads_rows_once_per_head_cluster():
    """Latents once per cluster of 2 x 64 heads (H = 128 and 256: pairs; H = 192: three blocks, no cluster; H <= 64:
    one block), their rope and fp8 scales once per 64 heads (not multicast: `kernel_mosaic.TMA_ALIGN`); the v2
    target at H = 128 with bf16 queries and output."""
    latents, rope = 64 * 2048 * 512, 64 * 2048 * 128  # fp8 latent + bf16 rope, every slot valid
    scales = 64 * 2048 * 16
    for H, reads, blocks in ((128, 1, 2), (256, 2, 4), (192, 3, 3), (64, 1, 1), (16, 1, 1)):
        t = traffic.sparse_mla_decode_mosaic_traffic(64, H, 512, 64, 2048)
        kernel = t.by_pass()["sparse_mla_decode (mosaic)"][0]
        want = reads * latents + blocks * (rope + scales)
        assert want < kernel < want * 1.25, (H, kernel / want)
        assert t.reference_bytes == latents + rope + scales and t.ratio >= 1
    best = traffic.sparse_mla_decode_mosaic_traffic(64, 128, 512, 64, 2048, query_dtype="bfloat16",
                                                   out_dtype="bfloat16")
    # 1.26x while the rope was multicast too; each block's half of it landed unaligned, which faults on an H200
    assert best.total_bytes <= 1.5 * best.reference_bytes
    f32 = traffic.sparse_mla_decode_mosaic_traffic(64, 128, 512, 64, 2048, query_dtype="bfloat16")
    assert f32.total_bytes - best.total_bytes == 64 * 128 * 512 * 2  # the output's other half
    # invalid slots are not read (TMA out of bounds), neither their scales
    half = traffic.sparse_mla_decode_mosaic_traffic(64, 64, 512, 64, 2048, valid_rows=64 * 1024)
    full = traffic.sparse_mla_decode_mosaic_traffic(64, 64, 512, 64, 2048)
    diff = full.by_pass()["sparse_mla_decode (mosaic)"][0] - half.by_pass()["sparse_mla_decode (mosaic)"][0]
    assert diff == 64 * 1024 * (512 + 128 + 16)
    with pytest.raises(ValueError, match="bf16 or fp8"):
        traffic.sparse_mla_decode_mosaic_traffic(64, 64, 512, 64, 2048, kv_dtype="float32")
    with pytest.raises(ValueError, match="out_dtype"):
        traffic.sparse_mla_decode_mosaic_traffic(64, 64, 512, 64, 2048, out_dtype="fp8")


@pytest.mark.skipif(mosaic_unavailable_reason() is not None, reason=str(mosaic_unavailable_reason()))
@pytest.mark.parametrize("B,H,K,kv,out", [(64, 128, 2048, "fp8", "bfloat16"), (1, 16, 2048, "bf16", "float32"),
                                          (3, 72, 100, "fp8", "float32"), (64, 256, 2048, "bf16", "bfloat16")])
def test_mosaic_decode_model_matches_the_launched_kernel(B, H, K, kv, out):
    """The model's grid, kernel operands and outputs are the ones the wrapper builds (read off its jaxpr: the
    Mosaic call's operand and result shapes), and one split means no merge pass."""
    from pallas_kernels.sparse_mla_decode import sparse_mla_decode

    C, R, P = 512, 64, 256
    sds = jax.ShapeDtypeStruct
    pool = jnp.float8_e4m3fn if kv == "fp8" else jnp.bfloat16
    args = [sds((B, H, C), jnp.bfloat16), sds((B, H, R), jnp.bfloat16), sds((P, 64, C), pool),
            sds((P, 64, R), jnp.bfloat16), sds((B, K), jnp.int32), sds((B, K), jnp.int32), sds((B, K), jnp.bool_)]
    if kv == "fp8":
        args.append(sds((P, 64, C // 128), jnp.float32))

    def call(*a):
        return sparse_mla_decode(*a[:7], tau=0.1, latent_scale=a[7] if kv == "fp8" else None, backend="mosaic",
                                 out_dtype=jnp.dtype(out))
    def eqns(jaxpr):  # every equation, nested jits included
        for e in jaxpr.eqns:
            yield e
            for p in e.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    yield from eqns(inner)
                elif hasattr(p, "eqns"):
                    yield from eqns(p)
    every = list(eqns(jax.make_jaxpr(call)(*args).jaxpr))
    calls = [e for e in every if any(k in str(e.primitive) for k in ("mosaic", "pallas", "mpmd", "core_map"))]
    assert len(calls) == 1, sorted({str(e.primitive) for e in every})
    (call,) = calls
    out_bytes = sum(v.aval.size * v.aval.dtype.itemsize for v in call.outvars)
    t = traffic.sparse_mla_decode_mosaic_traffic(B, H, C, R, K, kv_dtype=kv, query_dtype="bfloat16", out_dtype=out)
    from pallas_kernels.sparse_mla_decode.kernel_mosaic import decode_grid, head_cluster

    hp, S, steps = decode_grid(B, H, K)
    assert call.outvars[0].aval.shape == (S, B, hp, C)
    assert call.outvars[0].aval.dtype == (jnp.dtype(out) if S == 1 else jnp.float32)
    assert t.by_pass()["sparse_mla_decode (mosaic)"][1] == out_bytes
    mesh = str(call.params)
    assert f"cluster=({head_cluster(hp)},)" in mesh.replace(" ", ""), mesh[:300]
    addr = [v.aval.shape for v in call.invars if v.aval.dtype == jnp.int32]
    assert addr == [(B, S, steps, 32)]
    if kv == "fp8":  # the pool's scales, flat (each row's copied by the kernel): no gathered copy
        flat = [v.aval.shape for v in call.invars if v.aval.ndim == 1]
        assert flat == [(P * 64 * C // 128,)]
    assert ("xla: split merge" in t.by_pass()) == (S > 1)
