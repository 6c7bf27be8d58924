"""Speculative decoding: a row's last token plus up to k proposed tokens go through the model in
ONE call (`verify`), the proposals the model agrees with are kept, and the rest rolled back in
the same call; a proposer says what to propose (`PromptLookup`: the sequence's own history).

The verify step (a chunk of k + 1 tokens per row, the chunked attention path: Pallas kernels on
GPU / TPU, the blockwise jnp path on CPU):
- row b feeds t0 (its last token, not yet in the cache) and proposals p1..p_m (m = num_tokens[b]
  - 1 <= k); the logits after each fed token give target tokens y0..y_m, drawn as a plain
  decode step would draw them (the same keys: seed, the row's sequence id, the position);
- greedy rows (temperature 0) accept p_j while p_j == y_{j-1}: the result is exactly the tokens
  one-token decode steps give; sampled rows accept p_j with probability p(p_j) (the target's
  filtered distribution; the proposal is a point mass, so min(1, p/q) = p) and on a rejection
  draw the next token from p with p_j removed, renormalised: the standard rejection rule, so the
  tokens are distributed as the target model's;
- with a accepted, the row's new tokens are p1..p_a and then y_a (the correction, or after a
  full acceptance the bonus token): a + 1 tokens; the cache keeps t0, p1..p_a and the rest of the
  reservation is rolled back by `aj.truncate` inside the call (a page that empties is freed; the
  written watermark makes the stale tail unreadable).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from arena_jax.models.sampling import SamplingParams, filter_logits, first_argmax

__all__ = ["PromptLookup", "verify_rows"]


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Propose what followed an earlier occurrence of the sequence's last n tokens (n from
    `max_ngram` down to `min_ngram`): the most recent one followed by k tokens, else the
    earliest (the longest continuation). No second model. `k`: proposals per step."""

    k: int = 4
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        for name in ("k", "max_ngram", "min_ngram"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PromptLookup.{name} must be an integer >= 1, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"PromptLookup: min_ngram {self.min_ngram} > max_ngram {self.max_ngram}")

    def propose(self, ids: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens to follow `ids` (prompt + generated), or []."""
        limit = min(self.k, limit)
        if limit <= 0:
            return []
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            tail, found = ids[-n:], None
            for start in range(len(ids) - n - 1, -1, -1):  # the most recent earlier match with `limit` tokens after it
                if ids[start : start + n] == tail:
                    if len(ids) - (start + n) >= limit:
                        return ids[start + n : start + n + limit]
                    found = start  # else the earliest: the longest continuation (in a short loop the latest ends early)
            if found is not None:
                return ids[found + n : found + n + limit]
        return []


def _keys(seed, seq_ids, positions, salt: int):
    """Per-row keys; salt 0 is exactly `sampling.sample`'s (a decode step's draw at that position)."""
    base = jax.random.key(seed)
    if salt:
        base = jax.random.fold_in(base, 1 << 30 | salt)
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(base, s), p))(seq_ids, positions)


def verify_rows(logits, tokens, num_tokens, positions, sampling: SamplingParams | None, seed, seq_ids):
    """The acceptance rule on one verify call's logits f32[B, T, V] (T = k + 1) for tokens
    i32[B, T] (t0, p1..p_k) of which num_tokens[b] are real, positions i32[B, T] the fed tokens'
    positions. Returns (new i32[B, T]: the row's new tokens in order, count i32[B]: how many
    (accepted + 1; 0 for a row with no token))."""
    batch, width, vocab = logits.shape
    draw_pos = positions + 1  # the position each target token takes: the key a decode step uses
    greedy_y = first_argmax(logits)  # [B, T]
    proposals = jnp.concatenate([tokens[:, 1:], jnp.zeros((batch, 1), tokens.dtype)], axis=1).astype(jnp.int32)
    has_next = jnp.arange(width)[None, :] < (num_tokens[:, None] - 1)  # p_{j+1} exists

    def greedy(_):
        return proposals == greedy_y, greedy_y

    def sampled(_):  # every (row, position) at once: one filter and three draws over B * T rows
        params = sampling if isinstance(sampling, SamplingParams) else sampling.rows(batch)
        per_token = jax.tree.map(lambda a: jnp.repeat(a, width, axis=0), params)  # [B * T]
        flat = lambda a: a.reshape(batch * width, *a.shape[2:])  # noqa: E731  [B, T, ...] -> [B * T, ...]
        ids, pos, proposed, greedy_flat = jnp.repeat(seq_ids, width), flat(draw_pos), flat(proposals), flat(greedy_y)
        filtered = filter_logits(flat(logits), per_token)  # [B * T, V], as a decode step filters
        drawn = jax.vmap(jax.random.categorical)(_keys(seed, ids, pos, 0), filtered).astype(jnp.int32)
        p = jnp.take_along_axis(jax.nn.softmax(filtered, axis=-1), proposed[:, None], axis=1)[:, 0]
        u = jax.vmap(jax.random.uniform)(_keys(seed, ids, pos, 1))
        residual = jnp.where(jnp.arange(vocab)[None, :] == proposed[:, None], -jnp.inf, filtered)
        resampled = jax.vmap(jax.random.categorical)(_keys(seed, ids, pos, 2), residual).astype(jnp.int32)
        hot = per_token.temperature > 0
        ok = jnp.where(hot, u < p, proposed == greedy_flat)
        # a rejected proposal: the residual's draw; nothing proposed: the decode step's own draw
        fix = jnp.where(hot, jnp.where(flat(has_next), resampled, drawn), greedy_flat)
        return ok.reshape(batch, width), fix.reshape(batch, width)

    if sampling is None:
        accept, corrected = greedy(None)
    else:
        accept, corrected = jax.lax.cond(jnp.any(sampling.temperature > 0), sampled, greedy, None)
    accept = has_next & accept
    a = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [B]: the leading run of accepts
    j = jnp.arange(width)[None, :]
    new = jnp.where(j < a[:, None], proposals, jnp.take_along_axis(corrected, a[:, None], axis=1))
    count = jnp.where(num_tokens > 0, a + 1, 0)
    return new.astype(jnp.int32), count.astype(jnp.int32)
