"""Training a DSA model the way DeepSeek trained DeepSeek Sparse Attention (V3.2 report, section 2.1), in three stages:

1. "dense": language modelling with full causal attention; the indexer is not used and not trained.
2. "warmup": everything but the indexer frozen; each full indexer learns to match its layer's attention: the
   target is the main attention summed over heads and L1-normalised, p_t = sum_h a_{h,t} / H, and the loss is
   KL(p_t || softmax(I_t)) over the causal keys.
3. "sparse": attention only over the indexer's top-k (shared-index layers over their leader's, as GLM-5 does);
   the main model learns from the LM loss, the indexer from the KL restricted to the selected keys; the
   indexer's inputs are detached, so the two losses train disjoint parameters.

`train_forward` is the causal forward of `SparseMLAModel.forward`, scanned over the stacked layers with the same
`prefill_layer` (in the stage's indexer mode, returning the attention distribution and the indexer's scores),
plus the indexer loss. In "sparse" mode its logits are the model's own (`model(ids)`), which the tests check.
The optimizer is optax's AdamW with the stage's frozen parameters under `optax.set_to_zero`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hisparse_jax.model.block import prefill_layer, topk_to_mask
from hisparse_jax.model.decoder import SparseMLAModel, scan_layers
from pallas_kernels.indexer_topk.reference import select_topk

STAGES = ("dense", "warmup", "sparse")
# which parameter groups a stage trains (the rest are frozen)
TRAINS = {"dense": ("main",), "warmup": ("indexer",), "sparse": ("main", "indexer")}
# what each stage's layers do with their indexer (`prefill_layer`'s modes)
INDEXER_MODE = {"dense": "off", "warmup": "score", "sparse": "select"}


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")


def train_forward(model: SparseMLAModel, ids, *, stage: str, recall: bool = False):
    """ids int32[B, T] (positions 0..T-1) -> (logits f32[B, T, V], aux).

    aux = {"kl": f32[L_I] (the indexer loss per full-indexer layer; empty in "dense"), "topk": int32[L_I, B, T, K]
    (the selection in "sparse", else an empty list)}; with `recall` (not in "dense") also "recall": f32[L_I], the
    share of the attention's top-k keys (its distribution summed over heads) that the indexer's top-k holds, over the
    queries that see more than K keys (in "warmup" the attention is dense: what the indexer is taught).
    """
    _check_stage(stage)
    cfg = model.cfg
    B, T = ids.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cos, sin = model.rope(pos)
    causal = jnp.tril(jnp.ones((T, T), bool))[None]

    def body(x, layer, where, attend, _):
        x, rows, attend = prefill_layer(model, layer, x, cos, sin, causal, attend, indexer=INDEXER_MODE[stage],
                                        with_probs=True)
        if not where.owns_index:
            return x, attend, None, None
        out = {}
        if rows["topk"] is not None:
            out["topk"] = rows["topk"]
        if rows["scores"] is not None:
            p = jax.lax.stop_gradient(rows["probs"])
            out["kl"] = indexer_kl(p, rows["scores"], attend)
            if recall:
                out["recall"] = topk_recall(rows["scores"], jnp.sum(p.astype(jnp.float32), axis=1),
                                            jnp.broadcast_to(causal, rows["scores"].shape), cfg.index_topk)
        return x, attend, None, out

    x, _, out = scan_layers(model, body, model.embed(ids))
    logits = model.logits(x).astype(jnp.float32)
    none = jnp.zeros((0,), jnp.float32)
    aux = {"kl": out.get("kl", none), "topk": out.get("topk", [])}
    if recall:
        aux["recall"] = out.get("recall", none)
    return logits, aux


def topk_recall(scores, target, valid, K: int):
    """|top-K of scores ∩ top-K of target| / K, averaged over the queries t >= K (that see more than K keys):
    scores, target f32[B, T, S], valid bool[B, T, S]. 1.0 when no query sees more than K keys."""
    T = scores.shape[1]
    if T <= K:
        return jnp.float32(1)
    mine = topk_to_mask(select_topk(scores, valid, K), scores.shape[-1])
    best = topk_to_mask(select_topk(target, valid, K), scores.shape[-1])
    return jnp.mean(jnp.sum(mine & best, axis=-1)[:, K:].astype(jnp.float32)) / K


def indexer_kl(probs, scores, attend):
    """KL(p || softmax(scores)) averaged over queries: p = probs [B, H, T, S] summed over heads and normalised over
    the keys in `attend` bool[B, T, S] (where the main attention may look), scores f32[B, T, S]."""
    target = jnp.sum(probs.astype(jnp.float32), axis=1)
    target = jnp.where(attend, target, 0.0)
    target = target / jnp.maximum(jnp.sum(target, axis=-1, keepdims=True), 1e-30)
    logq = jax.nn.log_softmax(jnp.where(attend, scores, -jnp.inf), axis=-1)
    kl = jnp.where(attend, jax.scipy.special.xlogy(target, target) - target * jnp.where(attend, logq, 0.0), 0.0)
    return jnp.mean(jnp.sum(kl, axis=-1))


def lm_loss(logits, targets):
    """Mean next-token cross entropy (nats): logits f32[B, T, V], targets int32[B, T]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def stage_loss(model: SparseMLAModel, batch, stage: str):
    """batch int32[B, T + 1] -> (loss, metrics): the LM loss in "dense"/"sparse", the mean indexer KL in "warmup",
    their sum in "sparse"."""
    logits, aux = train_forward(model, batch[:, :-1], stage=stage)
    ce = lm_loss(logits, batch[:, 1:])
    kl = jnp.mean(aux["kl"]) if aux["kl"].size else jnp.float32(0)
    loss = {"dense": ce, "warmup": kl, "sparse": ce + kl}[stage]
    return loss, {"loss": loss, "lm": ce, "kl": kl}


def param_groups(params) -> object:
    """The pytree of group labels ("indexer" | "main") of a params State."""
    def label(path, _):
        return "indexer" if any(getattr(k, "key", getattr(k, "name", None)) == "indexer" for k in path) else "main"
    return jax.tree_util.tree_map_with_path(label, params)


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """One stage's schedule: `steps` AdamW steps of `batch` windows of `seq_len` tokens, linear warm-up over
    `warmup_steps` to `lr`, cosine decay to `lr * final_lr_frac`."""

    stage: str
    steps: int
    lr: float
    batch: int
    seq_len: int
    warmup_steps: int = 50
    final_lr_frac: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0

    def __post_init__(self):
        _check_stage(self.stage)
        for name in ("steps", "batch", "seq_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")

    def optimizer(self, params) -> optax.GradientTransformation:
        warm = min(self.warmup_steps, max(self.steps - 1, 0))
        schedule = optax.warmup_cosine_decay_schedule(0.0, self.lr, warm, max(self.steps, warm + 1),
                                                      end_value=self.lr * self.final_lr_frac)
        adamw = optax.chain(optax.clip_by_global_norm(self.clip_norm),
                            optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=self.weight_decay))
        transforms = {g: adamw if g in TRAINS[self.stage] else optax.set_to_zero() for g in ("main", "indexer")}
        return optax.multi_transform(transforms, param_groups(params))


def train_stage(model: SparseMLAModel, sc: StageConfig, batches: Iterator[np.ndarray], *,
                log: Callable[[dict], None] | None = None, log_every: int = 10) -> list[dict]:
    """Run one stage in place on `model`; `batches` yields int32[batch, seq_len + 1]. Returns the logged rows
    ({"stage", "step", "loss", "lm", "kl", "lr", "s_per_step"}), one every `log_every` steps and at the last."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = sc.optimizer(params)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, rest, opt_state, batch):
        def loss_fn(p):
            return stage_loss(nnx.merge(graphdef, p, rest), batch, sc.stage)
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    rows, acc, t0 = [], [], time.perf_counter()
    for i in range(sc.steps):
        batch = next(batches)
        if batch.shape != (sc.batch, sc.seq_len + 1):
            raise ValueError(f"batch shape {batch.shape}, want {(sc.batch, sc.seq_len + 1)}")
        params, opt_state, metrics = step(params, rest, opt_state, jnp.asarray(batch))
        acc.append(metrics)
        if (i + 1) % log_every == 0 or i + 1 == sc.steps:
            m = jax.device_get(acc)
            row = {"stage": sc.stage, "step": i + 1, **{k: float(np.mean([a[k] for a in m])) for k in m[0]},
                   "s_per_step": (time.perf_counter() - t0) / len(acc)}
            if not all(math.isfinite(row[k]) for k in ("loss", "lm", "kl")):
                raise FloatingPointError(f"{sc.stage} step {i + 1}: loss is not finite ({row})")
            rows.append(row)
            if log:
                log(row)
            acc, t0 = [], time.perf_counter()
    nnx.update(model, params)
    return rows


def evaluate(model: SparseMLAModel, windows: np.ndarray, *, batch: int = 1) -> dict:
    """Held-out quality of a DSA model on windows int32[N, T + 1]: LM loss (nats per token) and perplexity with
    dense attention and with the model's own sparse forward (`model(ids)`, what prefill runs), and per full
    indexer layer the recall of the main attention's top-k (summed over heads) by the indexer's top-k, over the
    queries that see more than top-k keys."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def one(state, ids):
        m = nnx.merge(graphdef, state)
        x, y = ids[:, :-1], ids[:, 1:]
        dense_logits, aux = train_forward(m, x, stage="warmup", recall=True)
        sparse_logits = m(x).astype(jnp.float32)
        return lm_loss(dense_logits, y), lm_loss(sparse_logits, y), aux["recall"], aux["kl"]

    out = {"dense": [], "sparse": [], "recall": [], "kl": []}
    for i in range(0, len(windows), batch):
        d, s, r, kl = jax.device_get(one(state, jnp.asarray(windows[i:i + batch])))
        out["dense"].append(d)
        out["sparse"].append(s)
        out["recall"].append(r)
        out["kl"].append(kl)
    dense, sparse = float(np.mean(out["dense"])), float(np.mean(out["sparse"]))
    return {"windows": int(len(windows)), "tokens_per_window": int(windows.shape[1] - 1),
            "loss_dense": dense, "loss_sparse": sparse, "ppl_dense": math.exp(dense), "ppl_sparse": math.exp(sparse),
            "sparse_over_dense_ppl": math.exp(sparse - dense),
            "recall_per_index_layer": [float(v) for v in np.mean(out["recall"], axis=0)],
            "kl_per_index_layer": [float(v) for v in np.mean(out["kl"], axis=0)]}
