"""`load_pretrained`: a Hugging Face Llama / Mistral checkpoint folder -> `Llama` (+ tokenizer).

    model, tokenizer = load_pretrained("path/to/Meta-Llama-3.1-8B", dtype=jnp.bfloat16)

Reads `config.json`, the weights from `model.safetensors` or the shards listed in
`model.safetensors.index.json` (safetensors' numpy reader, no torch), and `tokenizer.json`
with the `tokenizers` library when present (else tokenizer is None). The model is built
abstractly (`nnx.eval_shape`, nothing random is allocated) and filled tensor by tensor;
a missing tensor or a wrong shape raises ValueError naming the tensor and the expected shape.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import LlamaConfig
from models.llama import Llama

__all__ = [
    "Pretrained",
    "TensorSpec",
    "load_pretrained",
    "load_tokenizer",
    "hf_tensor_map",
    "export_hf_tensors",
    "read_safetensors",
]


class Pretrained(NamedTuple):
    model: Llama
    tokenizer: Any  # tokenizers.Tokenizer, or None when the folder has no tokenizer.json


class TensorSpec(NamedTuple):
    path: tuple  # where the array lives in the model's NNX state
    hf_shape: tuple[int, ...]  # the Hugging Face tensor's shape ([out, in] for projections)
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def hf_tensor_map(config: LlamaConfig) -> dict[str, TensorSpec]:
    """Hugging Face tensor name -> TensorSpec, for every tensor the config needs."""
    e, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
    same = lambda w: w  # noqa: E731
    t = lambda w: np.transpose(w)  # noqa: E731  [out, in] <-> [in, out]

    def heads(count):  # [count*H, E] <-> [E, count, H]
        return (
            lambda w: np.transpose(w.reshape(count, h, e), (2, 0, 1)),
            lambda w: np.transpose(w, (1, 2, 0)).reshape(count * h, e),
        )

    out = {"model.embed_tokens.weight": TensorSpec(("embed", "embedding"), (v, e), same, same)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", ("layers", i)
        out.update(
            {
                hf + "self_attn.q_proj.weight": TensorSpec(ours + ("attn", "q"), (n * h, e), *heads(n)),
                hf + "self_attn.k_proj.weight": TensorSpec(ours + ("attn", "k"), (k * h, e), *heads(k)),
                hf + "self_attn.v_proj.weight": TensorSpec(ours + ("attn", "v"), (k * h, e), *heads(k)),
                hf + "self_attn.o_proj.weight": TensorSpec(  # [E, N*H] <-> [N, H, E]
                    ours + ("attn", "o"), (e, n * h), lambda w: w.T.reshape(n, h, e), lambda w: w.reshape(n * h, e).T
                ),
                hf + "mlp.gate_proj.weight": TensorSpec(ours + ("mlp", "gate"), (f, e), t, t),
                hf + "mlp.up_proj.weight": TensorSpec(ours + ("mlp", "up"), (f, e), t, t),
                hf + "mlp.down_proj.weight": TensorSpec(ours + ("mlp", "down"), (e, f), t, t),
                hf + "input_layernorm.weight": TensorSpec(ours + ("attn_norm", "scale"), (e,), same, same),
                hf + "post_attention_layernorm.weight": TensorSpec(ours + ("mlp_norm", "scale"), (e,), same, same),
            }
        )
    out["model.norm.weight"] = TensorSpec(("norm", "scale"), (e,), same, same)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = TensorSpec(("lm_head",), (v, e), t, t)
    return out


def _value(var):
    """A Variable's array (or ShapeDtypeStruct), across flax versions."""
    return var.get_value() if hasattr(var, "get_value") else var.value


def export_hf_tensors(model: Llama) -> dict[str, np.ndarray]:
    """The model's weights as Hugging Face named numpy arrays (the inverse of loading)."""
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    return {
        name: np.ascontiguousarray(spec.to_hf(np.asarray(_value(flat[spec.path]))))
        for name, spec in hf_tensor_map(model.config).items()
    }


# ---- safetensors -------------------------------------------------------------------------------


def _read_bf16(path: str, name: str) -> np.ndarray:
    """numpy has no bfloat16, so safetensors' numpy reader refuses BF16 tensors: read the raw
    bytes at the offsets the file's header gives, as ml_dtypes.bfloat16."""
    import ml_dtypes

    with open(path, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        info = json.loads(fh.read(header_len))[name]
        begin, end = info["data_offsets"]
        fh.seek(8 + header_len + begin)
        data = fh.read(end - begin)
    return np.frombuffer(data, dtype=ml_dtypes.bfloat16).reshape(info["shape"])


def read_safetensors(model_dir: str) -> dict[str, tuple[str, str]]:
    """Tensor name -> (file, dtype string) over the single file or the index's shards."""
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    where = {}
    for name in files:
        path = os.path.join(model_dir, name)
        with safe_open(path, framework="numpy") as fh:
            for key in fh.keys():
                where[key] = (path, fh.get_slice(key).get_dtype())
    return where


def _get_tensor(path: str, dtype: str, name: str) -> np.ndarray:
    if dtype.upper() in ("BF16", "BFLOAT16"):
        return _read_bf16(path, name)
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as fh:
        return fh.get_tensor(name)


# ---- public -------------------------------------------------------------------------------------


def load_tokenizer(model_dir: str):
    """`tokenizers.Tokenizer` from `tokenizer.json`, or None if the folder has none."""
    path = os.path.join(os.fspath(model_dir), "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def load_pretrained(model_dir, *, dtype=jnp.bfloat16, param_dtype=None) -> Pretrained:
    """Build a `Llama` from a Hugging Face folder; weights cast to `param_dtype` (default `dtype`)."""
    model_dir = os.fspath(model_dir)
    config = LlamaConfig.from_hf(model_dir)
    param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
    abstract = nnx.eval_shape(lambda: Llama(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    where = read_safetensors(model_dir)
    for name, spec in hf_tensor_map(config).items():
        if name not in where:
            raise ValueError(f"checkpoint lacks tensor {name!r} (expected shape {spec.hf_shape}) in {model_dir}")
        array = _get_tensor(*where[name], name)
        if tuple(array.shape) != spec.hf_shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(array.shape)}, but the config expects {spec.hf_shape}")
        value = jnp.asarray(spec.to_ours(array), dtype=param_dtype)
        expected = _value(flat[spec.path]).shape
        assert value.shape == expected, (name, value.shape, expected)  # our own mapping, not user input
        flat[spec.path] = flat[spec.path].replace(value)
    state = nnx.from_flat_state(list(flat.items()))
    model = nnx.merge(graphdef, state)
    leftover = [p for p, var in nnx.to_flat_state(nnx.state(model)) if isinstance(_value(var), jax.ShapeDtypeStruct)]
    if leftover:  # every parameter must have come from the checkpoint
        raise ValueError(f"parameters not filled from the checkpoint: {leftover}")
    return Pretrained(model, load_tokenizer(model_dir))
