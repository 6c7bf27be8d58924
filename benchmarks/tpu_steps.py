"""The whole model step (`models.prefill`, `models.decode_step`) compiled for TPU v5e / v6e without a TPU.

A Llama-3-8B-shaped model (32 layers, 32 query / 8 KV heads, head_dim 128, bf16) and its paged
cache are built as ShapeDtypeStructs placed on a TPU topology mesh (`data` x `tensor`, e.g.
2x2 on v5e, 2x4 on v6e): weights Megatron-style over `tensor` (`models.parallel`), the arena
over KV heads (`tensor`) and pages (`data`) (`arena_jax.sharding`). Nothing is allocated; the
8B weights exist only as shapes. The step is the real jitted step with the cache donated, so
the compiled module shows whether the arena is aliased in place, whether XLA copies it, which
Mosaic kernels run, and what XLA's cost analysis says the step reads. On the TPU the arena ops
take the Mosaic kernels (`backend="pallas"` resolves to them on a TPU device).
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

__all__ = ["StepCase", "STEP_CASES", "step_inputs", "compile_step"]


@dataclasses.dataclass(frozen=True)
class StepCase:
    """One model step to compile: which step, target, mesh and sizes."""

    step: str  # "prefill" | "decode" | "decode_block" (generate's block program: `tokens` decode steps per call)
    #          | "verify" (speculative decoding's call: each row's last token + `tokens` - 1 proposals)
    #          | "mixed" (continuous batching's mixed step: `batch` decode rows + `chunks` prefill chunks of `tokens`)
    target: str  # "tpu-v5e" | "tpu-v6e"
    mesh: str  # "2x2" | "2x4": (data, tensor)
    batch: int
    tokens: int  # new tokens per row (1 for decode)
    num_pages: int  # arena pages in all (split over `data`)
    page_size: int = 16
    max_seq_len: int = 4096
    num_layers: int = 32  # Llama-3-8B has 32; fewer keep a CI compile short (every layer is the same)
    dtype: str = "bfloat16"  # the arena's
    chunks: int = 0  # prefill chunks of a mixed step (a multiple of the mesh's data axis)

    @property
    def label(self) -> str:
        layers = "" if self.num_layers == 32 else f" {self.num_layers} layers"
        chunks = f" +{self.chunks} chunks" if self.chunks else ""
        return (f"{self.step} {self.target} {self.mesh} B={self.batch}{chunks} T={self.tokens} page={self.page_size} "
                f"{self.dtype}{layers}")


# Sized to fit the chips: v5e 16 GiB (weights 8 GB per chip at tp=2 + 4 GiB of KV), v6e 32 GiB.
STEP_CASES = (
    StepCase("decode", "tpu-v5e", "2x2", batch=32, tokens=1, num_pages=8192),
    StepCase("prefill", "tpu-v5e", "2x2", batch=8, tokens=512, num_pages=8192),
    StepCase("decode", "tpu-v6e", "2x4", batch=64, tokens=1, num_pages=16384),
    StepCase("prefill", "tpu-v6e", "2x4", batch=8, tokens=512, num_pages=16384),
    # an int8 arena (keys rotated: its default), the same tokens in 128-token pages (8-bit pages on a TPU)
    StepCase("decode", "tpu-v5e", "2x2", batch=32, tokens=1, num_pages=1024, page_size=128, dtype="int8"),
    # ... and in 16-token pages, whose scales a TPU arena stores as rows of 128 lanes (KVCache.scale_rows)
    StepCase("decode", "tpu-v5e", "2x2", batch=32, tokens=1, num_pages=8192, page_size=16, dtype="int8"),
    # an int4 arena (the TPU kernels take none: the blockwise jnp path); XLA copies it (RESULTS, "int4 arenas on a
    # TPU"), so aj.create refuses it on a TPU: built here with $ARENA_JAX_ALLOW_INT4_ON_TPU=1 to show why
    StepCase("decode", "tpu-v6e", "2x4", batch=64, tokens=1, num_pages=16384, dtype="int4"),
    # a decode block (`generate(decode_block=8)`: 8 decode steps in one call; its weights+KV are one step's)
    StepCase("decode_block", "tpu-v6e", "2x4", batch=64, tokens=8, num_pages=16384),
    # speculative decoding's verify call (`generate(speculative=PromptLookup(k=4))`: 1 + 4 tokens a row)
    StepCase("verify", "tpu-v5e", "2x2", batch=32, tokens=5, num_pages=8192),
    StepCase("verify", "tpu-v6e", "2x4", batch=64, tokens=5, num_pages=16384),
    # continuous batching's mixed step: 32 decode rows and 2 prompt chunks of 256 tokens in one call (the decode
    # rows and the chunks each attend with their own Mosaic kernel call, per layer)
    StepCase("mixed", "tpu-v5e", "2x2", batch=32, tokens=256, num_pages=8192, chunks=2),
)


def _abstract_model(config, mesh):
    from flax import nnx

    from arena_jax.models.llama import Llama
    from arena_jax.models.parallel import state_shardings

    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: Llama(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    shardings = state_shardings(abstract, config, mesh, tensor_axis="tensor")
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return graphdef, state


def _abstract_cache(layout, mesh):
    import arena_jax as aj
    from arena_jax.sharding import _cache_specs
    from arena_jax.state import ALLOW_INT4_ON_TPU_ENV

    # aj.create refuses an int4 arena on a TPU (the copies this case measures); create it anyway here.
    allow = os.environ.get(ALLOW_INT4_ON_TPU_ENV)
    os.environ[ALLOW_INT4_ON_TPU_ENV] = "1"
    try:
        cache = jax.eval_shape(lambda: aj.create(layout, mesh=mesh, tensor_axis="tensor", data_axis="data"))
    finally:
        if allow is None:
            os.environ.pop(ALLOW_INT4_ON_TPU_ENV)
        else:
            os.environ[ALLOW_INT4_ON_TPU_ENV] = allow
    specs = _cache_specs(cache)
    named = jax.tree.map(cache.sharding.named, specs)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), cache, named)


def step_inputs(case: StepCase):
    """(layout, graphdef, state, cache) of `case`: the model state and the cache as placed
    ShapeDtypeStructs on the case's TPU mesh."""
    from arena_jax.models.config import LlamaConfig
    from pallas_kernels.offline import tpu as tpu_compile

    config = dataclasses.replace(LlamaConfig.llama3_8b(), num_layers=case.num_layers)
    mesh = tpu_compile.mesh_of(case.target, case.mesh, ("data", "tensor"))
    layout = config.kv_layout(page_size=case.page_size, num_pages=case.num_pages, max_seqs=case.batch,
                              max_seq_len=case.max_seq_len, dtype=case.dtype)
    graphdef, state = _abstract_model(config, mesh)
    return layout, graphdef, state, _abstract_cache(layout, mesh)


def compile_step(case: StepCase):
    """Compile `case` for its TPU target; returns (compiled, cache ShapeDtypeStructs, layout)."""
    import arena_jax as aj
    from arena_jax.models import decode_step, prefill
    from pallas_kernels.offline import tpu as tpu_compile

    layout, graphdef, state, cache = step_inputs(case)
    rows = jax.sharding.NamedSharding(cache.k.sharding.mesh, jax.sharding.PartitionSpec("data"))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows)  # noqa: E731
    previous = os.environ.pop(aj.BACKEND_ENV, None)  # the platform's default: Pallas, i.e. Mosaic on a TPU
    try:
        with tpu_compile.tpu_lowering(case.target):
            if case.step == "decode":
                lowered = decode_step.trace(graphdef, state, cache, i32(case.batch), i32(case.batch)).lower()
            elif case.step in ("decode_block", "verify"):  # what generate runs while no request waits; speculating
                from arena_jax.models.sampling import SamplingParams
                from arena_jax.models.steps import bound_steps

                steps = bound_steps(graphdef, state)
                f32 = jax.ShapeDtypeStruct((case.batch,), jnp.float32, sharding=rows)
                sampling = SamplingParams(temperature=f32, top_k=i32(case.batch), top_p=f32)
                seed = jax.ShapeDtypeStruct((), jnp.int32)
                if case.step == "verify":
                    lowered = steps.verify.trace(steps.leaves, cache, i32(case.batch, case.tokens), i32(case.batch),
                                                 i32(case.batch), i32(case.batch), seed, sampling).lower()  # fmt: skip
                else:
                    lowered = steps.decode_block.trace(steps.leaves, cache, i32(case.batch), i32(case.batch),
                                                       i32(case.batch), i32(case.batch), seed, sampling,
                                                       length=case.tokens).lower()  # fmt: skip
            elif case.step == "mixed":
                from arena_jax.models import mixed_step

                lowered = mixed_step.trace(graphdef, state, cache, i32(case.batch), i32(case.batch),
                                           i32(case.chunks, case.tokens), i32(case.chunks), i32(case.chunks),
                                           i32(case.chunks)).lower()  # fmt: skip
            else:
                lowered = prefill.trace(graphdef, state, cache, i32(case.batch, case.tokens), i32(case.batch),
                                        i32(case.batch)).lower()
            compiled = lowered.compile()
    finally:
        if previous is not None:
            os.environ[aj.BACKEND_ENV] = previous
    return compiled, cache, layout
