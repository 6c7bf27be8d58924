"""The host tier in the model-based test (test_allocator_model.py): strategies for `swap_out`,
`swap_in`, `offload_pages` and `drop_host_pages`, their driver (against
`cache_model.CacheModel`'s host-tier rules) and the host arena's checks.

Drawn beside every other op: a swap round trip (a slot out to free host pages, back into an
idle slot or appended to a settled one, part or all of it, its host pages then dropped or
kept), spills (the cache holds a slot's pages, then moves them to host pages: what a prefix
cache's eviction does), and each op with raw rows (pad, out-of-range, int32-extreme, held or
free host pages, duplicates). The host arena starts NaN-poisoned (values and scales), so a
stale host position that reached a device page a slot reads would show in the attention check.
After every step: `host.held` equals the model's host pages, and every held host token's K, V
(and scales) at every layer and head is exactly the value the model says.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

import arena_jax as aj
from cache_model import INT32_MAX, INT32_MIN, PAD, ceil_div

HOST_PAGES = 6
BAD_HOST_PAGES = (PAD, HOST_PAGES, -2, INT32_MAX, INT32_MIN, 2**31)
HOST_OPS = ("swap_out", "swap_in", "offload_pages", "drop_host_pages")


def calls():
    return {
        "swap_out": lambda c, h, s, p: aj.swap_out(c, h, s, p),
        "swap_in": lambda c, h, p, n, d: aj.swap_in(c, h, p, n, d),
        "offload_pages": lambda c, h, p, hp: aj.offload_pages(c, h, p, hp),
        "drop_host_pages": lambda c, h, hp: aj.drop_host_pages(c, h, hp),
    }


@functools.lru_cache(maxsize=None)
def jitted_calls():
    """One jit per op for the session (the host ops have no backend: shared by every example)."""
    return {name: jax.jit(f, donate_argnums=(0, 1)) for name, f in calls().items()}


def poisoned_host(cache):
    """A host tier for `cache` whose every page is NaN (values; scales too)."""
    host = aj.create_host(cache, HOST_PAGES)
    poison = {k: jax.device_put(np.full(x.shape, np.nan, x.dtype), x.sharding) for k, x in host.pages.items()
              if jnp.issubdtype(x.dtype, jnp.floating)}  # fmt: skip
    return host.replace(pages={**host.pages, **poison})


# ---- strategies ----------------------------------------------------------------------------------------


def host_page_choice(bad: bool):
    ok = st.one_of(st.tuples(st.just("hfree"), st.integers(0, 63)), st.tuples(st.just("hheld"), st.integers(0, 63)))
    return st.one_of(ok, ok, st.sampled_from(BAD_HOST_PAGES).map(lambda v: ("raw", v))) if bad else ok


def host_ops(bad: bool, slot_choice, page_choice, max_pages: int, bad_counts):
    active = st.integers(0, 7).map(lambda i: ("active", i))
    pages_list = st.lists(host_page_choice(bad), min_size=1, max_size=max_pages)
    out_source = st.one_of(st.just(("auto",)), st.tuples(st.just("list"), pages_list))
    in_source = st.one_of(st.tuples(st.just("run"), st.integers(0, 63)), st.tuples(st.just("list"), pages_list))
    count = st.floats(0, 1).map(lambda f: ("valid", f))
    if bad:
        count = st.one_of(count, st.sampled_from(bad_counts).map(lambda v: ("raw", v)))
    target = st.one_of(host_page_choice(bad), st.just(("auto",)))
    # A round trip: a slot out to free host pages, then back (into dst, part or all), then maybe dropped.
    swap = st.tuples(st.just("swap"), st.just(False), st.tuples(active, slot_choice(False), st.floats(0, 1), st.booleans()))
    spill = st.tuples(st.just("spill"), st.just(False), active)  # hold a slot's pages, then offload them
    # Three entries beside the other ops' fifteen or so (each host op drawn costs as much to check as
    # any other, and the model-based test's budget is shared): a round trip, a spill, one raw op.
    return [
        swap,
        spill,
        st.one_of(
        st.tuples(st.just("swap_out"), st.just(bad), st.lists(st.tuples(slot_choice(bad), out_source), min_size=1, max_size=3)),
        st.tuples(st.just("swap_in"), st.just(bad), st.tuples(  # one width: each is a compile (narrower: test_host_tier.py)
            st.just(max_pages), st.lists(st.tuples(slot_choice(bad), in_source, count), min_size=1, max_size=3))),
        st.tuples(st.just("offload_pages"), st.just(bad), st.lists(st.tuples(page_choice(bad), target), min_size=1, max_size=4)),
        st.tuples(st.just("drop_host_pages"), st.just(bad), st.lists(host_page_choice(bad), min_size=1, max_size=4))),
    ]  # fmt: skip


def expand(name, bad, payload, max_pages: int):
    """The composite draws as the ops they are made of: (op, bad, payload, check after it)."""
    if name == "swap":
        src, dst, frac, drop = payload
        out = [("swap_out", bad, [(src, ("auto",))], True),
               ("swap_in", bad, (max_pages, [(dst, ("run", -1), ("valid", frac))]), True)]  # fmt: skip
        return out + ([("drop_host_pages", bad, [("lastrun",)], True)] if drop else [])
    if name == "spill":
        return [("hold_pages", bad, ("slot", payload), False), ("offload_pages", bad, [(("held", i), ("auto",)) for i in range(4)], True)]
    return [(name, bad, payload, True)]


# ---- the driver ------------------------------------------------------------------------------------------


class HostDriver:
    """Runs the host-tier ops of one example on the cache, the host arena and the model."""

    def __init__(self, model, pages, mode, calls, args, rows: int):
        self.model, self.pages, self.mode, self.calls, self.args, self.rows = model, pages, mode, calls, args, rows
        self.runs: list[list[int]] = []  # host pages of each served swap_out row, in page order

    def _free(self, taken: set) -> list[int]:
        return [p for p in range(HOST_PAGES) if p not in self.model.host and p not in taken]

    def _host_page(self, choice, taken: set) -> int:
        kind, *v = choice
        if kind == "raw":
            return v[0]
        if kind == "lastrun":
            return PAD
        if kind == "hheld":
            held = sorted(self.model.host)
            return held[v[0] % len(held)] if held else PAD
        free = self._free(taken)  # "hfree" / "auto"
        pick = free[(v[0] if v else 0) % len(free)] if free else PAD
        taken.add(pick)
        return pick

    def _covered(self, row) -> int:
        """The most tokens host pages `row`, in order, hold (full pages, then one more)."""
        n = 0
        for p in row:
            k = len(self.model.host[p][0]) if p in self.model.host else 0
            n += k
            if k < self.model.S:
                break
        return n

    def _pad(self, rows, fill):
        return list(rows) + [fill] * (self.rows - len(rows))

    def step(self, name, bad, payload, cache, host, resolve_slot, dedupe):
        """One op: refused on the host (nothing changes) or run on the arrays and the model."""
        model, args, width_all = self.model, self.args, model_width(self.model)
        refuse = lambda *a: self.mode != "jit" and model.host_error(name, *a)  # noqa: E731
        if name == "swap_out":
            taken, rows = set(), []
            for slot_c, source in payload:
                slot = resolve_slot(model, slot_c)
                need = ceil_div(model.length(slot), model.S) if slot in model.slots else 0
                hps = [self._host_page(("auto",), taken) for _ in range(need)] if source[0] == "auto" else [
                    self._host_page(c, taken) for c in source[1]]  # fmt: skip
                rows.append((slot, (hps + [PAD] * width_all)[:width_all]))
            rows = self._pad(rows if bad or self.mode == "jit" else dedupe(rows), (PAD, [PAD] * width_all))
            slots, hps = [r[0] for r in rows], [r[1] for r in rows]
            if refuse(rows):
                return refusal(lambda: self.calls[name](cache, host, args(slots), args(hps)), cache, host)
            needs = [ceil_div(model.length(slot), model.S) if slot in model.slots else 0 for slot, _ in rows]
            ok = model.swap_out(rows)
            self.runs += [r[1][:need] for r, need, served in zip(rows, needs, ok) if served and r[0] != PAD]
            cache, host, got = self.calls[name](cache, host, args(slots), args(hps))
            np.testing.assert_array_equal(np.asarray(got), ok, err_msg=f"swap_out ok for {rows}")
            return cache, host
        if name == "swap_in":
            width, in_rows = payload
            rows = []
            for dst_c, source, (kind, v) in in_rows:
                if source[0] == "run":
                    run = self.runs[source[1] % len(self.runs)] if self.runs else []
                else:
                    run = [self._host_page(c, set()) for c in source[1]]
                row = (run + [PAD] * width)[:width]
                rows.append((resolve_slot(model, dst_c), row, int(v * self._covered(row)) if kind == "valid" else v))
            rows = self._pad(rows if bad or self.mode == "jit" else dedupe(rows), (PAD, [PAD] * width, 0))
            dst, hps, counts = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
            if refuse(rows, width):
                return refusal(lambda: self.calls[name](cache, host, args(hps), args(counts), args(dst)), cache, host)
            ok = model.swap_in(rows, width)
            cache, host, got = self.calls[name](cache, host, args(hps), args(counts), args(dst))
            np.testing.assert_array_equal(np.asarray(got), ok, err_msg=f"swap_in ok for {rows}")
            return cache, host
        if name == "offload_pages":
            taken, rows = set(), []
            for page_c, target in payload:
                page = self.pages.choose(model, page_c)
                rows.append((page, self._host_page(target, taken)))
            if not (bad or self.mode == "jit"):
                rows = dedupe(rows)
            rows = self._pad(rows, (PAD, PAD))
            page_ids, hps = [r[0] for r in rows], [r[1] for r in rows]
            if refuse(rows, self.pages.resolve):
                return refusal(lambda: self.calls[name](cache, host, args(page_ids), args(hps)), cache, host)
            model.offload_pages(rows, self.pages.resolve)
            return self.calls[name](cache, host, args(page_ids), args(hps))
        # drop_host_pages
        if payload and payload[0] == ("lastrun",):
            hps = list(self.runs[-1]) if self.runs else [PAD]
        else:
            hps = [self._host_page(c, set()) for c in payload]
        if not (bad or self.mode == "jit"):
            hps = dedupe(hps, key=lambda p: p)
        hps = self._pad(hps[: self.rows], PAD)
        if refuse(hps):
            return refusal(lambda: self.calls[name](cache, host, args(hps)), cache, host)
        model.drop_host_pages(hps)
        return self.calls[name](cache, host, args(hps))

    def clear(self, cache, host):
        """Drop every host page the model holds."""
        held = sorted(self.model.host)
        for i in range(0, len(held), self.rows):
            part = self._pad(held[i : i + self.rows], PAD)
            self.model.drop_host_pages(part)
            cache, host = self.calls["drop_host_pages"](cache, host, self.args(part))
        return cache, host


def model_width(model) -> int:
    return model.max_pages


def snapshot(tree):
    return jax.tree_util.tree_map(lambda x: np.frombuffer(np.asarray(x).tobytes(), np.uint8), tree)


def refusal(fn, cache, host):
    """The host checks refuse: a ValueError, and the cache and the host tier unchanged, byte for byte."""
    import pytest

    before = snapshot((cache, host))
    with pytest.raises(ValueError):
        fn()
    jax.tree_util.tree_map(np.testing.assert_array_equal, snapshot((cache, host)), before)
    return cache, host


# ---- checks ---------------------------------------------------------------------------------------------


def check_host(host, model, values, scales) -> None:
    """`held` equals the model's host pages; every held token's K, V (and scales) are the model's."""
    held = np.asarray(host.held)
    want = np.zeros(HOST_PAGES, np.int64)
    for p, ids in model.host.items():
        want[p] = len(ids[0])
    np.testing.assert_array_equal(held, want, err_msg="host held")
    k, v = np.asarray(host.pages["k"]), np.asarray(host.pages["v"])
    for p, ids in model.host.items():
        for layer, x in enumerate(ids):
            if not x:
                continue
            at = (layer, slice(None), p, slice(0, len(x)))
            np.testing.assert_array_equal(k[at], values[0, x, layer].transpose(1, 0, 2))  # [H, T, D]
            np.testing.assert_array_equal(v[at], values[1, x, layer].transpose(1, 0, 2))
            if scales is not None:  # [T, H] per token (8-bit) or [T, H, D / 32] per group (int4) -> [H, T, ...]
                np.testing.assert_array_equal(np.asarray(host.pages["k_scale"])[at], np.swapaxes(scales[0, x, layer], 0, 1))
                np.testing.assert_array_equal(np.asarray(host.pages["v_scale"])[at], np.swapaxes(scales[1, x, layer], 0, 1))


# Named: a slot out and back (into another slot, which then writes on in its own pages), a
# swap_in asking more than the host pages hold, a spill of held pages, and refusals of held /
# twice-named / free host pages.
HOST_ROUND_TRIP = [
    ("reserve", False, [(("slot", 0), ("raw", 6)), (("slot", 1), ("raw", 3))]),
    ("append_all", False, [(("slot", 0), ("frac", 1.0)), (("slot", 1), ("frac", 1.0))]),
    ("swap_out", False, [(("slot", 0), ("auto",))]),
    ("swap_in", False, (6, [(("slot", 2), ("run", 0), ("valid", 1.0))])),
    ("reserve", False, [(("slot", 2), ("raw", 2))]),
    ("append_all", False, [(("slot", 2), ("frac", 1.0))]),
    ("swap_in", True, (6, [(("slot", 3), ("run", 0), ("raw", 7))])),
    ("drop_host_pages", False, [("lastrun",)]),
    ("spill", False, ("slot", 1)),
    ("swap_out", True, [(("slot", 2), ("list", [("hheld", 0), ("hfree", 0), ("hfree", 1)]))]),
    ("drop_host_pages", True, [("hheld", 0), ("hheld", 0), ("hfree", 0)]),
]
