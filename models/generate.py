"""`generate`: continuous batching over a fixed number of batch rows on the paged cache.

    result = generate(model, [[1, 5, 9], [2, 7]], max_new_tokens=32, batch_size=4)
    result.tokens          # list[list[int]] generated tokens per prompt (a stop token included)

By default a sequence stops at the model's eos tokens (`model.config.eos_token_ids`, from the
checkpoint's generation_config.json / config.json, as transformers' generate); random-weight
models have none. `stop_tokens=()` turns stopping off, `stop_tokens=[...]` sets other tokens.

Each iteration the host (1) admits waiting prompts into free rows, (2) runs ONE `prefill`
call for rows with more than one token to feed (a fixed `chunk_size`, so long prompts take
several calls and one compiled function), (3) runs ONE `decode_step` for rows with exactly
one token to feed. A finished sequence releases its pages at once and its row takes the
next prompt. Shapes never change, so nothing recompiles as sequences come and go. While
decode steps follow each other, step t+1 is dispatched (fed step t's tokens on the device)
before step t is read back, so the host's work overlaps the device's; a stop token is seen a
step late and the extra token discarded (`models.scheduler.run_ahead`, "Overlap": same tokens).

Memory pressure: when `reserve` cannot serve a row (ok False), the most recently admitted
running sequence is preempted: its pages are released and it is requeued first, to be
recomputed from prompt + tokens generated so far (recompute preemption). A new prompt is
admitted only while the free pages cover it plus one page per running sequence, so the
oldest sequences always make progress. Greedy tokens equal those of a run with ample
memory; sampled tokens too (randomness is keyed by sequence and position).

Prefix cache (`prefix_cache=True`, or the `PrefixCache` of an earlier call with its cache):
an admitted sequence first looks up the longest cached prefix of its tokens (at most all but
the last) in the host index (`arena_jax.PrefixCache`) and gets those pages mapped into its
slot (`aj.fork_pages`: token granularity, a partly used last page is copied on its first
write); only the rest is computed. Full pages are indexed (and held by the cache,
`aj.hold_pages`) as soon as they are written, so sequences running together share a system
prompt; a sequence that finishes or is preempted has all its written tokens indexed, its
partly filled last page included, so the next turn of a conversation (or the recomputation)
hits them. The host knows exactly how many pages are free (index pages + each running
sequence's private pages), so before a step that needs more, it evicts pages only the cache
holds, least recently used leaves first (`aj.drop_pages`); a sequence is preempted only when
nothing is left to evict. The page table rows the scheduler needs come back with the step's
sampled tokens, in the same transfer.

Host tier (`host_pages=N`: `aj.create_host(cache, N)`; `models.host_tier`): without a prefix
cache, a preempted sequence's written pages go to host memory and come back into its slot when
it is re-admitted (`aj.swap_out` / `aj.swap_in`) instead of being recomputed, when the cost
model (`SwapPolicy`: bytes at an assumed bandwidth vs tokens at the prefill rate) says moving is
cheaper and host pages are free. With a prefix cache, the index spills evicted pages to host
memory (LRU device -> host -> gone) and a hit on them brings them back. Tokens are the same
either way. The result's `host` continues it: `generate(..., cache=r.cache,
prefix_cache=r.prefix_cache, host=r.host)`.

8-bit arenas: `kv_dtype="int8"` (or "float8_e4m3fn", "float8_e5m2") when generate sizes the arena.
Many devices: `mesh=` (the cache and, if needed, the weights are placed on it); with a data
axis, rows split into one block per data shard (`models.scheduler`). The scheduler itself
lives in `models.scheduler`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

import arena_jax as aj
from arena_jax.host import check_pair
from arena_jax.models.checks import check_int, token_ids
from arena_jax.models.compile_clock import CompileClock
from arena_jax.models.fingerprint import fingerprint
from arena_jax.models.host_tier import HostTier
from arena_jax.models.key_calibration import calibrate_key_factors
from arena_jax.models.llama import Llama
from arena_jax.models.options import Parallelism, Serving, options_from_keywords
from arena_jax.models.sampling import Sampling
from arena_jax.models.scheduler import Scheduler, Seq, fetch

__all__ = ["Generation", "generate", "default_layout", "length_bucket", "default_decode_block", "default_chunk_size"]


@dataclasses.dataclass
class Generation:
    """What `generate` returns."""

    tokens: list[list[int]]  # generated tokens per prompt, in prompt order
    logits: list[np.ndarray] | None  # per prompt f32[num_generated, V]: the logits each token was drawn from
    cache: aj.KVCache  # the cache afterwards (no sequence; with a prefix cache, its held pages); reusable
    preemptions: int = 0
    prefill_calls: int = 0
    decode_calls: int = 0  # decode_step / decode block calls
    decode_steps: int = 0  # decode steps the device ran (decode_calls when decode_block=1)
    discarded_tokens: int = 0  # tokens sampled past a row's stop token (read back late: run-ahead, decode blocks), dropped
    seconds: float = 0.0  # the call's wall time, compiling included
    prefix_cache: aj.PrefixCache | None = None  # the index of `cache`'s held pages (prefix_cache=...)
    prompt_tokens: int = 0  # tokens each admission had to bring into the cache (a recomputation's too)
    prefill_tokens: int = 0  # of those, the ones computed (the rest were prefix cache hits)
    prefix_hit_tokens: int = 0  # tokens mapped from the prefix cache at admissions
    evictions: int = 0  # pages the prefix cache evicted (LRU) for running sequences
    first_token_seconds: list[float] | None = None  # per prompt: from the call's start to its first token
    preempted: list[int] | None = None  # per prompt: times it was preempted (at most 1: models.scheduler.admission)
    scheduler_steps: int = 0  # iterations of the scheduler's loop (bounded: Scheduler.step_bound)
    host: aj.HostArena | None = None  # the host tier (host_pages=... or host=...), reusable with `cache`
    recomputed_tokens: int = 0  # tokens preempted sequences had in the cache and computed again
    swap_outs: int = 0  # preemptions that moved the sequence's pages to the host tier (no prefix cache)
    swapped_tokens: int = 0  # tokens those preemptions moved (brought back, not recomputed)
    modelled_transfer_seconds: float = 0.0  # host <-> device copies made, at the SwapPolicy's bandwidth
    run_ahead_steps: int = 0  # decode steps dispatched before the previous step was read back (models.scheduler.run_ahead)
    decode_step_seconds: list[float] | None = None  # per scheduler iteration that only decoded: its wall time / its decode steps
    mixed_calls: int = 0  # mixed steps (mixed_steps=True): decode rows and prompt chunks in one call
    token_seconds: list[list[float]] | None = None  # per prompt: when each generated token was read back (s after the start)
    compile_seconds: float = 0.0  # of `seconds`, the time spent tracing and compiling steps (models.compile_clock)
    verify_calls: int = 0  # speculative decoding: verify calls (models.speculative)
    proposed_tokens: int = 0  # tokens the proposer proposed
    accepted_tokens: int = 0  # of those, the ones the model agreed with (kept unless past a stop)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of the call's wall time less its compile time (a first call
        compiles its steps; `seconds` and `compile_seconds` give both)."""
        running = self.seconds - self.compile_seconds
        return self.num_generated / running if running > 0 else float("nan")


def default_layout(
    model: Llama, batch_size: int, max_total_len: int, *, page_size: int = 16, dtype=None, scale_dtype=None
) -> aj.KVLayout:
    """Enough pages for `batch_size` sequences of `max_total_len` tokens each. `dtype`: the
    arena's (default the model's compute dtype; int8 / float8_e4m3fn / float8_e5m2 for an
    8-bit arena, with `scale_dtype` float32 or bfloat16)."""
    pages_per_seq = -(-max_total_len // page_size)
    return model.config.kv_layout(
        page_size=page_size,
        num_pages=batch_size * pages_per_seq,
        max_seqs=batch_size,
        max_seq_len=pages_per_seq * page_size,
        dtype=model.dtype if dtype is None else dtype,
        scale_dtype=scale_dtype,
    )


def length_bucket(num_tokens: int, page_size: int = 16) -> int:
    """The sequence length generate's own arena is sized for: `num_tokens` rounded up to a power
    of two, at least one page. Calls whose longest prompt + max_new_tokens fall in the same
    bucket get the same layout, so they compile nothing new (a given layout or cache: never)."""
    return max(page_size, 1 << max(0, int(num_tokens) - 1).bit_length())


def generate(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    serving: Serving | None = None,
    parallel: Parallelism | None = None,
    cache: aj.KVCache | None = None,
    host: aj.HostArena | None = None,
    arrivals: Sequence[float] | None = None,
    on_token: Callable[[int, int], None] | None = None,
    speculative=None,
    speculate: Sequence[bool] | None = None,
    **options,
) -> Generation:
    """Generate up to `max_new_tokens` for each prompt (lists of token ids).

    Options come as three objects (`models.options`; each checked when made, frozen, reusable
    across calls): `sampling=Sampling(temperature, top_k, top_p, seed, stop_tokens,
    return_logits)`, `serving=Serving(batch_size, chunk_size, layout, kv_dtype, prefix_cache,
    host_pages, swap_policy, mixed_steps, token_budget, decode_block)` and
    `parallel=Parallelism(mesh, tensor_axis, data_axis)`; None: the defaults. Each field is also
    accepted as a keyword of its own, as before (`generate(..., batch_size=8, temperature=0.7)`:
    the same run); an object together with one of its own keywords is a TypeError. The state a
    call continues is given beside them: `cache`, `host`, and an earlier result's
    `prefix_cache=<PrefixCache>` (with `Serving(prefix_cache=True)`); `arrivals` is the workload.
    The fields, as the keywords they were:

    `batch_size` rows run at once (row r uses cache slot r); give `layout` (or a `cache`,
    reused and returned) to bound the arena, else it holds every row at full length, the
    longest prompt + `max_new_tokens` rounded up to a power of two (`length_bucket`), so that
    later calls with other lengths in that bucket compile nothing (with the default `chunk_size`,
    `default_chunk_size`: their longest prompts in the same class, up to 32, 64 or more tokens,
    as the prefill's width follows it). A given layout or cache is compiled for once: any
    prompts and max_new_tokens that fit it reuse its steps (the same proviso).
    temperature 0 is greedy; top_k / top_p filter; `seed` (an int32) makes sampling reproducible.
    A sequence stops after a token in `stop_tokens` (kept in its output). The default, None,
    means the model's `config.eos_token_ids` (a checkpoint's eos tokens, as transformers'
    generate stops at them); `()` means no stop token.

    `prefix_cache=True` reuses the K/V of cached prefixes (module docstring); the result's
    `prefix_cache` and `cache` continue it: `generate(..., cache=r.cache, prefix_cache=r.prefix_cache)`
    hits what earlier calls computed. Without it the cache passed must hold no page at all.

    `kv_dtype` sets the arena's dtype when generate sizes it (no `layout` or `cache` given):
    default the model's dtype; "int8", "float8_e4m3fn" or "float8_e5m2" for an 8-bit arena
    (per-token scales, half the bytes of bf16). A given layout or cache brings its own.

    Many devices: give a `mesh` (the cache is created on it, `aj.create(..., mesh=mesh,
    tensor_axis=, data_axis=)`; single-device weights are placed on it first with
    `models.shard_model`), or a sharded `cache`. With a data axis of size dp, rows are split
    into dp blocks of batch_size / dp, each served by its data shard's slots and pages (no
    prefix cache there: its index would be per shard).

    `host_pages=N` adds a host-memory tier of N pages (module docstring): swap preemption, or
    with a prefix cache its spill tier; `host` continues an earlier result's tier (with its
    `cache`, and its `prefix_cache` if it had one); `swap_policy` overrides the cost model's
    constants (`models.SwapPolicy`). One data shard only.

    `mixed_steps=True`: an iteration with prompt tokens to feed runs one `mixed_step` that
    carries every decoding row's next token together with prompt chunks of `chunk_size`, as
    many as `token_budget` (tokens per step, default `batch_size + chunk_size`: one chunk) holds
    beside the `batch_size` decode tokens, so a long prompt arriving mid-run does not stall the
    running sequences for a whole batch-wide prefill. Same tokens as without (greedy and
    seeded sampling; up to float rounding of differently shaped products). With dp data
    shards every shard gets the same number of chunks per step, for its own rows: the budget's
    chunks are rounded down to a multiple of dp, and the default is one chunk per shard.
    Off by default: it lowers latency under arrivals, but an offline batch of equal-length
    prompts runs faster with batch-wide prefills (benchmarks/RESULTS.md, "Mixed steps").

    `arrivals` (seconds after the call starts, one per prompt, non-decreasing): an online
    workload; a prompt is admitted only once it has arrived. The result's `token_seconds`
    give each token's read-back time on the same clock (time to first token, inter-token
    latency: `arena-bench serve`).

    `decode_block=N` runs up to N decode steps in one device call while no request waits, no
    row prefills and there is no prefix cache (each row's sampled token fed back on the
    device; `models.scheduler.run_ahead`, "Decode blocks"): the host's work is paid once per N steps
    instead of every step. Same tokens (the block's steps are the same ops, bit for bit); a
    row's tokens after a stop token in the block are computed and discarded, and a block's
    tokens are read back together (`token_seconds`). Default None: `default_decode_block` (8;
    1 with `arrivals` or on a TPU); 1 turns blocks off. With `return_logits` every call runs
    one step (through the same program: no other compile).

    `on_token(i, token)` streams: it is called in the continuous-batching loop for each token
    of prompt i as soon as the host has read it back and kept it (in order per prompt, before
    generate returns; exactly the tokens of the result, a stop token included; none a decode
    block or run-ahead step computed past a stop). It runs on the host between device calls: a
    slow callback slows the run. An exception it raises ends the run and propagates.

    `speculative=models.PromptLookup(k=4)` decodes speculatively (models.speculative): each
    decode call feeds every row's last token and up to k tokens the proposer proposes (prompt
    lookup: what followed the last n tokens earlier in the sequence), keeps the ones the model
    agrees with and rolls the rest back in the same call. Greedy rows give exactly the tokens of
    plain decoding; sampled rows follow the standard rejection rule (the target model's
    distribution). Decode blocks and run-ahead are off while a row speculates (each call reads
    the accepted tokens back); the result counts `verify_calls`, `proposed_tokens`, `accepted_tokens`, and
    so do the cache's counters (`aj.health`: proposed_tokens, accepted_tokens, acceptance_rate).
    `speculate` (one bool per prompt; default all True) opts prompts out: a prompt given False
    gets no proposals and decodes plainly, in the same verify call as the others (a call whose
    decoding rows all opted out is a plain decode step).

    Token ids must be integers (Python or numpy; not floats, strings or bools) in
    [0, vocab_size); every bad argument is a ValueError naming it.
    """
    if not isinstance(model, Llama):
        raise ValueError(f"model must be a models.Llama (init_random, load_pretrained), got {type(model).__name__}")
    if on_token is not None and not callable(on_token):
        raise ValueError(f"on_token must be a callable (prompt index, token id), got {type(on_token).__name__}")
    if speculative is not None and not (callable(getattr(speculative, "propose", None))
                                        and isinstance(getattr(speculative, "k", None), int) and speculative.k >= 1):  # fmt: skip
        raise ValueError(f"speculative must be a proposer like models.PromptLookup(k=4) (propose(ids, limit), k >= 1), "
                         f"got {type(speculative).__name__}")  # fmt: skip
    if speculative is not None and hasattr(speculative, "check_target"):
        speculative.check_target(model)  # (models.DraftModel: the same vocabulary)
    sampling, serving, parallel, index = options_from_keywords(sampling, serving, parallel, options)
    batch_size, chunk_size, layout, kv_dtype = serving.batch_size, serving.chunk_size, serving.layout, serving.kv_dtype
    host_pages, swap_policy, token_budget, decode_block = serving.host_pages, serving.swap_policy, serving.token_budget, serving.decode_block
    mesh, tensor_axis, data_axis = parallel.mesh, parallel.tensor_axis, parallel.data_axis
    seed, stop_tokens, return_logits, top_k = sampling.seed, sampling.stop_tokens, sampling.return_logits, sampling.top_k
    vocab = model.config.vocab_size
    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts is a string; pass a list of token-id lists")
    try:
        prompts = list(prompts)
    except TypeError:  # None, an int, ...
        raise ValueError(f"prompts must be a sequence of token-id lists, got {type(prompts).__name__}") from None
    prompts = [token_ids(f"prompts[{i}]", p, vocab) for i, p in enumerate(prompts)]
    max_new_tokens = check_int("max_new_tokens", max_new_tokens)
    arrivals_given = arrivals is not None
    arrivals = _check_arrivals(arrivals, len(prompts))
    speculate = _check_speculate(speculate, len(prompts), speculative)
    if host is not None and not isinstance(host, aj.HostArena):
        raise ValueError(f"host must be an arena_jax.HostArena (an earlier Generation's .host), got {type(host).__name__}")
    if host is not None and (host_pages or cache is None):
        raise ValueError("give host (with the cache it belongs to) to continue a host tier, or host_pages to make one")
    stop = model.config.eos_token_ids if stop_tokens is None else token_ids("stop_tokens", stop_tokens, vocab)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompts[{i}] is empty")
    if top_k is not None and top_k > vocab:
        raise ValueError(f"top_k={top_k} exceeds vocab_size={vocab}")
    longest = max((len(p) for p in prompts), default=1) + max_new_tokens
    if kv_dtype is not None and cache is not None:  # (with a layout: Serving's check)
        raise ValueError("give kv_dtype only when generate sizes the arena: a layout or cache brings its own dtype")
    if index is not None and cache is None:
        raise ValueError("prefix_cache=<PrefixCache> needs the cache holding its pages: cache=<the earlier Generation>.cache")
    if cache is not None and not isinstance(cache, aj.KVCache):
        raise ValueError(f"cache must be an arena_jax.KVCache (e.g. an earlier Generation's .cache), got {type(cache).__name__}")
    tag = fingerprint(model) if serving.prefix_cache else None  # what the cached K/V were made by
    if cache is not None:
        from arena_jax.validate import check_cache_arrays

        layout = check_cache_arrays(cache)  # also: a cache donated to a later call is refused here
        num_free = int(fetch(cache.table.num_free)[0].sum())  # a [dp] array when data-parallel
        if bool(fetch(cache.table.active)[0].any()):
            raise ValueError("cache must hold no sequences (release them first): generate owns every slot")
        if index is not None:
            index.bind(cache, tag=tag, host=host)  # its arena, model and host tier; its held pages exactly the index's
            if num_free != layout.num_pages - index.num_pages:
                raise ValueError("cache has pages in use besides the prefix index's: generate owns every page")
        elif num_free != layout.num_pages:
            held = int(np.count_nonzero(fetch(cache.table.held)[0]))
            why = f" ({held} held by a prefix cache: pass its PrefixCache as prefix_cache)" if held else ""
            raise ValueError(f"cache must hold no pages{why}: generate owns every slot and page")
        if mesh is not None and (cache.sharding is None or cache.sharding.mesh.devices.tolist() != mesh.devices.tolist()):
            raise ValueError("mesh does not match the cache's: give one or the other")
    elif layout is None:  # bucketed: other lengths in the same bucket reuse the compiled steps
        layout = default_layout(model, batch_size, length_bucket(longest), dtype=kv_dtype)
    model = _on_mesh(model, cache.sharding.mesh if cache is not None and cache.sharding else mesh, tensor_axis)
    cfg = model.config
    for field, want in (("num_layers", cfg.num_layers), ("num_kv_heads", cfg.num_kv_heads), ("head_dim", cfg.head_dim)):
        if getattr(layout, field) != want:
            raise ValueError(f"the layout's {field}={getattr(layout, field)} does not match the model's {want}")
    if batch_size > layout.max_seqs:
        raise ValueError(f"batch_size={batch_size} exceeds the layout's max_seqs={layout.max_seqs}")
    if chunk_size is None:
        chunk_size = default_chunk_size(online=arrivals_given, mixed_steps=serving.mixed_steps,
                                        longest_prompt=max((len(p) for p in prompts), default=1))  # fmt: skip
    chunk_size = min(chunk_size, layout.max_seq_len)  # no sequence is longer: a longer chunk is pure padding
    if cache is None:
        if mesh is not None and data_axis is not None and data_axis not in mesh.shape:
            raise ValueError(f"data_axis={data_axis!r} is not an axis of the mesh {dict(mesh.shape)}")
        dp = mesh.shape[data_axis] if mesh is not None and data_axis else 1
    else:
        dp = cache.sharding.dp if cache.sharding is not None else 1
    mixed_chunks = 0
    if serving.mixed_steps:  # chunks per step: the same number on every data shard
        least = batch_size + dp * chunk_size
        budget = least if token_budget is None else token_budget
        if budget < least:
            shards = f" per data shard ({dp})" if dp > 1 else ""
            raise ValueError(
                f"token_budget={budget} must hold the batch's decode tokens (batch_size={batch_size}) plus at least "
                f"one prompt chunk (chunk_size={chunk_size}){shards}: at least {least}"
            )
        mixed_chunks = min(batch_size, (budget - batch_size) // chunk_size)
        mixed_chunks -= mixed_chunks % dp
    if serving.prefix_cache and dp > 1:
        raise ValueError(f"prefix_cache needs one data shard; this mesh has {dp} (an index per data shard is not built)")
    if (host_pages or host is not None) and dp > 1:
        raise ValueError(f"host_pages needs one data shard; this mesh has {dp} (a host tier per data shard is not built)")
    if host is not None and index is None:
        check_pair(cache, host)
        if fetch(host.held)[0].any():
            why = " (a prefix cache's host copies: pass its PrefixCache as prefix_cache)" if not serving.prefix_cache else ""
            raise ValueError(f"host must hold no pages{why}: generate owns every host page")
    if batch_size % dp or batch_size // dp > layout.max_seqs // dp:
        raise ValueError(
            f"batch_size={batch_size} must split into {dp} data shards (a multiple of {dp}) of at most "
            f"max_seqs / {dp} = {layout.max_seqs // dp} rows each"
        )
    if cache is None and mesh is not None:
        aj.CacheSharding.plan(layout, mesh, tensor_axis=tensor_axis, data_axis=data_axis)  # its errors before any work
    pages_per_shard = layout.num_pages // dp
    for i, p in enumerate(prompts):
        total = len(p) + max_new_tokens
        if total > layout.max_seq_len or layout.pages_for(total) > pages_per_shard:
            shard = " per data shard" if dp > 1 else ""
            raise ValueError(
                f"prompts[{i}] ({len(p)} tokens) + max_new_tokens={max_new_tokens} = {total} tokens does not fit "
                f"the arena (max_seq_len={layout.max_seq_len}, {pages_per_shard} pages of {layout.page_size}{shard})"
            )
    if cache is None:
        # Smoothed keys: factors from a calibration pass over the model, fixed before any request
        # (models.key_calibration): tokens never depend on scheduling or earlier tenants.
        factors = calibrate_key_factors(model) if layout.smooth_keys else None
        cache = aj.create(layout, key_factors=factors, **parallel.on_mesh)
    if host_pages:
        host = aj.create_host(cache, host_pages)
    if serving.prefix_cache and index is None:
        index = aj.PrefixCache(layout, tag=tag, host_pages=host.num_pages if host is not None else 0)
        index.bind(cache, host=host)
    tier = HostTier.beside(host, layout, swap_policy, index)
    if decode_block is None:
        decode_block = default_decode_block(cache, online=arrivals_given)

    seqs = [Seq(i, p, arrival=a, speculate=f) for i, (p, a, f) in enumerate(zip(prompts, arrivals, speculate))]
    runner = Scheduler(
        model, cache, layout, batch_size, chunk_size, sampling, seed, set(stop), max_new_tokens, return_logits, index,
        tier, mixed_chunks, decode_block,
    )
    runner.on_token = on_token
    if speculative is not None:
        if return_logits:
            raise ValueError("speculative decoding does not return logits: give return_logits=False (or no speculative)")
        runner.speculative = speculative
    start = runner.start = time.perf_counter()
    with CompileClock() as compiling:
        if max_new_tokens > 0:
            runner.run(seqs)
    seconds = time.perf_counter() - start
    logits = None
    if return_logits:
        logits = [np.stack(s.logits) if s.logits else np.zeros((0, vocab), np.float32) for s in seqs]
    return Generation(
        tokens=[s.generated for s in seqs],
        logits=logits,
        cache=runner.cache,
        preemptions=runner.preemptions,
        prefill_calls=runner.prefill_calls,
        decode_calls=runner.decode_calls,
        decode_steps=runner.decode_steps,
        discarded_tokens=runner.discarded_tokens,
        seconds=seconds,
        prefix_cache=index,
        prompt_tokens=runner.prompt_tokens,
        prefill_tokens=runner.prefill_tokens,
        prefix_hit_tokens=runner.hit_tokens,
        evictions=runner.evictions,
        first_token_seconds=[runner.first_token.get(s.index, float("nan")) for s in seqs],
        preempted=[s.preemptions for s in seqs],
        scheduler_steps=runner.iterations,
        host=tier.host if tier is not None else None,
        recomputed_tokens=runner.recomputed_tokens,
        swap_outs=tier.swap_outs if tier is not None else 0,
        swapped_tokens=tier.swapped_tokens if tier is not None else 0,
        modelled_transfer_seconds=tier.modelled_transfer_s if tier is not None else 0.0,
        run_ahead_steps=runner.run_ahead_steps,
        decode_step_seconds=runner.decode_step_seconds,
        mixed_calls=runner.mixed_calls,
        token_seconds=[s.times for s in seqs],
        compile_seconds=min(compiling.seconds, seconds),
        verify_calls=runner.verify_calls,
        proposed_tokens=runner.proposed_tokens,
        accepted_tokens=runner.accepted_tokens,
    )


# generate's prompt tokens a row per prefill call when not given (`default_chunk_size`).
OFFLINE_CHUNK_SIZE = 128
ONLINE_CHUNK_SIZE = 32


def default_chunk_size(online: bool = False, mixed_steps: bool = False, longest_prompt: int | None = None) -> int:
    """generate's prefill chunk when not given: up to 128 tokens a row per call, or 32 for an
    online workload (arrivals: a prompt that arrives mid-run stalls the running rows for a call,
    whose other rows are padding) or with mixed steps (a mixed step's size is the decode rows'
    latency). Given the longest prompt, no wider than it rounded up to a power of two (at least
    32): a chunk is computed whole, padding included, so short prompts keep chunks of 32.

    Every prefill call reads all of the model's weights, so chunks of 32 run a small batch's
    prefill at the weights' bandwidth: on a CPU, the mid model's prefill of one 512-token prompt
    took 0.68 s in chunks of 32 and 0.32 s in chunks of 128 (256 and 512: no faster; 8 prompts:
    2.53 -> 2.30 s); 32 prompts of 16 tokens + 128 new ran 1.27x slower with a chunk of 128 than
    of 32 (benchmarks/RESULTS.md, session 43)."""
    if online or mixed_steps:
        return ONLINE_CHUNK_SIZE
    if longest_prompt is None:
        return OFFLINE_CHUNK_SIZE
    return min(OFFLINE_CHUNK_SIZE, length_bucket(longest_prompt, ONLINE_CHUNK_SIZE))  # a power of two, at least 32


def default_decode_block(cache: aj.KVCache, online: bool = False) -> int:
    """generate's decode steps per call when not given: 8, or 1 for an online workload (every
    token read back as it is sampled) or a cache on a TPU, where XLA compiles the block program
    ~4x as long as one step (the sampler's full-vocabulary sort inside the block's loop: 23 s vs
    5 s for a Llama-3-8B-shaped step on v6e, deviceless; benchmarks/RESULTS.md)."""
    platform = next(iter(cache.k.devices())).platform
    return 1 if online or platform == "tpu" else 8


def _check_arrivals(arrivals, num_prompts: int) -> list[float]:
    """Arrival times: finite seconds >= 0, one per prompt, non-decreasing (the queue is FIFO)."""
    if arrivals is None:
        return [0.0] * num_prompts
    if isinstance(arrivals, (str, bytes)) or not hasattr(arrivals, "__len__"):
        raise ValueError(f"arrivals must be a sequence of seconds, one per prompt, got {type(arrivals).__name__}")
    if len(arrivals) != num_prompts:
        raise ValueError(f"arrivals has {len(arrivals)} entries for {num_prompts} prompts: give one per prompt")
    out = []
    for i, a in enumerate(arrivals):
        if isinstance(a, bool) or not isinstance(a, (int, float, np.integer, np.floating)) or not np.isfinite(a) or a < 0:
            raise ValueError(f"arrivals[{i}]={a!r} must be a finite number of seconds >= 0")
        if out and a < out[-1]:
            raise ValueError(f"arrivals[{i}]={a!r} is before arrivals[{i - 1}]={out[-1]!r}: arrivals must be non-decreasing")
        out.append(float(a))
    return out


def _check_speculate(speculate, num_prompts: int, speculative) -> list[bool]:
    """Per-prompt opt-outs of speculative decoding: bools, one per prompt (None: every prompt speculates)."""
    if speculate is None:
        return [True] * num_prompts
    if speculative is None:
        raise ValueError("speculate: per-prompt opt-outs need a proposer (give speculative=, e.g. models.PromptLookup(k=4))")
    if isinstance(speculate, (str, bytes)) or not hasattr(speculate, "__len__"):
        raise ValueError(f"speculate must be a sequence of bools, one per prompt, got {type(speculate).__name__}")
    if len(speculate) != num_prompts:
        raise ValueError(f"speculate has {len(speculate)} entries for {num_prompts} prompts: give one per prompt")
    for i, flag in enumerate(speculate):
        if not isinstance(flag, (bool, np.bool_)):
            raise ValueError(f"speculate[{i}]={flag!r} must be a bool (False: that prompt decodes without proposals)")
    return [bool(f) for f in speculate]


def _on_mesh(model: Llama, mesh, tensor_axis):
    """The model with its weights on `mesh` (placed there if they are on one device)."""
    from arena_jax.models.parallel import shard_model, weights_mesh

    placed = weights_mesh(model)
    if mesh is None:
        if placed is not None:
            raise ValueError("the model's weights are sharded over a mesh: pass mesh= (or a cache created on it)")
        return model
    if placed is None:
        return shard_model(model, mesh, tensor_axis=tensor_axis)
    if placed.devices.tolist() != mesh.devices.tolist():
        raise ValueError("the model's weights are on a different mesh than the cache's")
    return model
