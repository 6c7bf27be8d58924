"""examples/tiny_decoder.py: the same user-written decoder gives the same greedy tokens with its own
dense cache and with the paged arena (soft-capped logits, local and global layers, GQA), and its
paged loop's cache code stays short."""
from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
from flax import nnx

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import tiny_decoder  # noqa: E402


@pytest.mark.parametrize("page_size", [4])  # 4-token pages: every sequence crosses several
def test_paged_tokens_equal_the_dense_cache_tokens(page_size):
    cfg = tiny_decoder.Config()
    assert cfg.soft_cap and cfg.window < 9 + 12  # the options are exercised: capped logits, windows shorter than the text
    model = tiny_decoder.TinyDecoder(cfg, nnx.Rngs(0))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab, (3, 9))
    dense = tiny_decoder.generate_dense(model, cfg, prompts, 12)
    paged = tiny_decoder.generate_paged(model, cfg, prompts, 12, page_size=page_size)
    np.testing.assert_array_equal(paged, dense)
    assert len(set(dense.ravel().tolist())) > 3  # not a degenerate constant output


def test_the_integration_is_short():
    lines = (EXAMPLES / "tiny_decoder.py").read_text().splitlines()
    arena = [line for line in lines if "# arena" in line or "aj." in line or "kv.attend" in line]
    assert 5 <= len(arena) <= 40, arena
