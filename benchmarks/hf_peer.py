"""`transformers` as a second peer in `arena-bench decode` (issue 17.5): the same weights, the
same prompts, greedy, on CPU.

The model's weights are exported to Hugging Face names (`models.loading.export_hf_tensors`), its
config to a `config.json` dict (`LlamaConfig.to_hf`), and transformers builds its own model of
that `model_type` from them (`AutoModelForCausalLM.from_config`, eager attention, the model's
dtype). The run mirrors the arena's: one forward over the prompts (prefill, `use_cache=True`),
then `new_tokens - 1` single-token forwards with transformers' own KV cache
(`past_key_values`), argmax each step — a hand loop, not `generate`, so that no sampling or
stopping machinery is timed on either side. torch runs on `threads` threads (1 by default);
JAX's CPU thread pool is XLA's (all cores) unless `XLA_FLAGS` limits it, which the result
states: `XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"` before
the command makes both sides one thread.
"""
from __future__ import annotations

import os
import time

import numpy as np

__all__ = ["unavailable_reason", "HFRun", "hf_model", "jax_threads"]


def unavailable_reason(platform: str, mesh) -> str | None:
    """Why transformers cannot run beside this decode run (None: it can)."""
    if platform != "cpu":
        return f"the arena runs on {platform}; the transformers peer is a CPU comparison"
    if mesh is not None:
        return "a --mesh run: the transformers peer runs on one device"
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return f"transformers / torch not installed ({exc.name}); `pip install -e '.[test]'` brings them"
    return None


def jax_threads() -> str:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen=false" in flags and "intra_op_parallelism_threads=1" in flags:
        return "1 (XLA_FLAGS)"
    return f"XLA's pool ({os.cpu_count()} cores)"


def hf_model(model, device: str = "cpu", attention: str = "eager"):
    """transformers' model of `model`'s `model_type` on its weights (`export_hf_tensors`), in its
    dtype, on torch's `device`, in eval mode; `attention`: transformers' implementation name."""
    import torch
    import transformers

    from arena_jax.models.loading import export_hf_tensors

    transformers.logging.set_verbosity_error()
    hf_dict = dict(model.config.to_hf())
    model_type = hf_dict.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **hf_dict)
    config._attn_implementation = attention
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[np.dtype(model.dtype).name]
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    tensors = {}
    for name, a in export_hf_tensors(model).items():
        a = np.array(a)  # (a writable copy; bfloat16 travels as its bits)
        t = torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16) if a.dtype.name == "bfloat16" else torch.from_numpy(a)
        tensors[name] = t.to(device=device, dtype=dtype)
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"transformers' {type(hf).__name__} does not take our tensors: missing {sorted(missing)}, "
                           f"unexpected {sorted(unexpected)}")  # fmt: skip
    if tied:
        hf.tie_weights()
    return hf.eval()


class HFRun:
    """transformers' model on the arena model's weights. `run()` -> (tokens i32[B, new_tokens],
    prefill seconds, [decode step seconds]), like the arena and dense runs."""

    def __init__(self, model, prompts: np.ndarray, new_tokens: int, threads: int = 1):
        import torch

        hf = hf_model(model)
        self.torch_dtype = hf.dtype
        self.hf = hf
        self.torch = torch
        self.prompts = torch.from_numpy(np.asarray(prompts, np.int64))
        self.steps = new_tokens - 1
        self.threads = threads
        self.name = type(hf).__name__

    def run(self):
        torch = self.torch
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = self.hf(input_ids=self.prompts, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1)
                prefill_s = time.perf_counter() - t0
                past, toks, steps = out.past_key_values, [nxt], []
                for _ in range(self.steps):
                    t0 = time.perf_counter()
                    out = self.hf(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
                    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
                    steps.append(time.perf_counter() - t0)
                    toks.append(nxt)
        finally:
            torch.set_num_threads(before)
        return torch.stack(toks, dim=1).numpy().astype(np.int32), prefill_s, steps
