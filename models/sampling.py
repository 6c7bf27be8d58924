"""Token sampling inside the jitted steps: greedy, temperature, top-k, top-p.

`Sampling` is the host-side, validated choice (with the seed, the stop tokens and whether to
return logits: everything `generate` needs to know about sampling, like vLLM's
`SamplingParams`); `Sampling.rows(batch)` turns its filters into
`SamplingParams`, per-row arrays that the steps take as ordinary (traced) arguments. So
any mix of sampling settings, per request, runs through ONE compiled step; a batch whose
rows are all greedy takes a `lax.cond` branch that is a plain argmax (no sort).

Randomness is keyed per sequence and per position
(`fold_in(fold_in(key(seed), seq_id), position)`), so a sequence draws the same tokens
whichever batch row it runs in, and again after being preempted and recomputed.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from arena_jax.models.checks import INT32_MIN, check_int, check_number, token_ids

__all__ = ["Sampling", "SamplingParams", "GREEDY", "sample", "filter_logits", "first_argmax"]


@struct.dataclass
class SamplingParams:
    """Per-row sampling settings (a pytree of arrays: changing them never recompiles)."""

    temperature: jax.Array  # f32[B], 0 = greedy
    top_k: jax.Array  # i32[B], 0 = off
    top_p: jax.Array  # f32[B], 1 = off


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What `generate` samples: temperature 0 is greedy; top_k keeps the k largest logits; top_p
    the smallest set of most likely tokens whose probability reaches p (after temperature and
    top-k), and at least the most likely token: a top_p too small to keep any token keeps the argmax.

    Checked on the host: temperature a finite number >= 0 (NaN is refused, not run greedily),
    top_k an integer in [1, 2**31 - 1], top_p a finite number in (0, 1], seed an int32,
    stop_tokens integers (kept as a tuple; against the vocabulary: by `generate`),
    return_logits a bool. Frozen and hashable."""

    temperature: float = 0.0
    """0: greedy; else logits / temperature are sampled."""
    top_k: int | None = None
    """Keep the k largest logits (None: off)."""
    top_p: float | None = None
    """Keep the most likely tokens whose probability reaches p (None: off)."""
    seed: int = 0
    """An int32 keying the draws (per sequence and position: the same tokens in any batch row)."""
    stop_tokens: tuple[int, ...] | None = None
    """A sequence stops after one of these (kept in its output); None: the model's
    `config.eos_token_ids` (as transformers' generate); (): never."""
    return_logits: bool = False
    """Return the logits each token was drawn from (`Generation.logits`)."""

    def __post_init__(self):
        object.__setattr__(self, "temperature", check_number("temperature", self.temperature, low=0.0))
        if self.top_k is not None:
            object.__setattr__(self, "top_k", check_int("top_k", self.top_k, low=1))
        if self.top_p is not None:
            object.__setattr__(self, "top_p", check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True))
        object.__setattr__(self, "seed", check_int("seed", self.seed, low=INT32_MIN))
        if self.stop_tokens is not None:
            object.__setattr__(self, "stop_tokens", tuple(token_ids("stop_tokens", self.stop_tokens, None)))
        if not isinstance(self.return_logits, bool):
            raise ValueError(f"return_logits must be a bool, got {self.return_logits!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def rows(self, batch: int) -> SamplingParams:
        """The same setting for every one of `batch` rows."""
        return SamplingParams(
            temperature=jnp.full((batch,), self.temperature, jnp.float32),
            top_k=jnp.full((batch,), self.top_k or 0, jnp.int32),
            top_p=jnp.full((batch,), 1.0 if self.top_p is None else self.top_p, jnp.float32),
        )


GREEDY = Sampling()


def filter_logits(logits, params: SamplingParams | Sampling):
    """Temperature, then top-k, then top-p on f32[B, V]; removed entries become -inf.

    Each row is shifted by its largest logit before the temperature divides it (the same
    distribution), so a tiny temperature (1e-38) gives -inf to every token below the largest
    instead of overflowing to inf: it samples the argmax (ties among equal largest logits).
    Rows with temperature 0 are returned unscaled (they are sampled greedily)."""
    if isinstance(params, Sampling):
        params = params.rows(logits.shape[0])
    vocab = logits.shape[-1]
    positive = params.temperature > 0
    temperature = jnp.where(positive, params.temperature, 1.0)[:, None]
    logits = logits.astype(jnp.float32)
    top = jnp.max(jnp.where(jnp.isfinite(logits), logits, -jnp.inf), axis=-1, keepdims=True)
    shift = jnp.where(positive[:, None] & jnp.isfinite(top), top, 0.0)
    logits = (logits - shift) / temperature
    ordered = -jnp.sort(-logits, axis=-1)  # [B, V] descending
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab)[:, None]  # [B, 1]
    kth = jnp.take_along_axis(ordered, k - 1, axis=-1)
    ordered = jnp.where(jnp.arange(vocab)[None, :] < k, ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
    # The most likely token is always kept: a top_p that keeps nothing (one below float32's
    # smallest normal number is flushed to 0 on some backends, 1e-39 say) keeps the argmax.
    keep = (before < params.top_p[:, None]) | (jnp.arange(vocab) == 0)[None, :]
    cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((logits < kth) | (logits < cutoff), -jnp.inf, logits)


def first_argmax(logits):
    """`jnp.argmax(logits, axis=-1)` as int32, the same index in every case (the first largest
    value; the first NaN where a row has one), as two plain reductions: a max, then the least
    index holding it (or the first NaN). XLA CPU runs argmax's variadic (value, index) reduce
    about 5x slower (32 x 32,000 float32 logits: 4.7 ms against 0.9 ms, one thread), a twentieth
    of a mid-size model's decode step at batch 32 (benchmarks/RESULTS.md)."""
    nan = jnp.isnan(logits)
    top = jnp.max(logits, axis=-1, keepdims=True)  # (XLA CPU's max may skip NaN: not relied on)
    index = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, logits == top)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


def sample(logits, params: SamplingParams | Sampling | None, seed, seq_ids, positions):
    """Next tokens i32[B] from logits f32[B, V].

    params None means greedy. seed: i32[]; seq_ids, positions: i32[B] (the sequence's id and
    the index the new token will have in it) key each row's draw.
    """
    greedy = first_argmax(logits)
    if params is None:
        return greedy
    if isinstance(params, Sampling):
        params = params.rows(logits.shape[0])

    def draw(_):
        base = jax.random.key(seed)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(base, s), p))(seq_ids, positions)
        drawn = jax.vmap(jax.random.categorical)(keys, filter_logits(logits, params)).astype(jnp.int32)
        return jnp.where(params.temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(params.temperature > 0), draw, lambda _: greedy, None)
