"""What a model's forward pass needs from the cache, in three calls (no plumbing of your own).

    step, ok = aj.begin_step(cache, slots, num_tokens, width=T)   # reserve the new tokens' pages
    q, k = rope(q, step.positions), rope(k, step.positions)      # positions i32[B, T] of the new tokens
    step, out = step.attend(layer, q, k, v, sliding_window=w, logits_soft_cap=c)   # append + attend
    cache = step.cache                                            # after the last layer

or the two pieces on their own:

    pos = aj.positions(cache, slots, num_tokens, width=T)          # after aj.reserve
    cache, out = aj.append_attend(q, k, v, cache, layer, slots, num_tokens=n, sm_scale=s)

`CacheStep` is a pytree (a `flax.struct` dataclass), so it passes through `jax.jit`,
`lax.scan` over layers and NNX modules like the cache itself. Rows whose reservation failed
(`ok` False) become padding: they write and read nothing in this step, and their slot is
unchanged, so the caller can free pages and retry. Every op keeps the cache's rules (host
checks outside jit, totality inside it: `arena_jax.api`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from arena_jax import api
from arena_jax.kv_cache import PAD_SLOT, KVCache
from arena_jax.plan import StepPlan, plan_step
from arena_jax.validate import check_counts, check_reserved, check_slots, check_width, concrete

__all__ = ["positions", "append_attend", "CacheStep", "begin_step"]


def _width(num_tokens, width) -> int:
    if width is not None:
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be a positive Python int (the tokens axis of this step), got {width!r}")
        return width
    n = concrete(num_tokens)
    if n is None:
        raise ValueError("width must be given inside jit (num_tokens is traced): the static tokens axis T")
    return max(int(n.max()) if n.size else 1, 1)


def positions(cache: KVCache, slots, num_tokens, *, width: int | None = None):
    """Absolute positions i32[B, width] of each row's newest `num_tokens[b]` tokens: after
    `aj.reserve(cache, slots, num_tokens)` they are the slot's last num_tokens positions,
    `lengths[slot] - num_tokens[b] + t`. Padded rows (PAD_SLOT) and tokens t >= num_tokens[b]
    get 0 (they are masked everywhere). `width` is the tokens axis (default: max(num_tokens),
    which must then be concrete).

    On the host (concrete values) a row with more tokens than `width`, an idle slot, or more
    tokens than its slot holds is a ValueError; inside jit such rows get zeros (nothing to count
    them in: `begin_step` refuses them in `stats.rejected_rows`)."""
    layout = api._check_cache(cache)
    slots = check_slots(layout, slots, unique=False)
    num_tokens = check_counts(layout, num_tokens, slots.shape[0], "num_tokens")
    width = _width(num_tokens, width)
    check_width(slots, num_tokens, width)
    check_reserved(cache, slots, num_tokens)
    return _positions(cache, slots, num_tokens, width)


def _positions(cache: KVCache, slots, num_tokens, width: int):
    max_seqs = cache.table.page_map.shape[0]
    valid = (slots >= 0) & (slots < max_seqs)
    if cache.sharding is not None:  # each data shard reads its own slots' lengths
        from arena_jax.sharding import slot_lengths

        lengths = slot_lengths(cache, slots)
    else:
        lengths = jnp.where(valid, cache.table.lengths[jnp.where(valid, slots, 0)], 0)
    t = jnp.arange(width, dtype=jnp.int32)[None, :]
    pos = (lengths - num_tokens)[:, None] + t
    live = valid[:, None] & (t < num_tokens[:, None]) & (pos >= 0)
    return jnp.where(live, pos, 0)


def append_attend(q, k, v, cache: KVCache, layer, slots, *, num_tokens=None, backend: str | None = None, plan=None,
                  **attend_options):  # fmt: skip
    """One layer's cache work: `aj.append(cache, layer, slots, k, v)` then `aj.attend(q, ...)`.

    q [B, T, q_heads, D]; k, v [B, T, kv_heads, D]; row b's first num_tokens[b] tokens are real
    (default all T). `attend_options`: `sm_scale`, `sliding_window` (an int, None or a traced
    int32), `logits_soft_cap`, as `aj.attend` takes them; `plan`: the step's `aj.plan_step`.
    Returns (cache, out [B, T, q_heads, D]).
    """
    cache = api.append(cache, layer, slots, k, v, num_tokens=num_tokens, backend=backend, plan=plan)
    out = api.attend(q, cache, layer, slots, num_tokens=num_tokens, backend=backend, plan=plan, **attend_options)
    return cache, out


@struct.dataclass
class CacheStep:
    """The cache during one forward pass, with the rows' slots, token counts and positions.

    slots i32[B] (rows whose reservation failed are PAD_SLOT), num_tokens i32[B] (0 for those
    rows), positions i32[B, T]; plan: the rows classified once for every layer
    (`aj.plan_step`; None on a sharded cache).

    `cache` is the arena as the layers have left it. Under `begin_step`'s plan (deferred) each
    layer's `attend` writes its K/V into `pending_cache` and counts the append in `appended`
    (i32[L + 1], per plan entry); the watermarks and counters of every layer appended are set
    once, when `cache` is read (`StepPlan.commit`): one scatter a step, not one a layer, and a
    layer the model skips moves no watermark. `replace(cache=c)` sets the arena as given, with
    nothing pending. (Setting `pending_cache` yourself to an arena at another epoch and back
    between layers is outside the contract: an append at the other epoch writes nothing, yet its
    layer's watermark would move at the commit.) Outside jit `attend` does not defer: each
    layer's append sets its own watermark, so that the next op's host checks see it."""

    pending_cache: KVCache
    slots: jax.Array
    num_tokens: jax.Array
    positions: jax.Array
    plan: StepPlan | None = None
    appended: jax.Array | None = None

    @property
    def cache(self) -> KVCache:
        """The arena after the layers run so far: their K/V, watermarks and counters."""
        if self.plan is None or not self.plan.deferred:
            return self.pending_cache
        return self.plan.commit(self.pending_cache, self._appended())

    def _appended(self):
        if self.appended is not None:
            return self.appended
        return _no_appends(self.plan)

    def attend(self, layer, q, k, v, *, backend: str | None = None, **attend_options):
        """append + attend at `layer` (see `append_attend`); k, v are cast to a float arena's
        dtype (an 8-bit arena quantizes them as given). Returns (the next CacheStep, out)."""
        if self.pending_cache.k_scale is None:
            k, v = k.astype(self.pending_cache.k.dtype), v.astype(self.pending_cache.v.dtype)
        plan = self.plan
        if plan is not None and plan.deferred and not isinstance(self.pending_cache.table.packed, jax.core.Tracer):
            plan = plan.replace(deferred=False)  # outside jit: this layer's own watermark, for the host checks
        cache, out = append_attend(q, k, v, self.pending_cache, layer, self.slots, num_tokens=self.num_tokens,
                                   backend=backend, plan=plan, **attend_options)  # fmt: skip
        if plan is None or not plan.deferred:
            return _replace(self, pending_cache=cache), out
        return _replace(self, pending_cache=cache, appended=self._appended() + _one_append(plan, layer)), out


def _no_appends(plan: StepPlan):
    """i32[L + 1] zeros: no layer appended yet under `plan`."""
    return jnp.zeros((plan.counts.shape[0],), jnp.int32)


def _one_append(plan: StepPlan, layer):
    """i32[L + 1]: one append at `layer`, counted at its plan entry (L: out of range). A layer
    known when traced (a Python loop's) gives a constant, which XLA folds into the step's
    count (no kernel a layer); a traced one (a layer scan's counter) a one-hot."""
    num_layers = plan.counts.shape[0] - 1
    given = concrete(layer) if not isinstance(layer, jax.core.Tracer) else None
    if given is not None and given.shape == () and np.issubdtype(given.dtype, np.integer):
        entry = int(given) if 0 <= int(given) < num_layers else num_layers
        return np.eye(num_layers + 1, dtype=np.int32)[entry]
    layer = jnp.asarray(layer)
    entry = jnp.where((layer >= 0) & (layer < num_layers), layer, num_layers)
    return (jnp.arange(num_layers + 1, dtype=jnp.int32) == entry).astype(jnp.int32)


_replace = CacheStep.replace


def _replace_cache(self, **changes) -> CacheStep:
    """`dataclasses.replace`, where `cache=` sets the arena as given: its watermarks and
    counters are the ones it holds (nothing pending)."""
    if "cache" in changes:
        changes["pending_cache"] = changes.pop("cache")
        if self.plan is not None and self.plan.deferred:
            changes["appended"] = _no_appends(self.plan)
    return _replace(self, **changes)


CacheStep.replace = _replace_cache


def begin_step(cache: KVCache, slots, num_tokens, *, width: int | None = None) -> tuple[CacheStep, jax.Array]:
    """Reserve `num_tokens[b]` new tokens for each row's slot (`aj.reserve`) and return the
    `CacheStep` that the layers use, and ok bool[B] (False: the row got no pages and is padding
    in this step; its slot is unchanged). `width`: the tokens axis T of the step's inputs.

    A row with more than `width` tokens is a ValueError on the host; inside jit it is refused
    (ok False, nothing reserved, counted in `stats.rejected_rows`)."""
    layout = api._check_cache(cache)
    slots = check_slots(layout, slots)
    num_tokens = check_counts(layout, num_tokens, slots.shape[0], "num_tokens")
    width = _width(num_tokens, width)
    check_width(slots, num_tokens, width)
    num_tokens = jnp.where(slots != PAD_SLOT, num_tokens, 0)
    # A traced count past the tokens axis: a negative count, which `reserve` refuses and counts.
    cache, ok = api.reserve(cache, slots, jnp.where(num_tokens > width, -1, num_tokens))
    slots = jnp.where(ok, slots, PAD_SLOT)
    num_tokens = jnp.where(ok, num_tokens, 0)
    # Every layer's bookkeeping, once: the rows classified now and, inside jit, the watermarks
    # set when the step's cache is read (`CacheStep.cache`; outside jit `attend` sets each
    # layer's own, so that the next op's host checks see what was written).
    plan = plan_step(cache, slots, num_tokens, width, deferred=True)
    appended = None if plan is None else _no_appends(plan)
    return CacheStep(cache, slots, num_tokens, _positions(cache, slots, num_tokens, width), plan, appended), ok
