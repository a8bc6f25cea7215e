"""Pallas GPU kernels, each with a pure-jnp reference of the same signature."""
