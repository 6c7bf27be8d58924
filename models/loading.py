"""`load_pretrained`: a Hugging Face checkpoint folder (Llama, Mistral, Qwen 2 / 3, Gemma 2 / 3
text; dispatched on config.json's model_type) -> `Llama` (+ tokenizer).

    model, tokenizer = load_pretrained("path/to/Meta-Llama-3.1-8B", dtype=jnp.bfloat16)
    model, tokenizer = load_pretrained("meta-llama/Llama-3.1-8B")  # from the local Hugging Face cache

Reads `config.json`, the weights from `model.safetensors` or the shards listed in
`model.safetensors.index.json` (safetensors' numpy reader, no torch), and `tokenizer.json`
with the `tokenizers` library when present (else tokenizer is None). The model is built
abstractly (`nnx.eval_shape`, nothing random is allocated) and filled tensor by tensor;
missing or unexpected tensors, a wrong shape or dtype, an unreadable file all raise ValueError
naming the file and the tensors.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arena_jax.models.config import LlamaConfig
from arena_jax.models.hub import checkpoint_dir
from arena_jax.models.llama import Llama, default_scan_layers

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
    layer: int | None = None  # the index along the stacked layers' leading axis (None: not a layer's)


def hf_tensor_map(config: LlamaConfig, *, scan_layers: bool = True) -> dict[str, TensorSpec]:
    """Hugging Face tensor name -> TensorSpec, for every tensor the config needs.

    A layer's tensors map to slices of the stacked parameters: `("layers", "attn", "q")`
    with `layer=i` is `state["layers"]["attn"]["q"][i]` (with `scan_layers=False`, a list of
    layers: `("layers", i, "attn", "q")`, layer None). Norm names follow the family:
    Llama / Qwen's `post_attention_layernorm` is the pre-MLP norm, Gemma's is the norm after
    attention (its pre-MLP norm is `pre_feedforward_layernorm`).
    """
    e, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
    same = lambda w: w  # noqa: E731
    t = lambda w: np.transpose(w)  # noqa: E731  [out, in] <-> [in, out]

    def heads(count):  # [count*H, E] <-> [E, count, H]
        return (
            lambda w: np.transpose(w.reshape(count, h, e), (2, 0, 1)),
            lambda w: np.transpose(w, (1, 2, 0)).reshape(count * h, e),
        )

    def bias(count):  # [count*H] <-> [count, H]
        return lambda w: w.reshape(count, h), lambda w: w.reshape(count * h)

    norms = {"input_layernorm": "attn_norm"}
    if config.gemma:
        norms.update(post_attention_layernorm="post_attn_norm", pre_feedforward_layernorm="mlp_norm",
                     post_feedforward_layernorm="post_mlp_norm")
    else:
        norms["post_attention_layernorm"] = "mlp_norm"
    out = {"model.embed_tokens.weight": TensorSpec(("embed", "embedding"), (v, e), same, same)}
    for i in range(config.num_layers):
        hf = f"model.layers.{i}."
        layer = {
            "self_attn.q_proj.weight": (("attn", "q"), (n * h, e), *heads(n)),
            "self_attn.k_proj.weight": (("attn", "k"), (k * h, e), *heads(k)),
            "self_attn.v_proj.weight": (("attn", "v"), (k * h, e), *heads(k)),
            # [E, N*H] <-> [N, H, E]
            "self_attn.o_proj.weight": (("attn", "o"), (e, n * h), lambda w: w.T.reshape(n, h, e),
                                        lambda w: w.reshape(n * h, e).T),
            "mlp.gate_proj.weight": (("mlp", "gate"), (f, e), t, t),
            "mlp.up_proj.weight": (("mlp", "up"), (f, e), t, t),
            "mlp.down_proj.weight": (("mlp", "down"), (e, f), t, t),
        }
        if config.qkv_bias:
            layer.update({
                "self_attn.q_proj.bias": (("attn", "q_bias"), (n * h,), *bias(n)),
                "self_attn.k_proj.bias": (("attn", "k_bias"), (k * h,), *bias(k)),
                "self_attn.v_proj.bias": (("attn", "v_bias"), (k * h,), *bias(k)),
            })
        if config.o_bias:
            layer["self_attn.o_proj.bias"] = (("attn", "o_bias"), (e,), same, same)
        if config.qk_norm:
            layer["self_attn.q_norm.weight"] = (("attn", "q_norm", "scale"), (h,), same, same)
            layer["self_attn.k_norm.weight"] = (("attn", "k_norm", "scale"), (h,), same, same)
        for hf_norm, ours in norms.items():
            layer[f"{hf_norm}.weight"] = ((ours, "scale"), (e,), same, same)
        for name, (path, shape, to_ours, to_hf) in layer.items():
            if scan_layers:
                out[hf + name] = TensorSpec(("layers",) + path, shape, to_ours, to_hf, i)
            else:
                out[hf + name] = TensorSpec(("layers", i) + path, shape, to_ours, to_hf)
    out["model.norm.weight"] = TensorSpec(("norm", "scale"), (e,), same, same)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = TensorSpec(("lm_head",), (v, e), same, same)
    return out


def _value(var):
    """A Variable's array (or ShapeDtypeStruct), across flax versions."""
    return var.get_value() if hasattr(var, "get_value") else var.value


def export_hf_tensors(model: Llama) -> dict[str, np.ndarray]:
    """The model's weights as Hugging Face named numpy arrays (the inverse of loading)."""
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    host = {path: np.asarray(_value(var)) for path, var in flat.items()}
    return {
        name: np.ascontiguousarray(spec.to_hf(host[spec.path] if spec.layer is None else host[spec.path][spec.layer]))
        for name, spec in hf_tensor_map(model.config, scan_layers=model.scan_layers).items()
    }


# ---- safetensors -------------------------------------------------------------------------------

# transformers drops these from the unexpected keys when loading Llama / Mistral (its
# `_adjust_missing_and_unexpected_keys`: older checkpoints saved every layer's RoPE inverse
# frequencies, which are now computed, never loaded). Exactly that pattern is ignored here.
IGNORED_TENSORS = re.compile(r"rotary_emb\.inv_freq")
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_LISTED = 8  # tensor names listed in an error before "and N more"


def _read_bf16(path: str, name: str) -> np.ndarray:
    """numpy has no bfloat16, so older safetensors' numpy reader refuses BF16 tensors: read the
    raw bytes at the offsets the file's header gives, as ml_dtypes.bfloat16. (`read_safetensors`
    has already opened the file with safetensors, which checks header and data lengths.)"""
    import ml_dtypes

    with open(path, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        info = json.loads(fh.read(header_len))[name]
        begin, end = info["data_offsets"]
        fh.seek(8 + header_len + begin)
        data = fh.read(end - begin)
    return np.frombuffer(data, dtype=ml_dtypes.bfloat16).reshape(info["shape"])


class _Stored(NamedTuple):
    path: str
    dtype: str  # safetensors' name: "F32", "BF16", ...
    shape: tuple[int, ...]


def _weight_files(model_dir: str) -> list[str]:
    """The files transformers would load: the index's shards, else model.safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
            raise ValueError(f"{index}: not a JSON object with a weight_map ({exc})") from None
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: weight_map must be a non-empty JSON object of tensor name -> file name")
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
        if absent:
            raise ValueError(f"{index} names shard files that are not in {model_dir}: {', '.join(absent)}")
        return [os.path.join(model_dir, f) for f in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"no model.safetensors or model.safetensors.index.json (safetensors weights) in {model_dir}")


def read_safetensors(model_dir: str) -> dict[str, _Stored]:
    """Tensor name -> where it is stored, its dtype and shape, over the single file or the
    index's shards. A file safetensors cannot read (truncated, corrupt) is a ValueError naming it."""
    from safetensors import SafetensorError, safe_open

    where: dict[str, _Stored] = {}
    for path in _weight_files(model_dir):
        try:
            with safe_open(path, framework="numpy") as fh:
                for key in fh.keys():
                    if key in where:
                        raise ValueError(f"tensor {key!r} is stored twice: in {where[key].path} and {path}")
                    piece = fh.get_slice(key)
                    where[key] = _Stored(path, piece.get_dtype(), tuple(piece.get_shape()))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
    return where


def _get_tensor(stored: _Stored, name: str) -> np.ndarray:
    from safetensors import SafetensorError, safe_open

    try:
        if stored.dtype.upper() in ("BF16", "BFLOAT16"):
            return _read_bf16(stored.path, name)
        with safe_open(stored.path, framework="numpy") as fh:
            return fh.get_tensor(name)
    except (SafetensorError, OSError, ValueError) as exc:  # ValueError: raw bytes that do not fill the shape
        raise ValueError(f"{stored.path}: cannot read tensor {name!r} ({exc})") from None


def _names(names: list[str], describe=lambda n: n) -> str:
    shown = ", ".join(describe(n) for n in names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def _check_tensor_names(model_dir: str, where: dict[str, _Stored], expected: dict[str, TensorSpec], tied: bool) -> None:
    """Exactly the tensors the config describes (a tied head may also be stored, see load_pretrained)."""
    missing = [n for n in expected if n not in where]
    extra = [n for n in where if n not in expected and not IGNORED_TENSORS.search(n) and not (tied and n == "lm_head.weight")]
    if not missing and not extra:
        return
    parts = []
    if missing:
        parts.append(f"it lacks {len(missing)} tensor(s) the config needs: {_names(missing, lambda n: f'{n} {expected[n].hf_shape}')}")
    if extra:
        parts.append(f"it holds {len(extra)} tensor(s) the config does not describe: {_names(sorted(extra))}")
    raise ValueError(f"the checkpoint in {model_dir} does not match its config.json: " + "; ".join(parts))


# ---- public -------------------------------------------------------------------------------------


def load_tokenizer(model_dir: str):
    """`tokenizers.Tokenizer` from `tokenizer.json`, or None if the folder has none (`model_dir`: a
    folder or a Hugging Face name in the local cache, `models.checkpoint_dir`)."""
    path = os.path.join(checkpoint_dir(model_dir), "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for any malformed file
        raise ValueError(f"{path}: not a valid tokenizer.json ({exc})") from None


def load_pretrained(
    model_dir, *, dtype=jnp.bfloat16, param_dtype=None, mesh=None, tensor_axis: str | None = "tensor",
    scan_layers: bool | None = None,
) -> Pretrained:
    """Build a `Llama` from a Hugging Face folder; weights cast to `param_dtype` (default `dtype`).
    `model_dir`: the folder, or a Hugging Face name ("org/name") already in the local Hugging Face
    cache (`models.checkpoint_dir`: nothing is downloaded; a name not there is a FileNotFoundError
    saying how to download it). `scan_layers`: stacked layers run by a scan (True) or a list of
    layers (False; see `Llama`); None (default): `models.default_scan_layers` on the platform the
    weights go to (a scan, except on a CPU for layers of 1 MiB of weights or more: a scan's
    matmuls there copy every layer's weights every step).

    With a `mesh`, each tensor goes from the host straight to its devices, split Megatron style
    over `tensor_axis` (`models.parallel`): no device ever holds the whole model. The layers'
    tensors of one kind (e.g. every q_proj) are stacked on the host, then transferred at once:
    host memory peaks at one kind's share of the weights.

    The checkpoint must hold exactly the tensors its config.json describes, with their shapes
    and a float dtype (else ValueError listing the names); old checkpoints' per-layer
    `rotary_emb.inv_freq` buffers are ignored, as transformers ignores them. The config's
    `eos_token_ids` come from generation_config.json when present (see `LlamaConfig.from_hf`).
    """
    model_dir = checkpoint_dir(model_dir)
    config = LlamaConfig.from_hf(model_dir)
    param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
    if scan_layers is None:
        platform = None if mesh is None else mesh.devices.flat[0].platform
        scan_layers = default_scan_layers(config, param_dtype, platform)
    elif not isinstance(scan_layers, bool):
        raise ValueError(f"scan_layers must be a bool or None (the platform's default), got {scan_layers!r}")
    expected = hf_tensor_map(config, scan_layers=scan_layers)
    where = read_safetensors(model_dir)
    _check_tensor_names(model_dir, where, expected, config.tie_word_embeddings)
    for name, spec in expected.items():
        stored = where[name]
        if tuple(stored.shape) != spec.hf_shape:
            raise ValueError(f"tensor {name!r} has shape {stored.shape}, but the config expects {spec.hf_shape}")
        if stored.dtype.upper() not in _FLOAT_DTYPES:
            raise ValueError(f"tensor {name!r} in {stored.path} has dtype {stored.dtype}; expected one of {_FLOAT_DTYPES}")
    if config.tie_word_embeddings and "lm_head.weight" in where:
        # transformers then unties the head when it differs from the embedding; refuse instead.
        head = _get_tensor(where["lm_head.weight"], "lm_head.weight")
        embed = _get_tensor(where["model.embed_tokens.weight"], "model.embed_tokens.weight")
        if head.shape != embed.shape or not np.array_equal(head, embed):
            raise ValueError(
                f"{model_dir}: config.json ties the output head to the embedding (tie_word_embeddings true), but the "
                "checkpoint stores a different lm_head.weight; set tie_word_embeddings to false to use it"
            )
    abstract = nnx.eval_shape(
        lambda: Llama(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0), scan_layers=scan_layers)
    )
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    put = lambda path, host: jnp.asarray(host, dtype=param_dtype)  # noqa: E731
    if mesh is not None:
        from arena_jax.models.parallel import place, state_shardings

        placement = dict(nnx.to_flat_state(state_shardings(state, config, mesh, tensor_axis=tensor_axis)))
        put = lambda path, host: place(np.asarray(host).astype(param_dtype), _value(placement[path]))  # noqa: E731
    by_path: dict[tuple, list[tuple[str, TensorSpec]]] = {}
    for name, spec in expected.items():
        by_path.setdefault(spec.path, []).append((name, spec))
    for path, specs in by_path.items():
        shape = _value(flat[path]).shape
        if specs[0][1].layer is None:
            (name, spec), = specs
            host = spec.to_ours(_get_tensor(where[name], name))
        else:  # a stacked parameter: every layer's tensor into its slice, on the host, then one transfer
            host = np.empty(shape, param_dtype)
            for name, spec in specs:
                host[spec.layer] = spec.to_ours(_get_tensor(where[name], name))
        assert host.shape == shape, (path, host.shape, shape)  # our own mapping, not user input
        flat[path] = flat[path].replace(put(path, host))
    state = nnx.from_flat_state(list(flat.items()))
    model = nnx.merge(graphdef, state)
    leftover = [p for p, var in nnx.to_flat_state(nnx.state(model)) if isinstance(_value(var), jax.ShapeDtypeStruct)]
    if leftover:  # every parameter must have come from the checkpoint
        raise ValueError(f"parameters not filled from the checkpoint: {leftover}")
    return Pretrained(model, load_tokenizer(model_dir))
