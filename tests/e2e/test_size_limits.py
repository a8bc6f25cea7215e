"""Sizes with no natural upper bound are refused before anything of that size is allocated, with one line naming
the field (or option), its value and the bound: the layer and expert counts of a config (`config.SIZE_LIMITS`), a
model whose parameters cannot fit the device's memory, a store (here: its hot buffer) larger than the machine's
memory, a whole-prompt forward whose activations cannot fit, and the demo's
--requests / --prompt-len / --new-tokens / --device-requests / --devices.

The refusals run in child processes under an address-space limit (`LIMIT`: jax imports and builds a small model
well within it), each timed and with its peak-RSS growth measured: a refusal must come at once, not after an
allocation (which the limit would turn into a MemoryError or an XLA error instead of the message)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import hisparse_jax as hj
from hisparse_jax import config, demo
from hisparse_jax.config import CacheConfig, ModelConfig
from hisparse_jax.hf_config import to_hf_config
from hisparse_jax.model.decoder import SparseMLAModel
from limit_harness import CLI, PRELUDE, child, child_env
from tiny import MICRO

FAST_S = 5.0  # a refusal takes well under this after the imports (an allocation of the refused size would not)
GREW_MB = 256  # peak RSS growth allowed per refusal (an allocation of a refused size: gigabytes)
# the counts `config.SIZE_LIMITS` bounds (per-layer and per-expert structures)
COUNTS = ("num_hidden_layers", "num_nextn_predict_layers", "num_attention_heads", "index_n_heads", "n_routed_experts",
          "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group")

_LIBRARY = PRELUDE + """
import hisparse_jax as hj
import jax
from flax import nnx
from hisparse_jax.config import CacheConfig, ModelConfig
from hisparse_jax.hf_config import from_hf_config

folder = sys.argv[1]
MICRO = ModelConfig(**""" + repr(MICRO) + """)
# the control: a real (small) model is built under the same limit
attempt("micro_model", lambda: jax.block_until_ready(nnx.state(hj.SparseMLAModel(MICRO, rngs=nnx.Rngs(0)))) and None)
attempt("hf_layers", lambda: from_hf_config(folder))
tiny = hj.get_preset("tiny-glm")
attempt("preset_experts", lambda: hj.SparseMLAModel(tiny.replace(n_routed_experts=10**8), rngs=nnx.Rngs(0)))
huge = tiny.replace(n_routed_experts=8192, moe_intermediate_size=2**20)  # ~36 TiB of expert weights
attempt("model_memory", lambda: hj.SparseMLAModel(huge, rngs=nnx.Rngs(0)))
attempt("model_abstract", lambda: {"leaves": len(jax.tree.leaves(nnx.eval_shape(
    lambda: hj.SparseMLAModel(huge, rngs=nnx.Rngs(0)))))})
from hisparse_jax.kv.state import StoreSpec, init_store
# 10^10 hot rows x 8 slots x 2 groups: the hot-buffer state alone is 1.3 TB (against 8 device pages)
attempt("hot_rows", lambda: init_store(StoreSpec.create(tiny, CacheConfig(device_pages=8, hot_rows=10**10))))
# a whole-prompt forward of 40000 tokens (bucket 65536): ~650 GiB of attention and indexer scores (XLA said
# "Out of memory allocating 696096129680 bytes" at run time); a short prompt in the same process runs
from hisparse_jax.engine.pd import export_prefill
model = hj.SparseMLAModel(tiny, rngs=nnx.Rngs(0))
attempt("prefill_short", lambda: {"tokens": hj.generate(model, [[5] * 100], 2)[0]})
attempt("prefill_long", lambda: hj.generate(model, [[5] * 40000], 1))
attempt("export_long", lambda: export_prefill(model, [5] * 40000))
print(json.dumps(results))
"""

# (argv after `demo`, option, value): the default model (stdlib-dsa: 8192 positions, text prompts) and demo-glm
DEMO_CASES = {
    "requests_text": (["--requests", "1000000000"], "--requests", "1000000000"),
    "requests_memory": (["--preset", "demo-glm", "--requests", "1000000000"], "--requests", "1000000000"),
    "prompt_len": (["--prompt-len", "1000000000"], "--prompt-len", "1000000000"),
    "prompt_len_preset": (["--preset", "demo-glm", "--prompt-len", "1000000000"], "--prompt-len", "1000000000"),
    "new_tokens": (["--new-tokens", "100000000"], "--new-tokens", "100000000"),
    "new_tokens_preset": (["--preset", "demo-glm", "--new-tokens", "100000000"], "--new-tokens", "100000000"),
    "device_requests": (["--device-requests", "1e12"], "--device-requests", "1e+12"),
}


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    folder = tmp_path_factory.mktemp("layers")
    d = to_hf_config(hj.get_preset("deepseek-v3.2"))
    del d["mlp_layer_types"]  # as the released config.json: first_k_dense_replace, no per-layer list
    d["num_hidden_layers"] = 10 ** 9
    (folder / "config.json").write_text(json.dumps(d))
    return child(_LIBRARY, str(folder))


@pytest.fixture(scope="module")
def cli():
    return child(CLI, json.dumps({k: ["demo", "--plot", "", "--json", *argv] for k, (argv, _, _) in
                                    DEMO_CASES.items()}))


def _quick(r: dict) -> None:
    assert r["seconds"] < FAST_S and r["grew_mb"] < GREW_MB, r


def _refused(r: dict, *words: str) -> str:
    assert r["error"] == "ValueError", r
    msg = r["message"]
    assert "\n" not in msg and all(w in msg for w in words), msg
    _quick(r)
    return msg


def test_the_limit_leaves_room_for_a_small_model(library):
    assert library["micro_model"]["error"] is None, library["micro_model"]


def test_config_json_layer_count_is_bounded_before_the_per_layer_lists(library):
    _refused(library["hf_layers"], "num_hidden_layers must be <= 1024", "got 1000000000")


def test_expert_count_is_bounded_before_the_model_is_built(library):
    _refused(library["preset_experts"], "n_routed_experts must be <= 8192", "got 100000000")


def test_a_model_larger_than_the_device_memory_is_refused_before_allocating(library):
    msg = _refused(library["model_memory"], "parameters need", "bytes", "more than the", "routed experts",
                   "n_routed_experts=8192", "moe_intermediate_size=1048576")
    need, have = (int(x.replace(",", "")) for x in re.findall(r"([\d,]+) bytes \(", msg)[:2])
    assert need > have


def test_the_same_model_stays_buildable_abstractly(library):
    r = library["model_abstract"]
    assert r["error"] is None and r["leaves"] > 0, r
    _quick(r)


def test_a_store_past_the_machine_memory(library):
    """A hot buffer of 10^10 rows is refused when the store is made, before any array of it is allocated, naming
    the array and the field it follows (a hot buffer larger than the device pool is allowed: such a request
    never tiers, and preempt / offload use none; what cannot be is a store larger than the memory)."""
    _refused(library["hot_rows"], "the KV store needs", "largest part is the store's hot_token",
             "sized by hot_rows=10,000,000,000 x max_seqs=8")


@pytest.mark.parametrize("case", ["prefill_long", "export_long"])
def test_a_prompt_whose_forward_cannot_fit_is_refused_before_running(library, case):
    """generate's and export_prefill's whole-prompt forward: refused from XLA's memory analysis of the compiled
    program (compiling takes seconds, hence the longer bound), before any of its ~650 GiB is allocated."""
    assert library["prefill_short"]["error"] is None and len(library["prefill_short"]["tokens"]) == 2
    r = library[case]
    assert r["error"] == "ValueError", r
    msg = r["message"]
    assert "\n" not in msg and "a whole-prompt forward over 65536 positions" in msg and "prefill='chunked'" in msg
    need, have = re.search(r"needs ([\d,]+) bytes .* more than the ([\d.]+) GiB", msg).groups()
    assert int(need.replace(",", "")) > float(have) * 2 ** 30, msg
    assert r["seconds"] < 60 and r["grew_mb"] < GREW_MB, r


@pytest.mark.parametrize("case", sorted(DEMO_CASES))
def test_demo_size_is_refused_up_front(cli, case):
    _, option, value = DEMO_CASES[case]
    r = cli[case]
    assert r["error"] is None and r["rc"] == 2, r
    err = r["stderr"]
    assert "Traceback" not in err and err.count("\n") == 1, err  # one line
    assert err.startswith(f"hisparse demo: error: {option} {value} must be <= "), err
    assert re.search(r"must be <= \d", err), err
    _quick(r)


def test_demo_devices_beyond_what_xla_makes():
    """The real command: --devices 100000 used to make XLA create 100000 host devices (a segfault)."""
    p = subprocess.run([sys.executable, "-c", PRELUDE + "from hisparse_jax.cli import main; sys.exit(main())",
                        "demo", "--devices", "100000", "--plot", ""], capture_output=True, text=True, timeout=120,
                       env=child_env())
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert p.stderr.splitlines()[-1] == (f"hisparse demo: error: argument --devices: must be <= {demo.MAX_DEVICES}, "
                                         "got '100000'"), p.stderr
    with pytest.raises(ValueError, match=f"devices: must be <= {demo.MAX_DEVICES}, got '100000'"):
        demo.run(devices=100000, plot="")


@pytest.mark.parametrize("name", COUNTS)
def test_every_count_has_its_bound(name):
    limit = config.SIZE_LIMITS[name]
    with pytest.raises(ValueError, match=rf"{name} must be <= {limit} \(this package's limit"):
        hj.get_preset("tiny-glm").replace(**{name: limit + 1})
    assert set(config.SIZE_LIMITS) == set(COUNTS)


@pytest.mark.parametrize("preset, change, mtp", [
    ("tiny-glm", {}, False), ("tiny-deepseek", {"num_nextn_predict_layers": 2}, True),
    ("tiny-glm", {"tie_word_embeddings": True, "n_shared_experts": 0, "num_nextn_predict_layers": 1}, True),
])
def test_parameter_bytes_match_the_model(preset, change, mtp):
    cfg = hj.get_preset(preset).replace(**change)
    model = nnx.eval_shape(lambda: SparseMLAModel(cfg, rngs=nnx.Rngs(0), mtp=mtp))
    have = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert sum(cfg.parameter_bytes(mtp=mtp).values()) == have
    assert set(cfg.parameter_bytes()) == set(ModelConfig.PARAMETER_FIELDS)


def test_hot_rows_within_the_pool_are_accepted():
    assert CacheConfig(device_pages=8, hot_rows=512).hot_rows == 512


def test_a_hot_buffer_larger_than_the_device_pool_is_not_refused_by_itself():
    """The fuzzer's generate case 414 (seed 2026): 1 device page, 192 hot rows and a one-page request, which never
    tiers, ran; preempt and offload use no hot buffer. Only a store past the machine's memory is refused."""
    assert CacheConfig(device_pages=1, host_pages=2, hot_rows=192, max_seq_len=128).hot_rows == 192


def test_demo_names_devices_when_one_devices_share_fits(monkeypatch):
    """The demo's refusal names --devices (with the largest count that fits) when one device's share of the
    workload fits the memory and the devices' count is what does not, whichever part of it is the largest."""
    from hisparse_jax import demo_checks, memory
    from hisparse_jax.config import get_preset

    args = demo.parse_args(["--preset", "demo-glm", "--devices", "4", "--plot", ""])
    cfg = get_preset(args.preset)
    costs = demo_checks.workload_costs(argparse.Namespace(**{**vars(args), "devices": 1}), cfg, args.prompt_len)
    one = sum(memory.account_bytes(costs).values())
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: int(2.5 * one))  # two devices' shares fit, not three
    with pytest.raises(demo.DemoSetupError, match=r"^--devices 4 must be <= 2 on this machine: the workload needs"):
        demo_checks.check_memory(args, cfg, args.prompt_len)
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: int(4.5 * one))
    demo_checks.check_memory(args, cfg, args.prompt_len)  # four fit: no refusal
