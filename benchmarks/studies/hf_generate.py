"""`models.generate` against transformers' `generate` and its continuous batching (issue 39, item 3).

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \
        python -m arena_jax.benchmarks.studies.hf_generate [--batch 32] [--prompt-len 128] [--new-tokens 64]

The same random weights (the "mid" model of `context_cost` / `dense_ratio`: hidden 512, 8 layers,
8 query / 2 KV heads, head_dim 64, MLP 1536, vocab 32,000, float32) and the same random prompts
(all `--prompt-len` tokens) on three paths, greedy, `--new-tokens` tokens per prompt, no stop
token, one thread each on a CPU (torch by `torch.set_num_threads(1)`, XLA by the flags above).
`--model llama3-8b --dtype bfloat16` on a GPU: both on the GPU, transformers with SDPA attention:

- arena:  `models.generate(model, prompts, new_tokens, batch_size=batch)` (its defaults otherwise:
          chunked prefill, decode blocks, the paged arena sized by the call), the model's layers
          in the form `load_pretrained` gives a checkpoint of these weights on this platform
          (`models.default_scan_layers`: on a CPU the mid model's layers, 12 MiB each, are a list
          run by a Python loop, read in place by their matmuls; a layer scan elsewhere);
- hf:     transformers' `model.generate(input_ids, do_sample=False, max_new_tokens=...)` with its
          own KV cache, eager attention (what `arena-bench decode --hf on` builds: `hf_peer`);
- hf-static: the same `generate` with `cache_implementation="static"` (a preallocated cache;
          transformers compiles its decode forward with `torch.compile` where it can, on a GPU);
- arena-scan / arena-list (`--other-layers`): `models.generate` on the same weights in the other
          form: stacked and run by a layer scan (XLA's CPU compiler copies each layer's weight
          slices out of the stacks every step), or a list of layers (`scan_layers=False`);
- arena-chunkN (`--chunk-sizes N,...`): `models.generate` with `Serving(chunk_size=N)`, against
          the default chunk (`models.default_chunk_size`);
- hf-cb:  transformers' continuous batching, `model.generate_batch(...)` (paged attention
          on its own cache), where the installed transformers has it.

Each path runs once untimed (JAX compiles; torch warms), then the paths alternate for `--rounds`
rounds; each figure is the median of its rounds' wall times, generated tokens / s over the whole
call (prefill included). Tokens: the arena's against each peer's, position by position.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arena_jax import models
from arena_jax.benchmarks.studies.context_cost import Settings

__all__ = ["run", "main"]


def _hf_model(model, device: str, attention: str):
    """transformers' model on the arena model's weights (`hf_peer.hf_model`), greedy to the end."""
    from arena_jax.benchmarks.hf_peer import hf_model

    hf = hf_model(model, device, attention)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def unrolled(model):
    """The same model as a list of layers run by a Python loop (`scan_layers=False`), its weights
    copied from `model`'s stacks layer by layer."""
    out = models.init_random(model.config, seed=0, dtype=model.dtype, scan_layers=False)
    for i, block in enumerate(out.layers):
        nnx.update(block, nnx.state(model.layer(i)))
    rest = {name: value for name, value in nnx.state(model).items() if name != "layers"}
    nnx.update(out, nnx.State(rest))
    return out


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _config(model: str, capacity: int):
    if model == "mid":
        return Settings(capacity=capacity).config()
    from arena_jax.benchmarks.presets import PRESETS

    return PRESETS[model]()


def run(batch: int = 32, prompt_len: int = 128, new_tokens: int = 64, rounds: int = 3, seed: int = 0, model_name: str = "mid",
        dtype: str = "float32", peers=("hf", "hf-cb"), log=print, other_layers: bool = False,
        chunk_sizes=()) -> dict:  # fmt: skip
    import torch

    on_gpu = jax.default_backend() == "gpu" and torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    if not on_gpu:
        torch.set_num_threads(1)
    cfg = _config(model_name, prompt_len + new_tokens)
    model = models.init_random(cfg, seed=seed, dtype=jnp.dtype(dtype))  # stacked layers
    scan = models.default_scan_layers(cfg, jnp.dtype(dtype))
    listed = unrolled(model) if other_layers or not scan else None  # a second copy of the weights: only if run
    default, other = (model, listed) if scan else (listed, model)
    prompts = np.random.default_rng(seed).integers(1, cfg.vocab_size, (batch, prompt_len)).astype(np.int64)
    hf = _hf_model(model, device, "sdpa" if on_gpu else "eager")

    def synced(out):
        if on_gpu:
            torch.cuda.synchronize()
        return out

    def arena(m=default, chunk_size=None):
        out = models.generate(m, prompts.tolist(), new_tokens, serving=models.Serving(batch_size=batch, chunk_size=chunk_size))
        return np.asarray([list(t) for t in out.tokens])

    def hf_generate(**cache):
        with torch.inference_mode():
            ids = torch.from_numpy(prompts).to(device)
            out = synced(hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, **cache))  # fmt: skip
        return out[:, prompt_len:].cpu().numpy()

    def hf_cb():
        import transformers

        gen = transformers.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                            eos_token_id=None, pad_token_id=0)  # fmt: skip
        with torch.inference_mode():
            out = synced(hf.generate_batch(inputs=prompts.tolist(), generation_config=gen, progress_bar=False))
        return np.asarray([out[k].generated_tokens for k in sorted(out, key=lambda k: int(str(k).split("_")[-1]))])

    other_name = "arena-list" if scan else "arena-scan"
    log(f"# arena: {'a layer scan' if scan else 'a list of layers'} (models.default_scan_layers)")
    paths = {"arena": arena, **({other_name: functools.partial(arena, other)} if other_layers else {}),
             **{f"arena-chunk{c}": functools.partial(arena, chunk_size=c) for c in chunk_sizes},
             "hf": hf_generate, "hf-static": lambda: hf_generate(cache_implementation="static")}
    if hasattr(hf, "generate_batch"):
        paths["hf-cb"] = hf_cb
    paths = {name: fn for name, fn in paths.items() if name.startswith("arena") or name in peers}
    tokens, skipped = {}, {}
    for name, fn in list(paths.items()):  # untimed: compile / warm
        try:
            tokens[name], seconds = _timed(fn)
            log(f"# {name}: untimed first call {seconds:.1f} s")
        except Exception as exc:  # noqa: BLE001  (a peer that cannot run here is reported, not fatal)
            if name.startswith("arena"):
                raise
            skipped[name] = f"{type(exc).__name__}: {exc}"[:300]
            del paths[name]
    times = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            _, seconds = _timed(fn)
            times[name].append(seconds)
            log(f"# {name}: {seconds:.2f} s")
    rows = []
    arena_s = float(np.median(times["arena"]))
    for name in paths:
        s = float(np.median(times[name]))
        same = float(np.mean(tokens[name] == tokens["arena"])) if tokens[name].shape == tokens["arena"].shape else None
        rows.append(dict(path=name, seconds=s, tokens_per_s=batch * new_tokens / s, arena_speedup=s / arena_s,
                         tokens_equal_to_arena=same, rounds=times[name]))  # fmt: skip
        log(f"| {name} | {s:.2f} | {batch * new_tokens / s:,.0f} | {s / arena_s:.2f}x | "
            f"{'' if same is None else f'{same:.1%}'} |")  # fmt: skip
    for name, why in skipped.items():
        log(f"| {name} | not run: {why} | | | |")
    return dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, rounds=rounds, rows=rows, skipped=skipped)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.studies.hf_generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="mid", help="'mid' (default) or a preset of arena-bench (e.g. llama3-8b)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--peers", default="hf,hf-cb", help="comma-separated: hf (generate), hf-static (generate, static cache), "
                   "hf-cb (generate_batch)")
    p.add_argument("--other-layers", action="store_true", help="also the arena on the same weights with its layers in "
                   "the other form: a layer scan where models.default_scan_layers gives a list (a CPU), else a list")
    p.add_argument("--chunk-sizes", default="", help="comma-separated prefill chunks: also the arena with each "
                   "(Serving(chunk_size=N); the 'arena' path runs models.default_chunk_size)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import torch
    import transformers

    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; {a.model} model ({a.dtype}), batch {a.batch}, "
          f"{a.prompt_len} prompt + {a.new_tokens} new tokens, {a.rounds} alternated rounds")  # fmt: skip
    print("| path | seconds (median) | generated tokens/s | arena speedup | tokens equal to the arena's |")
    print("|---|---:|---:|---:|---:|")
    result = run(a.batch, a.prompt_len, a.new_tokens, a.rounds, model_name=a.model, dtype=a.dtype,
                 peers=tuple(a.peers.split(",")), other_layers=a.other_layers,
                 chunk_sizes=tuple(int(c) for c in a.chunk_sizes.split(",") if c))  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
