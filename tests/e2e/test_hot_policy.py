"""Score-aware retention in the store (`CacheConfig(hot_policy="score_ema")`): a moving average of every position's
indexer scores beside its key (`index_ema`), the held positions' averages the resolver's victim keys. The encoding
keeps the float order; the averages fold each step's scores as a NumPy oracle does; the resolver (jnp and Pallas,
interpret mode) picks the victims the oracle picks; a policy changes where rows are read from, never the tokens."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.generate import generate
from hisparse_jax.kv.resolve import SCORE_KEY_MAX, encode_score, resolve, update_index_ema
from hisparse_jax.kv.scoring import index_scores_paged
from hisparse_jax.kv.state import StoreSpec, init_store
from pallas_kernels.sparse_gather import sparse_gather, sparse_gather_reference
from pallas_kernels.sparse_gather.reference import UNUSED_STAMP
from test_kernel_sparse_gather import assert_same, make_case, run
from tiny import BIG, model_cfg

BETA = 0.9


def test_encode_score_keeps_the_float_order():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-30, 30, 4000),
                        [0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, 1.0 + 2**-23, 1.0 + 2**-22]])
    x = np.sort(x.astype(np.float32))
    k = np.asarray(encode_score(jnp.asarray(x)))
    assert k.dtype == np.int32 and k.min() >= 0 and k.max() <= SCORE_KEY_MAX < UNUSED_STAMP
    assert np.all(np.diff(k.astype(np.int64)) >= 0)  # non-decreasing: the integer order is the float order
    one = np.asarray(encode_score(jnp.asarray(np.float32([1.0, 1.0 + 2**-22, -1.0, -1.0 - 2**-22]))))
    assert one[0] < one[1] and one[2] > one[3]  # only the lowest mantissa bit is dropped


def score_key_case(seed, **kw):
    """A resolver case whose hot_stamp holds score keys (the score_ema store's state): encoded averages spread over
    the whole key range with ties, never-used slots (-1) and slots past a budget (UNUSED_STAMP)."""
    case = make_case(seed, **kw)
    rng = np.random.default_rng(seed + 100)
    tok = case["hot_token"]
    x = (rng.standard_normal(tok.shape) * 10.0 ** rng.integers(-3, 4, tok.shape)).astype(np.float32)
    x[:, 1::5] = x[:, ::5][:, :x[:, 1::5].shape[1]]  # ties: slot 5i + 1 averages what slot 5i does
    keys = np.asarray(encode_score(jnp.asarray(x)))
    keys = np.where(tok < 0, -1, keys)
    HR = tok.shape[1]
    keys[:, HR - max(1, HR // 8):] = np.where(tok[:, HR - max(1, HR // 8):] < 0, UNUSED_STAMP,
                                              keys[:, HR - max(1, HR // 8):])
    return dict(case, hot_stamp=keys.astype(np.int32))


@pytest.mark.parametrize("scenario", ["mixed", "all_miss", "adversarial"])
def test_kernel_matches_reference_on_score_keys(scenario):
    """The Pallas resolver selects its victims exactly for any keys, not only step stamps near the clock."""
    for seed in range(3):
        case = score_key_case(seed, scenario=scenario)
        assert_same(run(sparse_gather, case, interpret=True), run(sparse_gather_reference, case))


# ----- the store's score_ema rule against a NumPy oracle ------------------------------------------------------
def _spec(Rq, MP, HR, K, PI):
    return StoreSpec(num_layers=2, num_indexer_layers=2, groups=((0,), (1,)), latent_dim=16, rope_dim=16,
                     index_dim=16, device_pages=1, index_pages=PI, host_pages=1, max_seqs=Rq, max_pages=MP,
                     hot_rows=HR, kv_dtype="float32", fetch="row", fetch_min_rows=8, mirror_to_host=True, topk=K,
                     hot_policy="score_ema", hot_ema_beta=BETA)


def _state(seed, Rq=5, MP=4, HR=24, K=10, B=4):
    rng = np.random.default_rng(seed)
    S = MP * 64
    req = rng.permutation(Rq)[:B].astype(np.int32)
    req[rng.random(B) < 0.25] = -1
    topk = np.stack([rng.permutation(S)[:K] for _ in range(B)]).astype(np.int32)
    topk[:, -2:] = np.where(rng.random((B, 2)) < 0.5, -1, topk[:, -2:])
    block_table = np.where(rng.random((Rq, MP)) < 0.3, rng.permutation(4 * Rq * MP)[:Rq * MP].reshape(Rq, MP),
                           -1).astype(np.int32)
    host_table = rng.permutation(4 * Rq * MP)[:Rq * MP].reshape(Rq, MP).astype(np.int32)
    index_table = rng.permutation(Rq * MP).reshape(Rq, MP).astype(np.int32)
    hot_pages = rng.permutation(8 * Rq)[:Rq].reshape(Rq, 1).astype(np.int32)
    hot_pages[0, 0] = -1  # request 0 has no hot buffer
    tok = np.full((Rq, HR), -1, np.int32)
    for r in range(Rq):
        n = int(rng.integers(0, HR + 1))
        tok[r, :n] = rng.permutation(S)[:n]
    for b, r in enumerate(req):  # some of each row's top-k are held (hits)
        if r >= 0:
            held = [t for t in topk[b, :4] if t >= 0 and t not in tok[r]]
            tok[r, rng.permutation(HR - 3)[:len(held)]] = held
    stamp = np.where(np.arange(HR) < HR - 3, -1, UNUSED_STAMP)[None].repeat(Rq, 0).astype(np.int32)
    tok[:, HR - 3:] = -1  # past the budget: never filled
    ema = rng.standard_normal((2, Rq * MP, 64)).astype(np.float32)
    ema[1, :, 5::9] = ema[1, :, 4::9][:, :ema[1, :, 5::9].shape[1]]  # ties
    return dict(topk=topk, req=req, block_table=block_table, host_table=host_table, index_table=index_table,
                hot_pages=hot_pages, hot_token=tok, hot_stamp=stamp, index_ema=ema)


def _oracle(c, group=1):
    """score_ema by hand: the resolver's rule with keys = the held positions' encoded averages (-1 empty, never a
    slot past the budget): misses claim the lowest (key, slot) slots not hit, in slot order. Returns (hot_token,
    miss, hit)."""
    tok = c["hot_token"].copy()
    B, K = c["topk"].shape
    miss = np.zeros((B, K), bool)
    hit = np.zeros((B, K), bool)
    for b, r in enumerate(c["req"]):
        if r < 0 or c["hot_pages"][r, 0] < 0:  # idle, or no hot buffer: resident rows only, nothing claimed
            continue
        held = c["hot_token"][r]
        pos = np.maximum(held, 0)
        avg = c["index_ema"][group, c["index_table"][r, pos // 64], pos % 64]
        keys = np.where(c["hot_stamp"][r] == UNUSED_STAMP, UNUSED_STAMP,
                        np.where(held < 0, -1, np.asarray(encode_score(jnp.asarray(avg)))))
        hit_slots, misses = set(), []
        for i, t in enumerate(c["topk"][b]):
            if t < 0 or c["block_table"][r, t // 64] >= 0:
                continue
            where = np.flatnonzero(held == t)
            if where.size:
                hit[b, i] = True
                hit_slots.add(int(where[0]))
            elif c["host_table"][r, t // 64] >= 0:
                miss[b, i] = True
                misses.append(t)
        free = sorted((int(keys[j]), j) for j in range(len(keys)) if j not in hit_slots)
        for j, t in zip(sorted(j for _, j in free[:len(misses)]), misses):
            tok[r, j] = t
    return tok, miss, hit


def _store(c, spec):
    Rq, HR = c["hot_token"].shape
    junk = np.random.default_rng(1).integers(-1, 9, (Rq, 2, HR)).astype(np.int32)
    tok, st = junk.copy(), junk.copy()
    tok[:, 1], st[:, 1] = c["hot_token"], c["hot_stamp"]
    return dataclasses.replace(
        init_store(spec), block_table=jnp.asarray(c["block_table"]), host_table=jnp.asarray(c["host_table"]),
        index_table=jnp.asarray(c["index_table"]), hot_pages=jnp.asarray(c["hot_pages"]), hot_token=jnp.asarray(tok),
        hot_stamp=jnp.asarray(st), index_ema=jnp.asarray(c["index_ema"]), clock=jnp.asarray(9, jnp.int32)), junk


@pytest.mark.parametrize("kernel", [False, True], ids=["jnp", "pallas_interpret"])
def test_score_ema_resolve_matches_the_oracle(kernel):
    total = np.zeros(2, int)
    for seed in range(4):
        c = _state(seed)
        Rq, HR = c["hot_token"].shape
        spec = _spec(Rq, c["block_table"].shape[1], HR, c["topk"].shape[1], c["index_ema"].shape[1])
        store, junk = _store(c, spec)
        resolver = functools.partial(sparse_gather, interpret=True) if kernel else None
        fn = jax.jit(functools.partial(resolve, resolver=resolver), static_argnums=(1,))
        plan, out = fn(store, 1, jnp.asarray(c["req"]), jnp.asarray(c["topk"]))
        want_tok, want_miss, want_hit = _oracle(c)
        np.testing.assert_array_equal(np.asarray(out.hot_token)[:, 1], want_tok)
        np.testing.assert_array_equal(np.asarray(out.hot_stamp)[:, 1], c["hot_stamp"])  # only the budget's marks
        np.testing.assert_array_equal(np.asarray(plan.miss), want_miss)
        np.testing.assert_array_equal(np.asarray(plan.valid & ~plan.resident & ~plan.miss), want_hit)
        np.testing.assert_array_equal(np.asarray(out.hot_token)[:, 0], junk[:, 0])  # other groups untouched
        np.testing.assert_array_equal(np.asarray(out.hot_stamp)[:, 0], junk[:, 0])
        total += want_miss.sum(), want_hit.sum()
    assert np.all(total > 0), total


@pytest.mark.parametrize("rows_per_request", [1, 2])
def test_update_index_ema_folds_each_scored_position_once(rows_per_request):
    """The average of every scored position: its score the first time (NaN before), then beta-weighted; positions
    not scored (past a row's position, idle rows) unchanged; with 2 rows per request the higher score, once; a page
    two requests share (a prefix) follows the first of them in the batch."""
    c = _state(7)
    Rq, MP = c["index_table"].shape
    spec = _spec(Rq, MP, 24, 10, c["index_ema"].shape[1])
    c["index_table"][3, :2] = c["index_table"][2, :2]  # requests 2 and 3 share their first two pages
    ema0 = c["index_ema"].copy()
    ema0[1, :, ::7] = np.nan  # never scored
    c["index_ema"] = ema0
    store, _ = _store(c, spec)
    rng = np.random.default_rng(3)
    S = rows_per_request
    req = np.array([2, 2, 3, 3, -1, -1, 4, 4] if S == 2 else [2, 3, -1, 4], np.int32)
    positions = np.array([150, 151, 100, 101, 0, 0, 200, -1] if S == 2 else [150, 100, 0, 200], np.int32)
    P = 4
    scores = rng.standard_normal((len(req), P * 64)).astype(np.float32)
    _, valid, pages = index_scores_paged(store, 1, jnp.asarray(req), jnp.asarray(positions),
                                         jnp.zeros((len(req), 1, 16)), jnp.zeros((len(req), 1)), P)
    out = jax.jit(functools.partial(update_index_ema, rows_per_request=S), static_argnums=(1,))(
        store, 1, jnp.asarray(req), jnp.asarray(scores), valid, pages)
    want = ema0.copy()
    new = {}
    for g in range(len(req) // S):
        rows = range(g * S, g * S + S)
        r = max(req[i] for i in rows)
        if r < 0:
            continue
        for t in range(P * 64):
            ok = [i for i in rows if req[i] >= 0 and t <= positions[i]]
            if not ok:
                continue
            s = max(scores[i, t] for i in ok)
            at = (c["index_table"][r, t // 64], t % 64)
            old = ema0[1][at]
            v = s if np.isnan(old) else np.float32(BETA * old + (1 - BETA) * s)
            new.setdefault(at, v)  # the batch's first row scoring the page writes it
    for at, v in new.items():
        want[1][at] = v
    got = np.asarray(out.index_ema)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    assert len(new) > 300


# ----- through the model: where rows come from changes, the tokens do not -------------------------------------
@pytest.fixture(scope="module")
def model():
    return hj.SparseMLAModel(model_cfg(), rngs=nnx.Rngs(5))


PROMPTS = [[(11 * i + 5 * j * j) % 97 for j in range(n)] for i, n in enumerate((260, 140, 200))]
TIGHT = BIG.replace(device_pages=9)


@pytest.fixture(scope="module")
def lru_run(model):
    return generate(model, PROMPTS, 16, cache=TIGHT, return_stats=True)


def test_generate_gives_the_same_tokens_under_score_ema(model, lru_run):
    out, st = generate(model, PROMPTS, 16, cache=TIGHT.replace(hot_policy="score_ema"), return_stats=True)
    assert out == lru_run[0]
    assert st.hits + st.misses == lru_run[1].hits + lru_run[1].misses  # the same rows were asked for
    assert st.misses > 0 and st.hits > 0
    assert st.per_layer["hits"] != lru_run[1].per_layer["hits"]  # ... and the policies kept different ones


def test_pallas_resolver_runs_score_ema_like_the_reference(model):
    cache = TIGHT.replace(hot_policy="score_ema")
    a, sa = generate(model, PROMPTS, 6, cache=cache, return_stats=True)
    b, sb = generate(model, PROMPTS, 6, cache=cache, return_stats=True, kernels="pallas_interpret")
    assert a == b and (sa.hits, sa.misses, sa.h2d_bytes) == (sb.hits, sb.misses, sb.h2d_bytes) and sa.misses > 0


def test_engine_gives_the_same_tokens_under_score_ema(model, lru_run):
    from hisparse_jax.engine import Engine, EngineConfig, SamplingParams

    eng = Engine(model, TIGHT.replace(hot_policy="score_ema"),
                 EngineConfig(policy="hisparse", max_running=3, prefill="whole", check_invariants=True))
    assert eng.generate(PROMPTS, SamplingParams(max_new_tokens=16)) == lru_run[0]
    assert eng.metrics().misses > 0


def test_bad_hot_policies_are_refused():
    with pytest.raises(ValueError, match="hot_policy must be one of"):
        hj.CacheConfig(hot_policy="lfu")
    for beta, why in ((1.0, r"must be < 1 \(the weight of the past\), got 1.0"), (-0.1, "must be >= 0.0, got -0.1"),
                      (True, "must be a number, got True"), ("0.9", "must be a number, got '0.9'"),
                      (float("nan"), "must be finite, got nan")):
        with pytest.raises(ValueError, match="hot_ema_beta " + why):
            hj.CacheConfig(hot_policy="score_ema", hot_ema_beta=beta)
    assert hj.CacheConfig(hot_policy="score_ema", hot_ema_beta=np.float32(0.5)).hot_ema_beta == 0.5  # numpy numbers
    with pytest.raises(ValueError, match="hot_policy must be the capacity's"):
        BIG.replace(capacity=BIG).replace(hot_policy="score_ema")


def test_the_averages_are_counted_in_the_device_budget():
    """score_ema's 4 bytes per token and index layer come out of the device budget: an indexer page costs that much
    more, so one device byte budget splits into fewer KV pages than under lru."""
    from hisparse_jax.engine import device_budget

    cfg = model_cfg()
    for kv, index in (("float32", "auto"), ("bf16", "auto"), ("float32", "int4")):
        cache = hj.CacheConfig(kv_dtype=kv, index_dtype=index)
        lru, ema = (StoreSpec.create(cfg, cache.replace(hot_policy=p)) for p in ("lru", "score_ema"))
        assert ema.index_row_bytes == lru.index_row_bytes + 4
    budget = 64 * (StoreSpec.create(cfg, BIG).page_bytes * 4 + 64 * 2 * StoreSpec.create(cfg, BIG).index_row_bytes)
    kw = dict(max_running=4, max_len=512)
    a = device_budget(cfg, BIG, budget, "offload", **kw)
    b = device_budget(cfg, BIG.replace(hot_policy="score_ema"), budget, "offload", **kw)
    assert a.device_pages == 64 and b.device_pages < 64


def test_fuzzer_option_applies_to_the_kinds_that_take_it(capsys):
    from experiments import fuzz_tiered as fz

    with pytest.raises(SystemExit) as e:
        fz.main(["--only", "mesh", "--hot-policy", "score_ema", "--out", "/nonexistent/x.json"])
    assert e.value.code == 2 and "--hot-policy score_ema applies to --only generate or engine" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        fz.main(["--only", "engine", "--hot-policy", "mru"])
    assert e.value.code == 2 and "invalid choice: 'mru'" in capsys.readouterr().err


def test_trace_replay_refuses_score_ema(model):
    from hisparse_jax.kv.device import gather, new_store
    from hisparse_jax.kv.manager import PageManager

    manager = PageManager(model.cfg, TIGHT.replace(hot_policy="score_ema"))
    with pytest.raises(ValueError, match="gather replays top-k without the indexer's scores"):
        gather(new_store(manager), manager, [0], np.zeros((1, 16), np.int32))


# ----- hisparse demo --hot-policy --------------------------------------------------------------------------------
def test_demo_option_is_checked_like_the_others(monkeypatch, capsys):
    from hisparse_jax import cli, demo, demo_workload

    def refuse(*a, **k):
        raise AssertionError("work started despite a bad argument")

    monkeypatch.setattr(demo, "run_policies", refuse)
    assert cli.main(["demo", "--hot-policy", "lfu"]) == 2
    err = capsys.readouterr().err
    assert "argument --hot-policy: invalid choice: 'lfu'" in err and "score_ema" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="hot_policy"):
        demo.run(hot_policy="lfu")
    assert demo.parse_args([]).hot_policy == "lru"
    cfg = model_cfg()
    assert demo_workload.budgets(cfg, 2, 500, 2.0, hot_policy="score_ema")[0].hot_policy == "score_ema"


@pytest.mark.slow
def test_demo_runs_every_hot_policy_with_the_same_outputs():
    from hisparse_jax import demo

    runs = {p: demo.run(requests=4, prompt_len=384, new_tokens=4, policies=("hisparse",), hot_policy=p, plot="",
                        device_requests=2.5, preset="demo-glm") for p in ("lru", "score_ema")}
    for p, out in runs.items():
        assert out["hot_policy"] == p and out["policies"]["hisparse"]["misses"] > 0
    a, b = (runs[p]["policies"]["hisparse"] for p in ("lru", "score_ema"))
    assert a["outputs_sha256"] == b["outputs_sha256"]
    assert a["hits"] + a["misses"] == b["hits"] + b["misses"]
