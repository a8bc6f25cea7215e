"""Sampling a token from logits (pure functions: the runner jits them into its steps).

`sample_rows` is the engine's and the tiered `generate`'s rule: each row's token depends only on its request's
seed and its position (`token_key`), so a request's tokens do not depend on batching or scheduling.
`sample_tokens` is the contiguous `generate`'s: one PRNG key split per step over the whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def nucleus_logits(lg, t, p):
    """The distribution a token is drawn from, as logits: lg [V] / temperature t with everything outside the top-p
    nucleus at -inf (t > 0; at t == 0 the draw is greedy and this is unused)."""
    scaled = lg / jnp.maximum(t, 1e-6)
    sorted_l = jnp.sort(scaled)[::-1]
    cum = jnp.cumsum(jax.nn.softmax(sorted_l))
    cutoff = sorted_l[jnp.sum(cum < p)]
    return jnp.where(scaled < cutoff, -jnp.inf, scaled)


def token_key(seed, pos):
    """The PRNG key of the token at position `pos` of the request with `seed`."""
    return jax.random.fold_in(jax.random.key(seed), pos)


def sample_rows(logits, seeds, positions, temperatures, top_ps):
    """One token per row of logits [n, V]: greedy where temperature == 0, else temperature + nucleus (top-p)
    drawn from the key (seed, position)."""

    def one(lg, seed, pos, t, p):
        greedy = jnp.argmax(lg).astype(jnp.int32)
        drawn = jax.random.categorical(token_key(seed, pos), nucleus_logits(lg, t, p)).astype(jnp.int32)
        return jnp.where(t > 0, drawn, greedy)

    return jax.vmap(one)(logits, seeds, positions, temperatures, top_ps)


def sample_tokens(logits, key, temperature: float, top_p: float):
    """logits f32[B, V] -> int32[B]. Greedy when temperature == 0, else temperature + nucleus (top-p)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cutoff_idx = jnp.sum(cum < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
