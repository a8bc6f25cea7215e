"""The DSA decoder: embeddings, layers (MLA + indexer, dense MLP or MoE), final norm, LM head.

The layers are stacked and scanned, as maxtext does, so a compiled step does not grow with depth. DeepSeek-V3.2 and
GLM-5 are not uniform (dense MLP layers first, then MoE; GLM-5's full / shared indexer pattern), so the unit of the
scan is a *block*: a layer with its own indexer and the shared-index layers after it (one indexer group). Runs of
consecutive identical blocks (`layer_runs`) keep their parameters stacked on a leading axis (`model.stacks[r][p]`:
position p of run r's block, parameters [repeats, ...]), and each run is one `lax.scan` (`scan_layers`). GLM-5's 78
layers are 3 runs (layers 0-1, one block each; layers 2-5, the last dense layer and its 3 MoE shared-index layers;
then 18 blocks of 4 MoE layers), DeepSeek-V3.2's 61 are 2 (3 dense, 58 MoE).
`model.layer(i)` is layer i on its own (a copy of its slice); checkpoints keep per-layer names (`weights.py`).

Two entry points:

* `SparseMLAModel.__call__(input_ids [B, T]) -> logits [B, T, V]` — the full causal forward in which
  every layer attends only to its indexer's top-k (shared-index layers reuse their leader's), as
  transformers does. `forward(...)` also returns what the KV arrays need (per-layer latent rows, indexer
  keys) and the per-layer top-k.
* `decode_step(model, tokens [B], positions [B], kv, backend)` — one new token per sequence in
  the absorbed MLA form. Where the rows come from is the *backend's* business (`block.KVBackend`):
  contiguous arrays here, the tiered paged store and the Pallas kernels elsewhere, without touching
  the model.

The per-layer bodies (`block.prefill_layer`, `block.decode_layer`) are shared with the multi-token-prediction
layers (`hisparse_jax.model.mtp`, built with `SparseMLAModel(..., mtp=True)`), whose block is one more decoder layer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from hisparse_jax.config import ModelConfig
from hisparse_jax.memory import abstract, device_memory_bytes, memory_name
from hisparse_jax.model.block import DecoderLayer, KVBackend, LayerIds, decode_layer, prefill_layer
from hisparse_jax.model.layers import Linear, RMSNorm, _normal
from hisparse_jax.model.mtp import MTPLayer
from hisparse_jax.model.rope import rope_cos_sin, rope_frequencies
from pallas_kernels.indexer_topk.reference import check_index_dtype

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """`repeats` consecutive identical blocks of layers, scanned as one (see the module docstring)."""

    first: int  # the number of its first layer
    first_index: int  # the number of its first block's indexer among the full-indexer layers
    repeats: int  # blocks in the run: the scan's length
    kinds: tuple[tuple[str, str], ...]  # (indexer type, mlp type) of each layer of a block; the first is "full"

    @property
    def size(self) -> int:
        """Layers per block."""
        return len(self.kinds)

    @property
    def num_layers(self) -> int:
        return self.repeats * self.size


@functools.lru_cache(maxsize=64)
def layer_runs(cfg: ModelConfig) -> tuple[LayerRun, ...]:
    """The model's main layers as runs of identical blocks, in layer order."""
    blocks: list[tuple[int, list]] = []
    for i, kind in enumerate(zip(cfg.indexer_types, cfg.mlp_layer_types)):
        if kind[0] == "full":
            blocks.append((i, []))
        blocks[-1][1].append(kind)
    runs: list[LayerRun] = []
    for index, (first, kinds) in enumerate(blocks):
        if runs and runs[-1].kinds == tuple(kinds):
            runs[-1] = dataclasses.replace(runs[-1], repeats=runs[-1].repeats + 1)
        else:
            runs.append(LayerRun(first, index, 1, tuple(kinds)))
    return tuple(runs)


def check_parameter_memory(cfg: ModelConfig, dtype=None, *, mtp: bool = False) -> None:
    """Refuse (ValueError), before anything is allocated, a model whose parameters (`cfg.parameter_bytes`) exceed
    the memory of the device they would be made on (`device_memory_bytes`). A no-op while jax traces (a fresh
    array is then a `jax.core.Tracer`, the public test flax uses too): under `nnx.eval_shape` nothing is allocated,
    so sizing GLM-5 for a deviceless build or `load_pretrained`'s shape pass stays possible on any machine, and
    under `jit` the outputs' placement (possibly sharded over devices) is not the constructor's to see."""
    if abstract():
        return
    # made where the parameters would be (the default device, or `jax.default_device`'s)
    device = next(iter(jnp.zeros((), jnp.int8).devices()))
    limit = device_memory_bytes(device)
    if limit is None:
        return
    dtype = jnp.dtype(dtype or DTYPES[cfg.dtype])
    parts = cfg.parameter_bytes(mtp=mtp, itemsize=dtype.itemsize)
    total = sum(parts.values())
    if total <= limit:
        return
    part = max(parts, key=parts.get)
    fields = ", ".join(f"{f}={getattr(cfg, f)}" for f in cfg.PARAMETER_FIELDS[part])
    raise ValueError(f"the model's parameters need {total:,} bytes ({total / 2 ** 30:,.1f} GiB, {dtype.name}), more "
                     f"than the {limit:,} bytes ({limit / 2 ** 30:,.1f} GiB) of {memory_name(device)}; the largest "
                     f"part is the {part} ({parts[part]:,} bytes: {fields}, num_hidden_layers="
                     f"{cfg.num_hidden_layers})")


def _stack(modules: list[nnx.Module]) -> nnx.Module:
    """Modules of one structure -> one module of that structure whose arrays are stacked on a new leading axis."""
    graphdef, _ = nnx.split(modules[0])
    states = [nnx.split(m)[1] for m in modules]
    return nnx.merge(graphdef, jax.tree.map(lambda *a: jnp.stack(a), *states))


class SparseMLAModel(nnx.Module):
    """A DeepSeek-V3.2 / GLM-5 style decoder. Parameters mirror the Hugging Face names, the main layers' stacked
    by runs of identical blocks (`model.layers.{i}.self_attn.q_a_proj.weight` -> the slice of layer i in
    `stacks[r][p].self_attn.q_a_proj.kernel`, transposed; `weights.layer_param_paths` maps the two).

    Options (static, not parameters): `moe_impl` ("ragged" | "dense"), `index_dtype` (None: the exact scores
    transformers computes; "fp8": emulate DeepSeek's FP8 + Hadamard indexer; "int4": MXFP4 keys and queries, as
    vLLM's and SGLang's 4-bit indexer caches; `pallas_kernels.indexer_topk.reference`). `mtp=True` also builds the
    config's `num_nextn_predict_layers` multi-token-prediction layers as `self.mtp` (`hisparse_jax.model.mtp`;
    an empty `nnx.List` otherwise).

    A config whose parameters (`ModelConfig.parameter_bytes`) exceed the memory of the device they would be made on
    is refused with a ValueError before any is allocated (`check_parameter_memory`; skipped under `nnx.eval_shape`).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None, dtype=None, moe_impl: str = "ragged",
                 index_dtype: str | None = None, mtp: bool = False):
        if mtp and cfg.num_nextn_predict_layers < 1:
            raise ValueError("mtp=True needs a config with num_nextn_predict_layers >= 1 (the checkpoint's "
                             "multi-token-prediction layers); this one has 0")
        # parameters that cannot fit the device are refused before any is made (not under nnx.eval_shape)
        check_parameter_memory(cfg, dtype, mtp=mtp)
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        dtype = jnp.dtype(dtype or DTYPES[cfg.dtype])
        self.cfg = cfg
        self.dtype = dtype
        self.moe_impl = moe_impl
        self.index_dtype = check_index_dtype(index_dtype)
        self.embed_tokens = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        # built one by one (each layer draws its initial values in layer order), then stacked run by run
        layers = [DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_hidden_layers)]
        self.stacks = nnx.List([
            nnx.List([_stack([layers[run.first + j * run.size + p] for j in range(run.repeats)])
                      for p in range(run.size)])
            for run in layer_runs(cfg)])
        del layers
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype,
                                                                    rngs=rngs)
        # the multi-token-prediction layers (`hisparse_jax.model.mtp`), empty unless asked for
        self.mtp = nnx.List([MTPLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_nextn_predict_layers)]
                            if mtp else [])

    @property
    def runs(self) -> tuple[LayerRun, ...]:
        return layer_runs(self.cfg)

    def layer_slot(self, i: int) -> tuple[int, int, int]:
        """Layer i's place in the stacks: (run r, block j within the run, position p within the block)."""
        if not 0 <= i < self.cfg.num_hidden_layers:
            raise IndexError(f"layer {i} out of range: the model has {self.cfg.num_hidden_layers} layers")
        for r, run in enumerate(self.runs):
            if i < run.first + run.num_layers:
                j, p = divmod(i - run.first, run.size)
                return r, j, p
        raise AssertionError("unreachable: the runs cover every layer")

    def layer(self, i: int) -> DecoderLayer:
        """Layer i as a `DecoderLayer` of its own: a copy of its slice of the stacked parameters (to read or run
        one layer; writing to it does not change the model)."""
        r, j, p = self.layer_slot(i)
        graphdef, state = nnx.split(self.stacks[r][p])
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[j], state))

    # ----- pieces shared by prefill and decode ---------------------------------------------------
    def rope(self, positions):
        """positions int[...] -> (cos, sin) f32[..., R/2]."""
        return rope_cos_sin(positions, *rope_frequencies(self.cfg.rope, self.cfg.qk_rope_head_dim))

    def embed(self, ids):
        return jnp.take(self.embed_tokens[...], ids, axis=0)

    def logits(self, h):
        """Un-normed final hidden states -> logits (final norm, then the LM head)."""
        return self.head(self.norm(h))

    def head(self, h):
        """The LM head alone, on hidden states already through the final norm."""
        if self.lm_head is None:
            return jnp.einsum("...d,vd->...v", h, self.embed_tokens[...])
        return self.lm_head(h)

    # ----- full causal forward -------------------------------------------------------------------
    def __call__(self, input_ids):
        return self.forward(input_ids)[0]

    def forward(self, input_ids, *, topk_override=None):
        """input_ids int32[B, T] (positions 0..T-1) -> (logits [B, T, V], aux).

        aux = {"latent": [L, B, T, C], "rope": [L, B, T, R], "index_k": [L_I, B, T, dI], "topk": int32[L_I, B, T, K],
        "hidden": [B, T, D]}; top-k rows are -1 padded (K = min(index_topk, T)); "hidden" is the final hidden state
        after the final norm (what the MTP layers read).
        topk_override: optional int32[L_I, B, T, K] (one index set per full indexer, or a list of them) to use instead
        of the indexer's — to test the attention math separately from the selection.
        """
        B, T = input_ids.shape
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        cos, sin = self.rope(pos)
        causal = jnp.tril(jnp.ones((T, T), bool))[None]
        override = None if topk_override is None else jnp.stack(list(topk_override))

        def body(x, layer, ids, attend, topk):
            x, rows, attend = prefill_layer(self, layer, x, cos, sin, causal, attend, topk_override=topk)
            index_rows = (rows["index_k"], rows["topk"]) if ids.owns_index else None
            return x, attend, (rows["latent"], rows["rope"]), index_rows

        x, (latent, rope), (index_k, topk) = scan_layers(self, body, self.embed(input_ids), index_xs=override)
        aux = {"latent": latent, "rope": rope, "index_k": index_k, "topk": topk, "hidden": self.norm(x)}
        return self.head(aux["hidden"]), aux


def scan_layers(model: SparseMLAModel, body, carry, *, index_xs=None, remat: bool = False):
    """Run `body` over the model's main layers in order, one `lax.scan` per run of identical blocks.

    remat: rematerialize each block under differentiation (`jax.checkpoint`): its backward pass recomputes the
    block's forward instead of keeping its activations, so training memory holds one block's attention
    (T x T per head) at a time, not every layer's: what a long context needs (about a third more compute).

    body(carry, layer: DecoderLayer, ids: LayerIds, local, xs) -> (carry, local, layer_out, index_out):
      `local` is what a block's leader hands its shared-index layers (None when the leader is called);
      `xs` is this block's slice of `index_xs` (a pytree of arrays with a leading axis of L_I, one entry per full
      indexer) for the leader, None for the others; `layer_out` is any pytree, the same for every layer;
      `index_out` the leader's (None for shared layers), the same for every leader.
    Returns (carry, layer_outs stacked [L, ...] in layer order, index_outs stacked [L_I, ...]).
    """
    layer_outs, index_outs = [], []
    for run, stack in zip(model.runs, model.stacks):
        graphdefs, params = zip(*(nnx.split(m) for m in stack))
        xs = None if index_xs is None else jax.tree.map(lambda a: a[run.first_index:run.first_index + run.repeats],
                                                        index_xs)

        def block(carry, inputs, run=run, graphdefs=graphdefs):
            params_j, j, xs_j = inputs  # j: the block's number in the run (traced inside the scan)
            local, outs, index_out = None, [], None
            for p, (graphdef, state) in enumerate(zip(graphdefs, params_j)):
                ids = LayerIds(layer=run.first + j * run.size + p, index=run.first_index + j, owns_index=p == 0,
                               group_size=run.size)
                carry, local, out, idx = body(carry, nnx.merge(graphdef, state), ids, local,
                                              xs_j if p == 0 else None)
                outs.append(out)
                if p == 0:
                    index_out = idx
            return carry, (jax.tree.map(lambda *a: jnp.stack(a), *outs), index_out)

        if run.repeats == 1:  # one block: called as it is, its numbers static (a reshape, not a slice, drops the
            # stacking axis: XLA sees through a reshape of a prepared weight where it copies a slice of it)
            params_0, xs_0 = jax.tree.map(lambda a: a.reshape(a.shape[1:]), (params, xs))

            def first(carry, params_0, xs_0, block=block):
                return block(carry, (params_0, 0, xs_0))
            carry, (outs, idx) = (jax.checkpoint(first) if remat else first)(carry, params_0, xs_0)
            outs, idx = jax.tree.map(lambda a: a[None], (outs, idx))
        else:
            carry, (outs, idx) = jax.lax.scan(jax.checkpoint(block) if remat else block, carry,
                                              (params, jnp.arange(run.repeats, dtype=jnp.int32), xs))
        layer_outs.append(jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), outs))
        index_outs.append(idx)

    def cat(*a):
        return a[0] if len(a) == 1 else jnp.concatenate(a)

    return carry, jax.tree.map(cat, *layer_outs), jax.tree.map(cat, *index_outs)


def decode_step(model: SparseMLAModel, tokens, positions, kv, backend: KVBackend, *, return_hidden: bool = False):
    """One decode step: tokens int32[B] at positions int32[B] -> (logits f32[B, V], kv, topk int32[L_I, B, K]: each
    full indexer's selection), or with `return_hidden` (logits, kv, topk, hidden [B, D]): the final hidden state
    after the final norm, what `model.mtp` reads. The backend must keep the structure of `kv` (`KVBackend`)."""
    pos = jnp.maximum(positions, 0)[:, None]  # [B, 1]
    cos, sin = model.rope(pos)

    def body(carry, layer, ids, topk, _):
        x, kv = carry
        x, kv, topk = decode_layer(model, layer, ids, x, cos, sin, positions, kv, backend, topk)
        return (x, kv), topk, None, topk if ids.owns_index else None

    (x, kv), _, all_topk = scan_layers(model, body, (model.embed(tokens[:, None]), kv))
    h = model.norm(x)
    logits = model.head(h)[:, 0].astype(jnp.float32)
    if return_hidden:
        return logits, kv, all_topk, h[:, 0]
    return logits, kv, all_topk
