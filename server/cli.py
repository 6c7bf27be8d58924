"""`arena-serve`: an OpenAI-compatible server for a Hugging Face checkpoint (or a tiny random
model, for demos) on the paged cache.

    arena-serve --model-dir path/to/checkpoint --port 8000 --max-seqs 16 --max-model-len 4096
    arena-serve --model tiny                                   # a random-weight tiny model

Every program is compiled before the port opens (a warm-up), so serving compiles nothing
(`/metrics`: arena_compiles_since_warm_up). The compiled programs are kept in a JAX persistent
compilation cache (`--compile-cache`, off with `--no-compile-cache`), so a restart on the same
machine reads them back instead of compiling them again. SIGTERM or Ctrl-C: stop taking
requests, let the ones in flight finish for --grace-period seconds, abort the rest, exit 0.
"""
from __future__ import annotations

import argparse
import logging
import sys

from arena_jax.models import compile_cache
from arena_jax.models.argtypes import HelpWithDefaults, int_in, positive_int

TINY = ("tiny", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3")
_FAMILY = {"tiny": "llama", "tiny-mistral": "mistral", "tiny-qwen2": "qwen2", "tiny-qwen3": "qwen3",
           "tiny-gemma2": "gemma2", "tiny-gemma3": "gemma3_text"}  # fmt: skip


def _bytes(text: str) -> int:
    """'2GiB', '512MiB', '1e9' or a plain integer of bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    low = text.strip().lower()
    for unit, scale in units.items():
        if low.endswith(unit):
            number = low[: -len(unit)]
            break
    else:
        number, scale = low, 1
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 2GiB, 512MiB, 1000000)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return value


class _Server:
    """Made in `main` (uvicorn imported late): uvicorn's server, except that SIGTERM / SIGINT end in
    exit status 0 after its graceful shutdown (uvicorn raises the signal again once it stopped)."""

    @staticmethod
    def make(config):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                super().handle_exit(sig, frame)
                if hasattr(self, "_captured_signals"):
                    self._captured_signals.clear()

        return Server(config)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="arena-serve", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpWithDefaults)  # fmt: skip
    p.add_argument("--model-dir", help="Hugging Face checkpoint folder or org/name in the local HF cache (default: --model)")
    p.add_argument("--model", choices=TINY, default="tiny", help="the tiny random-weight model served without --model-dir")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the folder's or --model's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int_in(0, 65535), default=8000, help="port (0: any free one)")
    p.add_argument("--max-seqs", type=positive_int, default=8, help="requests decoded together (batch rows)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="prompt + generated tokens per request (default: the config's max_position_embeddings, at most 4096)")  # fmt: skip
    p.add_argument("--kv-memory", type=_bytes, default=None, help="the KV arena's size, e.g. 2GiB (default: every row at full length)")
    p.add_argument("--page-size", type=positive_int, default=16, help="tokens per page")
    p.add_argument("--kv-dtype", default=None, help="the arena's dtype: bfloat16, float32, int8, float8_e4m3fn, int4 (default: the model's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="the model's compute dtype (default: bfloat16 for checkpoints, float32 for tiny)")  # fmt: skip
    p.add_argument("--chunk-size", type=positive_int, default=64, help="prompt tokens per prefill call and row")
    p.add_argument("--decode-block", type=int_in(1, 64), default=4, help="decode steps per device call while no request waits")
    p.add_argument("--prefix-cache", action="store_true",
                   help="reuse the K/V of earlier prompts (shared system prompts, n > 1 choices); decode then runs one "
                        "step per device call")  # fmt: skip
    p.add_argument("--speculative-k", type=int_in(0, 16), default=0,
                   help="speculative decoding by prompt lookup: up to K tokens proposed per step from the request's own "
                        "history, verified in one call (greedy output unchanged); 0: off")  # fmt: skip
    p.add_argument("--host-pages", type=int_in(0, 2**31 - 1), default=0,
                   help="a host-memory tier of N pages: a preempted request's pages are swapped out and back instead "
                        "of recomputed when moving them is cheaper; with --prefix-cache, the cache's spill tier "
                        "(evicted pages go there, a hit brings them back); 0: none")  # fmt: skip
    p.add_argument("--max-queue", type=positive_int, default=256, help="requests that may wait; more get HTTP 429")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ routes")
    p.add_argument("--grace-period", type=float, default=10.0, help="seconds in-flight requests get to finish on shutdown")
    p.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0, help="the tiny model's weights and unseeded sampling")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    compile_cache.add_flags(p)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_dir and args.model != "tiny":
        parser.error(f"--model {args.model} has no effect with --model-dir")
    cache_dir = compile_cache.folder(args, parser)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import jax
    import jax.numpy as jnp
    import uvicorn

    from arena_jax import models
    from arena_jax.server.app import create_app
    from arena_jax.server.engine import Engine

    tokenizer = None
    try:
        if args.model_dir:
            folder = models.checkpoint_dir(args.model_dir)
            model, _ = models.load_pretrained(folder, dtype=jnp.dtype(args.dtype or "bfloat16"))
            if models.load_tokenizer(folder) is not None:
                tokenizer = models.TextTokenizer.from_pretrained(folder)
            name = args.served_model_name or args.model_dir
        else:
            config = models.LlamaConfig.tiny_family(_FAMILY[args.model])
            model = models.init_random(config, seed=args.seed, dtype=jnp.dtype(args.dtype or "float32"))
            name = args.served_model_name or args.model
        if cache_dir is not None:  # only once the arguments and the model are known to be good
            compile_cache.enable(cache_dir, given=args.compile_cache is not None)
        engine = Engine(model, max_seqs=args.max_seqs, max_model_len=args.max_model_len, page_size=args.page_size,
                        kv_memory=args.kv_memory, kv_dtype=args.kv_dtype, chunk_size=args.chunk_size,
                        decode_block=args.decode_block, max_queue=args.max_queue, seed=args.seed,
                        prefix_cache=args.prefix_cache, speculative=args.speculative_k, host_pages=args.host_pages)  # fmt: skip
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    log = logging.getLogger("arena_jax.server")
    log.info("warming up (compiling every program%s) ...",
             f"; compilation cache {jax.config.jax_compilation_cache_dir}" if cache_dir else "")  # fmt: skip
    log.info("warm-up done in %.1f s; KV arena %d pages of %d tokens", engine.warm_up(), engine.layout.num_pages,
             engine.layout.page_size)  # fmt: skip
    app = create_app(engine, tokenizer, name, api_key=args.api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.grace_period)  # fmt: skip
    server = _Server.make(config)
    try:
        # Bound here, not inside `run`, so that the port actually bound (any free one with --port 0)
        # is printed whatever the log level: a launcher reads this line to know where to connect.
        sock = config.bind_socket()  # a port in use: uvicorn's error and exit status 3 (STARTUP_FAILURE)
        print(f"arena-serve: listening on http://{args.host}:{sock.getsockname()[1]}", flush=True)
        server.run(sockets=[sock])
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
