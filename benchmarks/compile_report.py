"""`arena-bench kernels --compile-report`: static sm_90a facts of every kernel variant, no GPU needed.

For each variant of `pallas_kernels.offline.sm90_variants.CI_VARIANTS` (the matrix the test suite
checks): registers per thread, spill stores/loads, shared memory per CTA, estimated CTAs per
SM (and what limits it), the tensor-core instruction (`wgmma` / `mma`), whether TMA is used,
and the compile time. These are the facts that predict speed before a GPU is available; the
timings themselves still need one (`arena-bench kernels` on a GPU).

Beside them, the experimental Mosaic GPU decode kernel (`pallas_kernels.offline.sm90_mosaic.MOSAIC_VARIANTS`):
lowered for an H100 only. Mosaic GPU makes machine code when the kernel first runs on a GPU,
so its registers and spills are "n/a"; shared memory (Mosaic's plan), wgmma and TMA come from
the lowering on JAX >= 0.11 ("n/a" on 0.10, which dumps nothing).

Needs `bash scripts/install_sm90_tools.sh` and, on a host without a GPU, JAX_PLATFORMS=cpu.
"""
from __future__ import annotations

import time

__all__ = ["run_compile_report", "format_table"]

COLUMNS = (
    ("variant", "variant"),
    ("kernel", "kernel"),
    ("launch", "warps/stages"),
    ("regs", "regs/thr"),
    ("spills", "spill st/ld B"),
    ("smem", "smem B"),
    ("ctas", "CTAs/SM est."),
    ("tc", "tensor cores"),
    ("tma", "TMA"),
    ("seconds", "compile s"),
)


def run_compile_report(*, via: str = "xla", only: str | None = None, progress=None) -> dict:
    """Compile every variant (whose label contains `only`, if given); rows of static facts."""
    import jax

    from pallas_kernels.offline import sm90
    from pallas_kernels.offline.sm90_variants import CI_VARIANTS

    problem = sm90.tooling_problem(via)
    if problem:
        raise RuntimeError(f"cannot compile for sm_90a here: {problem}")
    variants = [v for v in CI_VARIANTS if not only or only in v.label]
    rows, start = [], time.perf_counter()
    for i, variant in enumerate(variants):
        if progress is not None:
            progress(i, len(variants), variant.label)
        t0 = time.perf_counter()
        facts = sm90.compile_call(*variant.call(), via=via)
        seconds = time.perf_counter() - t0
        for f in facts:
            rows.append(dict(
                variant=variant.label, kernel=f.name, launch=f"{f.num_warps}/{f.num_stages}", regs=f.regs,
                spill_stores=f.spill_stores, spill_loads=f.spill_loads, stack=f.stack, smem=f.smem,
                ctas_per_sm=f.ctas_per_sm, limiter=f.limiter, tensor_core=f.tensor_core,
                mma_shapes=list(f.mma_shapes), tma=f.tma, cp_async=f.cp_async, seconds=round(seconds, 2),
                backend="triton", compiled=True,
            ))
    rows += _mosaic_rows(only, progress)
    return dict(
        metadata=dict(jax=jax.__version__, via=via, target="sm_90a (H100)",
                      variants=len(variants) + sum(r["backend"] == "mosaic" for r in rows),
                      wall_s=round(time.perf_counter() - start, 1)),
        rows=rows,
    )


def _mosaic_rows(only, progress) -> list[dict]:
    """The Mosaic GPU decode kernel, lowered (not compiled: see the module docstring)."""
    from pallas_kernels.offline import sm90
    from pallas_kernels.gpu.mosaic_decode import stages
    from pallas_kernels.offline.sm90_mosaic import MOSAIC_VARIANTS, lower_mosaic_call

    rows = []
    for variant in [v for v in MOSAIC_VARIANTS if not only or only in v.label]:
        if progress is not None:
            progress(0, 1, variant.label)
        t0 = time.perf_counter()
        f = lower_mosaic_call(*variant.call())
        smem_ctas = (sm90.SM90["smem_per_sm"] // (f.smem + sm90.SM90["smem_reserved_per_cta"])) if f.smem else None
        rows.append(dict(
            variant=variant.label, kernel=f.name, launch=f"1 WG/{stages(variant.page_size, variant.head_dim)}",
            regs=None, spill_stores=None, spill_loads=None, stack=None, smem=f.smem,
            ctas_per_sm=min(smem_ctas, sm90.SM90["max_ctas_per_sm"]) if smem_ctas else None, limiter="smem",
            tensor_core="wgmma" if f.wgmma else ("n/a" if f.wgmma is None else "none"), mma_shapes=[],
            tma=bool(f.tma_loads) if f.tma_loads is not None else None, cp_async=None,
            seconds=round(time.perf_counter() - t0, 2), backend="mosaic", compiled=False,
        ))
    return rows


def _na(value) -> str:
    return "n/a" if value is None else str(value)


def _cells(row: dict) -> dict:
    if row.get("backend") == "mosaic":
        return dict(
            variant=row["variant"], kernel=row["kernel"], launch=row["launch"], regs="n/a (runtime)", spills="n/a",
            smem=_na(row["smem"]), ctas=f"{row['ctas_per_sm']} (smem)" if row["ctas_per_sm"] else "n/a",
            tc=f"{row['tensor_core']} (lowered)", tma=("yes" if row["tma"] else "no") if row["tma"] is not None else "n/a",
            seconds=f"{row['seconds']:.1f}",
        )
    shape = next(iter(row["mma_shapes"]), "")
    mnk = shape.split(".")[4 if shape.startswith("wgmma") else 3] if shape else ""
    return dict(
        variant=row["variant"],
        kernel=row["kernel"],
        launch=row["launch"],
        regs=str(row["regs"]),
        spills=f"{row['spill_stores']}/{row['spill_loads']}",
        smem=str(row["smem"]),
        ctas=f"{row['ctas_per_sm']} ({row['limiter']})",
        tc=(f"{row['tensor_core']} {mnk}".strip() if row["tensor_core"] != "none"
            else "none (copy)" if row["kernel"].startswith("paged_append") else "none (fp32 FMA)"),
        tma="yes" if row["tma"] else "no",
        seconds=f"{row['seconds']:.1f}",
    )


def format_table(rows: list[dict]) -> str:
    """A plain fixed-width table (copied as is into benchmarks/RESULTS.md)."""
    cells = [_cells(r) for r in rows]
    widths = {k: max(len(h), *(len(c[k]) for c in cells)) for k, h in COLUMNS} if cells else {}
    lines = ["  ".join(h.ljust(widths.get(k, len(h))) for k, h in COLUMNS).rstrip(),
             "  ".join("-" * widths.get(k, len(h)) for k, h in COLUMNS)]
    lines += ["  ".join(c[k].ljust(widths[k]) for k, _ in COLUMNS).rstrip() for c in cells]
    return "\n".join(lines)
