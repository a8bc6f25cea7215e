"""Every bad `hisparse` argument is a usage error: exit code 2, `usage:` and `error: argument --option: ...` naming
the value on stderr, no traceback, and no work started (`demo.run` / `calc.max_requests` would raise here)."""

from __future__ import annotations

import json
import math
import os

import pytest

from hisparse_jax import calc_cli, checkpoints, cli, demo, demo_run
from hisparse_jax.engine.scheduler import POLICIES

# {file}: a regular file; {dir}: an existing writable directory (both under tmp_path).
UNWRITABLE_DIRS = ["{file}/sub", "/proc/hisparse_x"]
UNWRITABLE_FILES = ["{file}/x.png", "/proc/x.png", "{dir}/missing/x.png", "{dir}"]

DEMO_BAD = [
    *[("--device-requests", v) for v in ("nan", "inf", "-inf", "0", "-1", "lots")],
    *[("--policies", v) for v in (",", "", " , ", "foo", "hisparse,foo", "hisparse,hisparse", "hisparse,")],
    ("--preset", "nope"), ("--model", "nope"), ("--model", "{dir}"), ("--workload", "nope"),
    ("--prefill-chunk", "0"), ("--prefill-chunk", "-5"),
    ("--requests", "0"), ("--requests", "-1"), ("--requests", "2.5"), ("--prompt-len", "10"), ("--prompt-len", "63"),
    ("--new-tokens", "0"), ("--seed", "-1"), ("--seed", str(10**30)),
    ("--kernels", "nope"), ("--kv-dtype", "nope"), ("--prefill", "nope"),
    *[("--log-dir", v) for v in UNWRITABLE_DIRS], *[("--plot", v) for v in UNWRITABLE_FILES],
]

CALC_BAD = [
    *[("--kv-hbm-gib", v) for v in ("nan", "inf", "-inf", "-5", "0")],
    *[("--host-gib", v) for v in ("nan", "-inf", "-5", "x")],
    *[("--gpu-memory-utilization", v) for v in ("nan", "inf", "0", "-0.5", "1.5")],
    *[("--reserve-gib", v) for v in ("nan", "inf", "-5")],
    *[(opt, v) for opt in ("--dp", "--tp", "--hot-rows", "--groups", "--max-seqs") for v in ("0", "-1", "1.5")],
    ("--retained", "-1"), ("--other", "-1"),
    *[("--seq", v) for v in ("0", "-5", "1.3k", "0.5", "nan", "inf", "lots")],
    ("--gpu", "nope"), ("--kv-dtype", "nope"), ("--preset", "nope"),
    *[("--plot", v) for v in UNWRITABLE_FILES],
]

# Valid one at a time, impossible together or for the model: the calculator's own error (exit 2, no usage).
CALC_ERRORS = [(["--tp", "3"], "does not divide"), (["--tp", "4"], "no HBM left"),
               (["--reserve-gib", "1e300"], "no HBM left"), (["--kv-hbm-gib", "1e308"], "at most the h200's")]


@pytest.fixture
def no_work(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("work started despite a bad argument")

    monkeypatch.setattr(demo, "run", refuse)
    monkeypatch.setattr(calc_cli, "max_requests", refuse)


@pytest.fixture
def paths(tmp_path):
    (tmp_path / "file").write_text("x")
    return {"file": str(tmp_path / "file"), "dir": str(tmp_path)}


def _arg(option: str, value: str) -> list[str]:
    """`--opt value`, or `--opt=value` where argparse would take the value for an option (`-inf`)."""
    return [f"{option}={value}"] if value.startswith("-") and value.lstrip("-")[:1].isalpha() else [option, value]


def _usage_error(capsys, argv: list[str], option: str, value: str) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: hisparse" in err and f"error: argument {option}: " in err, err
    assert value in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("option, value", DEMO_BAD)
def test_demo_bad_argument(no_work, paths, capsys, option, value):
    value = value.format(**paths)
    _usage_error(capsys, ["demo", *_arg(option, value)], option, value)


@pytest.mark.parametrize("option, value", CALC_BAD)
def test_calc_bad_argument(no_work, paths, capsys, option, value):
    value = value.format(**paths)
    _usage_error(capsys, ["calc", "--sweep", *_arg(option, value)], option, value)


def test_demo_pallas_without_gpu_is_a_usage_error(no_work, capsys):
    if __import__("jax").default_backend() == "gpu":
        pytest.skip("the pallas kernels run here")
    err = _usage_error(capsys, ["demo", "--kernels", "pallas"], "--kernels", "pallas")
    assert "GPU backend" in err


def test_demo_model_or_preset_not_both(no_work, capsys):
    err = _usage_error(capsys, ["demo", "--model", "stdlib-dsa", "--preset", "demo-glm"], "--preset", "demo-glm")
    assert "give one of them" in err


@pytest.mark.parametrize("argv, needle", [
    (["--model", "{no_mtp}", "--speculative-tokens", "2"], "has no MTP layer to draft with"),
    (["--preset", "demo-glm", "--workload", "text"], "the prompts are bytes"),  # a 512-token vocabulary
])
def test_demo_model_cannot_run_the_workload(capsys, argv, needle, monkeypatch, tmp_path):
    """Valid arguments the model cannot serve: the demo's own error (exit 2, no usage) before any model is built.
    `{no_mtp}`: the shipped checkpoint's config without its MTP layer."""
    def refuse(*a, **k):
        raise AssertionError("a model was built")

    with open(os.path.join(checkpoints.path(), "config.json")) as f:
        config = json.load(f)
    assert config["num_nextn_predict_layers"] == 1  # the shipped checkpoint drafts
    (tmp_path / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=0)))
    argv = [a.replace("{no_mtp}", str(tmp_path)) for a in argv]
    monkeypatch.setattr(demo_run, "SparseMLAModel", refuse)
    monkeypatch.setattr(checkpoints, "load", refuse)
    assert cli.main(["demo", *argv, "--plot", ""]) == 2
    err = capsys.readouterr().err
    assert "hisparse demo: error: " in err and needle in err and "Traceback" not in err, err


def test_policy_message_names_the_problem(no_work, capsys):
    assert "unknown policy 'foo'" in _usage_error(capsys, ["demo", "--policies", "hisparse,foo"], "--policies", "foo")
    assert "at least one policy" in _usage_error(capsys, ["demo", "--policies", ","], "--policies", ",")
    assert "repeated policy" in _usage_error(capsys, ["demo", "--policies", "offload,offload"], "--policies", "offload")


@pytest.mark.parametrize("argv, needle", CALC_ERRORS)
def test_calc_inconsistent_input(capsys, argv, needle):
    assert cli.main(["calc", *argv]) == 2
    err = capsys.readouterr().err
    assert "hisparse calc: error: " in err and needle in err and "Traceback" not in err, err


def test_top_level(no_work, capsys):
    assert cli.main([]) == 2 and "usage: hisparse" in capsys.readouterr().err
    assert cli.main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
    for argv in (["-h"], ["--help"], ["demo", "-h"], ["calc", "--help"]):
        assert cli.main(argv) == 0 and "usage:" in capsys.readouterr().out


def test_valid_arguments_parse(tmp_path):
    d = demo._parser().parse_args([])
    assert (d.model, d.preset, d.workload, d.requests, d.prompt_len, d.new_tokens, d.device_requests, d.policies,
            d.prefill_chunk, d.seed, d.plot, d.log_dir) == (None, None, None, 16, 0, 160, 3.5, tuple(POLICIES), 240,
                                                            0, "hisparse_demo.png", "")
    assert demo.parse_args(["--plot", ""]).model == "stdlib-dsa"  # the shipped checkpoint, unless a preset is asked
    logs, png = tmp_path / "logs" / "deep", tmp_path / "p.png"
    d = demo.parse_args(["--requests", "1", "--prompt-len", "64", "--new-tokens", "1", "--device-requests", "0.5",
                         "--policies", " offload , hisparse", "--prefill-chunk", "1", "--seed", "7",
                         "--log-dir", str(logs), "--plot", str(png), "--preset", "tiny-glm"])
    assert d.policies == ("offload", "hisparse") and d.device_requests == 0.5 and d.preset == "tiny-glm"
    assert d.model is None
    assert logs.is_dir() and not png.exists() and list(tmp_path.iterdir()) == [tmp_path / "logs"]
    assert demo.parse_args(["--plot", ""]).plot == ""

    c = calc_cli._parser().parse_args(["--seq", "1.5k", "--host-gib", "inf", "--retained", "0", "--other", "0",
                                   "--reserve-gib", "0", "--gpu-memory-utilization", "1", "--kv-hbm-gib", "30"])
    assert (c.seq, c.host_gib, c.retained, c.reserve_gib, c.gpu_memory_utilization, c.kv_hbm_gib) == (
        1536, math.inf, 0, 0.0, 1.0, 30.0)
    c = calc_cli._parser().parse_args([])
    assert (c.preset, c.seq, c.dp, c.tp, c.host_gib, c.kv_hbm_gib, c.groups) == ("glm-5.3-blog", 81_920, 1, 8, None,
                                                                                 None, None)


@pytest.mark.parametrize("device_requests, words", [
    ("0.01", "device_pages must be >= 1, got 0"),
    ("0.6", "can never be admitted"),
])
def test_demo_budgets_too_small_for_the_workload(capsys, device_requests, words):
    """Each argument is valid but together they leave a request no room: refused (exit 2) before any policy runs,
    naming --device-requests and what does not fit."""
    code = cli.main(["demo", "--requests", "2", "--prompt-len", "128", "--new-tokens", "2",
                     "--device-requests", device_requests, "--plot", ""])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--device-requests {device_requests}" in err and "too small" in err and words in err, err
