"""`DraftModel`: a speculative-decoding proposer that runs a smaller model of the same family and
tokenizer in its own arena (issue 43, item 2b).

For each decoding row the target model's verify call (`models.speculative`) needs up to k
proposed tokens. The draft proposes them greedily: it feeds the tokens of the row's sequence it
has not seen yet (one prefill call for all rows, chunks of `chunk_size`) and then runs up to
k - 1 decode steps in one call (`decode_block`), one read-back for the batch. Greedy proposals
are point masses, so the verify step's rejection rule keeps the target model's distribution for
sampled rows too; greedy rows get exactly plain decoding's tokens whatever the draft proposes.

Rollback without bookkeeping: the draft row r keeps the list of tokens its cache holds
(`fed[r]`). A key and value depend only on the tokens before them, so on the next call the row is
truncated (`aj.truncate`: pages that empty are freed, the watermark makes the tail unreadable) to
the longest common prefix of what it holds and the row's sequence now: the rejected proposals go,
the accepted ones stay, and a new sequence in the same scheduler row starts over (or keeps a
shared prompt prefix). No sequence identity is needed.

    draft = models.init_random(models.LlamaConfig.tiny(num_layers=1), seed=0)  # or load_pretrained
    out = models.generate(target, prompts, 64, speculative=models.DraftModel(draft, k=4))
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import arena_jax as aj

__all__ = ["DraftModel", "first_layers"]


@functools.partial(jax.jit, donate_argnames=("cache",))
def _truncate_rows(cache: aj.KVCache, slots, lengths) -> aj.KVCache:
    """`aj.truncate` with fixed shapes (PAD_SLOT rows untouched): inside a jit it is total."""
    return aj.truncate(cache, slots, lengths)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def first_layers(model, num_layers: int):
    """A draft for `model`: its first `num_layers` layers with its own embeddings, final norm and
    head (the weights are `model`'s arrays, sliced for stacked layers: nothing is trained or
    copied on the host). A cheap draft that agrees with its target often, and the one
    `arena-bench speculative --draft-layers N` measures."""
    from flax import nnx

    from arena_jax.models.llama import Llama

    if not isinstance(model, Llama):
        raise ValueError(f"first_layers: model must be a models.Llama, got {type(model).__name__}")
    total = model.config.num_layers
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not 1 <= num_layers <= total:
        raise ValueError(f"first_layers: num_layers must be an integer in [1, {total}], got {num_layers!r}")
    types = model.config.layer_types
    config = dataclasses.replace(model.config, num_layers=num_layers,
                                 layer_types=None if types is None else tuple(types)[:num_layers])  # fmt: skip
    _, state = nnx.split(model)
    mine = {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(state)}
    param_dtype = jax.tree_util.tree_leaves(state)[0].dtype
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(
        config, dtype=model.dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0), scan_layers=model.scan_layers)))

    def take(path, want):
        leaf = mine[jax.tree_util.keystr(path)]
        return leaf if leaf.shape == want.shape else leaf[:num_layers]  # stacked layers: [L, ...] -> [n, ...]

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(take, abstract))


class DraftModel:
    """Propose with a draft model: greedy, up to `k` tokens per row per verify call.

    model: a `models.Llama` sharing the target's tokenizer (same vocabulary size; checked by
    `generate`); `max_len`: tokens a row of the draft's arena holds (a row whose sequence plus k
    does not fit gets no proposals: it decodes plainly in the same verify call); `page_size` and
    `kv_dtype` (default: the model's dtype) of the draft's arena; `chunk_size`: tokens per row
    per prefill call when the draft catches up on a sequence (a new prompt: ceil(len / chunk_size)
    calls, once; afterwards 1-2 tokens per verify). The arena is created on the first call,
    one row per scheduler row, and kept across `generate` calls with as many rows or fewer."""

    def __init__(self, model, k: int = 4, *, max_len: int = 1024, page_size: int = 16, chunk_size: int = 8,
                 kv_dtype=None):  # fmt: skip
        from arena_jax.models.llama import Llama

        if not isinstance(model, Llama):
            raise ValueError(f"DraftModel: model must be a models.Llama (init_random, load_pretrained), "
                             f"got {type(model).__name__}")  # fmt: skip
        for name, value, low in (("k", k, 1), ("max_len", max_len, 2), ("page_size", page_size, 1),
                                 ("chunk_size", chunk_size, 1)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"DraftModel: {name} must be an integer >= {low}, got {value!r}")
        self.model, self.k, self.max_len, self.page_size, self.chunk_size = model, k, max_len, page_size, chunk_size
        self.kv_dtype = kv_dtype
        self.cache: aj.KVCache | None = None
        self.fed: list[list[int]] = []  # per arena row: the tokens its cache holds
        self.calls = 0  # draft model calls (prefill + decode block), for reports

    def check_target(self, target) -> None:
        """generate calls this: the draft must speak the target's vocabulary."""
        mine, theirs = self.model.config.vocab_size, target.config.vocab_size
        if mine != theirs:
            raise ValueError(f"speculative: the DraftModel's vocab_size {mine} differs from the model's {theirs} "
                             f"(the draft must share the target's tokenizer)")  # fmt: skip

    def propose(self, ids: list[int], limit: int) -> list[int]:
        """One sequence's proposals (arena row 0): `propose_rows([(ids, limit)])[0]`."""
        return self.propose_rows([(ids, limit)])[0]

    def _arena(self, rows: int) -> None:
        if self.cache is not None and self.cache.layout.max_seqs >= rows:
            return
        from flax import nnx

        from arena_jax.models.generate import default_layout
        from arena_jax.models.steps import bound_steps

        layout = default_layout(self.model, rows, self.max_len, page_size=self.page_size, dtype=self.kv_dtype)
        self.cache = aj.create(layout)
        self.steps = bound_steps(*nnx.split(self.model))
        self.fed = [[] for _ in range(layout.max_seqs)]

    def propose_rows(self, requests: list) -> list[list[int]]:
        """requests[r]: (ids: the row's prompt + generated tokens, limit: most proposals it may
        take) or None (the row does not decode now). Returns each row's proposals (up to
        min(k, limit) tokens; [] for None rows and rows that do not fit the draft's arena)."""
        self._arena(len(requests))
        rows = self.cache.layout.max_seqs
        want = np.zeros((rows,), np.int32)  # proposals per row
        start = np.zeros((rows,), np.int32)  # where its unseen tokens start
        for r, request in enumerate(requests):
            if request is None:
                continue
            ids, limit = list(request[0]), int(request[1])
            m = min(self.k, limit)
            if m <= 0 or not ids or len(ids) + m > self.max_len:
                continue
            want[r] = m
            start[r] = min(_common_prefix(self.fed[r], ids), len(ids) - 1)  # the last token is fed again at least
        served = np.flatnonzero(want > 0)
        out = [[] for _ in requests]
        if served.size == 0:
            return out
        slots = np.where(want > 0, np.arange(rows), aj.PAD_SLOT).astype(np.int32)
        self.cache = _truncate_rows(self.cache, jnp.asarray(slots), jnp.asarray(start))
        seqs = {r: list(requests[r][0]) for r in served}
        first, fed_ok = self._catch_up(seqs, start, slots)  # i32[rows] on device: each row's first proposal
        steps = np.where(want > 1, want - 1, 0).astype(np.int32)
        if steps.max() > 0:
            block, packed = self.steps.decode_block(self.steps.leaves, self.cache, first, jnp.asarray(slots),
                                                    jnp.asarray(steps), jnp.asarray(np.maximum(slots, 0)), 0, None,
                                                    length=self.k - 1)  # fmt: skip
            self.cache = block.cache
            self.calls += 1
            later = np.asarray(packed)  # [k - 1, 2, rows]: each step's tokens and ok
        first, fed_ok = np.asarray(first), np.asarray(fed_ok)
        for r in served:
            if not fed_ok[r]:  # (refused pages: cannot happen in a full-length row) start the row over
                self.fed[r] = []
                continue
            got = [int(first[r])]
            for j in range(int(steps[r])):
                if not later[j, 1, r]:
                    break
                got.append(int(later[j, 0, r]))
            out[r] = got
            self.fed[r] = seqs[r] + got[:-1]  # the last proposal is not fed
        return out

    def _catch_up(self, seqs: dict, start: np.ndarray, slots: np.ndarray):
        """Feed each served row its tokens from `start[r]` on, `chunk_size` per call; returns the
        greedy next token after each row's last token and whether every call took the row's
        tokens (i32[rows], bool[rows], on device)."""
        rows, width = slots.shape[0], self.chunk_size
        left = {r: seqs[r][start[r]:] for r in seqs}
        first, fed_ok = jnp.zeros((rows,), jnp.int32), jnp.ones((rows,), bool)
        while any(left.values()):
            tokens = np.zeros((rows, width), np.int32)
            counts = np.zeros((rows,), np.int32)
            for r, todo in left.items():
                piece, left[r] = todo[:width], todo[width:]
                tokens[r, : len(piece)], counts[r] = piece, len(piece)
            step_slots = np.where(counts > 0, slots, aj.PAD_SLOT).astype(np.int32)
            result, _ = self.steps.prefill(self.steps.leaves, self.cache, jnp.asarray(tokens), jnp.asarray(step_slots),
                                           jnp.asarray(counts), jnp.asarray(np.maximum(step_slots, 0)), 0, None)  # fmt: skip
            self.cache = result.cache
            self.calls += 1
            done = np.array([counts[r] > 0 and not left.get(r) for r in range(rows)])
            first = jnp.where(jnp.asarray(done), result.tokens, first)
            fed_ok = fed_ok & result.ok
        return first, fed_ok
