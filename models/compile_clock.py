"""How long a stretch of host time spent making JAX programs: tracing, lowering to MLIR and
compiling (or reading a compiled program from the persistent cache), so that a rate can leave
it out (`Generation.tokens_per_second`, issue 40).

It listens to the time spans JAX reports for those phases (`jax.monitoring`; the same events on
JAX 0.10 and 0.11) and sums their union: a trace nested in another trace counts once. The
listener is process-wide, so programs another thread builds meanwhile count too.
"""
from __future__ import annotations

import threading

import jax.monitoring

LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # once per program (jit cache miss)
BACKEND = "/jax/core/compile/backend_compile_duration"  # XLA compiling it (or the persistent cache serving it)
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", LOWERED, BACKEND)


class CompileClock:
    """`with CompileClock() as clock: ...` then `clock.seconds`: compile time inside the block;
    `clock.programs`: programs lowered in it (every jit cache miss, whether XLA then compiles it
    or the persistent compilation cache serves it)."""

    def __init__(self):
        self._spans: list[tuple[float, float]] = []
        self.programs = 0
        self._lock = threading.Lock()

    def _listen(self, event: str, start: float, end: float, **_) -> None:
        if event in COMPILE_EVENTS:
            with self._lock:
                self._spans.append((start, end))
                self.programs += event == LOWERED

    def __enter__(self) -> CompileClock:
        jax.monitoring.register_event_time_span_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_time_span_listener(self._listen)

    @property
    def seconds(self) -> float:
        """The length of the union of the recorded spans."""
        total, reach = 0.0, float("-inf")
        with self._lock:
            spans = sorted(self._spans)
        for start, end in spans:
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total
