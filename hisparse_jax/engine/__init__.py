"""The imperative shell: requests, continuous batching under a memory policy, metrics."""

from hisparse_jax.engine.engine import Engine, EngineConfig, device_budget
from hisparse_jax.engine.request import Request, RequestState, SamplingParams
from hisparse_jax.engine.scheduler import POLICIES

__all__ = ["Engine", "EngineConfig", "device_budget", "Request", "RequestState", "SamplingParams", "POLICIES"]
