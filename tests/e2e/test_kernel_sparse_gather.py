"""The fused HiSparse resolver: reference == `kv.resolve.resolve` (bit for bit) and Pallas (interpret) == reference.

States cover empty buffers, all-hit, all-miss, mixed, -1 padding, idle rows, ties of stamps, stamps at or
past the clock, duplicate tags and duplicate top-k positions, and multi-step LRU trajectories. The CUDA
lowering test runs the Pallas -> Triton lowering at realistic shapes on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.compat import gpu_lowering_target
from hisparse_jax.kernel_cases import gather_case
from hisparse_jax.kv.resolve import Plan, resolve
from hisparse_jax.kv.state import StoreSpec, init_store
from pallas_kernels.sparse_gather import sparse_gather, sparse_gather_reference

FIELDS = ("page", "row", "valid", "resident", "miss", "src_page", "src_row", "hot_token", "hot_stamp")


def make_case(seed, *, B=4, K=20, Rq=5, MP=6, HR=48, seq_len=None, scenario="mixed", clock=7):
    """Random resolver inputs (numpy). seq_len: positions 0..seq_len-1 exist (top-k padded with -1)."""
    rng = np.random.default_rng(seed)
    S = MP * 64
    seq_len = S if seq_len is None else seq_len
    topk = np.full((B, K), -1, np.int32)
    for b in range(B):
        n = min(K, seq_len)
        topk[b, :n] = rng.permutation(seq_len)[:n]
    req = rng.permutation(Rq)[:B].astype(np.int32)
    req[rng.random(B) < 0.2] = -1  # idle rows
    resident_p = {"all_miss": 0.0, "empty": 0.0, "all_hit": 0.2}.get(scenario, 0.3)
    block_table = np.where(rng.random((Rq, MP)) < resident_p, rng.permutation(4 * Rq * MP)[:Rq * MP].reshape(Rq, MP),
                           -1).astype(np.int32)
    host_table = rng.permutation(4 * Rq * MP)[:Rq * MP].reshape(Rq, MP).astype(np.int32)
    NH = -(-HR // 64)
    hot_pages = rng.permutation(8 * Rq * NH)[:Rq * NH].reshape(Rq, NH).astype(np.int32)
    tok = np.full((Rq, HR), -1, np.int32)
    stamp = np.full((Rq, HR), -1, np.int32)
    if scenario != "empty":
        for r in range(Rq):
            n = int(rng.integers(0, HR + 1))
            tok[r, :n] = rng.permutation(S)[:n]
            stamp[r, :n] = rng.integers(0, clock, n)
            perm = rng.permutation(HR)
            tok[r], stamp[r] = tok[r, perm], stamp[r, perm]
    live = req >= 0
    if scenario == "all_hit":  # every non-resident top-k position is held by some slot
        for b in np.nonzero(live)[0]:
            r, t = req[b], topk[b][topk[b] >= 0]
            slots = rng.permutation(HR)[:t.size]
            tok[r] = np.where(np.isin(tok[r], t), -1, tok[r])
            tok[r, slots], stamp[r, slots] = t, rng.integers(0, clock, t.size)
    if scenario == "all_miss":  # nothing held: tags outside the sequence
        tok = np.where(tok >= 0, tok + S, tok)
    if scenario == "adversarial":
        stamp = rng.integers(-1, 3, (Rq, HR)).astype(np.int32)  # many ties
        stamp[:, ::7] = clock  # stamped this step already (another group's layer would not, but be exact anyway)
        stamp[:, 1::11] = clock + 5  # "future" stamps
        src = tok[:, 3::5].copy()
        tok[:, 2:2 + 5 * src.shape[1]:5] = src  # duplicate tags
        topk[:, -3:] = topk[:, :3]  # duplicate top-k positions
        hot_pages[0, 0] = -1  # request 0's hot buffer is not all lent: it has none (only resident rows valid)
    if scenario == "starved":  # every untouched slot looks newer than the clock: misses evict this step's hits
        stamp[:] = clock + 3
    return dict(topk=topk, req=req, block_table=block_table, host_table=host_table, hot_pages=hot_pages,
                hot_token=tok, hot_stamp=stamp, clock=np.int32(clock))


def run(fn, case, **kw):
    args = [jnp.asarray(case[k]) for k in ("topk", "req", "block_table", "host_table", "hot_pages", "hot_token",
                                           "hot_stamp", "clock")]
    return [np.asarray(x) for x in fn(*args, hot_rows=case["hot_token"].shape[1], **kw)]


def assert_same(a, b):
    for name, x, y in zip(FIELDS, a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, (name, x.dtype, y.dtype, x.shape, y.shape)
        np.testing.assert_array_equal(x, y, err_msg=name)


def resolve_via_store(case, group=1, groups=2):
    """`resolve` on a tiny KVStore whose group `group` holds the case's hot state (others hold junk).

    Returns the plan and that group's hot state (resolve's other store updates are not this kernel's job)."""
    Rq, HR = case["hot_token"].shape
    MP = case["block_table"].shape[1]
    spec = StoreSpec(num_layers=groups, num_indexer_layers=groups, groups=tuple((g,) for g in range(groups)),
                     latent_dim=16, rope_dim=16, index_dim=16, device_pages=1, index_pages=1, host_pages=1,
                     max_seqs=Rq, max_pages=MP, hot_rows=HR, kv_dtype="float32", fetch="row", fetch_min_rows=8,
                     mirror_to_host=True, topk=case["topk"].shape[1])
    junk = np.random.default_rng(1).integers(-1, 9, (Rq, groups, HR)).astype(np.int32)
    tok, st = junk.copy(), junk.copy()
    tok[:, group], st[:, group] = case["hot_token"], case["hot_stamp"]
    store = dataclasses.replace(
        init_store(spec), block_table=jnp.asarray(case["block_table"]), host_table=jnp.asarray(case["host_table"]),
        hot_pages=jnp.asarray(case["hot_pages"]), hot_token=jnp.asarray(tok), hot_stamp=jnp.asarray(st),
        clock=jnp.asarray(case["clock"]))
    plan, out = jax.jit(resolve, static_argnums=(1,))(
        store, group, jnp.asarray(case["req"]), jnp.asarray(case["topk"]))
    others = [g for g in range(groups) if g != group]
    np.testing.assert_array_equal(np.asarray(out.hot_token)[:, others], junk[:, others])
    np.testing.assert_array_equal(np.asarray(out.hot_stamp)[:, others], junk[:, others])
    return [np.asarray(x) for x in plan] + [np.asarray(out.hot_token)[:, group], np.asarray(out.hot_stamp)[:, group]]


SCENARIOS = ("mixed", "empty", "all_hit", "all_miss", "adversarial", "starved")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_reference_matches_ops_resolve(scenario):
    for seed in range(3):
        case = make_case(seed, scenario=scenario)
        assert_same(run(sparse_gather_reference, case), resolve_via_store(case))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_kernel_matches_reference(scenario):
    for seed, clock in ((0, 7), (1, 2**30), (2, 3)):  # a large clock spreads stamps: ~30 bisection steps
        case = make_case(seed, scenario=scenario, clock=clock)
        assert_same(run(sparse_gather, case, interpret=True), run(sparse_gather_reference, case))


def test_kernel_matches_reference_on_the_gpu_checks_case():
    """`kernel_cases.gather_case`, the GPU check's resolver input (resident pages, about half of the other top-k
    positions held, buffers 3/4 full, two idle request slots), at this file's shapes: kernel == reference, and the
    case has resident rows, hits and misses."""
    args = gather_case(4, B=3, K=20, hot_rows=48, context=6 * 64)
    want = [np.asarray(x) for x in sparse_gather_reference(*args, hot_rows=48)]
    assert_same([np.asarray(x) for x in sparse_gather(*args, hot_rows=48, interpret=True)], want)
    out = dict(zip(FIELDS, want))
    assert out["resident"].any() and out["miss"].any() and (out["valid"] & ~out["resident"] & ~out["miss"]).any()


def test_scenarios_exercise_every_path():
    """The generated states really hit the paths they are named after."""
    counts = {}
    for scenario in SCENARIOS:
        out = dict(zip(FIELDS, run(sparse_gather_reference, make_case(0, scenario=scenario))))
        hit = out["valid"] & ~out["resident"] & ~out["miss"]
        counts[scenario] = (out["resident"].sum(), hit.sum(), out["miss"].sum())
    assert counts["empty"][:2] == (0, 0) and counts["empty"][2] > 0
    assert counts["all_miss"][:2] == (0, 0) and counts["all_miss"][2] > 0
    assert counts["all_hit"][2] == 0 and counts["all_hit"][1] > 0
    assert all(c > 0 for c in counts["mixed"])
    assert counts["starved"][1] > 0 and counts["starved"][2] > 0


@pytest.mark.parametrize("seq_len", [1, 63, 64, 65, 19, 20, 21, 300])
def test_seq_len_boundaries(seq_len):
    """K = 20: seq_len in {1, 63, 64, 65, K-1, K, K+1, several pages} (-1 padding when seq_len < K)."""
    case = make_case(seq_len, seq_len=seq_len)
    ref = run(sparse_gather_reference, case)
    assert_same(run(sparse_gather, case, interpret=True), ref)
    assert_same(ref, resolve_via_store(case))


@pytest.mark.parametrize("K,HR,tile_note", [(5, 5, "K = HR, odd"), (64, 64, "one full tile"), (70, 100, "HR % 8 = 4"),
                                            (33, 96, "K just over a tile")])
def test_awkward_sizes(K, HR, tile_note):
    for scenario in ("mixed", "adversarial", "all_miss"):  # all_miss: m > 64, several rank tiles
        case = make_case(K + HR, K=K, HR=HR, scenario=scenario)
        ref = run(sparse_gather_reference, case)
        assert_same(run(sparse_gather, case, interpret=True), ref)
        assert_same(ref, resolve_via_store(case))


def test_multi_step_trajectory():
    """Ten steps feeding each step's hot state to the next (clock + 1): the LRU dynamics stay identical."""
    case = make_case(3, scenario="empty", K=24, HR=40, MP=3)
    rng = np.random.default_rng(5)
    ref_state = ker_state = (case["hot_token"], case["hot_stamp"])
    for step in range(10):
        S = case["block_table"].shape[1] * 64
        case["topk"] = np.stack([rng.permutation(S)[:24] for _ in range(case["topk"].shape[0])]).astype(np.int32)
        case["clock"] = np.int32(step)
        ref = run(sparse_gather_reference, dict(case, hot_token=ref_state[0], hot_stamp=ref_state[1]))
        ker = run(sparse_gather, dict(case, hot_token=ker_state[0], hot_stamp=ker_state[1]), interpret=True)
        assert_same(ker, ref)
        ref_state, ker_state = (ref[7], ref[8]), (ker[7], ker[8])
    assert (ref_state[1] >= 0).sum() > 0


def test_rejects_unsupported_shapes():
    case = make_case(0, K=20, HR=16)
    with pytest.raises(ValueError, match="hot_rows=16 must be >= K=20"):
        run(sparse_gather, case, interpret=True)
    case = make_case(0)
    with pytest.raises(ValueError, match="hot_rows"):
        sparse_gather(*[jnp.asarray(case[k]) for k in ("topk", "req", "block_table", "host_table", "hot_pages",
                                                        "hot_token", "hot_stamp", "clock")], hot_rows=64)


@pytest.mark.parametrize("HR", [4096, 10240])
def test_lowers_for_cuda(HR):
    """Pallas -> Triton lowering at production shapes (B=32, K=2048, MP=2048 pages, HR hot rows)."""
    B, K, Rq, MP = 32, 2048, 64, 2048
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    args = (i32(B, K), i32(B), i32(Rq, MP), i32(Rq, MP), i32(Rq, HR // 64), i32(Rq, HR), i32(Rq, HR), i32())
    with gpu_lowering_target():  # jax >= 0.11 needs the target GPU named
        lowered = jax.jit(functools.partial(sparse_gather, hot_rows=HR)).trace(*args).lower(
            lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 2


def test_plan_fields_match_dataclass():
    assert FIELDS[:7] == Plan._fields
