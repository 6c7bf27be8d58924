"""`arena-bench kernels --compile-report --target tpu-v5e|tpu-v6e`: the TPU kernels (and model steps) compiled without a TPU.

For each variant of `pallas_kernels.offline.tpu_variants.CI_VARIANTS` (compiled with libtpu's XLA and
Mosaic for the target; `pallas_kernels.offline.tpu`): the Mosaic kernels in the module, the VMEM
the compiler gave each (scoped memory), the module's code size, the kernels' DMA plan (their
`CostEstimate` at the variant's workload: every row at the page table's full length), XLA's
cost analysis of the whole module (bytes accessed: the kernels' plan plus everything XLA adds
around them), the bytes the call must move (`kv_bytes`: K/V/scales read by attention, new rows
written by append), and any copy XLA made of an arena-sized array (must be none).

Then decode attention's per-block loop in libtpu's final VLIW bundles, ours beside JAX's own
`paged_attention` and `ragged_paged_attention` (`pallas_kernels.offline.tpu_bundles`, compiled in
one child process with libtpu's dump flags): bundles, DMAs and MXU pushes per (KV head x 512
keys), and issue time (bundles / clock) against the HBM time of the bytes the loop reads.

`--steps` adds the whole model steps of `benchmarks.tpu_steps.STEP_CASES` (Llama-3-8B shape, 32
layers, bf16, sharded over 2x2 / 2x4 meshes, cache donated): per device, XLA's bytes accessed
vs what the step must read (its weights and the KV at full page-table length), whether the
arena is aliased in place, arena copies, code and temp sizes. Static facts; timings need a TPU.

Needs libtpu (`bash scripts/install_tpu_tools.sh`) and, on a host without a TPU, JAX_PLATFORMS=cpu.
"""
from __future__ import annotations

import time

__all__ = ["run_tpu_compile_report", "format_tpu_table", "format_steps_table", "format_bundles_table"]

MIB = 1 << 20


def _kernel_rows(target: str, only: str | None, progress) -> list[dict]:
    from pallas_kernels.offline import tpu as tpu_compile
    from pallas_kernels.offline.tpu_variants import CI_VARIANTS

    variants = [v for v in CI_VARIANTS if not only or only in v.label]
    rows = []
    for i, variant in enumerate(variants):
        if progress is not None:
            progress(i, len(variants), variant.label)
        fn, args, donate = variant.call()
        t0 = time.perf_counter()
        compiled = tpu_compile.compile_for_tpu(fn, args, target=target, donate_argnums=donate)
        seconds = time.perf_counter() - t0
        facts = tpu_compile.module_facts(compiled, big=variant.arena_bytes() // 4)
        plan = sum(int(k.estimate.get("bytes_accessed", 0)) for k in facts.kernels)
        rows.append(dict(
            variant=variant.label, kernels=[k.name.split(".")[0] for k in facts.kernels],
            vmem=[k.vmem_bytes for k in facts.kernels], code_bytes=facts.code_bytes, plan_bytes=plan,
            xla_bytes=facts.bytes_accessed, must_bytes=variant.kv_bytes(), flops=facts.flops,
            arena_copies=len(facts.big_copies), aliased=list(facts.aliased_params), seconds=round(seconds, 2),
        ))
    return rows


def _step_rows(target: str, progress) -> list[dict]:
    import jax
    import numpy as np

    from arena_jax.benchmarks.tpu_steps import STEP_CASES, compile_step, step_inputs
    from pallas_kernels.offline import tpu as tpu_compile

    cases = [c for c in STEP_CASES if c.target == target]
    rows = []
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i, len(cases), case.label)
        t0 = time.perf_counter()
        compiled, cache, layout = compile_step(case)
        seconds = time.perf_counter() - t0
        devices = cache.k.sharding.num_devices
        local = cache.k.sharding.shard_shape(cache.k.shape)
        facts = tpu_compile.module_facts(compiled, big=cache.k.size * cache.k.dtype.itemsize // devices // 4)
        shape = tpu_compile.hlo_shape(cache.k.dtype, local)
        arena_params = facts.params_of_shape(shape)
        # What the step must read per device: its weights and, per layer, the KV of its rows at the
        # page table's full length (the kernels' DMA plan; prefill reads the same pages once per row block).
        mesh = cache.k.sharding.mesh
        dp, tp = mesh.shape["data"], mesh.shape["tensor"]
        _, _, state, _ = step_inputs(case)
        weights = sum(int(np.prod(s.sharding.shard_shape(s.shape))) * s.dtype.itemsize for s in jax.tree.leaves(state))
        context = layout.max_pages_per_seq * layout.page_size
        per_token = layout.bytes_per_token // (2 * layout.num_layers * layout.num_kv_heads)  # one head's K, scales included
        kv = ((case.batch + case.chunks) // dp) * context * (layout.num_kv_heads // tp) * per_token * 2 * case.num_layers  # K and V
        rows.append(dict(
            step=case.label, layers=case.num_layers, kernels=len(facts.kernels), code_bytes=facts.code_bytes,
            temp_bytes=facts.temp_bytes, xla_bytes=facts.bytes_accessed, weights_bytes=weights, kv_bytes=kv,
            arena_aliased=bool(arena_params) and set(arena_params) <= set(facts.aliased_params),
            arena_copies=len(facts.cache_copies(arena_params)),
            weight_copies=len(facts.weight_copies(arena_params)), seconds=round(seconds, 1),
        ))
    return rows


def run_tpu_compile_report(*, target: str = "tpu-v5e", only: str | None = None, steps: bool = False,
                           progress=None) -> dict:
    """Compile every variant (label containing `only`) and, with `steps`, the model steps for `target`."""
    import jax

    from pallas_kernels.offline import tpu as tpu_compile

    problem = tpu_compile.tooling_problem()
    if problem:
        raise RuntimeError(f"cannot compile for {target} here: {problem}")
    from pallas_kernels.offline import tpu_bundles

    start = time.perf_counter()
    rows = _kernel_rows(target, only, progress)
    bundle_rows = tpu_bundles.capture(target, only=only, progress=progress)
    step_rows = _step_rows(target, progress) if steps else []
    import libtpu  # noqa: F401  (version for the record)
    from importlib.metadata import version

    return dict(
        metadata=dict(jax=jax.__version__, libtpu=version("libtpu"), target=target, variants=len(rows),
                      wall_s=round(time.perf_counter() - start, 1)),
        rows=rows, bundle_rows=bundle_rows, bundle_figures=tpu_bundles.figures(target), steps=step_rows,
    )


def _table(columns, cells) -> str:
    widths = {k: max(len(h), *(len(c[k]) for c in cells)) for k, h in columns} if cells else {}
    lines = ["  ".join(h.ljust(widths.get(k, len(h))) for k, h in columns).rstrip(),
             "  ".join("-" * widths.get(k, len(h)) for k, h in columns)]
    lines += ["  ".join(c[k].ljust(widths[k]) for k, _ in columns).rstrip() for c in cells]
    return "\n".join(lines)


def format_tpu_table(rows: list[dict]) -> str:
    columns = (("variant", "variant"), ("vmem", "VMEM KiB"), ("code", "code KiB"), ("plan", "DMA plan MiB"),
               ("xla", "XLA bytes MiB"), ("must", "must move MiB"), ("ratio", "XLA/must"),
               ("copies", "arena copies"), ("seconds", "compile s"))
    cells = [dict(
        variant=r["variant"], vmem="/".join(str(v // 1024) for v in r["vmem"]), code=str(r["code_bytes"] // 1024),
        plan=f"{r['plan_bytes'] / MIB:.1f}", xla=f"{r['xla_bytes'] / MIB:.1f}", must=f"{r['must_bytes'] / MIB:.1f}",
        ratio=f"{r['xla_bytes'] / max(r['must_bytes'], 1):.2f}", copies=str(r["arena_copies"]),
        seconds=f"{r['seconds']:.1f}") for r in rows]
    return _table(columns, cells)


def format_steps_table(rows: list[dict]) -> str:
    columns = (("step", "model step (per device)"), ("kernels", "Mosaic calls"), ("xla", "XLA bytes GiB"),
               ("must", "weights+KV GiB"), ("ratio", "XLA/must"), ("aliased", "arena aliased"),
               ("copies", "arena copies"), ("code", "code MiB"), ("temp", "temp MiB"), ("seconds", "compile s"))
    gib = float(1 << 30)
    cells = [dict(
        step=r["step"], kernels=str(r["kernels"]), xla=f"{r['xla_bytes'] / gib:.2f}",
        must=f"{(r['weights_bytes'] + r['kv_bytes']) / gib:.2f}",
        ratio=f"{r['xla_bytes'] / max(r['weights_bytes'] + r['kv_bytes'], 1):.2f}",
        aliased="yes" if r["arena_aliased"] else "NO", copies=str(r["arena_copies"]),
        code=f"{r['code_bytes'] / MIB:.1f}", temp=f"{r['temp_bytes'] / MIB:.1f}", seconds=f"{r['seconds']:.0f}")
        for r in rows]
    return _table(columns, cells)


def format_bundles_table(rows: list[dict], figures: dict) -> str:
    """Decode attention's per-block loop, per (KV head x 512 keys); a refused or failed case's row says why.
    The mixed cases (decode rows and a prompt chunk in one call: ours, ragged) add the chunk's
    loop, whose iteration serves "q tokens/iter" query tokens (a decode loop's: one a row)."""
    head = (f"decode attention, final bundles per (KV head x 512 keys), ours vs JAX ({figures['target']}: clock "
            f"{figures['clock_ghz']} GHz, {figures['clock_source']}; HBM {figures['hbm_gb_per_s']:g} GB/s, "
            f"{figures['hbm_source']})")
    columns = (("variant", "variant"), ("bundles", "bundles/iter"), ("kh", "keys x heads/iter"), ("qt", "q tokens/iter"),
               ("b512", "bundles/512"), ("dma", "DMAs/page"), ("push", "MXU pushes/512"), ("issue", "issue ns"),
               ("hbm", "HBM ns"), ("ratio", "issue/HBM"), ("nested", "nested loops"),
               ("cold", "cold bundles"), ("general", "general-path bundles"))
    cells = []
    for r in rows:
        if r["status"] != "ok":
            cells.append(dict({k: "" for k, _ in columns}, variant=r["label"]))
            continue
        it, nested = r["per_iter"], r["nested"]
        trips = sorted({"reg" if n["trip"] is None else str(n["trip"]) for n in nested})
        cells.append(dict(
            variant=r["label"], bundles=str(it["bundles"]), cold=str(it["cold"]),
            general="-" if r.get("general_path_bundles") is None else str(r["general_path_bundles"]),
            kh=f"{r['keys_per_iter']} x {r['heads_per_iter']}", qt=str(r.get("query_tokens_per_iter", 1)),
            b512=f"{r['bundles_per_512']:.0f}",
            dma=f"{r['dmas_per_page']:.2f}", push=f"{r['pushes_per_512']:.0f}", issue=f"{r['issue_ns']:.0f}",
            hbm=f"{r['hbm_ns']:.0f}", ratio=f"{r['issue_over_hbm']:.2f}",
            nested=f"{len(nested)} (x {', '.join(trips)})" if nested else "0"))
    lines = _table(columns, cells).split("\n")
    width = len(lines[1].split("  ")[0])  # the variant column's
    for i, r in enumerate(rows):  # a row without numbers says why, past the variant, unaligned
        if r["status"] != "ok":
            lines[2 + i] = f"{r['label'].ljust(width)}  {r['status']}"
    return "\n".join([head, *lines])
