"""Flax NNX decoders on the arena_jax paged KV cache: Llama 2/3, Mistral, Qwen 2 / 2.5, Qwen 3
(dense), Gemma 2 and Gemma 3 (text), one `LlamaConfig` and one `Llama` for all (see models.config).

    from arena_jax import models
    model, tokenizer = models.load_pretrained("path/to/checkpoint", dtype=jnp.bfloat16)  # or "org/name" in the HF cache
    result = models.generate(model, [[1, 2, 3]], max_new_tokens=32)
    result = models.generate(model, prompts, 64, sampling=models.Sampling(temperature=0.7, seed=1),
                             serving=models.Serving(batch_size=16, prefix_cache=True))   # options as objects

or a random-weight model: `models.init_random(models.LlamaConfig.tiny(), seed=0)` (fast: one
numpy draw on CPU, one jitted call elsewhere) or `models.Llama(config, rngs=nnx.Rngs(0))`.
`prefill` / `decode_step` / `mixed_step` are the jitted steps (see models.steps); the layers run in one
`jax.lax.scan` (models.llama; `scan_layers=False` for a Python loop); `models.dense_baseline`
runs the same model with a conventional dense KV cache for comparison.

Many devices: `init_random(..., mesh=)` / `load_pretrained(..., mesh=)` place the weights
Megatron style (`models.parallel`), and with a cache from `aj.create(layout, mesh=...)` the
same `prefill` / `decode_step` / `generate(..., mesh=)` run across the mesh.

`generate` stops at `model.config.eos_token_ids` (a checkpoint's eos tokens, read as
transformers' generate reads them) unless given `stop_tokens`. Configs are read by
`arena_jax.hf.config` (transformers' defaults and types); bad input of any kind is a
ValueError naming the argument, file or key, and the limit.

This folder installs as `arena_jax.models` (a user's own `models` package never shadows it). Old
module paths kept: in a source checkout `import models` is this package (`models.llama is
arena_jax.models.llama`); `models.decode_ahead` is `models.scheduler.run_ahead` (the scheduler is
a package now, one module per idea: models.scheduler).
"""
import sys

if __name__ == "models":  # imported by its old top-level name (a source checkout): be arena_jax.models
    from pallas_kernels._moved import alias_tree

    alias_tree("models", "arena_jax.models")

from arena_jax.models import presets
from arena_jax.models.config import LlamaConfig, RopeScaling
from arena_jax.models.dense_baseline import DenseCache, dense_decode, dense_generate, dense_prefill, init_dense_cache
from arena_jax.models.generate import Generation, default_chunk_size, default_decode_block, default_layout, generate, length_bucket
from arena_jax.models.host_tier import SwapPolicy
from arena_jax.models.key_calibration import calibrate_key_factors
from arena_jax.models.layers import MLP, Attention, Embedder, RMSNorm, apply_rope, rope_frequencies
from arena_jax.models.llama import CPU_LIST_LAYER_BYTES, Block, Llama, default_scan_layers, init_random, token_positions
from arena_jax.models.options import Parallelism, Serving
from arena_jax.models.parallel import shard_model, weights_mesh
from arena_jax.models.hub import checkpoint_dir
from arena_jax.models.loading import Pretrained, TensorSpec, export_hf_tensors, hf_tensor_map, load_pretrained, load_tokenizer
from arena_jax.models.sampling import GREEDY, Sampling, SamplingParams, filter_logits, sample
from arena_jax.models.scheduler import run_ahead as decode_ahead  # the module's old path (models.decode_ahead)
from arena_jax.models.draft import DraftModel, first_layers
from arena_jax.models.speculative import PromptLookup
from arena_jax.models.text import TextGeneration, TextStream, TextTokenizer, generate_text
from arena_jax.models.steps import TRACE_COUNTS, StepOutput, decode_step, mixed_step, prefill, release_rows

sys.modules[f"{__name__}.decode_ahead"] = decode_ahead

__all__ = [
    "LlamaConfig",
    "RopeScaling",
    "Llama",
    "Block",
    "init_random",
    "default_scan_layers",
    "CPU_LIST_LAYER_BYTES",
    "shard_model",
    "weights_mesh",
    "Attention",
    "MLP",
    "RMSNorm",
    "Embedder",
    "apply_rope",
    "rope_frequencies",
    "token_positions",
    "load_pretrained",
    "load_tokenizer",
    "checkpoint_dir",
    "hf_tensor_map",
    "export_hf_tensors",
    "TensorSpec",
    "Pretrained",
    "prefill",
    "decode_step",
    "mixed_step",
    "release_rows",
    "StepOutput",
    "TRACE_COUNTS",
    "generate",
    "Generation",
    "generate_text",
    "PromptLookup",
    "DraftModel",
    "first_layers",
    "TextGeneration",
    "TextTokenizer",
    "TextStream",
    "Serving",
    "Parallelism",
    "default_layout",
    "default_decode_block",
    "default_chunk_size",
    "length_bucket",
    "SwapPolicy",
    "calibrate_key_factors",
    "DenseCache",
    "init_dense_cache",
    "dense_prefill",
    "dense_decode",
    "dense_generate",
    "Sampling",
    "SamplingParams",
    "GREEDY",
    "sample",
    "filter_logits",
]
