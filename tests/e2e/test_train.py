"""Training (`hisparse_jax.train`): the corpus, the three DSA stages' and the two MTP stages' objectives and
freezing, and the training script's smoke recipe end to end (checkpoint loadable, card and log written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hisparse_jax.model.decoder import SparseMLAModel
from hisparse_jax.model.mtp import mtp_forward
from hisparse_jax.train import data, dsa
from tiny import model_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# tiny.py's base, all-dense, at 3 layers with one MTP layer
TINY = model_cfg(vocab_size=256, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, q_lora_rank=16,
                 qk_rope_head_dim=8, v_head_dim=8, mlp_layer_types=("dense",) * 3, index_n_heads=2, index_head_dim=16,
                 index_topk=8, indexer_types=("full", "shared", "full"), eos_token_id=(0,), num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus()


def test_corpus_is_the_stdlib_split_by_path(corpus):
    train, held, info = corpus
    files = data.source_files()
    assert files == sorted(files) and files
    assert not any(part in ("test", "tests", "site-packages") for f in files for part in f.split(os.sep)[:-1])
    n_held = sum(data.is_held_out(f) for f in files)
    assert 0 < n_held < len(files) / 8
    # one BOS per file, at the start of each
    assert int(np.sum(train == data.BOS_ID)) == info.train_files and train[0] == data.BOS_ID
    assert int(np.sum(held == data.BOS_ID)) == info.held_out_files
    assert info.train_bytes == train.size and info.train_files + info.held_out_files <= len(files)
    assert data.load_corpus()[2] == info  # the same bytes every time
    w = next(data.random_windows(train, 65, 3, seed=1))
    assert w.shape == (3, 65) and w.dtype == np.int32 and (w == next(data.random_windows(train, 65, 3, 1))).all()
    with pytest.raises(ValueError, match="fewer than"):
        data.fixed_windows(held, held.size, 2)


@pytest.mark.parametrize("indexer_types", [("full", "shared", "full"), ("full", "full", "full")])
def test_sparse_training_forward_is_the_models_forward(corpus, indexer_types):
    cfg = TINY.replace(indexer_types=indexer_types)
    model = SparseMLAModel(cfg, rngs=nnx.Rngs(3))
    ids = jnp.asarray(next(data.random_windows(corpus[0], 40, 2, seed=0)))
    logits, aux = dsa.train_forward(model, ids, stage="sparse")
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(model(ids)))
    assert len(aux["topk"]) == aux["kl"].shape[0] == indexer_types.count("full")
    # dense attention differs once a query sees more than top-k keys
    dense, _ = dsa.train_forward(model, ids, stage="dense")
    assert np.abs(np.asarray(dense[:, cfg.index_topk + 1:] - logits[:, cfg.index_topk + 1:])).max() > 1e-6
    np.testing.assert_allclose(np.asarray(dense[:, :cfg.index_topk]), np.asarray(logits[:, :cfg.index_topk]),
                               rtol=1e-5, atol=1e-5)
    # the warm-up scores the indexer but attends densely: the dense logits, and a KL per full indexer
    warm, waux = dsa.train_forward(model, ids, stage="warmup")
    np.testing.assert_array_equal(np.asarray(warm), np.asarray(dense))
    assert waux["kl"].shape == aux["kl"].shape and not waux["topk"] and (np.asarray(waux["kl"]) > 0).all()


def test_evaluate_reports_where_the_sparse_loss_comes_from(corpus):
    model = SparseMLAModel(TINY, rngs=nnx.Rngs(5))
    K = TINY.index_topk
    assert dsa.position_buckets(8192, 128) == [(0, 128), (128, 512), (512, 1024), (1024, 2048), (2048, 4096),
                                               (4096, 8192)]
    assert dsa.position_buckets(100, 8) == [(0, 8), (8, 32), (32, 64), (64, 100)]
    assert dsa.position_buckets(6, 8) == [(0, 6)]
    windows = data.fixed_windows(corpus[1], 101, 3)
    ev = dsa.evaluate(model, windows)
    buckets = ev["by_position"]
    assert [b["positions"] for b in buckets] == [list(b) for b in dsa.position_buckets(100, K)]
    # below top-k every query attends to all its keys: sparse is dense there (up to the programs' rounding), not past it
    assert abs(buckets[0]["loss_sparse"] - buckets[0]["loss_dense"]) < 1e-5
    assert max(abs(b["loss_sparse"] - b["loss_dense"]) for b in buckets[1:]) > 1e-4
    # the buckets split the positions: their losses weighted by width are the window's
    for kind in ("dense", "sparse"):
        whole = sum(b[f"loss_{kind}"] * (b["positions"][1] - b["positions"][0]) for b in buckets) / 100
        np.testing.assert_allclose(whole, ev[f"loss_{kind}"], rtol=1e-5)
        np.testing.assert_allclose(np.exp(ev["loss_sparse"] - ev["loss_dense"]), ev["sparse_over_dense_ppl"])


def test_indexer_kl():
    rng = np.random.default_rng(0)
    B, H, T = 2, 3, 6
    p = jax.nn.softmax(jnp.asarray(rng.normal(size=(B, H, T, T)), jnp.float32), axis=-1)
    attend = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    p = jnp.where(attend[:, None], p, 0)
    p = p / p.sum(-1, keepdims=True)
    target = p.sum(1) / H
    exact = dsa.indexer_kl(p, jnp.log(jnp.where(attend, target, 1.0)), attend)
    assert abs(float(exact)) < 1e-6  # the indexer that reproduces the attention has no loss
    other = dsa.indexer_kl(p, jnp.asarray(rng.normal(size=(B, T, T)), jnp.float32), attend)
    assert float(other) > 0.01
    # keys outside `attend` do not count, whatever their scores
    junk = jnp.where(attend, jnp.log(jnp.where(attend, target, 1.0)), 1e9)
    assert abs(float(dsa.indexer_kl(p, junk, attend))) < 1e-6


def _params(model):
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {tuple(str(k) for k in path): np.asarray(v[...]) for path, v in flat}


@pytest.mark.parametrize("stage", dsa.STAGES)
def test_each_stage_trains_only_its_parameters(corpus, stage):
    model = SparseMLAModel(TINY, rngs=nnx.Rngs(0), mtp=True)
    before = _params(model)
    sc = dsa.StageConfig(stage, steps=3, lr=1e-2, batch=2, seq_len=24, warmup_steps=1)
    rows = dsa.train_stage(model, sc, data.random_windows(corpus[0], 25, 2, seed=2), log_every=1)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in rows)
    after = _params(model)
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    mtp = {k for k in before if k[0] == "mtp"}
    indexer = {k for k in before if "indexer" in k} - mtp
    mtp_indexer = {k for k in mtp if "indexer" in k}
    assert indexer and mtp_indexer and changed
    if stage == "dense":
        assert not changed & (indexer | mtp)
    elif stage == "warmup":
        assert changed <= indexer and rows[-1]["lm"] > 0
    elif stage == "sparse":
        assert changed & indexer and changed - indexer - mtp and not changed & mtp
    else:  # the main model frozen; the MTP layer and its indexer learn
        assert changed <= mtp and changed & mtp_indexer and changed - mtp_indexer and rows[-1]["kl"] > 0


@pytest.mark.parametrize("stage", ["dense", "warmup", "sparse"])
def test_remat_gives_the_same_loss_and_gradients(corpus, stage):
    """`remat=True` (each block recomputed in the backward pass, for long contexts) changes memory, not the math:
    the loss and every parameter's gradient equal those of the stored-activation pass."""
    model = SparseMLAModel(TINY.replace(indexer_types=("full", "shared", "full")), rngs=nnx.Rngs(4))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = jnp.asarray(next(data.random_windows(corpus[0], 41, 2, seed=5)))

    def grads(remat):
        def loss(p):
            return dsa.stage_loss(nnx.merge(graphdef, p, rest), batch, stage, remat=remat)[0]
        return jax.value_and_grad(loss)(params)

    (l0, g0), (l1, g1) = grads(False), grads(True)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    flat0, flat1 = jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)
    assert len(flat0) == len(flat1) and any(np.abs(np.asarray(g)).max() > 0 for g in flat0)
    for a, b in zip(flat0, flat1):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


class _Killed(Exception):
    pass


def _killed_after(batches, n):
    """`batches`, then the process "dies" when it asks for batch n + 1."""
    for i, b in enumerate(batches):
        if i == n:
            raise _Killed
        yield b


def test_a_killed_stage_resumes_to_the_uninterrupted_result(corpus, tmp_path):
    """`train_stage(resume=StageResume(dir, every=2, ...))` killed at step 4 of 5 continues from its step-2 state
    (Orbax) to the same parameters, optimizer moments and logged losses as a run never killed; another run's
    directory is refused; a finished stage leaves none behind."""
    from hisparse_jax.train.resume import StageResume

    sc = dsa.StageConfig("sparse", steps=5, lr=1e-2, batch=2, seq_len=24, warmup_steps=1)
    stream = lambda: data.random_windows(corpus[0], 25, 2, seed=7)  # noqa: E731
    fresh = lambda: SparseMLAModel(TINY, rngs=nnx.Rngs(9))  # noqa: E731
    whole = fresh()
    rows = dsa.train_stage(whole, sc, stream(), log_every=1)

    model, where = fresh(), tmp_path / "resume"
    fingerprint = {"stage": 3, "config": sc.__dict__}
    with pytest.raises(_Killed):
        dsa.train_stage(model, sc, _killed_after(stream(), 3), log_every=1, resume=StageResume(where, 2, fingerprint))
    start = _params(fresh())  # a killed stage leaves the model's weights as they were
    assert all(np.array_equal(v, start[k]) for k, v in _params(model).items()) and (where / "stage.json").exists()
    with pytest.raises(ValueError, match="another run"):
        dsa.train_stage(fresh(), sc, stream(), resume=StageResume(where, 2, {**fingerprint, "stage": 4}))
    model = fresh()  # the weights the stage started from (a new process loads them from the last stage's save)
    again = dsa.train_stage(model, sc, stream(), log_every=1, resume=StageResume(where, 2, fingerprint))
    strip = lambda rs: [{k: v for k, v in r.items() if k != "s_per_step"} for r in rs]  # noqa: E731
    assert strip(again) == strip(rows) and [r["step"] for r in again] == [1, 2, 3, 4, 5]
    want, got = _params(whole), _params(model)
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    assert not where.exists()


def test_mtp_training_forward_is_the_drafting_forward(corpus):
    """The "mtp_sparse" stage trains what speculative decoding drafts with: its MTP logits are `mtp_forward`'s on
    the main model's own hidden states, its main logits the model's; the dense stage differs (dense attention)."""
    model = SparseMLAModel(TINY, rngs=nnx.Rngs(5), mtp=True)
    ids = jnp.asarray(next(data.random_windows(corpus[0], 41, 2, seed=4)))
    main, draft, aux = dsa.mtp_train_forward(model, ids, stage="mtp_sparse", recall=True)
    logits, maux = model.forward(ids[:, :-1])
    want, _ = mtp_forward(model, maux["hidden"][:, :-1], ids[:, 1:-1])
    np.testing.assert_array_equal(np.asarray(main), np.asarray(logits))
    np.testing.assert_array_equal(np.asarray(draft), np.asarray(want))
    assert draft.shape == (2, 39, 256) and aux["kl"].shape == aux["recall"].shape == (1,)
    dense = dsa.mtp_train_forward(model, ids, stage="mtp_dense")[1]
    assert not np.allclose(np.asarray(dense), np.asarray(draft))
    loss, metrics = dsa.stage_loss(model, ids, "mtp_sparse")
    np.testing.assert_allclose(float(metrics["lm"]), float(dsa.lm_loss(draft, ids[:, 2:])), rtol=1e-6)
    with pytest.raises(ValueError, match="MTP stages"):
        dsa.mtp_train_forward(model, ids, stage="sparse")
    with pytest.raises(ValueError, match="mtp_train_forward"):
        dsa.train_forward(model, ids, stage="mtp_dense")
    with pytest.raises(ValueError, match="need a model with an MTP layer"):
        dsa.mtp_train_forward(SparseMLAModel(TINY, rngs=nnx.Rngs(5)), ids, stage="mtp_dense")


def test_draft_agreement_and_mtp_head_init():
    main = jnp.zeros((1, 4, 5)).at[0, jnp.arange(4), jnp.array([1, 2, 3, 4])].set(1.0)  # greedy 1, 2, 3, 4
    draft = jnp.zeros((1, 3, 5)).at[0, jnp.arange(3), jnp.array([2, 0, 4])].set(1.0)  # rows t vs main t + 1
    assert float(dsa.draft_agreement(main, draft)) == pytest.approx(2 / 3)
    model = SparseMLAModel(TINY, rngs=nnx.Rngs(1), mtp=True)
    model.norm.weight[...] = jnp.linspace(0.5, 1.5, TINY.hidden_size)
    dsa.init_mtp_head(model)
    np.testing.assert_array_equal(np.asarray(model.mtp[0].shared_head.kernel[...]), np.asarray(model.lm_head.kernel[...]))
    np.testing.assert_array_equal(np.asarray(model.mtp[0].shared_head_norm.weight[...]),
                                  np.asarray(model.norm.weight[...]))


def test_model_card_tells_two_stages_of_one_kind_apart():
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    try:
        import train_locality_model as script
    finally:
        sys.path.remove(os.path.join(ROOT, "experiments"))
    steps = [{"stage": s, "step": i, "loss": loss} for s, i, loss in
             [("dense", 10, 3.0), ("dense", 20, 2.5), ("dense", 10, 2.2), ("warmup", 10, 0.9), ("sparse", 10, 2.1)]]
    assert [[r["loss"] for r in g] for g in script.stage_rows(steps)] == [[3.0, 2.5], [2.2], [0.9], [2.1]]
    ev = {"ppl_dense": 6.0, "ppl_sparse": 6.1, "sparse_over_dense_ppl": 1.01, "recall_per_index_layer": [0.5],
          "windows": 1, "tokens_per_window": 8}
    stages = [{"config": {"stage": s, "steps": 1, "batch": 1, "seq_len": 8, "lr": 1e-3}, "eval": ev, "wall_s": 60}
              for s in ("dense", "dense", "warmup", "sparse")]
    log = {"corpus": {"python": "3", "train_files": 1, "train_bytes": 1, "held_out_files": 1, "held_out_bytes": 1,
                      "sha256": "x"}, "config": {"index_topk": 4}, "parameters": 1, "recipe": "r", "stages": stages,
           "steps": steps, "wall_s": 60, "machine": "m", "jax": "j", "python": "p", "seed": 0}
    card = script.model_card(log)
    assert [line.split(" | ")[4] for line in card.splitlines() if line.startswith("| dense |")] == ["2.5000", "2.2000"]


def test_stage_config_is_checked():
    with pytest.raises(ValueError, match="stage must be one of"):
        dsa.StageConfig("sparsest", steps=1, lr=1e-3, batch=1, seq_len=8)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        dsa.StageConfig("dense", steps=0, lr=1e-3, batch=1, seq_len=8)
    with pytest.raises(ValueError, match="lr must be > 0"):
        dsa.StageConfig("dense", steps=1, lr=0.0, batch=1, seq_len=8)


@pytest.mark.slow
def test_training_script_smoke_recipe(tmp_path):
    out = tmp_path / "model"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def script(*argv):
        return subprocess.run([sys.executable, os.path.join("experiments", "train_locality_model.py"), "--recipe",
                               "smoke", "--eval-windows", "2", "--log-every", "1", *argv], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)

    proc = script("--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stage 5/5: mtp_sparse" in proc.stderr and "held out: ppl dense" in proc.stderr
    assert "MTP held out: loss" in proc.stderr
    # each stage's weights and log are saved as it ends (a killed run resumes with --init OUT --first-stage N+1)
    assert all(f"training_log.json after stage {n}" in proc.stderr for n in range(1, 6))
    log = json.loads((out / "training_log.json").read_text())
    assert [s["stage"] for s in log["stages"]] == ["dense", "warmup", "sparse", "mtp_dense", "mtp_sparse"]
    dense_steps = [r for r in log["steps"] if r["stage"] == "dense"]
    assert dense_steps[-1]["lm"] < dense_steps[0]["lm"] < np.log(256) + 0.5  # it learned something
    assert 0 <= log["stages"][-1]["eval"]["mtp"]["draft_agreement"] <= 1
    card = (out / "README.md").read_text()
    assert "| sparse |" in card and "| mtp_sparse |" in card and log["corpus"]["sha256"] in card
    assert "| 0-127 |" in card and "| 128-255 |" in card  # the last evaluation by query position
    import hisparse_jax as hj

    model = hj.load_pretrained(out, mtp=True)
    assert model.cfg.index_topk == 128 and model.cfg.vocab_size == 256 and len(model.mtp) == 1
    ids = jnp.asarray(data.fixed_windows(data.load_corpus()[1], 64, 1))
    assert np.isfinite(np.asarray(model(ids))).all()

    # only the MTP stages again, from that checkpoint: the main model's weights stay, the earlier stages' log too
    again = tmp_path / "again"
    proc = script("--init", str(out), "--first-stage", "5", "--out", str(again), "--seed", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stage 4/5" not in proc.stderr and "stage 5/5: mtp_sparse" in proc.stderr
    log2 = json.loads((again / "training_log.json").read_text())
    assert log2["stages"][:4] == log["stages"][:4] and log2["first_stage"] == 5
    assert [s["stage"] for s in log2["stages"]] == [s["stage"] for s in log["stages"]]
    assert [r for r in log2["steps"] if r["stage"] != "mtp_sparse"] == [r for r in log["steps"]
                                                                        if r["stage"] != "mtp_sparse"]
    before, after = _params(model), _params(hj.load_pretrained(again, mtp=True))
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all(k[0] == "mtp" for k in changed)

    # --resume: a finished run has nothing to do; one whose log ends at stage 4 runs stage 5 alone
    proc = script("--out", str(again), "--resume")
    assert proc.returncode == 0 and "all 5 stages of recipe smoke are done" in proc.stderr
    log2["stages"] = log2["stages"][:4]
    (again / "training_log.json").write_text(json.dumps(log2))
    proc = script("--out", str(again), "--resume", "--seed", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming" in proc.stderr and "stage 4/5" not in proc.stderr and "stage 5/5: mtp_sparse" in proc.stderr
    log3 = json.loads((again / "training_log.json").read_text())
    assert [s["stage"] for s in log3["stages"]] == [s["stage"] for s in log["stages"]] and log3["first_stage"] == 5

    proc = script("--first-stage", "4", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "--first-stage: needs --init" in proc.stderr
    proc = script("--init", str(out), "--recipe", "default", "--first-stage", "5", "--out", str(tmp_path / "x"))
    assert proc.returncode != 0 and "does not hold stages 1..4 of recipe 'default'" in proc.stderr


@pytest.mark.slow
def test_locality_script_quick(tmp_path):
    """experiments/locality.py on the shipped checkpoint (quick: 2 short sequences): quality, and per index layer
    overlap and hit rates for trained and random weights, every policy within OPT's bound."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join("experiments", "locality.py"), "--quick", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "locality_quick.json").read_text())
    assert (tmp_path / "locality_quick.png").exists() and out["model"] == "stdlib-dsa"
    for name in ("trained", "random"):
        layers = out["traces"][name]["per_index_layer"]
        assert len(layers) == 2  # the full indexers of full / shared / full / shared
        for la in layers:
            assert 0 <= la["adjacent_overlap"] <= 1
            for size, r in la["results"]["lru"].items():
                assert 0 <= r["hit_rate"] <= la["results"]["opt"][size]["hit_rate"] + 1e-9
    assert 0 < out["quality"]["ppl_dense"] < 256


@pytest.mark.slow
def test_index_dtype_quality_script_quick(tmp_path):
    """experiments/index_dtype_quality.py (quick): per key format the trained model's sparse perplexity, top-k
    recall against FP8 (FP8 against itself: exactly 1) and the exact selection, and hit rates within OPT's bound;
    MXFP4 changes the selection (recall below 1) but not beyond recognition, at 68 bytes per key against 132."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join("experiments", "index_dtype_quality.py"), "--quick", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "index_dtype_quality_quick.json").read_text())
    assert out["key_bytes_per_token_per_index_layer"] == {"exact": 256, "fp8": 132, "int4": 68}
    f = out["formats"]
    assert f["fp8"]["recall_vs_fp8_per_index_layer"] == [1.0, 1.0] and f["fp8"]["ppl_over_fp8"] == 1.0
    assert all(0.8 < r < 1 for r in f["int4"]["recall_vs_fp8_per_index_layer"])
    for r in f.values():
        assert 0 < r["ppl_sparse"] < 256
        for lru, opt in zip(r["hit_rate_per_index_layer"]["lru_2x"], r["hit_rate_per_index_layer"]["opt_2x"]):
            assert 0 <= lru <= opt + 1e-9
