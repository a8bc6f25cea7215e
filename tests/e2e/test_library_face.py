"""The library's face: the lazy top-level names, the calculator without jax, `save_params(..., overwrite=)` and
`demo.run(**keywords)`."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax import checkpoints, demo, demo_workload
from hisparse_jax.model.weights import PARAMS_MANIFEST

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A fresh interpreter in which jax, jaxlib and flax cannot be imported (nor numpy: the calculator needs none).
BLOCK_JAX = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = ("jax", "jaxlib", "flax", "numpy")
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
    sys.meta_path.insert(0, Block())
""")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_calc_without_jax():
    code = BLOCK_JAX + textwrap.dedent("""
        import contextlib, io, json
        import hisparse_jax.calc
        import hisparse_jax.cli
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = hisparse_jax.cli.main(["calc", "--json"])
        assert rc == 0, rc
        result = json.loads(out.getvalue())
        assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED], "a blocked module was imported"
        print(json.dumps(result))
    """)
    p = _python(code)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    for key in ("baseline_running", "hisparse_running", "hisparse_gpu_limit", "hisparse_host_limit",
                "min_host_gib", "min_host_gib_published", "kv_hbm_gib", "block_bytes", "inputs"):
        assert key in out, key
    # the published figures: GLM-5.3 on 8xH200, TP8, 80K tokens: baseline 4 vs HiSparse 39 running requests
    assert (out["baseline_running"], out["hisparse_running"], out["inputs"]["seq"]) == (4, 39, 81_920)
    assert (out["kv_hbm_gib"], out["min_host_gib_published"]) == (17.8, 134)


def test_demo_without_jax_says_what_is_missing():
    p = _python(BLOCK_JAX + "import hisparse_jax.cli; sys.exit(hisparse_jax.cli.main(['demo']))")
    assert p.returncode == 1, p.stderr
    assert "hisparse demo: error: it needs" in p.stderr and "not installed" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr


def test_import_is_lazy_and_names_resolve_in_a_fresh_interpreter():
    code = textwrap.dedent("""
        import sys
        import hisparse_jax as hj
        assert "jax" not in sys.modules and "flax" not in sys.modules, "import hisparse_jax imported jax"
        assert hj.integrity.manifest is not None and hj.config.CacheConfig is hj.CacheConfig
        assert "hisparse_jax.generate" not in sys.modules
        from hisparse_jax.generate import validate_prompts  # binds the submodule `generate` on the package...
        import hisparse_jax.generate
        assert hj.generate is sys.modules["hisparse_jax.generate"].generate  # ...yet the name is the function
        assert hj.SparseMLAModel.__name__ == "SparseMLAModel" and hj.Engine.__name__ == "Engine"
    """)
    p = _python(code)
    assert p.returncode == 0, p.stderr


TOP_LEVEL = {
    "CacheConfig": "hisparse_jax.config", "Engine": "hisparse_jax.engine", "EngineConfig": "hisparse_jax.engine",
    "MeshEngine": "hisparse_jax.engine",
    "SamplingParams": "hisparse_jax.engine", "PRESETS": "hisparse_jax.config", "ModelConfig": "hisparse_jax.config",
    "RopeConfig": "hisparse_jax.config", "get_preset": "hisparse_jax.config",
    "SparseMLAModel": "hisparse_jax.model.decoder", "decode_step": "hisparse_jax.model.decoder",
    "generate": "hisparse_jax.generate", "CheckpointError": "hisparse_jax.model.weights",
    "load_pretrained": "hisparse_jax.model.weights", "save_pretrained": "hisparse_jax.model.weights",
    "save_params": "hisparse_jax.model.weights", "restore_params": "hisparse_jax.model.weights",
}


def test_top_level_names_are_the_right_objects():
    assert hj.Engine is hj.engine.Engine is importlib.import_module("hisparse_jax.engine.engine").Engine
    assert hj.EngineConfig is hj.engine.EngineConfig
    assert hj.SamplingParams is hj.engine.SamplingParams
    assert hj.CacheConfig is hj.config.CacheConfig
    for name, module in TOP_LEVEL.items():
        assert getattr(hj, name) is getattr(importlib.import_module(module), name), name
    assert sorted(hj.__all__) == sorted(TOP_LEVEL)
    ns = {}
    exec("from hisparse_jax import *", ns)
    assert {k for k in ns if not k.startswith("__")} == set(TOP_LEVEL)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        hj.not_a_name  # noqa: B018


def test_dir_lists_the_top_level_names():
    listed = dir(hj)
    for name in ("CacheConfig", "Engine", "EngineConfig", "SamplingParams", *TOP_LEVEL):
        assert name in listed, name


# -- save_params(..., overwrite=) ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    cfg = hj.get_preset("tiny-glm")
    return cfg, hj.SparseMLAModel(cfg, rngs=nnx.Rngs(0)), hj.SparseMLAModel(cfg, rngs=nnx.Rngs(1))


def _params(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(_params(a), _params(b), strict=True))


def test_save_params_refuses_an_existing_path_and_overwrites_its_own_checkpoint(models, tmp_path):
    cfg, m0, m1 = models
    path = tmp_path / "ckpt"
    hj.save_params(m0, path)
    with pytest.raises(FileExistsError, match=re.escape(str(path)) + ".*overwrite=True"):
        hj.save_params(m1, path)
    assert _same(hj.restore_params(path, cfg), m0)  # the refused save changed nothing
    hj.save_params(m1, path, overwrite=True)
    assert _same(hj.restore_params(path, cfg), m1) and not _same(m0, m1)
    assert sorted(os.listdir(path)).count(PARAMS_MANIFEST) == 1


def test_save_params_overwrite_replaces_an_empty_folder_or_a_checkpoint_without_manifest(models, tmp_path):
    cfg, m0, _ = models
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileExistsError, match=re.escape(str(empty))):
        hj.save_params(m0, empty)
    hj.save_params(m0, empty, overwrite=True)
    assert _same(hj.restore_params(empty, cfg), m0)
    os.remove(empty / PARAMS_MANIFEST)  # an Orbax checkpoint without our manifest: still Orbax's marker
    hj.save_params(m0, empty, overwrite=True)
    assert _same(hj.restore_params(empty, cfg), m0)


def test_save_params_overwrite_never_deletes_what_is_not_a_checkpoint(models, tmp_path):
    _, m0, _ = models
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=re.escape(f"{folder} exists and is not a save_params checkpoint")):
        hj.save_params(m0, folder, overwrite=True)
    assert (folder / "notes.txt").read_text() == "keep me"

    file = tmp_path / "file"
    file.write_text("keep me too")
    with pytest.raises(FileExistsError, match=re.escape(f"{file} exists and is not a folder")):
        hj.save_params(m0, file, overwrite=True)
    assert file.read_text() == "keep me too"

    ckpt, link = tmp_path / "ckpt", tmp_path / "link"
    hj.save_params(m0, ckpt)
    link.symlink_to(ckpt, target_is_directory=True)
    with pytest.raises(FileExistsError, match=re.escape(f"{link} exists and is a symbolic link")):
        hj.save_params(m0, link, overwrite=True)
    assert (ckpt / PARAMS_MANIFEST).exists()


# -- demo.run(**keywords) ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_run_with_keywords():
    out = demo.run(requests=2, prompt_len=64, new_tokens=2, policies=("hisparse",), plot="", json=True)
    assert (out["requests"], out["new_tokens"], list(out["policies"])) == (2, 2, ["hisparse"])
    assert len(out["prompt_tokens"]) == 2 and max(out["prompt_tokens"]) == 64 and "plot" not in out
    assert out["outputs_identical"] and out["policies"]["hisparse"]["max_running"] >= 1


def test_demo_keywords_build_the_commands_namespace(tmp_path):
    kw = dict(requests=3, prompt_len=128, new_tokens=4, device_requests=2, policies=["offload", "hisparse"],
              seed=np.int64(5), plot=str(tmp_path / "p.png"), log_dir=str(tmp_path / "logs"), json=True)
    argv = ["--requests", "3", "--prompt-len", "128", "--new-tokens", "4", "--device-requests", "2", "--policies",
            "offload,hisparse", "--seed", "5", "--plot", str(tmp_path / "p.png"), "--log-dir", str(tmp_path / "logs"),
            "--json"]
    assert demo._namespace(kw) == demo.parse_args(argv)
    assert demo._namespace({}) == demo.parse_args([])


@pytest.mark.parametrize("kw, error, message", [
    ({"bogus": 1}, TypeError, "unexpected keyword argument 'bogus'"),
    ({"prompt-len": 64}, TypeError, "unexpected keyword argument 'prompt-len'"),
    ({"requests": "4"}, TypeError, "requests must be an int"),
    ({"requests": True}, TypeError, "requests must be an int"),
    ({"requests": 2.0}, TypeError, "requests must be an int"),
    ({"device_requests": "1"}, TypeError, "device_requests must be a number"),
    ({"json": 1}, TypeError, "json must be a bool"),
    ({"policies": 3}, TypeError, "policies must be a sequence of names"),
    ({"plot": None}, TypeError, "plot must be a str"),
    ({"requests": 0}, ValueError, "requests: must be >= 1, got '0'"),
    ({"prompt_len": 63}, ValueError, "prompt_len: must be >= 64"),
    ({"device_requests": float("nan")}, ValueError, "device_requests: must be a finite number > 0"),
    ({"policies": ("hisparse", "nope")}, ValueError, "unknown policy 'nope'"),
    ({"policies": ()}, ValueError, "needs at least one policy"),
    ({"kv_dtype": "fp4"}, ValueError, "kv_dtype: invalid choice"),
    ({"plot": "/proc/x.png"}, ValueError, "plot: "),
])
def test_demo_run_refuses_bad_keywords_before_any_work(kw, error, message, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("work started despite a bad keyword")

    monkeypatch.setattr(demo_workload, "get_preset", refuse)
    monkeypatch.setattr(checkpoints, "load", refuse)
    with pytest.raises(error, match=re.escape(message)):
        demo.run(**kw)


def test_demo_run_takes_a_namespace_or_keywords_not_both():
    with pytest.raises(TypeError, match="not both"):
        demo.run(demo.parse_args(["--plot", ""]), requests=2)
    with pytest.raises(TypeError, match="argparse.Namespace"):
        demo.run({"requests": 2})
