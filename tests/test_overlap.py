"""Run-ahead decode (`models.scheduler`, "Overlap"): the scheduler dispatches decode step t+1
before reading step t back. Against the reference (`Scheduler.RUN_AHEAD = False`: every step
read back before the next is planned), on the same prompts: the same tokens and the same
logits, greedy and sampled, with stop tokens read a step late, under preemption (recompute and
swap to the host tier), and the host's page count equal to the device's after every iteration
(`Scheduler._check_pages`). Logits are equal bit for bit where the schedule is the reference's
(no stop token); a stop read a step late delays the admission it allows by one step, which can
change which sequence is preempted and recomputed, and a recomputed sequence's K/V come from a
prefill instead of decode steps: equal up to float rounding (tokens equal). The shapes are
test_models.py's (no new compile).
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import arena_jax as aj
from arena_jax import models
from arena_jax.models.scheduler import Scheduler, Seq

BATCH, CHUNK, NEW = 4, 8, 24
PROMPT_LENS = (3, 17, 9, 25, 1, 12, 30, 5)


@pytest.fixture(scope="module")
def model():
    return models.init_random(models.LlamaConfig.tiny(), seed=0)


@pytest.fixture(scope="module")
def layouts(model):
    def layout(pages):
        return model.config.kv_layout(page_size=16, num_pages=pages, max_seqs=BATCH, max_seq_len=64, dtype="float32")

    return {"tight": layout(6)}  # 4 rows of up to 48 tokens would need 12 pages


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 128, n).tolist() for n in PROMPT_LENS]


def _both(monkeypatch, model, layout, prompts, exact=True, **kwargs):
    monkeypatch.setattr(Scheduler, "CHECK_ACCOUNTING", True)
    out = {}
    for ahead in (False, True):
        monkeypatch.setattr(Scheduler, "RUN_AHEAD", ahead)
        out[ahead] = models.generate(model, prompts, NEW, batch_size=BATCH, chunk_size=CHUNK, layout=layout,
                                     return_logits=True, **kwargs)  # fmt: skip
    ref, fast = out[False], out[True]
    assert ref.run_ahead_steps == 0 and fast.run_ahead_steps > 0  # the fast path ran
    assert fast.tokens == ref.tokens
    for a, b in zip(fast.logits, ref.logits):
        if exact:
            np.testing.assert_array_equal(a, b)
        else:  # float32 rounding of K/V recomputed by a prefill (module docstring)
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    held = fast.prefix_cache.num_pages if fast.prefix_cache is not None else 0  # pages the prefix index holds
    assert aj.health(fast.cache)["free_pages"] + held == layout.num_pages  # the extra tokens' pages came back
    return ref, fast


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_run_ahead_equals_the_reference_with_stops(monkeypatch, model, layouts, prompts, temperature):
    """Stop tokens that end rows mid-run while others wait, too few pages; greedy and seeded sampling."""
    plain = models.generate(model, prompts, NEW, batch_size=BATCH, chunk_size=CHUNK, layout=layouts["tight"],
                            stop_tokens=(), temperature=temperature, seed=11)  # fmt: skip
    stop = sorted({t[4] for t in plain.tokens[:3]})  # tokens drawn early: several rows stop at them
    ref, fast = _both(monkeypatch, model, layouts["tight"], prompts, exact=False, stop_tokens=stop,
                      temperature=temperature, seed=11)  # fmt: skip
    assert any(len(t) < NEW for t in ref.tokens)  # some rows did stop


@pytest.mark.parametrize("stops", [False, True])
def test_run_ahead_with_a_prefix_cache_equals_the_reference(monkeypatch, model, layouts, prompts, stops):
    """With a prefix index (pages indexed as they fill, evictions, hits): steps run ahead while
    neither maps a page, and tokens equal the reference's; too few pages, with and without stop
    tokens (a row indexed at its stop, its run-ahead token written past the indexed ones)."""
    shared = list(range(40, 60))  # 20 tokens: a full page and part of the next, in every prompt
    with_prefix = [shared + p for p in prompts]
    layout = model.config.kv_layout(page_size=16, num_pages=10, max_seqs=BATCH, max_seq_len=80, dtype="float32")
    stop = ()
    if stops:
        plain = models.generate(model, with_prefix, NEW, batch_size=BATCH, chunk_size=CHUNK, layout=layout,
                                stop_tokens=(), prefix_cache=True)  # fmt: skip
        stop = sorted({t[4] for t in plain.tokens[:3]})
    ref, fast = _both(monkeypatch, model, layout, with_prefix, exact=False, stop_tokens=stop, prefix_cache=True)
    assert ref.prefix_hit_tokens > 0 and fast.prefix_hit_tokens > 0
    assert not stops or any(len(t) < NEW for t in ref.tokens)


def test_run_ahead_equals_the_reference_under_preemption(monkeypatch, model, layouts, prompts):
    """No stop tokens, too few pages: recompute preemption; then the same with a host tier (swap)."""
    ref, fast = _both(monkeypatch, model, layouts["tight"], prompts, stop_tokens=())
    assert ref.preemptions > 0 and fast.preemptions == ref.preemptions
    assert fast.scheduler_steps == ref.scheduler_steps and fast.decode_calls == ref.decode_calls  # same schedule
    ref, fast = _both(monkeypatch, model, layouts["tight"], prompts, stop_tokens=(), host_pages=16)
    assert ref.swap_outs > 0 and fast.swap_outs == ref.swap_outs


def test_each_step_compiles_once_whatever_commits_its_inputs(model):
    """A fresh `aj.create` cache is uncommitted and a step's outputs are committed; run-ahead feeds
    a step's sampled tokens back where the host feeds its own. Each lowered the same step again,
    same shapes (the HLO differed only in sharding annotations): two compiles. The Scheduler
    commits the cache and places the host's tokens as a step's come back: one program of each
    (the jitted steps' executables, counted), for a Scheduler given a fresh cache and for a
    generate continuing its cache."""
    layout = aj.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=13, max_seqs=2,
                         max_pages_per_seq=6, dtype="float32")  # fmt: skip (13 pages: a shape no other test compiles)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    steps = models.steps.bound_steps(*nnx.split(model))
    assert hasattr(steps.prefill, "_cache_size"), "jax.jit's executables count (a private attribute) is gone"
    before = steps.prefill._cache_size(), steps.decode_step._cache_size()
    run = Scheduler(model, aj.create(layout), layout, 2, 4, models.GREEDY, 0, set(), 6, False, decode_block=1)
    seqs = [Seq(i, p) for i, p in enumerate(prompts)]
    run.run(seqs)
    again = models.generate(model, prompts, 6, cache=run.cache, batch_size=2, chunk_size=4, decode_block=1, stop_tokens=())
    after = steps.prefill._cache_size(), steps.decode_step._cache_size()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1), (before, after)
    assert [s.generated for s in seqs] == again.tokens and run.run_ahead_steps > 0


def test_generate_compiles_once_for_a_length_bucket(model):
    """generate's own arena is sized for a power-of-two bucket of the longest prompt + max_new_tokens
    (`models.length_bucket`): other prompt lengths, fewer prompts and another max_new_tokens in
    the same bucket compile nothing (counted from JAX's compile events), and give the tokens of a
    run on an arena of exactly that bucket's layout."""
    from arena_jax.benchmarks.compile_count import CompileCount

    assert [models.length_bucket(n) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, 128]
    # Batch 1, the 32 bucket: test_prefix_progress.py's default arena (2 pages of 16), compiled once per session.
    rng = np.random.default_rng(7)
    first = [rng.integers(0, 128, n).tolist() for n in (20, 9)]
    models.generate(model, first, 4, batch_size=1, stop_tokens=())  # 24 tokens: the 32 bucket (decode blocks)
    again = [rng.integers(0, 128, n).tolist() for n in (3, 17, 11)]
    with CompileCount() as count:
        before = dict(models.TRACE_COUNTS)
        got = models.generate(model, again, 11, batch_size=1, stop_tokens=(), return_logits=True)  # 28 tokens: one-step blocks
        blocks = models.generate(model, again, 11, batch_size=1, stop_tokens=())
    assert count.programs == 0 and dict(models.TRACE_COUNTS) == before
    assert blocks.tokens == got.tokens and blocks.decode_steps == got.decode_steps > blocks.decode_calls
    layout = models.default_layout(model, 1, 32, dtype="float32")
    want = models.generate(model, again, 11, batch_size=1, stop_tokens=(), layout=layout, return_logits=True)
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits):
        np.testing.assert_array_equal(a, b)
    with CompileCount() as count:  # the counter does see a compile
        jax.jit(lambda x: x * 3 + 1)(np.arange(5))
    assert count.programs == 1


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_decode_blocks_equal_one_step_calls(monkeypatch, model, layouts, prompts, temperature):
    """Decode blocks (`models.scheduler`, "Decode blocks": up to 8 decode steps per call) give
    the tokens of one step per call, greedy and seeded sampling: stop tokens inside a block,
    rows reaching max_new_tokens inside one, too few pages (blocks fall back to one step;
    preemption), run-ahead on and off. The host's page count equals the
    device's after every iteration (a block's steps counted while in flight) and every page
    comes back."""
    monkeypatch.setattr(Scheduler, "CHECK_ACCOUNTING", True)
    tight = layouts["tight"]
    # pages of 4 (a block of 8 crosses two), 16 of them: the last rows run out of pages inside blocks
    small = model.config.kv_layout(page_size=4, num_pages=16, max_seqs=BATCH, max_seq_len=64, dtype="float32")
    common = dict(batch_size=BATCH, chunk_size=CHUNK, temperature=temperature, seed=11)
    # The reference: one step per call (returning logits makes every call one step of the same
    # program; test_decode_block_steps_equal_decode_step_calls checks it against decode_step)
    plain = models.generate(model, prompts, NEW, layout=tight, stop_tokens=(), return_logits=True, **common)
    stop = sorted({t[6] for t in plain.tokens[-3:]})  # tokens drawn in the last rows' blocks
    for layout, stops in ((tight, stop), (tight, ()), (small, ())):
        ref = models.generate(model, prompts, NEW, layout=layout, stop_tokens=stops, return_logits=True, **common)
        assert ref.decode_steps == ref.decode_calls
        assert not stops or any(len(t) < NEW for t in ref.tokens) and any(len(t) == NEW for t in ref.tokens)
        assert stops or ref.preemptions > 0
        for ahead in (False, True):
            monkeypatch.setattr(Scheduler, "RUN_AHEAD", ahead)
            got = models.generate(model, prompts, NEW, layout=layout, stop_tokens=stops, decode_block=8, **common)
            assert got.tokens == ref.tokens and got.preemptions == ref.preemptions
            assert got.decode_steps > got.decode_calls  # some calls ran several steps
            # Blocks run only where their pages fit, and past no row's end but a stop read back late
            assert int(got.cache.stats.failed_reservations) == int(ref.cache.stats.failed_reservations)
            assert got.discarded_tokens > 0 if stops else got.discarded_tokens == 0
            assert stops or got.decode_steps == ref.decode_steps  # no step ran for nothing (a refused block's rows)
            assert (got.run_ahead_steps > 0) == ahead
            assert aj.health(got.cache)["free_pages"] == layout.num_pages


def test_decode_block_steps_equal_decode_step_calls(model, layouts):
    """`BoundSteps.decode_block` against as many `decode_step` calls, on fresh random prompts
    (the shapes generate compiled above): rows running 5 / 3 / 0 steps and a PAD row, the
    sampled tokens bit for bit (greedy and seeded sampling) and every cache array equal; and a
    row refused pages mid-block runs nothing after, while the others run on."""
    from flax import nnx

    from arena_jax.models.steps import bound_steps

    steps = bound_steps(*nnx.split(model))
    rng = np.random.default_rng()
    layout, length = layouts["tight"], 5  # 6 pages of 16
    slots = np.array([0, 1, aj.PAD_SLOT, 3], np.int32)
    counts = np.array([5, 3, 4, 0], np.int32)
    lens = np.array([5, 2, 0, 7], np.int32)
    for temperature in (0.0, 0.9):
        sampling = models.sampling.Sampling(temperature=temperature).rows(BATCH)
        seed = jax.numpy.asarray(rng.integers(0, 2**31), jax.numpy.int32)
        prompts = rng.integers(0, model.config.vocab_size, (BATCH, CHUNK)).astype(np.int32)
        empty = aj.create(layout)  # one arena id for both runs

        def start():
            cache = jax.tree.map(jax.numpy.copy, empty)
            out, _ = steps.prefill(steps.leaves, cache, prompts, slots, lens, slots, seed, sampling)
            return out.cache, out.tokens

        cache, tokens = start()
        want = []
        for j in range(length):
            live = np.where(counts > j, slots, aj.PAD_SLOT).astype(np.int32)
            out, packed = steps.decode_step(steps.leaves, cache, tokens, live, slots, seed, sampling)
            cache, tokens = out.cache, jax.numpy.where(live >= 0, out.tokens, tokens)
            want.append(np.asarray(packed))
        caches = [np.asarray(x) for x in jax.tree.leaves(cache)]
        cache, tokens = start()
        out, packed = steps.decode_block(steps.leaves, cache, tokens, slots, counts, slots, seed, sampling, length=length)
        packed = np.asarray(packed)
        for j in range(length):
            ran = (counts > j) & (slots >= 0)
            np.testing.assert_array_equal(packed[j][:, ran], want[j][:, ran])
            assert packed[j][1].all()
        for a, b in zip(caches, jax.tree.leaves(out.cache)):
            np.testing.assert_array_equal(a, np.asarray(b))
    # Rows of 46 and 40 tokens hold all 6 pages (3 each). Row 0's 3rd step needs a 4th page: it
    # is refused there and runs nothing after; row 1 runs its 5 steps inside its pages.
    two = np.array([0, 1, aj.PAD_SLOT, aj.PAD_SLOT], np.int32)
    cache = aj.create(layout)
    for fed in range(0, 46, CHUNK):
        num = np.array([min(CHUNK, 46 - fed), min(CHUNK, max(0, 40 - fed)), 0, 0], np.int32)
        out, _ = steps.prefill(steps.leaves, cache, prompts, two, num, two, seed, sampling)
        cache = out.cache
    assert aj.health(cache)["free_pages"] == 0
    out, packed = steps.decode_block(steps.leaves, cache, out.tokens, two, np.full(BATCH, length, np.int32), two, seed,
                                     sampling, length=length)  # fmt: skip
    ok = np.asarray(packed)[:, 1, :2]  # [step, row]
    assert ok[:, 1].all() and ok[:2, 0].all() and ok[2, 0] == 0
    assert np.asarray(out.ok)[:2].tolist() == [False, True]
    assert np.asarray(out.cache.table.lengths)[:2].tolist() == [48, 45]  # nothing reserved past the refusal


def test_default_chunk_size_by_workload(model, monkeypatch):
    """Up to 128 prompt tokens a row per prefill call offline, no wider than the longest prompt
    rounded up to a power of two (at least 32: a chunk is computed whole), 32 with arrivals (a
    prompt arriving mid-run stalls the running rows for a call) or mixed steps; a chunk given
    is kept; the same tokens every way."""
    assert models.default_chunk_size() == 128 and models.default_chunk_size(online=True) == 32
    assert models.default_chunk_size(mixed_steps=True, longest_prompt=500) == 32
    assert [models.default_chunk_size(longest_prompt=n) for n in (1, 32, 33, 64, 65, 128, 129, 4096)] == [
        32, 32, 64, 64, 128, 128, 128, 128]
    assert models.Serving().chunk_size is None
    widths = []  # the chunk each generate call's scheduler runs
    scheduler_init = Scheduler.__init__

    def spy(self, model, cache, layout, batch_size, chunk_size, *args):
        widths.append(chunk_size)
        scheduler_init(self, model, cache, layout, batch_size, chunk_size, *args)

    monkeypatch.setattr(Scheduler, "__init__", spy)
    prompts = np.random.default_rng(5).integers(0, 128, (2, 100)).tolist()
    offline = models.generate(model, prompts, 4, batch_size=2)
    assert offline.prefill_calls == 1 and widths[-1] == 128  # 100 tokens: one chunk (the 128 bucket)
    chunked = models.generate(model, prompts, 4, batch_size=2, chunk_size=32)
    assert chunked.prefill_calls == 4 and widths[-1] == 32 and chunked.tokens == offline.tokens
    online = models.generate(model, prompts, 4, batch_size=2, arrivals=[0.0, 0.0])
    assert online.prefill_calls == 4 and widths[-1] == 32 and online.tokens == offline.tokens
    mixed = models.generate(model, prompts, 4, batch_size=2, mixed_steps=True)  # budget: 2 rows + one chunk of 32
    assert mixed.mixed_calls == 8 and widths[-1] == 32 and mixed.tokens == offline.tokens  # 2 x 4 chunks, one a step
    short = models.generate(model, [p[:40] for p in prompts], 60, batch_size=2)  # the 128 bucket, 40-token prompts
    assert short.prefill_calls == 1 and widths[-1] == 64
    assert short.tokens == models.generate(model, [p[:40] for p in prompts], 60, batch_size=2, chunk_size=128).tokens


def test_default_decode_block_by_workload_and_platform(model):
    """8 offline on this CPU; 1 for an online workload (tokens read back as sampled) and for a
    cache on a TPU (XLA's TPU compile of the block program: RESULTS, "Decode blocks"); the
    argument is checked like every count."""
    import types

    cache = aj.create(model.config.kv_layout(page_size=16, num_pages=2, max_seqs=1, max_seq_len=32, dtype="float32"))
    assert models.default_decode_block(cache) == 8 and models.default_decode_block(cache, online=True) == 1
    on_tpu = types.SimpleNamespace(k=types.SimpleNamespace(devices=lambda: [types.SimpleNamespace(platform="tpu")]))
    assert models.default_decode_block(on_tpu) == 1
    for bad in (0, 1025, 2.0, True):
        with pytest.raises(ValueError, match="decode_block"):
            models.generate(model, [[1, 2, 3]], 5, batch_size=1, decode_block=bad)
