"""Eviction across the prefix index's two tiers: `PrefixCache.evict_plan` (the rules are in
`arena_jax.prefix.cache`'s module docstring, "A host tier").

The plan frees device pages, least recently used first, and says what the device must do, in
this order: `drop_host` (host pages freed, `aj.drop_host_pages`), `offload` ((device page, host
page) pairs, `aj.offload_pages`: a copy, then the cache's hold goes; a host page freed by
`drop_host` may be reused here), `drop` (device holds that go without a copy, `aj.drop_pages`:
the node keeps its host copy, or leaves the index). The index is updated as the plan says.

A node with children whose host copies are all kept (`keep`) and no host page to spare stays
(the plan may free fewer pages than asked; never when `keep` is a hit's host part, whose
device ancestors are locked). Candidates, both in LRU order ((last_used, serial): parents are touched with their children,
so a parent is never older than its child):
  device  unlocked nodes with a device page and no child on the device;
  host    nodes with a host copy that is not pinned (`keep`: a hit about to be swapped in), that
          keep a device copy (their host copy just goes) or have no child (they leave the
          index), and copies made by this plan whose node has no child (the offload is
          cancelled: the node leaves the index, its device hold is dropped instead).
"""
from __future__ import annotations

import dataclasses
import heapq

__all__ = ["Eviction", "evict_plan"]


@dataclasses.dataclass
class Eviction:
    drop_host: list[int]  # host pages to free first
    offload: list[tuple[int, int]]  # (device page, host page): copy, then drop the hold
    drop: list[int]  # device pages whose holds go without a copy

    @property
    def device_pages(self) -> int:
        """Device pages the plan frees (held only by the cache: unlocked nodes)."""
        return len(self.offload) + len(self.drop)


def _key(node):
    return (node.last_used, node.serial)


def _device_candidate(node) -> bool:
    return node.live and node.page is not None and not node.locks and not any(c.page is not None for c in node.children())


def evict_plan(index, num_pages: int, keep=()) -> Eviction:
    """Free up to `num_pages` device pages of `index` (see the module docstring)."""
    plan = Eviction([], [], [])
    keep = {id(n) for n in keep}
    copies: dict[int, tuple] = {}  # id(node) -> (node, device page, host page): offloads of this plan
    dev_heap = [(_key(n), n.serial, n) for n in index._nodes.values() if _device_candidate(n)]
    heapq.heapify(dev_heap)
    host_heap: list | None = None

    def host_candidate(node) -> bool:
        if not node.live or node.host_page is None or id(node) in keep:
            return False
        if id(node) in copies:
            return node.is_leaf()
        return node.page is not None or node.is_leaf()

    def free_one_host_page(x):
        """A host page for `x`: a free one, or one freed from the LRU host candidate. None when
        `x` itself is older than every candidate and has no child (then `x` should just go)."""
        nonlocal host_heap
        if index._free_host:
            return index._free_host.pop()
        if host_heap is None:
            host_heap = [(_key(n), n.serial, n) for n in index._host_nodes.values() if host_candidate(n)]
            heapq.heapify(host_heap)
        while host_heap and not host_candidate(host_heap[0][2]):
            heapq.heappop(host_heap)
        if not host_heap or (x.is_leaf() and _key(x) < host_heap[0][0]):
            return None
        _, _, y = heapq.heappop(host_heap)
        hp, parent = y.host_page, y.parent
        if id(y) in copies:  # cancel this plan's copy: the node leaves the index, its device hold goes
            _, page, _ = copies.pop(id(y))
            plan.offload.remove((page, hp))
            plan.drop.append(page)
            _forget(index, y)
        elif y.page is not None:  # a device copy stays: only the host copy goes
            plan.drop_host.append(hp)
            del index._host_nodes[hp]
            y.host_page = None
        else:
            plan.drop_host.append(hp)
            _forget(index, y)
        index.host_dropped_pages += 1
        if parent is not index.root and host_candidate(parent):
            heapq.heappush(host_heap, (_key(parent), parent.serial, parent))
        if index._free_host and index._free_host[-1] == hp:
            index._free_host.pop()
        return hp

    freed = 0
    while dev_heap and freed < num_pages:
        _, _, x = heapq.heappop(dev_heap)
        if not _device_candidate(x):
            continue
        parent = x.parent
        if x.host_page is not None:  # already copied: the device copy just goes
            plan.drop.append(x.page)
            del index._nodes[x.page]
            x.page = None
        else:
            hp = free_one_host_page(x) if index.host_capacity else None
            if hp is None and not x.is_leaf():  # its children's host copies are all kept: it stays
                continue
            if hp is None:  # no host tier, or x is the least recently used of all: it goes
                plan.drop.append(x.page)
                index._remove(x)
            else:
                plan.offload.append((x.page, hp))
                copies[id(x)] = (x, x.page, hp)
                del index._nodes[x.page]
                x.page, x.host_page = None, hp
                index._host_nodes[hp] = x
                index.offloaded_pages += 1
                if host_heap is not None and host_candidate(x):
                    heapq.heappush(host_heap, (_key(x), x.serial, x))
        freed += 1
        if parent is not index.root and _device_candidate(parent):
            heapq.heappush(dev_heap, (_key(parent), parent.serial, parent))
    index.evicted_pages += freed
    return plan


def _forget(index, node) -> None:
    """`node` (a leaf) leaves the index; its host page returns to the free list."""
    index._remove(node)
