"""How low a paged decode step's first compile can go on XLA's CPU backend, and on an H100 or a
TPU v5e by their deviceless compilers (issue 39, item 4).

    python -m arena_jax.benchmarks.studies.compile_bound [--rounds 3] [--capacity 64] [--toy 30]
    python -m arena_jax.benchmarks.studies.compile_bound --target h100|tpu-v5e [--model tiny|mid|llama3_8b]

Item 4 asks for the paged decode step's compile <= 1.5x the dense step's (the cache's share
<= 0.5x). This study bounds what any reservation could reach. It compiles each step in five
variants, fresh each time (`jax.clear_caches()`), variants alternated round by round, and
prints the least CPU time of the rounds with the step's distinct kernels (`op_hlo`):

- **as built**: `reserve`'s table work as one kernel where the platform has one
  (`allocator.RESERVE_KERNEL` "auto": the native call on a CPU, the Triton kernel on a GPU and
  for `--target h100`; XLA's ops on a TPU), and on a CPU the step's plan as one native call
  (`plan.PLAN_KERNEL` "auto");
- **XLA's plan**: the plan as XLA's ops (`PLAN_KERNEL` False), reserve as built;
- **XLA's ops**: reserve and the plan as XLA's ops (what "as built" was up to session 61);
- **in-place branch only** (unsafe; XLA's ops): `reserve`'s allocator branch swapped for its in-place
  branch (`_grow_in_place`): every live row served, no page popped, no copy-on-write. What any
  allocator branch, however lean, could save;
- **no reserve** (unsafe; the plan as XLA's ops): `reserve` returns the cache as it got it. What the whole of
  reservation could save;

for the tiny model's decode step (`models.decode_step`, a layer scan) against the dense
baseline's (`dense_baseline.dense_decode`), and for `examples/tiny_decoder.py`'s step (a model
outside `models/`, its layers a Python loop, `aj.begin_step`) against its own dense cache. The
unsafe variants exist only inside `unsafe_variant`'s block and give wrong caches whenever a row
needs a page: they are bounds, not options.

A toy program of `--toy` independent one-line kernels (each a constant of its own, behind an
optimization barrier) gives what one distinct kernel costs to compile here, whatever it does.
Compile time follows distinct kernels (RESULTS.md, "One compile for every layer's cache ops").

`--target h100` / `--target tpu-v5e`: the same variants compiled for an H100 (sm_90a) or one TPU
v5e chip by XLA's deviceless compilers, on this host, no device (`scripts/install_sm90_tools.sh`,
`scripts/install_tpu_tools.sh`; `pallas_kernels.offline`): the `--model` preset's paged decode
step, its attention and append the Triton or Mosaic kernels as on the device (a TPU's take
head_dim 128: `llama3_8b`), and the dense baseline's, bf16 (`_device_programs`). A GPU's XLA fuses
the bookkeeping outside `reserve`'s allocator branch into a few kernels, so there the branch is
most of the cache's compile; a TPU's compiles an 8B-shaped step in about the dense step's time
(benchmarks/RESULTS.md, "Item 4 on the H100 and TPU targets").

`--by-part`: where the tiny steps' compile goes, from XLA's own timers. A child process
compiles them with XLA CPU's per-module logs on (`TF_CPP_VMODULE=ir_compiler=2,
fusion_compiler=2`: each kernel's LLVM and MLIR code generation, in ms), and each kernel's time
is summed under the part of the step its op_name names (`PARTS`).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

import arena_jax as aj
from arena_jax import allocator, models
from arena_jax import plan as plan_lib
from arena_jax.benchmarks.studies.op_hlo import PARTS as OP_PARTS
from arena_jax.benchmarks.studies.op_hlo import example_steps, hlo_counts, part_of
from arena_jax.models import dense_baseline, steps

__all__ = ["VARIANTS", "TARGETS", "PARTS", "unsafe_variant", "kernel_cost", "measure", "module_times", "ms_by_part",
           "compile_ms_by_part", "main"]

VARIANTS = ("as built", "XLA's plan", "XLA's ops", "in-place branch only", "no reserve")
TARGETS = ("cpu", "h100", "tpu-v5e")
DEVICE_PRESETS = ("tiny", "mid", "llama3_8b")  # --model for the device targets
# A kernel's part of the step: the first of these names in its op_name (`op_hlo.PARTS`, and the
# step's plan, `arena_jax.plan`); "model" for any other op_name, "no op_name" for none.
PARTS = (*OP_PARTS[:3], ("plan", "jit(_plan)"), *OP_PARTS[3:])


def _in_place_only(page_size, table, slots, idx, live, n, length, *, runs=False):
    del runs
    return allocator._grow_in_place(page_size, table, slots, idx, live, n, length)


def _no_reserve(cache, slots, num_tokens, *, run_pages=None, kernel=None):
    del num_tokens, run_pages, kernel
    return cache, slots == slots


@contextlib.contextmanager
def unsafe_variant(variant: str):
    """Inside the block, `reserve` is traced as `variant` says (`VARIANTS`); JAX's caches are
    cleared on the way in and out, so nothing traced inside outlives it."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    xla = ((allocator, "RESERVE_KERNEL", False), (plan_lib, "PLAN_KERNEL", False))
    swaps = {"as built": (), "XLA's plan": xla[1:], "XLA's ops": xla,
             "in-place branch only": (*xla, (allocator, "_allocate_and_map", _in_place_only)),
             "no reserve": (xla[1], (allocator, "reserve_impl", _no_reserve))}[variant]  # fmt: skip
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    jax.clear_caches()
    for module, name, swap in swaps:
        setattr(module, name, swap)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        jax.clear_caches()


def _compiled(lowered, options=None) -> tuple[float, int]:
    """(compile CPU seconds, distinct kernels) of a lowered program (`options`: XLA's)."""
    start = time.process_time()
    text = lowered.compile(options).as_text()
    return time.process_time() - start, hlo_counts(text)["distinct_kernels"]


def _programs(batch: int, capacity: int, page_size: int, example: bool = True) -> dict:
    """{(model, step): lowered}: the tiny model's paged and dense decode steps, the example
    decoder's (where the checkout has it), lowered as `reserve` is now."""
    model = models.init_random(models.LlamaConfig.tiny(), seed=0)
    graphdef, state = nnx.split(model)
    tokens, slots = jnp.zeros((batch,), jnp.int32), jnp.arange(batch, dtype=jnp.int32)
    cache = aj.create(models.default_layout(model, batch, capacity, page_size=page_size))
    dense = dense_baseline.init_dense_cache(model.config, batch, capacity)
    out = {("tiny model", "paged"): steps.decode_step.lower(graphdef, state, cache, tokens, slots),
           ("tiny model", "dense"): dense_baseline.dense_decode.lower(graphdef, state, dense, tokens)}  # fmt: skip
    for name, lowered in example_steps(batch, capacity, page_size) if example else ():
        out[("example decoder", "paged" if "paged" in name else "dense")] = lowered
    return out


def _device_programs(target: str, model: str, batch: int, capacity: int, page_size: int,
                     layers: int | None = None) -> dict:
    """{(model, step): lowered} for a device this host lacks, for XLA's deviceless compiler: "h100"
    (sm_90a, `pallas_kernels.offline.sm90`) or "tpu-v5e" (one chip, `pallas_kernels.offline.tpu`).
    The preset's paged decode step (`models.decode_step`, backend "pallas": the Triton or Mosaic
    kernels, as on the device) and the dense baseline's, bf16 weights and caches, as
    ShapeDtypeStructs on a compile-only device. `model`: a `models.LlamaConfig` preset ("tiny",
    "mid", "llama3_8b"), its layers scanned, as on a device; `layers`: its depth, if not the
    preset's (a scan compiles its body once; an 8B-shaped model of 32 layers does not fit one
    v5e chip's 16 GB: XLA refuses it)."""
    from pallas_kernels.offline.tpu import placed

    if target == "h100":
        from arena_jax.benchmarks.studies.sm90_steps import _h100
        from pallas_kernels.offline import sm90, sm90_compat

        device = sm90_compat.cuda_topology(sm90.H100_TARGET_CONFIG).devices[0]
        paged_context, dense_context = _h100(device), jax.default_device(device)
    else:
        from pallas_kernels.offline import tpu

        device = tpu.tpu_devices(target)[0]
        paged_context, dense_context = _platform_backend(tpu.tpu_lowering(target)), tpu.tpu_lowering(target)
    on_device = jax.sharding.SingleDeviceSharding(device)
    place = functools.partial(placed, sharding=on_device)

    config = getattr(models.LlamaConfig, model)()
    config = config if layers is None else dataclasses.replace(config, num_layers=layers)
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: models.Llama(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    state, rows = place(state), jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=on_device)  # tokens, slots i32[B]
    layout = config.kv_layout(page_size=page_size, num_pages=batch * -(-capacity // page_size), max_seqs=batch,
                              max_seq_len=capacity, dtype="bfloat16")  # fmt: skip
    cache = place(jax.eval_shape(lambda: aj.create(layout)))
    dense = place(jax.eval_shape(lambda: dense_baseline.init_dense_cache(config, batch, capacity, jnp.bfloat16)))
    with paged_context:
        paged = steps.decode_step.trace(graphdef, state, cache, rows, rows).lower()
    with dense_context:
        dense_step = dense_baseline.dense_decode.trace(graphdef, state, dense, rows).lower()
    return {(f"{model} model", "paged"): paged, (f"{model} model", "dense"): dense_step}


@contextlib.contextmanager
def _platform_backend(context):
    """`context`, with the arena ops on their platform's default backend (`aj.BACKEND_ENV` unset
    inside: Mosaic on a TPU)."""
    saved = os.environ.pop(aj.BACKEND_ENV, None)
    try:
        with context:
            yield
    finally:
        if saved is not None:
            os.environ[aj.BACKEND_ENV] = saved


def kernel_cost(count: int = 30) -> float:
    """Compile CPU seconds per distinct kernel: a program of `count` one-line kernels, each
    adding its own constant behind an optimization barrier (so none fuses or folds into
    another), less a program of one."""
    x = jnp.arange(4, dtype=jnp.int32)

    def toy(n):
        return jax.jit(lambda x: [jax.lax.optimization_barrier(jnp.where(x > c, x * c, x - c)) for c in range(3, 3 + n)])

    jax.clear_caches()
    many, _ = _compiled(toy(count).lower(x))
    one, _ = _compiled(toy(1).lower(x))
    return (many - one) / (count - 1)


def measure(rounds: int = 3, batch: int = 4, capacity: int = 64, page_size: int = 8, target: str = "cpu",
            model: str = "tiny", layers: int | None = None) -> list[dict]:
    """One row per (model, variant): the least compile CPU seconds of `rounds` and the distinct
    kernels; the dense steps as variant "dense". Variants alternate within each round.
    `target`: "cpu" (this host; the tiny model and the example decoder), "h100" or "tpu-v5e"
    (XLA's deviceless compile for that device: the `model` preset, `layers` deep if given,
    `_device_programs`)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    options = None
    if target == "h100":
        from pallas_kernels.offline import sm90

        options = dict(sm90.DEFAULT_OPTIMIZATION)  # as the sm_90a checks compile
    best: dict = {}
    for _ in range(rounds):
        for variant in VARIANTS:
            with unsafe_variant(variant):
                programs = (_programs(batch, capacity, page_size) if target == "cpu"
                            else _device_programs(target, model, batch, capacity, page_size, layers))  # fmt: skip
                for (name, step), lowered in programs.items():
                    if step == "dense" and variant != "as built":
                        continue  # the dense steps call no cache op
                    key = (name, "dense" if step == "dense" else variant)
                    seconds, distinct = _compiled(lowered, options)
                    old = best.get(key)
                    best[key] = dict(model=name, variant=key[1], distinct_kernels=distinct,
                                     compile_s=seconds if old is None else min(seconds, old["compile_s"]))
    rows = list(best.values())
    for row in rows:
        dense = best[(row["model"], "dense")]
        row["over_dense"] = row["compile_s"] / dense["compile_s"]
        row["kernels_over_dense"] = row["distinct_kernels"] - dense["distinct_kernels"]
    return rows


_MODULE_TIME = re.compile(r"Compiled (?:LLVM|MLIR) module: (\S+) time: ([\d.]+) (us|ms|s)\b")
_MARK = "compile_bound: compiling "


def module_times(log: str) -> dict[str, dict[str, float]]:
    """{program: {kernel: ms}} from a child's log: XLA CPU's per-module times (LLVM and MLIR,
    summed per kernel), each under the last `_MARK` line before it. Module names are the
    kernels' HLO names with XLA's prefixes and suffix taken off."""
    out: dict[str, dict[str, float]] = {}
    program = None
    for line in log.splitlines():
        if line.startswith(_MARK):
            program = line[len(_MARK):].strip()
            out[program] = {}
            continue
        m = _MODULE_TIME.search(line)
        if m and program is not None:
            name = m.group(1).replace("__compute_module_", "").removesuffix("_kernel_module")
            ms = float(m.group(2)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(3)]
            out[program][name] = out[program].get(name, 0.0) + ms
    return out


def ms_by_part(times: dict[str, float], hlo_text: str) -> dict[str, float]:
    """{part: ms}: each kernel's time (`module_times`) under the part its instruction's op_name
    names in the optimized HLO (`PARTS`)."""
    part = {}  # instruction name -> its part
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
        if m:
            part[m.group(1)] = part_of(line, PARTS)
    parts = dict.fromkeys([name for name, _ in PARTS] + ["model", "no op_name"], 0.0)
    for kernel, ms in times.items():
        parts[part.get(kernel, "no op_name")] += ms
    return parts


def _child(folder: str, batch: int, capacity: int, page_size: int) -> None:
    """Compile the tiny steps, each after a `_MARK` line on stderr, its optimized HLO to `folder`."""
    for (_, step), lowered in _programs(batch, capacity, page_size, example=False).items():
        print(_MARK + step, file=sys.stderr, flush=True)
        (pathlib.Path(folder) / f"{step}.hlo").write_text(lowered.compile().as_text())
        print(_MARK + "(done)", file=sys.stderr, flush=True)


def compile_ms_by_part(batch: int = 4, capacity: int = 64, page_size: int = 8) -> dict[str, dict[str, float]]:
    """{"paged" / "dense": {part: ms}}: the tiny steps' kernel code generation by part, from XLA's
    own timers in a child process (its logs must be on before XLA loads)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="ir_compiler=2,fusion_compiler=2")
    with tempfile.TemporaryDirectory() as folder:
        args = ["--child", folder, "--batch", str(batch), "--capacity", str(capacity), "--page-size", str(page_size)]
        argv = [sys.executable, "-m", "arena_jax.benchmarks.studies.compile_bound", *args]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"the compile child failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        times = module_times(proc.stderr)
        return {step: ms_by_part(times.get(step, {}), (pathlib.Path(folder) / f"{step}.hlo").read_text())
                for step in ("paged", "dense")}  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.studies.compile_bound",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--capacity", type=int, default=64, help="tokens per sequence (default: 64, the tour's)")
    p.add_argument("--page-size", type=int, default=8)
    p.add_argument("--toy", type=int, default=30, help="kernels in the per-kernel cost's toy (default: 30)")
    p.add_argument("--by-part", action="store_true", help="also the tiny steps' code generation by part (XLA's timers)")
    p.add_argument("--target", choices=TARGETS, default="cpu",
                   help="cpu (default): this host's XLA; h100 / tpu-v5e: XLA's deviceless compile for that device "
                        "(needs scripts/install_sm90_tools.sh / scripts/install_tpu_tools.sh)")
    p.add_argument("--model", choices=DEVICE_PRESETS, default="tiny",
                   help="the preset compiled for --target h100 / tpu-v5e (a TPU's kernels take head_dim 128: "
                        "llama3_8b; tiny and mid run the jnp path there)")
    p.add_argument("--layers", type=int, default=None,
                   help="the --model preset's depth, if not its own (layers are scanned: the compile does not "
                        "grow with them; llama3_8b on tpu-v5e needs 2 to fit one chip)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child, args.batch, args.capacity, args.page_size)
    if args.target != "cpu" and args.by_part:
        p.error("--by-part reads XLA CPU's timers: it takes --target cpu")
    if args.target == "cpu" and args.model != "tiny":
        p.error("--model picks the preset of --target h100 / tpu-v5e (--target cpu compiles the tiny model and the "
                "example decoder)")
    if args.target == "cpu" and args.layers is not None:
        p.error("--layers sets the depth of --target h100 / tpu-v5e's preset")
    where = (jax.devices()[0].platform if args.target == "cpu"
             else f"{args.target} (deviceless), the {args.model} preset"
                  f"{'' if args.layers is None else f' at {args.layers} layers'}, bf16")  # fmt: skip
    print(f"jax {jax.__version__}, {where}; batch {args.batch}, capacity {args.capacity}, "
          f"page {args.page_size}; least of {args.rounds} rounds")
    print("| model | variant | distinct kernels | over dense | compile CPU s | / dense |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in measure(args.rounds, args.batch, args.capacity, args.page_size, args.target, args.model, args.layers):
        print(f"| {r['model']} | {r['variant']} | {r['distinct_kernels']} | {r['kernels_over_dense']:+d} "
              f"| {r['compile_s']:.2f} | {r['over_dense']:.2f}x |")
    if args.target == "cpu":
        print(f"one distinct kernel: {1e3 * kernel_cost(args.toy):.1f} ms of compile CPU time "
              f"({args.toy} one-line kernels against one)")
    if args.by_part:
        parts = compile_ms_by_part(args.batch, args.capacity, args.page_size)
        print("\nthe tiny steps' kernel code generation (LLVM + MLIR, XLA's timers), ms by part:")
        print("| part | paged | dense |")
        print("| --- | ---: | ---: |")
        for part in parts["paged"]:
            print(f"| {part} | {parts['paged'][part]:.0f} | {parts['dense'][part]:.0f} |")
        print(f"| all | {sum(parts['paged'].values()):.0f} | {sum(parts['dense'].values()):.0f} |")


if __name__ == "__main__":
    main()
