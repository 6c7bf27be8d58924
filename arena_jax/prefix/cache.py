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

A host tier (`PrefixCache(layout, host_pages=N)`, with an `aj.HostArena` of N pages): LRU
across tiers, device -> host -> gone, as SGLang's HiCache keeps a host tier under its radix
tree. A node's tokens live in a device page, a host page, or both (`page`, `host_page`).
Device eviction (`evict_plan`, `arena_jax.prefix.eviction`) takes the least recently used unlocked
node with no child on the device: with a host copy its device copy just goes; else it is
copied to a free host page (`aj.offload_pages`), a host page being freed first when none is
(the least recently used host copy whose node keeps a device copy or has no child: its host
copy goes, and a node left without a copy leaves the index), unless the node itself is older
and has no child: then it goes at once. A lookup walks both tiers: its hit is the nodes on the
device (a prefix of the path: parents are touched with their children, so a node's device copy
outlives its descendants'), then nodes only on the host, whose pages the caller brings back
(`aj.swap_in` into the slot); when the caller's sequence indexes those tokens again, its own
device pages become the nodes' device copies (the host copies stay: a second eviction moves
nothing). Without a host tier nothing changes: `evict` removes leaves as before.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence


from arena_jax.layout import KVLayout
from arena_jax.prefix.binding import Binding
from arena_jax.prefix.checks import check_tag as _check_tag
from arena_jax.prefix.checks import common_prefix as _common_prefix
from arena_jax.prefix.checks import count as _count
from arena_jax.prefix.checks import page_ids as _page_ids
from arena_jax.prefix.checks import token_ids as _token_ids
from arena_jax.prefix.eviction import Eviction, evict_plan

MAX_HOST_PAGES = 2**31 - 1  # host page ids are int32 (aj.create_host: at most this many pages)

__all__ = ["PrefixCache", "PrefixHit", "Insertion", "Eviction"]


class _Node:
    __slots__ = ("page", "host_page", "tokens", "parent", "full", "partial", "last_used", "locks", "serial", "live",
                 "owner")  # fmt: skip

    def __init__(self, page: int | None, tokens: tuple, parent: "_Node | None", serial: int):
        self.page = page  # device page id (-1 for the root; None: the tokens are only on the host)
        self.host_page: int | None = None  # host page id holding a copy (host tier), or None
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
    """The longest cached prefix of a lookup: `num_tokens` tokens held in device `pages`, then
    (host tier) `host_pages`: ceil(num_tokens / page_size) pages in all, the last of which may
    hold more tokens than the hit uses. When `host_pages` is not empty, `pages` are whole."""

    num_tokens: int
    pages: tuple[int, ...]
    nodes: tuple = dataclasses.field(default=(), repr=False, compare=False)  # the index's nodes, for lock / unlock
    host_pages: tuple[int, ...] = ()

    @property
    def device_tokens(self) -> int:
        """Tokens of the hit in device pages (the rest are in host pages)."""
        return len(self.pages) * _page_size(self) if self.host_pages else self.num_tokens

    @property
    def host_tokens(self) -> int:
        return self.num_tokens - self.device_tokens

    def whole_pages(self, page_size: int) -> "PrefixHit":
        """The hit cut back to its whole pages: no partly used last page, so nothing to copy on write."""
        keep = self.num_tokens // page_size
        device = min(keep, len(self.pages))
        return PrefixHit(keep * page_size, self.pages[:device], self.nodes[:keep], self.host_pages[: keep - device])

    def device_part(self) -> "PrefixHit":
        """The hit cut back to its device pages (its host pages would be recomputed instead)."""
        if not self.host_pages:
            return self
        return PrefixHit(self.device_tokens, self.pages, self.nodes[: len(self.pages)])


def _page_size(hit: PrefixHit) -> int:
    return hit.nodes[0].owner.page_size


@dataclasses.dataclass
class Insertion:
    """What `insert` changed: the caller holds `hold` ((page, tokens) pairs: new nodes, or host
    nodes whose device copy the caller's page becomes) and drops `drop` (pages of unlocked,
    partly filled nodes a longer one replaced) and `drop_host` (their host copies); `nodes` are
    the nodes holding the caller's own pages, root first (a running caller maps them: it locks
    the last)."""

    hold: list[tuple[int, int]]
    drop: list[int]
    nodes: list
    drop_host: list[int] = dataclasses.field(default_factory=list)


class PrefixCache(Binding):
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

    def __init__(self, layout: KVLayout, *, tag=None, host_pages: int = 0):
        if not isinstance(layout, KVLayout):
            raise ValueError(f"layout must be a KVLayout, got {type(layout).__name__}")
        host_pages = _count(host_pages, "host_pages", high=MAX_HOST_PAGES,
                            why="2**31 - 1: host page ids are int32, as aj.create_host takes them")
        if tag is not None:
            _check_tag(tag)
        self.layout = layout
        self.page_size = layout.page_size
        self.tag = tag
        self.arena_id: int | None = None  # set by `bind`
        self._serial = 0  # a plain int (not itertools.count, which deepcopy refuses from Python 3.14)
        self.root = _Node(-1, (), None, self._next_serial())
        self.root.owner = self
        self._nodes: dict[int, _Node] = {}  # device page -> node
        self._host_nodes: dict[int, _Node] = {}  # host page -> node
        self.host_capacity = host_pages  # the index keeps host copies in host pages [0, host_pages)
        self._free_host = list(range(host_pages - 1, -1, -1))  # pop() gives the lowest first
        self.host_id: int | None = None  # the HostArena's id (set by `bind`)
        self._clock = 0
        self._locked = 0  # nodes with locks > 0 (only nodes on the device are ever locked)
        self.lookups = self.lookup_tokens = self.hit_tokens = self.host_hit_tokens = 0
        self.inserted_pages = self.evicted_pages = self.replaced_pages = 0
        self.offloaded_pages = self.host_dropped_pages = self.promoted_pages = 0

    def _next_serial(self) -> int:
        self._serial += 1
        return self._serial - 1

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

    def host_pages(self) -> dict[int, int]:
        """host page -> number of tokens held: what the host tier's `held` must say."""
        return {p: len(n.tokens) for p, n in self._host_nodes.items()}

    @property
    def num_host_pages(self) -> int:
        return len(self._host_nodes)

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
        # The device part, then nodes only on the host (a node found on the device after those ends the hit).
        d = next((i for i, n in enumerate(nodes) if n.page is None), len(nodes))
        h = next((i for i in range(d, len(nodes)) if nodes[i].page is not None or nodes[i].host_page is None), len(nodes))
        if h < len(nodes):
            nodes, pos = nodes[:h], h * size  # the nodes before the cut are whole pages
        return PrefixHit(pos, tuple(n.page for n in nodes[:d]), tuple(nodes), tuple(n.host_page for n in nodes[d:]))

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
        d = len(hit.pages)
        if (len(hit.nodes) != d + len(hit.host_pages) or any(n.page != p for n, p in zip(hit.nodes, hit.pages))
                or any(n.host_page != p for n, p in zip(hit.nodes[d:], hit.host_pages))):  # fmt: skip
            raise ValueError("hit: its pages are not its nodes' pages (a PrefixHit made by hand, not by lookup)")
        num_tokens = _count(num_tokens, "num_tokens")
        if num_tokens < hit.num_tokens:
            raise ValueError(f"num_tokens={num_tokens} is fewer than the hit's {hit.num_tokens} tokens")
        self.lookups += 1
        self.lookup_tokens += num_tokens
        self.hit_tokens += hit.num_tokens
        if not hit.nodes:
            return None
        self.host_hit_tokens += hit.host_tokens
        self._touch(hit.nodes[-1])
        anchor = hit.nodes[d - 1] if d else None  # the caller maps the device part only
        self._lock(anchor)
        return anchor

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
                elif child.page is None and not self._promote(child, page, out):
                    break
                if child.page == page:
                    out.nodes.append(child)
                node = child
                continue
            # A partly filled last page: a leaf.
            group = node.partial.get(chunk[0], [])
            covering = [c for c in itertools.chain(group, node.full.values()) if c.tokens[: len(chunk)] == chunk]
            if covering:
                only_host = [c for c in covering if c.page is None and c.tokens == chunk]
                if only_host:
                    self._promote(only_host[0], page, out)
                mine = [c for c in covering if c.page == page]
                if mine:
                    out.nodes.append(mine[0])
                node = max(covering, key=lambda c: c.last_used)
                break
            added = self._add(node, chunk, page, out)
            if added is None:
                break
            for old in [c for c in group if c is not added and chunk[: len(c.tokens)] == c.tokens and not c.locks]:
                self._replace(old, out)
            out.nodes.append(added)
            node = added
            break
        self._touch(node)
        return out

    def _add(self, parent: _Node, chunk: tuple, page: int, out: Insertion) -> "_Node | None":
        if page in self._nodes:
            return None
        node = _Node(page, chunk, parent, self._next_serial())
        node.owner = self
        if len(chunk) == self.page_size:
            parent.full[chunk] = node
            # Partly filled siblings this full page covers are replaced (if no sequence maps them).
            group = parent.partial.get(chunk[0], [])
            for old in [c for c in group if chunk[: len(c.tokens)] == c.tokens and not c.locks]:
                self._replace(old, out)
        else:
            parent.partial.setdefault(chunk[0], []).append(node)
        self._nodes[page] = node
        self.inserted_pages += 1
        out.hold.append((page, len(chunk)))
        return node

    def _promote(self, node: _Node, page: int, out: Insertion) -> bool:
        """A node only on the host gets the caller's page (same tokens) as its device copy."""
        if page in self._nodes:
            return False
        node.page = page
        self._nodes[page] = node
        out.hold.append((page, len(node.tokens)))
        self.promoted_pages += 1
        return True

    def _replace(self, old: _Node, out: Insertion) -> None:
        """A partly filled node a longer one covers leaves the index, both copies."""
        if old.page is not None:
            out.drop.append(old.page)
        if old.host_page is not None:
            out.drop_host.append(old.host_page)
        self._remove(old)
        self.replaced_pages += 1

    def _remove(self, node: _Node) -> None:
        """An unlocked leaf leaves the index, with both its copies (the caller drops them)."""
        assert node.is_leaf() and not node.locks, "only unlocked leaves leave the index"
        parent = node.parent
        if len(node.tokens) == self.page_size:
            del parent.full[node.tokens]
        else:
            group = parent.partial[node.tokens[0]]
            group.remove(node)
            if not group:
                del parent.partial[node.tokens[0]]
        if node.page is not None:
            del self._nodes[node.page]
        if node.host_page is not None:
            del self._host_nodes[node.host_page]
            self._free_host.append(node.host_page)
        node.live = False

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
        `evict(evictable_pages)` empties the index of everything no sequence maps. An index with
        a host tier moves pages there instead: use `evict_plan`."""
        num_pages = _count(num_pages, "num_pages")
        if self.host_capacity:
            raise ValueError("this index has a host tier: evict_plan(num_pages) says which pages to offload and drop")
        return evict_plan(self, num_pages).drop

    def evict_plan(self, num_pages: int, keep=()) -> Eviction:
        """Free up to `num_pages` device pages, least recently used first, across the tiers
        (module docstring; the plan's order: `arena_jax.prefix.eviction`). `keep`: nodes whose host
        copies must stay (a hit about to be brought back)."""
        num_pages = _count(num_pages, "num_pages")
        for node in keep:
            self._check_node(node, "keep")
        return evict_plan(self, num_pages, keep)

    def drop_host_copies(self) -> list[int]:
        """Every host copy goes (nodes only on the host leave the index). Returns the host pages
        to free (`aj.drop_host_pages`)."""
        out = []
        for node in sorted(self._host_nodes.values(), key=lambda n: -n.serial):  # children before parents
            if node.page is not None:
                del self._host_nodes[node.host_page]
                self._free_host.append(node.host_page)
                out.append(node.host_page)
                node.host_page = None
        while True:  # host-only nodes, leaves first
            leaves = [n for n in self._host_nodes.values() if n.is_leaf()]
            if not leaves:
                break
            for node in leaves:
                out.append(node.host_page)
                self._remove(node)
        self.host_dropped_pages += len(out)
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
            "prefix_device_hit_tokens": self.hit_tokens - self.host_hit_tokens,
            "prefix_host_hit_tokens": self.host_hit_tokens,
            "prefix_host_capacity": self.host_capacity,
            "prefix_host_pages": self.num_host_pages,
            "prefix_offloaded_pages": self.offloaded_pages,
            "prefix_host_dropped_pages": self.host_dropped_pages,
            "prefix_promoted_pages": self.promoted_pages,
        }
