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
from models.steps import decode_step, prefill, release_rows

__all__ = ["Generation", "generate", "default_layout"]


@dataclasses.dataclass
class Generation:
    """What `generate` returns."""

    tokens: list[list[int]]  # generated tokens per prompt, in prompt order
    logits: list[np.ndarray] | None  # per prompt f32[num_generated, V]: the logits each token was drawn from
    cache: aj.KVCache  # the cache afterwards (every page released); reusable
    preemptions: int = 0
    prefill_calls: int = 0
    decode_calls: int = 0
    seconds: float = 0.0

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

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def pending(self) -> int:
        return len(self.prompt) + len(self.generated) - self.fed


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
    kv_dtype=None,
    mesh=None,
    tensor_axis: str | None = "tensor",
    data_axis: str | None = None,
) -> Generation:
    """Generate up to `max_new_tokens` for each prompt (lists of token ids).

    `batch_size` rows run at once (row r uses cache slot r); give `layout` (or a `cache`,
    reused and returned) to bound the arena, else it holds every row at full length.
    temperature 0 is greedy; top_k / top_p filter; `seed` (an int32) makes sampling reproducible.
    A sequence stops after a token in `stop_tokens` (kept in its output). The default, None,
    means the model's `config.eos_token_ids` (a checkpoint's eos tokens, as transformers'
    generate stops at them); `()` means no stop token.

    `kv_dtype` sets the arena's dtype when generate sizes it (no `layout` or `cache` given):
    default the model's dtype; "int8", "float8_e4m3fn" or "float8_e5m2" for an 8-bit arena
    (per-token scales, half the bytes of bf16). A given layout or cache brings its own.

    Token ids must be integers (Python or numpy; not floats, strings or bools) in
    [0, vocab_size); every bad argument is a ValueError naming it.

    Many devices: give a `mesh` (the cache is created on it, `aj.create(..., mesh=mesh,
    tensor_axis=, data_axis=)`; single-device weights are placed on it first with
    `models.shard_model`), or a sharded `cache`. With a data axis of size dp, rows are split
    into dp blocks of batch_size / dp, each served by its data shard's slots and pages.
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
    if kv_dtype is not None and (layout is not None or cache is not None):
        raise ValueError("give kv_dtype only when generate sizes the arena: a layout or cache brings its own dtype")
    if cache is not None:
        layout = cache.layout
        if bool(_fetch(cache.table.active).any()) or int(_fetch(cache.table.num_free).sum()) != layout.num_pages:
            raise ValueError("cache must hold no sequences (release them first): generate owns every slot and page")
        if mesh is not None and (cache.sharding is None or cache.sharding.mesh.devices.tolist() != mesh.devices.tolist()):
            raise ValueError("mesh does not match the cache's: give one or the other")
    elif layout is None:
        layout = default_layout(model, batch_size, longest, dtype=kv_dtype)
    model = _on_mesh(model, cache.sharding.mesh if cache is not None and cache.sharding else mesh, tensor_axis)
    cfg = model.config
    for field, want in (("num_layers", cfg.num_layers), ("num_kv_heads", cfg.num_kv_heads), ("head_dim", cfg.head_dim)):
        if getattr(layout, field) != want:
            raise ValueError(f"the layout's {field}={getattr(layout, field)} does not match the model's {want}")
    if batch_size > layout.max_seqs:
        raise ValueError(f"batch_size={batch_size} exceeds the layout's max_seqs={layout.max_seqs}")
    if cache is None:
        if mesh is not None:
            aj.CacheSharding.plan(layout, mesh, tensor_axis=tensor_axis, data_axis=data_axis)  # its errors first
        dp = mesh.shape[data_axis] if mesh is not None and data_axis else 1
    else:
        dp = cache.sharding.dp if cache.sharding is not None else 1
    if batch_size % dp or batch_size // dp > layout.max_seqs // dp:
        raise ValueError(
            f"batch_size={batch_size} must split into {dp} data shards of at most max_seqs / {dp} = "
            f"{layout.max_seqs // dp} rows each"
        )
    pages_per_shard = layout.num_pages // dp
    chunk_size = min(chunk_size, layout.max_seq_len)  # no sequence is longer: a longer chunk is pure padding
    for i, p in enumerate(prompts):
        total = len(p) + max_new_tokens
        if total > layout.max_seq_len or layout.pages_for(total) > pages_per_shard:
            shard = " per data shard" if dp > 1 else ""
            raise ValueError(
                f"prompts[{i}] ({len(p)} tokens) + max_new_tokens={max_new_tokens} = {total} tokens does not fit "
                f"the arena (max_seq_len={layout.max_seq_len}, {pages_per_shard} pages of {layout.page_size}{shard})"
            )
    if cache is None:
        cache = aj.create(layout) if mesh is None else aj.create(layout, mesh=mesh, tensor_axis=tensor_axis, data_axis=data_axis)

    seqs = [_Seq(i, p) for i, p in enumerate(prompts)]
    runner = _Runner(
        model, cache, layout, batch_size, chunk_size, sampling, seed, set(stop), max_new_tokens, return_logits
    )
    start = time.perf_counter()
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
    )


def _fetch(x) -> np.ndarray:
    """A device array on the host, whole (gathered from the other processes of a multi-host mesh)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _on_mesh(model: Llama, mesh, tensor_axis):
    """The model with its weights on `mesh` (placed there if they are on one device)."""
    from models.parallel import shard_model, weights_mesh

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


class _Runner:
    """The host-side scheduler: rows, queue, page accounting. Device work is the jitted steps.

    With dp data shards, row r belongs to shard r // (batch / dp) and uses that shard's slot
    `shard * max_seqs / dp + r % (batch / dp)`; pages are counted per shard."""

    def __init__(self, model, cache, layout, batch_size, chunk_size, sampling, seed, stop, max_new, return_logits):
        self.graphdef, self.state = nnx.split(model)
        self.cache, self.layout = cache, layout
        self.batch, self.chunk = batch_size, chunk_size
        self.dp = cache.sharding.dp if cache.sharding is not None else 1
        self.rows_per_shard = batch_size // self.dp
        self.pages_per_shard = layout.num_pages // self.dp
        self.slot_of = [(r // self.rows_per_shard) * (layout.max_seqs // self.dp) + r % self.rows_per_shard
                        for r in range(batch_size)]  # fmt: skip
        self.sampling = sampling.rows(batch_size)  # arrays: greedy and sampled runs share one compile
        self.seed = jnp.asarray(seed, jnp.int32)
        self.stop, self.max_new, self.return_logits = stop, max_new, return_logits
        self.rows: list[_Seq | None] = [None] * batch_size
        self.preemptions = self.prefill_calls = self.decode_calls = 0
        self._admissions = 0
        self._to_release: list[int] = []

    # ---- bookkeeping --------------------------------------------------------------------
    def _shard_rows(self, shard: int) -> list:
        return self.rows[shard * self.rows_per_shard : (shard + 1) * self.rows_per_shard]

    def _free_pages(self, shard: int = 0) -> int:
        """Pages of a data shard not claimed by its running sequences, each counted at its full
        length to be fed (a row still prefilling will take them; a decoding row its next token's page)."""
        used = sum(self.layout.pages_for(len(s.ids)) for s in self._shard_rows(shard) if s is not None)
        return self.pages_per_shard - used

    def _admit(self, waiting: collections.deque) -> None:
        for r in range(self.batch):
            if not waiting:
                return
            if self.rows[r] is not None:
                continue
            seq = waiting[0]
            shard = r // self.rows_per_shard
            running = sum(s is not None for s in self._shard_rows(shard))
            # Watermark: room for this sequence plus one page of growth per running sequence.
            if self.layout.pages_for(len(seq.ids) + 1) + running > self._free_pages(shard) and running:
                continue  # (one shard: every later row would answer the same)
            waiting.popleft()
            seq.fed, seq.admitted = 0, self._admissions
            self._admissions += 1
            self.rows[r] = seq

    def _vacate(self, r: int) -> None:
        self.rows[r] = None
        self._to_release.append(r)

    def _flush_releases(self) -> None:
        if self._to_release:
            slots = np.full((self.batch,), aj.PAD_SLOT, np.int32)
            slots[self._to_release] = [self.slot_of[r] for r in self._to_release]
            self.cache = release_rows(self.cache, jnp.asarray(slots))
            self._to_release = []

    def _preempt(self, waiting: collections.deque, shard: int = 0) -> None:
        """Release the most recently admitted running sequence of a data shard and requeue it first."""
        rows = range(shard * self.rows_per_shard, (shard + 1) * self.rows_per_shard)
        r = max((r for r in rows if self.rows[r] is not None), key=lambda r: self.rows[r].admitted)
        seq = self.rows[r]
        seq.fed = 0
        self._vacate(r)
        self._flush_releases()
        waiting.appendleft(seq)
        self.preemptions += 1

    def _accept(self, r: int, token: int, logits) -> None:
        seq = self.rows[r]
        seq.generated.append(token)
        if logits is not None:
            seq.logits.append(logits)
        if token in self.stop or len(seq.generated) >= self.max_new:
            self._vacate(r)

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, seqs: list[_Seq]) -> None:
        waiting = collections.deque(seqs)
        while waiting or any(s is not None for s in self.rows):
            self._flush_releases()
            self._admit(waiting)
            if not any(s is not None for s in self.rows):
                raise RuntimeError("no sequence could be admitted")  # excluded by generate's size checks
            failed = set()  # data shards that refused a row for lack of pages
            if any(s is not None and s.pending > 1 for s in self.rows):
                failed |= self._prefill()
            if any(s is not None and s.pending == 1 for s in self.rows):
                failed |= self._decode()
            for shard in sorted(failed):
                self._preempt(waiting, shard)
        self._flush_releases()

    def _prefill(self) -> set:
        tokens = np.zeros((self.batch, self.chunk), np.int32)
        slots = np.full((self.batch,), aj.PAD_SLOT, np.int32)
        counts = np.zeros((self.batch,), np.int32)
        seq_ids = np.zeros((self.batch,), np.int32)
        for r, s in enumerate(self.rows):
            if s is not None and s.pending > 1:
                piece = s.ids[s.fed : s.fed + self.chunk]
                tokens[r, : len(piece)] = piece
                slots[r], counts[r], seq_ids[r] = self.slot_of[r], len(piece), s.index
        out = prefill(
            self.graphdef, self.state, self.cache, jnp.asarray(tokens), jnp.asarray(slots), jnp.asarray(counts),
            jnp.asarray(seq_ids), self.seed, self.sampling,
        )  # fmt: skip
        self.cache = out.cache
        self.prefill_calls += 1
        return self._collect(out, slots, counts)

    def _decode(self) -> set:
        tokens = np.zeros((self.batch,), np.int32)
        slots = np.full((self.batch,), aj.PAD_SLOT, np.int32)
        seq_ids = np.zeros((self.batch,), np.int32)
        for r, s in enumerate(self.rows):
            if s is not None and s.pending == 1:
                tokens[r], slots[r], seq_ids[r] = s.ids[-1], self.slot_of[r], s.index
        out = decode_step(
            self.graphdef, self.state, self.cache, jnp.asarray(tokens), jnp.asarray(slots), jnp.asarray(seq_ids),
            self.seed, sampling=self.sampling,
        )  # fmt: skip
        self.cache = out.cache
        self.decode_calls += 1
        return self._collect(out, slots, (slots >= 0).astype(np.int32))

    def _collect(self, out, slots, counts) -> set:
        """Advance the rows the step served; the data shards where a row was refused for lack of pages."""
        ok, next_tokens = _fetch(out.ok), _fetch(out.tokens)
        logits = _fetch(out.logits) if self.return_logits else None
        failed = set()
        for r in np.flatnonzero(slots >= 0):
            seq = self.rows[r]
            if not ok[r]:
                failed.add(int(r) // self.rows_per_shard)
                continue
            seq.fed += int(counts[r])
            if seq.pending == 0:  # the whole sequence is in the cache: the sample is its next token
                self._accept(r, int(next_tokens[r]), None if logits is None else logits[r])
        return failed
