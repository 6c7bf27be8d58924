"""`fetch`: device arrays back on the host, in one transfer when this process holds them all,
else gathered from the other processes of a multi-host mesh. It answers "how do the step's
results reach the host?"; the scheduler and `models.fingerprint` use it.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["fetch"]


def fetch(*xs) -> list[np.ndarray]:
    """Device arrays on the host, whole: one transfer when this process holds them all, else
    each gathered from the other processes of a multi-host mesh."""
    if all(getattr(x, "is_fully_addressable", True) for x in xs):
        if len(xs) == 1:  # the usual step: one array, no tree walk
            return [np.asarray(xs[0])]
        return [np.asarray(x) for x in jax.device_get(xs)]
    return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in xs]
