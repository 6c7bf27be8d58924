"""Megatron-style tensor parallelism for `Llama` (every family) on a `jax.sharding.Mesh`.

    mesh = jax.make_mesh((1, 8), ("data", "tensor"))
    model = models.init_random(config, mesh=mesh)                 # or load_pretrained(..., mesh=mesh)
    cache = aj.create(layout, mesh=mesh, data_axis="data")        # the arena on the same mesh
    out = models.decode_step(*nnx.split(model), cache, tokens, slots)   # one jit, all devices

Weights are placed once, each device receiving only its part (`place`: from host arrays, so
a checkpoint never passes through one device, and every process of a multi-host mesh gives
its own devices their parts). Each attention and MLP block is column- then row-parallel:

    q [E, N, H]  -> P(None, tensor, None)     query heads split (N % tp == 0)
    k, v [E, K, H] -> P(None, tensor, None)   KV heads split when K % tp == 0; when there are
                                              fewer KV heads than tp (tp % K == 0) they are
                                              replicated: every device computes all K heads
                                              (E*K*H multiply-adds, small next to q's E*N*H) and
                                              `aj.append` keeps the one head its shard stores
    o [N, H, E]  -> P(tensor, None, None)     row-parallel: partial sums, one all-reduce
    gate, up [E, F] -> P(None, tensor)        column-parallel (F % tp == 0)
    down [F, E]  -> P(tensor, None)           row-parallel: one all-reduce
    embedding [V, E], lm_head [V, E]          vocabulary split when V % tp == 0, else replicated
    q_bias [N, H], k_bias, v_bias [K, H]      split like their projection's output heads
    o_bias [E]                                replicated (added after the all-reduce)
    norm scales (q/k norms included)          replicated

The layers' parameters are stacked on a leading [num_layers] axis (`models.llama`): their
specs get a leading None (every device holds its part of every layer). A model built with
`scan_layers=False` (a list of layers) takes the per-layer specs as they are.

so attention runs on each device's own heads against its own shard of the arena, and a
decoder layer communicates twice, once after each row-parallel projection (XLA's
all-reduce of [B, T, E] activations). The residual stream is pinned to rows over the data
axis, replicated over tensor (`arena_jax.sharding.shard_rows`), which is what makes XLA
place exactly those all-reduces. Weights are replicated over the data axis.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from arena_jax.sharding import auto_mesh

__all__ = ["param_spec", "state_shardings", "place", "shard_model", "weights_mesh"]


def _name(path) -> str:
    """The parameter's own name: the last string key of its state path."""
    for key in reversed(path):
        name = getattr(key, "key", getattr(key, "name", key))
        if isinstance(name, str) and name not in ("value", "raw_value"):
            return name
    raise ValueError(f"no parameter name in path {path!r}")


def check_tensor_parallel(config, tp: int, tensor_axis) -> None:
    """ValueError unless the model's heads and MLP width can be split `tp` ways."""
    if tp == 1:
        return
    where = f"the tensor axis {tensor_axis!r} of size {tp}"
    if config.num_heads % tp:
        raise ValueError(f"num_heads={config.num_heads} is not divisible by {where}")
    if config.num_kv_heads % tp and tp % config.num_kv_heads:
        raise ValueError(f"num_kv_heads={config.num_kv_heads} and {where}: one must divide the other")
    if config.intermediate_size % tp:
        raise ValueError(f"intermediate_size={config.intermediate_size} is not divisible by {where}")


def param_spec(name: str, config, tp: int, tensor_axis) -> P:
    """The PartitionSpec of one parameter (by its name in the model) for tensor degree tp; a
    layer's parameter (stacked over layers) takes `P(None, *spec)`."""
    t = tensor_axis
    vocab = t if config.vocab_size % tp == 0 else None
    kv = t if config.num_kv_heads % tp == 0 else None
    specs = {
        "q": P(None, t, None),
        "k": P(None, kv, None),
        "v": P(None, kv, None),
        "o": P(t, None, None),
        "gate": P(None, t),
        "up": P(None, t),
        "down": P(t, None),
        "q_bias": P(t, None),
        "k_bias": P(kv, None),
        "v_bias": P(kv, None),
        "o_bias": P(None),
        "embedding": P(vocab, None),
        "lm_head": P(vocab, None),
        "scale": P(),
    }
    if name not in specs:
        raise ValueError(f"no sharding rule for parameter {name!r}")
    return specs[name]


def state_shardings(state, config, mesh: Mesh, *, tensor_axis: str | None = "tensor"):
    """A tree of NamedShardings matching `state` (an nnx.State of arrays or ShapeDtypeStructs)."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if tensor_axis is not None and tensor_axis not in mesh.axis_names:
        raise ValueError(f"tensor_axis={tensor_axis!r} is not an axis of the mesh (axes: {tuple(mesh.axis_names)})")
    mesh = auto_mesh(mesh)
    tp = mesh.shape[tensor_axis] if tensor_axis else 1
    check_tensor_parallel(config, tp, tensor_axis)

    def spec(path):
        one = param_spec(_name(path), config, tp, tensor_axis)
        return P(None, *one) if _stacked(path) else one

    return jax.tree_util.tree_map_with_path(lambda path, _: NamedSharding(mesh, spec(path)), state)


def _stacked(path) -> bool:
    """A parameter of the stacked layers: its state path starts at the model's `layers` and
    goes on by name (a list of layers goes on by index: not stacked)."""
    keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path[:2]]
    return len(keys) == 2 and keys[0] == "layers" and isinstance(keys[1], str)


def place(tree, shardings):
    """Host (numpy) or single-device arrays -> global arrays with the given shardings.

    Each device receives only its slice. Under `jax.distributed` every process must pass the
    same values; it fills its own devices (`jax.make_array_from_callback`).
    """

    def one(x, sharding):
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def shard_model(model, mesh: Mesh, *, tensor_axis: str | None = "tensor"):
    """The same model with its weights placed over `mesh` (see the module docstring)."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, place(state, state_shardings(state, model.config, mesh, tensor_axis=tensor_axis)))


def weights_mesh(model) -> Mesh | None:
    """The mesh the model's weights are placed on, or None for single-device weights."""
    from flax import nnx

    for leaf in jax.tree.leaves(nnx.state(model)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh
    return None
