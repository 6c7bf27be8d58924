"""One process of the two-process test in `tests/test_sharding.py` (not collected: no `test_`).

    python tests/multihost_worker.py PORT PROCESS_ID OUT.json      (PROCESS_ID 0 or 1)

with `JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2`: two processes of
two CPU devices each join `jax.distributed` on 127.0.0.1:PORT (CPU collectives: gloo), build
the same model and cache on a (data=2, tensor=2) mesh whose tensor axis spans both processes
(so every row-parallel all-reduce crosses the process boundary), run one prefill and one
decode step, and write the gathered greedy tokens and logits to OUT.json. Exactly the code a
real multi-host launch runs; only the addresses and device counts differ.
"""
from __future__ import annotations

import json
import sys

import jax


def main(port: int, process_id: int, out_path: str) -> None:
    if hasattr(jax.config, "jax_cpu_collectives_implementation"):  # gloo: the default in JAX 0.10, said explicitly
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=60)  # fmt: skip
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import arena_jax as aj
    from arena_jax import models
    from multihost_case import CONFIG, NEW_STEPS, PAGE_SIZE, SEED, prompts

    assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.device_count())
    by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(2)]
    # rows: data shards; columns: tensor shards, one in each process
    mesh = Mesh(np.asarray([[by_process[0][i], by_process[1][i]] for i in range(2)]), ("data", "tensor"))

    model = models.init_random(CONFIG, seed=SEED, mesh=mesh)  # each process fills its own devices
    graphdef, state = nnx.split(model)
    tokens_host = prompts()
    batch, width = tokens_host.shape
    layout = models.default_layout(model, batch, width + NEW_STEPS + 1, page_size=PAGE_SIZE)
    cache = aj.create(layout, mesh=mesh, data_axis="data")

    def global_array(x):  # the same host value in every process -> one replicated global array
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(cache.sharding.mesh, P()), lambda index: x[index])

    slots = global_array(np.arange(batch, dtype=np.int32))
    out = models.prefill(graphdef, state, cache, global_array(tokens_host), slots, global_array(np.full(batch, width, np.int32)))
    steps = [out]
    for _ in range(NEW_STEPS):
        steps.append(models.decode_step(graphdef, state, steps[-1].cache, steps[-1].tokens, slots))
    gather = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))  # noqa: E731
    result = {
        "process_id": process_id,
        "tokens": [gather(s.tokens).tolist() for s in steps],
        "logits": [gather(s.logits).tolist() for s in steps],
        "ok": [bool(gather(s.ok).all()) for s in steps],
        "health": {k: v for k, v in aj.health(steps[-1].cache).items() if isinstance(v, int)},
    }
    with open(out_path, "w") as fh:
        json.dump(result, fh)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
