"""The host tier's public operations: validate on the host, then one jitted pure function each
(`arena_jax.host.arena` has the design, `arena_jax.host.ops` the rules and the bodies).

Every op takes the cache and the host tier donated and returns both: keep the returned ones.
Inside a user's jit they inline and are total (refusals counted in `stats.rejected_rows`).
On a tensor-parallel mesh each runs its body per shard (`jax.shard_map`): every device moves
its own KV heads between its own memory kinds.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from arena_jax import sharding
from arena_jax.host import ops as host_ops
from arena_jax.host.arena import HostArena, check_pair
from arena_jax.kv_cache import PAD_PAGE, PAD_SLOT, KVCache
from arena_jax.validate import check_cache_arrays, check_counts, check_ints, check_pages, check_slots, concrete

__all__ = ["swap_out", "swap_in", "offload_pages", "drop_host_pages"]


def _check(cache, host):
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache (from arena_jax.create), got {type(cache).__name__}")
    layout = check_cache_arrays(cache)
    check_pair(cache, host)
    if cache.sharding is not None and cache.sharding.dp > 1:
        raise ValueError(f"the host tier needs one data shard; this cache has {cache.sharding.dp}")
    return layout


def _host_pages(host: HostArena, pages, name: str, *, ndim: int, unique: bool):
    """Host page ids as i32 of `ndim` dims: PAD_PAGE or in [0, host.num_pages); with `unique`,
    no page twice in the call."""
    arr = check_ints(pages, name)
    if arr.ndim == 0 and ndim == 1:
        arr = arr[None]
    if arr.ndim != ndim:
        what = "a 1-D array of host page ids" if ndim == 1 else "a 2-D array of host page ids [batch, pages]"
        raise ValueError(f"{name} must be {what} (PAD_PAGE={PAD_PAGE} for none), got shape {arr.shape}")
    values = concrete(arr)
    if values is not None:
        bad = values[(values != PAD_PAGE) & ((values < 0) | (values >= host.num_pages))]
        if bad.size:
            raise ValueError(f"{name} has {bad.tolist()}: host pages must be in [0, {host.num_pages}) or PAD_PAGE ({PAD_PAGE})")
        live = values[values != PAD_PAGE]
        if unique and np.unique(live).size != live.size:
            raise ValueError(f"{name} names a host page twice ({values.tolist()}): each may appear once per call")
    return arr


def _used_once(used: list[int], name: str) -> None:
    seen = set()
    for p in used:
        if p in seen:
            raise ValueError(f"{name} uses host page {p} twice in one call")
        seen.add(p)


def _pad_columns(pages, width: int):
    return jnp.pad(pages, ((0, 0), (0, width - pages.shape[1])), constant_values=PAD_PAGE)


# ---- sharded runs (tensor-parallel: the page table and `held` replicated, pages split by head) ------


def _run_pair(cache: KVCache, host: HostArena, body, args, arg_specs, out_specs):
    sh = cache.sharding
    cache_specs = sharding._cache_specs(cache)
    host_specs = host.replace(pages={name: sh.arena_spec for name in host.pages}, held=P(), host_id=P(),
                              arena_id=None if host.arena_id is None else P(),
                              key_factors=None if host.key_factors is None else cache_specs.key_factors)  # fmt: skip

    def per_shard(blocks, host_blocks, *local_args):
        local, local_host, *rest = body(sharding._local(blocks), host_blocks.replace(sharding=None), *local_args)
        return (sharding._blocks(local, sh), local_host.replace(sharding=sh), *rest)

    fn = jax.shard_map(per_shard, mesh=sh.mesh, in_specs=(cache_specs, host_specs, *arg_specs),
                       out_specs=(cache_specs, host_specs, *out_specs))  # fmt: skip
    return fn(cache, host, *args)


def _maybe_sharded(impl, cache, host, args, arg_specs, out_specs):
    if cache.sharding is None:
        return impl(cache, host, *args)
    return _run_pair(cache, host, impl, args, arg_specs, out_specs)


# ---- the ops ---------------------------------------------------------------------------------------


@functools.partial(jax.jit, donate_argnames=("cache", "host"))
def _swap_out(cache, host, slots, host_pages):
    return _maybe_sharded(host_ops.swap_out_impl, cache, host, (slots, host_pages), (P(), P()), (P(),))


def swap_out(cache: KVCache, host: HostArena, slots, host_pages):
    """Copy each slot's tokens to host pages and release the slot. Returns (cache, host, ok bool[B]).

    `slots` i32[B] (PAD_SLOT rows are padding); `host_pages` i32[B, W] (W <= max_pages_per_seq):
    the slot's logical page j goes to host page host_pages[b, j], for j < ceil(length /
    page_size), and that host page then holds the tokens the slot has in it. A slot must be in
    use and settled (every layer written up to its reservation); the host pages it uses must be
    free and named once in the call. The slot is released afterwards: its pages return to the
    free stack unless another holder (a fork, the prefix cache) still has them."""
    layout = _check(cache, host)
    slots = check_slots(layout, slots)
    pages = _host_pages(host, host_pages, "host_pages", ndim=2, unique=False)
    if pages.shape[0] != slots.shape[0]:
        raise ValueError(f"host_pages has {pages.shape[0]} rows but slots has {slots.shape[0]}")
    if pages.shape[1] > layout.max_pages_per_seq:
        raise ValueError(f"host_pages has {pages.shape[1]} columns, more than max_pages_per_seq={layout.max_pages_per_seq}")
    s, p = concrete(slots), concrete(pages)
    if s is not None and p is not None:
        t = cache.table
        active, lengths, written = concrete(t.active), concrete(t.lengths), concrete(t.written)
        held = concrete(host.held)
        used = []
        for b in np.flatnonzero(s != PAD_SLOT):
            slot = int(s[b])
            if not active[slot]:
                raise ValueError(f"slots[{b}]={slot} is not in use: nothing to swap out")
            if (written[:, slot] != lengths[slot]).any():
                raise ValueError(
                    f"slots[{b}]={slot} has reserved tokens not yet written (reserved {int(lengths[slot])}, written per "
                    f"layer {written[:, slot].tolist()}): append them, or truncate to the written length, first"
                )
            need = -(-int(lengths[slot]) // layout.page_size)
            if need > p.shape[1]:
                raise ValueError(f"slot {slot} holds {int(lengths[slot])} tokens in {need} pages; host_pages has {p.shape[1]} columns")
            for j, hp in enumerate(p[b, :need].tolist()):
                if hp == PAD_PAGE or held[hp]:
                    what = "PAD_PAGE" if hp == PAD_PAGE else f"host page {hp}, held ({int(held[hp])} tokens)"
                    raise ValueError(f"host_pages[{b}, {j}] is {what}: slot {slot}'s page {j} needs a free host page")
                used.append(hp)
        _used_once(used, "host_pages")
    return _swap_out(cache, host, slots, _pad_columns(pages, layout.max_pages_per_seq))


@functools.partial(jax.jit, donate_argnames=("cache", "host"))
def _swap_in(cache, host, host_pages, num_tokens, dst):
    return _maybe_sharded(host_ops.swap_in_impl, cache, host, (host_pages, num_tokens, dst), (P(), P(), P()), (P(),))


def swap_in(cache: KVCache, host: HostArena, host_pages, num_tokens, dst):
    """Copy the first `num_tokens[b]` tokens of host pages `host_pages[b, :]` (i32[B, W], W <=
    max_pages_per_seq) into fresh device pages appended to slot dst[b]. Returns (cache, host, ok).

    dst is an idle slot (it becomes a slot of num_tokens tokens) or one in use, settled and
    ending at a page boundary (it grows by num_tokens: e.g. after `fork_pages` of a prefix whose
    rest is on the host). The slot is then settled; its new pages are its own. Each used host
    page must hold at least the tokens taken from it; the host pages stay held (drop them with
    `drop_host_pages` once they are not needed). A row that finds too few free device pages is
    left unchanged, `ok` False (`stats.failed_swaps`), first come first served as `reserve`."""
    layout = _check(cache, host)
    dst = check_slots(layout, dst, "dst")
    pages = _host_pages(host, host_pages, "host_pages", ndim=2, unique=False)
    if pages.shape[0] != dst.shape[0]:
        raise ValueError(f"host_pages has {pages.shape[0]} rows but dst has {dst.shape[0]}")
    if pages.shape[1] > layout.max_pages_per_seq:
        raise ValueError(f"host_pages has {pages.shape[1]} columns, more than max_pages_per_seq={layout.max_pages_per_seq}")
    num_tokens = check_counts(layout, num_tokens, dst.shape[0], "num_tokens")
    d, p, n = concrete(dst), concrete(pages), concrete(num_tokens)
    if d is not None and p is not None and n is not None:
        t = cache.table
        active, lengths, written = concrete(t.active), concrete(t.lengths), concrete(t.written)
        held, size = concrete(host.held), layout.page_size
        used = []
        for b in np.flatnonzero(d != PAD_SLOT):
            slot, count = int(d[b]), int(n[b])
            if active[slot] and ((written[:, slot] != lengths[slot]).any() or lengths[slot] % size):
                raise ValueError(
                    f"dst[{b}]={slot} is in use with {int(lengths[slot])} tokens reserved (written per layer "
                    f"{written[:, slot].tolist()}): swap_in appends to an idle slot or a settled one ending at a page boundary"
                )
            if count > p.shape[1] * size:
                raise ValueError(f"num_tokens[{b}]={count} needs more than the {p.shape[1]} pages a row of host_pages has")
            if int(lengths[slot]) + count > layout.max_seq_len:
                raise ValueError(f"num_tokens[{b}]={count} would grow slot {slot} past max_seq_len={layout.max_seq_len}")
            for j, hp in enumerate(p[b, : -(-count // size)].tolist()):
                take = min(size, count - j * size)
                if hp == PAD_PAGE or held[hp] < take:
                    have = "PAD_PAGE" if hp == PAD_PAGE else f"host page {hp}, holding {int(held[hp])} tokens"
                    raise ValueError(f"host_pages[{b}, {j}] is {have}: num_tokens[{b}]={count} takes {take} tokens from it")
                used.append(hp)
        _used_once(used, "host_pages")
    return _swap_in(cache, host, pages, num_tokens, dst)


@functools.partial(jax.jit, donate_argnames=("cache", "host"))
def _offload_pages(cache, host, pages, host_pages):
    return _maybe_sharded(host_ops.offload_pages_impl, cache, host, (pages, host_pages), (P(), P()), ())


def offload_pages(cache: KVCache, host: HostArena, pages, host_pages):
    """Copy pages the cache holds (`pages` i32[K], PAD_PAGE rows are padding) to free host pages
    (`host_pages` i32[K]), each then holding the same tokens, and drop the cache's holds (a page
    no slot maps returns to the free stack). Returns (cache, host)."""
    layout = _check(cache, host)
    pages = check_pages(layout, pages)
    hp = _host_pages(host, host_pages, "host_pages", ndim=1, unique=True)
    if hp.shape != pages.shape:
        raise ValueError(f"host_pages must have pages' shape {pages.shape}, got {hp.shape}")
    p, h = concrete(pages), concrete(hp)
    if p is not None and h is not None:
        held, host_held = concrete(cache.table.held), concrete(host.held)
        for k in np.flatnonzero(p != PAD_PAGE):
            if not held[p[k]]:
                raise ValueError(f"pages[{k}]={int(p[k])} is not held by the cache: only held pages are offloaded")
            if h[k] == PAD_PAGE or host_held[h[k]]:
                raise ValueError(f"host_pages[{k}] is {'PAD_PAGE' if h[k] == PAD_PAGE else f'held host page {int(h[k])}'}: "
                                 "an offloaded page needs a free host page")  # fmt: skip
    return _offload_pages(cache, host, pages, hp)


@functools.partial(jax.jit, donate_argnames=("cache", "host"))
def _drop_host_pages(cache, host, host_pages):
    return _maybe_sharded(host_ops.drop_host_pages_impl, cache, host, (host_pages,), (P(),), ())


def drop_host_pages(cache: KVCache, host: HostArena, host_pages):
    """Free host pages (`host_pages` i32[K], PAD_PAGE rows are padding). Returns (cache, host)."""
    _check(cache, host)
    hp = _host_pages(host, host_pages, "host_pages", ndim=1, unique=True)
    h = concrete(hp)
    if h is not None:
        host_held = concrete(host.held)
        idle = [int(x) for x in h[h != PAD_PAGE] if not host_held[x]]
        if idle:
            raise ValueError(f"host_pages {idle} are not held: nothing to drop")
    return _drop_host_pages(cache, host, hp)
