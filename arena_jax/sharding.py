"""Many devices: the arena and its page table placed on a `jax.sharding.Mesh`.

    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    cache = aj.create(layout, mesh=mesh, tensor_axis="tensor", data_axis="data")
    cache, ok = aj.reserve(cache, slots, n)          # the same ops, run per shard in jax.shard_map
    cache.sharding.arena_bytes_per_device(layout)    # what each device holds

Design, and why.

* Where the arena is cut. `k, v: [layers, kv_heads, pages, page_size, head_dim]` are sharded
  `P(None, tensor, data, None, None)`: KV heads over the tensor-parallel axis (the axis the
  model's column-parallel q/k/v projections cut, so each device attends with its own query
  heads to its own KV heads: attention needs no communication at all), pages over the
  data-parallel axis (what tpu-inference and sglang-jax do, `P(data, None, tensor, ...)` in
  their page-major layout). Any other mesh axis holds a replica.

* Fewer KV heads than the tensor degree (Llama-70B's 8 on tp=16, a 2-head GQA model on
  tp=4). The arena stores `kv_replicas = tp // num_kv_heads` copies of each head,
  `stored_kv_heads = tp` heads in all, one per device: device d holds head `d // kv_replicas`,
  exactly the KV head its query heads `[d * N/tp, (d+1) * N/tp)` read. No device ever asks
  another for a head (peers measured the all-to-alls of the alternative: tpu-inference
  #2661). The price is memory, and it is reported as it is: `bytes_per_token_per_device`
  counts the replicas (tp=4 over 2 heads: half the unsharded bytes per device, not a
  quarter). `aj.append` still takes `[B, T, num_kv_heads, D]`; each device picks its head.
  Head counts that neither divide nor are divided by tp are refused.

* The page table is replicated on the tensor axis: every tensor shard runs the allocator on
  the same values (a few integer ops on small arrays) instead of broadcasting results; no
  collective is needed and all shards stay in lockstep by construction.

* Data parallelism: each data shard owns `max_seqs / dp` slots and `num_pages / dp` pages,
  with its own free stack, and runs the unchanged single-device allocator on them. Global
  slot s lives on shard `s // (max_seqs / dp)`; `page_map` holds page ids *local to the slot's
  shard*, so the per-shard body is exactly the single-device code. Arrays indexed by slot or
  page keep their global shapes (split along that axis: `cache.table.lengths[slot]` still
  works), and the three that are per allocator, `num_free`, `epoch` and the `stats` counters,
  gain a leading `[dp]` axis. Batch rows are split likewise: a batch of B rows is dp blocks of
  B / dp, and block d may only name shard d's slots (or PAD_SLOT); the host check raises
  otherwise, and inside a user's jit such a row is rejected and counted, as any invalid row.
  No op moves a page or a table entry between shards.

* How the ops find out. A sharded cache carries a static (non-array) field,
  `KVCache.sharding` (this module's `CacheSharding`: mesh, axis names, replicas). Static, not
  read from the arrays' shardings, because inside a user's jit the arrays are tracers whose
  shardings are unknown until XLA propagates them; a static field is known at trace time,
  travels with the cache through every jit, and costs nothing: an unsharded cache has
  `sharding=None` and takes exactly the code path it always took (no extra op). A
  `KVLayout` field was the other option; the layout is recovered from shapes everywhere
  (`cache.layout`), is a pure geometry that also sizes host-side plans, and would have to
  carry a mesh through every layout comparison.

* How the ops run. Each public op (`reserve`, `append`, `attend`, `release`, `fork`,
  `truncate`) wraps its single-device body in `jax.shard_map` over the mesh: the body sees
  its local arena, its local table and local slot numbers. Nothing in the compiled step
  gathers the arena or a page (checked on the compiled HLO in the tests); with the Pallas
  backend the kernels run per shard on local pages. The shard_map runs with `check_vma=True`
  on the reference path, so JAX itself verifies that table and counters come out the same
  on every tensor shard (they are declared replicated); Pallas calls (GPU or TPU) do not carry
  that type information, so the Pallas paths run with `check_vma=False`, computing the same table.

* Mesh axis types. The cache's mesh is kept in `Auto` mode (a mesh made by `jax.make_mesh`,
  Explicit by default in JAX 0.10, is rebuilt with Auto axes over the same devices): the ops'
  own shard_map specs say where everything is, and models built on the same mesh
  (`models.init_random(..., mesh=...)`) leave intermediate layouts to XLA.

* Multi-host. Nothing here is host-local: arrays are created with `jax.jit(...,
  out_shardings=...)` so each process materializes only its devices' shards, and the mesh may
  span processes (`jax.distributed.initialize`). Host-side checks read table values only
  when the process can see them all (`is_fully_addressable`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from arena_jax.allocator import copies_pages_by_dma, fork_impl, release_impl, reserve_impl, truncate_impl
from arena_jax.arena_ops import append_impl, attend_impl, attend_mixed_impl
from arena_jax.kv_cache import PAD_SLOT, CacheStats, KVCache, PageTable
from arena_jax.layout import KVLayout
from arena_jax.prefix.ops import drop_pages_impl, fork_pages_impl, hold_pages_impl

__all__ = ["CacheSharding", "create_sharded", "auto_mesh", "shard_rows", "slot_lengths", "check_rows", "check_heads"]


def auto_mesh(mesh):
    """The same devices (or, for an AbstractMesh, sizes) and axis names with Auto axis types."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    auto = (AxisType.Auto,) * len(mesh.axis_names)
    if isinstance(mesh, AbstractMesh):
        return AbstractMesh(tuple(mesh.shape.values()), tuple(mesh.axis_names), axis_types=auto)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def _spec(*axes) -> P:
    """A PartitionSpec without trailing Nones (P() when nothing is split)."""
    axes = list(axes)
    while axes and axes[-1] is None:
        axes.pop()
    return P(*axes)


@dataclasses.dataclass(frozen=True)
class CacheSharding:
    """Where a cache lives: a static (hashable) description carried by `KVCache.sharding`."""

    mesh: Mesh  # Auto axis types (an AbstractMesh in a plan made only to size things)
    tensor_axis: str | None  # KV heads are split over this mesh axis
    data_axis: str | None  # slots and pages are split over this mesh axis
    kv_replicas: int = 1  # copies of each KV head (tp // num_kv_heads when fewer heads than tp)

    @classmethod
    def plan(cls, layout: KVLayout, mesh, *, tensor_axis: str | None = "tensor", data_axis: str | None = None):
        """Check that `layout` can be split over `mesh` and say how. ValueError naming the limit.

        `mesh` may be a `jax.sharding.AbstractMesh` (axis names and sizes, no devices) to size a
        deployment from here, e.g. `AbstractMesh((1, 16), ("data", "tensor"))`.
        """
        if not isinstance(layout, KVLayout):
            raise ValueError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if not isinstance(mesh, (Mesh, AbstractMesh)):
            raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        names = tuple(mesh.axis_names)
        for arg, axis in (("tensor_axis", tensor_axis), ("data_axis", data_axis)):
            if axis is not None and axis not in names:
                raise ValueError(f"{arg}={axis!r} is not an axis of the mesh (axes: {names}); pass None for no such axis")
        if tensor_axis is not None and tensor_axis == data_axis:
            raise ValueError(f"tensor_axis and data_axis are both {tensor_axis!r}")
        tp = mesh.shape[tensor_axis] if tensor_axis else 1
        dp = mesh.shape[data_axis] if data_axis else 1
        heads = layout.num_kv_heads
        if heads % tp == 0:
            replicas = 1
        elif tp % heads == 0:
            replicas = tp // heads
        else:
            raise ValueError(
                f"num_kv_heads={heads} and the tensor axis {tensor_axis!r} of size {tp}: one must divide the other "
                "(KV heads are split over the axis, or each is replicated tp // num_kv_heads times)"
            )
        for field in ("num_pages", "max_seqs"):
            if getattr(layout, field) % dp:
                raise ValueError(
                    f"{field}={getattr(layout, field)} is not divisible by the data axis {data_axis!r} of size {dp} "
                    "(each data shard owns an equal share of slots and pages)"
                )
        return cls(auto_mesh(mesh), tensor_axis, data_axis, replicas)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return self.mesh.shape[self.tensor_axis] if self.tensor_axis else 1

    @property
    def dp(self) -> int:
        return self.mesh.shape[self.data_axis] if self.data_axis else 1

    def stored_kv_heads(self, layout: KVLayout) -> int:
        """Heads the global arena stores: num_kv_heads * kv_replicas."""
        return layout.num_kv_heads * self.kv_replicas

    def kv_heads_per_device(self, layout: KVLayout) -> int:
        return self.stored_kv_heads(layout) // self.tp

    def bytes_per_token_per_device(self, layout: KVLayout) -> int:
        """K and V of one token, all layers, on ONE device (replicated heads counted; a quantized
        arena's scales included, as in `KVLayout.bytes_per_token`)."""
        return layout.bytes_per_token // layout.num_kv_heads * self.kv_heads_per_device(layout)

    def arena_bytes_per_device(self, layout: KVLayout) -> int:
        """The arena bytes each device holds: its heads of its data shard's pages."""
        return self.bytes_per_token_per_device(layout) * layout.page_size * (layout.num_pages // self.dp)

    def arena_shape(self, layout: KVLayout) -> tuple[int, ...]:
        """The global shape of `k` and `v` (heads counted with their replicas; int4: head_dim / 2 bytes)."""
        return (layout.num_layers, self.stored_kv_heads(layout)) + layout.arena_shape[2:]

    # ---- partition specs (trailing Nones dropped: jit gives outputs specs in that form, and a
    # created cache must have the shardings of a stepped one, or the first step compiles twice)
    @property
    def arena_spec(self) -> P:
        return _spec(None, self.tensor_axis, self.data_axis, None, None)

    @property
    def rows_spec(self) -> P:
        """Batch rows (slots, counts, ok): split over the data axis."""
        return _spec(self.data_axis)

    def heads_spec(self, split: bool = True) -> P:
        """[B, T, heads, D] activations: rows over data, heads over tensor (if `split`)."""
        return _spec(self.data_axis, None, self.tensor_axis if split else None, None)

    def table_specs(self, geometry: tuple) -> PageTable:
        """The table (`geometry`: its static field): one row of `packed` a data shard, split over
        the data axis (no data axis: one replicated row)."""
        return PageTable(packed=_spec(self.data_axis), geometry=geometry)

    def stats_specs(self) -> CacheStats:
        """Counters: a row per data shard ([dp, N]), else one replicated vector [N]."""
        return jax.tree.map(lambda _: _spec(self.data_axis), CacheStats.zeros())

    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)


# ---- creation ----------------------------------------------------------------------------------


def create_sharded(layout: KVLayout, mesh, *, tensor_axis: str | None = "tensor", data_axis: str | None = None,
                   key_factors=None) -> KVCache:
    """`aj.create(layout, mesh=...)`: the arena and table created in place on their devices."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh of devices, got {type(mesh).__name__}")
    sh = CacheSharding.plan(layout, mesh, tensor_axis=tensor_axis, data_axis=data_axis)
    pages_per_shard = layout.num_pages // sh.dp

    def build():
        table = PageTable.empty(layout)
        stats = CacheStats.zeros()
        if sh.data_axis is not None:
            # A table row per data shard: its slots, its pages (local ids: its free stack's top is
            # its page 0) and its allocator's words, the arena's id in every row.
            table = PageTable.empty(layout, max_seqs=layout.max_seqs // sh.dp, num_pages=pages_per_shard).stacked(sh.dp)
            stats = jax.tree.map(lambda x: jnp.zeros((sh.dp, *x.shape), x.dtype), stats)  # a row of counters a shard
        shape = sh.arena_shape(layout)
        extras = {}
        if layout.quantized:  # [layers, heads, pages, page_size(, groups)]: split like the arena
            scale_shape = shape[:4] + layout.scale_shape[4:]
            if layout.stores_scale_rows(mesh.devices.flat[0].platform, pages=pages_per_shard):  # KVCache.scale_rows
                scale_shape = shape[:2] + layout.scale_rows_shape()[2:]
            extras = {name: jnp.zeros(scale_shape, layout.scale_dtype) for name in ("k_scale", "v_scale")}
        if layout.smooth_keys:  # [layers, heads, head_dim]: heads split (and replicated) like the arena's
            factors = jnp.zeros(layout.key_factors_shape, jnp.float32) if key_factors is None else key_factors
            extras["key_factors"] = jnp.repeat(factors, shape[1] // layout.num_kv_heads, axis=1)
        return KVCache(k=jnp.zeros(shape, layout.storage_dtype), v=jnp.zeros(shape, layout.storage_dtype), table=table,
                       stats=stats, sharding=sh, rotate_keys=layout.rotate_keys, **extras)  # fmt: skip

    specs = _cache_specs(jax.eval_shape(build))
    return jax.jit(build, out_shardings=jax.tree.map(sh.named, specs))()


# ---- host checks (before jit) ----------------------------------------------------------------------


def _concrete(x):
    if isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    return np.asarray(x)


def check_rows(cache: KVCache, slots, name: str = "slots") -> None:
    """On a data-parallel cache: B divisible by dp, and row block d names only shard d's slots."""
    sh = cache.sharding
    if sh.dp == 1:
        return
    batch = slots.shape[0]
    if batch % sh.dp:
        raise ValueError(
            f"{name} has {batch} rows, not a multiple of the data axis {sh.data_axis!r} of size {sh.dp} "
            "(rows are split into equal blocks, one per data shard)"
        )
    values = _concrete(slots)
    if values is None:
        return
    per_shard = cache.table.page_map.shape[0] // sh.dp
    block = np.arange(batch) // (batch // sh.dp)
    owner = values // per_shard
    bad = np.flatnonzero((values != PAD_SLOT) & (owner != block))
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"{name}[{b}]={int(values[b])} is a slot of data shard {int(owner[b])}, but row {b} is in shard "
            f"{int(block[b])}'s block of rows: with data axis {sh.data_axis!r} of size {sh.dp}, rows "
            f"[d*{batch // sh.dp}, (d+1)*{batch // sh.dp}) name slots [d*{per_shard}, (d+1)*{per_shard}) or PAD_SLOT"
        )


def check_heads(cache: KVCache, num_q_heads: int) -> None:
    """Query heads are split over the tensor axis like the KV heads."""
    sh = cache.sharding
    if num_q_heads % sh.tp:
        raise ValueError(
            f"q has {num_q_heads} heads, not divisible by the tensor axis {sh.tensor_axis!r} of size {sh.tp}"
        )


def slot_lengths(cache: KVCache, slots):
    """`cache.table.lengths[slots]` (0 for PAD_SLOT and for a slot the row may not name), read
    by each data shard from its own block: no table value crosses shards."""
    sh = cache.sharding
    max_seqs = cache.table.page_map.shape[0]

    def per_shard(lengths, slots):
        local = _local_slots(sh, slots, max_seqs)
        ok = (local >= 0) & (local < lengths.shape[0])
        return jnp.where(ok, lengths[jnp.where(ok, local, 0)], 0)

    return jax.shard_map(per_shard, mesh=sh.mesh, in_specs=(sh.rows_spec, sh.rows_spec), out_specs=sh.rows_spec)(
        cache.table.lengths, slots
    )


def shard_rows(x, cache: KVCache):
    """Pin activations `[B, ...]` to rows-over-data, replicated over tensor (no-op if unsharded)."""
    sh = cache.sharding
    if sh is None:
        return x
    return lax.with_sharding_constraint(x, sh.named(P(sh.data_axis)))


# ---- the ops, per shard -------------------------------------------------------------------------------


def _cache_specs(cache: KVCache) -> KVCache:
    """The cache's PartitionSpecs, as a KVCache (the same tree, `sharding` included). The page
    table and counters as `table_specs` / `stats_specs`; every other array field is
    arena-shaped (`[layers, heads, pages, ...]`: `k`, `v`, and any per-page companion such as
    quantization scales) and is split like the arena."""
    sh = cache.sharding
    specs = {}
    for f in dataclasses.fields(cache):
        if not f.metadata.get("pytree_node", True) or getattr(cache, f.name) is None:
            continue
        specs[f.name] = {"table": sh.table_specs(cache.table.geometry), "stats": sh.stats_specs(),
                         "key_factors": _spec(None, sh.tensor_axis)}.get(f.name, sh.arena_spec)
    return cache.replace(**specs)


def _local(cache: KVCache) -> KVCache:
    """This shard's blocks -> the cache as the single-device code knows it (no sharding)."""
    table, stats = cache.table, cache.stats
    if cache.sharding.data_axis is not None:  # the shard's row of the table ([1, W] here) and of the counters
        table = table.replace(packed=table.packed[0])
        stats = jax.tree.map(lambda x: x[0], stats)
    return cache.replace(table=table, stats=stats, sharding=None)


def _blocks(local: KVCache, sh: CacheSharding) -> KVCache:
    """A shard's local cache -> its blocks of the global cache (the inverse of `_local`)."""
    table, stats = local.table, local.stats
    if sh.data_axis is not None:
        table = table.replace(packed=table.packed[None])
        stats = jax.tree.map(lambda x: x[None], stats)
    return local.replace(table=table, stats=stats, sharding=sh)


def _local_slots(sh: CacheSharding, slots, max_seqs: int):
    """Global slot ids -> this data shard's; a slot of another shard becomes out of range
    (rejected by the body like any invalid slot), PAD_SLOT stays PAD_SLOT."""
    if sh.data_axis is None:
        return slots
    per_shard = max_seqs // sh.dp
    base = lax.axis_index(sh.data_axis) * per_shard
    mine = (slots >= base) & (slots < base + per_shard)
    return jnp.where(mine, slots - base, jnp.where(slots == PAD_SLOT, PAD_SLOT, per_shard))


def _run(cache: KVCache, body, args, arg_specs, out_specs, *, returns_cache: bool = True, check_vma: bool = True):
    """shard_map `body(local_cache, max_seqs, *local_args)` over the cache's mesh. The body
    returns (local_cache, *outs), or, with returns_cache=False, its one output (read-only ops
    do not return the arena: an un-donated identity output would be a copy of it)."""
    sh = cache.sharding
    max_seqs = cache.table.page_map.shape[0]
    specs = _cache_specs(cache)

    def per_shard(blocks, *local_args):
        out = body(_local(blocks), max_seqs, *local_args)
        if not returns_cache:
            return out
        local, rest = (out, ()) if isinstance(out, KVCache) else (out[0], out[1:])
        return (_blocks(local, sh), *rest)

    out_tree = out_specs if not returns_cache else (specs, *out_specs)
    fn = jax.shard_map(per_shard, mesh=sh.mesh, in_specs=(specs, *arg_specs), out_specs=out_tree, check_vma=check_vma)
    out = fn(cache, *args)
    return out if not returns_cache else (out[0], list(out[1:]))


def reserve(cache: KVCache, slots, num_tokens):
    sh = cache.sharding

    def body(local, max_seqs, slots, num_tokens):
        return reserve_impl(local, _local_slots(sh, slots, max_seqs), num_tokens, kernel=False)  # (XLA's ops per shard)

    # The TPU page-copy kernel (copy-on-write) carries no vma types, like the other Pallas paths.
    cache, (ok,) = _run(cache, body, (slots, num_tokens), (sh.rows_spec,) * 2, (sh.rows_spec,),
                        check_vma=not copies_pages_by_dma(cache))
    return cache, ok


def release(cache: KVCache, slots):
    sh = cache.sharding
    body = lambda local, max_seqs, slots: release_impl(local, _local_slots(sh, slots, max_seqs))  # noqa: E731
    return _run(cache, body, (slots,), (sh.rows_spec,), ())[0]


def truncate(cache: KVCache, slots, lengths):
    sh = cache.sharding
    body = lambda local, max_seqs, slots, n: truncate_impl(local, _local_slots(sh, slots, max_seqs), n)  # noqa: E731
    return _run(cache, body, (slots, lengths), (sh.rows_spec,) * 2, ())[0]


def fork(cache: KVCache, src, dst):
    sh = cache.sharding

    def body(local, max_seqs, src, dst):
        return fork_impl(local, _local_slots(sh, src, max_seqs), _local_slots(sh, dst, max_seqs))

    return _run(cache, body, (src, dst), (sh.rows_spec,) * 2, ())[0]


# ---- the prefix cache's ops (one data shard: the index names global page ids) ---------------------


def one_data_shard(cache: KVCache, op: str) -> CacheSharding:
    sh = cache.sharding
    if sh.dp > 1:
        raise ValueError(
            f"{op} on a cache split over the data axis {sh.data_axis!r} ({sh.dp} shards) is not supported: a prefix "
            "cache would need an index per data shard; use a mesh without a data axis (tensor-parallel only)"
        )
    return sh


def hold_pages(cache: KVCache, pages, num_tokens):
    sh = one_data_shard(cache, "hold_pages")
    body = lambda local, max_seqs, pages, n: hold_pages_impl(local, pages, n)  # noqa: E731
    return _run(cache, body, (pages, num_tokens), (P(), P()), ())[0]


def drop_pages(cache: KVCache, pages):
    sh = one_data_shard(cache, "drop_pages")
    body = lambda local, max_seqs, pages: drop_pages_impl(local, pages)  # noqa: E731
    return _run(cache, body, (pages,), (P(),), ())[0]


def fork_pages(cache: KVCache, pages, num_tokens, dst):
    sh = one_data_shard(cache, "fork_pages")
    body = lambda local, max_seqs, pages, n, dst: fork_pages_impl(local, pages, n, dst)  # noqa: E731
    return _run(cache, body, (pages, num_tokens, dst), (sh.rows_spec,) * 3, ())[0]


def _my_heads(sh: CacheSharding, x):
    """[B, T, num_kv_heads, D] given whole on every tensor shard -> this shard's replica head."""
    head = lax.axis_index(sh.tensor_axis) // sh.kv_replicas
    return lax.dynamic_slice_in_dim(x, head, 1, axis=2)


def append(cache: KVCache, layer, slots, k, v, num_tokens, backend: str):
    sh = cache.sharding
    replicated = sh.kv_replicas > 1

    def body(local, max_seqs, layer, slots, k, v, num_tokens):
        if replicated:
            k, v = _my_heads(sh, k), _my_heads(sh, v)
        return append_impl(local, layer, _local_slots(sh, slots, max_seqs), k, v, num_tokens, backend)

    kv = sh.heads_spec(split=not replicated)
    specs = (P(), sh.rows_spec, kv, kv, sh.rows_spec)
    return _run(cache, body, (layer, slots, k, v, num_tokens), specs, (), check_vma=backend == "reference")[0]


def attend(q, cache: KVCache, layer, slots, num_tokens, backend: str, sliding_window, sm_scale, logits_soft_cap=None):
    sh = cache.sharding
    static_window = sliding_window is None or isinstance(sliding_window, int)
    window = jnp.zeros((), jnp.int32) if static_window else sliding_window  # a traced window travels as data

    def body(local, max_seqs, q, layer, slots, num_tokens, window):
        return attend_impl(q, local, layer, _local_slots(sh, slots, max_seqs), num_tokens, backend,
                           sliding_window if static_window else window, sm_scale, logits_soft_cap)

    specs = (sh.heads_spec(), P(), sh.rows_spec, sh.rows_spec, P())
    return _run(cache, body, (q, layer, slots, num_tokens, window), specs, sh.heads_spec(), returns_cache=False,
                check_vma=backend == "reference")  # fmt: skip


def attend_mixed(q_dec, slots_dec, n_dec, q_pre, slots_pre, n_pre, cache: KVCache, layer, sliding_window, sm_scale,
                 logits_soft_cap=None):
    """`arena_ops.attend_mixed_impl` per shard (the TPU kernels: one call for both parts)."""
    sh = cache.sharding
    static_window = sliding_window is None or isinstance(sliding_window, int)
    window = jnp.zeros((), jnp.int32) if static_window else sliding_window  # a traced window travels as data

    def body(local, max_seqs, q_dec, layer, slots_dec, n_dec, q_pre, slots_pre, n_pre, window):
        return attend_mixed_impl(q_dec, _local_slots(sh, slots_dec, max_seqs), n_dec, q_pre,
                                 _local_slots(sh, slots_pre, max_seqs), n_pre, local, layer,
                                 sliding_window if static_window else window, sm_scale, logits_soft_cap)

    specs = (sh.heads_spec(), P(), sh.rows_spec, sh.rows_spec, sh.heads_spec(), sh.rows_spec, sh.rows_spec, P())
    return _run(cache, body, (q_dec, layer, slots_dec, n_dec, q_pre, slots_pre, n_pre, window), specs,
                (sh.heads_spec(), sh.heads_spec()), returns_cache=False, check_vma=False)
