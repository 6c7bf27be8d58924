"""`generate(..., prefix_cache=...)` always finishes: every request that fits the arena alone is
served, a prefix hit is shortened when keeping it would leave the request unservable, and no
request is preempted twice (`models.scheduler`, "Admission" and "Progress").

The reproductions of the hangs found on b599a34 run by name; a hypothesis test draws tiny
budgets, page sizes and prompt sets with shared prefixes and checks termination within the
scheduler's bound, at most one preemption per request, and tokens equal to the run without a
prefix cache. Its layouts are few and fixed (each new shape compiles the steps again).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import arena_jax as aj
from arena_jax import models
from arena_jax.models.scheduler import Scheduler


@pytest.fixture(scope="module")
def model():
    return models.init_random(models.LlamaConfig.tiny(), seed=0)


@pytest.fixture(autouse=True)
def check_accounting(monkeypatch):
    monkeypatch.setattr(Scheduler, "CHECK_ACCOUNTING", True)


A = list(range(1, 20))  # 19 tokens: a cached prefix of it ends inside a 16-token page


def _served(result, prompts, max_new):
    """Every request finished (max_new tokens: no stop tokens here), none preempted twice, within the bound."""
    assert [len(t) for t in result.tokens] == [max_new] * len(prompts)
    assert max(result.preempted) <= 1, result.preempted
    seqs = [models.scheduler.Seq(i, list(p)) for i, p in enumerate(prompts)]
    assert result.scheduler_steps <= Scheduler.step_bound(seqs, max_new)


@pytest.mark.timeout(120)
def test_a_partial_hit_on_a_full_arena_is_cut_to_whole_pages(model):
    """Default layout for batch 1: 2 pages. The second prompt's hit ends inside the first's last
    page, and copying that page would need a third page: the hit is cut to its whole page."""
    prompts = [A, A + [42]]
    cached = models.generate(model, prompts, 4, batch_size=1, prefix_cache=True, stop_tokens=())
    _served(cached, prompts, 4)
    assert cached.prefix_hit_tokens == 16  # the whole first page, not the 19 tokens of the partial hit
    assert cached.tokens == models.generate(model, prompts, 4, batch_size=1, stop_tokens=()).tokens


@pytest.mark.timeout(120)
@pytest.mark.parametrize("new", [1, 2])
def test_three_prompts_sharing_a_prefix_on_three_pages_of_four(model, new):
    layout = model.config.kv_layout(page_size=4, num_pages=3, max_seqs=2, max_seq_len=12, dtype="float32")
    prompts = [A[:7], A[:10], A[:9]]
    kwargs = dict(batch_size=2, layout=layout, chunk_size=4, stop_tokens=())
    cached = models.generate(model, prompts, new, prefix_cache=True, **kwargs)
    _served(cached, prompts, new)
    assert cached.tokens == models.generate(model, prompts, new, **kwargs).tokens


@pytest.mark.timeout(120)
def test_a_second_turn_continuing_the_returned_cache_and_index(model):
    first = models.generate(model, [A], 4, batch_size=1, prefix_cache=True, stop_tokens=())
    turn2 = [A + first.tokens[0] + [5]]  # 24 tokens + 4 new in the same 2 pages of 16
    second = models.generate(model, turn2, 4, batch_size=1, cache=first.cache, prefix_cache=first.prefix_cache,
                             stop_tokens=())  # fmt: skip
    _served(second, turn2, 4)
    assert second.prefix_hit_tokens == 16
    fresh = models.generate(model, turn2, 4, batch_size=1, layout=first.cache.layout, stop_tokens=())
    assert second.tokens == fresh.tokens


@pytest.mark.timeout(120)
def test_cli_prefix_cache_on_a_one_page_arena_finishes(capsys):
    from arena_jax.models.cli import main

    args = ["--prefix-cache", "--num-pages", "1", "--page-size", "16", "--prompt", "abcdefghijklmn",
            "--max-new-tokens", "2", "--batch", "1", "--no-compile-cache"]  # fmt: skip
    assert main(args) == 0
    assert "2 tokens in" in capsys.readouterr().out


def test_cli_refuses_a_budget_below_one_sequence_before_compiling(capsys):
    from arena_jax.models.cli import main

    before = models.TRACE_COUNTS.copy()
    with pytest.raises(SystemExit) as exc:
        main(["--num-pages", "1", "--page-size", "16", "--prompt", "abcdefghijklmnop", "--max-new-tokens", "5",
              "--batch", "1", "--no-compile-cache"])  # fmt: skip
    assert exc.value.code == 2 and models.TRACE_COUNTS == before  # nothing compiled
    err = capsys.readouterr().err
    assert "--num-pages 1 x --page-size 16 = 16 tokens" in err and "--max-new-tokens 5 = 21 tokens need 2 pages" in err


# ---- drawn: tiny budgets, page sizes and prompt sets with shared prefixes ------------------------------------

# (page_size, num_pages) with 12-token sequences and 2 rows: few shapes, so few compiles.
BUDGETS = [(2, 6), (4, 3), (4, 5)]
MAX_LEN = 12
# Mixed steps drawn for the cached runs (a soak may pin them: ARENA_PROGRESS_MIXED=1 or 0).
MIXED = {"1": (True,), "0": (False,)}.get(os.environ.get("ARENA_PROGRESS_MIXED", ""), (False, True))


@st.composite
def workloads(draw):
    page_size, num_pages = draw(st.sampled_from(BUDGETS))
    cap = min(MAX_LEN, page_size * num_pages)
    max_new = draw(st.integers(1, 4))
    systems = [draw(st.lists(st.integers(0, 3), min_size=0, max_size=cap - max_new - 1)) for _ in range(2)]
    prompts = []
    for _ in range(draw(st.integers(1, 4))):
        base = systems[draw(st.integers(0, 1))]
        base = base[: draw(st.integers(0, len(base)))]
        tail = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
        prompts.append((base + tail)[: cap - max_new])
    temperature = draw(st.sampled_from([0.0, 0.9]))
    turns = draw(st.integers(1, 2))
    mixed = draw(st.sampled_from(MIXED))  # the cached run's prompts fed by mixed steps (chunks beside decode rows)
    return page_size, num_pages, max_new, prompts, temperature, turns, mixed


@settings(max_examples=int(os.environ.get("ARENA_PROGRESS_EXAMPLES", "12")), deadline=None)
@given(work=workloads())
def test_drawn_workloads_finish_with_the_no_cache_tokens(model, work):
    page_size, num_pages, max_new, prompts, temperature, turns, mixed = work
    layout = model.config.kv_layout(page_size=page_size, num_pages=num_pages, max_seqs=2, max_seq_len=MAX_LEN,
                                     dtype="float32")  # fmt: skip
    kwargs = dict(batch_size=2, chunk_size=4, temperature=temperature, top_k=3, seed=7, stop_tokens=())
    cached = models.generate(model, prompts, max_new, layout=layout, prefix_cache=True, mixed_steps=mixed, **kwargs)
    for turn in range(turns):
        _served(cached, prompts, max_new)
        assert cached.tokens == models.generate(model, prompts, max_new, layout=layout, **kwargs).tokens
        h = aj.health(cached.cache, cached.prefix_cache)
        assert h["prefix_index_matches"] and h["active_sequences"] == 0 and h["rejected_rows"] == 0
        if turn + 1 < turns:  # the next turn continues the cache and index
            cached = models.generate(model, prompts, max_new, cache=cached.cache, prefix_cache=cached.prefix_cache,
                                     mixed_steps=mixed, **kwargs)  # fmt: skip
    assert np.isfinite(cached.seconds)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("prefix", [False, True], ids=["no prefix cache", "prefix cache"])
def test_a_request_preempted_once_is_readmitted_for_good(model, prefix):
    """Four rows on ten 2-token pages: a watermark re-admission (room for the prompt plus one page
    per running sequence) preempts the third request twice here; re-admission with room for the
    whole remaining life of everything running preempts nobody twice."""
    layout = model.config.kv_layout(page_size=2, num_pages=10, max_seqs=4, max_seq_len=16, dtype="float32")
    prompts = [[0, 1, 0, 2, 2, 3], [0, 3, 0, 3], [1, 1, 1, 0], [1, 3, 0, 2, 1, 3]]
    run = models.generate(model, prompts, 10, batch_size=4, chunk_size=4, layout=layout, stop_tokens=(), prefix_cache=prefix)
    _served(run, prompts, 10)
    assert run.preemptions > 0  # memory is short: the rule is exercised
    ample = models.generate(model, prompts, 10, batch_size=4, chunk_size=4, stop_tokens=())
    assert run.tokens == ample.tokens


# The same drawn workloads with a host tier of 3 pages: swap preemption (the cost model forced to
# swap whenever host pages are free; too few of them, and the rest recompute), or the prefix
# cache spilling to host pages and hitting there. Same bound, same single preemption, same tokens.
FORCE_SWAP = models.SwapPolicy(prefill_tokens_per_s=1.0)


@settings(max_examples=int(os.environ.get("ARENA_PROGRESS_HOST_EXAMPLES", "8")), deadline=None)
@given(work=workloads(), tier=st.sampled_from(["swap", "prefix"]))
# Found by a soak: in the second turn two admissions hit the same prefix, its tail on one host
# page; one swap_in call may read a host page once, so the scheduler must split them (it did not).
@example(work=(2, 6, 4, [[0, 0], [0], [0, 0, 0, 0], [0, 0, 0, 0]], 0.0, 2, False), tier="prefix")
def test_drawn_workloads_with_a_host_tier_finish_with_the_no_cache_tokens(model, work, tier):
    page_size, num_pages, max_new, prompts, temperature, turns, mixed = work
    layout = model.config.kv_layout(page_size=page_size, num_pages=num_pages, max_seqs=2, max_seq_len=MAX_LEN,
                                     dtype="float32")  # fmt: skip
    kwargs = dict(batch_size=2, chunk_size=4, temperature=temperature, top_k=3, seed=7, stop_tokens=(), swap_policy=FORCE_SWAP)
    plain = models.generate(model, prompts, max_new, layout=layout, **{k: v for k, v in kwargs.items() if k != "swap_policy"})
    kwargs["mixed_steps"] = mixed
    got = models.generate(model, prompts, max_new, layout=layout, host_pages=3, prefix_cache=tier == "prefix", **kwargs)
    swap_outs = 0  # the cache's counters add up over the turns; each Generation counts its own call
    for turn in range(turns):
        swap_outs += got.swap_outs
        _served(got, prompts, max_new)
        assert got.tokens == plain.tokens
        h = aj.health(got.cache, got.prefix_cache, host=got.host)
        assert h["active_sequences"] == 0 and h["rejected_rows"] == 0 and h["failed_swaps"] == 0
        if tier == "prefix":
            assert h["prefix_index_matches"] and h["prefix_host_index_matches"]
        else:
            assert h["host_pages_held"] == 0 and h["swap_ins"] == h["swap_outs"] == swap_outs
        if turn + 1 < turns:
            got = models.generate(model, prompts, max_new, cache=got.cache, prefix_cache=got.prefix_cache or False,
                                  host=got.host, **kwargs)  # fmt: skip
