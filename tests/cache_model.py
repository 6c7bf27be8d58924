"""A plain-Python account of the cache's rules, independent of its arrays: the oracle of the
model-based tests (`test_allocator_model.py`).

Slots hold page *objects* (shared by forks, replaced by copy-on-write) and, per layer, the ids
of the tokens written there. The cache itself may hold pages too (the prefix cache's holds):
`held` maps a page object to the ids of the tokens held in it per layer, one more holder of
the page. Every op takes arbitrary rows, classifies each exactly as the documented rules say
(pad / rejected / served or refused) and returns what the cache must answer; `host_error` says
whether the host checks must raise instead. The page ops (`hold_pages`, `drop_pages`,
`fork_pages`) name physical pages: a `resolve(page) -> object | None` (None: a free page)
turns them into the model's objects. The host tier (`host`: host page id -> the ids of the
tokens it holds per layer) is addressed by id directly: `swap_out`, `swap_in`,
`offload_pages`, `drop_host_pages` (`arena_jax.host.ops` has the rules mirrored here).
"""
from __future__ import annotations

import collections

import ml_dtypes
import numpy as np

PAD = -1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
OP_COUNTS: collections.Counter = collections.Counter()  # ops run per mode (and 8-bit arena dtype), reported after the session
HOST_SERVED: collections.Counter = collections.Counter()  # host-tier rows served / refused, reported after the session


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def numpy_quantize(x, dtype: str, scale_dtype: str = "float32"):
    """8-bit rows as `pallas_kernels.quant` documents them, written again with numpy and
    ml_dtypes (np.rint rounds ties to even): x [..., D] -> (values [..., D], scale [...])."""
    x = np.asarray(x, np.float32)
    qmax = np.float32(QMAX[dtype])
    absmax = np.abs(x).max(axis=-1)
    finite = np.isfinite(x).all(axis=-1)
    live = finite & (absmax >= np.float32(2.0**-64))
    scale = np.where(live, absmax * np.float32(1 / qmax), np.float32(0)).astype(np.float32)
    scale = np.where(finite, scale, np.nan).astype(ml_dtypes.bfloat16 if scale_dtype == "bfloat16" else np.float32)
    stored = scale.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(live, np.float32(1) / np.where(live, stored, 1), 0).astype(np.float32)
        y = np.clip(x * inv[..., None], -qmax, qmax)
    y = np.where(live[..., None], y, 0)  # a non-finite row stores zeros (and a NaN scale)
    values = np.rint(y).astype(np.int8) if dtype == "int8" else y.astype(getattr(ml_dtypes, dtype))
    return values, scale


def numpy_quantize4(x, scale_dtype: str = "bfloat16"):
    """int4 rows as `pallas_kernels.quant4` documents them, again with numpy and ml_dtypes:
    x [..., D] -> (packed uint8 [..., D / 2], scales [..., D / 32]). Groups of 32 lanes, codes
    rint(x / scale) clipped to [-7, 7]; byte 16 g + j = lane 32 g + j (low nibble) | lane
    32 g + 16 + j (high nibble); a non-finite lane anywhere makes every group's scale NaN."""
    x = np.asarray(x, np.float32)
    g = x.reshape(*x.shape[:-1], -1, 32)
    absmax = np.abs(g).max(axis=-1)
    finite = np.isfinite(x).all(axis=-1)[..., None]
    live = finite & (absmax >= np.float32(2.0**-64))
    scale = np.where(live, absmax * np.float32(1 / 7), np.float32(0)).astype(np.float32)
    scale = np.where(finite, scale, np.nan).astype(ml_dtypes.bfloat16 if scale_dtype == "bfloat16" else np.float32)
    stored = scale.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(live, np.float32(1) / np.where(live, stored, 1), 0).astype(np.float32)
        y = np.clip(g * inv[..., None], -7, 7)
    codes = np.rint(np.where(live[..., None], y, 0)).astype(np.int64)  # [..., G, 32]
    nib = codes & 15
    packed = (nib[..., :16] | (nib[..., 16:] << 4)).astype(np.uint8)
    return packed.reshape(*x.shape[:-1], x.shape[-1] // 2), scale


def numpy_key_factors(keys, max_exponent: int = 6):
    """Smoothed keys' factors as `arena_jax.key_factors` documents them, again with numpy: the
    keys a write stores, [n, H, D] -> f32[H, D]. Per head and channel: amax of the finite |k|;
    ratio to the lower median amax (sorted element (D - 1) // 2; a median of 0 or not finite:
    ratio 1); 2 ** (how many of 2, 8, 32, ... the ratio reaches); 0 (nothing to calibrate on)
    for a head whose finite keys are all zero."""
    k = np.asarray(keys, np.float32).reshape(-1, *np.shape(keys)[-2:])
    amax = np.where(np.isfinite(k), np.abs(k), np.float32(0)).max(axis=0, initial=np.float32(0))  # [H, D]
    median = np.sort(amax, axis=-1)[:, (amax.shape[-1] - 1) // 2][:, None]
    ok = np.isfinite(median) & (median > 0)
    ratio = np.where(ok, amax / np.where(ok, median, np.float32(1)), np.float32(1)).astype(np.float32)
    exponent = sum((ratio >= np.float32(2.0 ** (2 * e - 1))).astype(np.int64) for e in range(1, max_exponent + 1))
    return np.where(amax.max(axis=-1, keepdims=True) > 0, 2.0**exponent, 0.0).astype(np.float32)



def numpy_dequantize4(packed, scale):
    """packed uint8 [..., D / 2], scales [..., D / 32] -> float64 [..., D]."""
    b = np.asarray(packed).astype(np.int64).reshape(*packed.shape[:-1], -1, 16)
    lo, hi = b & 15, b >> 4
    codes = np.concatenate([np.where(lo > 7, lo - 16, lo), np.where(hi > 7, hi - 16, hi)], axis=-1)  # [..., G, 32]
    out = codes * np.asarray(scale, np.float64)[..., None]
    return out.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def numpy_rotation(head_dim: int):
    """The rotation as float32 numpy (M with +-1 entries, column scales) and as float64 R = M * col_scale."""
    from pallas_kernels.rotation import rotation

    m, col_scale = rotation(head_dim)
    return m, col_scale, m.astype(np.float64) * col_scale.astype(np.float64)[None, :]


class Slot:
    def __init__(self, num_layers: int):
        self.length = 0  # reserved tokens
        self.pages: list[object] = []
        self.ids: list[list[int]] = [[] for _ in range(num_layers)]  # token ids written per layer

    def copy(self) -> "Slot":
        other = Slot(len(self.ids))
        other.length, other.pages, other.ids = self.length, list(self.pages), [list(x) for x in self.ids]
        return other

    def settled(self) -> bool:
        return all(len(x) == self.length for x in self.ids)


class Held:
    """The cache's hold on a page object: the ids of its first `k` tokens, per layer."""

    def __init__(self, page, ids: list[list[int]]):
        self.page, self.ids = page, ids

    @property
    def k(self) -> int:
        return len(self.ids[0])


class CacheModel:
    def __init__(self, *, num_layers, page_size, num_pages, max_seqs, max_pages_per_seq, host_pages=0):
        self.L, self.S, self.P, self.HP = num_layers, page_size, num_pages, host_pages
        self.max_pages = max_pages_per_seq
        self.host: dict[int, list[list[int]]] = {}  # host page -> token ids per layer (its held tokens)
        self.max_seqs, self.max_len = max_seqs, max_pages_per_seq * page_size
        self.slots: dict[int, Slot] = {}  # the active ones
        self.held: dict[int, Held] = {}  # id(page object) -> the cache's hold
        self.next_id = 0
        self.counters = collections.Counter()

    # ---- helpers ---------------------------------------------------------------------------
    def in_range(self, slot) -> bool:
        return 0 <= slot < self.max_seqs

    def length(self, slot) -> int:
        return self.slots[slot].length if slot in self.slots else 0

    def written(self, layer, slot) -> int:
        return len(self.slots[slot].ids[layer]) if slot in self.slots else 0

    def pages_in_use(self) -> dict[int, object]:
        used = {id(h.page): h.page for h in self.held.values()}
        used.update({id(p): p for s in self.slots.values() for p in s.pages})
        return used

    def mappings(self, page) -> int:
        return sum(1 for s in self.slots.values() for p in s.pages if p is page)

    def holders(self, page) -> int:
        return self.mappings(page) + (id(page) in self.held)

    def fill(self, page) -> tuple[int, list[list[int]]]:
        """The most tokens of `page` a mapping slot has written at every layer, and their ids."""
        best, ids = 0, [[] for _ in range(self.L)]
        for s in self.slots.values():
            settled = min(len(x) for x in s.ids)
            for j, p in enumerate(s.pages):
                n = max(0, min(self.S, settled - j * self.S))
                if p is page and n > best:
                    best, ids = n, [x[j * self.S : j * self.S + n] for x in s.ids]
        return best, ids

    def pending(self, page) -> bool:
        """Some slot has reserved-but-unwritten positions in `page`."""
        for s in self.slots.values():
            settled = min(len(x) for x in s.ids)
            for j, p in enumerate(s.pages):
                if p is page and max(settled, j * self.S) < min(s.length, (j + 1) * self.S):
                    return True
        return False

    def first_occurrences(self, slots) -> list[bool]:
        """Per row: an in-range slot named by no earlier row."""
        seen, out = set(), []
        for slot in slots:
            ok = self.in_range(slot) and slot not in seen
            if self.in_range(slot):
                seen.add(slot)
            out.append(ok)
        return out

    def _bad_ints(self, values, *, counts=False) -> bool:
        return any(not INT32_MIN <= v <= INT32_MAX for v in values) or (
            counts and any(v < 0 or v > self.max_len for v in values)
        )

    def _bad_slots(self, slots, *, unique=True) -> bool:
        live = [s for s in slots if s != PAD]
        return self._bad_ints(slots) or any(not self.in_range(s) for s in live) or (unique and len(set(live)) < len(live))

    # ---- host checks: which inputs must raise ValueError before anything runs -------------------
    def host_error(self, op: str, *args) -> bool:
        if op == "reserve":
            (rows,) = args
            slots, counts = [r[0] for r in rows], [r[1] for r in rows]
            if self._bad_slots(slots) or self._bad_ints(counts, counts=True):
                return True
            return any(self.length(s) + n > self.max_len for s, n in rows if s != PAD)
        if op in ("append", "attend"):
            layer, rows, tokens = args
            slots, counts = [r[0] for r in rows], [r[1] for r in rows]
            if self._bad_slots(slots) or self._bad_ints(counts, counts=True) or self._bad_ints([layer]):
                return True
            if not 0 <= layer < self.L or any(n > tokens for n in counts):
                return True
            if op == "append":  # on the host, tokens past a row's reservation are an error naming reserve
                return any(n > 0 and self.written(layer, s) + n > self.length(s) for s, n in rows if s != PAD)
            return any(n > self.written(layer, s) for s, n in rows if s != PAD)
        if op == "release":
            (slots,) = args
            return self._bad_slots(slots)
        if op == "truncate":
            (rows,) = args
            slots, counts = [r[0] for r in rows], [r[1] for r in rows]
            if self._bad_slots(slots) or self._bad_ints(counts, counts=True):
                return True
            return any(n > self.length(s) for s, n in rows if s != PAD)
        if op == "fork":
            (pairs,) = args
            src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
            if self._bad_slots(src, unique=False) or self._bad_slots(dst):
                return True
            rows = [(s, d) for s, d in pairs if d != PAD]
            if any(s == PAD for s, _ in rows) or {s for s, _ in rows} & {d for _, d in rows}:
                return True
            return any(s not in self.slots or not self.slots[s].settled() for s, _ in rows)
        if op in ("hold_pages", "drop_pages"):
            rows, resolve = args
            pages = [r[0] for r in rows]
            if self._bad_ints(pages) or (op == "hold_pages" and self._bad_ints([r[1] for r in rows])):
                return True
            live = [p for p in pages if p != PAD]
            if any(not 0 <= p < self.P for p in live) or len(set(live)) < len(live):
                return True
            served = self._hold_rows(rows, resolve) if op == "hold_pages" else self._drop_rows(pages, resolve)
            return any(p != PAD and not ok for p, ok in zip(pages, served))
        if op in ("swap_out", "swap_in", "offload_pages", "drop_host_pages"):
            return self._host_tier_error(op, *args)
        if op == "fork_pages":
            rows, width, resolve = args
            dst, counts = [r[0] for r in rows], [r[2] for r in rows]
            entries = [p for r in rows for p in r[1]]
            if self._bad_slots(dst) or self._bad_ints(counts, counts=True) or self._bad_ints(entries):
                return True
            if any(p != PAD and not 0 <= p < self.P for p in entries):
                return True
            served = self._fork_pages_rows(rows, width, resolve)
            return any(d != PAD and not ok for d, ok in zip(dst, served))
        raise ValueError(op)

    # ---- the ops, as they must behave on any input -----------------------------------------
    def reserve(self, rows) -> list[bool]:
        firsts = self.first_occurrences([s for s, _ in rows])
        live = []
        for (slot, n), first in zip(rows, firsts):
            live.append(first and 0 <= n <= self.max_len - self.length(slot))
            if slot != PAD and not live[-1]:
                self.counters["rejected_rows"] += 1
        wants = []
        for (slot, n), ok in zip(rows, live):
            length = self.length(slot)
            last = self.slots[slot].pages[length // self.S] if ok and n > 0 and length % self.S else None
            wants.append(last if last is not None and self.holders(last) > 1 else None)
        free = self.P - len(self.pages_in_use())
        served, cow, running = [], [], 0
        for i, ((slot, n), ok) in enumerate(zip(rows, live)):
            copy = False
            if wants[i] is not None:
                same = [j for j, w in enumerate(wants) if w is wants[i]]
                copy = not (same[0] == i and len(same) == self.holders(wants[i]))
            length = self.length(slot)
            demand = ceil_div(length + n, self.S) - ceil_div(length, self.S) + copy if ok else 0
            running += demand
            served.append(ok and (demand == 0 or running <= free))
            cow.append((copy, demand))
        for i, w in enumerate(wants):  # a keeper is served only if its co-holders are
            if w is not None and not cow[i][0] and any(wants[j] is w and cow[j][0] and not served[j] for j in range(len(rows))):
                served[i] = False
        for i, (slot, n) in enumerate(rows):
            if live[i] and not served[i]:
                self.counters["failed_reservations"] += 1
            if not served[i]:
                continue
            s = self.slots.setdefault(slot, Slot(self.L))
            copy, demand = cow[i]
            if copy:
                s.pages[s.length // self.S] = object()
                self.counters["cow_copies"] += 1
            if n > 0 and demand == 0:
                self.counters["metadata_ops"] += 1
            s.length += n
            while len(s.pages) < ceil_div(s.length, self.S):
                s.pages.append(object())
        return [slot == PAD or ok for (slot, _), ok in zip(rows, served)]

    def append(self, layer, rows, tokens) -> list[list[int] | None]:
        """Per row: the ids written (None if nothing was)."""
        firsts = self.first_occurrences([s for s, _ in rows])
        out = []
        for (slot, n), first in zip(rows, firsts):
            out.append(None)
            if slot == PAD:
                continue
            if not (first and 0 <= layer < self.L and 0 <= n <= tokens):
                self.counters["rejected_rows"] += 1
                continue
            s = self.slots.get(slot)
            w = len(s.ids[layer]) if s else 0
            fits = s is not None and n <= s.length - w
            private = fits and all(self.holders(s.pages[p // self.S]) == 1 for p in range(w, w + n))
            if not private:
                self.counters["dropped_writes"] += n > 0
                continue
            ids = list(range(self.next_id, self.next_id + n))
            self.next_id += n
            s.ids[layer].extend(ids)
            if layer == 0:
                self.counters["tokens_written"] += n
            out[-1] = ids
        return out

    def attend_rows(self, layer, rows, tokens) -> list[int]:
        """Per row: the number of query tokens answered (0: the row gives zeros)."""
        out = []
        for slot, n in rows:
            good = self.in_range(slot) and 0 <= layer < self.L and 0 <= n <= tokens and n <= self.written(layer, slot)
            out.append(n if good else 0)
        return out

    def release(self, slots) -> None:
        for slot, first in zip(slots, self.first_occurrences(slots)):
            if first:
                self.slots.pop(slot, None)
            elif slot != PAD:
                self.counters["rejected_rows"] += 1

    def truncate(self, rows) -> None:
        for (slot, n), first in zip(rows, self.first_occurrences([s for s, _ in rows])):
            if not (first and 0 <= n <= self.length(slot)):
                self.counters["rejected_rows"] += slot != PAD
                continue
            self.counters["metadata_ops"] += n < self.length(slot)  # a truncate that changes nothing counts nothing
            if slot in self.slots:
                s = self.slots[slot]
                s.length, s.pages = n, s.pages[: ceil_div(n, self.S)]
                s.ids = [x[:n] for x in s.ids]

    def fork(self, pairs) -> None:
        dst_first = self.first_occurrences([d for _, d in pairs])
        is_dst = {d for (_, d), f in zip(pairs, dst_first) if f}
        is_src = {s for s, d in pairs if self.in_range(s) and d != PAD}
        served = []
        for (src, dst), first in zip(pairs, dst_first):
            ok = (
                first and self.in_range(src) and src in self.slots and self.slots[src].settled()
                and src not in is_dst and dst not in is_src
            )  # fmt: skip
            served.append(ok)
            if dst != PAD and not ok:
                self.counters["rejected_rows"] += 1
        copies = {dst: self.slots[src].copy() for (src, dst), ok in zip(pairs, served) if ok}
        for dst, slot in copies.items():
            self.slots[dst] = slot
            self.counters["metadata_ops"] += 1

    # ---- the prefix cache's holds -------------------------------------------------------------
    def _first_pages(self, pages) -> list[bool]:
        seen, out = set(), []
        for p in pages:
            ok = 0 <= p < self.P and p not in seen
            if 0 <= p < self.P:
                seen.add(p)
            out.append(ok)
        return out

    def _hold_rows(self, rows, resolve) -> list[bool]:
        out = []
        for (p, k), first in zip(rows, self._first_pages([r[0] for r in rows])):
            obj = resolve(p) if first else None
            ok = obj is not None and id(obj) not in self.held and not self.pending(obj) and 1 <= k <= self.fill(obj)[0]
            out.append(ok)
        return out

    def hold_pages(self, rows, resolve) -> None:
        """rows: (physical page, tokens to hold)."""
        served = self._hold_rows(rows, resolve)
        for (p, k), ok in zip(rows, served):
            if ok:
                obj = resolve(p)
                self.held[id(obj)] = Held(obj, [x[:k] for x in self.fill(obj)[1]])
                self.counters["pages_held"] += 1
            elif p != PAD:
                self.counters["rejected_rows"] += 1

    def _drop_rows(self, pages, resolve) -> list[bool]:
        return [first and resolve(p) is not None and id(resolve(p)) in self.held for p, first in zip(pages, self._first_pages(pages))]

    def drop_pages(self, pages, resolve) -> None:
        for p, ok in zip(pages, self._drop_rows(pages, resolve)):
            if not ok:
                self.counters["rejected_rows"] += p != PAD
                continue
            obj = self.held.pop(id(resolve(p))).page
            self.counters["holds_dropped"] += 1
            if not self.mappings(obj):
                self.counters["pages_evicted"] += 1

    def _fork_pages_rows(self, rows, width, resolve) -> list[bool]:
        out = []
        for (dst, pages, n), first in zip(rows, self.first_occurrences([r[0] for r in rows])):
            ok = first and 0 <= n <= width * self.S
            used = pages[: ceil_div(n, self.S)] if ok else []
            for j, p in enumerate(used):
                obj = resolve(p) if 0 <= p < self.P else None
                take = min(self.S, n - j * self.S)
                ok = ok and obj is not None and id(obj) in self.held and self.held[id(obj)].k >= take
            out.append(ok and len(set(used)) == len(used))
        return out

    def fork_pages(self, rows, width, resolve) -> None:
        """rows: (dst slot, physical pages [width], tokens)."""
        served = self._fork_pages_rows(rows, width, resolve)
        made = {}
        for (dst, pages, n), ok in zip(rows, served):
            if not ok:
                self.counters["rejected_rows"] += dst != PAD
                continue
            slot = Slot(self.L)
            slot.length = n
            for j, p in enumerate(pages[: ceil_div(n, self.S)]):
                hold = self.held[id(resolve(p))]
                slot.pages.append(hold.page)
                take = min(self.S, n - j * self.S)
                for layer in range(self.L):
                    slot.ids[layer].extend(hold.ids[layer][:take])
            made[dst] = slot
            self.counters["metadata_ops"] += 1
            self.counters["prefix_forks"] += 1
            self.counters["prefix_tokens"] += n
        self.slots.update(made)  # each dst released first

    # ---- the host tier -------------------------------------------------------------------------
    def _host_in_range(self, hp) -> bool:
        return 0 <= hp < self.HP

    def _bad_host_pages(self, values, *, unique: bool) -> bool:
        live = [v for v in values if v != PAD]
        return self._bad_ints(values) or any(not self._host_in_range(v) for v in live) or (unique and len(set(live)) < len(live))

    def _host_tier_error(self, op, *args) -> bool:
        if op == "swap_out":
            (rows,) = args  # (slot, host pages [width])
            slots = [r[0] for r in rows]
            if self._bad_slots(slots) or self._bad_host_pages([p for r in rows for p in r[1]], unique=False):
                return True
            used = []
            for slot, hps in rows:
                if slot == PAD:
                    continue
                if slot not in self.slots or not self.slots[slot].settled():
                    return True
                need = ceil_div(self.slots[slot].length, self.S)
                if need > len(hps) or any(p == PAD or p in self.host for p in hps[:need]):
                    return True
                used += hps[:need]
            return len(set(used)) < len(used)
        if op == "swap_in":
            rows, width = args  # (dst, host pages [width], tokens)
            dst, counts = [r[0] for r in rows], [r[2] for r in rows]
            if self._bad_slots(dst) or self._bad_ints(counts, counts=True):
                return True
            if self._bad_host_pages([p for r in rows for p in r[1]], unique=False):
                return True
            used = []
            for slot, hps, n in rows:
                if slot == PAD:
                    continue
                s = self.slots.get(slot)
                if s is not None and (not s.settled() or s.length % self.S):
                    return True
                if n > width * self.S or self.length(slot) + n > self.max_len:
                    return True
                for j, p in enumerate(hps[: ceil_div(n, self.S)]):
                    if p == PAD or len(self.host.get(p, [[]])[0]) < min(self.S, n - j * self.S):
                        return True
                    used.append(p)
            return len(set(used)) < len(used)
        if op == "offload_pages":
            rows, resolve = args  # (device page, host page)
            pages, hps = [r[0] for r in rows], [r[1] for r in rows]
            live = [p for p in pages if p != PAD]
            if self._bad_ints(pages) or any(not 0 <= p < self.P for p in live) or len(set(live)) < len(live):
                return True
            if self._bad_host_pages(hps, unique=True):
                return True
            for p, hp in rows:
                if p != PAD and (resolve(p) is None or id(resolve(p)) not in self.held or hp == PAD or hp in self.host):
                    return True
            return False
        (hps,) = args  # drop_host_pages
        return self._bad_host_pages(hps, unique=True) or any(p != PAD and p not in self.host for p in hps)

    def swap_out(self, rows) -> list[bool]:
        """rows: (slot, host pages [width]). Per row: served (or padding)."""
        claimed, served = set(), []
        for (slot, hps), first in zip(rows, self.first_occurrences([r[0] for r in rows])):
            s = self.slots.get(slot) if first else None
            need = ceil_div(s.length, self.S) if s is not None else 0
            entries_ok = True
            for p in hps[:need]:
                ok = self._host_in_range(p) and p not in claimed and p not in self.host
                if self._host_in_range(p):
                    claimed.add(p)
                entries_ok &= ok
            served.append(s is not None and s.settled() and entries_ok)
        for (slot, hps), ok in zip(rows, served):
            if not ok:
                self.counters["rejected_rows"] += slot != PAD
                continue
            s = self.slots.pop(slot)
            for j in range(ceil_div(s.length, self.S)):
                self.host[hps[j]] = [x[j * self.S : (j + 1) * self.S] for x in s.ids]
            self.counters["swap_outs"] += 1
            HOST_SERVED["swap_out"] += 1
            self.counters["pages_to_host"] += ceil_div(s.length, self.S)
        return [slot == PAD or ok for (slot, _), ok in zip(rows, served)]

    def swap_in(self, rows, width) -> list[bool]:
        """rows: (dst, host pages [width], tokens). Per row: served (or padding)."""
        claimed, valid, demands = set(), [], []
        for (slot, hps, n), first in zip(rows, self.first_occurrences([r[0] for r in rows])):
            length = self.length(slot) if first else 0
            n_ok = INT32_MIN <= n <= INT32_MAX and 0 <= n <= width * self.S and n <= self.max_len - length
            count = n if n_ok else 0
            entries_ok = True
            for j in range(ceil_div(count, self.S)) if first else ():
                p, take = hps[j], min(self.S, count - j * self.S)
                ok = self._host_in_range(p) and p not in claimed and p in self.host and len(self.host[p][0]) >= take
                if self._host_in_range(p):
                    claimed.add(p)
                entries_ok &= ok
            s = self.slots.get(slot)
            settled = s is None or (s.settled() and s.length % self.S == 0)
            valid.append(first and settled and n_ok and entries_ok)
            demands.append(ceil_div(count, self.S) if valid[-1] else 0)
        free = self.P - len(self.pages_in_use())
        served, running = [], 0
        for ok, demand in zip(valid, demands):
            running += demand
            served.append(ok and (demand == 0 or running <= free))
        for (slot, hps, n), ok, served_row in zip(rows, valid, served):
            if not ok:
                self.counters["rejected_rows"] += slot != PAD
                continue
            if not served_row:
                self.counters["failed_swaps"] += 1
                HOST_SERVED["swap_in refused (no pages)"] += 1
                continue
            s = self.slots.setdefault(slot, Slot(self.L))
            for j in range(ceil_div(n, self.S)):
                take = min(self.S, n - j * self.S)
                s.pages.append(object())
                for layer in range(self.L):
                    s.ids[layer].extend(self.host[hps[j]][layer][:take])
            s.length += n
            self.counters["swap_ins"] += 1
            HOST_SERVED["swap_in"] += 1
            self.counters["pages_to_device"] += ceil_div(n, self.S)
        return [slot == PAD or ok for (slot, _, _), ok in zip(rows, served)]

    def offload_pages(self, rows, resolve) -> None:
        """rows: (device page, host page)."""
        claimed, served = set(), []
        for (p, hp), first in zip(rows, self._first_pages([r[0] for r in rows])):
            first_use = self._host_in_range(hp) and hp not in claimed
            if p != PAD and self._host_in_range(hp):
                claimed.add(hp)
            obj = resolve(p) if first else None
            served.append(obj is not None and id(obj) in self.held and first_use and hp not in self.host)
        for (p, hp), ok in zip(rows, served):
            if not ok:
                self.counters["rejected_rows"] += p != PAD
                continue
            hold = self.held.pop(id(resolve(p)))
            self.host[hp] = [list(x) for x in hold.ids]
            self.counters["pages_to_host"] += 1
            self.counters["holds_dropped"] += 1
            HOST_SERVED["offload_pages"] += 1
            if not self.mappings(hold.page):
                self.counters["pages_evicted"] += 1

    def drop_host_pages(self, hps) -> None:
        seen = set()
        for p in hps:
            ok = self._host_in_range(p) and p not in seen and p in self.host
            if self._host_in_range(p):
                seen.add(p)
            if ok:
                del self.host[p]
                self.counters["host_pages_dropped"] += 1
                HOST_SERVED["drop_host_pages"] += 1
            else:
                self.counters["rejected_rows"] += p != PAD
