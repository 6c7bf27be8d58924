"""`arena_jax.server`: how does the paged cache serve requests as they come? An online engine
(`engine.Engine`: requests join the running batch at the next step, the device loop in its own
thread, every program compiled before the first request) and an OpenAI-compatible HTTP server
over it (`app.create_app`, `arena-serve`: `cli`; request bodies in `protocol`). Nothing below
imports it: it is a layer over `arena_jax.models`.
"""
from arena_jax.server.engine import Engine, QueueFull, Request

__all__ = ["Engine", "QueueFull", "Request"]
