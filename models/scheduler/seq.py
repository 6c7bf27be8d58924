"""`Seq`: one request's record in the scheduler (its prompt, generated tokens and logits, the
tokens whose K/V are in the cache, its prefix-index and host-tier bookkeeping, its arrival).
It answers "where does this request stand?"; every part of `models.scheduler` reads it.
"""
from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Seq"]


@dataclasses.dataclass
class Seq:
    """One request as the scheduler runs it: its tokens, how many are in the cache, and the
    pages and index nodes it holds (`models.scheduler.admission`, "Admission")."""

    index: int  # position in the prompt list; also keys its random draws
    prompt: list[int]
    generated: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    fed: int = 0  # tokens of prompt + generated whose K/V are in the cache
    admitted: int = -1  # admission order (for last-in-first-out preemption)
    preemptions: int = 0  # times it was preempted (at most once: `models.scheduler.admission`, "Progress")
    # Prefix cache bookkeeping: the deepest index node this sequence locks, how many of its
    # mapped pages are indexed, the partly used hit page its first reserve copies, and how many
    # of its full pages were indexed.
    anchor: object = None
    in_index: int = 0
    cow_node: object = None
    indexed_full: int = 0
    # Swap preemption: the host pages holding its first `fed` tokens while it waits (None: none).
    swapped: list[int] | None = None
    swapped_tokens: int = 0
    lost: int = 0  # tokens it had in the cache when preempted
    arrival: float = 0.0  # seconds after the run's start when it may be admitted (an online workload)
    times: list[float] = dataclasses.field(default_factory=list)  # when each generated token was read back (s after start)
    # Per-request settings (an online engine's requests differ; None: the scheduler's own).
    max_new: int | None = None  # tokens it may generate
    stop: frozenset | None = None  # token ids that end it (kept in its output)
    sampling: tuple | None = None  # (temperature, top_k or 0, top_p): its row's sampling while it runs
    key: int | None = None  # keys its random draws (with the step's seed and position); None: `index`
    speculate: bool = True  # False: decodes without proposals under speculative decoding (an opt-out)
    cancelled: bool = False  # ends at its next read-back (its tokens from then on dropped): `finish` "abort"
    finish: str | None = None  # why it ended: "stop" (a stop token), "length" (max_new), "abort" (cancelled)

    @property
    def draw_key(self) -> int:
        return self.index if self.key is None else self.key

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def pending(self) -> int:
        return len(self.prompt) + len(self.generated) - self.fed
