"""arena-bench's command line: argument types (a bad value is an argparse error, exit status 2),
each subcommand's flags and defaults, what `--help` says of each (`DESCRIPTION`, `SUBCOMMANDS`),
and `build_parser`."""
from __future__ import annotations

import argparse
import os

from arena_jax.models.argtypes import INT32_MAX, HelpWithDefaults, float_in, int_in, positive_float, positive_int, seed

GIB = 2**30


# ---- argument types (errors become argparse messages, exit status 2) ---------------------------


MAX_BUDGET_GIB = 2**20  # 1 PiB of KV: beyond any device (and past it GiB -> bytes loses integer precision)
_budget_gib = float_in(0.0, MAX_BUDGET_GIB, low_open=True)
_headroom = float_in(0.0, 1e6, low_open=True)  # past max_seq_len - 1 every slab is max-length anyway
MAX_ARRIVALS_LOAD = 10.0  # serve --arrivals-load: at most 10x the rate served when every request is there at once


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text}")
    return value


_requests_per_step = float_in(0.0)


def _rate(text: str):
    if text == "auto":
        return "auto"
    try:
        return _requests_per_step(text)
    except argparse.ArgumentTypeError:  # nan, inf, negative, not a number
        raise argparse.ArgumentTypeError(f"expected 'auto' or a finite number of requests per step >= 0, got {text!r}") from None


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers in [1, {INT32_MAX}], got {text!r}") from None
    if not values or min(values) < 1 or max(values) > INT32_MAX:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers in [1, {INT32_MAX}], got {text!r}")
    return values


MESH_AXES = {"dp": "data", "tp": "tensor"}


def mesh_spec(text: str) -> tuple[int, int]:
    """`tp=8`, `dp=2,tp=4`, `dp=8` -> (dp, tp): the data- and tensor-parallel degrees."""
    degrees = {"dp": 1, "tp": 1}
    seen = set()
    for part in text.split(","):
        key, _, value = part.strip().partition("=")
        if key not in degrees or key in seen or not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"expected 'tp=N', 'dp=N' or 'dp=N,tp=M' (positive N, M), got {text!r}")
        seen.add(key)
        degrees[key] = int(value)
    return degrees["dp"], degrees["tp"]


# ---- parser -----------------------------------------------------------------------------------------


def _models():
    from arena_jax.benchmarks.presets import PRESETS

    return list(PRESETS)


def _cpu_models():
    from arena_jax.benchmarks.presets import CPU_PRESETS

    return CPU_PRESETS


_DTYPE_HELP = "the model's compute dtype (default: float32 for the CPU presets, tiny* and mid, else bfloat16)"
KV_DTYPES = ("bfloat16", "float16", "float32", "int8", "float8_e4m3fn", "float8_e5m2")
SIZED_KV_DTYPES = KV_DTYPES + ("int4",)  # layout / capacity: sizes only (bytes per token, scales counted)


def _add_kv_dtype(g, default="bfloat16", flag="--kv-dtype"):
    g.add_argument(flag, choices=SIZED_KV_DTYPES, default=default,
                   help="the KV arena's dtype; int8 / float8_* store 8-bit values + a float32 scale per token and KV "
                        "head, int4 two values a byte + a bf16 scale per 32 lanes (scales counted in the bytes)")  # fmt: skip


def _add_capacity_args(p: argparse.ArgumentParser, defaults: dict) -> None:
    g = p.add_argument_group("capacity")
    g.add_argument("--model", choices=[m for m in _models() if m not in _cpu_models()], default="mistral-7b",
                   help="preset whose KV bytes per token size the budget (mistral-7b: 131,072 B/token)")  # fmt: skip
    g.add_argument("--budget-gib", type=_budget_gib, default=defaults["budget_gib"], help="KV memory budget in GiB")
    g.add_argument("--requests", type=positive_int, default=defaults["requests"], help="requests in the synthetic workload")
    g.add_argument("--lengths", metavar="FILE",
                   help="replay request lengths: CSV 'prompt_len,output_len[,arrival]' or JSON lines "
                        '{"prompt_len": P, "output_len": O}; default: seeded log-normal chat-like mix. A prompt of '
                        "--max-seq-len tokens or more is refused; an output past it is cut there (counted)")  # fmt: skip
    g.add_argument("--rate", type=_rate, default="auto",
                   help="arrivals per step (Poisson); 0 = all at step 0; auto = 1.5x what the budget serves "
                        "if every sequence held exactly its tokens (an overload, so allocators run at capacity)")  # fmt: skip
    g.add_argument("--max-seq-len", type=positive_int, default=2048, help="longest sequence = the max-length slab")
    g.add_argument("--page-size", type=positive_int, default=16, help="arena page size in tokens")
    g.add_argument("--max-seqs", type=positive_int, default=128, help="sequence slots (all allocators)")
    g.add_argument("--headroom", type=_headroom, default=0.25, help="growth allocator's headroom")
    g.add_argument("--watermark", type=_fraction, default=0.01, help="budget fraction admissions leave free for growth")
    g.add_argument("--seed", type=seed, default=0, help="workload seed")
    g.add_argument("--host-scheduler", action="store_true",
                   help="drive the arena one jitted call per step from the host (slower; same figures)")  # fmt: skip
    _add_kv_dtype(g)


def _add_decode_args(p: argparse.ArgumentParser, defaults: dict) -> None:
    g = p.add_argument_group("decode")
    g.add_argument("--model", choices=_models(), default="tiny",
                   help="preset with random weights (tiny-gqa: 8 query / 2 KV heads, for --mesh up to tp=8; "
                        "tiny-<family>: a tiny Mistral / Qwen 2 / Qwen 3 / Gemma 2 / Gemma 3; mid: hidden 512, "
                        "8 layers, 8 query / 2 KV heads, vocab 32,000)")  # fmt: skip
    g.add_argument("--model-dir", help="a Hugging Face checkpoint folder (Llama, Mistral, Qwen 2 / 3, Gemma 2 / 3 text) "
                                       "instead of random weights")
    g.add_argument("--num-layers", type=positive_int,
                   help="override the preset's depth (e.g. llama3-8b geometry on a CPU; mixed layer types keep their pattern)")
    form = g.add_mutually_exclusive_group()
    form.add_argument("--no-scan-layers", action="store_true",
                      help="a list of layers run by a Python loop (compiles with depth; no per-layer weight slice "
                           "copies). Default: as load_pretrained builds the model here (models.default_scan_layers: "
                           "a list on a CPU for layers of 1 MiB of weights or more, else stacked layers in a scan)")  # fmt: skip
    form.add_argument("--scan-layers", action="store_true",
                      help="stacked layers run by a scan, whatever the default (on a CPU the scan slices each layer's "
                           "weights out of the stacks, a copy every step)")  # fmt: skip
    g.add_argument("--batch", type=positive_int, default=defaults["batch"], help="sequences decoded together")
    g.add_argument("--prompt-len", type=positive_int, default=defaults["prompt_len"], help="random prompt tokens per sequence")
    g.add_argument("--new-tokens", type=int_in(2), default=defaults["new_tokens"],
                   help="tokens generated per sequence (>= 2: one from prefill, at least one decode step)")  # fmt: skip
    g.add_argument("--repeats", type=positive_int, default=defaults["repeats"], help="timed repeats (median reported)")
    g.add_argument("--warmup", type=positive_int, default=1, help="untimed warm-up runs (compile)")
    g.add_argument("--page-size", type=positive_int, default=16, help="arena page size in tokens")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help=_DTYPE_HELP)
    g.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="the paged arena's dtype (default: --dtype); int8 / float8_* quantize K/V on write (the dense "
                        "cache stays in --dtype, so greedy tokens may then differ)")  # fmt: skip
    g.add_argument("--seed", type=seed, default=0, help="weights and prompts")
    g.add_argument("--mesh", type=mesh_spec, metavar="SPEC",
                   help="run sharded over dp*tp devices: 'tp=8' (KV heads and Megatron weights over 8 devices), "
                        "'dp=2,tp=4' (also slots, pages and batch rows over 2 data shards); on a CPU give it host "
                        "devices with XLA_FLAGS=--xla_force_host_platform_device_count=N (a functional check, not a speed)")  # fmt: skip
    g.add_argument("--hf", choices=("auto", "on", "off"), default="auto",
                   help="also run transformers on the same weights (CPU, one device; auto: when torch and transformers "
                        "are installed); for one thread on both sides set XLA_FLAGS='--xla_cpu_multi_thread_eigen=false "
                        "intra_op_parallelism_threads=1'")  # fmt: skip
    g.add_argument("--hf-threads", type=int_in(1, os.cpu_count() or 1), default=1,
                   help="torch threads for the transformers run (at most this host's cores: torch segfaulted at 100,000)")  # fmt: skip


def _add_prefix_args(p: argparse.ArgumentParser) -> None:
    from arena_jax.benchmarks.prefix import PrefixSettings

    d = PrefixSettings()
    g = p.add_argument_group("prefix")
    g.add_argument("--model", choices=_models(), default=d.model, help="preset with random weights")
    g.add_argument("--model-dir", help="a Hugging Face checkpoint folder (any supported family) instead of random weights")
    g.add_argument("--num-layers", type=positive_int, help="override the preset's depth")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help=_DTYPE_HELP)
    g.add_argument("--system-prompts", type=positive_int, default=d.system_prompts, help="distinct system prompts")
    g.add_argument("--system-len", type=positive_int, default=d.system_len, help="tokens per system prompt")
    g.add_argument("--conversations", type=positive_int, default=d.conversations, help="conversations (requests per turn)")
    g.add_argument("--turns", type=positive_int, default=d.turns, help="turns per conversation")
    g.add_argument("--user-len", type=positive_int, default=d.user_len, help="mean user message tokens (uniform in [len/2, 3len/2])")
    g.add_argument("--new-tokens", type=positive_int, default=d.new_tokens, help="answer tokens per turn (greedy)")
    g.add_argument("--batch", type=positive_int, default=d.batch, help="batch rows (sequences decoded together)")
    g.add_argument("--chunk-size", type=positive_int, default=d.chunk_size, help="prefill chunk (tokens per prefill call)")
    g.add_argument("--page-size", type=positive_int, default=d.page_size, help="page size in tokens")
    g.add_argument("--num-pages", type=positive_int, help="KV budget in pages (default: twice what the batch rows need at their longest)")
    g.add_argument("--budget-gib", type=_budget_gib, help="KV budget in GiB (instead of --num-pages)")
    g.add_argument("--repeats", type=positive_int, default=d.repeats, help="timed runs per mode (alternating)")
    g.add_argument("--seed", type=seed, default=d.seed, help="workload and weights")
    g.add_argument("--host-pages", type=int_in(0), default=d.host_pages,
                   help="a third mode: the prefix cache with a host tier of this many pages (evicted pages spill there)")  # fmt: skip


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from arena_jax.benchmarks.serve_settings import ServeSettings

    d = ServeSettings()
    g = p.add_argument_group("serve")
    g.add_argument("--batch", type=positive_int, default=d.batch, help="batch rows (and prompts)")
    g.add_argument("--prompt-len", type=positive_int, default=d.prompt_len, help="random prompt tokens per sequence")
    g.add_argument("--new-tokens", type=int_in(2), default=d.new_tokens, help="tokens generated per sequence in the long call")
    g.add_argument("--chunk", type=positive_int, default=d.chunk, help="bare-loop steps per timed run")
    g.add_argument("--cold-layers", type=positive_int, default=d.cold_layers,
                   help="depth of the model whose compiles per generate call are counted (the timed model has 2: "
                        "another depth keeps its cold call cold)")  # fmt: skip
    g.add_argument("--rounds", type=positive_int, default=d.rounds, help="alternated timing rounds (medians reported)")
    g.add_argument("--layers", type=int_in(1), nargs="*", default=list(d.layers),
                   help="depths whose first-call compile time is measured (none: skip)")  # fmt: skip
    g.add_argument("--no-compile-cache-runs", action="store_true",
                   help="skip the two arena-generate processes that measure the persistent compilation cache")  # fmt: skip
    from arena_jax.benchmarks.arrivals import ArrivalSettings

    a = ArrivalSettings()
    g.add_argument("--arrivals-model", choices=("tiny", "mid"), default=a.model,
                   help="model of the Poisson-arrival run (mixed steps vs separate prefill; mid: hidden 512, 8 layers)")  # fmt: skip
    g.add_argument("--arrivals-requests", type=int_in(0), default=a.requests, help="requests of that run (0: skip it)")
    g.add_argument("--arrivals-rounds", type=positive_int, default=a.rounds, help="alternated rounds of that run")
    g.add_argument("--arrivals-short-len", type=int_in(2), default=a.short_len, help="short prompts' tokens (+-50%%)")
    g.add_argument("--arrivals-long-len", type=positive_int, default=a.long_len, help="long prompts' tokens")
    g.add_argument("--arrivals-long-every", type=positive_int, default=a.long_every,
                   help="every N-th prompt is long (1: all of them)")  # fmt: skip
    g.add_argument("--arrivals-load", type=float_in(0.0, MAX_ARRIVALS_LOAD, low_open=True), default=a.load,
                   help="arrival rate as a fraction of the rate served when every request is there at once")  # fmt: skip
    g.add_argument("--arrivals-only", action="store_true", help="run only the Poisson-arrival part")
    g.add_argument("--seed", type=seed, default=d.seed, help="weights, prompts and arrivals")
    from arena_jax.benchmarks.http_serve import HttpSettings

    h = HttpSettings()
    g = p.add_argument_group("serve --http: arena-serve against transformers serve over loopback")
    g.add_argument("--http", action="store_true",
                   help="run only this: both servers as processes on the same checkpoint, Poisson loads alternated")  # fmt: skip
    g.add_argument("--http-model-dir", help="checkpoint folder both serve (default: a demo checkpoint made for the run)")
    g.add_argument("--http-rates", type=float_in(0.0, 1e6, low_open=True), nargs="+", default=list(h.rates),
                   help="request arrival rates, per second")  # fmt: skip
    g.add_argument("--http-requests", type=positive_int, default=h.requests, help="requests per load")
    g.add_argument("--http-max-tokens", type=positive_int, default=h.max_tokens, help="greedy tokens per request")
    g.add_argument("--http-repeats", type=positive_int, default=h.repeats, help="alternated loads per rate and server")
    g.add_argument("--http-max-seqs", type=positive_int, default=h.max_seqs, help="arena-serve --max-seqs")
    g.add_argument("--http-peer", choices=("auto", "transformers", "none"), default=h.peer,
                   help="the peer server: transformers serve where torch, transformers and accelerate are installed (auto)")  # fmt: skip


def _add_swap_args(p: argparse.ArgumentParser) -> None:
    from arena_jax.benchmarks.swap import SwapSettings

    d = SwapSettings()
    g = p.add_argument_group("swap")
    g.add_argument("--model", choices=_models(), default=d.model, help="preset with random weights")
    g.add_argument("--model-dir", help="a Hugging Face Llama/Mistral checkpoint folder instead of random weights")
    g.add_argument("--num-layers", type=positive_int, help="override the preset's depth")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help=_DTYPE_HELP)
    g.add_argument("--requests", type=positive_int, default=d.requests, help="prompts served")
    g.add_argument("--prompt-len", type=positive_int, default=d.prompt_len, help="mean prompt tokens (uniform in [len/2, 3len/2])")
    g.add_argument("--new-tokens", type=positive_int, default=d.new_tokens, help="greedy tokens per request")
    g.add_argument("--batch", type=positive_int, default=d.batch, help="batch rows")
    g.add_argument("--chunk-size", type=positive_int, default=d.chunk_size, help="prefill chunk (tokens per prefill call)")
    g.add_argument("--page-size", type=positive_int, default=d.page_size, help="page size in tokens")
    g.add_argument("--num-pages", type=positive_int, help="KV budget in pages (default: 60%% of what the rows need at their longest)")
    g.add_argument("--host-pages", type=positive_int, help="host tier pages (default: every row at full length)")
    g.add_argument("--bandwidth-gbps", type=float_in(0.0, 1e6, low_open=True), help="SwapPolicy: host<->device GB/s (default 25)")
    g.add_argument("--prefill-rate", type=float_in(0.0, 1e12, low_open=True),
                   help="SwapPolicy: prefill tokens/s (default: measured in the run)")  # fmt: skip
    g.add_argument("--repeats", type=positive_int, default=d.repeats, help="timed runs per mode (alternating)")
    g.add_argument("--seed", type=seed, default=d.seed, help="prompts and weights")


CAPACITY_DEFAULTS = {"budget_gib": 1.0, "requests": 100}
TOUR_CAPACITY = {"budget_gib": 1.0, "requests": 100, "max_seq_len": 2048, "max_seqs": 128}
DECODE_DEFAULTS = {"batch": 4, "prompt_len": 32, "new_tokens": 32, "repeats": 5}
TOUR_DECODE = {"batch": 4, "prompt_len": 32, "new_tokens": 32, "repeats": 15, "num_layers": None}
# `arena-bench kernels`' defaults: run_kernel_benchmark's own (its flags default to None, so the benchmark's
# signature decides; tests/test_bench.py checks these are the same)
KERNEL_DEFAULTS = {"batches": (1, 8, 64), "contexts": (512, 4096, 32768), "page_size": 16, "repeats": 50,
                   "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}


DESCRIPTION = (
    "Measure what arena_jax's paged KV cache buys and what it costs. With no subcommand, arena-bench runs the tour: "
    "on a tiny built-in model (on a CPU by default, in under two minutes) it shows the KV layout of real models, how "
    "many sequences the arena fits in a memory budget against contiguous allocators, and decode speed against a dense "
    "cache. Each subcommand below measures one of these questions in depth (layout, capacity, decode, kernels, "
    "accuracy, prefix, swap, serve); each one's own --help lists its flags. Every subcommand writes its results as "
    "JSON with --json PATH; capacity, decode, kernels and prefix draw a PNG with --plot PATH."
)

# name -> (one line for the list under `arena-bench --help`, the paragraph on top of `arena-bench NAME --help`)
SUBCOMMANDS = {
    "tour": ("layout report + small capacity run + tiny-model decode (default)",
             "A quick tour on a tiny built-in model: the layout report, a small capacity run (the arena against "
             "contiguous allocators under one KV budget) and a tiny model's decode against a dense cache, then a "
             "summary. What arena-bench runs with no subcommand."),
    "layout": ("KV bytes per token and pages for a budget (Mistral-7B, Llama-3)",
               "Bytes per token, page size and pages that fit a KV memory budget for Mistral-7B and Llama-3 8B / "
               "70B, as arena_jax.KVLayout stores them (KV heads only; quantized arenas' scales counted). Nothing "
               "is allocated."),
    "capacity": ("arena vs contiguous allocators under one KV budget",
                 "How many sequences one KV memory budget serves: the paged arena (real aj.reserve / aj.release) "
                 "against contiguous max-length slabs and slabs with growth headroom, on the same workload (a "
                 "seeded synthetic one, or --lengths FILE). Reports utilization, concurrency, waits and preemptions."),
    "decode": ("end-to-end decode: paged arena vs dense cache",
               "End-to-end decode of a model (a random-weight preset or a Hugging Face checkpoint) on the paged "
               "arena against a dense cache sized to exactly prompt + new tokens: tokens/s, step latency, prefill "
               "and compile time, and whether the greedy tokens match."),
    "kernels": ("Pallas append / paged-attention timings (needs a GPU)",
                "Timings of the paged decode-attention and append kernels over batches x contexts, against JAX's "
                "own Pallas paged kernel and dense attention (a GPU; on a CPU the jnp reference runs on clamped "
                "sizes). With --compile-report: every kernel variant compiled for an H100 (sm_90a) or a TPU v5e / "
                "v6e without that device, and its static facts printed."),
    "accuracy": ("quantized KV arenas (8-bit, int4, rotated keys): attention error (outlier keys) and end-to-end logits",
                 "How much the quantized KV arenas (int8, fp8, int4; keys plain, rotated or smoothed) change the "
                 "results: attention against float64 on keys with outlier channels, and end to end the logits of "
                 "tiny random-weight models against a bf16 arena."),
    "prefix": ("multi-turn chat with and without the prefix cache under one KV budget",
               "A multi-turn chat workload served by generate with and without the prefix cache (and with a host "
               "tier: --host-pages) under the same KV budget: prefill tokens, hit rate, time to first token and "
               "throughput; the greedy tokens must match."),
    "swap": ("a preemption-heavy generate run: recompute vs swap to a host tier",
             "A generate run under a tight KV budget, so sequences are preempted: recomputed later, or swapped to a "
             "host-memory tier and back (models.SwapPolicy). Reports wall time, tokens recomputed and pages moved."),
    "serve": ("generate's decode step vs the bare jitted step, host overhead, compiles per call and by depth",
              "generate's serving loop against its bare jitted decode step (the host's overhead per step), the "
              "programs each generate call compiles, first-call compile time by depth, and a Poisson-arrival run "
              "(mixed steps against separate prefill)."),
    "speculative": ("speculative decoding (prompt lookup) vs plain decoding on a repetitive workload",
                    "Speculative decoding with prompt lookup against plain decoding (one step a call, and decode "
                    "blocks) on prompts that repeat a span: tokens per call of the model, acceptance, tokens/s "
                    "(compile excluded), identical greedy tokens checked."),
}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", metavar="PATH", help="write the results (and device, JAX version, date, arguments) as JSON")
    common.add_argument("--no-progress", action="store_true", help="no progress bar")
    plot = argparse.ArgumentParser(add_help=False)
    plot.add_argument("--plot", metavar="PATH", help="write a PNG plot")

    parser = argparse.ArgumentParser(
        prog="arena-bench",
        description=DESCRIPTION,
        epilog="With no subcommand: the tour (`arena-bench --json tour.json` works too).",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")

    def subcommand(name: str, *parents):
        line, paragraph = SUBCOMMANDS[name]
        return sub.add_parser(name, formatter_class=HelpWithDefaults, parents=list(parents), help=line,
                              description=paragraph)  # fmt: skip

    p = subcommand("tour", common)
    p.set_defaults(command="tour")

    p = subcommand("layout", common)
    p.add_argument("--budget-gib", type=_budget_gib, default=40.0, help="KV budget in GiB")
    p.add_argument("--page-size", type=positive_int, default=16, help="page size in tokens")
    _add_kv_dtype(p)

    p = subcommand("capacity", common, plot)
    _add_capacity_args(p, CAPACITY_DEFAULTS)

    p = subcommand("decode", common, plot)
    _add_decode_args(p, DECODE_DEFAULTS)

    p = subcommand("kernels", common, plot)
    # None: the benchmark's own default (benchmarks.kernels.run_kernel_benchmark), named in each help
    k = KERNEL_DEFAULTS
    p.add_argument("--batches", type=_int_list, default=None,
                   help=f"comma-separated batch sizes (default: {','.join(map(str, k['batches']))})")  # fmt: skip
    p.add_argument("--contexts", type=_int_list, default=None,
                   help=f"comma-separated context lengths, tokens per row (default: {','.join(map(str, k['contexts']))})")  # fmt: skip
    p.add_argument("--page-size", type=positive_int, default=None, help=f"page size in tokens (default: {k['page_size']})")
    p.add_argument("--repeats", type=positive_int, default=None, help=f"timed calls per point (default: {k['repeats']})")
    p.add_argument("--num-q-heads", type=positive_int, default=None, help=f"query heads (default: {k['num_q_heads']})")
    p.add_argument("--num-kv-heads", type=positive_int, default=None, help=f"KV heads (default: {k['num_kv_heads']})")
    p.add_argument("--head-dim", type=positive_int, default=None, help=f"head dimension (default: {k['head_dim']})")
    p.add_argument("--dtype", choices=KV_DTYPES, default=None,
                   help=f"the arena's dtype; for int8 / float8_* the queries and new K/V are bfloat16 (default: {k['dtype']})")
    p.add_argument("--compile-report", action="store_true",
                   help="instead of timings: compile every kernel variant for an H100 (sm_90a) without a GPU and print "
                        "registers, spills, shared memory, CTAs/SM, tensor-core instruction, TMA "
                        "(needs scripts/install_sm90_tools.sh; JAX_PLATFORMS=cpu on a host without a GPU)")
    p.add_argument("--via", choices=("xla", "plugin"), default="xla",
                   help="--compile-report: XLA's deviceless GPU compiler (what runs on a GPU) or the CUDA plugin's Triton handler "
                        "(jaxlib <= 0.10 only)")
    p.add_argument("--only", metavar="TEXT", help="--compile-report: only variants whose label contains TEXT")
    p.add_argument("--target", choices=("sm90", "tpu-v5e", "tpu-v6e"), default="sm90",
                   help="--compile-report: an H100 (sm_90a; the CUDA tooling) or a TPU v5e / v6e (the Mosaic TPU kernels; "
                        "needs scripts/install_tpu_tools.sh): VMEM, code size, DMA plan vs XLA's bytes accessed")
    p.add_argument("--steps", action="store_true",
                   help="--compile-report --target tpu-*: also compile the whole Llama-3-8B-shaped prefill / decode "
                        "steps on a 2x2 (v5e) / 2x4 (v6e) mesh (minutes)")

    p = subcommand("accuracy", common)
    p.add_argument("--context", type=positive_int, default=1024, help="cached tokens per row in the attention test")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="greedy tokens per prompt in the model test")
    p.add_argument("--seed", type=seed, default=0, help="keys, queries and weights")
    p.add_argument("--skip-models", action="store_true", help="only the attention measurement")
    p.add_argument("--skip-attention", action="store_true", help="only the end-to-end measurement")
    p.add_argument("--model-formats", default="int8,int8+rot,int8+smooth+rot,float8_e4m3fn,int4,int4+rot,int4+smooth+rot",
                   help="end-to-end arenas, comma-separated (+rot: rotated keys, +smooth: smoothed keys; a quantized "
                        "format without them stores plain keys; int4 runs head_dim-32 configs)")
    p.add_argument("--model-key-outliers", type=positive_float, default=1.0, metavar="X",
                   help="end-to-end models with outlier keys: one RoPE channel pair per layer and KV head scaled by X in "
                        "the key projection (1: the models as drawn)")
    p.add_argument("--model-outlier-queries", choices=("quiet", "loud"), default="quiet",
                   help="with --model-key-outliers: quiet divides the query heads' same channels by X (the same "
                        "function, only the stored keys change); loud leaves them (those channels dominate the scores)")
    p.add_argument("--formats", default="int8,float8_e4m3fn,float8_e5m2,int4",
                   help="quantized arenas of the attention test, comma-separated")
    p.add_argument("--key-options", default="plain,rot,smooth+rot",
                   help="the attention test's keys for each format, comma-separated: plain, rot (rotated), smooth "
                        "(smoothed), smooth+rot")
    p.add_argument("--batch", type=positive_int, default=4, help="rows in the attention test")
    p.add_argument("--outliers", type=int_in(0), default=4,
                   help="outlier key channels per KV head (attention test; times the KV heads at most head_dim)")
    p.add_argument("--heads", default="32,8,128", metavar="Q,KV,D",
                   help="query heads, KV heads, head_dim of the attention test (head_dim a multiple of 32)")
    p.add_argument("--backends", default="reference,pallas",
                   help="attention backends to measure, comma-separated (pallas on CPU: interpret mode)")
    p = subcommand("prefix", common, plot)
    _add_prefix_args(p)
    p = subcommand("swap", common)
    _add_swap_args(p)
    p = subcommand("serve", common)
    _add_serve_args(p)
    from arena_jax.benchmarks.speculative import SpeculativeSettings

    d = SpeculativeSettings()
    p = subcommand("speculative", common)
    p.add_argument("--model", choices=("tiny", "mid"), default=d.model, help="random-weight model (mid: hidden 512, 8 layers)")
    p.add_argument("--batch", type=positive_int, default=d.batch, help="batch rows")
    p.add_argument("--requests", type=positive_int, default=d.requests, help="prompts")
    p.add_argument("--span", type=positive_int, default=d.span, help="tokens of the span each prompt repeats")
    p.add_argument("--repeats-in-prompt", type=positive_int, default=d.repeats_in_prompt, help="times the span repeats")
    p.add_argument("--new-tokens", type=positive_int, default=d.new_tokens, help="greedy tokens per prompt")
    p.add_argument("--k", type=int_in(1, 64), default=d.k, help="proposals per verify call")
    p.add_argument("--draft-layers", type=int_in(0, 64), default=d.draft_layers,
                   help="also a draft model: the target's first N layers (0: none)")
    p.add_argument("--damping", type=float_in(0.0, 1.0), default=d.damping,
                   help="with --draft-layers: scale the output projections of the target's layers past the draft's "
                        "(< 1: a synthetic target its draft agrees with often, in place of a trained pair)")
    p.add_argument("--rounds", type=positive_int, default=d.rounds, help="alternated timing rounds (medians)")
    p.add_argument("--seed", type=seed, default=d.seed, help="weights and prompts")
    parser.subcommands = sub.choices  # name -> subparser, to report errors per subcommand
    return parser
