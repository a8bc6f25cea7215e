"""Training a DSA model the way DeepSeek trained DeepSeek Sparse Attention (V3.2 report, section 2.1), in three stages:

1. "dense": language modelling with full causal attention; the indexer is not used and not trained.
2. "warmup": everything but the indexer frozen; each full indexer learns to match its layer's attention: the
   target is the main attention summed over heads and L1-normalised, p_t = sum_h a_{h,t} / H, and the loss is
   KL(p_t || softmax(I_t)) over the causal keys.
3. "sparse": attention only over the indexer's top-k (shared-index layers over their leader's, as GLM-5 does);
   the main model learns from the LM loss, the indexer from the KL restricted to the selected keys; the
   indexer's inputs are detached, so the two losses train disjoint parameters.

Then the multi-token-prediction layer (`model.mtp[0]`, `hisparse_jax.model.mtp`), the main model frozen, with
DeepSeek-V3's MTP objective: from the main model's final hidden state at t and the token at t + 1, cross entropy on
the token at t + 2 (V3 report, section 2.2; one MTP module, depth 1). Its block has its own full indexer, trained as
the main ones are, in two stages:

4. "mtp_dense": the block attends densely; the MTP loss for the layer, the indexer KL for its indexer;
5. "mtp_sparse": the block attends over its indexer's top-k, as it drafts at decode time.

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
from hisparse_jax.model.mtp import mtp_input, mtp_logits
from hisparse_jax.train.resume import StageResume
from pallas_kernels.indexer_topk.reference import select_topk

STAGES = ("dense", "warmup", "sparse", "mtp_dense", "mtp_sparse")
MTP_STAGES = ("mtp_dense", "mtp_sparse")
# which parameter groups (`param_groups`) a stage trains (the rest are frozen)
GROUPS = ("main", "indexer", "mtp")
TRAINS = {"dense": ("main",), "warmup": ("indexer",), "sparse": ("main", "indexer"), "mtp_dense": ("mtp",),
          "mtp_sparse": ("mtp",)}
# what each stage's layers with their own indexer do with it (`prefill_layer`'s modes): the main layers' in the
# first three stages, the MTP block's in the last two (where the main model runs as it decodes, "select")
INDEXER_MODE = {"dense": "off", "warmup": "score", "sparse": "select", "mtp_dense": "score", "mtp_sparse": "select"}


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")


def train_forward(model: SparseMLAModel, ids, *, stage: str, recall: bool = False, remat: bool = False):
    """ids int32[B, T] (positions 0..T-1) -> (logits f32[B, T, V], aux).

    aux = {"kl": f32[L_I] (the indexer loss per full-indexer layer; empty in "dense"), "topk": int32[L_I, B, T, K]
    (the selection in "sparse", else an empty list)}; with `recall` (not in "dense") also "recall": f32[L_I], the
    share of the attention's top-k keys (its distribution summed over heads) that the indexer's top-k holds, over the
    queries that see more than K keys (in "warmup" the attention is dense: what the indexer is taught).
    remat: recompute each block's forward in the backward pass (`scan_layers`), for long contexts.
    """
    _check_stage(stage)
    if stage in MTP_STAGES:
        raise ValueError(f"train_forward runs the main layers' stages; {stage!r} trains the MTP layer "
                         "(mtp_train_forward)")
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

    x, _, out = scan_layers(model, body, model.embed(ids), remat=remat)
    logits = model.logits(x).astype(jnp.float32)
    none = jnp.zeros((0,), jnp.float32)
    aux = {"kl": out.get("kl", none), "topk": out.get("topk", [])}
    if recall:
        aux["recall"] = out.get("recall", none)
    return logits, aux


def mtp_train_forward(model: SparseMLAModel, ids, *, stage: str, recall: bool = False):
    """ids int32[B, T + 1] -> (main logits f32[B, T, V] at positions 0..T-1, MTP logits f32[B, T - 1, V], aux).

    The main model runs its own forward (`model.forward`, sparse, as it decodes) over ids[:, :T], its final hidden
    states detached (frozen, and no gradient computed through it); `model.mtp[0]` reads hidden state t and token
    t + 1 and predicts token t + 2, t = 0..T-2: MTP row t's target is ids[:, t + 2]. Its block runs in the stage's
    indexer mode ("score": dense attention; "select": over its indexer's top-k, then its logits are
    `mtp.mtp_forward`'s). aux = {"kl": f32[1] (the block's indexer loss), "recall" (with `recall`): f32[1], as
    `train_forward`'s: against the block's attention in this mode, so only meaningful in "mtp_dense"}.
    """
    if stage not in MTP_STAGES:
        raise ValueError(f"mtp_train_forward runs the MTP stages ({', '.join(MTP_STAGES)}), got {stage!r}")
    if not len(getattr(model, "mtp", ())):
        raise ValueError("the MTP stages need a model with an MTP layer (SparseMLAModel(..., mtp=True))")
    main_logits, aux = model.forward(ids[:, :-1])
    draft, out = _mtp_block(model, aux["hidden"], ids, stage, recall)
    return jax.lax.stop_gradient(main_logits.astype(jnp.float32)), draft, out


def _mtp_block(model: SparseMLAModel, hidden, ids, stage: str, recall: bool):
    """`mtp_train_forward` past the main forward: the main model's final hidden states hidden [B, T, D] (detached
    here) and ids int32[B, T + 1] -> (MTP logits f32[B, T - 1, V], aux)."""
    cfg, layer = model.cfg, model.mtp[0]
    B, T = ids.shape[0], ids.shape[1] - 1
    hidden = jax.lax.stop_gradient(hidden[:, :T - 1])
    pos = jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32), (B, T - 1))
    cos, sin = model.rope(pos)
    causal = jnp.tril(jnp.ones((T - 1, T - 1), bool))[None]
    x = mtp_input(layer, model.embed(ids[:, 1:T]), hidden, pos)
    y, rows, attend = prefill_layer(model, layer.block, x, cos, sin, causal, None, indexer=INDEXER_MODE[stage],
                                    with_probs=True)
    p = jax.lax.stop_gradient(rows["probs"])
    out = {"kl": indexer_kl(p, rows["scores"], attend)[None]}
    if recall:
        out["recall"] = topk_recall(rows["scores"], jnp.sum(p.astype(jnp.float32), axis=1),
                                    jnp.broadcast_to(causal, rows["scores"].shape), cfg.index_topk)[None]
    return mtp_logits(layer, y), out


def init_mtp_head(model: SparseMLAModel) -> None:
    """Start the MTP layer's output head and its norm (`shared_head`, `shared_head_norm`) as copies of the main
    model's LM head and final norm, in place: DeepSeek-V3 shares the output head between the main model and its MTP
    module; the checkpoints store the layer's own copy, which the MTP stages then train."""
    layer = model.mtp[0]
    head = model.embed_tokens[...].T if model.lm_head is None else model.lm_head.kernel[...]
    layer.shared_head.kernel[...] = head.astype(layer.shared_head.kernel.dtype)
    layer.shared_head_norm.weight[...] = model.norm.weight[...]


def draft_agreement(main_logits, mtp_logits):
    """The share of MTP rows t whose greedy draft (argmax of mtp_logits[:, t], f32[B, T - 1, V]) is the main
    model's greedy token at t + 2 given the true prefix (argmax of main_logits[:, t + 1], f32[B, T, V]): the
    acceptance rate of one greedy speculative token, teacher-forced."""
    return jnp.mean((jnp.argmax(mtp_logits, -1) == jnp.argmax(main_logits[:, 1:], -1)).astype(jnp.float32))


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
    return jnp.mean(token_nll(logits, targets))


def token_nll(logits, targets):
    """Next-token cross entropy (nats) per position, averaged over the batch: logits f32[B, T, V], targets
    int32[B, T] -> f32[T]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], axis=0)


def position_buckets(T: int, K: int) -> list[tuple[int, int]]:
    """The query positions [lo, hi) `evaluate` reports apart, for windows of T tokens and top-k K: [0, K) (every
    query sees at most K keys, so sparse attention is dense there), [K, 4K), then doubling ([4K, 8K), ...) to T."""
    edges = [0] + [e for e in (K, 4 * K) if e < T]
    while edges[-1] >= 4 * K and 2 * edges[-1] < T:
        edges.append(2 * edges[-1])
    return list(zip(edges, edges[1:] + [T]))


def stage_loss(model: SparseMLAModel, batch, stage: str, *, remat: bool = False):
    """batch int32[B, T + 1] -> (loss, metrics): the LM loss in "dense"/"sparse", the mean indexer KL in "warmup",
    their sum in "sparse"; in the MTP stages the MTP loss (the token two ahead) plus its block's indexer KL, with
    "lm" the MTP loss. remat: `train_forward`'s (main stages)."""
    if stage in MTP_STAGES:
        _, logits, aux = mtp_train_forward(model, batch, stage=stage)
        ce, kl = lm_loss(logits, batch[:, 2:]), jnp.mean(aux["kl"])
        return ce + kl, {"loss": ce + kl, "lm": ce, "kl": kl}
    logits, aux = train_forward(model, batch[:, :-1], stage=stage, remat=remat)
    ce = lm_loss(logits, batch[:, 1:])
    kl = jnp.mean(aux["kl"]) if aux["kl"].size else jnp.float32(0)
    loss = {"dense": ce, "warmup": kl, "sparse": ce + kl}[stage]
    return loss, {"loss": loss, "lm": ce, "kl": kl}


def param_groups(params) -> object:
    """The pytree of group labels (`GROUPS`) of a params State: "mtp" for the MTP layers' (their block's indexer
    included), "indexer" for the main layers' indexers, "main" for the rest."""
    def label(path, _):
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        return "mtp" if keys[:1] == ["mtp"] else "indexer" if "indexer" in keys else "main"
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
        transforms = {g: adamw if g in TRAINS[self.stage] else optax.set_to_zero() for g in GROUPS}
        return optax.multi_transform(transforms, param_groups(params))


def train_stage(model: SparseMLAModel, sc: StageConfig, batches: Iterator[np.ndarray], *,
                log: Callable[[dict], None] | None = None, log_every: int = 10, remat: bool = False,
                resume: StageResume | None = None) -> list[dict]:
    """Run one stage in place on `model`; `batches` yields int32[batch, seq_len + 1]. Returns the logged rows
    ({"stage", "step", "loss", "lm", "kl", "lr", "s_per_step"}), one every `log_every` steps and at the last.
    remat: recompute each block in the backward pass (`train_forward`): the same updates in less memory.
    resume: save the stage's state every `resume.every` steps, and continue from a saved one (`train.resume`):
    the batches its steps used are drawn from `batches` and skipped, the rows it logged are returned too."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = sc.optimizer(params)
    opt_state = tx.init(params)
    done, rows, acc = 0, [], []
    saved = resume.restore(params, opt_state) if resume is not None else None
    if saved is not None:
        done, params, opt_state, rows, acc = saved
        for _ in range(done):
            next(batches)

    @jax.jit
    def step(params, rest, opt_state, batch):
        def loss_fn(p):
            return stage_loss(nnx.merge(graphdef, p, rest), batch, sc.stage, remat=remat)
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    t0 = time.perf_counter()
    for i in range(done, sc.steps):
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
        if resume is not None and (i + 1) % resume.every == 0 and i + 1 < sc.steps:
            acc = [{k: float(v) for k, v in m.items()} for m in jax.device_get(acc)]  # (steps not logged yet)
            resume.save(i + 1, params, opt_state, rows, acc)
    nnx.update(model, params)
    if resume is not None:
        resume.finish()
    return rows


def evaluate(model: SparseMLAModel, windows: np.ndarray, *, batch: int = 1) -> dict:
    """Held-out quality of a DSA model on windows int32[N, T + 1]: LM loss (nats per token) and perplexity with
    dense attention and with the model's own sparse forward (`model(ids)`, what prefill runs), and per full
    indexer layer the recall of the main attention's top-k (summed over heads) by the indexer's top-k, over the
    queries that see more than top-k keys. With an MTP layer also "mtp": its loss on the token two ahead (its block
    sparse, as it drafts), the share of greedy drafts that are the data's token ("draft_accuracy") and the main
    model's greedy token ("draft_agreement", `draft_agreement`: one speculative token's acceptance rate,
    teacher-forced), its indexer's recall. "by_position": the dense and sparse losses over the query positions of
    each `position_buckets` range, where the sparse model's loss comes from."""
    graphdef, state = nnx.split(model)
    has_mtp = bool(len(getattr(model, "mtp", ())))

    @jax.jit
    def one(state, ids):
        m = nnx.merge(graphdef, state)
        x, y = ids[:, :-1], ids[:, 1:]
        dense_logits, aux = train_forward(m, x, stage="warmup", recall=True)
        sparse_logits, main = m.forward(x)
        sparse_logits = sparse_logits.astype(jnp.float32)
        out = {"dense": token_nll(dense_logits, y), "sparse": token_nll(sparse_logits, y), "recall": aux["recall"],
               "kl": aux["kl"]}
        if has_mtp:  # on the same main forward: sparse, as it drafts, and dense for its indexer's recall (under
            # "select" its attention sees only the indexer's own top-k)
            draft, _ = _mtp_block(m, main["hidden"], ids, "mtp_sparse", False)
            recall = _mtp_block(m, main["hidden"], ids, "mtp_dense", True)[1]["recall"][0]
            out.update(mtp_loss=lm_loss(draft, ids[:, 2:]), mtp_agreement=draft_agreement(sparse_logits, draft),
                       mtp_accuracy=jnp.mean((jnp.argmax(draft, -1) == ids[:, 2:]).astype(jnp.float32)),
                       mtp_recall=recall)
        return out

    rows = [jax.device_get(one(state, jnp.asarray(windows[i:i + batch]))) for i in range(0, len(windows), batch)]
    mean = {k: np.mean([r[k] for r in rows], axis=0) for k in rows[0]}  # (per position for "dense", "sparse")
    dense, sparse = float(np.mean(mean["dense"])), float(np.mean(mean["sparse"]))
    T = int(windows.shape[1] - 1)
    out = {"windows": int(len(windows)), "tokens_per_window": T,
           "loss_dense": dense, "loss_sparse": sparse, "ppl_dense": math.exp(dense), "ppl_sparse": math.exp(sparse),
           "sparse_over_dense_ppl": math.exp(sparse - dense),
           "recall_per_index_layer": [float(v) for v in mean["recall"]],
           "kl_per_index_layer": [float(v) for v in mean["kl"]],
           "by_position": []}
    for lo, hi in position_buckets(T, model.cfg.index_topk):
        d, s = float(np.mean(mean["dense"][lo:hi])), float(np.mean(mean["sparse"][lo:hi]))
        out["by_position"].append({"positions": [lo, hi], "loss_dense": d, "loss_sparse": s,
                                   "sparse_over_dense_ppl": math.exp(s - d)})
    if has_mtp:
        out["mtp"] = {"loss": float(mean["mtp_loss"]), "draft_accuracy": float(mean["mtp_accuracy"]),
                      "draft_agreement": float(mean["mtp_agreement"]), "indexer_recall": float(mean["mtp_recall"])}
    return out
