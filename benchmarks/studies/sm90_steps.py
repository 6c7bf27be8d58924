"""Whole model steps (decode, prefill, speculative verify) compiled for an H100 (sm_90a) on a host without a GPU.

    JAX_PLATFORMS=cpu python -m arena_jax.benchmarks.studies.sm90_steps [--layers 32] [--only verify]

Needs `bash scripts/install_sm90_tools.sh` (the CUDA PJRT plugin and ptxas; `pallas_kernels.offline.sm90`).
The GPU counterpart of the TPU step rows (`benchmarks.tpu_steps`): a Llama-3-8B-shaped model
(hidden 4096, 32 q / 8 KV heads, head_dim 128, MLP 14336, vocab 128256; bf16 weights and arena,
page 16) on one H100, no mesh, exists only as ShapeDtypeStructs; the real jitted step (cache
donated, backend "pallas": the Triton kernels) is compiled by XLA's deviceless GPU compiler.
One row per step: the Pallas (Triton) kernels in the module with registers/thread and spill
bytes (ptxas on XLA's PTX), whether the arena's k and v are aliased to outputs (updated in
place), arena-sized copies, the per-layer copies of stacked weights (the layer scan's
dynamic-slice fusions), the XLA kernels a layer and once a step (`launches`), temp bytes
(`memory_analysis()`) and compile seconds.

`--layers` (default 32, as the TPU rows): the layer loop is a `lax.scan`, so the body compiles
once whatever the depth (each step compiles in 5-15 s at 1, 2 or 32 layers). At 1 layer XLA
drops the trip-count-1 loop and its weight slices become bitcasts: no weight copies show.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp

from pallas_kernels.offline import sm90, sm90_compat
from pallas_kernels.offline.tpu import _shape_bytes, hlo_shape

__all__ = ["CASES", "compile_step", "step_facts", "main"]

# (step, batch rows B, new tokens per row T): the TPU StepCases' v5e sizes. verify: each row's
# last token + k=4 proposals (`generate(speculative=PromptLookup(k=4))`).
CASES = (("decode", 32, 1), ("prefill", 8, 512), ("verify", 32, 5))
PAGE_SIZE, MAX_SEQ_LEN = 16, 4096
NUM_PAGES = 8192  # 131072 tokens = 32 rows x 4096: 16 GiB at 32 layers, beside 16 GiB of weights (80 GiB H100)
TRITON_CALL = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?name = "([^"]+)"')
ARRAY_OP = re.compile(r"=\s*(\w+)\[([\d,]*)\]\{[^}]*\}\s+([\w-]+)\(")  # "= bf16[2,8]{1,0} copy(" -> dtype, dims, opcode


@contextlib.contextmanager
def _h100(device):
    """Trace for `device` (a compile-only H100): the Pallas GPU kernels compiled, not interpreted
    (they interpret when jax's default backend is the CPU, as it is here), backend "pallas" for
    the arena ops, and `device` as the default one (the arena ops' platform checks read it)."""
    import arena_jax as aj

    never = lambda interpret: bool(interpret)  # noqa: E731  (None -> False: compile for the GPU)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, {aj.BACKEND_ENV: "pallas"}))
        for module in ("pallas_kernels.gpu.attention", "pallas_kernels.gpu.append", "pallas_kernels.gpu.allocate"):
            stack.enter_context(mock.patch(f"{module}.resolve_interpret", never))
        stack.enter_context(sm90_compat.h100_target())
        stack.enter_context(jax.default_device(device))
        yield


def compile_step(step: str, batch: int, tokens: int, layers: int, dump: str):
    """Compile one step for an H100, XLA's dump under `dump`: (compiled, state, cache, seconds)."""
    from flax import nnx

    import arena_jax as aj
    from arena_jax.models.config import LlamaConfig
    from arena_jax.models.llama import Llama
    from arena_jax.models.sampling import SamplingParams
    from arena_jax.models.steps import bound_steps

    device = sm90_compat.cuda_topology(sm90.H100_TARGET_CONFIG).devices[0]
    h100 = jax.sharding.SingleDeviceSharding(device)
    place = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=h100), tree)  # noqa: E731
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=h100)  # noqa: E731
    config = dataclasses.replace(LlamaConfig.llama3_8b(), num_layers=layers)
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: Llama(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    state = place(state)  # layer weights stacked [L, ...]; embed [128256, 4096], lm_head [128256, 4096]
    layout = config.kv_layout(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_seqs=batch, max_seq_len=MAX_SEQ_LEN,
                              dtype="bfloat16")
    cache = place(jax.eval_shape(lambda: aj.create(layout)))  # k, v: bf16[L, 8, 8192, 16, 128]
    t0 = time.perf_counter()
    with _h100(device):  # the bound steps `generate` runs (their compile options: models.steps.STEP_COMPILER_OPTIONS)
        steps = bound_steps(graphdef, state)
        f32 = jax.ShapeDtypeStruct((batch,), jnp.float32, sharding=h100)
        sampling = SamplingParams(temperature=f32, top_k=i32(batch), top_p=f32)  # per row
        if step == "decode":  # tokens i32[B], slots, seq_ids i32[B], seed i32[]
            traced = steps.decode_step.trace(steps.leaves, cache, i32(batch), i32(batch), i32(batch), i32(), sampling)
        elif step == "prefill":  # tokens i32[B, T], slots, num_tokens, seq_ids i32[B], seed i32[]
            traced = steps.prefill.trace(steps.leaves, cache, i32(batch, tokens), i32(batch), i32(batch), i32(batch),
                                         i32(), sampling)
        else:  # verify: tokens i32[B, T], slots, num_tokens, seq_ids i32[B], seed i32[]
            traced = steps.verify.trace(steps.leaves, cache, i32(batch, tokens), i32(batch), i32(batch), i32(batch),
                                        i32(), sampling)
        compiled = traced.lower().compile({"xla_dump_to": dump, **sm90_compat.PTX_DUMP_OPTIONS,
                                           **sm90.DEFAULT_OPTIMIZATION})
    return compiled, state, cache, time.perf_counter() - t0


def step_facts(compiled, state, cache, dump: str) -> dict:
    """What the compiled module says: its Triton kernels (name, registers, spill bytes), arena
    aliasing and copies, per-layer weight copies, temp bytes."""
    text = compiled.as_text()
    header, entry = text[: text.find("\n")], text[text.find("\nENTRY"):]
    aliased = {int(p) for p in re.findall(r"\}:\s*\((\d+),", header)}  # input_output_alias={ {0}: (12, {}, ...
    arena = hlo_shape(cache.k.dtype, cache.k.shape)
    arena_params = {int(n) for d, s, n in re.findall(r"=\s*(\w+)\[([\d,]*)\]\{[^}]*\}\s+parameter\((\d+)\)", entry)
                    if f"{d}[{s}]" == arena}  # k and v (one shape)
    arena_bytes = cache.k.size * cache.k.dtype.itemsize
    # Per-layer slices of stacked weights [L, ...]: [1, ...] (or squeezed), as XLA's
    # dynamic-slice fusions (async `fusion-start` on a GPU) or copies materialize them.
    stacked = [a for a in jax.tree.leaves(state) if a.ndim >= 2 and a.shape[0] == cache.k.shape[0]]
    per_layer = {hlo_shape(a.dtype, s) for a in stacked for s in ((1, *a.shape[1:]), a.shape[1:])}
    arena_copies = weight_copies = weight_bytes = 0
    for dtype, dims, op in ARRAY_OP.findall(text):  # every array-valued instruction, fused computations included
        if op in ("copy", "copy-done") and _shape_bytes(dtype, dims) >= arena_bytes:
            arena_copies += 1
    for dtype, dims, op in ARRAY_OP.findall(_unfused(text)):  # buffers the step materializes
        if op in ("dynamic-slice", "copy", "fusion", "fusion-done") and f"{dtype}[{dims}]" in per_layer:
            weight_copies += 1  # (a slice fused into its matmul, XLA's "dynamic-slice-fusion", makes none)
            weight_bytes += _shape_bytes(dtype, dims)
    kernels = []
    ptxs = [open(os.path.join(dump, f)).read() for f in sorted(os.listdir(dump)) if f.endswith(".ptx")]
    for name in TRITON_CALL.findall(text):  # XLA splits the module's PTX over several files
        ptx = next((p for p in ptxs if f".entry {name}(" in p), None)
        info = sm90._ptxas(ptx, name, dump) if ptx else {}
        spills = info.get("spill_stores", 0) + info.get("spill_loads", 0)  # bytes
        kernels.append(dict(name=name, regs=info.get("regs"), spills=spills))
    return dict(kernels=kernels, aliased=len(arena_params) == 2 and arena_params <= aliased,
                arena_copies=arena_copies, weight_copies=weight_copies, weight_bytes=weight_bytes,
                temp_bytes=compiled.memory_analysis().temp_size_in_bytes, **launches(text))


def launches(text: str) -> dict:
    """XLA kernels (fusions, custom calls, unfused ops: `op_hlo.hlo_counts`' count) in the layer
    loop's body, which runs once a layer, and outside every loop, which runs once a step: a
    step launches about `per_layer * layers + once` kernels (the other loops, e.g. reserve's
    copy-on-write, run no trip on most steps)."""
    from arena_jax.benchmarks.studies.op_hlo import _instructions

    bodies = set(re.findall(r"body=%([\w.\-]+)", text))
    per = {}
    for computation, _, _, kernel in _instructions(text):
        if kernel:
            key = computation if computation in bodies else None
            per[key] = per.get(key, 0) + 1
    in_bodies = [n for c, n in per.items() if c is not None]
    return dict(per_layer=max(in_bodies, default=0), once=per.get(None, 0))


def _unfused(text: str) -> str:
    """The module's text without its fused computations (those a fusion `calls=`): what is left
    are the entry, loop and branch computations, whose instructions each produce a buffer."""
    fused = set(re.findall(r"calls=(%[\w.-]+)", text))
    keep, inside = [], False
    for line in text.splitlines():
        head = re.match(r"(%[\w.-]+) ", line)
        if head and line.rstrip().endswith("{"):
            inside = head.group(1) in fused
        if not inside:
            keep.append(line)
        if line.startswith("}"):
            inside = False
    return "\n".join(keep)


def _print_table(rows: list[list[str]]) -> None:
    heads = ("step", "Pallas Triton calls", "kernel: regs/thread, spill bytes", "arena aliased", "arena copies",
             "weight copies/layer (MiB)", "XLA kernels: a layer / once", "temp MiB", "compile s")
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(heads)]
    for cells in (heads, ["-" * w for w in widths], *rows):
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="model layers (the scan body compiles once)")
    parser.add_argument("--only", default=None, help="only the steps whose label contains SUBSTRING")
    args = parser.parse_args(argv)
    problem = sm90.tooling_problem()
    if problem:
        raise SystemExit(f"cannot compile for an H100 here: {problem}")
    start, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="sm90_steps_") as workdir:
        for step, batch, tokens in CASES:
            label = f"{step} B={batch} T={tokens}"
            if args.only and args.only not in label:
                continue
            dump = tempfile.mkdtemp(prefix=f"{step}_", dir=workdir)
            compiled, state, cache, seconds = compile_step(step, batch, tokens, args.layers, dump)
            f = step_facts(compiled, state, cache, dump)
            kernels = "; ".join(f"{k['name']}: {k['regs']}, {k['spills']}" for k in f["kernels"])
            rows.append([label, str(len(f["kernels"])), kernels, "yes" if f["aliased"] else "NO",
                         str(f["arena_copies"]), f"{f['weight_copies']} ({f['weight_bytes'] / 2**20:.0f})",
                         f"{f['per_layer']} / {f['once']}", f"{f['temp_bytes'] / 2**20:.1f}", f"{seconds:.1f}"])
    print(f"H100 (sm_90a), Llama-3-8B shape, {args.layers} layers, bf16, page {PAGE_SIZE}, {NUM_PAGES} pages, "
          f"jax {jax.__version__}")
    _print_table(rows)
    print(f"wall {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
