"""The host tier: a second arena of pages in pinned host memory, its page table, and the page
moves between it and the device arena.

The question it answers: where does a page go when device memory runs short, and how does it
come back?

    arena.py  `HostArena`, `create_host`, its page formats and `check_pair` (the design, and why)
    api.py    the public ops `swap_out`, `swap_in`, `offload_pages`, `drop_host_pages`: checks on
              the host, then one jitted pure function each
    ops.py    their jitted bodies, pure functions of (cache, host), and `move_pages`

`arena_jax.host` exports what the former single module `arena_jax/host.py` did, plus the four
ops (also at `arena_jax.swap_out`, ...). The former `arena_jax.host_api` / `arena_jax.host_ops`
are `arena_jax.host.api` / `arena_jax.host.ops` (the same module objects: `arena_jax._moved`).
"""
from arena_jax.host.api import drop_host_pages, offload_pages, swap_in, swap_out
from arena_jax.host.arena import (
    WORD_LANES,
    HostArena,
    check_pair,
    create_host,
    free_host_pages,
    host_layout_bytes,
    host_page_format,
    host_pages_view,
    is_words,
    packs_as_words,
    page_arrays,
    words_as_pages,
    words_fit,
)

__all__ = ["HostArena", "create_host", "page_arrays", "free_host_pages", "host_pages_view", "check_pair",
           "host_page_format", "packs_as_words", "words_as_pages", "words_fit", "is_words", "host_layout_bytes",
           "WORD_LANES", "swap_out", "swap_in", "offload_pages", "drop_host_pages"]
