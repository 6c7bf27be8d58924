"""Where a paged step's compile time goes: the HLO of each cache op (issue 39, item 4).

    python -m arena_jax.benchmarks.studies.op_hlo [--batch 4] [--capacity 64] [--page-size 8]
                                                  [--example-layers N]

Compiles for this machine's CPU, at XLA's default optimization level unless XLA_FLAGS names one:
the tiny model's paged decode step, the dense baseline's decode step on the same weights, and
each cache op of the paged step alone (`aj.reserve`, `aj.append` and `aj.attend` with the
"xla" backend, `aj.release`), `generate`'s prefill program with per-row sampling (a 16-token
chunk), and, from a checkout, a model outside `models/`: `examples/tiny_decoder.py`'s decode
step on its own dense cache and on the arena (`aj.begin_step`; its layers, 4 unless
`--example-layers` says, a Python loop, so the cache ops are traced once per layer).

Per program: HLO instructions, kernels (fusions and unfused ops: what XLA's CPU backend emits
and calls one by one at run time), distinct kernels (what it compiles: one compile serves every
kernel of the same body), while loops, the most kernels waiting at once in a loop body, and the
compile's CPU seconds; for the steps, their kernels by part (the cache ops, the sampler, the
layers' weight slices, the rest of the model). Compile time follows the distinct kernels more
than anything else; RESULTS.md ("Compile time of the cache ops", "One compile for every layer's
cache ops") has the figures before and after the changes they chose.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
import re
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

import arena_jax as aj
from arena_jax import api, models
from arena_jax.models import dense_baseline, steps

__all__ = ["hlo_counts", "kernel_signatures", "kernels_by_part", "measure", "part_of", "widest_loop_start"]

_NOT_KERNELS = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast"}


def _opcode(line: str) -> str | None:
    """The opcode of an instruction line (`%name = TYPE opcode(...)`; a tuple TYPE has spaces
    and nested parentheses), else None."""
    _, eq, rest = line.partition(" = ")
    if not eq:
        return None
    if rest.startswith("("):  # skip the balanced tuple type
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rest = rest[i + 1 :]
                break
    else:
        rest = rest.partition(" ")[2]
    op = re.match(r"\s*([\w-]+)\(", rest)
    return op.group(1) if op else None


def _instructions(hlo_text: str):
    """(computation, opcode, line, runs as kernels) per instruction of an optimized HLO module.
    Instructions run as kernels in the entry computation, in while loops' bodies and conditions
    and in conditionals' branches; not in fusion bodies (`calls=`: a fusion is one kernel, its
    body included) nor in reductions' and scatters' small combiner bodies (`to_apply=`)."""
    called = set(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", hlo_text))
    computation = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) ", line)
        if head:
            computation = head.group(2)
            continue
        op = _opcode(line)
        if op is not None:
            yield computation, op, line, computation not in called and op not in _NOT_KERNELS


def hlo_counts(hlo_text: str) -> dict:
    """Counts in an optimized HLO module's text: instructions (every computation), kernels (the
    instructions that run as kernels, `_instructions`: fusions and unfused ops, less parameters,
    tuples, constants and bitcasts), distinct kernels (`kernel_signatures`) and while loops."""
    instructions = kernels = loops = 0
    for _, op, _, kernel in _instructions(hlo_text):
        instructions += 1
        loops += op == "while"
        kernels += kernel
    distinct = len(set(kernel_signatures(hlo_text)))
    return dict(instructions=instructions, kernels=kernels, distinct_kernels=distinct, while_loops=loops)


def _unnamed(line: str) -> str:
    """An instruction line without its names and metadata: what it computes."""
    return re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", line)).strip()


def kernel_signatures(hlo_text: str, op_name: str | None = None) -> list[str]:
    """What each kernel (`hlo_counts`) computes, names left out: its type, opcode and operands'
    count, and a fusion's whole body. XLA's CPU backend compiles a kernel once for all kernels
    of one signature, so a step's compile time follows the distinct signatures, not the kernels
    (RESULTS.md, "One compile for every layer's cache ops"). `op_name`: only the kernels whose
    op_name contains it."""
    instructions = list(_instructions(hlo_text))
    bodies: dict[str, list[str]] = {}
    for computation, _, line, _ in instructions:
        bodies.setdefault(computation, []).append(line)
    out = []
    for _, _, line, kernel in instructions:
        name = re.search(r'op_name="([^"]+)"', line)
        if not kernel or (op_name is not None and (name is None or op_name not in name.group(1))):
            continue
        called = re.search(r"calls=%([\w.\-]+)", line)
        body = [_unnamed(x) for x in bodies.get(called.group(1), [])] if called else []
        out.append("\n".join([_unnamed(line.split(", calls=")[0]).partition(" = ")[2], *body]))
    return out


def _operands(line: str) -> list[str]:
    """The instruction names an instruction line reads (its operand list, not `calls=` etc.)."""
    _, _, rest = line.partition(" = ")
    op = _opcode(line)
    start = rest.find(f" {op}(") + len(op) + 2  # past "TYPE opcode("
    depth, end = 1, start
    while depth and end < len(rest):
        depth += {"(": 1, ")": -1}.get(rest[end], 0)
        end += 1
    return re.findall(r"%([\w.\-]+)", rest[start:end])


def widest_loop_start(hlo_text: str) -> int:
    """The most kernels waiting at once in a while loop body run in data order (XLA's CPU
    executor: kernels start as their operands are done; with more than 8 waiting it hands half
    of them to its thread pool, `arena_jax.arena_ops.waits_for`). A queue in program order, each
    kernel taken off it before the count; 0 without loops."""
    bodies = set(re.findall(r"body=%([\w.\-]+)", hlo_text))
    graphs: dict[str, dict[str, tuple[bool, list[str]]]] = {}
    for computation, _, line, kernel in _instructions(hlo_text):
        if computation in bodies:
            name = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line).group(1)
            graphs.setdefault(computation, {})[name] = (kernel, _operands(line))
    widest = 0
    for graph in graphs.values():
        def kernel_deps(name, seen=()):  # the kernels `name` waits for (through tuples, bitcasts, ...)
            out = set()
            for o in graph.get(name, (False, []))[1]:
                if o in graph and o not in seen:
                    out |= {o} if graph[o][0] else kernel_deps(o, seen + (o,))
            return out
        deps = {n: kernel_deps(n) for n, (kernel, _) in graph.items() if kernel}
        done: set[str] = set()
        queue = [n for n in deps if not deps[n]]
        while queue:
            n = queue.pop(0)
            widest = max(widest, len(queue))
            done.add(n)
            queue += [m for m in deps if m not in done and m not in queue and deps[m] and deps[m] <= done]
    return widest


# A kernel's part of the step, from the first of these names in its op_name (JAX's name stack):
# the cache ops are jitted functions of their own, the sampler's draws are threefry hashes, the
# rest of the sampler is a conditional's branch (greedy rows skip it).
PARTS = (("reserve", "jit(_reserve)"), ("append", "jit(_append)"), ("attend", "jit(_attend)"),
         ("sampling: threefry", "threefry"), ("sampling: the rest", "/cond/branch_"),
         ("layer weights sliced", "jit(dynamic_index_in_dim)"))  # fmt: skip


def part_of(line: str, parts=PARTS) -> str:
    """The part of the step an instruction line belongs to: the first of `parts` whose key its
    op_name contains, "model" for any other op_name, "no op_name" without one (copies and the
    like that XLA adds)."""
    name = re.search(r'op_name="([^"]+)"', line)
    if name is None:
        return "no op_name"
    return next((part for part, key in parts if key in name.group(1)), "model")


def kernels_by_part(hlo_text: str) -> dict:
    """The kernels `hlo_counts` counts, by part of the step (`part_of`)."""
    parts = dict.fromkeys([name for name, _ in PARTS] + ["model", "no op_name"], 0)
    for _, _, line, kernel in _instructions(hlo_text):
        if kernel:
            parts[part_of(line)] += 1
    return parts


def _compiled(name: str, lowered) -> dict:
    start = time.process_time()  # this process's CPU time (all its threads)
    text = lowered.compile().as_text()
    return dict(program=name, compile_cpu_s=round(time.process_time() - start, 3), **hlo_counts(text),
                loop_start=widest_loop_start(text), parts=kernels_by_part(text))  # fmt: skip


EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tiny_decoder.py"


def example_steps(batch: int, capacity: int, page_size: int, layers: int | None = None) -> list[tuple[str, object]]:
    """(name, lowered) for `examples/tiny_decoder.py`'s decode step (one token a row) on its dense
    cache and on the arena, as the example jits them (the weights a traced argument, the cache
    donated); [] where the example is not there (an installed package ships no examples)."""
    if not EXAMPLE.is_file():
        return []
    spec = importlib.util.spec_from_file_location("tiny_decoder_example", EXAMPLE)
    ex = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (dataclasses look their module up)
    spec.loader.exec_module(ex)
    cfg = ex.Config() if layers is None else dataclasses.replace(ex.Config(), layers=layers)
    graphdef, state = nnx.split(ex.TinyDecoder(cfg, nnx.Rngs(0)))
    shape = (cfg.layers, batch, capacity, cfg.kv_heads, cfg.head_dim)
    dense = ex.DenseKV(jnp.zeros(shape), jnp.zeros(shape), jnp.int32(1), jnp.ones((batch, 1), jnp.int32))
    layout = aj.KVLayout(num_layers=cfg.layers, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, page_size=page_size,
                         num_pages=batch * capacity // page_size, max_seqs=batch,
                         max_pages_per_seq=capacity // page_size, dtype="float32")  # fmt: skip
    tokens, slots = jnp.zeros((batch, 1), jnp.int32), jnp.arange(batch, dtype=jnp.int32)

    def dense_step(state, tokens, kv):  # ex.dense_step's body
        logits, kv = nnx.merge(graphdef, state)(tokens, kv)
        return jnp.argmax(logits[:, -1], axis=-1), kv

    def paged_step(state, tokens, cache, slots):  # ex.paged_step's body
        step, ok = aj.begin_step(cache, slots, jnp.ones(slots.shape, jnp.int32), width=1)
        logits, step = nnx.merge(graphdef, state)(tokens, step)
        return jnp.argmax(logits[:, -1], axis=-1), step.cache, ok

    return [("example paged decode", jax.jit(paged_step, donate_argnums=2).lower(state, tokens, aj.create(layout), slots)),
            ("example dense decode", jax.jit(dense_step, donate_argnums=2).lower(state, tokens, dense))]  # fmt: skip


def measure(batch: int = 4, capacity: int = 64, page_size: int = 8, example_layers: int | None = None) -> list[dict]:
    """One row per program (`hlo_counts` plus its compile CPU seconds), the tiny model's steps
    first. `capacity`: tokens per sequence the arena (and the dense cache) hold."""
    model = models.init_random(models.LlamaConfig.tiny(), seed=0)
    graphdef, state = nnx.split(model)
    config = model.config
    cache = aj.create(models.default_layout(model, batch, capacity, page_size=page_size))
    tokens, slots = jnp.zeros((batch,), jnp.int32), jnp.arange(batch, dtype=jnp.int32)
    ones = jnp.ones((batch,), jnp.int32)
    kv = jnp.ones((batch, 1, config.num_kv_heads, config.head_dim), jnp.float32)
    q = jnp.ones((batch, 1, config.num_heads, config.head_dim), jnp.float32)
    dense = dense_baseline.init_dense_cache(config, batch, capacity)
    bound = steps.bound_steps(graphdef, state)
    sampling = models.Sampling(0.7, top_k=8, top_p=0.9).rows(batch)  # generate's prefill program: per-row sampling
    chunk = jnp.zeros((batch, 16), jnp.int32)
    return [
        _compiled("paged decode step", steps.decode_step.lower(graphdef, state, cache, tokens, slots)),
        _compiled("paged prefill, sampled", bound.prefill.lower(bound.leaves, cache, chunk, slots, ones * 16, slots,
                                                               jnp.int32(0), sampling)),  # fmt: skip
        _compiled("dense decode step", dense_baseline.dense_decode.lower(graphdef, state, dense, tokens)),
        _compiled("aj.reserve", api._reserve.lower(cache, slots, ones)),
        _compiled("aj.append (xla)", api._append.lower(cache, jnp.int32(0), slots, kv, kv, ones, "xla")),
        _compiled("aj.attend (xla)", api._attend.lower(q, cache, jnp.int32(0), slots, ones, None, "xla", None, None, None)),
        _compiled("aj.release", api._release.lower(cache, slots)),
        *(_compiled(name, lowered) for name, lowered in example_steps(batch, capacity, page_size, example_layers)),
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--capacity", type=int, default=64, help="tokens per sequence (default: 64)")
    p.add_argument("--page-size", type=int, default=8)
    p.add_argument("--example-layers", type=int, default=None, help="the example decoder's depth (default: its own, 4)")
    args = p.parse_args(argv)
    rows = measure(args.batch, args.capacity, args.page_size, args.example_layers)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; tiny model, batch {args.batch}, capacity "
          f"{args.capacity}, page {args.page_size}")
    print(f"{'program':<22} {'instructions':>12} {'kernels':>8} {'distinct':>9} {'while':>6} "
          f"{'loop: most waiting':>19} {'compile CPU s':>14}")
    for r in rows:
        print(f"{r['program']:<22} {r['instructions']:>12,} {r['kernels']:>8} {r['distinct_kernels']:>9} "
              f"{r['while_loops']:>6} {r['loop_start']:>19} {r['compile_cpu_s']:>14.2f}")
    steps_ = [r for r in rows if r["program"].startswith(("paged", "dense", "example"))]
    print("\nkernels by part of the step (op_name):")
    print(f"{'part':<22}" + "".join(f" {r['program']:>22}" for r in steps_))
    for part in steps_[0]["parts"]:
        print(f"{part:<22}" + "".join(f" {r['parts'][part]:>22}" for r in steps_))


if __name__ == "__main__":
    main()
