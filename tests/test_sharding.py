"""Many devices, from the single-device test process.

JAX fixes its device count when it starts, and this process started with one CPU device. So
the 8-device checks (`tests/sharded_checks.py`) run in ONE child pytest with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` set before JAX starts: one interpreter
start and every check sharing its compiles (three children cost 167-170 s against one child's
106-122 s in CI; the child trades LLVM optimization, which the checks do not need, for compile
time). The multi-host test starts two worker
processes that join `jax.distributed` on 127.0.0.1 (CPU collectives) and compares their one
prefill + decode step with this process's single-device run.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import arena_jax as aj
from arena_jax import models

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
# The children inherit the suite's XLA_FLAGS (tests/conftest.py: optimization level 0, or the
# level the caller named) and add less LLVM work still.
FAST_COMPILE = "--xla_llvm_disable_expensive_passes=true"


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices} {FAST_COMPILE}".strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _tail(text: str, lines: int = 80) -> str:
    return "\n".join(text.splitlines()[-lines:])


@pytest.mark.timeout(900)  # one child: 106-122 s unloaded in CI (2026-11-27); 2x load stays far below
def test_sharded_checks_on_8_host_devices():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(TESTS / "sharded_checks.py"), "-p", "no:cacheprovider", "--durations=5"],
        cwd=ROOT, env=_env(8), capture_output=True, text=True, timeout=880,
    )  # fmt: skip  (a guard against a hang, not a timing)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, "8-device checks failed:\n" + _tail(out)
    summary = re.findall(r"^=* ?(\d+ passed.*) in [\d.]+s", out, re.M)
    assert summary and re.fullmatch(r"\d+ passed", summary[-1]), _tail(out)  # all ran: none skipped
    print(_tail(out, 12))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What process 0 prints when its coordinator cannot bind the port (taken since `_free_port`
# closed it: the other CI line's servers and client connections share the ephemeral range); gRPC's
# line, before a JaxRuntimeError or (1 run in 4 on jaxlib 0.10.2) a segfault.
PORT_TAKEN = "Failed to add port to server"


def _start_workers(outs) -> list:
    port = _free_port()
    return [
        subprocess.Popen([sys.executable, str(TESTS / "multihost_worker.py"), str(port), str(i), str(outs[i])],
                         cwd=ROOT, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for i in range(2)
    ]


def test_two_processes_one_decode_step_equals_one_process(tmp_path):
    """2 processes x 2 CPU devices, mesh data=2 x tensor=2 with the tensor axis across the
    processes: one prefill and one decode step equal this process's single-device run. (A
    coordinator port taken before it was bound starts both workers again on another, twice at most.)"""
    from multihost_case import CONFIG, NEW_STEPS, PAGE_SIZE, SEED, prompts

    outs = [tmp_path / f"process{i}.json" for i in range(2)]
    workers = _start_workers(outs)
    try:
        # meanwhile, the single-process reference
        model = models.init_random(CONFIG, seed=SEED)
        graphdef, state = nnx.split(model)
        tokens = prompts()
        batch, width = tokens.shape
        cache = aj.create(models.default_layout(model, batch, width + NEW_STEPS + 1, page_size=PAGE_SIZE))
        slots = jnp.arange(batch, dtype=jnp.int32)
        steps = [models.prefill(graphdef, state, cache, jnp.asarray(tokens), slots, jnp.full((batch,), width, jnp.int32))]
        for _ in range(NEW_STEPS):
            steps.append(models.decode_step(graphdef, state, steps[-1].cache, steps[-1].tokens, slots))
        for attempt in range(3):
            first = workers[0].communicate(timeout=240)[0]
            if attempt < 2 and workers[0].returncode and PORT_TAKEN in first:
                workers[1].kill()  # (it would wait for the coordinator until its timeout)
                workers[1].communicate()
                workers = _start_workers(outs)
                continue
            logs = [first, workers[1].communicate(timeout=240)[0]]
            break
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    for i, w in enumerate(workers):
        assert w.returncode == 0, f"process {i} failed:\n{_tail(logs[i])}"
    got = [json.loads(p.read_text()) for p in outs]
    assert got[0]["tokens"] == got[1]["tokens"]
    assert all(got[0]["ok"])
    for step, g_tokens, g_logits in zip(steps, got[0]["tokens"], got[0]["logits"]):
        np.testing.assert_array_equal(g_tokens, np.asarray(step.tokens))
        np.testing.assert_allclose(g_logits, np.asarray(step.logits), rtol=1e-5, atol=1e-5)
    health = got[0]["health"]
    assert (health["devices"], health["tensor_parallel"], health["data_parallel"]) == (4, 2, 2)
    assert health["tokens_written"] == batch * (width + NEW_STEPS)


def test_bench_mesh_flag(capsys):
    """`--mesh` is parsed, and a mesh larger than the process's devices is a usage error that
    says how to get host devices on a CPU (the sharded run itself: the 8-device checks and
    benchmarks/RESULTS.md)."""
    import argparse

    from arena_jax.benchmarks.cli import main, mesh_spec

    assert mesh_spec("tp=8") == (1, 8) and mesh_spec("dp=2,tp=4") == (2, 4) and mesh_spec("dp=2") == (2, 1)
    for bad in ("tp=0", "tp=2,tp=2", "pp=2", "tp", "tp=x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected 'tp=N'"):
            mesh_spec(bad)
    with pytest.raises(SystemExit) as exc:
        main(["decode", "--mesh", "tp=8", "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--mesh dp=1,tp=8 needs 8 devices; this process has 1" in err
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in err


def test_one_device_path_is_untouched():
    """An unsharded cache carries no sharding, and a cache on a 1-device mesh is a sharded one."""
    import jax

    layout = aj.KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, page_size=4, num_pages=8, max_seqs=2,
                         max_pages_per_seq=4, dtype="float32")  # fmt: skip
    assert aj.create(layout).sharding is None
    mesh = jax.make_mesh((1,), ("tensor",))
    cache = aj.create(layout, mesh=mesh)
    assert cache.sharding.tp == 1 and cache.layout == layout
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        aj.create(layout, mesh="tp=1")


def test_megatron_rules_and_limits():
    """Which weight is split how (models.parallel), and the degrees a model refuses."""
    from jax.sharding import PartitionSpec as P

    from arena_jax.models.parallel import check_tensor_parallel, param_spec

    cfg = models.LlamaConfig.tiny()  # 4 query / 2 KV heads, MLP 128, vocabulary 128
    assert param_spec("q", cfg, 4, "tensor") == P(None, "tensor", None)  # column-parallel
    assert param_spec("k", cfg, 2, "tensor") == P(None, "tensor", None)  # KV heads split...
    assert param_spec("k", cfg, 4, "tensor") == P(None, None, None)  # ...or replicated when fewer than tp
    assert param_spec("o", cfg, 4, "tensor") == P("tensor", None, None)  # row-parallel
    assert param_spec("down", cfg, 4, "tensor") == P("tensor", None)
    assert param_spec("lm_head", cfg, 4, "tensor") == P("tensor", None)  # vocabulary split
    assert param_spec("lm_head", models.LlamaConfig.tiny(vocab_size=130), 4, "tensor") == P(None, None)
    check_tensor_parallel(cfg, 4, "tensor")
    # the families' own parameters: biases split like their projection's heads, q/k norms replicated
    assert param_spec("q_bias", cfg, 4, "tensor") == P("tensor", None)
    assert param_spec("k_bias", cfg, 2, "tensor") == P("tensor", None)
    assert param_spec("v_bias", cfg, 4, "tensor") == P(None, None)  # 2 KV heads on tp=4: replicated, as k / v
    assert param_spec("o_bias", cfg, 4, "tensor") == P(None)
    # stacked layers: a leading None; what lies outside the layers keeps its own spec
    from arena_jax.models.parallel import state_shardings

    qwen3 = models.LlamaConfig.tiny_family("qwen3", attention_bias=True)
    abstract = nnx.state(nnx.eval_shape(lambda: models.Llama(qwen3, rngs=nnx.Rngs(0))))
    mesh = jax.make_mesh((1,), ("tensor",))
    specs = {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(state_shardings(abstract, qwen3, mesh))}
    find = lambda *names: next(v for k, v in specs.items() if all(f"'{n}'" in k for n in names))  # noqa: E731
    assert find("layers", "attn", "q") == P(None, None, "tensor", None)
    assert find("layers", "q_bias") == P(None, "tensor", None)
    assert find("layers", "o_bias") == P(None, None)
    assert find("layers", "q_norm", "scale") == P(None)
    assert find("embed", "embedding") == P("tensor", None)
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by the tensor axis 'tensor' of size 8"):
        check_tensor_parallel(cfg, 8, "tensor")
    with pytest.raises(ValueError, match="num_kv_heads=2 and the tensor axis 'tensor' of size 3"):
        check_tensor_parallel(models.LlamaConfig.tiny(num_heads=6, num_kv_heads=2, hidden_size=96), 3, "tensor")
