"""The checkpoint with text the tests use (tests/test_text.py, tests/test_server.py) and on which
tests/test_docs.py runs the documentation's blocks ("path/to/checkpoint"):
`arena_jax.benchmarks.demo_checkpoint`, which the HTTP benchmark serves too."""
from arena_jax.benchmarks.demo_checkpoint import (  # noqa: F401
    ADDED_EOS, CHAT_TEMPLATE, CORPUS, SPECIALS, bpe_tokenizer, write_checkpoint, write_tokenizer)
