"""Count XLA compilations (JAX's monitoring events) around a block of code.

    with CompileCount() as c:
        models.generate(...)
    c.programs, c.seconds      # programs lowered and compiled (or fetched from the persistent cache), their time

One listener is registered for the process on first use (JAX has no way to remove one); each
`CompileCount` reads the running totals at entry and exit. A program counts when JAX lowers it
to MLIR (`/jax/core/compile/jaxpr_to_mlir_module_duration`), i.e. on every jit cache miss,
whether XLA then compiles it or the persistent compilation cache serves it; `seconds` adds the
trace, lowering and backend compile durations JAX reports.
"""
from __future__ import annotations

import threading

__all__ = ["CompileCount"]

_LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_TIMED = ("/jax/core/compile/jaxpr_trace_duration", _LOWERED, "/jax/core/compile/backend_compile_duration")
_totals = {"programs": 0, "seconds": 0.0, "backend": 0}
_lock = threading.Lock()
_registered = False


def _listen(name: str, duration: float, **_) -> None:
    if name in _TIMED:
        with _lock:
            _totals["seconds"] += duration
            _totals["programs"] += name == _LOWERED
            _totals["backend"] += name == "/jax/core/compile/backend_compile_duration"


def _register() -> None:
    global _registered
    if not _registered:
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(_listen)
        _registered = True


class CompileCount:
    """Programs compiled inside the block (`programs`; `backend`: those XLA compiled, not served
    by the persistent cache) and the seconds JAX spent tracing, lowering and compiling them."""

    def __enter__(self):
        _register()
        with _lock:
            self._start = dict(_totals)
        self.programs, self.backend, self.seconds = 0, 0, 0.0
        return self

    def __exit__(self, *exc):
        with _lock:
            self.programs = _totals["programs"] - self._start["programs"]
            self.backend = _totals["backend"] - self._start["backend"]
            self.seconds = _totals["seconds"] - self._start["seconds"]
        return False
