"""The prefix cache: a host-side index of which token ids the arena's held pages hold (a trie of
pages, longest-prefix lookup, LRU eviction over the device and host tiers), and the device ops
that hold, share and drop those pages.

The question it answers: which pages already hold this prompt's first tokens, so a new
sequence can share them instead of computing them again?

    cache.py     `PrefixCache` (lookup, insert, evict; the design, and why), `PrefixHit`, `Insertion`
    eviction.py  eviction across the two tiers: `PrefixCache.evict_plan`'s `Eviction`
    binding.py   the index's binding to one arena, one model tag and one host tier (`check`, `bind`)
    checks.py    argument checks (a ValueError naming the argument, before any change)
    ops.py       the jitted bodies of `aj.hold_pages`, `aj.fork_pages`, `aj.drop_pages`

`arena_jax.prefix` exports what the former single module `arena_jax/prefix.py` did. The former
`arena_jax.prefix_ops` / `prefix_host` / `prefix_binding` / `prefix_checks` are
`arena_jax.prefix.ops` / `.eviction` / `.binding` / `.checks` (the same module objects:
`arena_jax._moved`).
"""
from arena_jax.prefix.binding import Binding
from arena_jax.prefix.cache import MAX_HOST_PAGES, Insertion, PrefixCache, PrefixHit
from arena_jax.prefix.eviction import Eviction, evict_plan

__all__ = ["PrefixCache", "PrefixHit", "Insertion", "Eviction", "MAX_HOST_PAGES", "evict_plan", "Binding"]
