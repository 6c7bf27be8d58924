"""Issue 40, item 3 (the streaming form): `generate(..., on_token=)` is called in the
continuous-batching loop for each token as the host keeps it: per prompt, in order, exactly the
result's tokens (a stop token included, none that a decode block or a run-ahead step computed
past a stop), and before the run goes on."""
from __future__ import annotations

import pytest

from arena_jax import models

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]


@pytest.fixture(scope="module")
def model():
    return models.init_random(models.LlamaConfig.tiny(), seed=0)


@pytest.mark.parametrize("decode_block", [1, 8], ids=["one step a call", "decode blocks"])
def test_streamed_tokens_are_the_results_tokens(model, decode_block):
    plain = models.generate(model, PROMPTS, 12, batch_size=2, chunk_size=4, stop_tokens=(), decode_block=decode_block)
    stop = plain.tokens[0][3]  # prompt 0 stops at its 4th token (and any prompt at that token)
    seen = []
    got = models.generate(model, PROMPTS, 12, batch_size=2, chunk_size=4, stop_tokens=(stop,), decode_block=decode_block,
                          on_token=lambda i, token: seen.append((i, token)))  # fmt: skip
    assert [[t for j, t in seen if j == i] for i in range(len(PROMPTS))] == got.tokens
    assert got.tokens[0] == plain.tokens[0][:4] and all(isinstance(t, int) for _, t in seen)
    # tokens a block or a run-ahead step computed past a stop: never streamed
    assert got.discarded_tokens > 0 and (decode_block > 1 or got.run_ahead_steps > 0)


def test_the_callback_runs_inside_the_loop(model):
    """An exception from the callback at a prompt's first token ends the run there (it was
    called before the rest was generated) and reaches the caller as it was."""

    class Enough(Exception):
        pass

    calls = []

    def first_only(i, token):
        calls.append((i, token))
        raise Enough(i)

    with pytest.raises(Enough):
        models.generate(model, PROMPTS, 12, batch_size=2, chunk_size=4, stop_tokens=(), on_token=first_only)
    assert len(calls) == 1


def test_a_callback_that_is_not_callable_is_refused(model):
    with pytest.raises(ValueError, match="on_token must be a callable \\(prompt index, token id\\), got list"):
        models.generate(model, PROMPTS, 4, on_token=[])
