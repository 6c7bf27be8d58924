"""`PrefixCache`'s binding to the arrays it describes: one arena (`table.arena_id`), one model
(`tag`) and, with a host tier, one `HostArena` (`host_id`). `check` compares the index with the
device's holds (and the host tier's held pages); `bind` ties the index to them."""
from __future__ import annotations

from arena_jax.prefix.checks import check_tag

__all__ = ["Binding"]


class Binding:
    """Mixed into `PrefixCache`: its `check` and `bind`."""

    def check(self, cache, *, tag=None, host=None) -> None:
        """ValueError unless `cache` is this index's arena (the id it was bound to, if bound), made
        with the same `tag` (when both are known), and holds exactly this index's pages with the
        same token counts (reads `table.held` back: a host check, not for a step's hot path).
        An index with a host tier needs its `host` (an `aj.HostArena` of `host_capacity` pages,
        the one it was bound to, the cache's own: `aj.create_host(cache)`, not donated) holding
        exactly the index's host copies; one without refuses a host."""
        import numpy as np

        from arena_jax.kv_cache import KVCache

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
        self._check_host(cache, host)

    def _check_host(self, cache, host) -> None:
        import numpy as np

        from arena_jax.host.arena import check_pair

        if host is None:
            if self.host_capacity:
                raise ValueError(f"this prefix index keeps host copies in {self.host_capacity} host pages: give its host")
            return
        check_pair(cache, host)  # the cache's own host tier (its arena, geometry, key factors), not donated
        if host.num_pages != self.host_capacity:
            raise ValueError(
                f"host has {host.num_pages} pages, but this prefix index was made for {self.host_capacity} "
                "(PrefixCache(layout, host_pages=N) with the host tier's N)"
            )
        host_id = int(np.asarray(host.host_id))
        if self.host_id is not None and host_id != self.host_id:
            raise ValueError(f"this prefix index keeps its host copies in host tier {self.host_id}, not {host_id}")
        held = np.asarray(host.held)
        on_host = {int(p): int(held[p]) for p in np.flatnonzero(held)}
        if on_host != self.host_pages():
            raise ValueError(
                f"the host tier holds {len(on_host)} pages, the prefix index {self.num_host_pages} host copies: this "
                "index does not belong to this host tier"
            )

    def bind(self, cache, *, tag=None, host=None) -> None:
        """`check(cache, tag=tag, host=host)`, then tie the index to the cache's arena, to `tag`
        and to its host tier (where not tied yet): from now on `check` refuses any other."""
        if tag is not None:
            check_tag(tag)
        self.check(cache, tag=tag, host=host)
        import numpy as np

        self.arena_id = int(np.asarray(cache.table.arena_id))
        if host is not None:
            self.host_id = int(np.asarray(host.host_id))
        if tag is not None:
            self.tag = tag


