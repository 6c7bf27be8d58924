"""The host tier (`arena_jax.host`): pages in pinned_host memory, the page moves against their
reference on fresh random data, 8-bit scales moving with their values, host errors, refusals
inside jit, a host tier bound to its cache (another cache's, another geometry's or key factors',
or a donated one refused by every op and reader; inside jit another arena's rows refused), and
`generate(host_pages=...)`: swap preemption and the prefix cache's host tier
give the tokens of a run without memory pressure (greedy and sampled), NaN-poisoned host pages
never reach an output, and nothing stays held on either tier after clearing.

The model-based test (test_allocator_model.py, model_host_ops.py) draws the ops at random
beside every other op; the index's own host-tier rules are test_prefix_index.py's.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj
from arena_jax import models
from arena_jax.host import ops as host_ops
from arena_jax.host import words_as_pages
from arena_jax.memory import to_device, to_host
from arena_jax.models.scheduler import Scheduler

LAYOUT = aj.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=8, max_seqs=4,
                     max_pages_per_seq=4, dtype="float32")  # fmt: skip


def kv(n, value, dtype=jnp.float32):
    return jnp.full((1, n, 2, 16), value, dtype)


def fill(cache, slot, n, value):
    cache, ok = aj.reserve(cache, [slot], n)
    assert bool(ok[0])
    for layer in range(2):
        cache = aj.append(cache, layer, [slot], kv(n, value + layer), kv(n, -value - layer))
    return cache


def snapshot(tree):
    return jax.tree_util.tree_map(lambda x: np.frombuffer(np.asarray(x).tobytes(), np.uint8), tree)


# ---- placement and the moves ------------------------------------------------------------------------


def test_host_pages_live_in_pinned_host_memory_and_stay_there_through_the_ops():
    cache = aj.create(LAYOUT)
    host = aj.create_host(cache, 5)
    assert all(x.sharding.memory_kind == "pinned_host" for x in host.pages.values())
    assert set(host.pages) == {"k", "v"} and host.pages["k"].shape == (2, 2, 5, 4, 16)
    cache = fill(cache, 0, 6, 1.0)
    cache, host, ok = aj.swap_out(cache, host, [0], [[3, 1]])
    assert bool(ok[0]) and all(x.sharding.memory_kind == "pinned_host" for x in host.pages.values())
    assert cache.k.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(host.held), [0, 2, 0, 4, 0])


@pytest.mark.parametrize("seed", [0, 1])
def test_move_pages_equals_its_reference_on_random_data(seed):
    """The page loop (slice, memory-kind transfer, update) against one gather + one scatter, both
    directions, over arrays of several ranks and dtypes (values, scales, a future format's groups)."""
    rng = np.random.default_rng(seed)
    device = {"k": rng.standard_normal((2, 3, 7, 4, 8)).astype(np.float32),
              "q": rng.integers(-128, 128, (2, 3, 7, 4, 8)).astype(np.int8),
              "s": rng.standard_normal((2, 3, 7, 4)).astype(np.float32)}  # fmt: skip
    host_shape = {k: v.shape[:2] + (5,) + v.shape[3:] for k, v in device.items()}
    hosted = {k: rng.standard_normal(sh).astype(device[k].dtype) if device[k].dtype != np.int8 else
              rng.integers(-128, 128, sh).astype(np.int8) for k, sh in host_shape.items()}  # fmt: skip
    src, dst = rng.integers(0, 7, 9), rng.permutation(5).tolist() + [0, 1, 2, 3]
    moves = np.zeros(9, bool)
    moves[rng.choice(5, 3, replace=False)] = True  # distinct destinations among the moves
    where = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    host_arrays = {k: jax.device_put(v, where) for k, v in hosted.items()}
    args = (jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32), jnp.asarray(moves))
    out = jax.jit(lambda d, h, *a: host_ops.move_pages(d, h, *a, to_host))(device, host_arrays, *args)
    want = host_ops.move_pages_reference({k: jnp.asarray(v) for k, v in device.items()},
                                         {k: jnp.asarray(v) for k, v in hosted.items()}, *args)  # fmt: skip
    for k in device:
        assert out[k].sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(want[k]))
    back = jax.jit(lambda h, d, *a: host_ops.move_pages(h, d, *a, to_device))(out, device, args[1], args[0], args[2])
    want_back = host_ops.move_pages_reference(want, {k: jnp.asarray(v) for k, v in device.items()}, args[1], args[0], args[2])
    for k in device:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(want_back[k]))


@pytest.mark.parametrize("dtype", [np.int8, jnp.float8_e4m3fn])
def test_word_packed_host_pages_move_as_the_reference_on_random_data(dtype):
    """An 8-bit array whose host side holds its pages as 32-bit words (what a TPU's host tier
    does, `arena_jax.host.host_page_format`), both directions, against the reference's gather +
    scatter on the same pages seen as bytes; a float32 array in the same call moves plainly."""
    rng = np.random.default_rng(7)
    q = rng.integers(0, 256, (2, 3, 7, 8, 64)).astype(np.uint8).view(np.dtype(dtype))  # S * D = 512: one word row
    s = rng.standard_normal((2, 3, 7, 8)).astype(np.float32)
    words = rng.integers(0, 2**32, (5 * 2, 3, 1, 128), dtype=np.uint64).astype(np.uint32)
    hosted_s = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
    src, dst = rng.integers(0, 7, 9), rng.permutation(5).tolist() + [0, 1, 2, 3]
    moves = np.zeros(9, bool)
    moves[rng.choice(5, 3, replace=False)] = True
    where = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    host = {"q": jax.device_put(words, where), "s": jax.device_put(hosted_s, where)}
    args = (jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32), jnp.asarray(moves))
    out = jax.jit(lambda d, h, *a: host_ops.move_pages(d, h, *a, to_host))({"q": q, "s": s}, host, *args)
    assert out["q"].dtype == jnp.uint32 and out["q"].sharding.memory_kind == "pinned_host"
    as_bytes = lambda x: jnp.asarray(np.asarray(x).view(np.uint8))  # noqa: E731  (compare bits, NaN included)
    want = host_ops.move_pages_reference({"q": as_bytes(q), "s": jnp.asarray(s)},
                                         {"q": as_bytes(words_as_pages(words, q)), "s": jnp.asarray(hosted_s)}, *args)  # fmt: skip
    np.testing.assert_array_equal(words_as_pages(np.asarray(out["q"]), q).view(np.uint8), np.asarray(want["q"]))
    np.testing.assert_array_equal(np.asarray(out["s"]), np.asarray(want["s"]))
    back = jax.jit(lambda h, d, *a: host_ops.move_pages(h, d, *a, to_device))(out, {"q": q, "s": s}, args[1], args[0], args[2])
    want_back = host_ops.move_pages_reference(want, {"q": as_bytes(q), "s": jnp.asarray(s)}, args[1], args[0], args[2])
    assert back["q"].dtype == q.dtype
    np.testing.assert_array_equal(np.asarray(back["q"]).view(np.uint8), np.asarray(want_back["q"]))
    np.testing.assert_array_equal(np.asarray(back["s"]), np.asarray(want_back["s"]))


def test_a_word_packed_host_tier_gives_the_plain_ones_results(monkeypatch):
    """A host tier holding an int8 arena's pages as words (forced here on the CPU; a TPU's default)
    through swap_out and swap_in: the same cache, bit for bit, and the same pages on the host."""
    from arena_jax.host import arena as host_module  # the module whose packs_as_words create_host reads

    layout = aj.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_size=8, num_pages=8, max_seqs=3,
                         max_pages_per_seq=3, dtype="int8")  # fmt: skip
    rng = np.random.default_rng(11)
    cache = aj.create(layout)
    cache, _ = aj.reserve(cache, [0, 1], [11, 16])
    for layer in range(2):
        k, v = (jnp.asarray(rng.standard_normal((2, 16, 2, 64)), jnp.float32) for _ in range(2))
        cache = aj.append(cache, layer, [0, 1], k, v, num_tokens=[11, 16])
    results = {}
    for words in (False, True):
        monkeypatch.setattr(host_module, "packs_as_words", lambda x, platform: words and x.dtype == jnp.int8)  # noqa: B023
        start = jax.tree.map(jnp.copy, cache)
        host = aj.create_host(start, 6)
        assert (host.pages["k"].dtype == jnp.uint32) == words and host.pages["k_scale"].dtype == jnp.float32
        out, host, ok = aj.swap_out(start, host, [0, 1], [[4, 1, -1], [0, 5, -1]])
        assert bool(ok.all())
        view = aj.host_pages_view(host, out)
        out, host, ok = aj.swap_in(out, host, [[0, 5, -1]], [16], [2])
        assert bool(ok.all())
        results[words] = (snapshot(out), view)
    assert jax.tree.all(jax.tree.map(np.array_equal, results[True][0], results[False][0]))
    for name, pages in results[False][1].items():
        np.testing.assert_array_equal(results[True][1][name], pages, err_msg=name)


def test_an_8bit_arena_moves_its_scales_with_its_values():
    layout = dataclasses.replace(LAYOUT, dtype="int8")
    cache = aj.create(layout)
    host = aj.create_host(cache, 4)
    assert set(host.pages) == {"k", "v", "k_scale", "v_scale"}
    rng = np.random.default_rng(3)
    cache, _ = aj.reserve(cache, [1], 5)
    for layer in range(2):
        k, v = (jnp.asarray(rng.standard_normal((1, 5, 2, 16)), jnp.float32) for _ in range(2))
        cache = aj.append(cache, layer, [1], k, v)
    row = np.asarray(cache.table.page_map[1])[:2]
    before = {name: np.asarray(getattr(cache, name))[:, :, row] for name in ("k", "v", "k_scale", "v_scale")}
    q = jnp.asarray(rng.standard_normal((1, 2, 2, 16)), jnp.float32)
    want = aj.attend(q, cache, 1, [1])
    cache, host, _ = aj.swap_out(cache, host, [1], [[2, 0]])
    cache = fill(cache, 0, 8, 9.0)  # the freed pages are reused: the old bytes are gone from them
    cache, host, ok = aj.swap_in(cache, host, [[2, 0]], [5], [3])
    assert bool(ok[0]) and int(cache.stats.pages_to_device) == 2
    new_row = np.asarray(cache.table.page_map[3])[:2]
    for name, old in before.items():
        np.testing.assert_array_equal(np.asarray(getattr(cache, name))[:, :, new_row][..., :1, :], old[..., :1, :])
        np.testing.assert_array_equal(np.asarray(getattr(cache, name))[:, :, new_row[0]], old[:, :, 0])
    np.testing.assert_array_equal(np.asarray(aj.attend(q, cache, 1, [3])), np.asarray(want))


def test_swap_in_appends_to_a_prefix_and_the_host_pages_stay_held_until_dropped():
    cache = fill(aj.create(LAYOUT), 0, 8, 1.0)  # two full pages
    host = aj.create_host(cache, 4)
    cache = fill(cache, 1, 3, 5.0)
    cache, host, _ = aj.swap_out(cache, host, [1], [[0]])
    cache, host, ok = aj.swap_in(cache, host, [[0]], [3], [0])  # appended after slot 0's 8 tokens
    assert bool(ok[0]) and int(cache.table.lengths[0]) == 11
    np.testing.assert_array_equal(np.asarray(cache.table.written[:, 0]), [11, 11])
    np.testing.assert_array_equal(np.asarray(host.held), [3, 0, 0, 0])
    q = jnp.ones((1, 1, 2, 16), jnp.float32)
    out = np.asarray(aj.attend(q, cache, 0, [0]))  # the last token is a swapped-in one (value -5)
    assert np.isfinite(out).all()
    cache, host = aj.drop_host_pages(cache, host, [0])
    assert not np.asarray(host.held).any() and int(cache.stats.host_pages_dropped) == 1


# ---- host errors and refusals inside jit -----------------------------------------------------------------


def _setup():
    cache = fill(aj.create(LAYOUT), 0, 6, 1.0)
    cache = fill(cache, 1, 2, 2.0)
    host = aj.create_host(cache, 4)
    cache, host, _ = aj.swap_out(cache, host, [1], [[3]])  # host page 3 holds 2 tokens
    cache, _ = aj.reserve(cache, [2], 3)  # slot 2: reserved, not written
    cache = aj.hold_pages(cache, np.asarray(cache.table.page_map[0])[:1], [4])
    return cache, host


HOST_ERRORS = {
    "swap_out idle slot": (lambda c, h: aj.swap_out(c, h, [3], [[0]]), r"slots\[0\]=3 is not in use"),
    "swap_out unsettled": (lambda c, h: aj.swap_out(c, h, [2], [[0]]), "reserved tokens not yet written"),
    "swap_out held host page": (lambda c, h: aj.swap_out(c, h, [0], [[3, 0]]), r"host_pages\[0, 0\] is host page 3, held"),
    "swap_out too few pages": (lambda c, h: aj.swap_out(c, h, [0], [[0]]), "host_pages has 1 columns"),
    "swap_out host page twice": (lambda c, h: aj.swap_out(c, h, [0], [[0, 0]]), "uses host page 0 twice"),
    "swap_out out of range": (lambda c, h: aj.swap_out(c, h, [0], [[0, 4]]), r"host pages must be in \[0, 4\)"),
    "swap_out beyond int32": (lambda c, h: aj.swap_out(c, h, [0], [[0, 2**32 + 1]]), "outside int32"),
    "swap_out float pages": (lambda c, h: aj.swap_out(c, h, [0], np.zeros((1, 2))), "must hold integers"),
    "swap_in more than held": (lambda c, h: aj.swap_in(c, h, [[3]], [3], [3]), "holding 2 tokens"),
    "swap_in free page": (lambda c, h: aj.swap_in(c, h, [[1]], [1], [3]), "host page 1, holding 0 tokens"),
    "swap_in unaligned dst": (lambda c, h: aj.swap_in(c, h, [[3]], [2], [0]), "ending at a page boundary"),
    "swap_in rows mismatch": (lambda c, h: aj.swap_in(c, h, [[3], [3]], [2], [3]), "host_pages has 2 rows but dst has 1"),
    "swap_in too many tokens": (lambda c, h: aj.swap_in(c, h, [[3]], [5], [3]), "needs more than the 1 pages"),
    "offload a page not held": (lambda c, h: aj.offload_pages(c, h, [7], [0]), r"pages\[0\]=7 is not held"),
    "offload onto a held host page": (lambda c, h: aj.offload_pages(c, h, np.flatnonzero(np.asarray(c.table.held)), [3]),
                                      "held host page 3"),  # fmt: skip
    "offload shape mismatch": (lambda c, h: aj.offload_pages(c, h, [0, 1], [0]), "must have pages' shape"),
    "drop a free host page": (lambda c, h: aj.drop_host_pages(c, h, [0]), r"host_pages \[0\] are not held"),
    "drop a host page twice": (lambda c, h: aj.drop_host_pages(c, h, [3, 3]), "names a host page twice"),
    "not a host arena": (lambda c, h: aj.drop_host_pages(c, object(), [3]), "host must be a HostArena"),
    "another geometry": (lambda c, h: aj.drop_host_pages(c, aj.create_host(aj.create(dataclasses.replace(LAYOUT, head_dim=32)), 4), [3]),
                         "do not match the cache's per-page arrays"),  # fmt: skip
    "another geometry, the same pages": (  # the pages' shapes match: the layout tells them apart
        lambda c, h: aj.drop_host_pages(c, aj.create_host(aj.create(dataclasses.replace(LAYOUT, num_pages=12, max_seqs=2)), 4),
                                        [3]),
        r"host: it was made for a cache of another geometry \(num_pages=12 \(the cache's 8\), max_seqs=2 \(the cache's 4\)\)"),
    "no cache recorded": (lambda c, h: aj.drop_host_pages(c, h.replace(arena_id=None), [3]), "host: it records no cache"),
}


def _foreign(cache):
    """The host tier of another cache of the same layout (another arena)."""
    return aj.create_host(aj.create(cache.layout), 4)


def _donated(cache):
    """The cache's own host tier, donated to a later call (its arrays deleted)."""
    host = aj.create_host(cache, 4)
    aj.drop_host_pages(jax.tree.map(jnp.copy, cache), host, [aj.PAD_PAGE])
    return host


# Each op refuses a host tier of another cache, and one donated to an earlier call.
for _op, _call in {"swap_out": lambda c, h: aj.swap_out(c, h, [0], [[0, 1]]),
                   "swap_in": lambda c, h: aj.swap_in(c, h, [[3]], [2], [3]),
                   "offload_pages": lambda c, h: aj.offload_pages(c, h, np.flatnonzero(np.asarray(c.table.held)), [0]),
                   "drop_host_pages": lambda c, h: aj.drop_host_pages(c, h, [3])}.items():  # fmt: skip
    HOST_ERRORS[f"{_op}: another cache's host"] = (lambda c, h, f=_call: f(c, _foreign(c)), r"host: it belongs to arena \d+, not")
    HOST_ERRORS[f"{_op}: a donated host"] = (lambda c, h, f=_call: f(c, _donated(c)), "host: its arrays were donated")


@pytest.mark.parametrize("case", list(HOST_ERRORS))
def test_host_errors_name_the_argument_and_change_nothing(case):
    call, message = HOST_ERRORS[case]
    cache, host = _setup()
    before = snapshot((cache, host))
    with pytest.raises(ValueError, match=message):
        call(cache, host)
    jax.tree_util.tree_map(np.testing.assert_array_equal, snapshot((cache, host)), before)


def test_create_host_checks_its_arguments():
    cache = aj.create(LAYOUT)
    for bad in (0, -1, 2.0, True, 2**31):
        with pytest.raises(ValueError, match="num_pages must be an integer"):
            aj.create_host(cache, bad)
    with pytest.raises(ValueError, match="cache must be a KVCache"):
        aj.create_host(LAYOUT, 4)


# ---- bound to its cache ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_pages_swapped_out_of_one_cache_are_refused_by_another_which_stays_untouched(dtype):
    """Issue 37's repro: a slot swapped out of cache A, then swapped into cache B (another arena;
    accepted before, and read wrong). Refused, B and the host tier unchanged; A takes them back."""
    layout = dataclasses.replace(LAYOUT, dtype=dtype, rotate_keys=None, smooth_keys=None)  # int8's defaults: both on
    a = fill(aj.create(layout), 0, 6, 1.0)
    host = aj.create_host(a, 4)
    a, host, ok = aj.swap_out(a, host, [0], [[0, 1]])
    assert bool(ok[0])
    b = fill(aj.create(layout), 0, 4, 3.0)
    before = snapshot((b, host))
    with pytest.raises(ValueError, match=r"host: it belongs to arena \d+, not to this cache's arena \d+"):
        aj.swap_in(b, host, [[0, 1]], [6], [1])
    jax.tree_util.tree_map(np.testing.assert_array_equal, snapshot((b, host)), before)
    a, host, ok = aj.swap_in(a, host, [[0, 1]], [6], [1])
    assert bool(ok[0]) and int(a.table.lengths[1]) == 6


def test_a_host_tier_of_a_cache_with_other_key_factors_is_refused():
    """Two caches of one jitted aj.create share its arena id (drawn when it was traced): the key
    factors the keys were stored with tell their host tiers apart."""
    layout = dataclasses.replace(LAYOUT, dtype="int8", rotate_keys=None, smooth_keys=None)  # smoothed keys
    make = jax.jit(lambda: aj.create(layout))
    a, b = make(), make()
    assert int(a.table.arena_id) == int(b.table.arena_id) and b.key_factors is not None
    b = b.replace(key_factors=b.key_factors.at[1, 0, 3].set(4.0))  # other factors (as aj.create(key_factors=) gives)
    host = aj.create_host(a, 4)
    before = snapshot((b, host))
    message = (r"host: its pages were stored with other key factors \(smooth_keys\) than this cache's "
               r"\(layer 1, KV head 0, channel 3: 0.0 vs the cache's 4.0")
    with pytest.raises(ValueError, match=message):
        aj.drop_host_pages(b, host, [aj.PAD_PAGE])
    with pytest.raises(ValueError, match=message):
        aj.health(b, host=host)
    jax.tree_util.tree_map(np.testing.assert_array_equal, snapshot((b, host)), before)
    aj.health(a, host=host)


READERS = {
    "health": lambda c, h: aj.health(c, host=h),
    "host_pages_view": lambda c, h: aj.host_pages_view(h, c),
    "PrefixCache.bind": lambda c, h: aj.PrefixCache(LAYOUT, host_pages=4).bind(c, host=h),
    "free_host_pages": lambda c, h: aj.free_host_pages(h),  # no cache: a donated host tier only
}
WHOSE = {"own": (lambda c: aj.create_host(c, 4), None), "foreign": (_foreign, r"host: it belongs to arena \d+, not"),
         "donated": (_donated, "host: its arrays were donated")}  # fmt: skip


@pytest.mark.parametrize("whose", list(WHOSE))
@pytest.mark.parametrize("reader", list(READERS))
def test_readers_take_the_caches_own_host_tier_and_refuse_another_caches_or_a_donated_one(reader, whose):
    make, message = WHOSE[whose]
    cache = aj.create(LAYOUT)
    host = make(cache)
    if message is None or (reader == "free_host_pages" and whose == "foreign"):
        READERS[reader](cache, host)
        return
    with pytest.raises(ValueError, match=message):
        READERS[reader](cache, host)


def test_inside_jit_a_host_tier_of_another_arena_has_every_row_refused():
    """Inside a user's jit the ids cannot be read on the host: the ops refuse every row of a
    host tier whose arena id is not the cache's (counted), so its pages never reach the cache."""
    cache, host = _setup()  # host page 3 holds 2 tokens
    other = fill(aj.create(LAYOUT), 1, 2, 7.0)
    other, foreign, _ = aj.swap_out(other, aj.create_host(other, 4), [1], [[3]])  # the same host page, held the same
    swap_in = jax.jit(lambda c, h, p, n, d: aj.swap_in(c, h, p, n, d))
    drop = jax.jit(lambda c, h, p: aj.drop_host_pages(c, h, p))
    row = (jnp.asarray([[3]], jnp.int32), jnp.asarray([2], jnp.int32), jnp.asarray([3], jnp.int32))
    before = snapshot(cache.table)
    out, out_host, ok = swap_in(cache, foreign, *row)
    assert not bool(ok[0]) and int(out.stats.rejected_rows) == int(cache.stats.rejected_rows) + 1
    assert int(out.stats.swap_ins) == int(out.stats.pages_to_device) == 0
    jax.tree_util.tree_map(np.testing.assert_array_equal, snapshot(out.table), before)
    out, out_host = drop(cache, foreign, jnp.asarray([3, 2]))
    np.testing.assert_array_equal(np.asarray(out_host.held), [0, 0, 0, 2])  # kept
    assert int(out.stats.rejected_rows) == int(cache.stats.rejected_rows) + 2 and int(out.stats.host_pages_dropped) == 0
    out, _, ok = swap_in(cache, host, *row)  # its own host tier: served
    assert bool(ok[0]) and int(out.table.lengths[3]) == 2


def test_in_jit_refusals_are_counted_and_change_nothing_for_their_rows():
    cache, host = _setup()
    out = jax.jit(lambda c, h, s, p: aj.swap_out(c, h, s, p), donate_argnums=(0, 1))
    # row 0: slot 0 onto a held host page (3); row 1: slot 0 again (a duplicate); row 2: idle slot 3;
    # row 3: unsettled slot 2; row 4: padding.
    pages = jnp.asarray([[3, 0, -1, -1], [0, 1, -1, -1], [2, -1, -1, -1], [2, -1, -1, -1], [0, 1, -1, -1]], jnp.int32)
    before, counts = snapshot(cache.table), (int(cache.stats.rejected_rows), int(cache.stats.swap_outs))
    cache, host, ok = out(cache, host, jnp.asarray([0, 0, 3, 2, -1], jnp.int32), pages)
    np.testing.assert_array_equal(np.asarray(ok), [False, False, False, False, True])
    assert (int(cache.stats.rejected_rows), int(cache.stats.swap_outs)) == (counts[0] + 4, counts[1])
    jax.tree_util.tree_map(np.testing.assert_array_equal, snapshot(cache.table), before)
    np.testing.assert_array_equal(np.asarray(host.held), [0, 0, 0, 2])


def test_in_jit_swap_in_serves_first_come_first_served_and_refuses_a_host_page_named_twice():
    cache = fill(fill(aj.create(LAYOUT), 0, 8, 1.0), 1, 6, 2.0)
    host = aj.create_host(cache, 4)
    cache, host, _ = aj.swap_out(cache, host, [1], [[0, 1]])  # host page 0: 4 tokens, page 1: 2 tokens
    cache = fill(fill(cache, 2, 16, 3.0), 3, 4, 4.0)  # one free device page left
    assert int(cache.table.num_free) == 1
    swap_in = jax.jit(lambda c, h, p, n, d: aj.swap_in(c, h, p, n, d), donate_argnums=(0, 1))
    pages = jnp.asarray([[0, -1, -1, -1], [1, -1, -1, -1], [0, -1, -1, -1], [3, -1, -1, -1], [2, -1, -1, -1]], jnp.int32)
    counts = jnp.asarray([4, 2, 4, 4, 4], jnp.int32)
    # row 0: served (the last free page); row 1: valid, appended to slot 0, but no page left
    # (failed_swaps); row 2: host page 0 again (rejected); rows 3-4: padding.
    stats = {k: int(getattr(cache.stats, k)) for k in ("swap_ins", "failed_swaps", "rejected_rows")}
    cache, host, ok = swap_in(cache, host, pages, counts, jnp.asarray([1, 0, 3, -1, -1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(ok), [True, False, False, True, True])
    got = {k: int(getattr(cache.stats, k)) - v for k, v in stats.items()}
    assert got == {"swap_ins": 1, "failed_swaps": 1, "rejected_rows": 1}
    np.testing.assert_array_equal(np.asarray(cache.table.lengths), [8, 4, 16, 4])  # refused rows unchanged
    np.testing.assert_array_equal(np.asarray(host.held), [4, 2, 0, 0])  # a copy: the host pages stay held


# ---- generate --------------------------------------------------------------------------------------------

BATCH, CHUNK = 4, 8
FORCE_SWAP = models.SwapPolicy(prefill_tokens_per_s=1.0)  # recomputing looks slow: swap whenever host pages are free
NEVER_SWAP = models.SwapPolicy(bandwidth_bytes_per_s=1.0)  # moving looks slow: recompute


@pytest.fixture(scope="module")
def model():
    return models.init_random(models.LlamaConfig.tiny(), seed=0, std=0.2)  # test_models.py's model


@pytest.fixture(scope="module")
def small_layout(model):
    return model.config.kv_layout(page_size=16, num_pages=6, max_seqs=BATCH, max_seq_len=64, dtype="float32")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    system = [rng.integers(0, 128, 20).tolist(), rng.integers(0, 128, 9).tolist()]
    return [system[i % 2] + rng.integers(0, 128, int(n)).tolist() for i, n in enumerate((3, 10, 1, 5, 12, 7))]


@pytest.fixture(autouse=True)
def check_accounting(monkeypatch):
    monkeypatch.setattr(Scheduler, "CHECK_ACCOUNTING", True)


def _run(model, layout, prompts, new=20, **kwargs):
    return models.generate(model, prompts, new, batch_size=BATCH, chunk_size=CHUNK, layout=layout, **kwargs)


SAMPLINGS = [{}, dict(temperature=0.8, top_k=5, seed=3)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_swap_preemption_gives_the_tokens_of_a_run_without_pressure(model, small_layout, prompts, sampling):
    ample = model.config.kv_layout(page_size=16, num_pages=BATCH * 4, max_seqs=BATCH, max_seq_len=64, dtype="float32")
    unpressured = _run(model, ample, prompts, **sampling)  # every row's whole life fits at once
    assert unpressured.preemptions == 0
    recompute = _run(model, small_layout, prompts, **sampling)
    swapped = _run(model, small_layout, prompts, host_pages=16, swap_policy=FORCE_SWAP, **sampling)
    assert recompute.tokens == swapped.tokens == unpressured.tokens
    assert recompute.preemptions > 0 and recompute.recomputed_tokens > 0
    assert swapped.swap_outs == swapped.preemptions > 0 and swapped.recomputed_tokens == 0
    assert swapped.prefill_tokens == recompute.prefill_tokens - recompute.recomputed_tokens
    h = aj.health(swapped.cache, host=swapped.host)
    assert h["swap_outs"] == h["swap_ins"] == swapped.swap_outs and h["rejected_rows"] == h["failed_swaps"] == 0
    assert h["bytes_to_host"] == h["bytes_to_device"] == h["pages_to_host"] * small_layout.page_bytes > 0
    assert h["host_pages_held"] == 0 and h["free_pages"] == small_layout.num_pages  # nothing held on either tier
    assert swapped.modelled_transfer_seconds == pytest.approx(2 * h["bytes_to_host"] / 25e9)


def test_the_cost_model_can_choose_recompute_and_a_poisoned_host_tier_never_reaches_an_output(model, small_layout, prompts):
    base = _run(model, small_layout, prompts)
    never = _run(model, small_layout, prompts, host_pages=16, swap_policy=NEVER_SWAP)
    assert never.tokens == base.tokens and never.swap_outs == 0 and never.recomputed_tokens == base.recomputed_tokens
    # A host tier whose every page is NaN, and too few host pages for some swaps (those recompute).
    cache = aj.create(small_layout)
    host = aj.create_host(cache, 3)
    host = host.replace(pages={k: jax.device_put(np.full(x.shape, np.nan, x.dtype), x.sharding) for k, x in host.pages.items()})
    poisoned = _run(model, None, prompts, cache=cache, host=host, swap_policy=FORCE_SWAP, return_logits=True)
    assert poisoned.tokens == base.tokens and poisoned.swap_outs > 0
    assert all(np.isfinite(x).all() for x in poisoned.logits)
    assert not np.asarray(poisoned.host.held).any()


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_the_prefix_cache_spills_to_host_and_hits_there(model, small_layout, prompts, sampling):
    """Six pages on the device: the first call's prefixes are spilled to the host tier when
    evicted, the second call (the same prompts) hits them there and brings them back."""
    without = _run(model, small_layout, prompts, new=12, **sampling)
    first = _run(model, small_layout, prompts, new=12, prefix_cache=True, host_pages=24, **sampling)
    second = _run(model, None, prompts, new=12, cache=first.cache, prefix_cache=first.prefix_cache, host=first.host, **sampling)
    assert first.tokens == second.tokens == without.tokens
    h = aj.health(second.cache, second.prefix_cache, host=second.host)
    assert h["prefix_index_matches"] and h["prefix_host_index_matches"] and h["rejected_rows"] == 0
    assert h["prefix_offloaded_pages"] > 0 and h["prefix_host_hit_tokens"] > 0 and h["pages_to_device"] > 0
    assert h["prefix_host_hit_tokens"] + h["prefix_device_hit_tokens"] == h["prefix_hit_tokens"]
    assert h["bytes_to_host"] == h["pages_to_host"] * small_layout.page_bytes
    layout = small_layout
    # Clearing: every device page the index holds goes to the host tier (or is dropped), then every
    # host copy goes: nothing stays held on either tier.
    index, cache, host = second.prefix_cache, second.cache, second.host
    plan = index.evict_plan(index.evictable_pages)
    cache, host = aj.drop_host_pages(cache, host, plan.drop_host or [aj.PAD_PAGE])
    if plan.offload:
        cache, host = aj.offload_pages(cache, host, *map(list, zip(*plan.offload)))
    cache = aj.drop_pages(cache, plan.drop or [aj.PAD_PAGE])
    cache, host = aj.drop_host_pages(cache, host, index.drop_host_copies() or [aj.PAD_PAGE])
    h = aj.health(cache, index, host=host)
    assert h["free_pages"] == layout.num_pages and h["host_pages_held"] == 0
    assert index.num_pages == index.num_host_pages == 0 and h["prefix_index_matches"] and h["prefix_host_index_matches"]


def test_generate_refuses_bad_host_arguments(model, small_layout, prompts):
    with pytest.raises(ValueError, match="host_pages must be"):
        _run(model, small_layout, prompts[:1], host_pages=-1)
    with pytest.raises(ValueError, match="swap_policy must be a models.SwapPolicy"):
        _run(model, small_layout, prompts[:1], swap_policy="fast")
    with pytest.raises(ValueError, match="give host \\(with the cache it belongs to\\)"):
        _run(model, small_layout, prompts[:1], host=aj.create_host(aj.create(small_layout), 2))
    first = _run(model, small_layout, prompts[:2], new=4, prefix_cache=True, host_pages=4)
    with pytest.raises(ValueError, match="keeps host copies in 4 host pages: give its host"):
        _run(model, None, prompts[:1], new=2, cache=first.cache, prefix_cache=first.prefix_cache)
    with pytest.raises(ValueError, match="must be a finite positive number"):
        models.SwapPolicy(bandwidth_bytes_per_s=0)
