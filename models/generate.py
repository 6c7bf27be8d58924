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
next prompt. Shapes never change, so nothing recompiles as sequences come and go.

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
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import arena_jax as aj
from models.checks import INT32_MIN, check_int, token_ids
from models.llama import Llama
from models.sampling import Sampling
from models.steps import decode_step, drop_page_rows, fork_page_rows, hold_page_rows, prefill, release_rows

__all__ = ["Generation", "generate", "default_layout"]


@dataclasses.dataclass
class Generation:
    """What `generate` returns."""

    tokens: list[list[int]]  # generated tokens per prompt, in prompt order
    logits: list[np.ndarray] | None  # per prompt f32[num_generated, V]: the logits each token was drawn from
    cache: aj.KVCache  # the cache afterwards (no sequence; with a prefix cache, its held pages); reusable
    preemptions: int = 0
    prefill_calls: int = 0
    decode_calls: int = 0
    seconds: float = 0.0
    prefix_cache: aj.PrefixCache | None = None  # the index of `cache`'s held pages (prefix_cache=...)
    prompt_tokens: int = 0  # tokens each admission had to bring into the cache (a recomputation's too)
    prefill_tokens: int = 0  # of those, the ones computed (the rest were prefix cache hits)
    prefix_hit_tokens: int = 0  # tokens mapped from the prefix cache at admissions
    evictions: int = 0  # pages the prefix cache evicted (LRU) for running sequences
    first_token_seconds: list[float] | None = None  # per prompt: from the call's start to its first token

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.seconds if self.seconds > 0 else float("nan")


@dataclasses.dataclass
class _Seq:
    index: int  # position in the prompt list; also keys its random draws
    prompt: list[int]
    generated: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    fed: int = 0  # tokens of prompt + generated whose K/V are in the cache
    admitted: int = -1  # admission order (for last-in-first-out preemption)
    # Prefix cache bookkeeping (see _Runner): the deepest index node this sequence locks, how many
    # of its mapped pages are indexed, the partly used hit page its first reserve copies, and how
    # many of its full pages were indexed.
    anchor: object = None
    in_index: int = 0
    cow_node: object = None
    indexed_full: int = 0

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def pending(self) -> int:
        return len(self.prompt) + len(self.generated) - self.fed


def default_layout(model: Llama, batch_size: int, max_total_len: int, *, page_size: int = 16, dtype=None) -> aj.KVLayout:
    """Enough pages for `batch_size` sequences of `max_total_len` tokens each."""
    pages_per_seq = -(-max_total_len // page_size)
    return model.config.kv_layout(
        page_size=page_size,
        num_pages=batch_size * pages_per_seq,
        max_seqs=batch_size,
        max_seq_len=pages_per_seq * page_size,
        dtype=model.dtype if dtype is None else dtype,
    )


def generate(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    batch_size: int = 4,
    chunk_size: int = 32,
    layout: aj.KVLayout | None = None,
    cache: aj.KVCache | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop_tokens: Sequence[int] | None = None,
    return_logits: bool = False,
    prefix_cache: bool | aj.PrefixCache = False,
) -> Generation:
    """Generate up to `max_new_tokens` for each prompt (lists of token ids).

    `batch_size` rows run at once (row r uses cache slot r); give `layout` (or a `cache`,
    reused and returned) to bound the arena, else it holds every row at full length.
    temperature 0 is greedy; top_k / top_p filter; `seed` (an int32) makes sampling reproducible.
    A sequence stops after a token in `stop_tokens` (kept in its output). The default, None,
    means the model's `config.eos_token_ids` (a checkpoint's eos tokens, as transformers'
    generate stops at them); `()` means no stop token.

    `prefix_cache=True` reuses the K/V of cached prefixes (module docstring); the result's
    `prefix_cache` and `cache` continue it: `generate(..., cache=r.cache, prefix_cache=r.prefix_cache)`
    hits what earlier calls computed. Without it the cache passed must hold no page at all.

    Token ids must be integers (Python or numpy; not floats, strings or bools) in
    [0, vocab_size); every bad argument is a ValueError naming it.
    """
    sampling = Sampling(temperature, top_k, top_p)
    vocab = model.config.vocab_size
    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts is a string; pass a list of token-id lists")
    prompts = [token_ids(f"prompts[{i}]", p, vocab) for i, p in enumerate(prompts)]
    max_new_tokens = check_int("max_new_tokens", max_new_tokens)
    batch_size = check_int("batch_size", batch_size, low=1)
    chunk_size = check_int("chunk_size", chunk_size, low=1)
    seed = check_int("seed", seed, low=INT32_MIN)
    stop = model.config.eos_token_ids if stop_tokens is None else token_ids("stop_tokens", stop_tokens, vocab)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompts[{i}] is empty")
    if top_k is not None and top_k > vocab:
        raise ValueError(f"top_k={top_k} exceeds vocab_size={vocab}")
    longest = max((len(p) for p in prompts), default=1) + max_new_tokens
    if not isinstance(prefix_cache, (bool, aj.PrefixCache)):
        raise ValueError(f"prefix_cache must be a bool or an arena_jax.PrefixCache, got {type(prefix_cache).__name__}")
    index = prefix_cache if isinstance(prefix_cache, aj.PrefixCache) else None
    if index is not None and cache is None:
        raise ValueError("prefix_cache=<PrefixCache> needs the cache holding its pages: cache=<the earlier Generation>.cache")
    if cache is not None:
        layout = cache.layout
        if bool(np.asarray(cache.table.active).any()):
            raise ValueError("cache must hold no sequences (release them first): generate owns every slot")
        if index is not None:
            index.check(cache)  # its held pages are exactly the index's
            if int(cache.table.num_free) != layout.num_pages - index.num_pages:
                raise ValueError("cache has pages in use besides the prefix index's: generate owns every page")
        elif int(cache.table.num_free) != layout.num_pages:
            held = int(np.count_nonzero(np.asarray(cache.table.held)))
            why = f" ({held} held by a prefix cache: pass its PrefixCache as prefix_cache)" if held else ""
            raise ValueError(f"cache must hold no pages{why}: generate owns every slot and page")
    elif layout is None:
        layout = default_layout(model, batch_size, longest)
    cfg = model.config
    for field, want in (("num_layers", cfg.num_layers), ("num_kv_heads", cfg.num_kv_heads), ("head_dim", cfg.head_dim)):
        if getattr(layout, field) != want:
            raise ValueError(f"the layout's {field}={getattr(layout, field)} does not match the model's {want}")
    if batch_size > layout.max_seqs:
        raise ValueError(f"batch_size={batch_size} exceeds the layout's max_seqs={layout.max_seqs}")
    chunk_size = min(chunk_size, layout.max_seq_len)  # no sequence is longer: a longer chunk is pure padding
    for i, p in enumerate(prompts):
        total = len(p) + max_new_tokens
        if total > layout.max_seq_len or layout.pages_for(total) > layout.num_pages:
            raise ValueError(
                f"prompts[{i}] ({len(p)} tokens) + max_new_tokens={max_new_tokens} = {total} tokens does not fit "
                f"the arena (max_seq_len={layout.max_seq_len}, {layout.num_pages} pages of {layout.page_size})"
            )
    if cache is None:
        cache = aj.create(layout)
    if prefix_cache is True:
        index = aj.PrefixCache(layout)

    seqs = [_Seq(i, p) for i, p in enumerate(prompts)]
    runner = _Runner(
        model, cache, layout, batch_size, chunk_size, sampling, seed, set(stop), max_new_tokens, return_logits, index
    )
    start = runner.start = time.perf_counter()
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
        seconds=seconds,
        prefix_cache=index,
        prompt_tokens=runner.prompt_tokens,
        prefill_tokens=runner.prefill_tokens,
        prefix_hit_tokens=runner.hit_tokens,
        evictions=runner.evictions,
        first_token_seconds=[runner.first_token.get(s.index, float("nan")) for s in seqs],
    )


class _Runner:
    """The host-side scheduler: rows, queue, page accounting. Device work is the jitted steps.

    With a prefix index, the host keeps an exact count of the pages in use: the index's pages
    (the cache's holds) plus, per running sequence, its mapped pages that are not indexed
    (`pages_for(fed) - in_index`: they are its own). It is checked against the device's
    `num_free` by the tests (`CHECK_ACCOUNTING`).
    """

    CHECK_ACCOUNTING = False  # tests: compare the host's page count with the device's after each step

    def __init__(self, model, cache, layout, batch_size, chunk_size, sampling, seed, stop, max_new, return_logits,
                 index=None):  # fmt: skip
        self.graphdef, self.state = nnx.split(model)
        self.cache, self.layout = cache, layout
        self.batch, self.chunk = batch_size, chunk_size
        self.sampling = sampling.rows(batch_size)  # arrays: greedy and sampled runs share one compile
        self.seed = jnp.asarray(seed, jnp.int32)
        self.stop, self.max_new, self.return_logits = stop, max_new, return_logits
        self.rows: list[_Seq | None] = [None] * batch_size
        self.preemptions = self.prefill_calls = self.decode_calls = 0
        self.prompt_tokens = self.prefill_tokens = self.hit_tokens = self.evictions = 0
        self.first_token: dict[int, float] = {}
        self.start = time.perf_counter()
        self._admissions = 0
        self._to_release: list[int] = []
        self.index = index
        self._holds: list[tuple[int, int]] = []  # (page, tokens) the cache must hold, before any release
        self._drops: list[int] = []  # pages whose holds go, after the releases
        self._page_rows: np.ndarray | None = None  # page_map as of the last step

    # ---- bookkeeping --------------------------------------------------------------------
    def _running(self):
        return [s for s in self.rows if s is not None]

    def _free_pages(self) -> int:
        """Pages not claimed by running sequences, each counted at its full length to be fed
        (a row still prefilling will take them; a decoding row its next token's page). With a
        prefix index: minus the index's pages, plus those it could evict."""
        if self.index is None:
            used = sum(self.layout.pages_for(len(s.ids)) for s in self._running())
            return self.layout.num_pages - used
        claims = sum(self.layout.pages_for(len(s.ids)) - s.in_index + (s.cow_node is not None) for s in self._running())
        return self.layout.num_pages - self.index.num_pages - claims + self.index.evictable_pages

    def _pages_in_use(self) -> int:
        """Prefix mode: exactly the device's pages in use, once pending releases are flushed."""
        private = sum(self.layout.pages_for(s.fed) - s.in_index for s in self._running())
        return self.index.num_pages + private

    def _admit(self, waiting: collections.deque) -> None:
        fork = []  # (row, hit)
        for r in range(self.batch):
            if not waiting:
                break
            if self.rows[r] is not None:
                continue
            seq = waiting[0]
            running = len(self._running())
            hit = self.index.lookup(seq.ids, limit=len(seq.ids) - 1) if self.index is not None else None
            need = self.layout.pages_for(len(seq.ids) + 1)
            free = self._free_pages()
            if hit is not None:  # its full pages are there already; the pages it locks cannot be evicted
                need -= hit.num_tokens // self.layout.page_size
                free -= sum(1 for n in hit.nodes if not n.locks)
            # Watermark: room for this sequence plus one page of growth per running sequence.
            if need + running > free and running:
                break
            waiting.popleft()
            seq.fed, seq.admitted = 0, self._admissions
            self._admissions += 1
            self.rows[r] = seq
            self.prompt_tokens += len(seq.ids)
            if hit is not None:
                seq.anchor = self.index.acquire(hit, len(seq.ids))
                seq.fed, seq.in_index = hit.num_tokens, len(hit.nodes)
                seq.cow_node = hit.nodes[-1] if hit.num_tokens % self.layout.page_size else None
                seq.indexed_full = hit.num_tokens // self.layout.page_size
                self.hit_tokens += hit.num_tokens
                if hit.num_tokens:
                    fork.append((r, hit))
            self.prefill_tokens += len(seq.ids) - seq.fed
        if fork:
            pages = np.full((self.batch, self.layout.max_pages_per_seq), aj.PAD_PAGE, np.int32)
            counts = np.zeros((self.batch,), np.int32)
            dst = np.full((self.batch,), aj.PAD_SLOT, np.int32)
            for r, hit in fork:
                pages[r, : len(hit.pages)], counts[r], dst[r] = hit.pages, hit.num_tokens, r
            self.cache = fork_page_rows(self.cache, jnp.asarray(pages), jnp.asarray(counts), jnp.asarray(dst))

    def _vacate(self, r: int) -> None:
        seq = self.rows[r]
        if self.index is not None:  # index everything it wrote (a partly filled last page too)
            if seq.fed:
                self._index(seq, self._page_rows[r], seq.fed)
            self.index.unlock(seq.anchor)
            seq.anchor, seq.in_index, seq.cow_node, seq.indexed_full = None, 0, None, 0
        self.rows[r] = None
        self._to_release.append(r)

    def _index(self, seq: _Seq, row: np.ndarray, num_tokens: int):
        ins = self.index.insert(seq.ids[:num_tokens], row[: self.layout.pages_for(num_tokens)])
        self._holds += ins.hold
        self._drops += ins.drop
        return ins

    def _flush(self) -> None:
        """Holds first (a finished sequence's pages are held before its slot lets them go),
        then releases, then dropped holds. Fixed shapes: one compile each."""
        width = self.batch * self.layout.max_pages_per_seq
        while self._holds:
            part, self._holds = self._holds[:width], self._holds[width:]
            pages = np.full((width,), aj.PAD_PAGE, np.int32)
            counts = np.ones((width,), np.int32)
            pages[: len(part)], counts[: len(part)] = zip(*part)
            self.cache = hold_page_rows(self.cache, jnp.asarray(pages), jnp.asarray(counts))
        if self._to_release:
            slots = np.full((self.batch,), aj.PAD_SLOT, np.int32)
            slots[self._to_release] = self._to_release
            self.cache = release_rows(self.cache, jnp.asarray(slots))
            self._to_release = []
        while self._drops:
            part, self._drops = self._drops[:width], self._drops[width:]
            pages = np.full((width,), aj.PAD_PAGE, np.int32)
            pages[: len(part)] = part
            self.cache = drop_page_rows(self.cache, jnp.asarray(pages))

    def _make_room(self, rows: list[int], counts) -> None:
        """Prefix mode, before a step: evict what the step's reservations need beyond the free pages."""
        size = self.layout.page_size
        demand = 0
        for r, n in zip(rows, counts):
            s = self.rows[r]
            demand += -(-(s.fed + n) // size) - -(-s.fed // size) + (s.cow_node is not None and n > 0)
        self._evict(demand - (self.layout.num_pages - self._pages_in_use()))

    def _evict(self, num_pages: int) -> int:
        pages = self.index.evict(num_pages) if num_pages > 0 else []
        self.evictions += len(pages)
        self._drops += pages
        self._flush()
        return len(pages)

    def _preempt(self, waiting: collections.deque) -> None:
        """Release the most recently admitted running sequence and requeue it first."""
        r = max((r for r, s in enumerate(self.rows) if s is not None), key=lambda r: self.rows[r].admitted)
        seq = self.rows[r]
        self._vacate(r)
        seq.fed = 0
        self._flush()
        waiting.appendleft(seq)
        self.preemptions += 1

    def _accept(self, r: int, token: int, logits) -> None:
        seq = self.rows[r]
        seq.generated.append(token)
        if len(seq.generated) == 1:
            self.first_token[seq.index] = time.perf_counter() - self.start
        if logits is not None:
            seq.logits.append(logits)
        if token in self.stop or len(seq.generated) >= self.max_new:
            self._vacate(r)

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, seqs: list[_Seq]) -> None:
        waiting = collections.deque(seqs)
        while waiting or any(s is not None for s in self.rows):
            self._flush()
            self._admit(waiting)
            if not any(s is not None for s in self.rows):
                raise RuntimeError("no sequence could be admitted")  # excluded by generate's size checks
            failed = False
            if any(s is not None and s.pending > 1 for s in self.rows):
                failed |= self._prefill()
            if any(s is not None and s.pending == 1 for s in self.rows):
                failed |= self._decode()
            if failed:
                # Pages only the cache holds go before any running sequence (at least one: the
                # host's count said the step would fit, so it must be short of the device's).
                if not (self.index is not None and self.index.evictable_pages and self._evict(1)):
                    self._preempt(waiting)
        self._flush()

    def _prefill(self) -> bool:
        self._flush()  # pages of sequences that just finished are free for this step
        tokens = np.zeros((self.batch, self.chunk), np.int32)
        slots = np.full((self.batch,), aj.PAD_SLOT, np.int32)
        counts = np.zeros((self.batch,), np.int32)
        seq_ids = np.zeros((self.batch,), np.int32)
        for r, s in enumerate(self.rows):
            if s is not None and s.pending > 1:
                piece = s.ids[s.fed : s.fed + self.chunk]
                tokens[r, : len(piece)] = piece
                slots[r], counts[r], seq_ids[r] = r, len(piece), s.index
        if self.index is not None:
            live = np.flatnonzero(slots >= 0)
            self._make_room(live.tolist(), counts[live].tolist())
        out = prefill(
            self.graphdef, self.state, self.cache, jnp.asarray(tokens), jnp.asarray(slots), jnp.asarray(counts),
            jnp.asarray(seq_ids), self.seed, self.sampling,
        )  # fmt: skip
        self.cache = out.cache
        self.prefill_calls += 1
        return self._collect(out, slots, counts)

    def _decode(self) -> bool:
        self._flush()
        tokens = np.zeros((self.batch,), np.int32)
        slots = np.full((self.batch,), aj.PAD_SLOT, np.int32)
        seq_ids = np.zeros((self.batch,), np.int32)
        for r, s in enumerate(self.rows):
            if s is not None and s.pending == 1:
                tokens[r], slots[r], seq_ids[r] = s.ids[-1], r, s.index
        if self.index is not None:
            live = np.flatnonzero(slots >= 0)
            self._make_room(live.tolist(), [1] * len(live))
        out = decode_step(
            self.graphdef, self.state, self.cache, jnp.asarray(tokens), jnp.asarray(slots), jnp.asarray(seq_ids),
            self.seed, sampling=self.sampling,
        )  # fmt: skip
        self.cache = out.cache
        self.decode_calls += 1
        return self._collect(out, slots, (slots >= 0).astype(np.int32))

    def _collect(self, out, slots, counts) -> bool:
        """Advance the rows the step served; True when some row was refused for lack of pages."""
        if self.index is not None:  # the page table rows travel with the sampled tokens
            ok, next_tokens, self._page_rows = jax.device_get((out.ok, out.tokens, out.cache.table.page_map))
        else:
            ok, next_tokens = jax.device_get((out.ok, out.tokens))
        logits = jax.device_get(out.logits) if self.return_logits else None
        failed = False
        for r in np.flatnonzero(slots >= 0):
            seq = self.rows[r]
            if not ok[r]:
                failed = True
                continue
            seq.fed += int(counts[r])
            if self.index is not None:
                self._index_running(seq, r)
            if seq.pending == 0:  # the whole sequence is in the cache: the sample is its next token
                self._accept(r, int(next_tokens[r]), None if logits is None else logits[r])
        if self.index is not None and self.CHECK_ACCOUNTING:
            self._flush()
            in_use = self.layout.num_pages - int(self.cache.table.num_free)
            assert in_use == self._pages_in_use(), f"host counts {self._pages_in_use()} pages in use, device {in_use}"
        return failed

    def _index_running(self, seq: _Seq, r: int) -> None:
        """After a served step: the partly used hit page was copied; newly full pages are indexed."""
        if seq.cow_node is not None:  # reserve gave the slot its own copy of the hit's last page
            parent = seq.cow_node.parent
            new_anchor = None if parent is self.index.root else parent
            self.index.relock(seq.anchor, new_anchor)
            seq.anchor, seq.cow_node = new_anchor, None
            seq.in_index -= 1
        full = seq.fed // self.layout.page_size
        if full > seq.indexed_full:
            ins = self._index(seq, self._page_rows[r], full * self.layout.page_size)
            if ins.nodes:
                self.index.relock(seq.anchor, ins.nodes[-1])
                seq.anchor = ins.nodes[-1]
            seq.in_index = len(ins.nodes)
            seq.indexed_full = full
