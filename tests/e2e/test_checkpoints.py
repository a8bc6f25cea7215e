"""The shipped checkpoints (`hisparse_jax.checkpoints`): found by name, loadable, the recipe's architecture, within
the size budget, and what their training logs claim (the 2K model's sparse perplexity within 5% of dense, the 8K
model's within 3 %, the issue's bar at GLM's top-k / context)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax import checkpoints
from hisparse_jax.hf_config import from_hf_config
from hisparse_jax.model.mtp import mtp_forward
from hisparse_jax.train import data
from hisparse_jax.train.recipe import RECIPES, STDLIB_DSA


def test_resolve_names_and_folders(tmp_path):
    folder = checkpoints.path("stdlib-dsa")
    assert checkpoints.resolve("stdlib-dsa") == folder and checkpoints.resolve(folder) == folder
    with pytest.raises(ValueError, match="unknown shipped checkpoint 'nope'"):
        checkpoints.path("nope")
    for bad in ("nope", str(tmp_path)):
        with pytest.raises(ValueError, match="neither a shipped checkpoint"):
            checkpoints.resolve(bad)


def test_shipped_checkpoint_is_the_recipes_model_and_fits_the_budget():
    folder = checkpoints.path()
    assert from_hf_config(folder) == STDLIB_DSA
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    assert size <= 25 * 2 ** 20, size
    model = checkpoints.load(mtp=True)
    ids = jnp.asarray(data.fixed_windows(data.load_corpus()[1], 96, 1))
    logits, aux = model.forward(ids)
    assert np.isfinite(np.asarray(logits)).all() and len(model.mtp) == 1
    assert np.isfinite(np.asarray(mtp_forward(model, aux["hidden"][:, :-1], ids[:, 1:])[0])).all()


def test_the_8k_checkpoint_is_the_long8k_recipes_model_and_meets_the_bar():
    folder = checkpoints.path("stdlib-dsa-8k")
    assert from_hf_config(folder) == STDLIB_DSA.replace(num_nextn_predict_layers=0)  # (no MTP stages)
    assert sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) <= 20 * 2 ** 20
    with open(os.path.join(folder, "training_log.json")) as f:
        log = json.load(f)
    # every stage the recipe has, as it has it: `--recipe long8k --resume` rebuilds these weights
    assert log["recipe"] == "long8k" and [s["config"] for s in log["stages"]] == [
        sc.__dict__ for sc in RECIPES["long8k"]]
    ev = log["stages"][-1]["eval"]
    assert ev["tokens_per_window"] == 8192 and ev["sparse_over_dense_ppl"] <= 1.03, ev
    buckets = ev["by_position"]
    assert buckets[0]["positions"] == [0, 128] and buckets[-1]["positions"] == [4096, 8192]
    assert buckets[0]["sparse_over_dense_ppl"] == pytest.approx(1, abs=1e-4)  # dense below top-k
    model = checkpoints.load("stdlib-dsa-8k")
    ids = jnp.asarray(data.fixed_windows(data.load_corpus()[1], 200, 1))
    assert np.isfinite(np.asarray(model(ids))).all()


def test_shipped_training_log_meets_the_bar():
    with open(os.path.join(checkpoints.path(), "training_log.json")) as f:
        log = json.load(f)
    assert [s["stage"] for s in log["stages"]][-4:] == ["warmup", "sparse", "mtp_dense", "mtp_sparse"]
    ev = log["stages"][-1]["eval"]
    assert ev["sparse_over_dense_ppl"] <= 1.05, ev  # the sparse model within 5% of its dense perplexity
    assert ev["ppl_dense"] < 8  # it learned the text (a byte model knowing nothing: 256)
    # the MTP stages leave the main model as it was (the evaluation's program differs: float rounding only)
    main = log["stages"][-3]["eval"]
    assert set(ev) == set(main) | {"mtp"}
    for k, v in main.items():
        np.testing.assert_allclose(ev[k], v, rtol=1e-5, err_msg=k)
    # its MTP layer drafts: a greedy draft is the main model's greedy token at least half the time (teacher-forced)
    assert ev["mtp"]["draft_agreement"] >= 0.5, ev["mtp"]
    with open(os.path.join(checkpoints.path(), "README.md")) as f:
        card = f.read()
    assert log["corpus"]["sha256"] in card and "| sparse |" in card and "| mtp_sparse |" in card


def test_document_prompts_start_at_documents():
    held = data.load_corpus()[1]
    lens = [300, 200, 100, 250]
    a = data.document_prompts(held, lens, seed=3)
    assert [len(p) for p in a] == lens and a == data.document_prompts(held, lens, seed=3)
    assert all(p[0] == data.BOS_ID for p in a)
    assert len({tuple(p[:50]) for p in a}) == len(a)  # different documents
    with pytest.raises(ValueError, match="fewer than a prompt"):
        data.document_prompts(held, [held.size + 1], seed=0)
