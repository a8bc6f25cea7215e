"""The contiguous decode step of plain `generate` (cache=None) updates its donated KV arrays in place and reads its
no per-step copy of a layer's arrays or of the whole of `kv`; one compile for a 40-step loop."""

from __future__ import annotations

import importlib
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

import hisparse_jax as hj
from hisparse_jax.config import CacheConfig
from hisparse_jax.engine import runner
from hisparse_jax.kv.dense import DenseKV, init_dense_kv
from tiny import model_cfg

G = importlib.import_module("hisparse_jax.generate")  # the module (the package re-exports the function)

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]\S*\s+([\w\-]+)\((.*)$")


def entry_instructions(hlo: str):
    """The ENTRY computation of compiled HLO text: [(name, dims, opcode, operand names)]."""
    start = hlo.index("\nENTRY")
    out = []
    for line in hlo[start:hlo.index("\n}", start)].splitlines()[1:]:
        m = _INSTR.match(line)
        if not m:
            continue
        name, _, dims, op, rest = m.groups()
        depth, args = 1, []
        for ch in rest:
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
            args.append(ch)
        out.append((name, tuple(int(d) for d in dims.split(",") if d), op, re.findall(r"%([\w.\-]+)", "".join(args))))
    return out


def is_data_movement(name: str, op: str) -> bool:
    """A copy / transpose, or a fusion XLA named after one (`transpose_copy_fusion`, `wrapped_slice`, ...) — not
    an in-place update (`..._scatter...`, `...dynamic-update-slice...`: a non-in-place one shows up as a `copy`)."""
    if op in ("copy", "copy-start", "transpose"):
        return True
    if op != "fusion" or "scatter" in name or "update-slice" in name:
        return False
    return any(w in name for w in ("copy", "transpose", "slice"))


def big(dims) -> tuple:
    return tuple(sorted(d for d in dims if d > 1))


def compiled_step(model, B: int, S: int):
    cfg = model.cfg
    graphdef, state = nnx.split(model)
    step = runner.jitted_dense_decode(graphdef, DenseKV(topk=cfg.index_topk, index_dtype=model.index_dtype))
    kv = init_dense_kv(cfg, B, S, model.dtype)
    sampling = {"seed": jnp.zeros((B,), jnp.uint32), "temperature": jnp.zeros((B,)), "top_p": jnp.ones((B,))}
    args = (state, jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32), kv, sampling)
    return step.lower(*args).compile(), kv


def test_decode_step_updates_the_kv_in_place(tiny_glm):
    cfg = tiny_glm.cfg
    B, S = 2, 1024
    compiled, kv = compiled_step(tiny_glm, B, S)
    kv_bytes = sum(v.nbytes for v in kv.values())
    layer_latent_bytes = kv["latent"].nbytes // cfg.num_hidden_layers

    # memory: the donated `kv` is aliased to the output, and the step's scratch is well below one layer's latent
    # rows (the slice-modify-writeback of every layer this replaced needed 1.7x a layer here, 2.6x the whole of `kv`
    # at B=1) beside the weights XLA:CPU re-lays out for its matmuls (kv_b_proj's W_UK / W_UV and the experts, read
    # transposed; 4.2 MB here, measured: 5.4 MB of scratch, 1.2 MB before the layers were stacked and when these
    # weights were prepared once per call, which stopped paying off under the scan)
    relaid = sum(v.nbytes for path, v in nnx.to_flat_state(nnx.state(tiny_glm, nnx.Param))
                 if "kv_b_proj" in path or "experts" in path)
    mem = compiled.memory_analysis()
    if mem is not None:
        assert mem.alias_size_in_bytes >= kv_bytes, (mem.alias_size_in_bytes, kv_bytes)
        assert mem.temp_size_in_bytes < layer_latent_bytes / 2 + relaid, (mem.temp_size_in_bytes, layer_latent_bytes,
                                                                          relaid)

    # HLO: no copy / transpose / slice shaped like a layer's latent or rope rows or like a whole `kv` array, none as
    # large as a layer's latent rows, none reading more than a row per sequence of a `kv` parameter. (The indexer's
    # score matmul may read one slot's keys through a transposed copy — XLA:CPU in jax 0.10 does, 0.12 does not:
    # that is the indexer reading its keys, B*S*index_head_dim values, not a write-back; the temp bound above
    # covers it.)
    L = cfg.num_hidden_layers
    kv_shapes = {big(s) for x in (cfg.kv_lora_rank, cfg.qk_rope_head_dim) for s in ((B, S, x), (L, B, S, x))}
    kv_shapes.add(big(kv["index_k"].shape))
    instrs = entry_instructions(compiled.as_text())
    kv_params = {n for n, dims, op, _ in instrs if op == "parameter" and big(dims) in kv_shapes}
    assert len(kv_params) == 3, kv_params  # the parser found the three `kv` arguments
    bad = []
    for name, dims, op, operands in instrs:
        if not is_data_movement(name, op):
            continue
        if (big(dims) in kv_shapes or int(np.prod(dims)) >= B * S * cfg.kv_lora_rank
                or (int(np.prod(dims)) > B * cfg.kv_lora_rank and any(o in kv_params for o in operands))):
            bad.append((name, dims, op))
    assert not bad, f"the decode step copies kv-sized buffers: {bad}"


def test_decode_step_compiles_once_for_40_steps_and_matches_the_paged_store():
    model = hj.SparseMLAModel(model_cfg(vocab_size=83, index_n_heads=4), rngs=nnx.Rngs(1))  # a fresh config: a fresh compile
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 83, n).tolist() for n in (90, 37)]
    before = runner.TRACE_COUNTS["decode"]
    tokens = G.generate(model, prompts, 40)
    assert runner.TRACE_COUNTS["decode"] - before == 1
    assert [len(t) for t in tokens] == [40, 40]
    G.generate(model, [p[:-1] for p in prompts], 40)  # the same shape buckets: no new compile
    assert runner.TRACE_COUNTS["decode"] - before == 1
    paged = G.generate(model, prompts, 40, cache=CacheConfig(device_pages=16, host_pages=16, max_seqs=2,
                                                              max_seq_len=256))
    assert tokens == paged
