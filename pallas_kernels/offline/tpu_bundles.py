"""Decode attention's inner loop in libtpu's final VLIW bundles: ours beside JAX's own TPU kernels.

libtpu prints the machine code it made for each Mosaic kernel when LIBTPU_INIT_ARGS has
`--xla_jf_dump_to=DIR --xla_jf_dump_llo_text` at the moment libtpu loads (read once per
process): `DIR/<id>-<HLO name>-<pass no.>-final_bundles.txt`, one VLIW bundle a line:

    0x13 LB: > { %s2093_s25 = sadd.s32 4294967295, %s3358_s24  ;;  ... }   /* comment */
    ^addr ^marker ^loop depth (one '>' per enclosing loop)       ^the bundle's ops

Markers: LH loop header, LB loop body (a loop's first bundle), LE loop exit, PB / PF predicated
region body / fallthrough, CT control target. An empty bundle `{}` has no depth marker.

`parse_bundles` reads a file; `block_loop` finds the per-block loop, the innermost loop holding
MXU ops (`vmatpush` / `vmatpush3`, `vmatmul`), and counts its bundles, DMA starts and waits, MXU
pushes, branches and spill references (`LoopFacts`). The count is static: every bundle of the
loop body once, both arms of every branch inside it, so a predicated region taken only on the
last block (the output's write) counts as if it ran every iteration. `per_iteration` runs the
loops nested in it with a constant trip count that many times and leaves register-bound ones
out of the steady-state iteration (`cold`: ours run only in a row's first and last blocks or
a block with a hole). A loop runs to its back branch (a branch to a region its first bundle
starts: `Bundle.regions`), past bundles libtpu prints at a lower depth inside it. Our
kernel's per-block loop is its steady-state loop (blocks every query row sees whole, two an
iteration); `general_path` gives the static bundles around it in the loop that encloses it
and has MXU ops of its own (ours: the two pairs served alone, each the general step or the
fast one).

`capture(target)` compiles the decode cases (`CASES`, Llama-3-8B shape: 32 q heads, 8 KV
heads, batch 8, 4096 keys per row, an arena of 16x the pages those rows map: `ARENA_SPARE`)
for `target` without a TPU, in ONE child process started
with the dump flags (`python -m pallas_kernels.offline.tpu_bundles --target tpu-v5e --json`
runs the same), maps each compile's new `*-final_bundles.txt` files to its case, parses the
kernel's, and returns one plain dict per case, normalized per (KV head x 512 keys):

- ours, `pallas_kernels.tpu.attention.tpu_paged_attention`: one loop iteration is two blocks
  of `block_k` keys of every KV head (`..._bk512x2_h8_...` in the kernel's name: keys a block,
  blocks an iteration, heads a block);
- JAX's `jax.experimental.pallas.ops.tpu.paged_attention` (grid (cores, batch, KV heads), a
  fori_loop over blocks inside, `inline_seq_dim=True`): `pages_per_compute_block * page_size`
  keys of one KV head, `pages_per_compute_block = 512 // page_size`;
- JAX's `ragged_paged_attention`: `num_kv_pages_per_block * page_size` keys of all the KV heads
  of its head block (heads unrolled in the loop body).

The mixed cases (`chunk` > 0: BATCH decode rows and one prompt chunk of `chunk` tokens in one
call) compile ours, `pallas_kernels.tpu.mixed.tpu_paged_attention_mixed`, whose two per-block
loops (`block_loops`, in program order: the decode part's, then the chunk's; the chunk's is its
loop over heads in the fast step, one block of one head an iteration, after the general step's
own loop over heads, which is not reported) give a row each,
and `ragged_paged_attention` on the same tokens packed (`RAGGED_QUERIES_PER_BLOCK` query tokens a
block). A chunk loop's iteration serves `query_tokens_per_iter` query tokens (ours: the chunk's
row block, `_bt<tokens>_`), so compare chunk loops per query token too.

Issue time = loop bundles / clock (one bundle a cycle, no stall); HBM time = the bytes one
iteration reads (K + V of its keys and heads, + scales) / HBM bandwidth; `CHIPS` gives both
figures with their sources.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["CHIPS", "CASES", "Chip", "BundleCase", "Bundle", "LoopFacts", "parse_bundles", "loops", "block_loop",
           "block_loops", "general_path", "per_iteration", "capture", "figures"]

BLOCK_KEYS = 512  # the normalization: per (KV head x 512 keys)


# --- the chips' figures ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Chip:
    clock_hz: float
    hbm_bytes_per_s: float
    clock_source: str
    hbm_source: str


# v5e: https://cloud.google.com/tpu/docs/v5e ("System architecture"): 197 bf16 TFLOP/s per chip,
# HBM2 819 GB/s, one TensorCore with 4 MXUs of 128 x 128. The clock is not published; derived:
# 197e12 / (4 MXUs x 128 x 128 MACs x 2 flops) = 1.503 GHz.
# v6e: https://cloud.google.com/tpu/docs/v6e ("System architecture"): 918 bf16 TFLOP/s per chip,
# HBM 1,640 GB/s (later text of the page: 1638 GBps), MXUs of 256 x 256. The clock is not
# published; derived: 918e12 / (4 x 256 x 256 x 2) = 1.751 GHz. The MXU count is uncertain: one
# version of the page says 4 MXUs, the current one "two 256x256 MXUs", and libtpu's v6e bundles
# address mxu0 and mxu1 only. Two would mean 3.5 GHz (issue times below halved), which fits
# neither the chips' clocks so far nor Google's Trillium announcement (the 4.7x over v5e from
# larger MXUs, 4x, and a higher clock); 4 MXU-equivalents at 1.75 GHz is the reading used.
CHIPS = {
    "tpu-v5e": Chip(clock_hz=197e12 / (4 * 128 * 128 * 2), hbm_bytes_per_s=819e9,
                    clock_source="derived: 197 TFLOP/s / (4 MXU x 128x128 x 2)",
                    hbm_source="cloud.google.com/tpu/docs/v5e"),
    "tpu-v6e": Chip(clock_hz=918e12 / (4 * 256 * 256 * 2), hbm_bytes_per_s=1640e9,
                    clock_source="derived: 918 TFLOP/s / (4 MXU x 256x256 x 2); 2 MXUs would give 3.5 GHz",
                    hbm_source="cloud.google.com/tpu/docs/v6e"),
}


def figures(target: str) -> dict:
    """The clock and bandwidth used for `target`, with their sources (for a table's header)."""
    chip = CHIPS[target]
    return dict(target=target, clock_ghz=round(chip.clock_hz / 1e9, 3), clock_source=chip.clock_source,
                hbm_gb_per_s=round(chip.hbm_bytes_per_s / 1e9, 1), hbm_source=chip.hbm_source)


# --- the parser --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Bundle:
    address: int
    marker: str  # "", "LH", "LB", "LE", "PB", "PF" or "CT"
    depth: int  # loops around it ('>' count; an empty bundle inherits the previous bundle's)
    ops: str  # the bundle's instructions, comments removed ("" for an empty bundle)
    regions: tuple = ()  # the regions its comment starts ("Start region N"): a loop's back branch targets its LB's


_COMMENT = re.compile(r"/\*.*?\*/", re.S)  # a comment may span lines (a bounds check's names its HLO op)
_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(LH|LB|LE|PB|PF|CT)?\s*:\s*(>*)\s*\{(.*)\}\s*$")


_REGION_START = re.compile(r"\bStart region (\d+)")
_ADDRESS = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:LH|LB|LE|PB|PF|CT)?\s*:")


def parse_bundles(text: str) -> list[Bundle]:
    """Every bundle of a `*-final_bundles.txt` dump, in address order."""
    starts: dict[int, tuple] = {}  # address -> regions its line's comments start
    for line in text.splitlines():
        m = _ADDRESS.match(line)
        if m and "Start region" in line:
            starts[int(m.group(1), 0)] = tuple(int(r) for r in _REGION_START.findall(line))
    out = []
    for line in _COMMENT.sub("", text).splitlines():
        m = _BUNDLE.match(line)
        if not m:
            continue
        ops = m.group(4).strip()
        depth = len(m.group(3)) if ops or not out else out[-1].depth
        address = int(m.group(1), 0)
        out.append(Bundle(address=address, marker=m.group(2) or "", depth=depth, ops=ops,
                          regions=starts.get(address, ())))
    return out


@dataclasses.dataclass(frozen=True)
class LoopFacts:
    """One loop's bundles, each counted once (static), nested loops' included."""

    first: int  # address of the loop's first (LB) bundle
    last: int  # address of its last bundle
    depth: int
    bundles: int  # bundles from first to last, the back branch and its delay slots included
    empty: int
    dma_starts: int  # `= dma.hbm_to_vmem`
    dma_waits: int  # `dma.done...`
    mxu_pushes: int  # `vmatpush` (v5e), `vmatpush3` (v6e): weights pushed into an MXU
    matmuls: int  # `vmatmul`
    branches: int  # `sbr.rel`
    spills: int  # references to spill slots (`#allocationN_spill`, SMEM or VMEM)
    trip: int | None = None  # iterations, when the exit test compares with a constant; None: a register
    nested: tuple = ()  # the LoopFacts of the loops directly inside


COUNTED = ("bundles", "empty", "dma_starts", "dma_waits", "mxu_pushes", "matmuls", "branches", "spills")
_COUNTS = {"dma_starts": re.compile(r"=\s*dma\.hbm_to_vmem\b"), "dma_waits": re.compile(r"\bdma\.done\b"),
           "mxu_pushes": re.compile(r"\bvmatpush\d*\b"), "matmuls": re.compile(r"\bvmatmul\b"),
           "branches": re.compile(r"\bsbr\.rel\b"), "spills": re.compile(r"_spill\b")}
_BRANCH = re.compile(r"\bsbr\.rel\s*\((!?)%(p\w+)\)")


def _extent(bundles: list[Bundle], i: int) -> int:
    """Index of the last bundle of the loop whose LB bundle is bundles[i]: the contiguous bundles
    at depth >= d; then, for a rotated loop, its back branch printed right after at depth d - 1
    (`sbr.rel`) and the delay slots behind it (empty, or again at depth >= d). A loop whose
    back branch (an `sbr.rel` to a region its LB bundle starts) lies past that run, after a few
    bundles the compiler printed at a lower depth (phi copies placed inside the loop), extends
    to it: every bundle up to the back branch runs each iteration."""
    d, j = bundles[i].depth, i
    while j + 1 < len(bundles) and bundles[j + 1].depth >= d:
        j += 1
    back = _back_branch(bundles, i)
    if back is not None and back > j:
        j = back
    elif j + 1 < len(bundles) and bundles[j + 1].depth == d - 1 and _BRANCH.search(bundles[j + 1].ops):
        j += 1
    else:
        return j
    while j + 1 < len(bundles) and (not bundles[j + 1].ops or bundles[j + 1].depth >= d):  # the delay slots
        j += 1
    return j


_TARGET = re.compile(r"\bsbr\.rel\b[^;]*?target = \$region(\d+)")


def _back_branch(bundles: list[Bundle], i: int) -> int | None:
    """Index of the last branch to a region that bundles[i] (a loop's LB bundle) starts, looking
    no further than the next loop at the same depth or an outer one (None: no such branch)."""
    regions = set(bundles[i].regions)
    if not regions:
        return None
    d, found = bundles[i].depth, None
    for k in range(i, len(bundles)):
        b = bundles[k]
        if k > i and b.marker in ("LB", "LH") and b.depth <= d:
            break  # another loop at this level: ours ended before it
        if any(int(r) in regions for r in _TARGET.findall(b.ops)):
            found = k
    return found


def _trip(ops: list[str]) -> int | None:
    """Trip count from the loop's back branch `sbr.rel (!%p)`: with `%p = scmp.ge.s32 %i, N` and
    `%i = sadd.s32 1, ...`, N (the index starts at 0); with `%p = pmov 1`, 1. None when the
    bound is a register."""
    branches = [m for o in ops for m in _BRANCH.finditer(o)]
    if not branches or branches[-1].group(1) != "!":
        return None
    pred = branches[-1].group(2)
    text = "\n".join(ops)
    if re.search(rf"%{pred} = pmov 1\b", text):  # a loop of one iteration: the back branch is never taken
        return 1
    m = re.search(rf"%{pred} = scmp\.ge\.s32\.totalorder %(s\w+), (\d+)\b", text)
    if not m or not re.search(rf"%{m.group(1)} = sadd\.s32 1, ", text):
        return None
    return int(m.group(2))


def loops(bundles: list[Bundle]) -> list[LoopFacts]:
    """Every loop (an LB bundle to `_extent`), outermost first, each with its nested loops."""
    spans = [(i, _extent(bundles, i)) for i, b in enumerate(bundles) if b.marker == "LB"]
    facts: dict[int, LoopFacts] = {}
    for i, j in sorted(spans, key=lambda s: -bundles[s[0]].depth):  # innermost first
        d = bundles[i].depth
        inner = [facts[a] for a, b in spans if i < a <= j and bundles[a].depth == d + 1]
        own = [bundles[k].ops for k in range(i, j + 1)
               if not any(lp.first <= bundles[k].address <= lp.last for lp in inner)]
        text = "\n".join(b.ops for b in bundles[i: j + 1])
        facts[i] = LoopFacts(first=bundles[i].address, last=bundles[j].address, depth=d, bundles=j - i + 1,
                             empty=sum(1 for b in bundles[i: j + 1] if not b.ops),
                             **{k: len(p.findall(text)) for k, p in _COUNTS.items()},
                             trip=_trip(own), nested=tuple(inner))
    return [facts[i] for i, _ in spans]


def block_loops(bundles: list[Bundle]) -> list[LoopFacts]:
    """The innermost loops with MXU ops (no loop inside one has any), in program order."""
    mxu = [lp for lp in loops(bundles) if lp.mxu_pushes + lp.matmuls]
    inner = [lp for lp in mxu if not any(o is not lp and lp.first <= o.first and o.last <= lp.last and o.depth > lp.depth
                                         for o in mxu)]
    return sorted(inner, key=lambda lp: lp.first)


def block_loop(bundles: list[Bundle]) -> LoopFacts | None:
    """The per-block loop: the innermost loop with MXU ops; the largest when there are several.
    None when no loop has MXU ops."""
    return max(block_loops(bundles), key=lambda lp: lp.bundles, default=None)


def general_path(bundles: list[Bundle], loop: LoopFacts) -> int | None:
    """Static bundles of the loop around `loop` when that loop has MXU ops of its own: a
    kernel whose steady state is an inner loop of its own (ours) runs its other blocks (a row's
    first and last, the block before a partial one, a prefill chunk's diagonal, a block with a
    hole; in our decode also a run's first pairs, by the fast step) in the enclosing loop's
    body. Counted as `LoopFacts.bundles` are: every bundle once, both arms of each branch, its
    register-bound loops once; `loop` excluded. None when the enclosing
    loop (a grid loop) has no MXU op outside `loop`, or there is none."""
    parents = [lp for lp in loops(bundles) if loop in lp.nested]
    if not parents:
        return None
    parent = parents[0]
    if parent.mxu_pushes + parent.matmuls - sum(c.mxu_pushes + c.matmuls for c in parent.nested) <= 0:
        return None
    return parent.bundles - loop.bundles


def per_iteration(loop: LoopFacts) -> dict:
    """`loop`'s counts per iteration in the steady state: its nested loops with a constant trip
    count run that many times; a loop bounded by a register is counted apart, in `cold` (its
    static bundles, once), not in the iteration: in our kernel those run only in a row's first
    and last blocks (pages partly in range, page-by-page waits, V rows zeroed) or in a block
    with an unmapped page, and an interior block, the steady state at long contexts, runs none.
    (JAX's kernels have no register-bound nested loop here.)"""
    out = {k: getattr(loop, k) - sum(getattr(c, k) for c in loop.nested) for k in COUNTED}
    out["cold"] = 0
    for child in loop.nested:
        sub = per_iteration(child)
        if child.trip is None:
            out["cold"] += sub["bundles"] + sub["cold"]
            continue
        for k in COUNTED:
            out[k] += sub[k] * child.trip
        out["cold"] += sub["cold"]
    return out


# --- the cases ---------------------------------------------------------------------------------------------------
BATCH, Q_HEADS, KV_HEADS, CONTEXT = 8, 32, 8, 4096
# The arena holds this many times the pages the batch maps (16: 512 MiB of int8 K at pages of 64,
# past a v5e / v6e VMEM of 128 MiB), as a real arena (many GiB) does. With one page a mapped
# entry (32-64 MiB an array) XLA placed some of a call's operands in VMEM, whose DMAs then
# compile to VMEM-local copies: JAX's int8 call read its K pages and broadcast K scales from
# VMEM (session 34; RESULTS.md, "The compile report's arenas in HBM").
ARENA_SPARE = 16
KERNEL_NAMES = {"ours": "ours", "jax": "jax paged", "ragged": "jax ragged", "mixed": "ours mixed"}
# HLO name (in the dump file's name) of each kernel's Mosaic call
_HLO_PREFIX = {"ours": "tpu_paged_attention_", "jax": "paged_attention", "ragged": "ragged_paged_attention",
               "mixed": "tpu_paged_attention_mixed"}
CHUNK = 128  # a mixed case's prompt chunk: BATCH decode rows and one chunk of CHUNK tokens in one call
RAGGED_QUERIES_PER_BLOCK = 32  # ragged_paged_attention's query block in the mixed cases


@dataclasses.dataclass(frozen=True)
class BundleCase:
    kernel: str  # "ours" | "jax" (paged_attention) | "ragged" (ragged_paged_attention)
    dtype: str  # the arena's: "bfloat16" | "int8" (q is bfloat16)
    page_size: int
    head_dim: int = 128
    chunk: int = 0  # > 0: a mixed step, BATCH decode rows and one prompt chunk of `chunk` tokens

    @property
    def label(self) -> str:
        dt = {"bfloat16": "bf16", "int8": "int8"}[self.dtype]
        mixed = f" +chunk{self.chunk}" if self.chunk else ""
        return f"{KERNEL_NAMES[self.kernel]} {dt} d{self.head_dim} p{self.page_size}{mixed}"


CASES = tuple(
    [BundleCase(k, "bfloat16", p) for p in (16, 32, 64, 128) for k in ("ours", "jax")]
    + [BundleCase(k, "bfloat16", 128, 256) for k in ("ours", "jax")]
    + [BundleCase(k, "int8", p) for p in (16, 32, 64, 128) for k in ("ours", "jax")]
    + [BundleCase("ragged", "bfloat16", p) for p in (16, 128)]
    + [BundleCase(k, "bfloat16", p, chunk=CHUNK) for p in (16, 128) for k in ("mixed", "ragged")]
    + [BundleCase("mixed", "int8", 32, chunk=CHUNK)]  # its decode part reads runs (`_runs`): three loops
)


def _case_call(case: BundleCase):
    """(fn, ShapeDtypeStruct args) of one decode call at the case's shape, or a refusal string."""
    import jax
    import jax.numpy as jnp

    S = jax.ShapeDtypeStruct
    B, Hq, Hkv, D, page = BATCH, Q_HEADS, KV_HEADS, case.head_dim, case.page_size
    M = CONTEXT // page  # pages per row
    P = B * M * ARENA_SPARE  # pages in the arena (`ARENA_SPARE`)
    dt, i32 = jnp.dtype(case.dtype), jnp.int32
    quantized = dt == jnp.int8
    # Our kernels' 8-bit scales: rows of 128 lanes under pages of 128 (`tpu.common.scale_rows`), else [L, Hkv, P, S]
    scale = S((1, Hkv, P * page // 128, 128) if page < 128 else (1, Hkv, P, page), jnp.float32)
    if case.kernel == "ours":
        from pallas_kernels.tpu.attention import tpu_paged_attention
        from pallas_kernels.tpu.common import tpu_unsupported_reason

        rows = quantized and page < 128  # scales as rows of 128 lanes (`tpu.common.scale_rows`)
        why = tpu_unsupported_reason(head_dim=D, page_size=page, dtype=dt, q_dtype=jnp.bfloat16,
                                     scale_dtype=jnp.float32 if quantized else None, scale_rows=rows)
        if why:
            return why
        q, kv = S((B, 1, Hq, D), jnp.bfloat16), S((1, Hkv, P, page, D), dt)  # q [B, T, Hq, D], arena [L, Hkv, P, S, D]
        if quantized:
            def fn(q, k, v, ks, vs, pm, n, t):
                return tpu_paged_attention(q, k, v, 0, pm, n, t, k_scale=ks, v_scale=vs, interpret=False)
            return fn, (q, kv, kv, scale, scale, S((B, M), i32), S((B,), i32), S((B,), i32))

        def fn(q, k, v, pm, n, t):
            return tpu_paged_attention(q, k, v, 0, pm, n, t, interpret=False)
        return fn, (q, kv, kv, S((B, M), i32), S((B,), i32), S((B,), i32))
    if case.kernel == "jax":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
        from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import QuantizedTensor

        q, kv = S((B, Hq, D), jnp.bfloat16), S((Hkv, P, page, D), dt)  # q [B, Hq, D], pages [Hkv, P, S, D]
        if quantized:  # what quantization_utils.quantize_to_int8 makes of bf16 pages: bf16 scales [Hkv, P, S, 1]
            kv = QuantizedTensor(weight=kv, scales=S((Hkv, P, page, 1), jnp.bfloat16))

        def fn(q, k, v, n, pi):
            return paged_attention(q, k, v, n, pi, pages_per_compute_block=BLOCK_KEYS // page)
        return fn, (q, kv, kv, S((B,), i32), S((B, M), i32))
    if case.kernel == "mixed":  # B decode rows + one chunk of case.chunk tokens, one call
        from pallas_kernels.tpu.mixed import tpu_paged_attention_mixed

        kv = S((1, Hkv, P, page, D), dt)
        rows = (S((B, M), i32), S((B,), i32), S((B,), i32), S((1, M), i32), S((1,), i32), S((1,), i32))
        qs = (S((B, 1, Hq, D), jnp.bfloat16), S((1, case.chunk, Hq, D), jnp.bfloat16))
        if quantized:
            def fn(qd, qp, k, v, ks, vs, pmd, nd, td, pmp, np_, tp):
                return tpu_paged_attention_mixed(qd, qp, k, v, 0, pmd, nd, td, pmp, np_, tp, k_scale=ks, v_scale=vs,
                                                 interpret=False)
            return fn, (*qs, kv, kv, scale, scale, *rows)

        def fn(qd, qp, k, v, pmd, nd, td, pmp, np_, tp):
            return tpu_paged_attention_mixed(qd, qp, k, v, 0, pmd, nd, td, pmp, np_, tp, interpret=False)
        return fn, (*qs, kv, kv, *rows)
    if case.kernel == "ragged":
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

        seqs = B + (1 if case.chunk else 0)  # a mixed case: the chunk is one more sequence
        q = S((B + case.chunk, Hq, D), jnp.bfloat16)  # every sequence's new tokens, packed: [tokens, Hq, D]
        kv = S((P, page, 2 * Hkv, D), dt)  # K and V heads interleaved: [P, S, 2 Hkv, D]

        def fn(q, kv, n, pi, cu, ns):
            return ragged_paged_attention(q, kv, n, pi, cu, ns, sm_scale=D**-0.5,
                                          num_kv_pages_per_block=BLOCK_KEYS // page,
                                          num_queries_per_block=B if not case.chunk else RAGGED_QUERIES_PER_BLOCK)
        return fn, (q, kv, S((seqs,), i32), S((seqs, M), i32), S((seqs + 1,), i32), S((1,), i32))
    raise ValueError(f"kernel={case.kernel!r}")


def _keys_heads(case: BundleCase, hlo_name: str, part: str | None = None) -> tuple[int, int]:
    """(keys, KV heads) one iteration of the case's per-block loop processes (`part`: a mixed
    call's loop, "decode" or "chunk")."""
    if case.kernel in ("ours", "mixed"):
        # keys a block, blocks an iteration of decode's loop, KV heads a block (decode unrolls them;
        # a chunk's innermost loop with MXU ops is its loop over heads, one an iteration)
        m = re.search(r"_bk(\d+)(?:x(\d+))?_(?:h(\d+)_)?", hlo_name)
        if not m:
            raise ValueError(f"kernel name {hlo_name!r} has no _bk<keys>_")
        if part == "chunk":
            return int(m.group(1)), 1
        return int(m.group(1)) * int(m.group(2) or 1), int(m.group(3) or 1)
    if case.kernel == "jax":
        return BLOCK_KEYS // case.page_size * case.page_size, 1
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as ragged

    _, combined = ragged.get_min_heads_per_blk(Q_HEADS, 2 * KV_HEADS, jnp.bfloat16, jnp.dtype(case.dtype))
    return BLOCK_KEYS // case.page_size * case.page_size, combined // 2


def _query_tokens(case: BundleCase, hlo_name: str, part: str | None) -> int:
    """Query tokens one iteration of the loop serves. Decode loops serve one (ragged's query block
    holds a token of each row, and an iteration reads one row's keys); a chunk's loop serves its
    query block: ours `_bt<tokens>_` (the kernel's name), ragged `RAGGED_QUERIES_PER_BLOCK`."""
    if case.kernel == "ragged":
        return RAGGED_QUERIES_PER_BLOCK if case.chunk else 1
    if part == "chunk":
        return int(re.search(r"_bt(\d+)_", hlo_name).group(1))
    return 1


def _bytes_per_key_head(case: BundleCase, part: str | None = None) -> int:
    """HBM bytes of one key of one KV head the kernel reads: K and V rows, and their scales
    (`part` "runs": our blocks of aligned runs of pages, their scale rows whole)."""
    import jax.numpy as jnp

    item = jnp.dtype(case.dtype).itemsize
    row = case.head_dim * item
    if case.dtype == "int8":
        # ours (and our mixed call): f32 per row (pages under 128: the 512-byte scale row a page's
        # DMA moves, 512 / S a row; a run's scale rows hold its pages alone); JAX: bf16 scales
        # broadcast to D
        whole_rows = case.page_size >= 128 or (part or "").endswith("runs")  # "runs", a mixed call's "decode runs"
        row += (4 if whole_rows else 512 // case.page_size) if case.kernel in ("ours", "mixed") else case.head_dim * 2
    return 2 * row


_NAME = re.compile(r"^\d+-(.+)-\d+-final_bundles\.txt$")


def _loop_figures(case: BundleCase, target: str, loop: LoopFacts, keys: int, heads: int, tokens: int,
                  general: int | None = None, part: str | None = None) -> dict:
    """One per-block loop's figures: per iteration, and per (KV head x 512 keys); `tokens`: the
    query tokens an iteration serves (a chunk loop's work grows with them, a decode loop's is one);
    `general`: the enclosing loop's general path (`general_path`), static bundles."""
    pages = keys // case.page_size  # pages of the block (one page holds every head of ragged's head block)
    it = per_iteration(loop)
    chip = CHIPS[target]
    per = keys * heads / BLOCK_KEYS  # (KV head x 512 keys) units per iteration
    nbytes = keys * heads * _bytes_per_key_head(case, part)
    issue_ns, hbm_ns = it["bundles"] / chip.clock_hz * 1e9, nbytes / chip.hbm_bytes_per_s * 1e9
    static = {k: v for k, v in dataclasses.asdict(loop).items() if k != "nested"}
    nested = [dict(first=c.first, bundles=c.bundles, trip=c.trip, dma_starts=c.dma_starts, dma_waits=c.dma_waits)
              for c in loop.nested]
    return dict(loop=static, nested=nested, per_iter=it, general_path_bundles=general, keys_per_iter=keys,
                heads_per_iter=heads, pages_per_iter=pages,
                query_tokens_per_iter=tokens,
                bytes_per_iter=nbytes, bundles_per_512=it["bundles"] / per, dmas_per_page=it["dma_starts"] / pages,
                pushes_per_512=it["mxu_pushes"] / per, issue_ns=issue_ns / per, hbm_ns=hbm_ns / per,
                issue_over_hbm=issue_ns / hbm_ns)  # fmt: skip


def _row(case: BundleCase, target: str, new_files: list[str], dump_dir: str, seconds: float) -> list[dict]:
    """The case's rows: one, or for our mixed call one per part (its per-block loops in program
    order: `_mixed_kernel` runs the decode part's body first, then the chunk's; over 8-bit scale
    rows the decode part's two, pages then runs), or for our decode over 8-bit scale rows that
    reads runs (`_runs` in its name) one per steady state: blocks a DMA a page, then blocks of
    runs of pages (`attention.start_run`)."""
    row = dict(label=case.label, kernel=KERNEL_NAMES[case.kernel], dtype=case.dtype, page_size=case.page_size,
               head_dim=case.head_dim, chunk=case.chunk, compile_s=round(seconds, 1))
    names = {f: _NAME.match(f).group(1) for f in new_files if _NAME.match(f)}
    mine = sorted((n, f) for f, n in names.items() if n.startswith(_HLO_PREFIX[case.kernel]))
    if not mine:
        return [dict(row, status=f"failed: no {_HLO_PREFIX[case.kernel]}* final_bundles among {len(names)} new dumps")]
    hlo_name, path = mine[0]
    with open(os.path.join(dump_dir, path)) as f:
        bundles = parse_bundles(f.read())
    found = block_loops(bundles)
    if not found:
        return [dict(row, status=f"failed: no loop with MXU ops in {hlo_name} ({len(bundles)} bundles)", hlo_name=hlo_name)]
    keys, heads = _keys_heads(case, hlo_name)
    done = dict(row, status="ok", hlo_name=hlo_name, file_bundles=len(bundles))
    runs = re.search(r"_runs(\.\d+)?$", hlo_name)
    if case.kernel == "mixed":  # (a chunk's general step loops over the heads too: its loop is not reported)
        parts = ("decode", "decode runs", "chunk general", "chunk") if runs else ("decode", "chunk general", "chunk")
    else:
        parts = ("pages", "runs") if runs else None
    if parts is None:
        # The steady state: a loop with no register-bound loop inside (ours: the fast loop, which
        # libtpu may lay out apart from the general loop around it; then both are innermost).
        loop = max(found, key=lambda lp: (per_iteration(lp)["cold"] == 0, lp.bundles))
        return [dict(done, **_loop_figures(case, target, loop, keys, heads, _query_tokens(case, hlo_name, None),
                                           general_path(bundles, loop)))]
    if len(found) != len(parts):
        return [dict(row, status=f"failed: {len(found)} loops with MXU ops in {hlo_name}, not {len(parts)} {parts}",
                     hlo_name=hlo_name)]  # fmt: skip
    return [dict(done, label=f"{case.label} {part}" if part != "pages" else case.label, part=part,
                 **_loop_figures(case, target, lp, *_keys_heads(case, hlo_name, part),
                                 _query_tokens(case, hlo_name, part), general_path(bundles, lp), part))
            for part, lp in zip(parts, found) if part != "chunk general"]  # fmt: skip


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _worker(target: str, cases, dump_dir: str) -> None:
    """The child: compile each case, parse its new dumps, print PROGRESS lines and one RESULT line."""
    import jax

    from pallas_kernels.offline import tpu as tpu_compile

    jax.config.update("jax_enable_compilation_cache", False)  # a cache hit would compile nothing, dump nothing
    rows = []
    for i, case in enumerate(cases):
        print(f"PROGRESS {i} {len(cases)} {case.label}", flush=True)
        before = set(os.listdir(dump_dir))
        t0 = time.perf_counter()
        try:
            call = _case_call(case)
            if isinstance(call, str):
                rows.append(dict(label=case.label, kernel=KERNEL_NAMES[case.kernel], dtype=case.dtype,
                                 page_size=case.page_size, head_dim=case.head_dim, status=f"refused: {call}"))
                continue
            fn, args = call
            tpu_compile.compile_for_tpu(fn, args, target=target)
        except Exception as exc:  # noqa: BLE001 - the row says why, in one line
            rows.append(dict(label=case.label, kernel=KERNEL_NAMES[case.kernel], dtype=case.dtype,
                             page_size=case.page_size, head_dim=case.head_dim, status=f"failed: {_one_line(exc)}"))
            continue
        seconds = time.perf_counter() - t0
        new = sorted(set(os.listdir(dump_dir)) - before)
        try:
            rows.extend(_row(case, target, new, dump_dir, seconds))
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(label=case.label, status=f"failed: {_one_line(exc)}"))
        for f in new:  # ~500 files a compile: keep the folder small
            os.remove(os.path.join(dump_dir, f))
    print("RESULT " + json.dumps(rows), flush=True)


def capture(target: str = "tpu-v5e", *, only: str | None = None, cases=None, progress=None,
            timeout_s: float = 3600.0) -> list[dict]:
    """Compile `cases` (default `CASES`; labels containing `only`) for `target` in one child
    process with libtpu's dump flags set, and return one dict per case (`_row`): status "ok"
    with the loop's facts, "refused: <why>" (the kernel takes no such arena), or "failed: <why>"."""
    if target not in CHIPS:
        raise ValueError(f"target={target!r}; expected one of {sorted(CHIPS)}")
    cases = [c for c in (CASES if cases is None else cases) if not only or only in c.label]
    if not cases:
        return []
    dump_dir = tempfile.mkdtemp(prefix="tpu_bundles_")
    env = dict(os.environ)
    env["LIBTPU_INIT_ARGS"] = (env.get("LIBTPU_INIT_ARGS", "") + f" --xla_jf_dump_to={dump_dir} --xla_jf_dump_llo_text").strip()
    env.setdefault("JAX_PLATFORMS", "cpu")  # compile deviceless; never claim a TPU this host may have
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    spec = json.dumps([dataclasses.asdict(c) for c in cases])
    cmd = [sys.executable, "-m", "pallas_kernels.offline.tpu_bundles", "--target", target, "--worker", dump_dir,
           "--cases", spec]
    try:
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
            timer = threading.Timer(timeout_s, proc.kill)  # a hung compile ends the child
            timer.start()
            result = None
            try:
                for line in proc.stdout:
                    if line.startswith("PROGRESS ") and progress is not None:
                        _, i, n, label = line.rstrip("\n").split(" ", 3)
                        progress(int(i), int(n), label)
                    elif line.startswith("RESULT "):
                        result = json.loads(line[len("RESULT "):])
                proc.wait()
            finally:
                timer.cancel()
            if result is None:
                err.seek(0)
                tail = err.read()[-2000:]
                raise RuntimeError(f"the bundle capture for {target} failed (exit {proc.returncode}): {tail}")
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pallas_kernels.offline.tpu_bundles", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="tpu-v5e", choices=sorted(CHIPS))
    ap.add_argument("--only", default=None, help="cases whose label contains this")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON (the default prints one line a row)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the child: the dump folder
    ap.add_argument("--cases", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        cases = [BundleCase(**c) for c in json.loads(args.cases)] if args.cases else list(CASES)
        _worker(args.target, cases, args.worker)
        return 0
    rows = capture(args.target, only=args.only,
                   progress=lambda i, n, label: print(f"[{i + 1}/{n}] {label}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(dict(figures=figures(args.target), rows=rows), indent=1))
    else:
        for r in rows:
            if r["status"] != "ok":
                print(f"{r['label']}: {r['status']}")
            else:
                print(f"{r['label']}: {r['per_iter']['bundles']} bundles an iteration ({r['loop']['bundles']} in the loop) / "
                      f"{r['keys_per_iter']} keys x {r['heads_per_iter']} heads x {r['query_tokens_per_iter']} query tokens, "
                      f"{r['bundles_per_512']:.0f} per (KV head x 512 keys), issue/HBM {r['issue_over_hbm']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
