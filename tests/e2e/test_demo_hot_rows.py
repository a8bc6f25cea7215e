"""`hisparse demo --hot-rows N`: the hot buffer's size for every policy's store. A bad value is a usage error naming
the option before any work; a value below the rows one step can miss ((K + 1) x the model's top-k) is the demo's
store's own error (said once) before any model is built; a real run reports the effective size, and the outputs do not depend on it.
Also experiments/speculative_sizing.py, which sweeps it against the speculative tokens, end to end (--quick)."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

from hisparse_jax import checkpoints, cli, demo, demo_run, demo_workload
from hisparse_jax.config import get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def no_model(monkeypatch):
    """Any model built, or any policy run, fails the test."""
    def refuse(*a, **k):
        raise AssertionError("a model was built")

    monkeypatch.setattr(demo_run, "SparseMLAModel", refuse)
    monkeypatch.setattr(checkpoints, "load", refuse)


@pytest.mark.parametrize("value", ["-1", "x", "1.5", "", "nan", str(demo.MAX_HOT_ROWS + 1)])
def test_bad_value_is_a_usage_error(monkeypatch, capsys, value):
    def refuse(*a, **k):
        raise AssertionError("work started despite a bad argument")

    monkeypatch.setattr(demo, "run", refuse)
    monkeypatch.setattr(demo, "run_policies", refuse)
    assert cli.main(["demo", f"--hot-rows={value}"]) == 2
    err = capsys.readouterr().err
    assert "usage: hisparse" in err and "error: argument --hot-rows: " in err, err
    assert repr(value) in err and "Traceback" not in err, err


def test_keyword_api_checks_like_the_command():
    with pytest.raises(ValueError, match="hot_rows: must be >= 0"):
        demo.run(hot_rows=-1)
    with pytest.raises(TypeError, match="hot_rows must be an int"):
        demo.run(hot_rows=1.5)
    assert demo.parse_args([]).hot_rows == 0  # the store's default


@pytest.mark.parametrize("argv, need", [
    (["--hot-rows", "127"], 128),  # the shipped model: top-k 128
    (["--preset", "demo-glm", "--hot-rows", "63"], 64),  # top-k 64
    (["--preset", "demo-glm", "--speculative-tokens", "2", "--hot-rows", "191"], 192),  # 3 rows verified per step
])
def test_too_few_rows_is_the_demos_error_before_any_model(no_model, capsys, argv, need):
    assert cli.main(["demo", *argv, "--plot", ""]) == 2
    err = capsys.readouterr().err
    # the store's own check (`CacheConfig.hot_rows_for`), said once
    assert err.startswith(f"hisparse demo: error: hot_rows ({argv[-1]}) must be >= ") and f"index_topk ({need})" in err
    assert "usage:" not in err and "Traceback" not in err, err
    with pytest.raises(demo_workload.DemoSetupError, match=re.escape(f"hot_rows ({argv[-1]}) must be >= ")):
        demo.run(**{a.lstrip("-").replace("-", "_"): (int(b) if b.isdigit() else b) for a, b in zip(argv[::2], argv[1::2])},
                 plot="")


def test_too_many_rows_for_the_machine_is_the_demos_error(no_model, capsys):
    assert cli.main(["demo", "--hot-rows", str(demo.MAX_HOT_ROWS), "--plot", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hisparse demo: error: --hot-rows {demo.MAX_HOT_ROWS} must be <= ") and "hot-buffer resolve " \
        "temporaries" in err, err


def test_budgets_carry_the_hot_rows():
    cfg = get_preset("demo-glm")
    base, dev = demo_workload.budgets(cfg, 4, 1000, 2.0)
    sized, dev2 = demo_workload.budgets(cfg, 4, 1000, 2.0, hot_rows=320)
    assert base.hot_rows is None and base.hot_rows_for(cfg) == 2 * cfg.index_topk
    assert sized.hot_rows == 320 and dev2 == dev  # the device bytes do not depend on it


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "experiments", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("ks", ["1,0", "0,x", "0,1,1", ""])
def test_speculative_sizing_refuses_bad_ks(ks, capsys):
    with pytest.raises(SystemExit) as e:
        _load("speculative_sizing").main(["--ks", ks, "--out", "/nonexistent/x.json"])
    assert e.value.code == 2 and "argument --ks: distinct values >= 0, 0 first" in capsys.readouterr().err


@pytest.mark.slow
def test_speculative_sizing_quick(tmp_path):
    """experiments/speculative_sizing.py --quick on the shipped model (k = 0, 1): every (k, hot rows) run recorded
    with the hot rows it ran with, each with the k = 0 run's outputs (the demo's `--hot-rows` and speculation change
    where rows come from and how many steps it takes, never the tokens)."""
    ss = _load("speculative_sizing")
    out = tmp_path / "sizing.json"
    assert ss.main(["--quick", "--ks", "0,1", "--out", str(out), "--plot", str(tmp_path / "sizing.png")]) == 0
    res = json.loads(out.read_text())
    topk, runs = res["index_topk"], res["runs"]
    assert res["model"] == "stdlib-dsa" and res["speculative_tokens"] == [0, 1]
    assert [(r["k"], r["hot_rows_x_topk"]) for r in runs] == [(0, 2), (0, 1), (1, 2), (1, 3)]
    for r in runs:
        assert r["hot_rows"] == r["hot_rows_x_topk"] * topk
        assert r["outputs_equal_k0"] is True and len(r["outputs_sha256"]) == 64
        assert r["steps"] > 0 and r["decode_steps"] > 0 and 0 <= r["hit_rate"] <= 1
        assert r["h2d_bytes_per_decode_step"] == pytest.approx(r["h2d_bytes"] / r["decode_steps"])
        assert (r["acceptance_rate"] is None or 0 <= r["acceptance_rate"] <= 1) and r["tokens_per_step"] >= 1
    assert res["outputs_identical"] is True and os.path.getsize(tmp_path / "sizing.png") > 0
