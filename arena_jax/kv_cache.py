"""The cache's state: immutable pytrees (`KVCache`, its `PageTable` and `CacheStats`), all arrays,
updated with `.replace` inside jit, and the padding sentinels `PAD_SLOT` / `PAD_PAGE`.

Near the bottom of `arena_jax` (it imports only `arena_jax.layout`, and the TPU kernels' test of
scale rows' shapes, `pallas_kernels.tpu.common.logical_scales`): every op imports these;
`arena_jax.state.create` allocates them (and re-exports them: `arena_jax.state.KVCache` is this
class)."""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization, struct

from arena_jax.layout import KVLayout
from arena_jax.unrolled import small_sum

__all__ = ["PageTable", "PAGE_TABLE_FIELDS", "CacheStats", "STAT_NAMES", "KVCache", "PAD_SLOT", "PAD_PAGE", "new_arena_id"]

# A batch row whose slot is PAD_SLOT asks for nothing, writes nothing and attends to nothing.
# It is an explicit sentinel: it is never used as an index (no -1 wrap-around into the last slot).
PAD_SLOT = -1
# A PAD_PAGE entry of `hold_pages` / `drop_pages` is padding: it names no page and is not counted.
PAD_PAGE = -1


def _view(read):
    """A PageTable property read from `packed`; on a table of ShapeDtypeStructs (`jax.eval_shape`
    of a cache) it gives the ShapeDtypeStruct of what it reads."""

    @functools.wraps(read)
    def get(self):
        if isinstance(self.packed, jax.ShapeDtypeStruct):
            return jax.eval_shape(lambda packed: read(dataclasses.replace(self, packed=packed)), self.packed)
        return read(self)

    return property(get)


@struct.dataclass
class PageTable:
    """Which pages belong to which slot, and how far each slot is reserved and written.

    `lengths[s]` is what slot s has *reserved*; `written[l, s]` what layer l has *stored*.
    Positions in [written[l, s], lengths[s]) are reserved but unwritten: attention never reads
    them, so a page's previous tenant stays invisible without scrubbing. They always lie in
    pages the slot holds alone (refcount 1), so `append` never writes a shared page.

    `held[p]` is how many tokens of page p the cache itself holds for its prefix index
    (`hold_pages`; 0: no hold). A hold is one more reference: every page in use has
    `refcount == (page_map entries naming it) + (held > 0)`. A held page is never written (a
    mapping slot shares it, and `append` writes only private pages), so its first `held[p]`
    tokens stay as they were when the hold was taken, at every layer.

    **Stored as one int32 array**, `packed`, read through the ten fields' names and four
    regions (properties) and updated with `.replace(<field or region>=...)` (a slice of
    `packed` rewritten in place) or `set_slots` (one scatter). Why one: every jitted op takes
    and returns the cache, and each array costs a call a buffer to pass, donate and alias
    (~0.95 us each on a CPU: a jitted no-op with the tiny decode step's signature took 24.0 us
    over the cache's 7 arrays, 21.0 us over its 4; benchmarks/RESULTS.md, "The page table in
    one array"). `packed` holds four regions, one after the other, each row-major:

    - `page_map`  i32[max_seqs, max_pages_per_seq], physical page per logical page, -1 unmapped
    - `slot_words` i32[max_seqs, 2 + num_layers]: per slot, `lengths` (tokens reserved),
      `active` (0 / 1: slot in use), then `written[l]` for each layer l (tokens whose K/V are
      stored there, <= lengths)
    - `page_words` i32[3, num_pages]: per page, `free_stack` (entries [0, num_free) are free;
      top = num_free - 1, LIFO), `refcount` (0 free, 1 owned, >1 shared; = mappings + (held >
      0)), `held` (tokens of the page the cache itself holds for the prefix cache, 0 = no hold)
    - `words` i32[3]: `num_free`; `epoch`, advanced by every call that unmaps a slot's page or
      shares a private one (release, truncate, fork, fork_pages, hold_pages; a call that
      changes nothing leaves it): a `StepPlan` is made at one epoch and void at any other, so a
      plan kept past such a call writes and reads nothing (the ops that only map more pages or
      make shared pages private, reserve, swap_in, drop_pages, offload_pages, leave it: a plan
      made before them never writes a page it may no longer write); `arena_id`, a random id
      drawn when the arena is created and never changed by any op: page ids mean something
      only in their own arena, so a prefix index bound to one arena can tell another apart
      (`PrefixCache.check`). Data, not a static field: a new arena must not recompile.

    `geometry` (static): (max_seqs, max_pages_per_seq, num_layers, num_pages) of the table a
    row of `packed` holds. A cache with data shards (`create(mesh=...)`) stores `packed` as
    [dp, W], a row per shard: that shard's slots, pages (local page ids) and allocator words.
    The regions then read as the whole cache's, slots and pages in shard order (`page_map`
    [dp * max_seqs, M], `page_words` [3, dp * num_pages], `words` [dp, 3]); inside the
    sharded ops each shard works on its own row (`arena_jax.sharding`).
    """

    packed: jax.Array  # i32[W] ([dp, W] with data shards): page_map, slot_words, page_words, words
    geometry: tuple = struct.field(pytree_node=False)  # (max_seqs, max_pages_per_seq, num_layers, num_pages) of a row

    # ---- the four regions and the ten fields (works on tracers and on concrete arrays) ----

    @_view
    def page_map(self) -> jax.Array:
        """i32[max_seqs, max_pages_per_seq], physical page per logical page, -1 unmapped."""
        return self._region("page_map")

    @_view
    def slot_words(self) -> jax.Array:
        """i32[max_seqs, 2 + num_layers]: lengths, active, written[0], ..., written[L - 1]."""
        return self._region("slot_words")

    @_view
    def page_words(self) -> jax.Array:
        """i32[3, num_pages]: free_stack, refcount, held."""
        return self._region("page_words")

    @_view
    def words(self) -> jax.Array:
        """i32[3] ([dp, 3] with data shards): num_free, epoch, arena_id."""
        return self._region("words")

    @property
    def slots_shape(self) -> tuple[int, int]:
        """(max_seqs, max_pages_per_seq) of the whole table: `page_map.shape`, read from the
        static geometry and `packed`'s shape (works on ShapeDtypeStructs)."""
        shards = self.packed.shape[0] if self.packed.ndim == 2 else 1
        return shards * self.geometry[0], self.geometry[1]

    @_view
    def lengths(self) -> jax.Array:
        """i32[max_seqs], tokens reserved per slot."""
        return self.slot_words[:, 0]

    @_view
    def active(self) -> jax.Array:
        """bool[max_seqs], slot in use."""
        return self.slot_words[:, 1] != 0

    @_view
    def written(self) -> jax.Array:
        """i32[num_layers, max_seqs], tokens whose K/V are stored at each layer (<= lengths)."""
        return self.slot_words[:, 2:].T

    @_view
    def free_stack(self) -> jax.Array:
        """i32[num_pages], entries [0, num_free) are free; top = num_free - 1 (LIFO)."""
        return self.page_words[0]

    @_view
    def refcount(self) -> jax.Array:
        """i32[num_pages], 0 free, 1 owned, >1 shared; = mappings + (held > 0)."""
        return self.page_words[1]

    @_view
    def held(self) -> jax.Array:
        """i32[num_pages], tokens of the page the cache itself holds (prefix cache), 0 = no hold."""
        return self.page_words[2]

    @_view
    def num_free(self) -> jax.Array:
        """i32[] (with data shards: i32[dp]), pages on the free stack."""
        return self.words[..., 0]

    @_view
    def epoch(self) -> jax.Array:
        """i32[] (with data shards: i32[dp]), see the class docstring."""
        return self.words[..., 1]

    @_view
    def arena_id(self) -> jax.Array:
        """i32[], the arena's random id (the same in every data shard's row)."""
        return self.words[2] if self.words.ndim == 1 else self.words[0, 2]

    def _region(self, name: str) -> jax.Array:
        start, shape = _regions(self.geometry)[name]
        size = int(np.prod(shape))
        if self.packed.ndim == 1:
            return self.packed[start : start + size].reshape(shape)
        shards = self.packed.shape[0]
        rows = self.packed[:, start : start + size].reshape(shards, *shape)  # each shard's region
        if name == "words":
            return rows  # [dp, 3]
        if name == "page_words":  # pages in shard order along axis 1
            return jnp.moveaxis(rows, 0, 1).reshape(3, shards * shape[1])
        return rows.reshape(shards * shape[0], shape[1])  # slots in shard order along axis 0

    def _with_region(self, name: str, value) -> "PageTable":
        """This table with region `name` := value (its shape as the property returns it): an
        in-place update of `packed`'s slice (an indexed update, not `lax.dynamic_update_slice`,
        which under an explicit mesh wants the value sharded as `packed`)."""
        start, shape = _regions(self.geometry)[name]
        size = int(np.prod(shape))
        xp = np if isinstance(self.packed, np.ndarray) else jnp  # a table of numpy arrays (read back) stays one
        value = xp.asarray(value, np.int32)
        if self.packed.ndim == 1:
            value = value.reshape(size)
        else:
            shards = self.packed.shape[0]
            if name == "page_words":
                value = xp.moveaxis(value.reshape(3, shards, shape[1]), 1, 0)
            value = value.reshape(shards, size)
        if xp is np:
            packed = self.packed.copy()
            packed[..., start : start + size] = value
        else:
            packed = self.packed.at[..., start : start + size].set(value)
        return dataclasses.replace(self, packed=packed)

    @classmethod
    def pack(cls, *, page_map, lengths, active, free_stack, num_free, refcount, written, held, arena_id,
             epoch) -> "PageTable":  # fmt: skip
        """A table (one row: no data shards) from its ten fields (shapes as the properties return them)."""
        page_map = jnp.asarray(page_map, jnp.int32)
        slot_words = _slot_words(lengths, active, written)
        page_words = _page_words(free_stack, refcount, held)
        words = _words(num_free, epoch, arena_id)
        if words.ndim != 1:
            raise ValueError(f"PageTable.pack builds one table: num_free and epoch are scalars, got words {words.shape}")
        geometry = (*page_map.shape, slot_words.shape[1] - 2, page_words.shape[1])
        return cls(packed=jnp.concatenate([page_map.ravel(), slot_words.ravel(), page_words.ravel(), words]),
                   geometry=geometry)  # fmt: skip

    def stacked(self, shards: int) -> "PageTable":
        """`shards` copies of this one-row table, a row each ([dp, W]): the tables of a cache
        with data shards, every shard starting alike."""
        return dataclasses.replace(self, packed=jnp.tile(self.packed[None], (shards, 1)))

    def advanced(self, changed) -> "PageTable":
        """This table at the next epoch if any of `changed` (bool[...]: the rows the call
        served) is set, else at its own (wraps at 2**32)."""
        return self.replace(epoch=self.epoch + jnp.any(changed).astype(jnp.int32))

    @classmethod
    def empty(cls, layout: KVLayout, arena_id: int | None = None, *, max_seqs: int | None = None,
              num_pages: int | None = None) -> "PageTable":  # fmt: skip
        """The table of a new arena (`max_seqs` / `num_pages`: a data shard's, default the layout's)."""
        max_seqs = layout.max_seqs if max_seqs is None else max_seqs
        num_pages = layout.num_pages if num_pages is None else num_pages
        # The stack's top is reused first; page 0 on top gives a fresh arena pages 0, 1, 2, ...
        return cls.pack(
            page_map=jnp.full((max_seqs, layout.max_pages_per_seq), -1, jnp.int32),
            lengths=jnp.zeros((max_seqs,), jnp.int32),
            active=jnp.zeros((max_seqs,), bool),
            free_stack=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),
            num_free=jnp.asarray(num_pages, jnp.int32),
            refcount=jnp.zeros((num_pages,), jnp.int32),
            written=jnp.zeros((layout.num_layers, max_seqs), jnp.int32),
            held=jnp.zeros((num_pages,), jnp.int32),
            arena_id=jnp.asarray(new_arena_id() if arena_id is None else arena_id, jnp.int32),
            epoch=jnp.zeros((), jnp.int32),
        )

    def set_slots(self, target, **columns) -> "PageTable":
        """`lengths` / `active` / `written_at=(layer, values)` set at slots `target` i32[B] (out of
        range: dropped), each column a value or per-row values [B]: one scatter into `packed`
        (`.replace(lengths=self.lengths.at[target].set(...))` rebuilds the region).
        `layer` must be in range (callers clip it)."""
        cols, values = [], []
        for name, col in (("lengths", 0), ("active", 1)):
            if name in columns:
                cols.append(col)
                values.append(jnp.broadcast_to(jnp.asarray(columns.pop(name), jnp.int32), target.shape))
        if "written_at" in columns:
            layer, value = columns.pop("written_at")
            cols.append(2 + layer)
            values.append(jnp.broadcast_to(jnp.asarray(value, jnp.int32), target.shape))
        if columns:
            raise TypeError(f"PageTable.set_slots: unknown columns {sorted(columns)}")
        if not cols:
            return self
        col_idx = jnp.broadcast_to(jnp.stack([jnp.asarray(c, jnp.int32) for c in cols])[None, :], (target.shape[0], len(cols)))
        return self.set_slot_words(jnp.broadcast_to(target[:, None], col_idx.shape), col_idx, jnp.stack(values, axis=1))

    def set_slot_words(self, rows, cols, values) -> "PageTable":
        """`slot_words[rows, cols] = values` (i32, one shape), a cell whose row is out of range
        dropped: one scatter into `packed` (no copy of the region)."""
        return self.scatter_region("slot_words", rows, cols, values)

    def scatter_region(self, name: str, rows, cols, values, *, add: bool = False) -> "PageTable":
        """Region `name` (page_map, slot_words, page_words; words as one row, a row a shard with
        data shards) with [rows, cols] set to (`add`: incremented by) values, i32 of one shape; a
        cell whose row is out of range is dropped (`cols` must be in range). One scatter into
        `packed`: no copy of the region (`.replace(region=...)` rebuilds it)."""
        if self.packed.ndim != 1:  # data shards (outside the sharded ops): through the region
            region = getattr(self, name)
            at = region.at[jnp.where(rows < 0, region.shape[0], rows), cols]  # a negative row dropped, not wrapped
            return self.replace(**{name: at.add(values, mode="drop") if add else at.set(values, mode="drop")})
        return self.scatter_flat(self.flat_index(name, rows, cols), values, add=add)

    def scatter_rows(self, name: str, target, values) -> "PageTable":
        """Whole rows of a 2-D region: row target[b] := values[b] (i32[B], [B, width]), a row out of
        range dropped (`scatter_region`)."""
        cols = jnp.broadcast_to(jnp.arange(values.shape[1], dtype=jnp.int32), values.shape)
        return self.scatter_region(name, jnp.broadcast_to(target[:, None], values.shape), cols, values)

    def flat_index(self, name: str, rows, cols):
        """The index into a one-row `packed` of region `name`'s cells [rows, cols] (`scatter_region`);
        len(packed), which scatters drop, where the row is out of range."""
        start, shape = _regions(self.geometry)[name]
        num_rows, width = shape if len(shape) == 2 else (1, shape[0])
        rows, cols = jnp.asarray(rows, jnp.int32), jnp.asarray(cols, jnp.int32)
        return jnp.where((rows >= 0) & (rows < num_rows), start + rows * width + cols, self.packed.shape[0])

    def scatter_flat(self, flat, values, *, add: bool = False) -> "PageTable":
        """`packed[flat] = values` (`add`: +=), an index out of range dropped; one-row tables
        (`flat_index`)."""
        at = self.packed.at[flat]
        return dataclasses.replace(self, packed=at.add(values, mode="drop") if add else at.set(values, mode="drop"))


def packed_width(geometry: tuple) -> int:
    """W: the int32 words of a table row of `geometry` (its four regions)."""
    start, shape = _regions(tuple(geometry))["words"]
    return start + int(np.prod(shape))


@functools.lru_cache(maxsize=64)
def _regions(geometry: tuple) -> dict:
    """{region: (start in `packed`'s row, shape)} of a table row of `geometry`."""
    max_seqs, max_pages, num_layers, num_pages = geometry
    shapes = {"page_map": (max_seqs, max_pages), "slot_words": (max_seqs, 2 + num_layers),
              "page_words": (3, num_pages), "words": (3,)}  # fmt: skip
    out, start = {}, 0
    for name, shape in shapes.items():
        out[name] = (start, shape)
        start += int(np.prod(shape))
    return out


_REGION_NAMES = ("page_map", "slot_words", "page_words", "words")
_SLOT_FIELDS = ("lengths", "active", "written")
_PAGE_FIELDS = ("free_stack", "refcount", "held")
_WORD_FIELDS = ("num_free", "epoch", "arena_id")
PAGE_TABLE_FIELDS = ("page_map", "lengths", "active", "free_stack", "num_free", "refcount", "written", "held",
                     "arena_id", "epoch")  # fmt: skip


def _slot_words(lengths, active, written):
    lengths, written = jnp.asarray(lengths, jnp.int32), jnp.asarray(written, jnp.int32)
    return jnp.concatenate([lengths[:, None], jnp.asarray(active).astype(jnp.int32)[:, None], written.T], axis=1)


def _page_words(free_stack, refcount, held):
    return jnp.stack([jnp.asarray(x, jnp.int32) for x in (free_stack, refcount, held)])


def _words(num_free, epoch, arena_id):
    num_free, epoch = jnp.asarray(num_free, jnp.int32), jnp.asarray(epoch, jnp.int32)
    arena_id = jnp.broadcast_to(jnp.asarray(arena_id, jnp.int32), num_free.shape)
    return jnp.stack([num_free, epoch, arena_id], axis=-1)


def _replace_table(table: PageTable, **changes) -> PageTable:
    """`PageTable.replace`: `packed`, a region by its name, or any of the ten fields by theirs
    (its region rebuilt from the new value and the others' current ones)."""
    unknown = sorted(set(changes) - {"packed", "geometry"} - set(_REGION_NAMES) - set(PAGE_TABLE_FIELDS))
    if unknown:
        raise TypeError(f"PageTable.replace: unknown fields {unknown}")
    out = dataclasses.replace(table, **{k: changes.pop(k) for k in ("packed", "geometry") if k in changes})
    for name in _REGION_NAMES:
        if name in changes:
            out = out._with_region(name, changes.pop(name))
    for group, name, pack in ((_SLOT_FIELDS, "slot_words", _slot_words), (_PAGE_FIELDS, "page_words", _page_words),
                              (_WORD_FIELDS, "words", _words)):  # fmt: skip
        if any(f in changes for f in group):
            values = [changes[f] if f in changes else getattr(out, f) for f in group]
            out = out._with_region(name, pack(*values))
    return out


PageTable.replace = _replace_table


def new_arena_id() -> int:
    """A random positive int32 (os.urandom: independent of any seeded generator)."""
    return int.from_bytes(os.urandom(4), "little") % (2**31 - 1) + 1


# The counters, in the order of `CacheStats.counts`; each a property of `CacheStats` by its name.
STAT_NAMES = {
    "tokens_written": "tokens appended (counted once, at layer 0)",
    "pages_allocated": "pages popped from the free stack (new pages and copy-on-write targets)",
    "pages_recycled": "pages returned to the free stack by release / truncate / fork-over",
    "metadata_ops": "forks, truncations and reservations served without a new page",
    "cow_copies": "copy-on-write page copies (the only data-moving allocator operation)",
    "failed_reservations": "reservation rows refused for lack of pages",
    "dropped_writes": "append rows refused: their tokens would pass the reservation or land in a shared page",
    "rejected_rows": "rows refused as invalid input inside jit (duplicate / out-of-range slots, bad counts, ...)",
    "prefix_forks": "slots made from cached pages (`fork_pages` rows served)",
    "prefix_tokens": "tokens those slots received without computing them",
    "pages_held": "holds the cache took on pages (`hold_pages` rows served)",
    "holds_dropped": "holds the cache gave back (`drop_pages` rows served)",
    "pages_evicted": "of those, pages the drop freed (no slot mapped them): evictions",
    # The host tier (`arena_jax.host`): pages, not bytes (int32 bytes would wrap after 2 GiB);
    # `aj.health` turns them into bytes (`layout.page_bytes` each: values and scales, all layers).
    "pages_to_host": "pages copied device -> host (`swap_out`, `offload_pages`)",
    "pages_to_device": "pages copied host -> device (`swap_in`)",
    "swap_outs": "slots swapped out (`swap_out` rows served)",
    "swap_ins": "slots swapped in (`swap_in` rows served)",
    "failed_swaps": "`swap_in` rows refused for lack of device pages",
    "host_pages_dropped": "host pages freed (`drop_host_pages`)",
    # Speculative decoding (counted by the verify step that runs on the cache: `models.speculative`).
    "proposed_tokens": "tokens proposed to verify calls (speculative decoding)",
    "accepted_tokens": "of those, the ones the model agreed with (the rest rolled back by `truncate`)",
}
_STAT_INDEX = {name: i for i, name in enumerate(STAT_NAMES)}


@struct.dataclass
class CacheStats:
    """Counters updated inside the jitted ops (int32: they wrap after 2**31 events).

    One int32 vector, `counts` [N] (a cache with data shards: [dp, N], one row per shard), in
    the order of `STAT_NAMES`; each counter reads as a property of its name
    (`cache.stats.rejected_rows`: i32[] or i32[dp]). One array, not N scalars: every jitted op
    takes and returns the cache, and each array in it costs a call a buffer to pass, donate
    and alias (N scalars made a tiny model's decode step dispatch ~24 us slower on a CPU), and
    an op's counts land in one add."""

    counts: jax.Array  # i32[..., len(STAT_NAMES)]

    @classmethod
    def zeros(cls) -> "CacheStats":
        return cls(counts=jnp.zeros((len(STAT_NAMES),), jnp.int32))

    def bump(self, **deltas) -> "CacheStats":
        """Add each named count: an integer scalar, or per-row counts / flags (summed). Deltas of
        one shape are summed together (e.g. a batch's bool[B] flags), and every count
        lands in one add: an op's counting is a few XLA kernels, not two per counter."""
        unknown = sorted(set(deltas) - set(STAT_NAMES))
        if unknown:
            raise TypeError(f"CacheStats.bump: unknown counters {unknown} (known: {', '.join(STAT_NAMES)})")
        values = {name: jnp.asarray(v, jnp.int32) for name, v in deltas.items()}
        counts = self.counts
        shards = counts.shape[0] if counts.ndim == 2 else 1  # [dp, N]: a row of counters per data shard
        for shape in sorted({v.shape for v in values.values()}):
            names = [n for n, v in values.items() if v.shape == shape]
            if counts.ndim == 2 and (len(shape) != 1 or shape[0] % shards):
                raise ValueError(f"CacheStats.bump: counters of {shards} data shards take per-row counts [B] "
                                 f"(B a multiple of {shards}, rows in shard order), got shape {shape} for {names}")
            flat = jnp.stack([values[n] for n in names]).reshape(len(names), shards, -1)  # [k, shards, rows]
            # Each count summed straight into its place of the [N] vector (a static one-hot
            # [k, N]): one sum whatever k, no per-counter slices to stack again; folded by
            # elementwise ops where k and the rows are short (`small_sum`: a decode step's counters).
            place = np.eye(len(STAT_NAMES), dtype=np.int32)[[_STAT_INDEX[n] for n in names]]
            per_shard = small_sum(flat[:, :, :, None] * place[:, None, None, :], axis=(0, 2))  # [shards, N]
            counts = counts + (per_shard if counts.ndim == 2 else per_shard[0])
        return self.replace(counts=counts)

    def as_dict(self) -> dict:
        """{counter name: i32[] (or i32[dp])}."""
        return {name: self.counts[..., i] for i, name in enumerate(STAT_NAMES)}


for _name, _doc in STAT_NAMES.items():
    setattr(CacheStats, _name, property(lambda self, _i=_STAT_INDEX[_name]: self.counts[..., _i], doc=_doc))


@dataclasses.dataclass(frozen=True)
class KVCache:
    """The arena (K/V values, and the scales of a quantized arena), its page table and counters.

    8-bit arenas (int8, float8_e4m3fn, float8_e5m2) carry `k_scale`, `v_scale`:
    `[num_layers, num_kv_heads, num_pages, page_size]` (float32 or bfloat16), one scale per
    token and KV head, so that a stored row is `values * scale` (`pallas_kernels.quant`). int4
    arenas store `k`, `v` as uint8 `[..., head_dim / 2]` (two codes a byte) with one scale per
    group of 32 lanes, `[num_layers, num_kv_heads, num_pages, page_size, head_dim / 32]`
    (`pallas_kernels.quant4`). Float arenas have `k_scale = v_scale = None`. Why this
    representation:
    - Same paged geometry as the values (indexed by the same physical page and offset): fork,
      truncate, release and prefix sharing move page *ids*, so they move scales with values
      and need nothing new; the one op that copies page data (copy-on-write in `reserve`)
      copies the scales with it.
    - None is an empty pytree node: a float arena's cache has exactly the leaves it had before
      (same jit signatures, same donation, same `tree_map`s); an 8-bit arena's scales are
      ordinary leaves, donated and updated in place with the values.
    - On a TPU, 8-bit pages of 16, 32 or 64 tokens store their scales as **scale rows**,
      `[num_layers, num_kv_heads, num_pages * page_size / 128, 128]` (`scale_rows`): the same
      values in row-major order, 128 / page_size pages a row, because a TPU DMA moves whole
      512-byte rows and the TPU's layout of `[..., pages, page_size]` puts the pages in the lanes
      (`pallas_kernels.tpu.common.scale_rows`). `page_scales()` reads either form as
      `[L, H, P, S]`.
    - `layout` stays derivable from shapes and dtypes alone (the scale dtype from `k_scale`; a
      uint8 arena is int4, head_dim twice its last axis), plus one static field:
    - `rotate_keys` (static, like `sharding`): the keys were rotated before quantization
      (`pallas_kernels.rotation`), so attention rotates q the same way. A property of how the
      bytes were written, not of any page: every op that moves pages stays oblivious, and a
      static field costs nothing in a jit and travels with the cache through every op.
    - `key_factors` (`smooth_keys`): f32[num_layers, num_kv_heads, head_dim], the static
      per-channel factors every stored key of a layer was divided by (`arena_jax.key_factors`;
      0: not calibrated, applied as 1). Not per page: fixed by `create` for the cache's life,
      read by every write and attention; no op changes it. None when off.
    """

    k: jax.Array  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]
    v: jax.Array  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]
    table: PageTable
    stats: CacheStats
    k_scale: jax.Array | None = None  # [num_layers, num_kv_heads, num_pages, page_size(, head_dim / 32 for int4)] or scale rows
    v_scale: jax.Array | None = None  # the same; None for float arenas
    # None: one device. A sharded cache (`create(layout, mesh=...)`) carries its static
    # `arena_jax.sharding.CacheSharding` here; the ops then run per shard (see that module).
    sharding: Any = dataclasses.field(default=None, metadata={"pytree_node": False})
    rotate_keys: bool = dataclasses.field(default=False, metadata={"pytree_node": False})  # keys stored rotated (quantized arenas)
    key_factors: jax.Array | None = None  # f32[num_layers, num_kv_heads, head_dim] (smooth_keys), else None

    def replace(self, **updates) -> "KVCache":
        """A copy with `updates` (field names) replaced, as a `flax.struct` dataclass's."""
        return dataclasses.replace(self, **updates)

    @property
    def layout(self) -> KVLayout:
        """The geometry, read back from the shapes (works on tracers and ShapeDtypeStructs)."""
        num_layers, num_kv_heads, num_pages, page_size, head_dim = self.k.shape
        int4 = self.k.dtype == jnp.uint8  # two codes a byte
        if self.sharding is not None:  # heads replicated over the tensor axis are stored kv_replicas times
            num_kv_heads //= self.sharding.kv_replicas
        max_seqs, max_pages_per_seq = self.table.slots_shape
        return KVLayout(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=2 * head_dim if int4 else head_dim,
            page_size=page_size,
            num_pages=num_pages,
            max_seqs=max_seqs,
            max_pages_per_seq=max_pages_per_seq,
            dtype="int4" if int4 else self.k.dtype,
            scale_dtype=None if self.k_scale is None else self.k_scale.dtype,
            rotate_keys=self.rotate_keys,
            smooth_keys=self.key_factors is not None,
        )

    @property
    def quantized(self) -> bool:
        """8-bit or int4 (values plus scales)."""
        return self.k_scale is not None

    @property
    def scale_rows(self) -> bool:
        """Whether the scales are stored as rows of 128 lanes (see the class docstring): the
        kernels' own test of the shapes (`pallas_kernels.tpu.common.logical_scales`)."""
        from pallas_kernels.tpu.common import logical_scales

        return logical_scales(self.k, self.k_scale)[1]

    def page_scales(self):
        """(k_scale, v_scale) as [L, H, P, S] (scale rows reshaped: a bitcast off a TPU, a
        relayout on one); None for a float arena."""
        if not self.scale_rows:
            return self.k_scale, self.v_scale
        shape = tuple(self.k.shape[:4])
        return self.k_scale.reshape(shape), self.v_scale.reshape(shape)


# KVCache is one pytree node whose children are its arrays, the table's and the counters' among
# them (k, v, table.packed, stats.counts, k_scale, v_scale, key_factors: the leaves, in the order
# nested dataclass nodes would give them). Why: every jitted op takes and returns the cache, and
# JAX rebuilds the returned one on the host at every call. Three `flax.struct` nodes (the cache,
# its table, its counters) took 2.9 us a call to rebuild, the one node 1.2 us; a jitted no-op
# with the tiny decode step's signature went from 25.7 to 23.2 us (benchmarks/RESULTS.md, "The
# cache as one pytree node"). A table or counters that are not a PageTable / CacheStats (a
# prefix of specs, say) stay one child each. The table's static geometry travels in the aux data.


def _cache_children(cache: KVCache):
    table, stats = cache.table, cache.stats
    if type(table) is PageTable and type(stats) is CacheStats:  # the common case, written out: it runs every call
        return (cache.k, cache.v, table.packed, stats.counts, cache.k_scale, cache.v_scale, cache.key_factors), (
            cache.sharding, cache.rotate_keys, table.geometry)
    return (cache.k, cache.v, table, stats, cache.k_scale, cache.v_scale, cache.key_factors), (
        cache.sharding, cache.rotate_keys, None)


def _cache_keys(cache: KVCache):
    children, aux = _cache_children(cache)
    inner = ("table.packed", "stats.counts") if aux[2] is not None else ("table", "stats")
    names = ("k", "v", *inner, "k_scale", "v_scale", "key_factors")
    return tuple(zip(map(jax.tree_util.GetAttrKey, names), children)), aux


def _cache_from_children(aux, children) -> KVCache:
    cache = object.__new__(KVCache)  # a frozen dataclass, its fields set without __init__ (as `dataclasses` does)
    fields = cache.__dict__
    fields["k"], fields["v"] = children[0], children[1]
    if aux[2] is not None:
        table = object.__new__(PageTable)
        table.__dict__.update(packed=children[2], geometry=aux[2])
        stats = object.__new__(CacheStats)
        stats.__dict__["counts"] = children[3]
        fields["table"], fields["stats"] = table, stats
    else:
        fields["table"], fields["stats"] = children[2], children[3]
    fields["k_scale"], fields["v_scale"], fields["key_factors"] = children[4], children[5], children[6]
    fields["sharding"], fields["rotate_keys"] = aux[0], aux[1]
    return cache


jax.tree_util.register_pytree_with_keys(KVCache, _cache_keys, _cache_from_children, flatten_func=_cache_children)

# `flax.serialization` as for a `flax.struct` dataclass: a dict of the pytree fields (the table and
# counters as theirs), restored field by field.
_DATA_FIELDS = tuple(f.name for f in dataclasses.fields(KVCache) if f.metadata.get("pytree_node", True))


def _cache_state_dict(cache: KVCache) -> dict:
    return {name: serialization.to_state_dict(getattr(cache, name)) for name in _DATA_FIELDS}


def _cache_from_state_dict(cache: KVCache, state: dict) -> KVCache:
    unknown = set(state) - set(_DATA_FIELDS)
    missing = set(_DATA_FIELDS) - set(state)
    if unknown or missing:
        raise ValueError(f"KVCache state dict: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}")
    return cache.replace(**{name: serialization.from_state_dict(getattr(cache, name), state[name], name=name)
                            for name in _DATA_FIELDS})  # fmt: skip


serialization.register_serialization_state(KVCache, _cache_state_dict, _cache_from_state_dict)
