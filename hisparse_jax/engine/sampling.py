"""Sampling a token from logits (pure functions: the runner jits them into its steps).

`sample_rows` is the one rule, the engine's and every `generate` path's: each row's token depends only on its
request's seed and its position (`token_key`), so a request's tokens do not depend on batching or scheduling.
`generate` takes one PRNG key for all its prompts; `prompt_seeds` turns it into one seed per prompt.
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


def prompt_seeds(key, n: int) -> list[int]:
    """`generate`'s per-prompt seeds from its one PRNG key: prompt i's seed is the uint32 drawn from
    `fold_in(key, i)`, so it depends only on the key and i (not on n)."""
    draw = jax.vmap(lambda i: jax.random.bits(jax.random.fold_in(key, i), dtype=jnp.uint32))
    return [int(s) for s in jax.device_get(draw(jnp.arange(n, dtype=jnp.uint32)))]
