"""Model-based test of the whole cache: random reserve / append / attend / fork / truncate /
release sequences, and the prefix cache's hold_pages / drop_pages / fork_pages, checked after
every step against `cache_model.CacheModel`, a plain-Python account of the rules that tracks
page *identity* (objects shared by forks and by the cache's holds) and, per layer, the ids of
the tokens written (and held).

Modes, drawn per example:
  host  eager `aj.*` calls with Python ints (host-numpy: int64 numpy arrays). Inputs the host
        checks must refuse (out of range, duplicates, beyond int32, ...) raise ValueError and
        leave the cache untouched, byte for byte.
  jit   every op inside this test's own `jax.jit`, where slots, counts and layers are tracers:
        duplicates, PAD mixes, out-of-range and int32-extreme slots and counts, forks onto
        themselves or from idle or unsettled slots, layers out of range, attention before
        append. The ops must be total: refuse and count, never corrupt.
After every step: the model's pages (mapped or held) and the physical pages are in bijection;
refcounts (mappings + the cache's hold), `held`, the free stack and `num_free` agree;
reserved-but-unwritten positions sit in private pages; every written token's K and V at every
layer is where the model says, and every held token's too; attention at every layer over
every active slot equals a float64 dense oracle over the model's tokens (on the backend drawn
for the example); and every counter matches the model.
Arena format, drawn per example: float32 (most examples) or a quantized arena (in CI int8 and
int4 with smoothed and rotated keys, their defaults; in jit mode), whose appends quantize (values
and scales: per token, or per group of 32 lanes for int4; keys divided by the layer's factors,
fixed at create from every token's keys by numpy (`cache_model.numpy_key_factors`) and never
changed by any op, then rotated) and whose pages
are copied, shared, held and recycled with their scales: the stored values and scales must
equal, bit for bit, an independent numpy quantization of the token's K and V
(`cache_model.numpy_quantize` / `numpy_quantize4`, after a numpy rotation: token values are
multiples of 1/16, so the rotation's sums are exact in float32 in any order and every
backend rotates them to the same bits), and the attention oracle takes their dequantized
values (rotated back and multiplied by the factors in float64). Stale pages start NaN-poisoned (values and scales) so a
stale read shows.
The host tier (`model_host_ops.py`): swap_out / swap_in round trips, spills of held pages
(offload_pages), drop_host_pages and raw rows of each, drawn beside the other ops; its NaN-
poisoned host arena's held tokens are checked after every step, and after the final clearing no
host page may stay held.

Soak: `HYPOTHESIS_PROFILE=soak pytest tests/test_allocator_model.py -s` (see conftest.py);
`ARENA_MODEL_MODES=jit` (or `host,host-numpy`) soaks one mode; `ARENA_MODEL_QUANT` the quantized
formats (e.g. `int8,int8+rot,int4+smooth,int4+smooth+rot,float8_e4m3fn,float8_e5m2+rot`; `+rot`: rotated
keys, `+smooth`: smoothed keys, a format without them stores plain keys;
`ARENA_MODEL_8BIT`, its former name, still works).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import arena_jax as aj
from cache_model import (INT32_MAX, INT32_MIN, OP_COUNTS, PAD, CacheModel, ceil_div, numpy_dequantize4, numpy_key_factors,
                         numpy_quantize, numpy_quantize4, numpy_rotation)
from model_host_ops import HOST_OPS, HOST_PAGES, HOST_ROUND_TRIP, HostDriver, check_host, expand, host_ops, jitted_calls, poisoned_host
from model_host_ops import calls as host_calls

LAYOUT = aj.KVLayout(  # head_dim 32: the smallest int4 row (16 bytes)
    num_layers=2, num_kv_heads=2, head_dim=32, page_size=4, num_pages=10, max_seqs=4, max_pages_per_seq=6, dtype="float32"
)
L, H, D, S = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.page_size
NUM_Q_HEADS = 4  # GQA: 2 query heads per KV head
ROWS = 5  # batch width of every call (more rows than slots: room for duplicates and PAD)
MAX_T = 7  # tokens per append call
TQ = 3  # query tokens per attend call
WINDOWS = (None, 1, 3, 6)

# K/V of token id i at layer l: VALUES[0 or 1, i, l] ([H, D] float32), distinct for every (i, l):
# multiples of 1/16 in [-2, 2], so that a rotation's sums (+-1 weights) are exact in float32.
# Key channels OUTLIER_CHANNELS are 8x the rest (multiples of 1/2 in [-16, 16]): smoothed keys
# calibrate factors of 2 or 4 there (their ratio to the median amax straddles the threshold 8),
# mostly 1 elsewhere (2 where a first write of few tokens draws a small median).
MAX_IDS = 4096
OUTLIER_CHANNELS = (3, 20)
VALUES = (np.random.default_rng(0).integers(-32, 33, (2, MAX_IDS, L, H, D)) / 16).astype(np.float32)
VALUES[0, ..., OUTLIER_CHANNELS] *= 8
GARBAGE = 1e6  # what rows that must write nothing carry
ATOL = 2e-5  # f32 kernels vs the float64 oracle (head_dim 32, values ~U[-2, 2]; quantized arenas: the
# oracle takes the dequantized values, and the kernels compute in f32, so the same bound holds)
# Arena format, drawn per example: a quantized arena in a quarter of them (in CI int8 and int4,
# keys rotated: what KVLayout gives by default; unrotated int8 in the explicit examples below;
# the fp8 formats differ only inside the kernels, which test_kernels_quantized.py covers, and a
# soak draws any of them with ARENA_MODEL_QUANT). Quantized examples run in jit mode (where
# totality is at stake; the host checks of their inputs are test_quantized.py's) without a
# window (windows are the kernels' business, tested there): every (mode, window, backend) is a
# separate compile, so this keeps the CI cost small.
MODES = tuple(os.environ.get("ARENA_MODEL_MODES", "host,host-numpy,jit,jit").split(","))  # a soak may pick one
QUANT = tuple(os.environ.get("ARENA_MODEL_QUANT", os.environ.get("ARENA_MODEL_8BIT", "int8+smooth+rot,int4+smooth+rot")).split(","))
DTYPES = ("float32",) * 3 * len(QUANT) + QUANT if "jit" in MODES else ("float32",)
# Backends drawn per example: the reference, the blockwise "xla" path (the default off a GPU) and
# the Pallas kernels (interpret mode); a soak may pick one (e.g. ARENA_MODEL_BACKENDS=xla).
BACKENDS = tuple(os.environ.get("ARENA_MODEL_BACKENDS", "reference,xla,pallas").split(","))


def arena_format(fmt: str) -> tuple[str, bool, bool]:
    """"int4+smooth+rot" -> ("int4", True, True): the arena dtype, whether keys are rotated and
    whether they are smoothed (a quantized format without "+rot" / "+smooth": off)."""
    dtype, *options = fmt.split("+")
    return dtype, "rot" in options, "smooth" in options


def stored(fmt: str, model=None):
    """What an arena of `fmt` holds for VALUES: (values, scales or None, float64 values it means:
    dequantized, and rotated back and multiplied by the factors for rotated / smoothed keys).
    Smoothed keys: the factors the model calibrated (`model.key_factors`; 0: not yet: 1)."""
    factors = None
    if arena_format(fmt)[2]:
        factors = np.where(model.key_factors > 0, model.key_factors, np.float32(1)).astype(np.float32)
    return _stored(fmt, None if factors is None else factors.tobytes())


@functools.lru_cache(maxsize=64)
def _stored(fmt: str, factors_bytes):
    dtype, rotate, _ = arena_format(fmt)
    if dtype == "float32":
        return VALUES, None, VALUES.astype(np.float64)
    x = VALUES
    factors = None if factors_bytes is None else np.frombuffer(factors_bytes, np.float32).reshape(L, H, D)
    if factors is not None:  # keys only, divided by powers of two: exact
        x = np.stack([VALUES[0] / factors, VALUES[1]]).astype(np.float32)
    if rotate:  # keys only; exact sums (multiples of 1/16), then one f32 rounding by the column scale
        m, col_scale, _ = numpy_rotation(D)
        x = np.stack([(x[0] @ m) * col_scale, x[1]]).astype(np.float32)
    if dtype == "int4":
        values, scales = numpy_quantize4(x)  # [2, MAX_IDS, L, H, D / 2], [2, MAX_IDS, L, H, D / 32]
        meant = numpy_dequantize4(values, scales)
    else:
        values, scales = numpy_quantize(x, dtype)  # [2, MAX_IDS, L, H, D], [2, MAX_IDS, L, H]
        meant = values.astype(np.float64) * scales.astype(np.float64)[..., None]
    if rotate:
        meant[0] = meant[0] @ numpy_rotation(D)[2].T  # R^T: (q R) . k_stored == q . (k_stored R^T)
    if factors is not None:
        meant[0] = meant[0] * factors  # (q f) . k_stored == q . (k_stored f)
    return values, scales, meant


# ---- the calls, eager (host mode) or inside the test's own jit (jit mode) --------------------------


def _backend_ops(backend):
    return {
        "append": lambda c, layer, s, k, v, n: aj.append(c, layer, s, k, v, num_tokens=n, backend=backend),
        "attend": lambda q, c, layer, s, n, w: aj.attend(q, c, layer, s, num_tokens=n, sliding_window=w, backend=backend),
    }


# The ops without a backend: the same functions (so, in jit mode, the same jits) for every backend.
_SHARED_OPS = {
    "reserve": lambda c, s, n: aj.reserve(c, s, n),
    "release": lambda c, s: aj.release(c, s),
    "fork": lambda c, src, dst: aj.fork(c, src, dst),
    "truncate": lambda c, s, n: aj.truncate(c, s, n),
    "hold_pages": lambda c, p, n: aj.hold_pages(c, p, n),
    "drop_pages": lambda c, p: aj.drop_pages(c, p),
    "fork_pages": lambda c, p, n, d: aj.fork_pages(c, p, n, d),
}


def _ops(backend):
    return {**_SHARED_OPS, **_backend_ops(backend), **host_calls()}


@functools.lru_cache(maxsize=None)
def _shared_jitted():
    """One jit per backend-free op for the session: traced and compiled once per cache format,
    not once more per backend."""
    return {name: jax.jit(f, donate_argnums=0) for name, f in _SHARED_OPS.items()}


@functools.lru_cache(maxsize=None)
def jitted(backend):
    ops = _backend_ops(backend)
    out = {"append": jax.jit(ops["append"], donate_argnums=0), "attend": jax.jit(ops["attend"], static_argnums=5)}
    return {**_shared_jitted(), **out, **jitted_calls()}


def i32(values):
    """Values as an int32 array the way a jitted caller would hold them (saturated into int32)."""
    return jnp.asarray(np.clip(np.asarray(values, np.int64), INT32_MIN, INT32_MAX).astype(np.int32))


def snapshot(cache):
    """Every array's bytes (byte for byte: NaN patterns of fp8 arenas compare equal to themselves)."""
    return jax.tree_util.tree_map(lambda x: np.frombuffer(np.asarray(x).tobytes(), np.uint8), cache)


# ---- strategies ---------------------------------------------------------------------------------------

# Slots: valid ones most often; then PAD, out of range, int32 extremes, and (host mode only,
# where they must be refused before any cast) values outside int32.
BAD_SLOTS = (PAD, LAYOUT.max_seqs, -2, INT32_MAX, INT32_MIN, 2**31, 2**32 + 2)
BAD_COUNTS = (-1, LAYOUT.max_seq_len + 1, INT32_MAX, INT32_MIN, 2**32 + 3)
BAD_LAYERS = (-1, L, INT32_MAX, 2**32)


def slot_choice(bad: bool):
    ok = st.integers(0, LAYOUT.max_seqs - 1).map(lambda i: ("slot", i))
    pad = st.just(("raw", PAD))
    return st.one_of(ok, ok, ok, pad, st.sampled_from(BAD_SLOTS).map(lambda v: ("raw", v))) if bad else st.one_of(ok, ok, pad)


def count_choice(bad: bool, hi: int = MAX_T):
    frac = st.floats(0, 1).map(lambda f: ("frac", f))
    raw = st.integers(0, hi).map(lambda v: ("raw", v))
    return st.one_of(frac, frac, raw, st.sampled_from(BAD_COUNTS).map(lambda v: ("raw", v))) if bad else st.one_of(frac, frac, raw)


def layer_choice(bad: bool):
    ok = st.integers(0, L - 1).map(lambda v: ("raw", v))
    return st.one_of(ok, ok, st.sampled_from(BAD_LAYERS).map(lambda v: ("raw", v))) if bad else ok


def rows_of(bad: bool, hi: int = MAX_T):
    return st.lists(st.tuples(slot_choice(bad), count_choice(bad, hi)), min_size=1, max_size=ROWS)


BAD_PAGES = (PAD, LAYOUT.num_pages, -2, INT32_MAX, INT32_MIN, 2**31)
WIDTHS = (LAYOUT.max_pages_per_seq, 3)  # fork_pages' page rows: full width or narrower


def page_choice(bad: bool):
    """A page mapped by a slot, one the cache holds, a free one, or (bad) a raw value."""
    ok = st.one_of(
        st.tuples(st.just("mapped"), st.integers(0, 63)),
        st.tuples(st.just("held"), st.integers(0, 63)),
        st.tuples(st.just("free"), st.integers(0, 63)),
    )
    return st.one_of(ok, ok, ok, st.sampled_from(BAD_PAGES).map(lambda v: ("raw", v))) if bad else ok


def _prefix_ops(bad: bool):
    hold_count = st.one_of(st.floats(0, 1).map(lambda f: ("fill", f)), st.integers(0, S + 1).map(lambda v: ("raw", v)))
    if bad:
        hold_count = st.one_of(hold_count, st.sampled_from((-1, INT32_MAX, INT32_MIN, 2**32 + 1)).map(lambda v: ("raw", v)))
    active = st.integers(0, 7).map(lambda i: ("active", i))
    source = st.one_of(
        st.tuples(st.just("slot"), active),  # the pages of a slot (a cached prefix, if held)
        st.tuples(st.just("held"), st.integers(0, 63)),  # held pages, full ones first
        st.tuples(st.just("pages"), st.lists(page_choice(bad), min_size=1, max_size=4)),
    )
    fork_count = st.one_of(st.floats(0, 1).map(lambda f: ("valid", f)), st.floats(0, 1.2).map(lambda f: ("valid", f)))
    if bad:
        fork_count = st.one_of(fork_count, st.sampled_from(BAD_COUNTS).map(lambda v: ("raw", v)))
    holds = st.lists(st.tuples(page_choice(bad), hold_count), min_size=1, max_size=ROWS)
    whole_slot = st.tuples(st.just("slot"), active)  # every written page of a slot: what generate holds
    # A slot's written pages held by the cache, then mapped into another slot (a prefix hit).
    share = st.tuples(st.just("share"), st.just(False), st.tuples(active, slot_choice(False), st.floats(0, 1)))
    return [
        share,
        st.tuples(st.just("hold_pages"), st.just(bad), st.one_of(holds, whole_slot)),
        st.tuples(st.just("drop_pages"), st.just(bad), st.lists(page_choice(bad), min_size=1, max_size=ROWS)),
        st.tuples(st.just("fork_pages"), st.just(bad), st.tuples(
            st.sampled_from(WIDTHS), st.lists(st.tuples(slot_choice(bad), source, fork_count), min_size=1, max_size=3))),
    ]  # fmt: skip


def _op(bad: bool):
    pairs = st.lists(
        st.tuples(st.integers(0, 7).map(lambda i: ("active", i)) | slot_choice(bad), slot_choice(bad)), min_size=1, max_size=3
    )
    grow = st.tuples(st.just("grow"), st.just(False), rows_of(False, hi=S + 2))  # reserve, then append_all of it
    return st.one_of(
        st.tuples(st.just("reserve"), st.just(bad), rows_of(bad)),
        st.tuples(st.just("append"), st.just(bad), st.tuples(layer_choice(bad), rows_of(bad))),
        st.tuples(st.just("append_all"), st.just(bad), rows_of(bad)),  # every layer: the common case
        grow,
        grow,  # the prefix ops need written pages to work on
        st.tuples(st.just("attend"), st.just(bad), st.tuples(layer_choice(bad), rows_of(bad, hi=TQ + 1))),
        st.tuples(st.just("release"), st.just(bad), st.lists(slot_choice(bad), min_size=1, max_size=ROWS)),
        st.tuples(st.just("fork"), st.just(bad), pairs),
        st.tuples(st.just("truncate"), st.just(bad), rows_of(bad)),
        *_prefix_ops(bad),
        *host_ops(bad, slot_choice, page_choice, LAYOUT.max_pages_per_seq, BAD_COUNTS),
    )


_GOOD, _BAD = _op(bad=False), _op(bad=True)  # built once: rebuilding them per draw costs seconds
op_st = st.integers(0, 3).flatmap(lambda x: _BAD if x == 0 else _GOOD)  # a quarter of the ops adversarial


# ---- resolving drawn choices against the model's state -----------------------------------------------


def resolve_slot(model: CacheModel, choice):
    kind, v = choice
    if kind == "active":
        active = sorted(model.slots)
        return active[v % len(active)] if active else v % LAYOUT.max_seqs
    return v


class Pages:
    """Physical page <-> model page object, as `check_state` last established it (a bijection)."""

    def __init__(self):
        self.obj_of: dict[int, object] = {}

    def phys(self, obj) -> int:
        return next(p for p, o in self.obj_of.items() if o is obj)

    def resolve(self, page):
        return self.obj_of.get(page)

    def choose(self, model: CacheModel, choice) -> int:
        kind, v = choice
        if kind == "raw":
            return v
        if kind == "mapped":
            pages = [p for slot in sorted(model.slots) for p in model.slots[slot].pages]
            return self.phys(pages[v % len(pages)]) if pages else PAD
        if kind == "held":
            held = sorted(self.phys(h.page) for h in model.held.values())
            return held[v % len(held)] if held else PAD
        free = sorted(set(range(LAYOUT.num_pages)) - set(self.obj_of))
        return free[v % len(free)] if free else PAD


def fork_source(model, pages: Pages, source) -> list[int]:
    kind, v = source
    if kind == "slot":
        slot = resolve_slot(model, v)
        return [pages.phys(p) for p in model.slots[slot].pages] if slot in model.slots else []
    if kind == "held":
        held = sorted(model.held.values(), key=lambda h: (h.k != S, pages.phys(h.page)))
        full = [h for h in held if h.k == S]
        chain = full[v % max(1, len(full)) :] + [h for h in held if h.k != S][:1]
        return [pages.phys(h.page) for h in chain]
    return [pages.choose(model, c) for c in v]


def max_fork_tokens(model, pages: Pages, row) -> int:
    """The most tokens the held pages of `row`, in order, cover (full pages, then one more)."""
    n = 0
    for p in row:
        hold = model.held.get(id(pages.resolve(p))) if 0 <= p < LAYOUT.num_pages else None
        if hold is None:
            break
        n += hold.k
        if hold.k < S:
            break
    return n


def resolve_rows(model, rows, room):
    out = []
    for slot_c, count_c in rows:
        slot = resolve_slot(model, slot_c)
        kind, v = count_c
        out.append((slot, int(np.ceil(v * max(0, room(slot)))) if kind == "frac" else v))
    return out


def dedupe(rows, key=lambda r: r[0]):
    """Host mode, valid ops: later rows naming an earlier row's slot become padding."""
    seen, out = set(), []
    for r in rows:
        slot = key(r)
        if slot != PAD and slot in seen:
            r = (PAD,) + tuple(r[1:]) if isinstance(r, tuple) else PAD
        seen.add(slot)
        out.append(r)
    return out


def pad_rows(rows, fill):
    return list(rows) + [fill] * (ROWS - len(rows))


# ---- checks ---------------------------------------------------------------------------------------------


def dense_oracle(q, keys, values, n, window):
    """q [TQ, Hq, D] (rows t < n are the last n written tokens); keys/values [w, H, D] -> [TQ, Hq, D] f64."""
    w, group = keys.shape[0], NUM_Q_HEADS // H
    out = np.zeros(q.shape, np.float64)
    for t in range(n):
        pos = w - n + t
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(NUM_Q_HEADS):
            kk, vv = keys[lo : pos + 1, h // group].astype(np.float64), values[lo : pos + 1, h // group].astype(np.float64)
            logits = kk @ q[t, h].astype(np.float64) / np.sqrt(D)
            p = np.exp(logits - logits.max())
            out[t, h] = (p / p.sum()) @ vv
    return out


def expected_attention(model, layer, slots, counts, q, window, dtype):
    answered = model.attend_rows(layer, list(zip(slots, counts)), TQ)
    meant = stored(dtype, model)[2]
    want = np.zeros(q.shape, np.float64)
    for b, (slot, n) in enumerate(zip(slots, answered)):
        if n:
            ids = np.asarray(model.slots[slot].ids[layer])
            want[b] = dense_oracle(q[b], meant[0, ids, layer], meant[1, ids, layer], n, window)
    return want


def check_state(cache, model: CacheModel, pages: Pages, dtype: str = "float32"):
    t = cache.table
    page_map, lengths, active = np.asarray(t.page_map), np.asarray(t.lengths), np.asarray(t.active)
    refcount, free_stack, num_free = np.asarray(t.refcount), np.asarray(t.free_stack), int(t.num_free)
    written, held = np.asarray(t.written), np.asarray(t.held)
    k, v = np.asarray(cache.k), np.asarray(cache.v)
    values, scales, _ = stored(dtype, model)
    assert (cache.k_scale is None) == (scales is None)
    assert (cache.key_factors is None) == (not arena_format(dtype)[2])
    if cache.key_factors is not None:  # fixed at create: no op changes them
        np.testing.assert_array_equal(np.asarray(cache.key_factors), model.key_factors, err_msg="key_factors")
    if scales is not None:
        k_scale, v_scale = np.asarray(cache.k_scale), np.asarray(cache.v_scale)

    for s in range(LAYOUT.max_seqs):
        m = model.slots.get(s)
        assert bool(active[s]) == (m is not None), f"slot {s} active"
        assert int(lengths[s]) == (m.length if m else 0), f"slot {s} length {lengths[s]}"
        np.testing.assert_array_equal(written[:, s], [len(x) for x in m.ids] if m else [0] * L, err_msg=f"slot {s} written")
        mapped = ceil_div(int(lengths[s]), S)
        assert (page_map[s, :mapped] >= 0).all() and (page_map[s, mapped:] == -1).all(), f"slot {s} page_map {page_map[s]}"

    # Page identity: model page objects (mapped or held) <-> physical pages is a bijection. A page
    # only the cache holds keeps the physical id it had when a slot last mapped it.
    phys_of: dict[int, int] = {}
    for s, m in model.slots.items():
        for j, obj in enumerate(m.pages):
            p = int(page_map[s, j])
            assert phys_of.setdefault(id(obj), p) == p, "one model page mapped to two physical pages"
    objects = {id(o): o for o in pages.obj_of.values()}
    for key, hold in model.held.items():
        if key not in phys_of:
            assert key in objects, "a held page no slot maps was never seen"
            phys_of[key] = pages.phys(hold.page)
    assert len(set(phys_of.values())) == len(phys_of), "two model pages share one physical page"
    live = {id(o): o for o in model.pages_in_use().values()}
    pages.obj_of = {p: live[key] for key, p in phys_of.items()}

    counts = np.zeros(LAYOUT.num_pages, np.int64)
    np.add.at(counts, page_map[page_map >= 0], 1)
    want_held = np.zeros(LAYOUT.num_pages, np.int64)
    for key, hold in model.held.items():
        want_held[phys_of[key]] = hold.k
    np.testing.assert_array_equal(held, want_held, err_msg="held")
    np.testing.assert_array_equal(refcount, counts + (want_held > 0), err_msg="refcount = mappings + holds")
    free = free_stack[:num_free]
    assert len(set(free.tolist())) == num_free, "a page is on the free stack twice"
    assert (refcount[free] == 0).all(), "a free page has references"
    assert num_free + np.count_nonzero(refcount) == LAYOUT.num_pages, "pages leaked"

    for s, m in model.slots.items():
        # Reserved but unwritten positions lie in pages this slot holds alone.
        for pos in range(min(len(x) for x in m.ids), m.length):
            assert refcount[page_map[s, pos // S]] == 1, f"slot {s} position {pos}: pending write in a shared page"
        # Every written token's K and V (and an 8-bit arena's scales), at every layer and head.
        for layer, ids in enumerate(m.ids):
            if ids:
                pos = np.arange(len(ids))
                at = (layer, slice(None), page_map[s, pos // S], pos % S)
                np.testing.assert_array_equal(k[at], values[0, ids, layer])  # [T, H, D]
                np.testing.assert_array_equal(v[at], values[1, ids, layer])
                if scales is not None:
                    np.testing.assert_array_equal(k_scale[at], scales[0, ids, layer])  # [T, H(, G)]
                    np.testing.assert_array_equal(v_scale[at], scales[1, ids, layer])

    # The tokens the cache holds are intact, at every layer and head.
    for key, hold in model.held.items():
        for layer, ids in enumerate(hold.ids):
            at = (layer, slice(None), phys_of[key], slice(0, hold.k))
            np.testing.assert_array_equal(k[at], values[0, ids, layer].transpose(1, 0, 2))  # [H, T, D]
            np.testing.assert_array_equal(v[at], values[1, ids, layer].transpose(1, 0, 2))
            if scales is not None:
                np.testing.assert_array_equal(k_scale[at], np.swapaxes(scales[0, ids, layer], 0, 1))  # [H, T(, G)]
                np.testing.assert_array_equal(v_scale[at], np.swapaxes(scales[1, ids, layer], 0, 1))

    stats = cache.stats
    for name in ("cow_copies", "failed_reservations", "dropped_writes", "rejected_rows", "metadata_ops", "tokens_written",
                 "prefix_forks", "prefix_tokens", "pages_held", "holds_dropped", "pages_evicted", "pages_to_host",
                 "pages_to_device", "swap_outs", "swap_ins", "failed_swaps", "host_pages_dropped"):  # fmt: skip
        assert int(getattr(stats, name)) == model.counters[name], f"stats.{name}={int(getattr(stats, name))}, model {model.counters[name]}"
    assert int(stats.pages_allocated) - int(stats.pages_recycled) == np.count_nonzero(refcount)


def check_attention(cache, model, call, args, rng, window, *, over_ask: bool, dtype: str = "float32"):
    """Attention at every layer for every active slot that has written tokens. With `over_ask`
    (inside jit, where nothing raises), the spare row asks one query token more than its slot
    has written at the layer (or attends a slot with nothing written): it must give zeros."""
    for layer in range(L):
        slots = [s for s in sorted(model.slots) if model.written(layer, s)]
        counts = [int(rng.integers(1, min(TQ, model.written(layer, s)) + 1)) for s in slots]
        if over_ask:
            short = [s for s in range(LAYOUT.max_seqs) if model.written(layer, s) < TQ]
            s = short[int(rng.integers(len(short)))] if short else 0
            slots.append(s)
            counts.append(min(TQ, model.written(layer, s) + 1))
        slots, counts = pad_rows(slots, PAD), pad_rows(counts, 0)
        q = rng.standard_normal((ROWS, TQ, NUM_Q_HEADS, D)).astype(np.float32)
        got = call(jnp.asarray(q), cache, args(layer), args(slots), args(counts), window)
        want = expected_attention(model, layer, slots, counts, q, window, dtype)
        np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0, err_msg=f"attention at layer {layer}")


# ---- the driver -----------------------------------------------------------------------------------------


def kv_rows(model, layer, rows, written_ids):
    k = np.full((ROWS, MAX_T, H, D), GARBAGE, np.float32)
    v = np.full((ROWS, MAX_T, H, D), -GARBAGE, np.float32)
    for b, ids in enumerate(written_ids):
        if ids:
            k[b, : len(ids)] = VALUES[0, ids, layer if 0 <= layer < L else 0]
            v[b, : len(ids)] = VALUES[1, ids, layer if 0 <= layer < L else 0]
    return jnp.asarray(k), jnp.asarray(v)


def run_ops(ops, mode: str, backend: str, window, dtype: str = "float32", seed: int = 0):
    """Run `ops` on a fresh cache and on the model, checking state (and attention) after each;
    then drop every hold and release every slot. Returns the final page table."""
    arena_dtype, rotate, smooth = arena_format(dtype)
    # Smoothed keys: factors fixed at create (from every token's keys, numpy), never changed by an op.
    factors = np.stack([numpy_key_factors(VALUES[0, :, layer]) for layer in range(L)]) if smooth else None
    cache = aj.create(dataclasses.replace(LAYOUT, dtype=arena_dtype, rotate_keys=rotate, smooth_keys=smooth),
                      key_factors=factors)
    assert cache.rotate_keys == rotate and (cache.key_factors is not None) == smooth
    # Stale pages NaN everywhere (values; and scales, the one stale thing an int8 arena can hold
    # as NaN): any read of an unwritten position or a recycled page's old tokens shows.
    nan = {f: jnp.full_like(getattr(cache, f), jnp.nan) for f in ("k", "v", "k_scale", "v_scale")
           if getattr(cache, f) is not None and jnp.issubdtype(getattr(cache, f).dtype, jnp.floating)}
    # Committed to its device, as the host tier's arrays are (an op taking both returns committed
    # arrays): every op then compiles once per example setup, not once more after a host-tier op.
    cache = jax.device_put(cache.replace(**nan), jax.devices()[0])
    host = poisoned_host(cache)  # the host tier's stale pages are NaN too
    model = CacheModel(
        num_layers=L, page_size=S, num_pages=LAYOUT.num_pages, max_seqs=LAYOUT.max_seqs,
        max_pages_per_seq=LAYOUT.max_pages_per_seq, host_pages=HOST_PAGES,
    )  # fmt: skip
    model.key_factors = factors if smooth else np.zeros((L, H, D), np.float32)
    rng = np.random.default_rng(seed)
    pages = Pages()
    calls = jitted(backend) if mode == "jit" else _ops(backend)
    if mode == "jit":
        args = i32
    elif mode == "host-numpy":  # int64 arrays: checked before any cast to int32
        args = lambda x: np.asarray(x, np.int64) if isinstance(x, (list, tuple)) else np.int64(x)  # noqa: E731
    else:  # Python ints, any size
        args = lambda x: list(x) if isinstance(x, (list, tuple)) else x  # noqa: E731

    driver = HostDriver(model, pages, mode, calls, args, ROWS)

    def host_refuses(op, *model_args) -> bool:
        """Host mode: when the host checks must refuse, check they do and that nothing changed."""
        return mode != "jit" and model.host_error(op, *model_args)

    def expect_refusal(fn):
        before = snapshot(cache)
        with pytest.raises(ValueError):
            fn()
        jax.tree_util.tree_map(np.testing.assert_array_equal, snapshot(cache), before)

    expanded = []  # (op, bad, payload, check the state after it)
    for name, bad, payload in ops:
        if name == "grow":  # a reservation, then an append_all of it
            expanded += [("reserve", bad, payload, False), ("append_all", bad, [(c, ("frac", 1.0)) for c, _ in payload], True)]
        elif name == "share":  # the cache holds a slot's written pages, then a slot is made from them
            src, dst, frac = payload
            expanded += [("hold_pages", bad, ("slot", src), False),
                         ("fork_pages", bad, (LAYOUT.max_pages_per_seq, [(dst, ("slot", src), ("valid", frac))]), True)]  # fmt: skip
        else:
            expanded += expand(name, bad, payload, LAYOUT.max_pages_per_seq)  # host-tier composites; any other op as it is
    for name, bad, payload, check in expanded:
        OP_COUNTS[mode if dtype == "float32" else f"{mode} {dtype}"] += 1
        if name == "reserve":
            rows = resolve_rows(model, payload, lambda s: min(MAX_T, model.max_len - model.length(s)))
            rows = pad_rows(rows if bad or mode == "jit" else dedupe(rows), (PAD, 0))
            slots, counts = [r[0] for r in rows], [r[1] for r in rows]
            if host_refuses("reserve", rows):
                expect_refusal(lambda: calls["reserve"](cache, args(slots), args(counts)))
            else:
                want_ok = model.reserve(rows)
                cache, ok = calls["reserve"](cache, args(slots), args(counts))
                np.testing.assert_array_equal(np.asarray(ok), want_ok, err_msg=f"reserve ok for {rows}")
        elif name in ("append", "append_all"):
            layers = [payload[0][1]] if name == "append" else list(range(L))
            rows_c = payload[1] if name == "append" else payload
            for layer in layers:
                room = lambda s: min(MAX_T, model.length(s) - model.written(layer, s)) if 0 <= layer < L else MAX_T  # noqa: E731
                rows = resolve_rows(model, rows_c, room)
                rows = pad_rows(rows if bad or mode == "jit" else dedupe(rows), (PAD, 0))
                slots, counts = [r[0] for r in rows], [r[1] for r in rows]
                if host_refuses("append", layer, rows, MAX_T):
                    k, v = kv_rows(model, layer, rows, [None] * ROWS)
                    expect_refusal(lambda: calls["append"](cache, args(layer), args(slots), k, v, args(counts)))
                    continue
                ids = model.append(layer, rows, MAX_T)
                k, v = kv_rows(model, layer, rows, ids)
                cache = calls["append"](cache, args(layer), args(slots), k, v, args(counts))
        elif name == "attend":
            layer = payload[0][1]
            room = lambda s: min(TQ, model.written(layer, s)) if 0 <= layer < L else TQ  # noqa: E731
            rows = resolve_rows(model, payload[1], room)
            rows = pad_rows(rows if bad or mode == "jit" else dedupe(rows), (PAD, 0))
            slots, counts = [r[0] for r in rows], [r[1] for r in rows]
            q = rng.standard_normal((ROWS, TQ, NUM_Q_HEADS, D)).astype(np.float32)
            if host_refuses("attend", layer, rows, TQ):
                expect_refusal(lambda: calls["attend"](jnp.asarray(q), cache, args(layer), args(slots), args(counts), window))
            else:
                got = calls["attend"](jnp.asarray(q), cache, args(layer), args(slots), args(counts), window)
                want = expected_attention(model, layer, slots, counts, q, window, dtype)
                np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0, err_msg=f"attend {rows} at layer {layer}")
        elif name == "release":
            slots = [resolve_slot(model, c) for c in payload]
            slots = pad_rows(slots if bad or mode == "jit" else dedupe(slots, key=lambda s: s), PAD)
            if host_refuses("release", slots):
                expect_refusal(lambda: calls["release"](cache, args(slots)))
            else:
                model.release(slots)
                cache = calls["release"](cache, args(slots))
        elif name == "fork":
            pairs = [(resolve_slot(model, s), resolve_slot(model, d)) for s, d in payload]
            pairs = pad_rows(pairs, (PAD, PAD))
            src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
            if host_refuses("fork", pairs):
                expect_refusal(lambda: calls["fork"](cache, args(src), args(dst)))
            else:
                model.fork(pairs)
                cache = calls["fork"](cache, args(src), args(dst))
        elif name == "hold_pages":
            rows = []
            if payload[0] == "slot":
                slot = resolve_slot(model, payload[1])
                objs = model.slots[slot].pages if slot in model.slots else []
                objs = [o for o in objs if model.fill(o)[0] and not model.pending(o) and id(o) not in model.held]
                payload = [(("raw", pages.phys(o)), ("fill", 1.0)) for o in objs[:ROWS]] or [(("raw", PAD), ("raw", 1))]
            for page_c, (kind, v) in payload:
                page = pages.choose(model, page_c)
                obj = pages.resolve(page)
                rows.append((page, max(1, int(np.ceil(v * model.fill(obj)[0]))) if kind == "fill" and obj is not None else (1 if kind == "fill" else v)))
            rows = pad_rows(rows if bad or mode == "jit" else dedupe(rows), (PAD, 1))
            page_ids, counts = [r[0] for r in rows], [r[1] for r in rows]
            if host_refuses("hold_pages", rows, pages.resolve):
                expect_refusal(lambda: calls["hold_pages"](cache, args(page_ids), args(counts)))
            else:
                model.hold_pages(rows, pages.resolve)
                cache = calls["hold_pages"](cache, args(page_ids), args(counts))
        elif name == "drop_pages":
            page_ids = [pages.choose(model, c) for c in payload]
            page_ids = pad_rows(page_ids if bad or mode == "jit" else dedupe(page_ids, key=lambda p: p), PAD)
            if host_refuses("drop_pages", [(p,) for p in page_ids], pages.resolve):
                expect_refusal(lambda: calls["drop_pages"](cache, args(page_ids)))
            else:
                model.drop_pages(page_ids, pages.resolve)
                cache = calls["drop_pages"](cache, args(page_ids))
        elif name == "fork_pages":
            width, fork_rows = payload
            rows = []
            for dst_c, source, (kind, v) in fork_rows:
                row = (fork_source(model, pages, source) + [PAD] * width)[:width]
                rows.append((resolve_slot(model, dst_c), row, int(v * max_fork_tokens(model, pages, row)) if kind == "valid" else v))
            rows = pad_rows(rows if bad or mode == "jit" else dedupe(rows), (PAD, [PAD] * width, 0))
            dst, page_rows, counts = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
            if host_refuses("fork_pages", rows, width, pages.resolve):
                expect_refusal(lambda: calls["fork_pages"](cache, args(page_rows), args(counts), args(dst)))
            else:
                model.fork_pages(rows, width, pages.resolve)
                cache = calls["fork_pages"](cache, args(page_rows), args(counts), args(dst))
        elif name in HOST_OPS:
            cache, host = driver.step(name, bad, payload, cache, host, resolve_slot, dedupe)
        elif name == "truncate":
            rows = [(resolve_slot(model, s), c) for s, c in payload]
            rows = [(s, int(v * model.length(s)) if kind == "frac" else v) for s, (kind, v) in rows]
            rows = pad_rows(rows if bad or mode == "jit" else dedupe(rows), (PAD, 0))
            slots, counts = [r[0] for r in rows], [r[1] for r in rows]
            if host_refuses("truncate", rows):
                expect_refusal(lambda: calls["truncate"](cache, args(slots), args(counts)))
            else:
                model.truncate(rows)
                cache = calls["truncate"](cache, args(slots), args(counts))
        assert model.next_id < MAX_IDS
        if check:
            check_state(cache, model, pages, dtype)
            check_host(host, model, *stored(dtype, model)[:2])
            if name not in ("hold_pages", "drop_pages"):  # holds change no slot's tokens: attention is as it was
                check_attention(cache, model, calls["attend"], args, rng, window, over_ask=mode == "jit", dtype=dtype)

    # Dropping every host page and every hold and releasing everything returns every page exactly once.
    cache, host = driver.clear(cache, host)
    held = sorted(pages.phys(h.page) for h in model.held.values())
    for i in range(0, len(held), ROWS):
        cache = calls["drop_pages"](cache, args(pad_rows(held[i : i + ROWS], PAD)))
    cache = calls["release"](cache, args(list(range(LAYOUT.max_seqs)) + [PAD] * (ROWS - LAYOUT.max_seqs)))
    return cache.table, host.held


def assert_everything_free(table):
    """No leak: after dropping every hold and releasing every slot, each page is free exactly once."""
    assert int(table.num_free) == LAYOUT.num_pages
    assert sorted(np.asarray(table.free_stack).tolist()) == list(range(LAYOUT.num_pages)), "each page free exactly once"
    assert not np.asarray(table.refcount).any() and not np.asarray(table.written).any() and not np.asarray(table.held).any()
    assert (np.asarray(table.page_map) == -1).all() and not np.asarray(table.active).any()


FILL = ("frac", 1.0)
# Found by the first version of this test: the copier of a shared half page is refused for lack of
# pages, so the keeper (the page's other holder, in the same batch) must not be served either.
COW_STARVED = [
    ("reserve", False, [(("slot", 0), ("raw", 5)), (("slot", 1), ("raw", 5)), (("slot", 3), ("raw", 5))]),
    ("append_all", False, [(("slot", 0), FILL), (("slot", 1), FILL), (("slot", 3), FILL)]),
    ("reserve", False, [(("slot", 0), ("raw", 5))]),
    ("append_all", False, [(("slot", 0), FILL)]),
    ("reserve", False, [(("slot", 0), ("raw", 5))]),
    ("append_all", False, [(("slot", 0), FILL)]),
    ("fork", False, [(("slot", 0), ("slot", 2))]),
    ("reserve", False, [(("slot", 2), ("raw", 2)), (("slot", 0), ("raw", 2))]),
    ("append_all", False, [(("slot", 2), FILL), (("slot", 0), FILL)]),
]
# The prefix cache's partly filled page: a slot writes 6 tokens (a full page and 2 of the next),
# the cache holds both pages, a second slot is made from them, then both slots write on: each
# must get its own copy of the partly filled page (copy-on-write), the cached tokens stay intact,
# and dropping the holds frees only the page no slot maps.
PREFIX_PARTIAL = [
    ("reserve", False, [(("slot", 0), ("raw", 6))]),
    ("append_all", False, [(("slot", 0), FILL)]),
    ("hold_pages", False, ("slot", ("slot", 0))),
    ("fork_pages", False, (6, [(("slot", 1), ("slot", ("slot", 0)), ("valid", 0.8))])),
    ("reserve", False, [(("slot", 1), ("raw", 3)), (("slot", 0), ("raw", 3))]),
    ("append_all", False, [(("slot", 0), FILL), (("slot", 1), FILL)]),
    ("hold_pages", True, [(("mapped", 0), ("raw", S)), (("free", 0), ("raw", 1))]),  # already held; free
    ("drop_pages", True, [("held", 1), ("held", 1), ("free", 0)]),  # a hold dropped twice; a page not held
    ("fork_pages", True, (3, [(("slot", 2), ("pages", [("held", 0), ("held", 0)]), ("raw", 8))])),  # a page twice
    ("release", False, [("slot", 0), ("slot", 1)]),
]
# Each refusal of the prefix ops, one at a time (the bugs injected to check this test catch them).
PREFIX_REFUSALS = [
    ("reserve", False, [(("slot", 0), ("raw", 6))]),
    ("append", False, [("raw", 0), [(("slot", 0), ("raw", 6))]]),
    ("append", False, [("raw", 1), [(("slot", 0), ("raw", 3))]]),  # layer 1 is 3 tokens behind layer 0
    ("hold_pages", True, [(("mapped", 0), ("raw", 4)), (("mapped", 1), ("raw", 1))]),  # unwritten at layer 1
    ("append", False, [("raw", 1), [(("slot", 0), ("raw", 3))]]),
    ("hold_pages", False, [(("mapped", 0), ("raw", 4)), (("mapped", 1), ("raw", 2))]),
    ("fork_pages", True, (6, [(("slot", 1), ("pages", [("mapped", 0), ("mapped", 1)]), ("raw", 7))])),  # past the hold
    ("fork_pages", True, (3, [(("slot", 2), ("pages", [("mapped", 0), ("mapped", 0)]), ("raw", 8))])),  # a page twice
    ("reserve", False, [(("slot", 0), ("raw", 2))]),  # copies the held page: its 2 new positions are pending
    ("hold_pages", True, [(("mapped", 1), ("raw", 2))]),  # 2 written tokens, but pending writes behind them
    ("drop_pages", True, [("held", 0), ("held", 0)]),
]
# The review's holes, in a user's jit: a duplicate release after a fork, an overflowing reservation,
# a fork onto itself and from an idle slot, negative and out-of-range appends, attend before append.
REVIEW_HOLES = [
    ("reserve", False, [(("slot", 0), ("raw", 6))]),
    ("append_all", False, [(("slot", 0), FILL)]),
    ("fork", True, [(("slot", 0), ("slot", 1))]),
    ("release", True, [("slot", 1), ("slot", 1)]),
    ("reserve", True, [(("slot", 0), ("raw", INT32_MAX)), (("slot", 2), ("raw", 3)), (("slot", 2), ("raw", 3))]),
    ("fork", True, [(("slot", 0), ("slot", 0)), (("slot", 3), ("slot", 1))]),
    ("append", True, [("raw", 0), [(("slot", 2), ("raw", -3)), (("slot", 0), ("raw", 2))]]),
    ("append", True, [("raw", L), [(("slot", 2), ("raw", 3))]]),
    ("attend", True, [("raw", 1), [(("slot", 2), ("raw", 3)), (("slot", 0), ("raw", 2))]]),
    ("truncate", True, [(("slot", 0), ("raw", -1)), (("slot", 0), ("raw", 2))]),
]


# (dtype, mode, window) per example.
setup_st = st.sampled_from(DTYPES).flatmap(
    lambda d: st.tuples(st.just(d), st.sampled_from(MODES), st.sampled_from(WINDOWS)) if d == "float32"
    else st.just((d, "jit", None))
)


@pytest.mark.timeout(600)  # ~55 s of CPU unloaded; it passed 300 s beside other jobs (docs/testing.md, "Timeouts")
@given(ops=st.lists(op_st, min_size=8, max_size=30), setup=setup_st,
       backend=st.sampled_from(BACKENDS))  # fmt: skip
@example(ops=PREFIX_PARTIAL, setup=("float32", "host", None), backend="reference")
@example(ops=PREFIX_PARTIAL, setup=("float32", "jit", None), backend="reference")
@example(ops=PREFIX_PARTIAL, setup=("int8", "jit", None), backend="pallas")  # held pages keep their scales
@example(ops=PREFIX_PARTIAL, setup=("int8+rot", "jit", None), backend="reference")
@example(ops=PREFIX_REFUSALS, setup=("float32", "jit", None), backend="reference")
@example(ops=PREFIX_REFUSALS, setup=("float32", "host-numpy", None), backend="reference")
@example(ops=COW_STARVED, setup=("float32", "host", None), backend="reference")
@example(ops=COW_STARVED, setup=("float32", "jit", None), backend="pallas")
@example(ops=COW_STARVED, setup=("int8", "jit", None), backend="pallas")  # COW copies the scales
@example(ops=COW_STARVED, setup=("int4+smooth+rot", "jit", None), backend="pallas")  # and an int4 arena's group scales
@example(ops=HOST_ROUND_TRIP, setup=("float32", "host", None), backend="reference")
@example(ops=HOST_ROUND_TRIP, setup=("float32", "jit", None), backend="reference")
@example(ops=HOST_ROUND_TRIP, setup=("int8", "jit", None), backend="pallas")  # host pages carry the scales
@example(ops=HOST_ROUND_TRIP, setup=("int4+smooth+rot", "jit", None), backend="pallas")  # and group scales
@example(ops=REVIEW_HOLES, setup=("float32", "jit", None), backend="reference")
@example(ops=REVIEW_HOLES, setup=("float32", "jit", 3), backend="pallas")
@example(ops=REVIEW_HOLES, setup=("int8", "jit", None), backend="reference")
@example(ops=REVIEW_HOLES, setup=("float32", "host", None), backend="reference")
@example(ops=REVIEW_HOLES, setup=("float32", "host-numpy", None), backend="pallas")
def test_random_operation_sequences_match_model(ops, setup, backend):
    """Every step is checked against the model inside run_ops; at the end nothing may leak (no
    device page, no host page)."""
    dtype, mode, window = setup
    table, host_held = run_ops(ops, mode, backend, window, dtype)
    assert_everything_free(table)
    assert not np.asarray(host_held).any(), "a host page is still held after clearing"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ops,setup", [(COW_STARVED, ("float32", "jit", None)), (PREFIX_PARTIAL, ("int8", "jit", None)),
                                       (HOST_ROUND_TRIP, ("float32", "host", None)), (REVIEW_HOLES, ("float32", "jit", 3)),
                                       (PREFIX_REFUSALS, ("float32", "host-numpy", None))],
                         ids=["cow-starved", "prefix-partial-int8", "host-round-trip", "review-holes", "prefix-refusals"])
def test_run_keeping_reservations_match_model(ops, setup, run_pages):
    """The run-keeping choice of pages (`allocator._run_pages`: the page after a slot's last, the
    first free run for a prefill, the lowest free pages) keeps every rule the model checks:
    copy-on-write, forks, the prefix cache's holds, the host tier, refusals, the free stack."""
    dtype, mode, window = setup
    table, host_held = run_ops(ops, mode, "pallas", window, dtype)
    assert_everything_free(table)
    assert not np.asarray(host_held).any(), "a host page is still held after clearing"


@pytest.mark.timeout(600)
@settings(max_examples=max(6, settings().max_examples // 10),
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(op_st, min_size=8, max_size=30), setup=setup_st)
def test_random_sequences_with_run_keeping_reservations_match_model(ops, setup, run_pages):
    """As `test_random_operation_sequences_match_model`, a tenth of its examples, with the
    run-keeping choice of pages (the flag stays set for every example)."""
    dtype, mode, window = setup
    table, host_held = run_ops(ops, mode, "pallas", window, dtype)
    assert_everything_free(table)
    assert not np.asarray(host_held).any(), "a host page is still held after clearing"
