"""`pallas_kernels.offline.tpu_bundles`: the parser of libtpu's final VLIW bundles, pinned on a
stored dump, and one real capture (ours and JAX's paged_attention compiled for v5e in a child
process with libtpu's dump flags).

tests/data/tpu_final_bundles_small.txt is JAX's `paged_attention` (bf16, page 128, v5e, libtpu
0.0.48.1) cut to 87 of its 695 bundles, most ops dropped, its structure kept: the grid loop
(depth 1, back branch inside, 4 delay slots); the per-block loop (depth 2, rotated: its back
branch printed after it at depth 1, then 4 empty delay slots) with DMA starts and waits, MXU
pushes and matmuls, spills; inside it a loop of 8 trips (depth 3, rotated, a delay slot at depth
3); a bounds check whose comment spans lines and names `dma.hbm_to_vmem` (not a DMA).

The capture test needs libtpu: it skips without it, and fails under CI=true (as
tests/test_compile_tpu.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from pallas_kernels.offline import tpu_bundles as tb
from test_compile_tpu import tooling  # noqa: F401 - the fixture: libtpu present (CI: must be)

SMALL = Path(__file__).parent / "data" / "tpu_final_bundles_small.txt"


@pytest.fixture(scope="module")
def small():
    return tb.parse_bundles(SMALL.read_text())


def test_bundles_comments_and_empty_bundles(small):
    assert len(small) == 87 and sum(1 for b in small if not b.ops) == 9
    assert small[0].address == 0 and small[-1].address == 0x2A4
    by_addr = {b.address: b for b in small}
    assert by_addr[0x13].marker == "LB" and by_addr[0x13].depth == 1
    assert by_addr[0x272].marker == "PF" and by_addr[0x272].depth == 1
    # an empty bundle has no depth marker: it takes the previous bundle's
    assert by_addr[0x6B].depth == 2 and by_addr[0x72].depth == 3 and by_addr[0x26E].depth == 1
    # a comment spanning lines is dropped with the names in it; the bundle stays
    assert by_addr[0x8E].ops == "%2759 = shalt.err (!%p2756_p10)"
    assert sum(b.ops.count("dma.hbm_to_vmem") for b in small) == 16


def test_loops_and_the_per_block_loop(small):
    outer, block, inner = tb.loops(small)
    assert (outer.first, outer.last, outer.depth, outer.bundles) == (0x13, 0x2A2, 1, 81)
    assert (outer.spills, outer.branches, outer.trip) == (14, 9, None)
    # rotated: the back branch at 0x26d (depth 1) and its 4 delay slots belong to the loop
    assert (block.first, block.last, block.depth, block.bundles, block.empty) == (0x40, 0x271, 2, 67, 7)
    assert (block.dma_starts, block.dma_waits, block.mxu_pushes, block.matmuls, block.branches, block.spills) == (
        16, 2, 17, 8, 8, 3)
    assert block.trip is None  # bounded by a register (the page count)
    assert (inner.first, inner.last, inner.depth, inner.bundles, inner.empty, inner.trip) == (0x6D, 0x72, 3, 6, 1, 8)
    assert block.nested == (inner,) and outer.nested == (block,)
    assert tb.block_loop(small) == block


def test_per_iteration_runs_nested_loops_their_trips(small):
    block = tb.block_loop(small)
    assert tb.per_iteration(block) == dict(bundles=67 + 6 * 7, empty=7 + 1 * 7, dma_starts=16, dma_waits=2,
                                                    mxu_pushes=17, matmuls=8, branches=8 + 1 * 7, spills=3, cold=0)
    # a register-bound nested loop is not in the steady-state iteration: its bundles are reported as cold
    dma_loop = tb.LoopFacts(0, 9, 3, 10, 0, 2, 0, 0, 0, 1, 0, trip=None)
    other = tb.LoopFacts(20, 24, 3, 5, 0, 0, 0, 0, 0, 1, 0, trip=None)
    loop = tb.LoopFacts(0, 40, 2, 41, 0, 2, 0, 8, 1, 2, 0, trip=None, nested=(dma_loop, other))
    got = tb.per_iteration(loop)
    assert (got["bundles"], got["dma_starts"], got["branches"], got["cold"]) == (26, 0, 0, 10 + 5)


# A loop whose body the compiler printed with a few lower-depth bundles inside (phi copies), its
# back branch past them; around it a loop with an MXU op of its own (ours: the general step
# around the steady-state loop).
SPLIT_LOOP = """\
  0x1 LB: > { %s1 = sadd.s32 1, %s0 } /* Start region 10 */
  0x2 LB: >> { %v1 = vmatpush.bf16.msra.mxu0 %v0  ;;  %s2 = sadd.s32 1, %s3 } /* Start region 20 :: Start region 21 */
  0x3   : >> { %v2 = vmatmul.bf16.gmra.mxu0 %v1 }
  0x4   : > { %s4 = smov %s2 } /* copy for cssa */
  0x5   : >> { %5 = dma.hbm_to_vmem [thread:$0]  %s4 }
  0x6   : >> { %7 = sbr.rel (%p1_p1) target = $region20 }
  0x7   :  {}
  0x8   :  {}
  0x9   :  {}
  0xa   :  {}
  0xb   : > { %v3 = vmatpush.bf16.msra.mxu0 %v0 }
  0xc   : > { %8 = sbr.rel (%p2_p2) target = $region10 }
  0xd   :  {}
  0xe   :  {}
  0xf   :  {}
  0x10  :  {}
  0x11  :  { %9 = shalt.err (!%p3_p3) }
"""


def test_a_loop_extends_to_its_back_branch_and_the_general_path_around_it():
    bundles = tb.parse_bundles(SPLIT_LOOP)
    assert bundles[1].regions == (20, 21) and bundles[0].regions == (10,) and bundles[2].regions == ()
    outer, inner = tb.loops(bundles)
    # without the back branch's target the inner loop would end at 0x3 (0x4 is printed at depth 1)
    assert (inner.first, inner.last, inner.bundles, inner.dma_starts, inner.branches) == (0x2, 0xA, 9, 1, 1)
    assert (outer.first, outer.last, outer.bundles) == (0x1, 0x10, 16) and outer.nested == (inner,)
    assert tb.block_loop(bundles) == inner
    assert tb.general_path(bundles, inner) == 16 - 9
    # the small dump's grid loop has no MXU op outside its block loop: no general path
    small_bundles = tb.parse_bundles(SMALL.read_text())
    assert tb.general_path(small_bundles, tb.block_loop(small_bundles)) is None


def test_no_loop_with_mxu_ops():
    text = "  0x1 LB: > { %1 = sadd.s32 1, %0 }\n  0x2   : > { %2 = sbr.rel (!%p1) target = $region3 }\n"
    assert tb.block_loop(tb.parse_bundles(text)) is None


def test_every_case_has_a_call():
    """Every listed case compiles a call: ours takes int8 pages under 128 with scale rows
    [L, Hkv, P * S / 128, 128] (`tpu.common.scale_rows`)."""
    labels = [c.label for c in tb.CASES]
    assert len(set(labels)) == len(labels)
    for c in tb.CASES:
        call = tb._case_call(c)
        assert not isinstance(call, str), (c.label, call)
        if c.kernel == "ours" and c.dtype == "int8":
            scale = call[1][3]
            pages = tb.BATCH * (tb.CONTEXT // c.page_size) * tb.ARENA_SPARE
            want = (1, tb.KV_HEADS, pages * c.page_size // 128, 128) if c.page_size < 128 else (1, tb.KV_HEADS, pages, c.page_size)
            assert tuple(scale.shape) == want, (c.label, scale.shape)


def test_every_case_arena_is_past_vmem():
    """Each case's K arena is larger than a v5e / v6e VMEM (128 MiB), as a real arena is: one that
    fits may become a VMEM operand of the call, its page DMAs VMEM-local copies (JAX's int8
    paged_attention did, until session 34: RESULTS.md, "The compile report's arenas in HBM")."""
    import jax
    import numpy as np

    for c in tb.CASES:
        fn, args = tb._case_call(c)
        biggest = max(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(args))
        assert biggest > 128 << 20, (c.label, biggest)


def test_the_table_says_why_a_row_has_no_numbers():
    from arena_jax.benchmarks.compile_report_tpu import format_bundles_table

    row = dict(label="ours int8 d128 p16", status="refused: page_size=16: the TPU kernels take multiples of 128")
    text = format_bundles_table([row], tb.figures("tpu-v5e"))
    assert "clock 1.503 GHz" in text and "HBM 819 GB/s" in text and "cloud.google.com/tpu/docs/v5e" in text
    assert text.splitlines()[-1] == "ours int8 d128 p16  refused: page_size=16: the TPU kernels take multiples of 128"




def test_capture_ours_and_jax_for_v5e(tooling):
    """Ours and JAX's paged_attention, and our mixed call (decode rows + a 128-token chunk): its
    decode loop is the decode call's, bundle for bundle (the same body and tiles), and its chunk
    loop serves the chunk's row block of query tokens an iteration."""
    cases = [tb.BundleCase("ours", "bfloat16", 128), tb.BundleCase("jax", "bfloat16", 128),
             tb.BundleCase("mixed", "bfloat16", 128, chunk=128)]
    ours, jax_row, decode, chunk = tb.capture("tpu-v5e", cases=cases)
    assert [decode.get("part"), chunk.get("part")] == ["decode", "chunk"], (decode, chunk)
    assert decode["status"] == chunk["status"] == "ok" and decode["hlo_name"].startswith("tpu_paged_attention_mixed")
    # the same body and tiles: the same ops an iteration (the scheduler may pack them a few bundles apart)
    same = lambda it: {k: v for k, v in it.items() if k not in ("bundles", "empty", "spills")}  # noqa: E731
    assert same(decode["per_iter"]) == same(ours["per_iter"]) and decode["query_tokens_per_iter"] == 1
    assert decode["per_iter"]["bundles"] == pytest.approx(ours["per_iter"]["bundles"], rel=0.05)
    assert decode["keys_per_iter"] == 1024 and chunk["keys_per_iter"] == 512  # decode's loop: two blocks an iteration
    # a chunk's iteration streams its 128 x 4 query rows through the MXU: more matmul pushes than decode's 4 rows
    assert chunk["query_tokens_per_iter"] == 128 and chunk["per_iter"]["matmuls"] > decode["per_iter"]["matmuls"]
    # ours: two 512-key blocks of all 8 KV heads an iteration of its steady-state loop
    # (`_bk512x2_h8_`); JAX's: 512 keys of one head
    for row, keys, heads in ((ours, 1024, 8), (jax_row, 512, 1)):
        assert row["status"] == "ok", row
        assert row["loop"]["mxu_pushes"] > 0 and row["loop"]["matmuls"] > 0
        assert row["per_iter"]["dma_starts"] > 0 and row["keys_per_iter"] == keys and row["heads_per_iter"] == heads
        assert row["bytes_per_iter"] == keys * heads * 2 * 128 * 2  # K and V, bf16
        assert row["issue_ns"] > 0 and row["hbm_ns"] == pytest.approx(512 * 2 * 128 * 2 / 819e9 * 1e9)
    assert ours["per_iter"]["dma_starts"] == 2 * 2 * 512 // 128  # K and V of each page of both blocks, every head in one
    assert ours["hlo_name"].startswith("tpu_paged_attention_") and "_bk512x2_h8_" in ours["hlo_name"]
    assert jax_row["hlo_name"].startswith("paged_attention")


def test_capture_ours_over_8_bit_scale_rows_has_a_steady_state_for_runs(tooling):
    """int8 pages of 32 (scale rows): two steady-state loops, two rows. Blocks a DMA a page (every
    KV head in each): K, V and both scale rows of each of a block's 16 pages; blocks of aligned runs of pages
    (`attention.start_run`): K, V and the run's scale rows one DMA each, and fewer bytes (the
    run's scale rows hold its pages alone: 4 bytes a key, not a 512-byte row a page)."""
    pages, runs = tb.capture("tpu-v5e", cases=[tb.BundleCase("ours", "int8", 32)])
    assert [pages.get("part"), runs.get("part")] == ["pages", "runs"], (pages, runs)
    assert pages["label"] == "ours int8 d128 p32" and runs["label"] == "ours int8 d128 p32 runs"
    assert pages["hlo_name"] == runs["hlo_name"] and "_runs" in pages["hlo_name"]
    assert pages["per_iter"]["dma_starts"] == 2 * 16 * 4 and runs["per_iter"]["dma_starts"] == 2 * 4
    assert pages["bytes_per_iter"] == 8 * 1024 * 2 * (128 + 512 // 32)  # 8 KV heads
    assert runs["bytes_per_iter"] == 8 * 1024 * 2 * (128 + 4)
    assert runs["per_iter"]["bundles"] < pages["per_iter"]["bundles"]


def test_compile_report_prints_and_saves_the_bundle_rows(tooling, tmp_path, capsys):
    """`arena-bench kernels --compile-report --target tpu-v5e --only <label>`: --only picks bundle rows
    by label too (here no kernel variant matches); the table and the --json file carry them."""
    import json

    from arena_jax.benchmarks import cli

    path = tmp_path / "out.json"
    argv = ["kernels", "--compile-report", "--target", "tpu-v5e", "--only", "jax paged bf16 d128 p128",
            "--no-progress", "--json", str(path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "final bundles per (KV head x 512 keys), ours vs JAX" in out and "jax paged bf16 d128 p128" in out
    res = json.loads(path.read_text())["results"]
    assert res["rows"] == [] and [r["label"] for r in res["bundle_rows"]] == ["jax paged bf16 d128 p128"]
    assert res["bundle_rows"][0]["status"] == "ok" and res["bundle_figures"]["hbm_gb_per_s"] == 819.0

