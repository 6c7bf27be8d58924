"""A forward pass's paging bookkeeping, done once for every layer (issue 39, item 2).

Each `aj.append` / `aj.attend` classifies its rows: which slot each names, whether it is live,
where its watermark stands at that layer, which page each new token lands in, whether that
page is private, what attention may read. Done per layer, that is a dozen small XLA kernels a
layer besides the data movement itself.

What those answers depend on changes only with the page-table ops (`reserve`, `release`, ...)
and with the layer's own append (its watermark). So after a step's `reserve`, `plan_step`
answers them for every layer at once (the same functions as the ops, vmapped over the layers:
`arena_ops.append_rows`, `arena_ops.attend_rows`), and each layer's append and attend take
their layer's entry (`aj.append(..., plan=)`, `aj.attend(..., plan=)`; `CacheStep` and the
models pass it): the per-layer work is the writes, the reads, one watermark scatter and one
counter add. Results equal the unplanned calls' exactly, layers in any order
(tests/test_plan.py). A forward pass that appends every layer once can defer the watermarks
and counters too (`deferred=True`, `StepPlan.commit`: one scatter and one add a step, as
`aj.begin_step`'s `CacheStep` does inside jit; `plan_and_commit`, as our models do: on a CPU the
plan and its commit as one native call).

A plan answers for the slots and counts it was made for, one append per layer. Inside jit,
misuse stays total: a layer appended twice writes the same positions again and leaves the
watermark where one append does; a plan kept past a call that unmaps or shares a page
(`PageTable.epoch` moved on) rejects every row, so it never writes a page its slot no longer
holds alone. What it buys and costs, measured: benchmarks/RESULTS.md, "A step's plan".
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from arena_jax.allocator import first_rows
from arena_jax.arena_ops import AppendRows, AttendRows, append_rows, attend_rows, page_rows, waits_for
from arena_jax.kv_cache import PAD_SLOT, KVCache
from arena_jax.validate import check_cache_arrays, check_counts, check_slots
from pallas_kernels.index_math import div_nonneg, rem_nonneg

__all__ = ["StepPlan", "plan_step", "plan_and_commit", "PLAN_KERNEL"]

# Whether `plan_step` makes the plan as one native call on a CPU (`pallas_kernels.cpu.plan`,
# built on first use; without a C++ compiler, XLA's ops): "auto" (default) / "cpu": on a CPU;
# False: XLA's ops everywhere (the reference). Other platforms always run XLA's ops. Read on
# each `plan_step` call (a static argument of its jitted body).
PLAN_KERNEL: bool | str = "auto"


@struct.dataclass
class StepPlan:
    """The rows of one forward pass, classified for every layer (`plan_step`).

    Packed so that making it writes three small arrays (XLA's CPU backend runs one kernel per
    array it materializes), each with an entry a layer and a last entry, L, for a layer out of
    range (every row rejected):

    - tokens i32[L + 1, B, T]: where each new token goes, page * page_size + offset into the
      layer's pages; num_pages * page_size where the token is not written;
    - rows4 i32[L + 1, B, 4]: the watermark once appended (end), the tokens appended (-1: the
      row writes nothing), the keys its attention reads, its query tokens (-1: it reads nothing);
    - counts i32[L + 1, N]: what each layer's append adds to `stats.counts`.

    slots, num_tokens i32[B] and width (static): the rows it was made for; rows i32[B, M]: their
    page-table rows; epoch i32[]: the table's when the plan was made (`PageTable.epoch`);
    page_size (static): the arena's."""

    slots: jax.Array
    num_tokens: jax.Array
    rows: jax.Array
    tokens: jax.Array
    rows4: jax.Array
    counts: jax.Array
    epoch: jax.Array
    width: int = struct.field(pytree_node=False)
    page_size: int = struct.field(pytree_node=False)
    deferred: bool = struct.field(pytree_node=False, default=False)
    attend_only: bool = struct.field(pytree_node=False, default=False)  # `last_query`'s: no append takes it

    def _index(self, layer, table, after):
        """Entry `layer`; entry L for a layer out of range or a table at another epoch. Read
        once `after` (the keys appended, or the arena they were written to) is computed
        (`arena_ops.waits_for`)."""
        num_layers = self.counts.shape[0] - 1
        usable = (layer >= 0) & (layer < num_layers) & (table.epoch == self.epoch)
        return waits_for(jnp.where(usable, layer, num_layers), after)

    def append_at(self, layer, table, after=None) -> AppendRows:
        """Layer `layer`'s append rows over `table` (the cache's table now); `after`: the keys
        appended (see `_index`)."""
        i = self._index(layer, table, after)
        flat, (end, accepted, _, _) = self.tokens[i], jnp.moveaxis(self.rows4[i], -1, 0)
        num_pages, max_seqs, size = table.refcount.shape[0], table.page_map.shape[0], self.page_size
        writable = accepted >= 0
        return AppendRows(page=div_nonneg(flat, size), pos=flat, ok=flat < num_pages * size, writable=writable,
                          accepted=jnp.maximum(accepted, 0), end=end, target=jnp.where(writable, self.slots, max_seqs),
                          counts=self.counts[i])  # fmt: skip

    def commit(self, cache: KVCache, appended=None) -> KVCache:
        """A deferred plan's bookkeeping for every layer (`plan_step(..., deferred=True)`: once
        per forward pass, whose layers each append once under this plan): each layer's written
        watermark set where its append leaves it, and the appends' counters added, as the
        layers' own appends would do one by one. A plan that is not deferred: the cache
        unchanged (its appends do it). A table at another epoch than the plan's: its appends
        write nothing, so no watermark moves and only their rejections are counted.

        `appended` i32[L + 1]: how many appends each layer took (entry L: layers out of range),
        for a forward pass that may skip or repeat layers (`CacheStep` counts them): only the
        layers appended move their watermark, and each append's counters are added once per
        append. None: every layer once."""
        if not self.deferred:
            return cache
        table = cache.table
        num_layers = self.counts.shape[0] - 1
        usable = table.epoch == self.epoch
        end, accepted = self.rows4[:num_layers, :, 0], self.rows4[:num_layers, :, 1]  # [L, B]
        layers = np.broadcast_to(np.arange(2, 2 + num_layers, dtype=np.int32)[:, None], end.shape)  # written[l]'s column
        moves = usable & (accepted >= 0)
        if appended is None:
            counts = jnp.where(usable, jnp.sum(self.counts[:num_layers], axis=0), num_layers * self.counts[num_layers])
        else:
            appended = jnp.maximum(jnp.asarray(appended, jnp.int32), 0)
            if appended.shape != (num_layers + 1,):
                raise ValueError(f"appended must be i32[{num_layers + 1}] (appends per layer, then those out of range), "
                                 f"got shape {appended.shape}")
            moves &= appended[:num_layers, None] > 0
            counts = jnp.where(usable, jnp.sum(appended[:, None] * self.counts, axis=0),
                               jnp.sum(appended) * self.counts[num_layers])  # fmt: skip
        target = jnp.where(moves, self.slots[None, :], table.slots_shape[0])  # [L, B]; out of range: none
        return cache.replace(table=table.set_slot_words(target, layers, end),
                             stats=cache.stats.replace(counts=cache.stats.counts + counts))

    def last_query(self) -> "StepPlan":
        """This plan for an attention of ONE query token a row, each row's last new token (q
        [B, 1, N, H], num_tokens min(n, 1)): a forward pass that needs only that token past the
        last layer's K/V (`models.Llama.hidden(..., last_only=True)`). For `aj.attend` only:
        the layer's append runs under the plan itself, with all its tokens."""
        n = self.rows4[..., 3]
        return self.replace(rows4=self.rows4.at[..., 3].set(jnp.minimum(n, 1)),
                            num_tokens=jnp.minimum(self.num_tokens, 1), width=1, attend_only=True)  # fmt: skip

    def attend_at(self, layer, table, after=None) -> AttendRows:
        """Layer `layer`'s attention rows, as they stand after its append; `after`: the arena
        after that append."""
        _, _, lengths, n = jnp.moveaxis(self.rows4[self._index(layer, table, after)], -1, 0)
        return AttendRows(good=n >= 0, lengths=lengths, num_tokens=jnp.maximum(n, 0))


def plan_step(cache: KVCache, slots, num_tokens, width: int, *, deferred: bool = False) -> StepPlan | None:
    """The plan of a forward pass of `width` tokens a row (slots, num_tokens i32[B]) over `cache`
    as it is after the step's `reserve`: pass it to every layer's `aj.append` / `aj.attend`
    (`plan=`) with the same slots and counts. None for a sharded cache (each shard classifies
    its own rows inside every call). On the host, slots and counts are checked as `aj.append`
    checks them (a ValueError naming the argument); inside jit, any values give a plan that keeps
    the cache's rules (rows the ops would refuse are refused by the plan).

    `deferred=True`, for a forward pass that appends every layer exactly once under the plan,
    in the same jit (a model's layer loop: `models.Llama.hidden`): those appends write K/V
    only, and `plan.commit(cache)`, called once in that forward pass, before or after its
    layers, sets every layer's watermark and adds the appends' counters in one scatter and one
    add, where each append would do it for its layer (XLA kernels a layer on the step's
    critical path: benchmarks/RESULTS.md, "The page table in one array"). Attention under the
    plan reads the plan's lengths, so the order does not matter; the cache after the forward
    pass equals the per-layer appends' (tests/test_plan.py). Outside that contract it is not:
    a layer left out would be marked written over bytes it never wrote, and a deferred append
    at a layer out of range counts nothing. `aj.CacheStep` keeps the contract for any model: it
    counts each layer's appends and commits those (`StepPlan.commit(cache, appended)`)."""
    slots, num_tokens = _checked(cache, slots, num_tokens, width)
    if cache.sharding is not None:
        return None
    if not isinstance(deferred, bool):
        raise ValueError(f"deferred must be a bool, got {deferred!r}")
    return _plan(cache, slots, num_tokens, width, deferred, _plans_natively(PLAN_KERNEL))


def plan_and_commit(cache: KVCache, slots, num_tokens, width: int) -> tuple[StepPlan | None, KVCache]:
    """(plan, cache) as `plan = plan_step(cache, slots, num_tokens, width, deferred=True)` and
    `cache = plan.commit(cache)` give them: for a forward pass whose layers each append once under
    the plan, in the same jit (our models' `hidden`). On a CPU the native call makes both: the
    commit's scatter, its index kernels and its add were about 4 kernels of a decode step
    (benchmarks/RESULTS.md, session 64). A sharded cache: (None, cache)."""
    slots, num_tokens = _checked(cache, slots, num_tokens, width)
    if cache.sharding is not None:
        return None, cache
    if not _plans_natively(PLAN_KERNEL):
        plan = _plan(cache, slots, num_tokens, width, True, False)
        return plan, plan.commit(cache)
    return _native_plan_and_commit(cache, slots, num_tokens, width)


def _checked(cache: KVCache, slots, num_tokens, width: int):
    """slots, num_tokens as the ops check them (on the host, a ValueError naming the argument)."""
    layout = check_cache_arrays(cache)
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a positive Python int (the tokens axis of the step), got {width!r}")
    slots = check_slots(layout, slots)
    return slots, check_counts(layout, num_tokens, slots.shape[0], "num_tokens")


def _plans_natively(kernel: bool | str) -> bool:
    """Whether `_plan` runs as the native call (`kernel`: a `PLAN_KERNEL` value)."""
    if kernel not in (False, "auto", "cpu") or kernel is True:
        raise ValueError(f"PLAN_KERNEL must be 'auto', 'cpu' or False, got {kernel!r}")
    if kernel is False:
        return False
    from pallas_kernels.cpu.plan import native_problem
    from pallas_kernels.tpu.common import target_platform

    return target_platform() == "cpu" and native_problem() is None


@functools.partial(jax.jit, static_argnames=("width", "deferred", "native"))
def _plan(cache: KVCache, slots, num_tokens, width: int, deferred: bool = False, native: bool = False) -> StepPlan:
    if native:
        return _native_plan(cache, slots, num_tokens, width, deferred)
    table = cache.table
    num_layers = table.written.shape[0]
    num_pages, page_size = cache.k.shape[2], cache.k.shape[3]
    rows = page_rows(table, slots)
    layers = np.arange(num_layers + 1, dtype=np.int32)  # the last: out of range (numpy: a constant XLA folds into its users)
    _, idx, first = first_rows(table, slots)
    words = table.slot_words[idx]  # [B, 2 + L]
    written = jnp.concatenate([words[:, 2:].T, jnp.zeros_like(idx)[None]])  # [L + 1, B]
    append = jax.vmap(lambda layer, w: append_rows(table, page_size, layer, slots, num_tokens, width, rows, words, w))(
        layers, written)
    # What each row's attention reads after its layer's append: the slot's watermark plus what
    # the batch's row that writes that slot (its first) appended (`append_impl` advances it so).
    first = jnp.minimum(first, slots.shape[0] - 1)  # out-of-range rows: read nothing anyway
    after = written + jnp.take(append.accepted, first, axis=1)
    attend = jax.vmap(lambda layer, w: attend_rows(table, layer, slots, num_tokens, width, written=w))(layers, after)
    tokens = jnp.where(append.ok, append.page * page_size + rem_nonneg(append.pos, page_size), num_pages * page_size)
    rows4 = jnp.stack([append.end, jnp.where(append.writable, append.accepted, -1), attend.lengths,
                       jnp.where(attend.good, attend.num_tokens, -1)], axis=-1)  # fmt: skip
    return StepPlan(slots=slots, num_tokens=num_tokens, rows=rows, tokens=tokens, rows4=rows4, counts=append.counts,
                    epoch=table.epoch, width=width, page_size=page_size, deferred=deferred)


@functools.partial(jax.jit, static_argnames=("width",))
def _native_plan_and_commit(cache: KVCache, slots, num_tokens, width: int) -> tuple[StepPlan, KVCache]:
    """A deferred plan and its `commit` of `cache` from one native call (`plan_rows(stats_counts=)`)."""
    rows, tokens, rows4, counts, epoch, packed, stats = _plan_rows(cache, slots, num_tokens, width, cache.stats.counts)
    plan = StepPlan(slots=slots, num_tokens=num_tokens, rows=rows, tokens=tokens, rows4=rows4, counts=counts,
                    epoch=epoch, width=width, page_size=cache.k.shape[3], deferred=True)  # fmt: skip
    return plan, cache.replace(table=cache.table.replace(packed=packed), stats=cache.stats.replace(counts=stats))


def _native_plan(cache: KVCache, slots, num_tokens, width: int, deferred: bool) -> StepPlan:
    """`_plan`'s arrays from one native call over the packed table (`pallas_kernels.cpu.plan`)."""
    rows, tokens, rows4, counts, epoch = _plan_rows(cache, slots, num_tokens, width)
    return StepPlan(slots=slots, num_tokens=num_tokens, rows=rows, tokens=tokens, rows4=rows4, counts=counts,
                    epoch=epoch, width=width, page_size=cache.k.shape[3], deferred=deferred)


def _plan_rows(cache: KVCache, slots, num_tokens, width: int, stats_counts=None):
    """`pallas_kernels.cpu.plan.plan_rows` over the cache's packed table."""
    from arena_jax.kv_cache import _STAT_INDEX, STAT_NAMES, _regions
    from pallas_kernels.cpu.plan import plan_rows

    at = _regions(cache.table.geometry)
    return plan_rows(
        slots, num_tokens, cache.table.packed, page_size=cache.k.shape[3], geometry=cache.table.geometry,
        offsets=tuple(at[r][0] for r in ("page_map", "slot_words", "page_words", "words")), pad_slot=PAD_SLOT,
        width=width, counters=tuple(_STAT_INDEX[c] for c in ("tokens_written", "dropped_writes", "rejected_rows")),
        num_counts=len(STAT_NAMES), stats_counts=stats_counts)  # fmt: skip
