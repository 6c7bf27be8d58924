"""The host-side scheduler of `models.generate`: batch rows, the waiting queue, page accounting,
preemption and (with a prefix index) prefix hits, indexing and eviction. Device work is the
jitted steps of `models.steps`; this package decides what goes into them.

It answers "what goes into the next device step, and for whom?". One idea per module:

    seq.py        `Seq`: one request's record
    readback.py   `fetch`: device arrays back on the host (multi-host too)
    admission.py  admission (FIFO, watermark), preemption, the bound on the loop's steps
    prefix.py     prefix index bookkeeping and the queued page ops (holds, releases, evictions)
    swap.py       the host tier: swap preemption, hits whose tail is on the host
    run_ahead.py  run-ahead decode ("Overlap") and decode blocks (`RunAhead`; `models.decode_ahead`)
    loop.py       `Scheduler`: the loop (prefill, mixed and decode calls, reading results back)

The arrows point down that list: `loop` builds `Scheduler` from the mixins above it, which
share `seq` and `readback`. `models.scheduler.Scheduler`, `.Seq`, `.fetch` and `.RunAhead` are re-exported here.
"""
from arena_jax.models.scheduler.loop import Scheduler
from arena_jax.models.scheduler.readback import fetch
from arena_jax.models.scheduler.run_ahead import RunAhead
from arena_jax.models.scheduler.seq import Seq

__all__ = ["Seq", "Scheduler", "fetch", "RunAhead"]
