"""The scheduler's host tier: swap preemption and the cost model that chooses it.

    result = generate(model, prompts, 64, host_pages=256)                       # swap instead of recompute
    result = generate(model, prompts, 64, host_pages=256, prefix_cache=True)    # prefix cache spills to host
    generate(..., swap_policy=SwapPolicy(bandwidth_bytes_per_s=50e9))           # other constants

Swap or recompute (`SwapPolicy`). A preempted sequence holding t tokens in p pages of
`page_bytes` each either goes to host memory and comes back (2 transfers of p * page_bytes
bytes at `bandwidth_bytes_per_s`) or is recomputed later (t tokens at the prefill rate). It is
swapped when

    2 * p * page_bytes / bandwidth_bytes_per_s  <  t / prefill_tokens_per_s

and there are p free host pages; else it is recomputed. A prefix hit whose tail is in host
pages takes that tail back (1 transfer) when `p * page_bytes / bandwidth < t / rate`, else the
hit is cut to its device pages and the tail recomputed. Constants:

  bandwidth_bytes_per_s   25e9: host <-> device over PCIe 4.0 x16 (32 GB/s peak per direction,
                          about 25 GB/s sustained for pinned memory); PCIe 5.0 ~50e9, GH200's
                          NVLink-C2C ~450e9. On a CPU, host and device share DRAM: nothing
                          crosses a bus, so this is a model of the GPU's cost, not a measurement.
  prefill_tokens_per_s    None: measured in the run (prefill tokens computed / seconds of the
                          prefill calls after the first, which compiles); until a call is
                          measured, `default_prefill_tokens_per_s` = 10,000 (an H100 on an 8B
                          model prefills several times that: the default leans to recompute).

For Llama-3-8B in bf16 (131,072 B/token) at 25 GB/s a swapped token costs 2 * 5.2 us = 10.5 us
of transfer, against 100 us of prefill at 10k tokens/s: swap wins by 10x whenever host pages
are free. The policy changes only what is computed, never the tokens (tests check both ways).

Who owns the host pages. Without a prefix cache the scheduler does (`free` below): a swapped-out
sequence holds its pages until it is swapped back in, then they are freed. With a prefix cache
the index does (`PrefixCache(host_pages=N)`): preemption indexes the sequence's pages as
always, eviction spills them to host memory, and the re-admission's hit brings them back.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

import arena_jax as aj
from arena_jax.models.steps import drop_host_page_rows, swap_in_rows, swap_out_rows

__all__ = ["SwapPolicy", "HostTier"]


@dataclasses.dataclass(frozen=True)
class SwapPolicy:
    """Swap or recompute (module docstring): bytes at a bandwidth vs tokens at a prefill rate."""

    bandwidth_bytes_per_s: float = 25e9
    prefill_tokens_per_s: float | None = None  # None: measured in the run
    default_prefill_tokens_per_s: float = 10_000.0

    def __post_init__(self):
        for name in ("bandwidth_bytes_per_s", "default_prefill_tokens_per_s", "prefill_tokens_per_s"):
            value = getattr(self, name)
            if value is None and name == "prefill_tokens_per_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"SwapPolicy.{name} must be a finite positive number, got {value!r}")

    def transfer_seconds(self, num_bytes: int) -> float:
        return num_bytes / self.bandwidth_bytes_per_s

    def recompute_seconds(self, tokens: int, measured_rate: float | None) -> float:
        rate = self.prefill_tokens_per_s or measured_rate or self.default_prefill_tokens_per_s
        return tokens / rate


class HostTier:
    """The host arena a scheduler moves pages to, the policy, and what moved."""

    def __init__(self, host: aj.HostArena, layout: aj.KVLayout, policy: SwapPolicy, owns_pages: bool):
        self.host, self.layout, self.policy = host, layout, policy
        self.free = list(range(host.num_pages - 1, -1, -1)) if owns_pages else None  # pop(): lowest first
        self.swap_outs = self.swapped_tokens = 0
        self.modelled_transfer_s = 0.0  # what the moves would cost at the policy's bandwidth
        self._prefill_tokens, self._prefill_s, self._prefill_calls = 0, 0.0, 0

    @classmethod
    def beside(cls, host, layout: aj.KVLayout, policy: SwapPolicy | None, index) -> "HostTier | None":
        """The tier a scheduler runs with `host` (None: no tier): without a prefix index it owns
        the host pages (swap preemption); with one, the index does (its spill tier)."""
        if host is None:
            return None
        return cls(host, layout, policy or SwapPolicy(), owns_pages=index is None)

    # ---- the cost model ---------------------------------------------------------------------
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill call's computed tokens and wall time (the first call compiles: skipped)."""
        self._prefill_calls += 1
        if self._prefill_calls > 1 and tokens:
            self._prefill_tokens += tokens
            self._prefill_s += seconds

    @property
    def measured_prefill_rate(self) -> float | None:
        return self._prefill_tokens / self._prefill_s if self._prefill_s > 0 else None

    def worth_moving(self, tokens: int, pages: int, transfers: int) -> bool:
        """Moving `pages` pages `transfers` times costs less than recomputing `tokens` tokens."""
        move = transfers * self.policy.transfer_seconds(pages * self.layout.page_bytes)
        return move < self.policy.recompute_seconds(tokens, self.measured_prefill_rate)

    def count_move(self, pages: int) -> None:
        self.modelled_transfer_s += self.policy.transfer_seconds(pages * self.layout.page_bytes)

    # ---- swap preemption (no prefix cache: the scheduler owns the host pages) ----------------------
    def swap_out(self, cache, slot: int, tokens: int, batch: int):
        """Swap a settled slot's `tokens` tokens out, if the policy and the free host pages allow.
        Returns (cache, host pages) or (cache, None) when the sequence should be recomputed."""
        pages = self.layout.pages_for(tokens)
        if self.free is None or not tokens or pages > len(self.free) or not self.worth_moving(tokens, pages, 2):
            return cache, None
        taken = [self.free.pop() for _ in range(pages)]
        slots = np.full((batch,), aj.PAD_SLOT, np.int32)
        rows = np.full((batch, self.layout.max_pages_per_seq), aj.PAD_PAGE, np.int32)
        slots[0], rows[0, :pages] = slot, taken
        cache, self.host = swap_out_rows(cache, self.host, jnp.asarray(slots), jnp.asarray(rows))
        self.swap_outs += 1
        self.swapped_tokens += tokens
        self.count_move(pages)
        return cache, taken

    def swap_in(self, cache, rows: list[tuple[int, list[int], int]], batch: int):
        """Bring rows (dst slot, host pages, tokens) back into their slots (appended after what the
        slot holds). Returns (cache, ok bool[batch] on the device: rows past len(rows) are padding)."""
        dst = np.full((batch,), aj.PAD_SLOT, np.int32)
        pages = np.full((batch, self.layout.max_pages_per_seq), aj.PAD_PAGE, np.int32)
        counts = np.zeros((batch,), np.int32)
        for b, (slot, host_pages, tokens) in enumerate(rows):
            dst[b], counts[b] = slot, tokens
            pages[b, : len(host_pages)] = host_pages
        cache, self.host, ok = swap_in_rows(cache, self.host, jnp.asarray(pages), jnp.asarray(counts), jnp.asarray(dst))
        self.count_move(sum(-(-tokens // self.layout.page_size) for _, _, tokens in rows))
        return cache, ok

    def release(self, cache, host_pages: list[int], width: int):
        """Free host pages the scheduler owns (a swapped-in or abandoned sequence's)."""
        for i in range(0, len(host_pages), width):
            part = np.full((width,), aj.PAD_PAGE, np.int32)
            part[: len(host_pages[i : i + width])] = host_pages[i : i + width]
            cache, self.host = drop_host_page_rows(cache, self.host, jnp.asarray(part))
        self.free.extend(reversed(host_pages))
        return cache
