"""Mixed steps (`models.steps.mixed_step`, `generate(mixed_steps=True)`): decode rows and prompt
chunks in one jitted call, and online arrivals (`generate(arrivals=...)`).

Against the separate steps on the same prompts: the same tokens (greedy and seeded sampling)
and logits equal up to float rounding (the mixed step's dense layers run the tokens packed
flat, a differently shaped product), under preemption, with a prefix cache and with a host
tier, the host's page count equal to the device's after every iteration. The step itself
against `prefill` + `decode_step` on ragged rows, a refused row, and through the Pallas kernels
(interpret mode) against the reference. The shapes are test_overlap.py's where they can be.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import arena_jax as aj
from arena_jax import models
from arena_jax.models.scheduler import Scheduler

BATCH, CHUNK, NEW = 4, 8, 24
PROMPT_LENS = (3, 17, 9, 25, 1, 12, 30, 5)
ATOL = 1e-5  # float32 logits: packed vs per-row products


@pytest.fixture(scope="module")
def model():
    return models.init_random(models.LlamaConfig.tiny(), seed=0)


@pytest.fixture(scope="module")
def tight(model):
    return model.config.kv_layout(page_size=16, num_pages=6, max_seqs=BATCH, max_seq_len=64, dtype="float32")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 128, n).tolist() for n in PROMPT_LENS]


def _compare(monkeypatch, model, prompts, token_budget=None, **kwargs):
    monkeypatch.setattr(Scheduler, "CHECK_ACCOUNTING", True)
    kwargs = dict(batch_size=BATCH, chunk_size=CHUNK, return_logits=True, **kwargs)
    ref = models.generate(model, prompts, NEW, **kwargs)
    mixed = models.generate(model, prompts, NEW, mixed_steps=True, token_budget=token_budget, **kwargs)
    assert mixed.mixed_calls > 0 and mixed.prefill_calls == 0 and ref.mixed_calls == 0
    assert mixed.tokens == ref.tokens
    for a, b in zip(mixed.logits, ref.logits):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)
    return ref, mixed


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_mixed_steps_equal_separate_steps_under_preemption(monkeypatch, model, tight, prompts, temperature):
    """Too few pages (preemption, recompute), no stop tokens, greedy and seeded sampling."""
    ref, mixed = _compare(monkeypatch, model, prompts, layout=tight, stop_tokens=(), temperature=temperature, seed=5)
    assert ref.preemptions > 0 and mixed.preemptions > 0
    assert aj.health(mixed.cache)["free_pages"] == tight.num_pages


def test_a_larger_token_budget_feeds_more_chunks_per_step(monkeypatch, model, tight, prompts):
    """token_budget = batch + 2 chunks: fewer mixed steps, the same tokens; a host tier (swap)."""
    one = models.generate(model, prompts, NEW, batch_size=BATCH, chunk_size=CHUNK, layout=tight, stop_tokens=(),
                          mixed_steps=True)  # fmt: skip
    ref, two = _compare(monkeypatch, model, prompts, layout=tight, stop_tokens=(), host_pages=16,
                        token_budget=BATCH + 2 * CHUNK)  # fmt: skip
    assert two.tokens == one.tokens and two.swap_outs > 0
    assert two.mixed_calls < one.mixed_calls


def test_mixed_steps_with_a_prefix_cache(monkeypatch, model, prompts):
    """Shared system prompt: hits, holds and evictions go through the mixed step's rows too."""
    system = prompts[6][:12]
    shared = [system + p for p in prompts[:6]]
    layout = model.config.kv_layout(page_size=16, num_pages=10, max_seqs=BATCH, max_seq_len=64, dtype="float32")
    ref, mixed = _compare(monkeypatch, model, shared, layout=layout, stop_tokens=(), prefix_cache=True)
    assert mixed.prefix_hit_tokens > 0 and mixed.prefix_hit_tokens == ref.prefix_hit_tokens


def _copy(cache):
    return jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, cache)


def _ragged_case(model, layout):
    """A cache whose slots 0, 1 hold a prompt (they decode next) and 2 holds part of one (its
    chunk comes next); returns (cache, next tokens i32[4], chunk tokens and count of slot 2)."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    tokens = np.zeros((4, 8), np.int32)
    counts = np.array([5, 7, 2, 0], np.int32)
    for r, n in enumerate(counts):
        tokens[r, :n] = rng.integers(0, 128, n)
    out = models.prefill(graphdef, state, aj.create(layout), jnp.asarray(tokens), jnp.arange(4, dtype=jnp.int32),
                         jnp.asarray(counts))  # fmt: skip
    chunk = rng.integers(0, 128, 8).astype(np.int32)
    return out.cache, np.asarray(out.tokens), chunk


def test_mixed_step_equals_prefill_plus_decode(monkeypatch):
    """Rows 0, 1 decode, row 2 brings a 6-token chunk, row 3 is empty, one chunk entry unused;
    the Pallas kernels (interpret mode) take both parts. Logits, tokens, lengths and K/V pages
    equal those of a `decode_step` then a `prefill` of the same rows. (The jnp paths: the
    generate-level tests above, mixed against separate steps.)"""
    monkeypatch.setenv(aj.BACKEND_ENV, "pallas")
    jax.clear_caches()  # the steps read the backend when traced
    model = models.init_random(models.LlamaConfig.tiny(num_layers=1), seed=2, std=0.2)
    graphdef, state = nnx.split(model)
    layout = model.config.kv_layout(page_size=4, num_pages=16, max_seqs=4, max_seq_len=16, dtype="float32")
    cache, nxt, chunk = _ragged_case(model, layout)
    slots = np.array([0, 1, aj.PAD_SLOT, aj.PAD_SLOT], np.int32)
    dec = models.decode_step(graphdef, state, _copy(cache), jnp.asarray(nxt), jnp.asarray(slots))
    wide = np.zeros((4, 8), np.int32)
    wide[2, :6] = chunk[:6]
    pre = models.prefill(graphdef, state, dec.cache, jnp.asarray(wide), jnp.asarray([-1, -1, 2, -1], jnp.int32),
                         jnp.asarray([0, 0, 6, 0], jnp.int32))  # fmt: skip
    chunks = np.zeros((2, 8), np.int32)
    chunks[1, :6] = chunk[:6]
    mixed = models.mixed_step(graphdef, state, cache, jnp.asarray(nxt), jnp.asarray(slots), jnp.asarray(chunks),
                              jnp.asarray([aj.PAD_SLOT, 2], jnp.int32), jnp.asarray([0, 6], jnp.int32),
                              jnp.asarray([-1, 2], jnp.int32))  # fmt: skip
    assert np.asarray(mixed.ok).all()
    want = np.array(dec.logits)
    want[2] = np.asarray(pre.logits)[2]
    np.testing.assert_allclose(np.asarray(mixed.logits)[:3], want[:3], rtol=0, atol=ATOL)
    assert np.asarray(mixed.tokens)[:3].tolist() == [*np.asarray(dec.tokens)[:2].tolist(), int(pre.tokens[2])]
    assert np.asarray(mixed.cache.table.lengths).tolist() == np.asarray(pre.cache.table.lengths).tolist() == [6, 8, 8, 0]
    for name in ("k", "v"):
        np.testing.assert_allclose(getattr(mixed.cache, name), getattr(pre.cache, name), rtol=0, atol=1e-6)


def test_a_refused_chunk_leaves_its_slot_and_the_others_intact():
    """A chunk that does not fit the free pages is refused (ok False, its slot unchanged) while
    the decode rows of the same step are served."""
    model = models.init_random(models.LlamaConfig.tiny(num_layers=1), seed=2, std=0.2)
    graphdef, state = nnx.split(model)
    layout = model.config.kv_layout(page_size=4, num_pages=6, max_seqs=4, max_seq_len=16, dtype="float32")
    cache, nxt, chunk = _ragged_case(model, layout)  # 2 + 2 + 1 pages of 6 in use
    before = np.asarray(cache.table.page_map)[2].copy()
    mixed = models.mixed_step(graphdef, state, cache, jnp.asarray(nxt), jnp.asarray([0, 1, -1, -1], jnp.int32),
                              jnp.asarray(chunk[None]), jnp.asarray([2], jnp.int32), jnp.asarray([8], jnp.int32),
                              jnp.asarray([2], jnp.int32))  # fmt: skip
    assert np.asarray(mixed.ok).tolist() == [True, True, False, True]
    assert np.asarray(mixed.cache.table.lengths).tolist() == [6, 8, 2, 0]
    assert (np.asarray(mixed.cache.table.page_map)[2] == before).all()
    assert aj.health(mixed.cache)["free_pages"] == 1  # the refused chunk (2 more pages) took none of them
    # A slot given twice (decoding and bringing a chunk): its chunk is refused, the rest served.
    twice = models.mixed_step(graphdef, state, mixed.cache, jnp.asarray(nxt), jnp.asarray([0, 1, -1, -1], jnp.int32),
                              jnp.asarray(chunk[None]), jnp.asarray([1], jnp.int32), jnp.asarray([2], jnp.int32),
                              jnp.asarray([3], jnp.int32))  # fmt: skip
    assert np.asarray(twice.ok).tolist() == [True, True, True, False]
    assert np.asarray(twice.cache.table.lengths).tolist() == [7, 9, 2, 0]
    assert aj.health(twice.cache)["free_pages"] == 0  # slot 1's 9th token took the last page


def test_rows_a_step_cannot_run_are_refused_and_reserve_nothing():
    """A row with more tokens than the chunk's width T, or a real token outside the vocabulary,
    used to reserve pages nothing wrote (or run a clipped token) and sample from no input: in
    `prefill` and `mixed_step` (jitted, nothing can raise) it is refused, ok False, its slot
    unchanged and the row counted in stats.rejected_rows. Tokens past a row's count are padding."""
    model = models.init_random(models.LlamaConfig.tiny(num_layers=1), seed=2, std=0.2)
    graphdef, state = nnx.split(model)
    layout = model.config.kv_layout(page_size=4, num_pages=16, max_seqs=4, max_seq_len=16, dtype="float32")
    cache, nxt, chunk = _ragged_case(model, layout)  # lengths [5, 7, 2, 0]
    rejected, free = int(cache.stats.rejected_rows), aj.health(cache)["free_pages"]
    tokens = np.zeros((4, 8), np.int32)
    tokens[1, 1] = 128  # row 1: a real token outside [0, vocab_size=128)
    tokens[2, 3:] = [500, -7, 128, 128, 128]  # row 2: 3 real tokens, then padding out of range
    slots = jnp.asarray([0, 1, 3, aj.PAD_SLOT], jnp.int32)
    counts = jnp.asarray([9, 2, 3, 0], jnp.int32)  # row 0: 9 tokens in a chunk of 8
    out = models.prefill(graphdef, state, _copy(cache), jnp.asarray(tokens), slots, counts)
    assert np.asarray(out.ok).tolist() == [False, False, True, True]
    assert np.asarray(out.cache.table.lengths).tolist() == [5, 7, 2, 3]
    assert int(out.cache.stats.rejected_rows) == rejected + 2 and aj.health(out.cache)["free_pages"] == free - 1
    bad = nxt.copy()
    bad[1] = 128
    mixed = models.mixed_step(graphdef, state, cache, jnp.asarray(bad), jnp.asarray([0, 1, -1, -1], jnp.int32),
                              jnp.asarray(chunk[None]), jnp.asarray([2], jnp.int32), jnp.asarray([9], jnp.int32),
                              jnp.asarray([2], jnp.int32))  # fmt: skip
    assert np.asarray(mixed.ok).tolist() == [True, False, False, True]
    assert np.asarray(mixed.cache.table.lengths).tolist() == [6, 7, 2, 0]
    assert int(mixed.cache.stats.rejected_rows) == rejected + 2 and aj.health(mixed.cache)["free_pages"] == free


def test_mixed_step_names_chunks_of_the_wrong_shape():
    """1-D chunks were an IndexError inside models/steps.py."""
    model = models.init_random(models.LlamaConfig.tiny(num_layers=1), seed=2, std=0.2)
    graphdef, state = nnx.split(model)
    cache = aj.create(model.config.kv_layout(page_size=4, num_pages=16, max_seqs=4, max_seq_len=16, dtype="float32"))
    rows = jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match=r"chunks must be i32\[P, T\] \(P prompt chunks of T tokens\), got shape \[8\]"):
        models.mixed_step(graphdef, state, cache, rows, rows - 1, jnp.zeros((8,), jnp.int32), rows[:1], rows[:1], rows[:1])
    with pytest.raises(ValueError, match=r"chunk_counts must be i32\[P\] with P = 1 \(the rows of chunks .*got shape \[2\]"):
        models.mixed_step(graphdef, state, cache, rows, rows - 1, jnp.zeros((1, 8), jnp.int32), rows[:1], rows[:2], rows[:1])


def test_arrivals_admit_in_time_and_keep_the_tokens(model, tight, prompts):
    """Each prompt's first token comes after its arrival; tokens equal an all-at-once run."""
    kwargs = dict(batch_size=BATCH, chunk_size=CHUNK, stop_tokens=(), layout=tight)
    ref = models.generate(model, prompts[:4], 6, **kwargs)
    arrivals = [0.0, 0.05, 0.05, 0.3]
    for mixed in (False, True):
        got = models.generate(model, prompts[:4], 6, arrivals=arrivals, mixed_steps=mixed, **kwargs)
        assert got.tokens == ref.tokens
        for times, arrival in zip(got.token_seconds, arrivals):
            assert len(times) == 6 and times[0] >= arrival and times == sorted(times)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(token_budget=40), "token_budget is the mixed steps' size"),
        (dict(mixed_steps=True, token_budget=BATCH + CHUNK - 1), r"token_budget=11 must hold .* at least 12"),
        (dict(mixed_steps=1), "mixed_steps must be a bool"),
        (dict(arrivals=[0.0]), "arrivals has 1 entries for 2 prompts"),
        (dict(arrivals=[0.5, 0.1]), r"arrivals\[1\]=0.1 is before arrivals\[0\]=0.5"),
        (dict(arrivals=[0.0, float("nan")]), r"arrivals\[1\]=nan must be a finite number"),
        (dict(arrivals=[-1.0, 0.0]), r"arrivals\[0\]=-1.0 must be"),
    ],
)
def test_bad_mixed_and_arrival_arguments_are_named(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        models.generate(model, [[1, 2], [3]], 2, batch_size=BATCH, chunk_size=CHUNK, **kwargs)
