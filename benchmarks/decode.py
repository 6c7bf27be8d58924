"""`arena-bench decode`: greedy generation on the paged arena vs the same model on a dense cache.

Both paths run in one process on one model with the same weights and the same random
prompts, as one static batch (`kv_dtype` may make the paged arena 8-bit while the dense cache
stays in the model's dtype: the byte figures then compare the two, and greedy tokens may
differ by quantization; `token_agreement` says how many are equal): one prefill call over the prompts, then `new_tokens - 1`
decode steps. Paged: `models.prefill` / `models.decode_step` (reserve + every layer's
append/attend + greedy sampling in one jitted call each). Dense: `models.dense_baseline`
(`[layers, batch, max_len, kv_heads, head_dim]`, one dynamic_update_slice per layer into the
loop-carried cache, in place). Any model family (`--model`, `--model-dir`).

Timing: each call is followed by `jax.block_until_ready` before the clock is read. The first
(warm-up) runs compile and are excluded; compile time is reported separately as the first
calls' time minus the median warm call, the prefill's and the decode step's (issue 39, item 4,
compares the decode steps). Arena and dense repeats alternate, the order flipping every repeat,
so drift on a shared machine, and whatever running first costs, hit both. Tokens/s is the
median over repeats of batch * decode steps / decode time; step latencies p50/p99 are over all
timed steps.

`mesh=(dp, tp)`: the same run sharded over dp * tp devices. The model's weights are placed
Megatron style (`models.parallel`), the arena split over KV heads (tensor) and over slots
and pages (data, when dp > 1), the dense baseline's cache split alike ([L, B, K, S, H]:
rows over data, KV heads over tensor when they divide); greedy tokens are compared as
without a mesh. On a CPU with host devices it is a functional check.

`hf=True`: a third run, `transformers` on the same weights and prompts (`benchmarks.hf_peer`:
its own model class and KV cache, a hand greedy loop timed like ours, torch on `hf_threads`
threads), alternated with the other two; its tokens are compared with the arena's.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import arena_jax as aj
from arena_jax import models
from arena_jax.models import dense_baseline
from arena_jax.benchmarks.presets import default_dtype, preset
from arena_jax.models.memory import TooLarge, cache_bytes, check_fits, host_memory_limit, weight_bytes

__all__ = ["DecodeSettings", "run_decode", "build_model", "check_memory", "ModelTooLarge"]


class ModelTooLarge(TooLarge):
    """The run would not fit in memory (the CLI turns it into a clean error)."""


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    model: str = "tiny"
    model_dir: str | None = None
    batch: int = 4
    prompt_len: int = 32
    new_tokens: int = 32
    repeats: int = 5
    warmup: int = 1
    page_size: int = 16
    dtype: str | None = None  # default: float32 for the CPU presets (tiny*, mid), bfloat16 otherwise
    kv_dtype: str | None = None  # the paged arena's; default: dtype (8-bit: int8, float8_e4m3fn, float8_e5m2)
    num_layers: int | None = None  # override the preset's depth (random weights only)
    seed: int = 0
    mesh: tuple[int, int] | None = None  # (data-parallel, tensor-parallel) degrees; None: one device
    # layers stacked and run by a scan (True) or a list run by a Python loop (False); None: as
    # `load_pretrained` builds them on this platform (`models.default_scan_layers`: a list on a
    # CPU for layers of 1 MiB of weights or more, whose matmuls then read them in place)
    scan_layers: bool | None = None
    hf: bool = False  # also run transformers on the same weights (CPU, one device; benchmarks.hf_peer)
    hf_threads: int = 1  # torch threads for the transformers run


def config_and_dtype(s):
    """The model's config and compute dtype, read before anything is allocated. `s`: any
    settings with model, model_dir, num_layers and dtype (DecodeSettings, PrefixSettings)."""
    if s.model_dir:
        return models.LlamaConfig.from_hf(s.model_dir), jnp.dtype(s.dtype or "bfloat16")
    cfg = preset(s.model)
    if s.num_layers:
        cfg = cfg.with_num_layers(s.num_layers)
    return cfg, jnp.dtype(s.dtype or default_dtype(s.model))


def make_mesh(s: DecodeSettings):
    """The (data, tensor) mesh over the first dp * tp devices, or None; ValueError if too few."""
    if s.mesh is None:
        return None
    dp, tp = s.mesh
    if jax.device_count() < dp * tp:
        hint = (" (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=" + str(dp * tp) + ")"
                if jax.default_backend() == "cpu" else "")  # fmt: skip
        raise ValueError(f"--mesh dp={dp},tp={tp} needs {dp * tp} devices; this process has {jax.device_count()}{hint}")
    if s.batch % dp:
        raise ValueError(f"--batch {s.batch} must be a multiple of dp={dp} (rows are split over the data shards)")
    return jax.make_mesh((dp, tp), ("data", "tensor"), devices=jax.devices()[: dp * tp])


def _layout(s: DecodeSettings, cfg, dtype):
    total = s.prompt_len + s.new_tokens
    pages_per_seq = -(-total // s.page_size)
    return cfg.kv_layout(page_size=s.page_size, num_pages=s.batch * pages_per_seq, max_seqs=s.batch,
                         max_seq_len=pages_per_seq * s.page_size, dtype=s.kv_dtype or dtype)  # fmt: skip


def check_memory(s: DecodeSettings, cfg, dtype) -> None:
    """ModelTooLarge unless weights + paged arena + dense cache + logits fit the device (and the
    prompts the host), computed from the sizes alone. With a mesh, per device: weights / tp
    (an estimate: norms and an unsplittable vocabulary are replicated), the arena's own share
    (`CacheSharding.arena_bytes_per_device`) and the dense cache split alike."""
    total = s.prompt_len + s.new_tokens
    layout = _layout(s, cfg, dtype)
    dense = 2 * cfg.num_layers * s.batch * total * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    weights, arena = weight_bytes(cfg, dtype), cache_bytes(layout)
    if s.mesh is not None:
        dp, tp = s.mesh
        plan = aj.CacheSharding.plan(layout, jax.sharding.AbstractMesh((dp, tp), ("data", "tensor")),
                                     data_axis="data" if dp > 1 else None)  # fmt: skip
        weights //= tp
        arena = arena - layout.arena_bytes + plan.arena_bytes_per_device(layout)  # the table is small, counted whole
        dense //= dp * (tp if cfg.num_kv_heads % tp == 0 else 1)
    hint = "lower --batch, --prompt-len, --new-tokens or --page-size"
    if not s.model_dir:
        hint += f"; --num-layers N (fewer) shrinks {s.model} (same per-layer geometry and KV bytes per layer)"
    flags = f"--batch {s.batch}, --prompt-len {s.prompt_len}, --new-tokens {s.new_tokens}, --page-size {s.page_size}"
    flags += f", --num-layers {s.num_layers}" if s.num_layers else ""
    try:
        check_fits(
            {
                f"weights ({cfg.num_layers} layers, {dtype.name})": weights,
                "paged arena and page table": arena,
                "dense cache": dense,
                "logits": 2 * s.batch * cfg.vocab_size * 4,
            },
            hint=hint,
        )
        check_fits({"prompts": s.batch * s.prompt_len * 4 * 2}, limit=host_memory_limit(), hint=hint)
    except TooLarge as exc:
        raise ModelTooLarge(f"{flags}: {s.model_dir or s.model} {exc}") from None


def build_model(s: DecodeSettings, mesh=None):
    """(model, description of the weights). Random weights from the preset unless model_dir."""
    cfg, dtype = config_and_dtype(s)
    if s.model_dir:
        model, _tok = models.load_pretrained(s.model_dir, dtype=dtype, mesh=mesh, scan_layers=s.scan_layers)
        return model, f"checkpoint {s.model_dir}, {_layer_form(model, s.scan_layers)}"
    scan = models.default_scan_layers(cfg, dtype) if s.scan_layers is None else s.scan_layers
    model = models.init_random(cfg, seed=s.seed, dtype=dtype, mesh=mesh, scan_layers=scan)
    depth = f", {cfg.num_layers} of {preset(s.model).num_layers} layers" if s.num_layers else ""
    return model, f"random weights{depth}, {_layer_form(model, s.scan_layers)}"


def _layer_form(model, asked: bool | None) -> str:
    """How the model runs its layers, and why (for the report's weights line)."""
    form = "layers in a scan" if model.scan_layers else "a list of layers"
    return form + (" (models.default_scan_layers)" if asked is None else "")


def _device_name() -> str:
    kind, backend = jax.devices()[0].device_kind, jax.default_backend()
    return backend if kind.lower() == backend else f"{kind} ({backend})"


def _block(x):
    return jax.block_until_ready(x)


class _ArenaRun:
    def __init__(self, model, s: DecodeSettings, prompts: np.ndarray, mesh=None):
        self.graphdef, self.state = nnx.split(model)
        total = s.prompt_len + s.new_tokens
        self.layout = models.default_layout(model, s.batch, total, page_size=s.page_size, dtype=s.kv_dtype)
        if mesh is None:
            self.cache = aj.create(self.layout)
        else:  # slot b serves row b: rows [d*B/dp, (d+1)*B/dp) are data shard d's, as its slots
            self.cache = aj.create(self.layout, mesh=mesh, data_axis="data" if mesh.shape["data"] > 1 else None)
        self.tokens = jnp.asarray(prompts)
        self.slots = jnp.arange(s.batch, dtype=jnp.int32)
        self.counts = jnp.full((s.batch,), s.prompt_len, jnp.int32)
        self.steps = s.new_tokens - 1
        self.health = None

    def run(self):
        """(tokens i32[B, new_tokens], prefill seconds, [decode step seconds])."""
        t0 = time.perf_counter()
        out = models.prefill(self.graphdef, self.state, self.cache, self.tokens, self.slots, self.counts)
        _block(out)
        prefill_s = time.perf_counter() - t0
        if not bool(np.all(jax.device_get(out.ok))):
            raise RuntimeError("the arena refused the prompts' pages (layout too small)")
        toks, steps = [out.tokens], []
        for _ in range(self.steps):
            t0 = time.perf_counter()
            out = models.decode_step(self.graphdef, self.state, out.cache, out.tokens, self.slots)
            _block(out)
            steps.append(time.perf_counter() - t0)
            toks.append(out.tokens)
        self.health = aj.health(out.cache)
        self.cache = models.release_rows(out.cache, self.slots)
        return np.stack(jax.device_get(toks), axis=1), prefill_s, steps


class _DenseRun:
    def __init__(self, model, s: DecodeSettings, prompts: np.ndarray, mesh=None):
        self.graphdef, self.state = nnx.split(model)
        self.placement = None
        if mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec as P

            from arena_jax.sharding import auto_mesh

            heads = "tensor" if model.config.num_kv_heads % mesh.shape["tensor"] == 0 else None
            rows = NamedSharding(auto_mesh(mesh), P(None, "data", heads))  # [L, B, K, S, H]
            self.placement = dense_baseline.DenseCache(
                k=rows, v=rows, lengths=NamedSharding(rows.mesh, P("data")),
                positions=NamedSharding(rows.mesh, P("data", None)), end=NamedSharding(rows.mesh, P()))
        self.config, self.dtype = model.config, model.dtype
        self.batch, self.max_len = s.batch, s.prompt_len + s.new_tokens
        self.tokens = jnp.asarray(prompts)
        self.counts = jnp.full((s.batch,), s.prompt_len, jnp.int32)
        self.steps = s.new_tokens - 1
        self.reserved = 0

    def run(self):
        cache = dense_baseline.init_dense_cache(self.config, self.batch, self.max_len, self.dtype)
        if self.placement is not None:
            cache = jax.device_put(cache, self.placement)
        self.reserved = cache.k.nbytes + cache.v.nbytes
        _block(cache)
        t0 = time.perf_counter()
        nxt, cache = dense_baseline.dense_prefill(self.graphdef, self.state, cache, self.tokens, self.counts)
        _block((nxt, cache))
        prefill_s = time.perf_counter() - t0
        toks, steps = [nxt], []
        for _ in range(self.steps):
            t0 = time.perf_counter()
            nxt, cache = dense_baseline.dense_decode(self.graphdef, self.state, cache, nxt)
            _block((nxt, cache))
            steps.append(time.perf_counter() - t0)
            toks.append(nxt)
        return np.stack(jax.device_get(toks), axis=1), prefill_s, steps


# A run's first decode steps after its prefill start cold, as any step after a pause does (1 ms of
# idling suffices on a CPU), and take up to ~3x a settled step; from the fifth they settle
# (benchmarks/RESULTS.md, "The module-level steps' graphdef hash"). `warm_step_ms_p50`: the median
# of the later steps.
COLD_STEPS = 4


def _summary(prefills, step_lists, batch, first_prefill, first_steps) -> dict:
    steps_ms = np.concatenate([np.asarray(x) for x in step_lists]) * 1e3
    warm_ms = [1e3 * t for x in step_lists for t in x[COLD_STEPS:]]
    per_repeat_tps = [batch * len(x) / sum(x) for x in step_lists]
    med_prefill = float(np.median(prefills))
    med_step = float(np.median(steps_ms)) / 1e3
    # Each program's first call less its median warm call: what compiling it took.
    compile_prefill_s = max(0.0, first_prefill - med_prefill)
    compile_decode_s = max(0.0, (first_steps[0] if first_steps else 0.0) - med_step)
    tokens_per_s = float(np.median(per_repeat_tps))
    return {
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_repeats": per_repeat_tps,
        # The mean step of the median repeat: batch / tokens_per_s, so that two runs' step means
        # say exactly what their tokens/s ratio says (a p50 step can disagree with it).
        "step_ms_mean": 1e3 * batch / tokens_per_s,
        "step_ms_p50": float(np.percentile(steps_ms, 50)),
        "step_ms_p99": float(np.percentile(steps_ms, 99)),
        "warm_step_ms_p50": float(np.median(warm_ms)) if warm_ms else None,  # each run's steps past COLD_STEPS
        "cold_steps": COLD_STEPS,
        "step_ms": steps_ms.tolist(),
        "prefill_ms": med_prefill * 1e3,
        "compile_s": compile_prefill_s + compile_decode_s,
        "compile_prefill_s": compile_prefill_s,
        "compile_decode_s": compile_decode_s,
    }


def run_decode(s: DecodeSettings, progress=None) -> dict:
    if s.new_tokens < 2:
        raise ValueError("new_tokens must be >= 2 (one from prefill, at least one decode step)")
    cfg, dtype = config_and_dtype(s)  # everything below is checked before a byte is allocated
    if s.prompt_len + s.new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt_len + new_tokens = {s.prompt_len + s.new_tokens} exceeds the model's "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
    mesh = make_mesh(s)
    if mesh is not None:
        from arena_jax.models.parallel import check_tensor_parallel

        try:
            check_tensor_parallel(cfg, s.mesh[1], "tensor")
        except ValueError as exc:
            hint = " (--model tiny-gqa shards up to tp=8)" if s.model == "tiny" and not s.model_dir else ""
            raise ValueError(f"--mesh tp={s.mesh[1]}: {exc}{hint}") from None
    check_memory(s, cfg, dtype)
    model, weights = build_model(s, mesh)
    rng = np.random.default_rng(s.seed)
    prompts = rng.integers(0, cfg.vocab_size, size=(s.batch, s.prompt_len), dtype=np.int32)
    arena, dense = _ArenaRun(model, s, prompts, mesh), _DenseRun(model, s, prompts, mesh)
    runners = {"arena": arena, "dense": dense}
    if s.hf:
        from arena_jax.benchmarks import hf_peer

        reason = hf_peer.unavailable_reason(jax.default_backend(), mesh)
        if reason is not None:
            raise ValueError(f"--hf: {reason}")
        runners["transformers"] = hf_peer.HFRun(model, prompts, s.new_tokens, threads=s.hf_threads)

    advance = progress.add_task("decode: warm-up + repeats", total=len(runners) * (s.warmup + s.repeats)) if progress else None
    results = {name: ([], [], []) for name in runners}  # tokens, prefills, step lists
    first = {}
    in_order = list(runners.items())
    for i in range(s.warmup + s.repeats):
        # The order flips every repeat (the first warm-up runs arena first): whatever running
        # first or second costs, each side pays it as often.
        for name, runner in (in_order if i % 2 == 0 else in_order[::-1]):
            toks, pre, steps = runner.run()
            if i == 0:
                first[name] = (pre, steps)
            if i >= s.warmup:
                results[name][0].append(toks)
                results[name][1].append(pre)
                results[name][2].append(steps)
            elif i == 0:
                results[name][0].append(toks)  # the warm-up's tokens are compared too
            if advance:
                advance(1)
    if progress:
        progress.finish_task()

    arena_tokens, dense_tokens = results["arena"][0], results["dense"][0]
    same = all(np.array_equal(a, d) for a, d in zip(arena_tokens, dense_tokens))
    mismatch = None
    if not same:
        a, d = arena_tokens[0], dense_tokens[0]
        diff = np.argwhere(a != d)
        if diff.size:
            b, t = diff[0]
            mismatch = {"row": int(b), "token_index": int(t), "arena": int(a[b, t]), "dense": int(d[b, t])}
    deterministic = all(np.array_equal(arena_tokens[0], x) for x in arena_tokens[1:])
    agreement = float(np.mean([np.mean(a == d) for a, d in zip(arena_tokens, dense_tokens)]))

    bpt = arena.layout.bytes_per_token
    held = s.batch * (s.prompt_len + s.new_tokens - 1)  # K/V written: prompt + fed-back tokens
    h = arena.health
    a_sum = _summary(results["arena"][1], results["arena"][2], s.batch, *first["arena"])
    d_sum = _summary(results["dense"][1], results["dense"][2], s.batch, *first["dense"])
    a_sum.update(
        kv_bytes_per_token=bpt,
        kv_bytes_reserved=h["bytes_in_use"],
        kv_bytes_reserved_per_token=h["bytes_in_use"] / max(h["logical_tokens"], 1),
        arena_bytes=arena.layout.arena_bytes,
        pages_in_use=h["pages_in_use"],
        utilization=h["utilization"],
    )
    sh = arena.cache.sharding
    if sh is not None:
        a_sum.update(
            arena_bytes_per_device=sh.arena_bytes_per_device(arena.layout),
            kv_bytes_per_token_per_device=sh.bytes_per_token_per_device(arena.layout),
            kv_replicas=sh.kv_replicas,
        )
    dense_bpt = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(model.dtype).itemsize
    d_sum.update(
        kv_bytes_per_token=dense_bpt,
        kv_bytes_reserved=dense.reserved,
        kv_bytes_reserved_per_token=dense.reserved / held,
    )
    peer = None
    if s.hf:
        from arena_jax.benchmarks import hf_peer

        hf_tokens = results["transformers"][0]
        peer = _summary(results["transformers"][1], results["transformers"][2], s.batch, *first["transformers"])
        peer.update(
            model_class=runners["transformers"].name, torch_threads=s.hf_threads, jax_threads=hf_peer.jax_threads(),
            same_tokens=bool(all(np.array_equal(a, h) for a, h in zip(arena_tokens, hf_tokens))),
            token_agreement=float(np.mean([np.mean(a == h) for a, h in zip(arena_tokens, hf_tokens)])),
        )
    return {
        "transformers": peer,
        "settings": {
            **dataclasses.asdict(s),
            "weights": weights,
            "dtype": jnp.dtype(model.dtype).name,
            "config": dataclasses.asdict(cfg),
            "arena_layout": {
                "page_size": arena.layout.page_size,
                "num_pages": arena.layout.num_pages,
                "max_seqs": arena.layout.max_seqs,
                "max_seq_len": arena.layout.max_seq_len,
                "dtype": arena.layout.dtype.name,
                "backend": aj.default_backend(),
            },
            "dense_max_len": dense.max_len,
        },
        "device": _device_name(),
        "mesh": None if mesh is None else {"data": s.mesh[0], "tensor": s.mesh[1]},
        "arena": a_sum,
        "dense": d_sum,
        "speedup_tokens_per_s": a_sum["tokens_per_s"] / d_sum["tokens_per_s"],
        "same_tokens": bool(same),
        "arena_quantized": arena.layout.quantized,
        "token_agreement": agreement,
        "first_mismatch": mismatch,
        "arena_deterministic_across_repeats": bool(deterministic),
        "tokens_sample": arena_tokens[0][0, : min(16, s.new_tokens)].tolist(),
    }
