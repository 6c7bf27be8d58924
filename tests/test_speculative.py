"""Speculative decoding (issue 43): the verify step keeps exactly the proposals greedy decoding
agrees with and rolls the rest back in the same call (pages and watermarks as if they never
came); `generate(speculative=PromptLookup(k))` gives plain decoding's greedy tokens across
families, arena dtypes, a prefix cache, a tight arena (preemption) and stop tokens inside an
accepted run, with the host's page count equal to the device's after every call; sampled
acceptance leaves each token distributed as the target model's."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from flax import nnx

import arena_jax as aj
from arena_jax import models
from arena_jax.models.sampling import SamplingParams
from arena_jax.models.scheduler import Scheduler
from arena_jax.models.speculative import verify_rows
from arena_jax.models.steps import bound_steps


def test_prompt_lookup_proposes_what_followed():
    look = models.PromptLookup(k=3, max_ngram=2)
    assert look.propose([1, 2, 3, 4, 1, 2], 10) == [3, 4, 1]  # "1 2" was followed by 3 4 1
    assert look.propose([5, 1, 2, 9, 7, 1, 2], 10) == [9, 7, 1]  # the most recent earlier "1 2"
    assert look.propose([1, 2, 8, 8, 8, 1, 2, 6, 1, 2], 10) == [6, 1, 2]  # the latest match with k tokens after it
    assert look.propose([1, 2, 8, 8, 8, 1, 2], 10) == [8, 8, 8]  # ... skipping none: here the only one
    assert look.propose([3, 3, 3, 3], 10) == [3, 3]  # none has k after it: the most recent
    assert look.propose([1, 2, 3, 4, 1, 2], 2) == [3, 4]  # at most `limit`
    assert look.propose([1, 2, 3], 5) == [] and look.propose([7], 5) == []
    assert look.propose([4, 9, 4], 5) == [9, 4]  # falls back to a 1-gram
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        models.PromptLookup(k=0)
    with pytest.raises(ValueError, match="min_ngram 3 > max_ngram 2"):
        models.PromptLookup(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="speculative must be a proposer"):
        models.generate(models.init_random(models.LlamaConfig.tiny(), seed=0), [[1, 2]], 2, speculative=4)


def test_verify_keeps_what_greedy_decoding_agrees_with():
    model = models.init_random(models.LlamaConfig.tiny(), seed=0)
    steps = bound_steps(*nnx.split(model))
    layout = models.default_layout(model, 3, 64, dtype="float32")
    slots, ids, seed, samp = jnp.arange(3, dtype=jnp.int32), jnp.arange(3, dtype=jnp.int32), jnp.int32(0), models.Sampling().rows(3)
    prompts = jnp.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0], [40, 41, 0, 0, 0, 0]], jnp.int32)
    lengths = jnp.array([6, 3, 2], jnp.int32)

    def prefilled():
        out, _ = steps.prefill(steps.leaves, aj.create(layout), prompts, slots, lengths, ids, seed, samp)
        return out

    out = prefilled()
    cache, token, plain = out.cache, out.tokens, [np.asarray(out.tokens)]
    for _ in range(5):
        out, _ = steps.decode_step(steps.leaves, cache, token, slots, ids, seed, samp)
        cache, token = out.cache, out.tokens
        plain.append(np.asarray(token))
    plain = np.stack(plain, 1)  # [3, 6]: greedy tokens
    out = prefilled()
    tokens = np.zeros((3, 5), np.int32)
    tokens[:, 0] = plain[:, 0]
    tokens[0, 1:5] = plain[0, 1:5]  # all four right: 4 accepted + the bonus
    tokens[1, 1:3], tokens[1, 3:5] = plain[1, 1:3], (plain[1, 3] + 1) % 128  # two right, then wrong
    tokens[2, 1] = (plain[2, 1] + 1) % 128  # wrong at once: the correction only
    counts = jnp.array([5, 5, 2], jnp.int32)
    got, packed = steps.verify(steps.leaves, out.cache, jnp.asarray(tokens), slots, counts, ids, seed, samp)
    packed = np.asarray(packed)
    assert packed[5, 0].tolist() == [5, 3, 1] and packed[5, 1].tolist() == [1, 1, 1]
    for r, n in enumerate((5, 3, 1)):
        assert packed[:n, 0, r].tolist() == plain[r, 1 : 1 + n].tolist()
    table = got.cache.table
    kept = np.asarray(lengths) + np.array([5, 3, 1])  # the prompt, t0 and the accepted proposals
    assert np.asarray(table.lengths)[:3].tolist() == kept.tolist()
    assert (np.asarray(table.written)[:, :3] == kept).all()  # every layer's watermark rolled back too
    health = aj.health(got.cache)
    assert health["pages_in_use"] == sum(layout.pages_for(int(n)) for n in kept)  # emptied pages freed


@pytest.mark.parametrize("family, kv_dtype, stops", [("llama", "float32", False), ("gemma2", "int8", True),
                                                     ("gemma3_text", "float32", False)])  # fmt: skip
def test_greedy_speculative_generate_is_plain_generate(monkeypatch, family, kv_dtype, stops):
    monkeypatch.setattr(Scheduler, "CHECK_ACCOUNTING", True)  # host and device page counts agree after each call
    model = models.init_random(models.LlamaConfig.tiny_family(family), seed=1)
    rng = np.random.default_rng(2)
    prompts = [[3, 4, 5, 6] * 6, rng.integers(0, 128, 17).tolist(), [9, 9, 9], rng.integers(0, 128, 40).tolist(),
               [7, 8] * 9]  # fmt: skip
    kw = dict(batch_size=2, stop_tokens=(), kv_dtype=kv_dtype)
    plain = models.generate(model, prompts, 30, **kw)
    if stops:  # a token the first prompt generates mid-run: a stop inside its (repetitive, accepted) run
        kw["stop_tokens"] = (plain.tokens[0][6],)
        plain = models.generate(model, prompts, 30, **kw)
        assert len(plain.tokens[0]) <= 7
    spec = models.generate(model, prompts, 30, speculative=models.PromptLookup(k=4), **kw)
    assert spec.tokens == plain.tokens
    assert spec.verify_calls > 0 and 0 < spec.accepted_tokens <= spec.proposed_tokens  # some were kept
    assert spec.verify_calls < plain.decode_steps  # fewer calls than tokens decoded one by one
    health = aj.health(spec.cache)  # the cache's own counters, counted in the verify step
    assert health["pages_in_use"] == 0
    assert (health["proposed_tokens"], health["accepted_tokens"]) == (spec.proposed_tokens, spec.accepted_tokens)
    assert health["acceptance_rate"] == spec.accepted_tokens / spec.proposed_tokens


def test_speculative_through_the_pallas_kernels(monkeypatch):
    """The verify call through the Pallas (Triton) kernels, in interpret mode here (the tests
    above run CPU's default, the blockwise "xla" path): plain decoding's greedy tokens on the
    same backend, proposals kept, and the kernels ran."""
    import importlib

    monkeypatch.setenv(aj.BACKEND_ENV, "pallas")
    jax.clear_caches()  # the jitted steps read the backend when traced: trace again
    calls = []
    attention = importlib.import_module("pallas_kernels.gpu.attention")
    original = attention.paged_attention
    monkeypatch.setattr(attention, "paged_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = models.init_random(models.LlamaConfig.tiny(num_layers=1, head_dim=32), seed=1)
    prompts, kw = [[3, 4, 5, 6] * 3, [7, 8] * 5], dict(batch_size=2, stop_tokens=(), chunk_size=8, decode_block=1)
    plain = models.generate(model, prompts, 8, **kw)
    spec = models.generate(model, prompts, 8, speculative=models.PromptLookup(k=3), **kw)
    assert spec.tokens == plain.tokens and spec.verify_calls > 0 and spec.accepted_tokens > 0 and calls
    jax.clear_caches()


class _Asked(models.PromptLookup):
    """Prompt lookup that records the prompts it was asked to propose for."""

    def __init__(self, k: int, prompts):
        super().__init__(k=k)
        object.__setattr__(self, "asked", set())
        object.__setattr__(self, "prompts", [tuple(p) for p in prompts])

    def propose(self, ids, limit):
        self.asked.update(i for i, p in enumerate(self.prompts) if tuple(ids[: len(p)]) == p)
        return super().propose(ids, limit)


def test_prompts_opt_out_of_speculation():
    """`speculate=[...]`: a prompt given False gets no proposals and decodes plainly, in the
    same verify calls as the others; all False runs plain decode steps (no verify call)."""
    model = models.init_random(models.LlamaConfig.tiny(), seed=1)
    prompts = [[3, 4, 5, 6] * 5, [7, 8, 9] * 6, [11, 12] * 18]
    kw = dict(batch_size=2, stop_tokens=(), kv_dtype="float32")  # (the shapes of the llama case above: its programs)
    plain = models.generate(model, prompts, 30, **kw)
    proposer = _Asked(3, prompts)
    spec = models.generate(model, prompts, 30, speculative=proposer, speculate=[True, False, True], **kw)
    assert spec.tokens == plain.tokens
    assert proposer.asked == {0, 2} and spec.verify_calls > 0 and spec.accepted_tokens > 0
    health = aj.health(spec.cache)
    assert (health["proposed_tokens"], health["accepted_tokens"]) == (spec.proposed_tokens, spec.accepted_tokens)
    proposer = _Asked(3, prompts)
    none = models.generate(model, prompts, 30, speculative=proposer, speculate=(False,) * 3, **kw)
    assert none.tokens == plain.tokens and none.verify_calls == 0 and not proposer.asked
    assert aj.health(none.cache)["proposed_tokens"] == 0
    for bad, match in [([True], "speculate has 1 entries for 3 prompts"), ([1, 0, 1], r"speculate\[0\]=1 must be a bool"),
                       ("yes", "speculate must be a sequence of bools")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            models.generate(model, prompts, 4, speculative=models.PromptLookup(), speculate=bad, **kw)
    with pytest.raises(ValueError, match="speculate: per-prompt opt-outs need a proposer"):
        models.generate(model, prompts, 4, speculate=[True] * 3, **kw)


@pytest.mark.parametrize("extra", [dict(prefix_cache=True), dict(host_pages=8)], ids=["prefix cache", "host tier"])
def test_speculative_in_a_tight_arena(monkeypatch, extra):
    """An arena so small that it preempts: with a prefix cache (hits on a shared system prompt,
    evictions), or with a host tier (a preempted row's pages swapped out to host memory and
    back instead of recomputed). Plain decoding's tokens, with proposals kept."""
    monkeypatch.setattr(Scheduler, "CHECK_ACCOUNTING", True)
    model = models.init_random(models.LlamaConfig.tiny(), seed=3)
    system = [5, 6, 7, 8, 9] * 4
    prompts = [system + [i, i + 1, i + 2] * 3 for i in range(6)]
    tight = models.LlamaConfig.tiny().kv_layout(page_size=16, num_pages=7, max_seqs=3, max_seq_len=64, dtype="float32")
    kw = dict(batch_size=3, stop_tokens=(), layout=tight, **extra)
    plain = models.generate(model, prompts, 24, **kw)
    spec = models.generate(model, prompts, 24, speculative=models.PromptLookup(k=3), **kw)
    assert spec.tokens == plain.tokens and spec.preemptions > 0 and spec.accepted_tokens > 0
    if "prefix_cache" in extra:
        assert spec.evictions > 0 and spec.prefix_hit_tokens > 0
    else:
        assert spec.swap_outs > 0 and aj.health(spec.cache)["pages_in_use"] == 0


def test_sampled_acceptance_keeps_the_target_distribution():
    """The first new token is distributed as the target's p0, whatever is proposed; after an
    accepted proposal the next one as p1 (a tiny vocabulary, 20,000 draws)."""
    vocab, draws = 4, 20000
    p0, p1 = np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.5, 0.25, 0.15, 0.1])
    logits = jnp.asarray(np.log(np.stack([p0, p1, p1]))[None], jnp.float32)  # [1, 3, V]
    tokens = jnp.array([[0, 2, 1]], jnp.int32)  # t0, then proposals 2 and 1
    params = SamplingParams(jnp.ones((1,)), jnp.zeros((1,), jnp.int32), jnp.ones((1,)))
    run = jax.jit(jax.vmap(lambda s: verify_rows(logits, tokens, jnp.array([3]), jnp.array([[10, 11, 12]]), params, s,
                                                 jnp.array([0]))))  # fmt: skip
    new, count = (np.asarray(x)[:, 0] for x in run(jnp.arange(draws)))
    first = np.bincount(new[:, 0], minlength=vocab) / draws
    np.testing.assert_allclose(first, p0, atol=0.015)
    accepted = new[:, 0] == 2
    assert abs(accepted.mean() - p0[2]) < 0.015 and (count[accepted] >= 2).all() and (count[~accepted] == 1).all()
    second = np.bincount(new[accepted, 1], minlength=vocab) / accepted.sum()
    np.testing.assert_allclose(second, p1, atol=0.03)


def test_a_draft_model_proposes_and_greedy_tokens_stay_plain(monkeypatch):
    """models.DraftModel (issue 43, item 2b): a draft in its own arena proposes greedily; the
    target's tokens are plain decoding's whatever it proposes. A draft that IS the target has
    every proposal kept; a one-layer draft (`first_layers`) some. Rows are reused by later
    prompts (batch 2, four prompts), and after every call each draft row holds exactly the
    tokens it says it holds: rollback by truncation leaks nothing."""
    monkeypatch.setattr(Scheduler, "CHECK_ACCOUNTING", True)
    # (the model, batch, arena dtype and length bucket of the llama case above: its programs are reused)
    model = models.init_random(models.LlamaConfig.tiny_family("llama"), seed=4)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 128, n).tolist() for n in (5, 40, 2, 11)]
    kw = dict(batch_size=2, stop_tokens=(), kv_dtype="float32")
    plain = models.generate(model, prompts, 20, **kw)
    same = models.DraftModel(model, k=4, max_len=64, chunk_size=8)
    held = []
    original = same.propose_rows

    def checked(requests):
        out = original(requests)
        lengths = np.asarray(same.cache.table.lengths)
        held.append([int(n) for n in lengths] == [len(f) for f in same.fed])
        return out

    monkeypatch.setattr(same, "propose_rows", checked)
    spec = models.generate(model, prompts, 20, speculative=same, **kw)
    assert spec.tokens == plain.tokens and all(held) and held
    assert spec.accepted_tokens == spec.proposed_tokens > 0  # the target agrees with itself
    assert spec.verify_calls * 2 < plain.decode_steps
    short = models.DraftModel(models.first_layers(model, 1), k=4, max_len=64, chunk_size=8)
    spec = models.generate(model, prompts, 20, speculative=short, **kw)
    assert spec.tokens == plain.tokens and spec.proposed_tokens > 0
    assert aj.health(spec.cache)["pages_in_use"] == 0 and aj.health(short.cache)["rejected_rows"] == 0
    # a sequence longer than the draft's rows gets no proposals: it decodes plainly
    tiny_rows = models.DraftModel(model, k=4, max_len=8)
    spec = models.generate(model, prompts[1:2], 6, speculative=tiny_rows, **kw)
    assert spec.tokens == [plain.tokens[1][:6]]
    assert spec.proposed_tokens == 0


def test_first_layers_and_draft_arguments():
    model = models.init_random(models.LlamaConfig.tiny(num_layers=3), seed=0)  # (nothing compiled here)
    draft = models.first_layers(model, 2)
    assert draft.config.num_layers == 2
    ours, theirs = (np.asarray(m.layers.attn.q[...]) for m in (draft, model))  # stacked [L, ...]
    np.testing.assert_array_equal(ours, theirs[:2])
    with pytest.raises(ValueError, match=r"num_layers must be an integer in \[1, 3\], got 4"):
        models.first_layers(model, 4)
    with pytest.raises(ValueError, match="k must be an integer >= 1, got 0"):
        models.DraftModel(model, k=0)
    with pytest.raises(ValueError, match="model must be a models.Llama"):
        models.DraftModel("draft")
    other = models.init_random(models.LlamaConfig.tiny(vocab_size=256), seed=0)
    with pytest.raises(ValueError, match="vocab_size 256 differs from the model's 128"):
        models.generate(model, [[1, 2]], 2, speculative=models.DraftModel(other))


class _Wrong:
    """A proposer the model almost always rejects: k random tokens (full rejection)."""

    k = 3

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def propose(self, ids, limit):
        return self.rng.integers(0, 128, max(0, min(self.k, limit))).tolist()


_DRAWN_MODEL = models.init_random(models.LlamaConfig.tiny(), seed=7)
_DRAWN_LAYOUTS = {  # roomy, and at the page limit: 2 rows of up to 12 + 12 tokens need 6 pages of 8, it has 4 (rows wait)
    "roomy": models.LlamaConfig.tiny().kv_layout(page_size=8, num_pages=8, max_seqs=2, max_seq_len=32, dtype="float32"),
    "tight": models.LlamaConfig.tiny().kv_layout(page_size=8, num_pages=4, max_seqs=2, max_seq_len=32, dtype="float32"),
}


@st.composite
def _spec_workloads(draw):
    span = draw(st.lists(st.integers(0, 127), min_size=1, max_size=4))
    prompts = [draw(st.one_of(st.lists(st.integers(0, 127), min_size=1, max_size=12),
                              st.just((span * 4)[: draw(st.integers(2, 12))])))  # repetitive: prompt lookup's case
               for _ in range(draw(st.integers(1, 3)))]  # fmt: skip
    return prompts, draw(st.sampled_from(["lookup", "draft (the model itself)", "wrong"])), draw(st.sampled_from(sorted(_DRAWN_LAYOUTS))), draw(st.booleans())


@pytest.mark.timeout(600)
@settings(max_examples=8, deadline=None)
@given(work=_spec_workloads(), seed=st.integers(0, 1000))
def test_drawn_speculative_workloads_give_plain_tokens(work, seed):
    """Drawn prompts (some repetitive) x proposers (prompt lookup; a draft that is the model itself:
    full acceptance; random tokens: full rejection) x arenas (roomy, or at their page limit:
    a row waits for another's pages) x a stop token inside the output or none: greedy tokens are plain decoding's; the
    host's page count equals the device's after every call (no page leaked by a rollback) and
    every page comes back."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Scheduler, "CHECK_ACCOUNTING", True)  # (a mismatch raises inside generate)
        proposer, plain, got = _drawn_workload(*work, seed)
    assert got.tokens == plain.tokens, proposer
    assert aj.health(got.cache)["pages_in_use"] == 0 and aj.health(got.cache)["rejected_rows"] == 0
    if proposer.startswith("draft") and got.proposed_tokens:
        assert got.accepted_tokens == got.proposed_tokens


def _drawn_workload(prompts, proposer, arena, stop, seed):
    """(proposer, plain Generation, speculative Generation) of one drawn workload."""
    kw = dict(batch_size=2, chunk_size=4, stop_tokens=(), layout=_DRAWN_LAYOUTS[arena])
    plain = models.generate(_DRAWN_MODEL, prompts, 12, **kw)
    if stop and len(plain.tokens[0]) > 3:
        kw["stop_tokens"] = (plain.tokens[0][3],)  # ends the first prompt mid-run (inside an accepted run, often)
        plain = models.generate(_DRAWN_MODEL, prompts, 12, **kw)
    spec = {"lookup": models.PromptLookup(k=3), "wrong": _Wrong(seed),
            "draft (the model itself)": models.DraftModel(_DRAWN_MODEL, k=3, max_len=32)}[proposer]
    return f"{proposer}, {arena} arena", plain, models.generate(_DRAWN_MODEL, prompts, 12, speculative=spec, **kw)


def _verify_rows_per_position(logits, tokens, num_tokens, positions, sampling, seed, seq_ids):
    """The acceptance rule written one position at a time (the reference `verify_rows`, which
    filters and draws for every position at once, must equal bit for bit)."""
    from arena_jax.models.sampling import filter_logits
    from arena_jax.models.speculative import _keys

    batch, width, vocab = logits.shape
    draw_pos = positions + 1
    greedy_y = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    proposals = jnp.concatenate([tokens[:, 1:], jnp.zeros((batch, 1), tokens.dtype)], axis=1).astype(jnp.int32)
    has_next = jnp.arange(width)[None, :] < (num_tokens[:, None] - 1)
    oks, fixes = [], []
    for j in range(width):
        filtered = filter_logits(logits[:, j], sampling)
        drawn = jax.vmap(jax.random.categorical)(_keys(seed, seq_ids, draw_pos[:, j], 0), filtered).astype(jnp.int32)
        p = jnp.take_along_axis(jax.nn.softmax(filtered, axis=-1), proposals[:, j : j + 1], axis=1)[:, 0]
        u = jax.vmap(jax.random.uniform)(_keys(seed, seq_ids, draw_pos[:, j], 1))
        residual = jnp.where(jnp.arange(vocab)[None, :] == proposals[:, j : j + 1], -jnp.inf, filtered)
        resampled = jax.vmap(jax.random.categorical)(_keys(seed, seq_ids, draw_pos[:, j], 2), residual).astype(jnp.int32)
        hot = sampling.temperature > 0
        oks.append(jnp.where(hot, u < p, proposals[:, j] == greedy_y[:, j]))
        fixes.append(jnp.where(hot, jnp.where(has_next[:, j], resampled, drawn), greedy_y[:, j]))
    accept = has_next & jnp.stack(oks, axis=1)
    a = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
    new = jnp.where(jnp.arange(width)[None, :] < a[:, None], proposals, jnp.take_along_axis(jnp.stack(fixes, 1), a[:, None], 1))
    return new.astype(jnp.int32), jnp.where(num_tokens > 0, a + 1, 0).astype(jnp.int32)


def test_verify_rows_equals_the_rule_one_position_at_a_time():
    """Fresh random logits, proposals, counts, positions and per-row sampling (greedy rows among
    sampled ones, top-k, top-p): `verify_rows` (all positions in one filter) gives exactly the
    tokens and counts of the per-position rule."""
    rng = np.random.default_rng()
    fast, reference = jax.jit(verify_rows), jax.jit(_verify_rows_per_position)  # (a compile each, not one per op)
    for trial in range(4):
        batch, width, vocab = 5, 4, 37
        args = (jnp.asarray(rng.normal(size=(batch, width, vocab)).astype(np.float32) * 3),
                jnp.asarray(rng.integers(0, vocab, (batch, width)), jnp.int32),
                jnp.asarray(rng.integers(0, width + 1, batch), jnp.int32),
                jnp.asarray(rng.integers(0, 50, (batch, 1)) + np.arange(width)[None], jnp.int32),
                SamplingParams(jnp.asarray(rng.choice([0.0, 0.5, 1.0, 1.7], batch), jnp.float32),
                               jnp.asarray(rng.choice([0, 3, 10], batch), jnp.int32),
                               jnp.asarray(rng.choice([1.0, 0.9, 0.3], batch), jnp.float32)),
                jnp.int32(rng.integers(0, 1000)), jnp.asarray(rng.integers(0, 100, batch), jnp.int32))  # fmt: skip
        for got, want in zip(fast(*args), reference(*args)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
