"""The case the two-process test runs (shared by `multihost_worker.py` and the single-process
reference in `test_sharding.py`)."""
from __future__ import annotations

import numpy as np

from arena_jax import models

CONFIG = models.LlamaConfig.tiny(num_heads=8, num_kv_heads=2)  # KV heads split over tensor=2
SEED = 5
PAGE_SIZE = 4
NEW_STEPS = 1  # decode steps after the prefill


def prompts() -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, CONFIG.vocab_size, (4, 6)).astype(np.int32)
