"""benchmarks/studies/hf_generate.py (issue 39, items 1 and 3): its list-of-layers model (the
`arena` path on a CPU, `arena-list` elsewhere) runs the same weights as the layer scan."""
from __future__ import annotations

import jax
import numpy as np

from arena_jax import models
from arena_jax.benchmarks.studies import hf_generate


def test_the_unrolled_model_holds_the_scanned_models_weights_and_decodes_alike():
    model = models.init_random(models.LlamaConfig.tiny(), seed=3)
    other = models.init_random(models.LlamaConfig.tiny(), seed=4, scan_layers=False)  # not the same weights
    out = hf_generate.unrolled(model)
    assert not out.scan_layers and len(out.layers) == model.config.num_layers
    for i, block in enumerate(out.layers):
        want = jax.tree.leaves(model.layer(i))
        assert [a.shape for a in jax.tree.leaves(block)] == [a.shape for a in want]
        for got, expected in zip(jax.tree.leaves(block), want):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert not all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(other.layers[0]), jax.tree.leaves(model.layer(0))))
    np.testing.assert_array_equal(np.asarray(out.embed.embedding[...]), np.asarray(model.embed.embedding[...]))
    prompts = np.random.default_rng(0).integers(1, model.config.vocab_size, (2, 7)).tolist()
    assert models.generate(out, prompts, 5).tokens == models.generate(model, prompts, 5).tokens
