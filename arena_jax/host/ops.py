"""Page moves between the arena and the host tier, as pure functions of (cache, host): the jitted
bodies of `aj.swap_out`, `aj.swap_in`, `aj.offload_pages`, `aj.drop_host_pages` (`host/api.py`
validates on the host; `arena_jax.host.arena` has the design).

  swap_out         a settled slot's written tokens -> the named host pages (page j of the slot
                   -> host_pages[b, j], each held for the tokens it holds); the slot is released
                   (a page it shared stays with its other holders).
  swap_in          the first num_tokens tokens of host pages -> fresh private device pages
                   appended to dst (an idle slot, or a settled one ending at a page boundary),
                   which is then settled (lengths = written = its old length + num_tokens).
                   The host pages stay held (a copy, not a move).
  offload_pages    pages the cache holds -> the named host pages (held for the same tokens);
                   the cache's holds are dropped (a page no slot maps is freed).
  drop_host_pages  host pages freed.

Totality follows `arena_jax.allocator`: rows are pad (PAD_SLOT, or PAD_PAGE in a page list),
rejected (counted in `stats.rejected_rows`; nothing changes) or served; `swap_in` rows that
are valid but find too few free device pages are refused first come, first served in batch
order (`stats.failed_swaps`), like `reserve`. Rejected:
  swap_out         the slot out of range, named by an earlier row, idle, or not settled (a
                   pending reservation); a used host page (logical page < ceil(length /
                   page_size)) out of range, held, or named by an earlier used entry of the call.
  swap_in          dst out of range, named by an earlier row, not settled or (if active) not
                   at a page boundary; num_tokens outside [0, width * page_size] or past the
                   slot's limit; a used host page out of range, held for fewer tokens than the
                   slot takes from it, or named by an earlier used entry of the call.
  offload_pages    the page out of range, named by an earlier row, or not held by the cache;
                   its host page out of range, held, or named by an earlier row.
  drop_host_pages  the host page out of range, named by an earlier row, or not held.
Every row is rejected, whatever it asks, when the host tier belongs to another arena (its
`arena_id` is not the cache's: `arena_jax.host.arena`, "Bound to its cache"; on the host `check_pair`
refuses it first), so another cache's pages never reach this one.
A used host page named by an earlier used entry of the call is refused even when that earlier
row is rejected for another reason: the first naming wins, whatever becomes of it. (A row's
used entries: swap_out, the pages its slot maps, if the slot is in range and named first;
swap_in, the pages its num_tokens takes, if dst is in range and named first and the count is
valid for it; offload_pages, every row that is not padding.)
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from arena_jax.allocator import _drop_refs, _page_rows, _release_rows, _saturating_cumsum, slot_rows
from arena_jax.host.arena import HostArena, page_arrays
from arena_jax.kv_cache import PAD_PAGE, PAD_SLOT, KVCache
from arena_jax.memory import to_device, to_host
from pallas_kernels.index_math import ceil_div_nonneg

__all__ = ["swap_out_impl", "swap_in_impl", "offload_pages_impl", "drop_host_pages_impl", "move_pages",
           "move_pages_reference"]


def move_pages(src: dict, dst: dict, src_pages, dst_pages, moves, transfer, scale_rows: int | None = None) -> dict:
    """Copy page src_pages[k] of every array in `src` to page dst_pages[k] of the same array in
    `dst`, for the k where `moves` (bool[K]) is set; `transfer` moves a page between memory kinds.
    One page at a time (dynamic_slice -> transfer -> dynamic_update_slice, module docstring of
    `arena_jax.host.arena`), the moves compacted to the front so the loop runs exactly their count.
    `scale_rows`: the cache's page size when its scales are scale rows (`KVCache.scale_rows`),
    moved by `_move_scale_lanes`."""
    order = jnp.argsort(~moves, stable=True)  # moves first
    src_pages, dst_pages = src_pages[order], dst_pages[order]
    count = jnp.sum(moves.astype(jnp.int32))
    lanes = ("k_scale", "v_scale") if scale_rows else ()
    words = sorted(name for name in dst if src[name].dtype != dst[name].dtype)  # host pages as words (`host_page_format`)
    plain = {name: x for name, x in dst.items() if name not in words and name not in lanes}

    def body(i, out):
        return {
            name: lax.dynamic_update_slice_in_dim(
                x, transfer(lax.dynamic_slice_in_dim(src[name], src_pages[i], 1, axis=2)), dst_pages[i], axis=2
            )
            for name, x in out.items()
        }

    out = {**dst, **(lax.fori_loop(0, count, body, plain) if plain else {})}
    for name in words:
        out[name] = _move_words(src[name], dst[name], src_pages, dst_pages, count, transfer)
    for name in lanes:
        out[name] = _move_scale_lanes(src[name], dst[name], src_pages, dst_pages, count, transfer, scale_rows)
    return out


def _move_scale_lanes(src, dst, src_pages, dst_pages, count, transfer, page_size: int):
    """`move_pages` for scale rows (`KVCache.scale_rows`: device page p is the S lanes of row
    p // (128 / S) at (p % (128 / S)) * S). The host tier keeps a whole 128-lane row a host page,
    its first S lanes used (`host_page_format`), because a TPU's host-memory slices must be whole
    lane tiles ("Slicing lane dimension is only supported when the lane slice size is a multiple
    of LaneCount", compiled for v5e); the device side moves the page's lanes of its row (device
    slices of rows compile there). `transfer` is `to_host` (device -> host) or `to_device`."""
    per_row = 128 // page_size
    layers, heads = src.shape[:2]

    def body(i, out):
        s, d = src_pages[i], dst_pages[i]
        if transfer is to_host:
            page = lax.dynamic_slice(src, (0, 0, s // per_row, s % per_row * page_size), (layers, heads, 1, page_size))
            row = jnp.pad(page, ((0, 0), (0, 0), (0, 0), (0, 128 - page_size)))
            return lax.dynamic_update_slice(out, transfer(row), (0, 0, d, 0))
        row = transfer(lax.dynamic_slice(src, (0, 0, s, 0), (layers, heads, 1, 128)))
        return lax.dynamic_update_slice(out, row[..., :page_size], (0, 0, d // per_row, d % per_row * page_size))

    return lax.fori_loop(0, count, body, dst)


def _move_words(src, dst, src_pages, dst_pages, count, transfer):
    """`move_pages` for one array whose host side holds its pages as 32-bit words
    (`arena_jax.host.host_page_format`: row p * L + l is layer l of page p), one layer of one
    page at a time: [1, H, S, D] 8-bit <-> [1, H, S * D / 512, 128] uint32 on the device side."""
    to_host_side = dst.dtype == jnp.uint32
    arena, words = (src, dst) if to_host_side else (dst, src)
    layers, heads, _, size, dim = arena.shape
    rows, lanes = words.shape[2:]

    def as_words(page):  # [1, H, 1, S, D] -> [1, H, rows, lanes]
        return lax.bitcast_convert_type(page.reshape(1, heads, rows, lanes, 4), jnp.uint32)

    def as_page(word_rows):  # [1, H, rows, lanes] -> [1, H, 1, S, D]
        return lax.bitcast_convert_type(word_rows, arena.dtype).reshape(1, heads, 1, size, dim)

    def body(j, out):
        i, layer = j // layers, j % layers
        if to_host_side:
            page = lax.dynamic_slice(src, (layer, 0, src_pages[i], 0, 0), (1, heads, 1, size, dim))
            return lax.dynamic_update_slice(out, transfer(as_words(page)), (dst_pages[i] * layers + layer, 0, 0, 0))
        word_rows = lax.dynamic_slice(src, (src_pages[i] * layers + layer, 0, 0, 0), (1, heads, rows, lanes))
        return lax.dynamic_update_slice(out, as_page(transfer(word_rows)), (layer, 0, dst_pages[i], 0, 0))

    return lax.fori_loop(0, count * layers, body, dst)


def move_pages_reference(src: dict, dst: dict, src_pages, dst_pages, moves) -> dict:
    """`move_pages` as one gather and one scatter, with no memory-kind transfer (every array
    on the device): what the loop must compute, for tests on fresh random data."""
    target = jnp.where(moves, dst_pages, dst[next(iter(dst))].shape[2])
    return {name: x.at[:, :, target].set(src[name][:, :, jnp.where(moves, src_pages, 0)], mode="drop")
            for name, x in dst.items()}  # fmt: skip


def _scale_rows(cache: KVCache) -> int | None:
    """The page size when the cache's scales are scale rows (`move_pages`), else None."""
    return cache.k.shape[3] if cache.scale_rows else None


def _first_uses(pages, use, num_pages: int):
    """bool like `pages` (any shape): the entry is a used, in-range page no earlier used entry names
    (row-major order over the whole call)."""
    flat, used = pages.reshape(-1), use.reshape(-1)
    ok = used & (flat >= 0) & (flat < num_pages)
    pos = jnp.arange(flat.shape[0], dtype=jnp.int32)
    first = jnp.full((num_pages,), flat.shape[0], jnp.int32).at[jnp.where(ok, flat, num_pages)].min(pos, mode="drop")
    return (ok & (first[jnp.where(ok, flat, 0)] == pos)).reshape(pages.shape)


def _same_arena(cache: KVCache, host: HostArena):
    """bool[]: the host tier was made for this cache's arena (every row is refused otherwise,
    and for a host tier that records no arena: `check_pair` refuses one before any trace)."""
    if host.arena_id is None:
        return jnp.bool_(False)
    return host.arena_id == cache.table.arena_id


def swap_out_impl(cache: KVCache, host: HostArena, slots, host_pages):
    """slots i32[B], host_pages i32[B, M] -> (cache, host, ok bool[B]) (module docstring)."""
    table = cache.table
    max_pages = table.page_map.shape[1]
    page_size = cache.k.shape[3]
    n_host = host.held.shape[0]
    pad = slots == PAD_SLOT
    live, idx = slot_rows(table, slots)
    length = jnp.where(live, table.lengths[idx], 0)
    settled = jnp.all(table.written[:, idx] == table.lengths[idx][None, :], axis=0)
    lp = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    use = lp < ceil_div_nonneg(length, page_size)[:, None]  # [B, M]
    free = (host_pages >= 0) & (host_pages < n_host) & (host.held[jnp.clip(host_pages, 0, n_host - 1)] == 0)
    distinct = _first_uses(host_pages, use, n_host)
    ok = live & table.active[idx] & settled & jnp.all((free & distinct) | ~use, axis=1) & _same_arena(cache, host)

    moves = ok[:, None] & use  # [B, M]
    src = jnp.where(moves, table.page_map[idx], 0)
    dst = jnp.where(moves, host_pages, 0)
    pages = move_pages(page_arrays(cache), host.pages, src.reshape(-1), dst.reshape(-1), moves.reshape(-1), to_host,
                       _scale_rows(cache))
    tokens = jnp.clip(length[:, None] - lp * page_size, 0, page_size)
    held = host.held.at[jnp.where(moves, host_pages, n_host)].set(tokens, mode="drop")
    cache, freed = _release_rows(cache, slots, ok)
    stats = cache.stats.bump(
        pages_to_host=moves, swap_outs=ok, pages_recycled=freed, rejected_rows=~pad & ~ok
    )
    return cache.replace(stats=stats), host.replace(pages=pages, held=held), ok | pad


def swap_in_impl(cache: KVCache, host: HostArena, host_pages, num_tokens, dst):
    """host_pages i32[B, W], num_tokens i32[B], dst i32[B] -> (cache, host, ok bool[B])."""
    table = cache.table
    max_seqs, max_pages = table.page_map.shape
    num_pages, page_size = cache.k.shape[2], cache.k.shape[3]
    n_host, width = host.held.shape[0], host_pages.shape[1]
    pad = dst == PAD_SLOT
    live, idx = slot_rows(table, dst)
    length = jnp.where(live, table.lengths[idx], 0)
    settled = jnp.all(table.written[:, idx] == table.lengths[idx][None, :], axis=0)
    # `n <= room`, never `length + n <= limit`: a traced n could overflow the sum.
    n_ok = (num_tokens >= 0) & (num_tokens <= width * page_size) & (num_tokens <= max_pages * page_size - length)
    n = jnp.where(n_ok, num_tokens, 0)
    lp = jnp.arange(width, dtype=jnp.int32)[None, :]
    take = jnp.clip(n[:, None] - lp * page_size, 0, page_size)  # [B, W] tokens taken from each host page
    use = (take > 0) & live[:, None]
    covered = (host_pages >= 0) & (host_pages < n_host) & (host.held[jnp.clip(host_pages, 0, n_host - 1)] >= take)
    distinct = _first_uses(host_pages, use, n_host)
    valid = live & settled & (length % page_size == 0) & n_ok & jnp.all((covered & distinct) | ~use, axis=1)
    valid = valid & _same_arena(cache, host)

    # First come, first served in batch order, as `reserve`.
    need = jnp.sum(use, axis=1).astype(jnp.int32)
    demand = jnp.where(valid, need, 0)
    ok = valid & ((demand == 0) | (_saturating_cumsum(demand, num_pages + 1) <= table.num_free))
    granted = jnp.where(ok, demand, 0)
    first = jnp.cumsum(granted) - granted
    total = jnp.sum(granted)
    new_page = table.free_stack[jnp.clip(table.num_free - 1 - (first[:, None] + lp), 0, num_pages - 1)]  # [B, W]
    moves = ok[:, None] & use

    have = length // page_size  # the slot's pages (it ends at a page boundary)
    where = jnp.where(moves, have[:, None] + lp, max_pages)  # logical page of each new page
    row = table.page_map[idx]  # [B, M]
    row = _place(row, where, new_page, moves)
    new_length = length + n
    target = jnp.where(ok, dst, max_seqs)
    table = table.replace(
        page_map=table.page_map.at[target].set(row, mode="drop"),
        lengths=table.lengths.at[target].set(new_length, mode="drop"),
        active=table.active.at[target].set(True, mode="drop"),
        written=table.written.at[:, target].set(new_length[None, :], mode="drop"),
        refcount=table.refcount.at[jnp.where(moves, new_page, num_pages)].set(1, mode="drop"),
        num_free=table.num_free - total,
    )
    src = jnp.where(moves, host_pages, 0).reshape(-1)
    fresh = jnp.where(moves, new_page, 0).reshape(-1)
    arrays = move_pages(host.pages, page_arrays(cache), src, fresh, moves.reshape(-1), to_device, _scale_rows(cache))
    stats = cache.stats.bump(
        pages_allocated=total, pages_to_device=total, swap_ins=ok,
        failed_swaps=valid & ~ok, rejected_rows=~pad & ~valid,
    )  # fmt: skip
    return cache.replace(table=table, stats=stats, **arrays), host, ok | pad


def _place(row, where, pages, moves):
    """row i32[B, M] with row[b, where[b, j]] = pages[b, j] where moves[b, j]."""
    max_pages = row.shape[1]
    b = jnp.arange(row.shape[0], dtype=jnp.int32)[:, None]
    return row.at[b, jnp.where(moves, where, max_pages)].set(pages, mode="drop")


def offload_pages_impl(cache: KVCache, host: HostArena, pages, host_pages):
    """pages i32[K] (held by the cache), host_pages i32[K] -> (cache, host) (module docstring)."""
    table = cache.table
    num_pages = cache.k.shape[2]
    n_host = host.held.shape[0]
    pad = pages == PAD_PAGE
    _, first, idx = _page_rows(num_pages, pages)
    held = table.held[idx]
    free = (host_pages >= 0) & (host_pages < n_host) & (host.held[jnp.clip(host_pages, 0, n_host - 1)] == 0)
    ok = first & (held > 0) & free & _first_uses(host_pages, ~pad, n_host) & _same_arena(cache, host)
    arrays = move_pages(page_arrays(cache), host.pages, idx, jnp.where(ok, host_pages, 0), ok, to_host, _scale_rows(cache))
    host_held = host.held.at[jnp.where(ok, host_pages, n_host)].set(held, mode="drop")
    target = jnp.where(ok, pages, num_pages)
    table, freed = _drop_refs(table.replace(held=table.held.at[target].set(0, mode="drop")), target)
    stats = cache.stats.bump(
        pages_to_host=ok, holds_dropped=ok, pages_evicted=freed, pages_recycled=freed,
        rejected_rows=~pad & ~ok,
    )  # fmt: skip
    return cache.replace(table=table, stats=stats), host.replace(pages=arrays, held=host_held)


def drop_host_pages_impl(cache: KVCache, host: HostArena, host_pages):
    """host_pages i32[K] -> (cache, host): the held ones are freed."""
    n_host = host.held.shape[0]
    pad = host_pages == PAD_PAGE
    _, first, idx = _page_rows(n_host, host_pages)
    ok = first & (host.held[idx] > 0) & _same_arena(cache, host)
    held = host.held.at[jnp.where(ok, host_pages, n_host)].set(0, mode="drop")
    stats = cache.stats.bump(host_pages_dropped=ok, rejected_rows=~pad & ~ok)
    return cache.replace(stats=stats), host.replace(held=held)
