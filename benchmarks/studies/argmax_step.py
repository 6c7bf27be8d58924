"""The decode step with `jnp.argmax` against `models.sampling.first_argmax` (issue 39, item 3; CPU).

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" taskset -c 1 \
        python -m arena_jax.benchmarks.studies.argmax_step mid 32 160

Two arena decode steps (`dense_ratio`'s setup: model, batch, context), one traced with the greedy
choice as `jnp.argmax`, one with `first_argmax`; the same tokens asserted, then 30 alternated
calls; prints both medians and the median of the per-pair time ratios.
"""
from __future__ import annotations

import sys
from unittest import mock

import jax.numpy as jnp
import numpy as np

from arena_jax import models
from arena_jax.models import sampling
from arena_jax.benchmarks.studies import dense_ratio as dr
from arena_jax.benchmarks.studies.context_cost import _filled_cache, _layout, _Runner, _timed

__all__ = ["main"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    model_name, batch, context = argv[0], int(argv[1]), int(argv[2])  # e.g. mid 32 160
    s = dr._settings(model_name, batch, context, 40)
    cfg = s.config()
    model = models.init_random(cfg, seed=0, dtype=jnp.dtype(s.dtype))

    def runner():
        cache = _filled_cache(s, _layout(s, cfg, s.capacity, s.layers), context, np.random.default_rng(0))
        return _Runner(s, "step", "xla", cache, model)

    new = runner()
    _timed(new.call)  # compile
    old = runner()
    with mock.patch.object(sampling, "first_argmax", lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)):
        _timed(old.call)
    assert (np.asarray(new.call()) == np.asarray(old.call())).all()
    t = {"old": [], "new": []}
    for _ in range(30):
        t["old"].append(_timed(old.call))
        t["new"].append(_timed(new.call))
    o, n = np.array(t["old"]), np.array(t["new"])
    print(f"{model_name}/{batch}/{context}: argmax step {np.median(o) * 1e3:.3f} ms, first_argmax step "
          f"{np.median(n) * 1e3:.3f} ms, median pair ratio old/new {np.median(o / n):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
