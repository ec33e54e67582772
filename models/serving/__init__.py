"""Serving: continuous batching over a paged KV pool (`engine.Engine`) and its host-side
scheduler (`scheduler.Scheduler`)."""

from oscar_jax.models.serving.engine import Engine
from oscar_jax.models.serving.request import Request, Result

__all__ = ["Engine", "Request", "Result"]
