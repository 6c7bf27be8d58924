"""Count XLA compilations around a block of code (arena-bench serve's "compiles per call").

    with CompileCount() as c:
        models.generate(...)
    c.programs, c.seconds      # programs lowered (jit cache misses), the time spent making them

`CompileCount` is `arena_jax.models.compile_clock.CompileClock`, which `generate` uses to leave
compile time out of tokens/s: a program counts when JAX lowers it to MLIR, whether XLA then
compiles it or the persistent compilation cache serves it; `seconds` is the union of the trace,
lowering and compile time spans (a nested trace counts once).
"""
from __future__ import annotations

from arena_jax.models.compile_clock import CompileClock as CompileCount

__all__ = ["CompileCount"]
