"""Small parameter holders (Flax NNX) and the pure math of norms and projections."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = x @ kernel, kernel [in, out] (transposed relative to the torch/HF `weight` [out, in])."""

    def __init__(self, d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_normal(rngs, (d_in, d_out), dtype))

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        k = self.kernel[...]
        return jnp.einsum("...i,io->...o", x.astype(k.dtype), k)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return rms_norm(x, self.weight[...], self.eps)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return layer_norm(x, self.weight[...], self.bias[...], self.eps)


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """RMSNorm computed in float32, cast back to x's dtype, then scaled (as transformers does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def layer_norm(x: jnp.ndarray, weight: jnp.ndarray, bias: jnp.ndarray, eps: float) -> jnp.ndarray:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, d: int, f: int, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(d, f, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, dtype=dtype, rngs=rngs)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
