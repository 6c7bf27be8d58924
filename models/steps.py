"""The jitted steps: `prefill`, `decode_step` and `mixed_step` (decode rows and prompt chunks
together). Each is ONE compiled call that reserves the new tokens' pages, runs every layer
(append + attend) and samples, with the cache donated (its arena is updated in place: keep
the returned cache).

    graphdef, state = nnx.split(model)
    out = prefill(graphdef, state, cache, tokens, slots, num_tokens, seq_ids, seed)   # tokens i32[B, T]
    cache = out.cache                      # out.tokens i32[B], out.logits f32[B, V], out.ok bool[B]
    out = decode_step(graphdef, state, cache, out.tokens, slots, seq_ids, seed)      # tokens i32[B]

Rows: `slots[b]` is the cache slot of batch row b, or `aj.PAD_SLOT` for an empty row. In
prefill, row b's real tokens are its FIRST `num_tokens[b]` tokens of the [B, T] chunk; they
take the slot's next positions. A row whose reservation fails (arena full) is run as a
padded row (nothing written) and reported with `ok[b] = False`; its slot is unchanged, so
the host can free pages (preempt) and retry the same tokens. A row that cannot run (more
tokens than T, or a real token outside [0, vocab_size), which the embedding would clip) is
refused the same way, reserving nothing, and counted in the cache's `stats.rejected_rows`.

Shapes and the static arguments (graphdef, all_logits) are the only things that compile
(sampling settings are arrays): sequences joining and leaving change values only. A call finds
its program by the graphdef object's identity (`models.model_jit`), not by hashing the whole
graph (35 us for the tiny model, ~23 us a layer for a list of layers): keep the one `graphdef`
of `nnx.split(model)` across calls; a new, equal one costs one hash and compiles nothing.

`bound_steps(graphdef, state)` binds them to a model's static parts once, and adds
`decode_block`: up to `length` decode steps in one call, each row's sampled token fed to its
next step on the device (what `generate` runs while no request waits).
"""
from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import arena_jax as aj
from arena_jax.models.checks import check_shape
from arena_jax.models.layers import take_tokens
from arena_jax.models.llama import token_positions
from arena_jax.models.model_jit import model_jit
from arena_jax.models.sampling import SamplingParams, sample

# Compile options of the bound steps (`bound_steps`: what `generate`, the scheduler, the server
# and the draft model run). `xla_gpu_enable_triton_gemm=False`: on a GPU the layer scan's matmuls
# go to cuBLAS, whose operands XLA reads in place from the stacked weights [L, ...] (a
# "dynamic-slice fusion": the slice is an address); with Triton GEMMs XLA first copies each
# layer's weights out of the stack every step (benchmarks/studies/sm90_steps.py, issue 39 item 1:
# 416 MiB a layer at Llama-3-8B shape). Other platforms ignore GPU options. JAX takes compile
# options only on a top-level jit, so the public `decode_step` / `prefill` / `mixed_step`, which a
# user may call inside their own jit or `eval_shape`, do not carry them: give them to your own
# top-level jit (`jax.jit(f, compiler_options=STEP_COMPILER_OPTIONS)`).
STEP_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}

__all__ = ["StepOutput", "prefill", "decode_step", "mixed_step", "release_rows", "fork_page_rows", "hold_page_rows", "drop_page_rows",
           "swap_out_rows", "swap_in_rows", "offload_page_rows", "drop_host_page_rows", "evict_to_host_rows",
           "flush_rows", "TRACE_COUNTS", "BoundSteps", "bound_steps"]

# Incremented each time a step is traced (= compiled): tests use it to check that nothing
# recompiles once shapes are warm.
TRACE_COUNTS: collections.Counter = collections.Counter()


class StepOutput(NamedTuple):
    cache: aj.KVCache
    tokens: jax.Array  # i32[B] sampled next token per row (meaningless where ok is False or the row is padded)
    logits: jax.Array  # f32[B, V] at each row's last real token, or f32[B, T, V] with all_logits=True
    ok: jax.Array  # bool[B] the row's pages were reserved (True for PAD_SLOT rows)


def _invalid_rows(tokens, num_tokens, vocab: int):
    """bool[B] of rows [B, T] that cannot run: more tokens than the chunk's width T, or a real
    token (one of the first num_tokens[b]) outside [0, vocab) (the embedding would clip it)."""
    width = tokens.shape[1]
    real = jnp.arange(width)[None, :] < num_tokens[:, None]
    ids = tokens.astype(jnp.int32)  # (a uint32 id past int32 wraps negative: outside as well)
    outside = jnp.any(real & ((ids < 0) | (ids >= vocab)), axis=1)
    return (num_tokens > width) | outside


def _reserve_rows(model, cache, tokens, slots, num_tokens):
    """Reserve each row's tokens: (cache, ok, slots with refused rows PAD_SLOT, num_tokens with
    refused rows 0, positions i32[B, T]). An invalid row asks `reserve` for -1 tokens: refused
    (ok False), counted in stats.rejected_rows."""
    slots = slots.astype(jnp.int32)
    num_tokens = jnp.where(slots >= 0, num_tokens.astype(jnp.int32), 0)
    invalid = _invalid_rows(tokens, num_tokens, model.config.vocab_size)
    cache, ok = aj.reserve(cache, slots, jnp.where(invalid, -1, num_tokens))
    num_tokens = jnp.where(invalid | ~ok, 0, num_tokens)
    slots = jnp.where(ok, slots, aj.PAD_SLOT)  # a refused row writes and reads nothing this step
    return cache, ok, slots, num_tokens, token_positions(cache, slots, num_tokens, tokens.shape[1])


def _step(graphdef, state, cache, tokens, slots, num_tokens, seq_ids, seed, sampling, all_logits):
    model = nnx.merge(graphdef, state)
    cache, ok, slots, num_tokens, positions = _reserve_rows(model, cache, tokens, slots, num_tokens)
    # [B, T, E]; without all_logits [B, 1, E]: each row's last token (the last layer runs that token alone)
    x, cache = model.hidden(tokens, positions, cache, slots, num_tokens, last_only=not all_logits)
    last = jnp.maximum(num_tokens - 1, 0)
    if all_logits:
        every = model.logits(x)  # [B, T, V]
        logits = take_tokens(every, last)[:, 0]
    else:
        logits = every = model.logits(x)[:, 0]  # [B, V]
    new_position = jnp.take_along_axis(positions, last[:, None], axis=1)[:, 0] + 1
    seq_ids = slots if seq_ids is None else seq_ids
    next_tokens = sample(logits, sampling, seed, seq_ids, new_position)
    return StepOutput(cache=cache, tokens=next_tokens, logits=every, ok=ok)


def _verify(graphdef, state, cache, tokens, slots, num_tokens, seq_ids, seed, sampling):
    """A speculative verify call (models.speculative): row b feeds tokens[b, :num_tokens[b]] (its
    last token and its proposals), keeps the accepted ones and rolls the rest back (`aj.truncate`,
    in the call). Returns (StepOutput: the cache, the row's last new token, its logits there,
    ok; packed i32[T + 1, 2, B]: new token j of each row and ok for j < T, then (count, ok))."""
    from arena_jax.models.speculative import verify_rows

    model = nnx.merge(graphdef, state)
    batch, width = tokens.shape
    cache, ok, slots, num_tokens, positions = _reserve_rows(model, cache, tokens, slots, num_tokens)
    x, cache = model.hidden(tokens, positions, cache, slots, num_tokens)  # [B, T, E]
    logits = model.logits(x).astype(jnp.float32)  # [B, T, V]
    seq_ids = slots if seq_ids is None else seq_ids
    new, count = verify_rows(logits, tokens, num_tokens, positions, sampling, seed, seq_ids)
    cache = aj.truncate(cache, slots, jnp.where(slots >= 0, positions[:, 0] + count, 0))  # keep t0 and the accepted
    live = slots >= 0  # (rows the reservation refused are not live: they proposed nothing)
    cache = cache.replace(stats=cache.stats.bump(proposed_tokens=jnp.where(live, jnp.maximum(num_tokens - 1, 0), 0),
                                                 accepted_tokens=jnp.where(live, jnp.maximum(count - 1, 0), 0)))  # fmt: skip
    last = jnp.maximum(count - 1, 0)
    out = StepOutput(cache=cache, tokens=jnp.take_along_axis(new, last[:, None], axis=1)[:, 0],
                     logits=jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], ok=ok)  # fmt: skip
    okay = ok.astype(jnp.int32)
    packed = jnp.concatenate([jnp.stack([new.T, jnp.broadcast_to(okay, (width, batch))], axis=1),
                              jnp.stack([count, okay])[None]], axis=0)  # fmt: skip
    return out, packed


def _shard_blocks(dp: int, decode, chunks):
    """[B], [P] -> [B + P]: the decode rows then the chunks of data shard 0, then of shard 1, ..."""
    return jnp.concatenate([decode.reshape(dp, -1), chunks.reshape(dp, -1)], axis=1).reshape(-1)


def _unblock(dp: int, rows, batch: int):
    """`_shard_blocks`' inverse: [B + P] -> ([B], [P])."""
    blocks = rows.reshape(dp, -1)
    return blocks[:, : batch // dp].reshape(-1), blocks[:, batch // dp :].reshape(-1)


def _mixed(graphdef, state, cache, tokens, slots, chunks, chunk_slots, chunk_counts, chunk_rows, seq_ids, seed, sampling):
    """The mixed step (see `mixed_step`); outputs in batch-row order."""
    model = nnx.merge(graphdef, state)
    check_shape("tokens", tokens, (None,), "i32[B] (one token per batch row)")
    check_shape("chunks", chunks, (None, None), "i32[P, T] (P prompt chunks of T tokens)")
    batch, width, num_chunks = tokens.shape[0], chunks.shape[1], chunks.shape[0]
    rows_of = {"B": (batch, "the rows of tokens [B]"), "P": (num_chunks, "the rows of chunks [P, T]")}
    for name, x, axis in (("slots", slots, "B"), ("seq_ids", seq_ids, "B"), ("chunk_slots", chunk_slots, "P"),
                          ("chunk_counts", chunk_counts, "P"), ("chunk_rows", chunk_rows, "P")):  # fmt: skip
        size, whose = rows_of[axis]
        check_shape(name, x, (size,), f"i32[{axis}] with {axis} = {size} ({whose})")
    dp = cache.sharding.dp if cache.sharding is not None else 1
    if num_chunks % dp:
        raise ValueError(f"chunks: {num_chunks} chunks do not split into the cache's {dp} data shards (a multiple of {dp})")
    # [B + P]: every row the step serves, in data-shard blocks as `aj.reserve` takes rows (shard
    # d's decode rows, then its chunks: block d of each part names shard d's slots).
    rows = _shard_blocks(dp, slots, chunk_slots).astype(jnp.int32)
    counts = _shard_blocks(dp, jnp.ones((batch,), jnp.int32), chunk_counts.astype(jnp.int32))
    # A row that cannot run (a token outside the vocabulary, a chunk count past T) asks `reserve`
    # for -1 tokens: refused (ok False) and counted in stats.rejected_rows.
    vocab = model.config.vocab_size
    invalid = _shard_blocks(dp, _invalid_rows(tokens[:, None], (slots >= 0).astype(jnp.int32), vocab),
                            _invalid_rows(chunks, chunk_counts.astype(jnp.int32), vocab))  # fmt: skip
    counts = jnp.where(invalid, -1, counts)
    # A slot given twice (a decode row and a chunk, or two chunks) keeps its first row only: the
    # others are refused (ok False, nothing written), so any input leaves every slot consistent.
    index = jnp.arange(rows.shape[0])
    repeated = jnp.any((rows[:, None] == rows[None, :]) & (index[None, :] < index[:, None]), axis=1) & (rows >= 0)
    counts = jnp.where((rows >= 0) & ~repeated, counts, 0)
    cache, ok = aj.reserve(cache, jnp.where(repeated, aj.PAD_SLOT, rows), counts)
    ok = ok & ~repeated
    rows = jnp.where(ok, rows, aj.PAD_SLOT)  # a refused row writes and reads nothing this step
    counts = jnp.where(ok, counts, 0)
    (d_slots, p_slots), (d_counts, p_counts), (d_ok, p_ok) = (_unblock(dp, a, batch) for a in (rows, counts, ok))
    ok = jnp.concatenate([d_ok, p_ok])  # [B + P] in part order, as below
    d_pos, p_pos = token_positions(cache, d_slots, d_counts, 1), token_positions(cache, p_slots, p_counts, width)
    # [B, 1, E], [P, 1, E]: each chunk's last token (with a list of layers the last layer runs those tokens alone)
    (xd, xp), cache = model.hidden_mixed(
        [(tokens[:, None], d_pos, d_slots, d_counts), (chunks, p_pos, p_slots, p_counts)], cache, last_only=True
    )
    last = jnp.maximum(p_counts - 1, 0)
    h = jnp.concatenate([xd, xp])  # [B + P, 1, E]
    logits = model.logits(h)[:, 0]  # [B + P, V]
    position = jnp.concatenate([d_pos[:, 0], jnp.take_along_axis(p_pos, last[:, None], axis=1)[:, 0]]) + 1
    where = jnp.where((chunk_rows >= 0) & (chunk_slots >= 0), chunk_rows, batch)  # [P] each chunk's batch row (batch: none)
    of_chunks = lambda a: jnp.concatenate([a, a[jnp.minimum(where, batch - 1)]])  # noqa: E731  [B] -> [B + P]
    if isinstance(sampling, SamplingParams):  # per batch row: a chunk samples with its row's settings
        sampling = jax.tree.map(of_chunks, sampling)
    drawn = sample(logits, sampling, seed, of_chunks(seq_ids), position)  # [B + P]

    def to_rows(a):  # [B + P, ...] -> [B, ...]: each chunk's result in its batch row
        return a[:batch].at[where].set(a[batch:], mode="drop")

    return StepOutput(cache=cache, tokens=to_rows(drawn), logits=to_rows(logits), ok=to_rows(ok))


@model_jit(donate_argnames=("cache",))
def mixed_step(graphdef, state, cache: aj.KVCache, tokens, slots, chunks, chunk_slots, chunk_counts, chunk_rows,
               seq_ids=None, seed=0, sampling: SamplingParams | None = None) -> StepOutput:  # fmt: skip
    """Decode rows and prefill chunks in ONE call (continuous batching's mixed step).

    Decode part, one token per batch row: tokens i32[B], slots i32[B] (PAD_SLOT: the row does
    not decode). Prefill part, P chunks of width T: chunks i32[P, T], chunk_slots i32[P],
    chunk_counts i32[P] (0..T real tokens each), chunk_rows i32[P] (the batch row each chunk
    belongs to, -1 for an unused chunk; a row decodes or prefills, not both: a slot given twice
    is served in its first place only, the others refused with ok False). seq_ids i32[B]
    per batch row (default: the slots). The tokens of both parts run packed flat through the
    dense layers, B + P * T of them (the step's token budget), and each part attends with its
    own kernel (`Llama.hidden_mixed`). Returns a StepOutput in batch-row order: `tokens` i32[B]
    sampled at each row's last new token, `logits` f32[B, V], `ok` bool[B] (True for rows the
    step does not serve). Outputs equal a `prefill` of the chunks plus a `decode_step` of the
    rest, up to float rounding of the differently shaped products. On a cache with dp data
    shards, P is a multiple of dp and chunk block d (P / dp chunks) names shard d's slots and
    rows, as the decode part's row blocks do (a chunk naming another shard's slot is refused).
    """
    TRACE_COUNTS["mixed_step"] += 1
    seq_ids = slots if seq_ids is None else seq_ids
    return _mixed(graphdef, state, cache, tokens, slots, chunks, chunk_slots, chunk_counts, chunk_rows, seq_ids, seed,
                  sampling)  # fmt: skip


@model_jit(static_argnames=("all_logits",), donate_argnames=("cache",))
def prefill(
    graphdef,
    state,
    cache: aj.KVCache,
    tokens,
    slots,
    num_tokens,
    seq_ids=None,
    seed=0,
    sampling: SamplingParams | None = None,
    *,
    all_logits: bool = False,
) -> StepOutput:
    """Feed a chunk: tokens i32[B, T], slots i32[B], num_tokens i32[B] (0..T).

    `sampling` (per-row `SamplingParams`, e.g. `Sampling(0.8, top_k=40).rows(B)`; None =
    greedy), seq_ids i32[B] and seed i32[] choose the next tokens (seq_ids default to the
    slot ids). Returns a StepOutput whose `tokens` are sampled at each row's last real token.
    """
    TRACE_COUNTS["prefill"] += 1
    return _step(graphdef, state, cache, tokens, slots, num_tokens, seq_ids, seed, sampling, all_logits)


@model_jit(donate_argnames=("cache",))
def decode_step(
    graphdef, state, cache: aj.KVCache, tokens, slots, seq_ids=None, seed=0, sampling: SamplingParams | None = None
) -> StepOutput:
    """Feed one token per row (tokens i32[B]) and sample the next; PAD_SLOT rows do nothing."""
    TRACE_COUNTS["decode_step"] += 1
    num_tokens = (slots >= 0).astype(jnp.int32)
    return _step(graphdef, state, cache, tokens[:, None], slots, num_tokens, seq_ids, seed, sampling, False)


class BoundSteps(NamedTuple):
    """`prefill`, `decode_step`, `mixed_step` and `decode_block` (up to `length` decode steps
    in one call, the tokens fed back on the device: `_decode_block`) with the model's static
    parts bound once (`bound_steps`):
    called with the state's leaves (a list, flattened by JAX's C++ fast path; an nnx State is
    flattened in Python, ~7 us a layer of a list of layers) and no graphdef. Same traces, same
    results, and beside the StepOutput the sampled tokens and `ok` packed in one i32[2, B] array (one
    transfer for a host that reads both back)."""

    prefill: object  # (leaves, cache, tokens, slots, num_tokens, seq_ids, seed, sampling, all_logits=False) -> (StepOutput, i32[2, B])
    decode_step: object  # (leaves, cache, tokens, slots, seq_ids, seed, sampling) -> (StepOutput, i32[2, B])
    leaves: list  # the state's leaves, in `treedef` order
    mixed: object = None  # (leaves, cache, tokens, slots, chunks, chunk_slots, chunk_counts, chunk_rows, seq_ids, seed, sampling) -> (StepOutput, i32[2, B])
    decode_block: object = None  # (leaves, cache, tokens, slots, counts, seq_ids, seed, sampling, length) -> (StepOutput, i32[length, 2, B])
    verify: object = None  # (leaves, cache, tokens, slots, num_tokens, seq_ids, seed, sampling) -> (StepOutput, i32[T + 1, 2, B])


def _packed(out: StepOutput):
    return out, jnp.stack([out.tokens.astype(jnp.int32), out.ok.astype(jnp.int32)])  # [2, B]


def _decode_block(graphdef, state, cache, tokens, slots, counts, seq_ids, seed, sampling, length: int):
    """Up to `length` decode steps in one call (a `lax.while_loop` of `_step`): row b runs
    `counts[b]` of them, each fed the token its previous step sampled, on the device. Step j of
    row b is exactly the j-th of as many `decode_step` calls (the same ops, bit for bit: tests);
    a row refused pages at a step (ok False) runs nothing after it. Trip count: the largest
    count, so a block of ones costs one step (and is `decode_step`, logits included).
    tokens, slots, counts, seq_ids: i32[B] -> (StepOutput: the cache, each row's last token,
    f32[B, V] logits of each row's last step, ok = no step of the row refused; packed
    i32[length, 2, B]: step j's sampled tokens and ok, ok 1 for rows that ran no step j)."""
    batch = tokens.shape[0]
    vocab = nnx.merge(graphdef, state).config.vocab_size
    counts = jnp.where(slots >= 0, jnp.clip(counts.astype(jnp.int32), 0, length), 0)

    def body(carry):
        j, cache, tokens, alive, logits, packed = carry
        step_slots = jnp.where(alive & (j < counts), slots, aj.PAD_SLOT)
        live = (step_slots >= 0).astype(jnp.int32)
        out = _step(graphdef, state, cache, tokens[:, None], step_slots, live, seq_ids, seed, sampling, False)
        packed = packed.at[j].set(jnp.stack([out.tokens.astype(jnp.int32), out.ok.astype(jnp.int32)]))
        logits = jnp.where(live[:, None] > 0, out.logits.astype(jnp.float32), logits)
        return j + 1, out.cache, jnp.where(live > 0, out.tokens, tokens), alive & out.ok, logits, packed

    init = (jnp.int32(0), cache, tokens.astype(jnp.int32), slots >= 0, jnp.zeros((batch, vocab), jnp.float32),
            jnp.zeros((length, 2, batch), jnp.int32))  # fmt: skip
    _, cache, tokens, alive, logits, packed = jax.lax.while_loop(lambda c: c[0] < jnp.max(counts), body, init)
    return StepOutput(cache=cache, tokens=tokens, logits=logits, ok=alive | (slots < 0)), packed


@functools.lru_cache(maxsize=8)
def _bound(graphdef, treedef):
    """The jitted steps (prefill, decode, mixed, decode block) per model structure, kept across
    `generate` calls (8 models)."""

    def prefill_leaves(leaves, cache, tokens, slots, num_tokens, seq_ids, seed, sampling, all_logits=False):
        TRACE_COUNTS["prefill"] += 1
        state = jax.tree.unflatten(treedef, leaves)
        return _packed(_step(graphdef, state, cache, tokens, slots, num_tokens, seq_ids, seed, sampling, all_logits))

    def decode_leaves(leaves, cache, tokens, slots, seq_ids, seed, sampling):
        TRACE_COUNTS["decode_step"] += 1
        state = jax.tree.unflatten(treedef, leaves)
        num_tokens = (slots >= 0).astype(jnp.int32)
        return _packed(_step(graphdef, state, cache, tokens[:, None], slots, num_tokens, seq_ids, seed, sampling, False))

    def mixed_leaves(leaves, cache, tokens, slots, chunks, chunk_slots, chunk_counts, chunk_rows, seq_ids, seed, sampling):
        TRACE_COUNTS["mixed_step"] += 1
        state = jax.tree.unflatten(treedef, leaves)
        return _packed(_mixed(graphdef, state, cache, tokens, slots, chunks, chunk_slots, chunk_counts, chunk_rows,
                              seq_ids, seed, sampling))  # fmt: skip

    def block_leaves(leaves, cache, tokens, slots, counts, seq_ids, seed, sampling, length):
        TRACE_COUNTS["decode_block"] += 1
        state = jax.tree.unflatten(treedef, leaves)
        return _decode_block(graphdef, state, cache, tokens, slots, counts, seq_ids, seed, sampling, length)

    def verify_leaves(leaves, cache, tokens, slots, num_tokens, seq_ids, seed, sampling):
        TRACE_COUNTS["verify"] += 1
        state = jax.tree.unflatten(treedef, leaves)
        return _verify(graphdef, state, cache, tokens, slots, num_tokens, seq_ids, seed, sampling)

    options = dict(donate_argnums=(1,), compiler_options=STEP_COMPILER_OPTIONS)
    return (jax.jit(prefill_leaves, static_argnames=("all_logits",), **options),
            jax.jit(decode_leaves, **options), jax.jit(mixed_leaves, **options),
            jax.jit(block_leaves, static_argnames=("length",), **options),
            jax.jit(verify_leaves, **options))  # fmt: skip


def bound_steps(graphdef, state) -> BoundSteps:
    """The steps for `nnx.split(model)`'s parts, split and hashed once here, not per call:

        steps = bound_steps(*nnx.split(model))
        out, packed = steps.decode_step(steps.leaves, cache, tokens, slots, seq_ids, seed, sampling)  # packed [2, B]
        out, packed = steps.decode_block(steps.leaves, cache, tokens, slots, counts, seq_ids, seed, sampling,
                                         length=8)  # up to 8 steps per row; packed [8, 2, B]
    """
    leaves, treedef = jax.tree.flatten(state)
    prefill_fn, decode_fn, mixed_fn, block_fn, verify_fn = _bound(graphdef, treedef)
    return BoundSteps(prefill_fn, decode_fn, leaves, mixed_fn, block_fn, verify_fn)


@functools.partial(jax.jit, donate_argnames=("cache",))
def release_rows(cache: aj.KVCache, slots) -> aj.KVCache:
    """`aj.release` with a fixed-shape i32[B] (PAD_SLOT rows ignored): one compile for any subset."""
    TRACE_COUNTS["release_rows"] += 1
    return aj.release(cache, slots)


# The prefix cache's device ops with fixed shapes (PAD_SLOT / PAD_PAGE rows ignored): one compile
# each, and no host check reads the cache back (inside jit the ops are total instead).


@functools.partial(jax.jit, donate_argnames=("cache",))
def fork_page_rows(cache: aj.KVCache, pages, num_tokens, dst) -> aj.KVCache:
    """`aj.fork_pages` with pages i32[B, max_pages_per_seq], num_tokens i32[B], dst i32[B]."""
    TRACE_COUNTS["fork_page_rows"] += 1
    return aj.fork_pages(cache, pages, num_tokens, dst)


@functools.partial(jax.jit, donate_argnames=("cache",))
def hold_page_rows(cache: aj.KVCache, pages, num_tokens) -> aj.KVCache:
    """`aj.hold_pages` with pages and num_tokens i32[K]."""
    TRACE_COUNTS["hold_page_rows"] += 1
    return aj.hold_pages(cache, pages, num_tokens)


@functools.partial(jax.jit, donate_argnames=("cache",))
def drop_page_rows(cache: aj.KVCache, pages) -> aj.KVCache:
    """`aj.drop_pages` with pages i32[K]."""
    TRACE_COUNTS["drop_page_rows"] += 1
    return aj.drop_pages(cache, pages)


# The host tier's ops with fixed shapes (`arena_jax.host`): one compile each, no host check.


@functools.partial(jax.jit, donate_argnames=("cache", "host"))
def swap_out_rows(cache: aj.KVCache, host: aj.HostArena, slots, host_pages):
    """`aj.swap_out` with slots i32[B], host_pages i32[B, max_pages_per_seq]. Returns (cache, host)."""
    TRACE_COUNTS["swap_out_rows"] += 1
    cache, host, _ = aj.swap_out(cache, host, slots, host_pages)
    return cache, host


@functools.partial(jax.jit, donate_argnames=("cache", "host"))
def swap_in_rows(cache: aj.KVCache, host: aj.HostArena, host_pages, num_tokens, dst):
    """`aj.swap_in` with host_pages i32[B, max_pages_per_seq], num_tokens i32[B], dst i32[B]."""
    TRACE_COUNTS["swap_in_rows"] += 1
    return aj.swap_in(cache, host, host_pages, num_tokens, dst)


@functools.partial(jax.jit, donate_argnames=("cache", "host"))
def offload_page_rows(cache: aj.KVCache, host: aj.HostArena, pages, host_pages):
    """`aj.offload_pages` with pages, host_pages i32[K]."""
    TRACE_COUNTS["offload_page_rows"] += 1
    return aj.offload_pages(cache, host, pages, host_pages)


@functools.partial(jax.jit, donate_argnames=("cache", "host"))
def drop_host_page_rows(cache: aj.KVCache, host: aj.HostArena, host_pages):
    """`aj.drop_host_pages` with host_pages i32[K]."""
    TRACE_COUNTS["drop_host_page_rows"] += 1
    return aj.drop_host_pages(cache, host, host_pages)


@functools.partial(jax.jit, donate_argnames=("cache", "host"))
def evict_to_host_rows(cache: aj.KVCache, host: aj.HostArena, host_drops, pages, host_pages, drops):
    """A prefix index's eviction plan in one call: `aj.drop_host_pages(host_drops)`, then
    `aj.offload_pages(pages, host_pages)` (which may reuse those host pages), then
    `aj.drop_pages(drops)`; every argument i32[K]."""
    TRACE_COUNTS["evict_to_host_rows"] += 1
    cache, host = aj.drop_host_pages(cache, host, host_drops)
    cache, host = aj.offload_pages(cache, host, pages, host_pages)
    return aj.drop_pages(cache, drops), host


@functools.partial(jax.jit, donate_argnames=("cache", "host"))
def flush_rows(cache: aj.KVCache, host, hold_pages, hold_counts, release_slots, host_drops, offload_pages, offload_host_pages,
               drops):  # fmt: skip
    """A prefix cache's pending bookkeeping in one call, in its order: holds (`aj.hold_pages`),
    releases (`aj.release`), then, with a host tier (`host` not None), host pages freed and
    pages copied there (`aj.drop_host_pages`, `aj.offload_pages`), then dropped holds
    (`aj.drop_pages`). Every argument i32[K] (release_slots i32[B]), padded. Returns (cache, host)."""
    TRACE_COUNTS["flush_rows"] += 1
    cache = aj.hold_pages(cache, hold_pages, hold_counts)
    cache = aj.release(cache, release_slots)
    if host is not None:
        cache, host = aj.drop_host_pages(cache, host, host_drops)
        cache, host = aj.offload_pages(cache, host, offload_pages, offload_host_pages)
    return aj.drop_pages(cache, drops), host
