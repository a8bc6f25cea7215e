"""Mixture of experts: DeepSeek's sigmoid router with correction bias and group-limited top-k.

Routing (`route`) follows transformers' `DeepseekV32TopkRouter` exactly: sigmoid scores, the
selection adds `e_score_correction_bias`, groups are ranked by the sum of their two best
experts, `topk_group` groups survive, `num_experts_per_tok` experts are picked among them, the
weights (from the *unbiased* scores) are renormalized and multiplied by `routed_scaling_factor`.

Two exact expert implementations:
* "ragged" (default): sort the (token, expert) pairs by expert and run `lax.ragged_dot`; the work
  is proportional to the routed pairs, as on a real serving system.
* "dense": run every expert on every token and combine with the routing weights; simple, the
  reference for tests.

Expert parallelism (`expert_parallel(axis)`): traced inside a `shard_map` over `axis` whose routed-expert weights
are split on their leading (expert) axis — rank r holds experts [r * E/N, (r + 1) * E/N) — each MoE layer gathers
every rank's tokens (`all_gather`), routes them all (the router is replicated), runs only its own experts on the
pairs routed to them, and returns each rank the sum over ranks of its tokens' outputs (`psum_scatter`). The
attention around it stays data-parallel; these two collectives per MoE layer are the only cross-device traffic.
With two experts per token the result is bit-identical to one device (a + b summed in either order).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

from hisparse_jax.config import ModelConfig
from hisparse_jax.model.layers import MLP, _normal


class Experts(nnx.Module):
    """Routed experts stacked on a leading axis: gate/up [E, D, F], down [E, F, D]."""

    def __init__(self, e: int, d: int, f: int, *, dtype, rngs: nnx.Rngs):
        self.gate = nnx.Param(_normal(rngs, (e, d, f), dtype))
        self.up = nnx.Param(_normal(rngs, (e, d, f), dtype))
        self.down = nnx.Param(_normal(rngs, (e, f, d), dtype))


class Router(nnx.Module):
    def __init__(self, e: int, d: int, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (d, e), jnp.float32))  # [D, E], kept in float32
        self.e_score_correction_bias = nnx.Param(jnp.zeros((e,), jnp.float32))


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.gate = Router(cfg.n_routed_experts, cfg.hidden_size, rngs=rngs)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype=dtype,
                               rngs=rngs)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype=dtype,
                                   rngs=rngs) if cfg.n_shared_experts else None)

    def __call__(self, x: jnp.ndarray, impl: str = "ragged") -> jnp.ndarray:
        """x [..., D] -> [..., D]."""
        if impl not in ("ragged", "dense"):
            raise ValueError(f"unknown moe impl {impl!r}; use 'ragged' or 'dense'")
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        e = self.experts
        run = experts_ragged if impl == "ragged" else experts_dense
        axis = _EXPERT_AXIS.get()
        if axis is None:
            weights, idx = route(xf, self.gate.weight[...], self.gate.e_score_correction_bias[...], self.cfg)
            y = run(xf, weights, idx, e.gate[...], e.up[...], e.down[...])
        else:  # expert parallel: every rank's tokens through this rank's experts, the sums scattered back
            xs = jax.lax.all_gather(xf, axis, tiled=True)  # [N * T, D]
            weights, idx = route(xs, self.gate.weight[...], self.gate.e_score_correction_bias[...], self.cfg)
            n_local = e.gate.shape[0]  # E / N experts on this rank
            first = jax.lax.axis_index(axis) * n_local
            mine = (idx >= first) & (idx < first + n_local)
            y = run(xs, jnp.where(mine, weights, 0.0), jnp.where(mine, idx - first, n_local),
                    e.gate[...], e.up[...], e.down[...])
            y = jax.lax.psum_scatter(y.astype(jnp.float32), axis, scatter_dimension=0, tiled=True).astype(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(xf)
        return y.reshape(shape)


_EXPERT_AXIS: contextvars.ContextVar = contextvars.ContextVar("hisparse_expert_axis", default=None)


@contextlib.contextmanager
def expert_parallel(axis: str):
    """Every MoE layer traced in this context runs expert-parallel over mesh axis `axis` (see the module
    docstring): for use inside a `shard_map` whose routed-expert weights are split on that axis."""
    token = _EXPERT_AXIS.set(axis)
    try:
        yield
    finally:
        _EXPERT_AXIS.reset(token)


def route(x: jnp.ndarray, w_router: jnp.ndarray, bias: jnp.ndarray, cfg: ModelConfig):
    """x [N, D] -> (weights float32[N, k], expert ids int32[N, k])."""
    logits = x.astype(jnp.float32) @ w_router.astype(jnp.float32)  # [N, E]
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias
    n, e = choice.shape
    g = cfg.n_group
    if g > 1:
        grouped = choice.reshape(n, g, e // g)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)  # [N, topk_group]
        group_mask = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], keep].set(True)
        expert_mask = jnp.repeat(group_mask, e // g, axis=1)
        choice = jnp.where(expert_mask, choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, idx.astype(jnp.int32)


def experts_dense(x, weights, idx, w_gate, w_up, w_down):
    """Every expert on every token, combined by the routing weights (zero for unrouted experts; a pair whose
    expert id is E — none of these experts — adds nothing)."""
    n, e = x.shape[0], w_gate.shape[0]
    combine = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], idx].add(weights, mode="drop")
    xc = x.astype(w_gate.dtype)
    h = jax.nn.silu(jnp.einsum("nd,edf->enf", xc, w_gate)) * jnp.einsum("nd,edf->enf", xc, w_up)
    y = jnp.einsum("enf,efd->end", h, w_down)  # [E, N, D]
    return jnp.einsum("end,ne->nd", y.astype(jnp.float32), combine).astype(x.dtype)


def experts_ragged(x, weights, idx, w_gate, w_up, w_down):
    """Grouped matmul over (token, expert) pairs sorted by expert (`lax.ragged_dot`). A pair whose expert id is E
    (none of these experts) sorts last, outside every group, and adds nothing."""
    n, k = idx.shape
    e = w_gate.shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tokens = order // k
    xs = x.astype(w_gate.dtype)[tokens]  # [N*k, D]
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    h = jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, sizes)) * jax.lax.ragged_dot(xs, w_up, sizes)
    y = jax.lax.ragged_dot(h, w_down, sizes)  # [N*k, D]
    routed = (flat[order] < e)[:, None]  # rows past the groups are not defined by ragged_dot: masked
    y = jnp.where(routed, y.astype(jnp.float32) * weights.reshape(-1)[order][:, None], 0.0)
    out = jnp.zeros((n, x.shape[1]), jnp.float32).at[tokens].add(y)
    return out.astype(x.dtype)
