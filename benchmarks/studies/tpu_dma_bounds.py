"""How far fewer DMAs a page could take 8-bit decode attention on a TPU (issue 42, item 2).

    python -m arena_jax.benchmarks.studies.tpu_dma_bounds [--target tpu-v5e] [--variants 4,3,2,1]

Ours issues four DMAs a page at 8-bit pages under 128 keys: K, V and the two scale rows
(pallas_kernels/tpu/attention.py, `start_page`). Whether an arena format with fewer could meet
the issue's bar (issue time <= 1.2x the HBM time of the bytes read, pages >= 32) is a question
about the compiled bundles, answered here without building the format: for each variant, a copy
of this checkout's `pallas_kernels/tpu/attention.py` (in a temporary folder, nothing here
changes) drops DMAs from `start_page` and their waits, reading the dropped buffers' stale VMEM
instead, and `arena-bench kernels --compile-report --only "int8 d128"` runs on it. Every copy
reads a DMA a page in every block (`attention.RUNS` off: the blocks of aligned runs the kernel
now reads one DMA a buffer are the report's "runs" rows):

    4  as built: K, V, K scale row, V scale row
    3  K, V and one scale DMA (as K and V scales in one 1 KiB row would take)
    2  K and V, no scale DMA (the bound for scales gathered ahead of the kernel, or never read)
    1  one DMA a page and nothing else (K, V and scales in one stream: a lower bound)

(A fifth variant, "run", a block's pages as one run, measured in session 34, is now the kernel's
own steady state for such blocks, `attention.start_run`.) None of the copies but 4 computes
correct attention. Their
HBM column is the unmodified kernel's bytes (K, V and scale rows), so "issue / HBM" compares like
with like. Needs a checkout (the kernel's
source beside `benchmarks/`) and libtpu (`scripts/install_tpu_tools.sh`); ~2 minutes a variant
per target on a 2-core CPU. Results: benchmarks/RESULTS.md, "How far fewer DMAs a page can take
int8 at pages 32 and 64" and "A block's pages as one run".
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

__all__ = ["PATCHES", "patched", "run", "main"]

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
KERNEL = "pallas_kernels/tpu/attention.py"

# Text replacements a variant makes in KERNEL, in order (each must match exactly once).
_NO_V_SCALE = [
    ("            pltpu.make_async_copy(vs_hbm.at[src], scale_dst(vsbuf[slot], p, page_size), sem.at[slot]).start()\n", ""),
    ("for buf in (kbuf, vbuf) + ((ksbuf, vsbuf) if quantized else ()):", "for buf in (kbuf, vbuf) + ((ksbuf,) if quantized else ()):"),
    ("for buf in (ksbuf, vsbuf):", "for buf in (ksbuf,):"),
    ("vs_row = scale_row(vsbuf[slot], shifts, page_size, run, offset)", "vs_row = scale_row(ksbuf[slot], shifts, page_size, run, offset)"),
    ("vs = scale_row(vsbuf[slot], shifts, page_size, run, offset)", "vs = scale_row(ksbuf[slot], shifts, page_size, run, offset)"),
]
_NO_K_SCALE = [
    ("            pltpu.make_async_copy(ks_hbm.at[src], scale_dst(ksbuf[slot], p, page_size), sem.at[slot]).start()\n", ""),
    ("for buf in (kbuf, vbuf) + ((ksbuf,) if quantized else ()):", "for buf in (kbuf, vbuf):"),
    ("                if quantized:\n                    for buf in (ksbuf,):", "                if False:\n                    for buf in (ksbuf,):"),
]
_NO_V = [
    ("        pltpu.make_async_copy(v_hbm.at[flat], vbuf[slot].at[dst], sem.at[slot]).start()\n", ""),
    ("        for buf in (kbuf, vbuf):\n            whole = buf[slot]", "        for buf in (kbuf,):\n            whole = buf[slot]"),
    ("                for buf in (kbuf, vbuf):\n                    one_page", "                for buf in (kbuf,):\n                    one_page"),
]
_PAGES_ONLY = [("RUNS = True  #", "RUNS = False  #")]
PATCHES = {4: _PAGES_ONLY, 3: _PAGES_ONLY + _NO_V_SCALE, 2: _PAGES_ONLY + _NO_V_SCALE + _NO_K_SCALE,
           1: _PAGES_ONLY + _NO_V_SCALE + _NO_K_SCALE + _NO_V}


def patched(source: str, dmas: int) -> str:
    """KERNEL's source with the variant's DMAs a page (`PATCHES`); a ValueError if an anchor does
    not match exactly once (the kernel changed: the study must follow it)."""
    for old, new in PATCHES[dmas]:
        if source.count(old) != 1:
            raise ValueError(f"variant {dmas}: {old.strip()[:70]!r} matches {source.count(old)} times in {KERNEL}")
        source = source.replace(old, new)
    return source


def _copy_checkout(dst: pathlib.Path) -> None:
    for name in ("arena_jax", "pallas_kernels", "benchmarks", "models", "server"):
        shutil.copytree(CHECKOUT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))


def run(target: str = "tpu-v5e", variants=(4, 3, 2, 1), log=print) -> list[dict]:
    """Rows {dmas, case, bundles, issue_over_hbm} for "ours int8 d128 p*" of each variant."""
    if not (CHECKOUT / KERNEL).is_file():
        raise SystemExit(f"tpu_dma_bounds needs a checkout: {CHECKOUT / KERNEL} is not there")
    source = (CHECKOUT / KERNEL).read_text()
    rows = []
    for dmas in variants:
        with tempfile.TemporaryDirectory() as tmp:
            tree = pathlib.Path(tmp)
            _copy_checkout(tree)
            (tree / KERNEL).write_text(patched(source, dmas))
            env = dict(os.environ, JAX_PLATFORMS="cpu", COLUMNS="250", PYTHONPATH=str(tree))
            out = subprocess.run([sys.executable, "-m", "arena_jax.benchmarks", "kernels", "--compile-report",
                                  "--target", target, "--only", "int8 d128"],
                                 cwd=tree, env=env, capture_output=True, text=True, check=True).stdout  # fmt: skip
        for line in out.splitlines():
            cells = re.split(r"\s{2,}", line.strip())
            if cells[0].startswith("ours int8 d128 p") and len(cells) > 9:  # variant, bundles/iter, ..., issue/HBM (9th)
                row = dict(dmas=dmas, case=cells[0].removeprefix("ours "), bundles=int(cells[1]),
                           dmas_per_page=float(cells[5]), issue_over_hbm=float(cells[9]))  # fmt: skip
                rows.append(row)
                log(f"| {target} | {dmas} | {row['case']} | {row['bundles']} | {row['dmas_per_page']:.2f} "
                    f"| {row['issue_over_hbm']:.2f} |")  # fmt: skip
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.studies.tpu_dma_bounds",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--target", default="tpu-v5e", help="tpu-v5e or tpu-v6e (default: tpu-v5e)")
    p.add_argument("--variants", default="4,3,2,1", help="DMAs a page to keep (4, 3, 2, 1), comma-separated (default: 4,3,2,1)")
    a = p.parse_args(argv)
    variants = tuple(int(v) if v.isdigit() else v for v in a.variants.split(",") if v)  # (a non-digit is refused below)
    if not variants or any(v not in PATCHES for v in variants):
        p.error(f"--variants: each of {', '.join(map(str, PATCHES))}, got {a.variants!r}")
    print("| target | DMAs a page kept | case | bundles an iteration | DMAs a page (report) | issue / HBM |")
    print("|---|---:|---|---:|---:|---:|")
    run(a.target, variants)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
