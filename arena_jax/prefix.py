"""`PrefixCache`: the host-side index of cached prefixes (which token ids the cache's held pages
hold), with longest-prefix lookup at token granularity and LRU eviction of leaves.

    index = aj.PrefixCache(layout)
    hit = index.lookup(prompt, limit=len(prompt) - 1)   # PrefixHit(num_tokens, pages)
    cache = aj.fork_pages(cache, [pad(hit.pages)], [hit.num_tokens], [slot])
    ...
    ins = index.insert(ids[:written], page_map_row)     # which pages to hold / drop
    cache = aj.hold_pages(cache, [p for p, _ in ins.hold], [k for _, k in ins.hold])

Design: a trie of *pages*. Each node is one physical page the cache holds: the token ids it
holds (1 to page_size of them, `table.held[page]` on the device), under the node of the page
before it in the sequence. Children of a full page are keyed by their tokens; a partly filled
page is a leaf. Why this and not the alternatives:

- A radix tree over tokens (SGLang) splits an edge wherever two sequences diverge. On pages of
  16 tokens that split can fall inside a page, and two continuations of one page position need
  two physical pages anyway (a page holds one sequence's tokens). So the unit of storage, of
  reference counting and of eviction is the page, and the tree is a tree of pages; siblings
  may share their first tokens (the K/V of those tokens is stored twice, unavoidably).
- Chained hashes of full pages (vLLM) find full pages in O(1) per page but reuse only whole
  pages. Here the full-page children of a node are found by their token tuple (a dict, the
  same O(1) per page, no hash collisions to worry about: keys are the tokens themselves), and
  then one step more gives token granularity: among the children starting with the next
  token, the longest common prefix wins, full or partly filled. A hit may end anywhere inside
  a page: `fork_pages` maps the page with fewer tokens than it holds, and the slot's first
  `reserve` copies it (copy-on-write), so the cached tokens stay intact.

Lookups walk one node per page (a dict lookup of the page's tokens), then scan the children
with the right first token. No device transfer: the index holds page ids and token ids; the
device holds the pages, their refcounts and the holds.

Locks and eviction (LRU, leaves first). A running sequence locks the deepest node it maps, and
with it every ancestor (`acquire`, `relock` as it grows, `unlock`: a count per node, as SGLang's
lock refs); `evictable_pages` counts the unlocked nodes. `evict(n)` removes up
to n unlocked leaves, least recently used first (a parent becomes a leaf when its last child
goes, and is considered in the same pass); the caller drops their holds (`aj.drop_pages`),
which frees the pages no slot maps. A locked node is never evicted, so nothing a running
sequence maps is freed; the device's refcounts would keep it alive anyway (a drop only frees a
page no slot maps), the locks make sure the pages evicted really free memory.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Sequence

import numpy as np

from arena_jax.layout import KVLayout
from arena_jax.state import PAD_PAGE

__all__ = ["PrefixCache", "PrefixHit", "Insertion"]


class _Node:
    __slots__ = ("page", "tokens", "parent", "full", "partial", "last_used", "locks", "serial", "live", "owner")

    def __init__(self, page: int, tokens: tuple, parent: "_Node | None", serial: int):
        self.page = page  # physical page id (-1 for the root)
        self.tokens = tokens  # the token ids the cache holds in the page
        self.parent = parent
        self.full: dict[tuple, _Node] = {}  # children holding a full page, keyed by their tokens
        self.partial: dict[int, list[_Node]] = {}  # children holding part of a page, by first token
        self.last_used = 0
        self.locks = 0  # running sequences mapping this node or a descendant
        self.serial = serial  # creation order: a deterministic tie-break
        self.live = True  # False once removed from the index (evicted or replaced)
        self.owner = None  # the PrefixCache holding it

    def children(self):
        yield from self.full.values()
        for group in self.partial.values():
            yield from group

    def is_leaf(self) -> bool:
        return not self.full and not self.partial


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix of a lookup: `num_tokens` tokens held in `pages`
    (ceil(num_tokens / page_size) of them; the last may hold more tokens than the hit uses)."""

    num_tokens: int
    pages: tuple[int, ...]
    nodes: tuple = dataclasses.field(default=(), repr=False, compare=False)  # the index's nodes, for lock / unlock

    def whole_pages(self, page_size: int) -> "PrefixHit":
        """The hit cut back to its whole pages: no partly used last page, so nothing to copy on write."""
        keep = self.num_tokens // page_size
        return PrefixHit(keep * page_size, self.pages[:keep], self.nodes[:keep])


@dataclasses.dataclass
class Insertion:
    """What `insert` changed: the caller holds `hold` ((page, tokens) pairs: new nodes) and drops
    `drop` (pages of unlocked, partly filled nodes a longer one replaced); `nodes` are the nodes
    holding the caller's own pages, root first (a running caller maps them: it locks the last)."""

    hold: list[tuple[int, int]]
    drop: list[int]
    nodes: list


class PrefixCache:
    """The index of the pages a `KVCache` holds for reuse (see the module docstring).

    It belongs to one arena: its pages are exactly that cache's held pages (`table.held`), with
    the same token counts, and page ids mean nothing in another arena. `bind(cache)` ties it to
    the arena's random id (`table.arena_id`, drawn by `aj.create`), and `check(cache)` refuses
    any other arena, and a cache whose holds differ from the index. `tag` names what produced
    the cached K/V (`models.generate` uses a fingerprint of the model's config and weights): a
    `check` with another tag is refused too, since the same tokens give other K/V under other
    weights. Metrics: `metrics()`.

    Every method validates its arguments (token ids are integers, pages are ids in
    [0, num_pages), locks balance) with a `ValueError` naming the argument, before changing
    anything: the counters (`num_pages`, `evictable_pages`, locks) stay consistent under any
    call order.
    """

    def __init__(self, layout: KVLayout, *, tag=None):
        if not isinstance(layout, KVLayout):
            raise ValueError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if tag is not None:
            _check_tag(tag)
        self.layout = layout
        self.page_size = layout.page_size
        self.tag = tag
        self.arena_id: int | None = None  # set by `bind`
        self._serial = itertools.count()
        self.root = _Node(-1, (), None, next(self._serial))
        self.root.owner = self
        self._nodes: dict[int, _Node] = {}  # page -> node
        self._leaves: set[_Node] = set()  # nodes without children: the eviction candidates
        self._clock = 0
        self._locked = 0  # nodes with locks > 0
        self.lookups = self.lookup_tokens = self.hit_tokens = 0
        self.inserted_pages = self.evicted_pages = self.replaced_pages = 0

    # ---- queries ------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Pages the index (and so the cache) holds."""
        return len(self._nodes)

    @property
    def evictable_pages(self) -> int:
        """Pages no running sequence maps (nor any descendant of theirs): `evict` can free them all."""
        return len(self._nodes) - self._locked

    @property
    def locked_pages(self) -> int:
        return self._locked

    def pages(self) -> dict[int, int]:
        """page -> number of tokens held: what `table.held` must say."""
        return {p: len(n.tokens) for p, n in self._nodes.items()}

    def lookup(self, ids: Sequence[int], limit: int | None = None) -> PrefixHit:
        """The longest cached prefix of `ids`, at most `limit` tokens. Changes nothing (no LRU
        touch, no metrics): `acquire` does that for a hit that is used."""
        ids = _token_ids(ids, "ids")
        if limit is not None:
            limit = _count(limit, "limit")
        limit = len(ids) if limit is None else min(limit, len(ids))
        size = self.page_size
        node, pos, nodes = self.root, 0, []
        while pos < limit:
            chunk = tuple(ids[pos : pos + size])
            child = node.full.get(chunk) if len(chunk) == size else None
            if child is not None and pos + size <= limit:
                nodes.append(child)
                node, pos = child, pos + size
                continue
            best, best_len = None, 0
            for cand in self._candidates(node, chunk[0]):
                n = _common_prefix(cand.tokens, chunk)
                if n > best_len or (n == best_len and best is not None and n and cand.last_used > best.last_used):
                    best, best_len = cand, n
            take = min(best_len, limit - pos)
            if take > 0:
                nodes.append(best)
                pos += take
            break
        return PrefixHit(pos, tuple(n.page for n in nodes), tuple(nodes))

    def _candidates(self, node: _Node, first: int):
        for tokens, child in node.full.items():
            if tokens[0] == first:
                yield child
        yield from node.partial.get(first, ())

    # ---- use, insert, lock ---------------------------------------------------------------------
    def acquire(self, hit: PrefixHit, num_tokens: int):
        """Record the lookup of `num_tokens` tokens that gave `hit` (metrics), mark its pages
        used now (LRU) and lock them (the caller maps them). Returns the lock's anchor, the
        deepest node of the hit (None for a miss): `unlock` it when the caller stops mapping."""
        if not isinstance(hit, PrefixHit):
            raise ValueError(f"hit must be a PrefixHit from lookup, got {type(hit).__name__}")
        for node in hit.nodes:
            self._check_node(node, "hit")
        if len(hit.nodes) != len(hit.pages) or any(n.page != p for n, p in zip(hit.nodes, hit.pages)):
            raise ValueError("hit: its pages are not its nodes' pages (a PrefixHit made by hand, not by lookup)")
        num_tokens = _count(num_tokens, "num_tokens")
        if num_tokens < hit.num_tokens:
            raise ValueError(f"num_tokens={num_tokens} is fewer than the hit's {hit.num_tokens} tokens")
        self.lookups += 1
        self.lookup_tokens += num_tokens
        self.hit_tokens += hit.num_tokens
        if not hit.nodes:
            return None
        self._touch(hit.nodes[-1])
        self._lock(hit.nodes[-1])
        return hit.nodes[-1]

    def lock(self, node) -> None:
        """One more running sequence maps `node` (None: nothing) and so needs its ancestors."""
        if node is not None:
            self._check_node(node, "node")
        self._lock(node)

    def unlock(self, node) -> None:
        """Undo one `lock` (or `acquire`) of `node` (None: nothing). More unlocks than locks are refused."""
        if node is not None:
            self._check_node(node, "node")
            if node.locks < 1:
                raise ValueError(f"node (page {node.page}) is not locked: an unlock must follow its lock")
        self._unlock(node)

    def relock(self, old, new) -> None:
        """Move a lock from `old` to `new` (either may be None); cheap when `new` descends from `old`."""
        if old is not None:
            self._check_node(old, "old")
            if old.locks < 1:
                raise ValueError(f"old (page {old.page}) is not locked: relock moves an existing lock")
        if new is not None:
            self._check_node(new, "new")
        if old is new:
            return
        segment, node = [], new
        while node is not None and node is not self.root and node is not old:
            segment.append(node)
            node = node.parent
        if node is old or old is None:  # `new` descends from `old`: lock the nodes between them
            for n in segment:
                n.locks += 1
                self._locked += n.locks == 1
        else:
            self._lock(new)
            self._unlock(old)

    def _lock(self, node) -> None:
        while node is not None and node is not self.root:
            node.locks += 1
            self._locked += node.locks == 1
            node = node.parent

    def _unlock(self, node) -> None:
        while node is not None and node is not self.root:
            node.locks -= 1
            self._locked -= node.locks == 0
            node = node.parent

    def _check_node(self, node, name: str) -> None:
        if not isinstance(node, _Node) or node.owner is not self or node is self.root:
            raise ValueError(f"{name} is not a node of this index (give what acquire / insert returned)")
        if not node.live:
            raise ValueError(f"{name} (page {node.page}) has left the index (evicted or replaced)")

    def insert(self, ids: Sequence[int], pages: Sequence[int]) -> Insertion:
        """Index the sequence `ids` whose K/V is written in `pages` (logical page j holds
        ids[j * page_size : (j + 1) * page_size]; the last page may be partly filled; entries
        of `pages` past the ones `ids` needs are ignored).

        Pages already indexed for the same tokens are kept (the caller's duplicate page is not
        held: it stays the caller's). A partly filled page whose tokens a sibling already holds
        is not added; one that holds more than an unlocked partly filled sibling replaces it.
        """
        ids, size = _token_ids(ids, "ids"), self.page_size
        need = -(-len(ids) // size)
        try:
            given = len(pages)
        except TypeError:
            raise ValueError(f"pages must be a sequence of page ids, got {type(pages).__name__}") from None
        if given < need:
            raise ValueError(f"pages: {len(ids)} tokens need {need} pages, got {given}")
        pages = _page_ids(list(pages)[:need], "pages", self.layout.num_pages)
        out = Insertion([], [], [])
        node = self.root
        for j in range(need):
            chunk, page = tuple(ids[j * size : (j + 1) * size]), pages[j]
            if len(chunk) == size:
                child = node.full.get(chunk)
                if child is None:
                    child = self._add(node, chunk, page, out)
                    if child is None:  # the page is indexed elsewhere: not ours to hold twice
                        break
                if child.page == page:
                    out.nodes.append(child)
                node = child
                continue
            # A partly filled last page: a leaf.
            group = node.partial.get(chunk[0], [])
            covering = [c for c in itertools.chain(group, node.full.values()) if c.tokens[: len(chunk)] == chunk]
            if covering:
                mine = [c for c in covering if c.page == page]
                if mine:
                    out.nodes.append(mine[0])
                node = max(covering, key=lambda c: c.last_used)
                break
            added = self._add(node, chunk, page, out)
            if added is None:
                break
            for old in [c for c in group if c is not added and chunk[: len(c.tokens)] == c.tokens and not c.locks]:
                self._remove(old)
                out.drop.append(old.page)
                self.replaced_pages += 1
            out.nodes.append(added)
            node = added
            break
        self._touch(node)
        return out

    def _add(self, parent: _Node, chunk: tuple, page: int, out: Insertion) -> "_Node | None":
        if page in self._nodes:
            return None
        node = _Node(page, chunk, parent, next(self._serial))
        node.owner = self
        self._leaves.discard(parent)
        self._leaves.add(node)
        if len(chunk) == self.page_size:
            parent.full[chunk] = node
            # Partly filled siblings this full page covers are replaced (if no sequence maps them).
            group = parent.partial.get(chunk[0], [])
            for old in [c for c in group if chunk[: len(c.tokens)] == c.tokens and not c.locks]:
                self._remove(old)
                out.drop.append(old.page)
                self.replaced_pages += 1
        else:
            parent.partial.setdefault(chunk[0], []).append(node)
        self._nodes[page] = node
        self.inserted_pages += 1
        out.hold.append((page, len(chunk)))
        return node

    def _remove(self, node: _Node) -> None:
        assert node.is_leaf() and not node.locks, "only unlocked leaves leave the index"
        parent = node.parent
        if len(node.tokens) == self.page_size:
            del parent.full[node.tokens]
        else:
            group = parent.partial[node.tokens[0]]
            group.remove(node)
            if not group:
                del parent.partial[node.tokens[0]]
        del self._nodes[node.page]
        self._leaves.discard(node)
        node.live = False
        if parent is not self.root and parent.is_leaf():
            self._leaves.add(parent)

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        while node is not self.root:
            node.last_used = self._clock
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> list[int]:
        """Remove up to `num_pages` unlocked leaves, least recently used first (a parent whose
        last child goes joins the candidates). Returns their pages: drop them (`aj.drop_pages`).
        Every unlocked page can go (a locked node's ancestors are locked too), so
        `evict(evictable_pages)` empties the index of everything no sequence maps."""
        num_pages = _count(num_pages, "num_pages")
        if num_pages == 0:
            return []
        heap = [(n.last_used, n.serial, n) for n in self._leaves if not n.locks]
        heapq.heapify(heap)
        out = []
        while heap and len(out) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._remove(node)
            out.append(node.page)
            if parent in self._leaves and not parent.locks:
                heapq.heappush(heap, (parent.last_used, parent.serial, parent))
        self.evicted_pages += len(out)
        return out

    # ---- reports -------------------------------------------------------------------------------
    def metrics(self) -> dict:
        return {
            "prefix_lookups": self.lookups,
            "prefix_lookup_tokens": self.lookup_tokens,
            "prefix_hit_tokens": self.hit_tokens,
            "prefix_hit_rate": self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0,
            "prefix_cached_pages": self.num_pages,
            "prefix_cached_tokens": sum(len(n.tokens) for n in self._nodes.values()),
            "prefix_evictable_pages": self.evictable_pages,
            "prefix_inserted_pages": self.inserted_pages,
            "prefix_evicted_pages": self.evicted_pages,
            "prefix_replaced_pages": self.replaced_pages,
        }

    # ---- the cache it belongs to ---------------------------------------------------------------
    def check(self, cache, *, tag=None) -> None:
        """ValueError unless `cache` is this index's arena (the id it was bound to, if bound), made
        with the same `tag` (when both are known), and holds exactly this index's pages with the
        same token counts (reads `table.held` back: a host check, not for a step's hot path)."""
        import numpy as np

        from arena_jax.state import KVCache

        if not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a KVCache (from arena_jax.create), got {type(cache).__name__}")
        if cache.layout.page_size != self.page_size or cache.layout.num_pages != self.layout.num_pages:
            raise ValueError(f"the cache's layout ({cache.layout}) is not the index's ({self.layout})")
        if tag is not None and self.tag is not None and tag != self.tag:
            raise ValueError(
                f"this prefix index holds K/V made with tag {self.tag!r}, not {tag!r} (another model or other "
                "weights would read wrong values): use a new PrefixCache for it"
            )
        arena_id = int(np.asarray(cache.table.arena_id))
        if self.arena_id is not None and arena_id != self.arena_id:
            raise ValueError(
                f"this prefix index belongs to arena {self.arena_id}, not to this cache's arena {arena_id}: "
                "an index names pages of the one cache it was made with (continue with that cache)"
            )
        held = np.asarray(cache.table.held)
        device = {int(p): int(held[p]) for p in np.flatnonzero(held)}
        if device != self.pages():
            extra = sorted(set(device) - set(self.pages()))[:5]
            missing = sorted(set(self.pages()) - set(device))[:5]
            raise ValueError(
                f"the cache holds {len(device)} pages, the prefix index {self.num_pages} (held but not indexed: {extra}, "
                f"indexed but not held: {missing}): this index does not belong to this cache"
            )

    def bind(self, cache, *, tag=None) -> None:
        """`check(cache, tag=tag)`, then tie the index to the cache's arena and to `tag` (where
        not tied yet): from now on `check` refuses any other arena or tag."""
        if tag is not None:
            _check_tag(tag)
        self.check(cache, tag=tag)
        import numpy as np

        self.arena_id = int(np.asarray(cache.table.arena_id))
        if tag is not None:
            self.tag = tag


def _check_tag(tag) -> None:
    try:
        hash(tag)
    except TypeError:
        raise ValueError(f"tag must be hashable (a str, or a tuple of them), got {type(tag).__name__}") from None


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _count(value, name: str) -> int:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def _token_ids(ids, name: str) -> list[int]:
    """Token ids as a list of Python ints: integers (not bools, floats or strings) in [0, 2**31)."""
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of integer token ids, got a {type(ids).__name__}")
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{name} must be a 1-D integer array of token ids, got {ids.dtype} {ids.shape}")
        ids = ids.tolist()
    try:
        ids = list(ids)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of integer token ids, got {type(ids).__name__}") from None
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise ValueError(f"{name}[{i}] is {t!r} ({type(t).__name__}): token ids are integers")
        if not 0 <= t < 2**31:
            raise ValueError(f"{name}[{i}]={int(t)} is outside the token ids' range [0, 2**31)")
    return [int(t) for t in ids]


def _page_ids(pages: list, name: str, num_pages: int) -> list[int]:
    for i, p in enumerate(pages):
        if not _is_int(p):
            raise ValueError(f"{name}[{i}] is {p!r} ({type(p).__name__}): page ids are integers")
        if p == PAD_PAGE:
            raise ValueError(f"{name}[{i}] is PAD_PAGE ({PAD_PAGE}): every page a token lies in must be a real page")
        if not 0 <= p < num_pages:
            raise ValueError(f"{name}[{i}]={int(p)} is outside [0, num_pages={num_pages})")
    pages = [int(p) for p in pages]
    if len(set(pages)) != len(pages):
        raise ValueError(f"{name} names a page twice ({pages}): a sequence's pages are distinct")
    return pages


def _common_prefix(a: tuple, b: tuple) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
