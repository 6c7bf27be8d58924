"""`arena-generate`: generate text (or token ids) with a Llama, Mistral, Qwen 2 / 3 or Gemma 2 / 3
model on the paged cache.

    arena-generate --model-dir path/to/checkpoint --prompt "Hello" --max-new-tokens 64
    arena-generate --model-dir path/to/checkpoint --chat --stream --prompt "Name three colours."
    arena-generate --prompt "Hello" --batch 4 --num-prompts 8     # built-in random-weight tiny model
    arena-generate --model tiny-gemma2 --prompt "Hello"           # a tiny random model of another family

Without `--model-dir` a random-weight tiny model runs (`--model`: `LlamaConfig.tiny()` or
`LlamaConfig.tiny_family(...)`) and the prompt's UTF-8 bytes (mod the vocabulary) are its
token ids. `--kv-dtype int8` (or float8_e4m3fn,
float8_e5m2) runs on an 8-bit arena: half the KV bytes of bf16; `--kv-dtype int4` on a 4-bit one (two
codes a byte and a bf16 scale per 32 lanes; head_dim a multiple of 32, e.g. `--model tiny-qwen3`). `--host-pages N` adds a host-memory
tier of N pages: a preempted sequence is swapped out and back instead of recomputed (when the
cost model says so: `models.SwapPolicy`), or with `--prefix-cache` evicted prefixes spill there. Prints the generated tokens (decoded
text when the checkpoint has a tokenizer.json; `--stream`: as they come) and tokens/s, compile time
left out and shown apart. A sequence stops at the
checkpoint's eos tokens, as transformers' generate does (`--ignore-eos`: run to
--max-new-tokens). Sizes are checked against the device's memory before anything is
allocated. Compiled steps are kept in a JAX persistent compilation cache
(`--compile-cache`, off with `--no-compile-cache`), so only the first run pays for compiling.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from arena_jax.models import compile_cache
from arena_jax.models.argtypes import MAX_DECODE_BLOCK, HelpWithDefaults, float_in, int_in, non_negative_float, positive_int, seed

_DTYPES = ("float32", "bfloat16", "float16")
_KV_DTYPES = _DTYPES + ("int8", "float8_e4m3fn", "float8_e5m2", "int4")
CACHE_ENV = compile_cache.CACHE_ENV
TINY_MODELS = {"tiny": "llama", "tiny-mistral": "mistral", "tiny-qwen2": "qwen2", "tiny-qwen3": "qwen3",
               "tiny-gemma2": "gemma2", "tiny-gemma3": "gemma3_text"}  # fmt: skip
DEFAULT_CACHE = compile_cache.DEFAULT_CACHE


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="arena-generate", description=__doc__.split("\n\n")[0], formatter_class=HelpWithDefaults)
    p.add_argument(
        "--model-dir", help="Hugging Face checkpoint folder (config.json, *.safetensors; model_type llama, mistral, "
                            "qwen2, qwen3, gemma2 or gemma3_text), or a Hugging Face name (org/name) already in the "
                            "local Hugging Face cache (nothing is downloaded); default: a tiny random model (--model)"
    )
    p.add_argument("--model", choices=sorted(TINY_MODELS), default="tiny",
                   help="the tiny random-weight model run without --model-dir")  # fmt: skip
    p.add_argument("--prompt", default="The arena holds every page.", help="prompt text")
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as a user message through the checkpoint's chat template (tokenizer_config.json "
                        "or chat_template.jinja), as transformers' apply_chat_template does")  # fmt: skip
    p.add_argument("--stream", action="store_true", help="print the first prompt's text as it is generated")
    p.add_argument("--num-prompts", type=positive_int, default=1,
                   help="copies of the prompt to run, --batch at a time")  # fmt: skip
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens to generate per prompt")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the checkpoint's eos tokens (generation_config.json / config.json)")  # fmt: skip
    p.add_argument("--batch", type=positive_int, default=4, help="batch rows decoded together")
    p.add_argument("--chunk-size", type=positive_int, default=None,
                   help="prefill chunk (tokens per prefill call); default: models.default_chunk_size (the prompt's length rounded up to a power of two, 32 to 128; 32 with --mixed-steps)")  # fmt: skip
    p.add_argument("--page-size", type=positive_int, default=16, help="tokens per page of the KV arena")
    p.add_argument("--num-pages", type=positive_int, default=None, help="arena pages (default: every row at full length)")
    p.add_argument("--max-seq-len", type=positive_int, default=None, help="per-sequence limit (default: prompt + new tokens, rounded up to a power of two)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=positive_int, default=None, help="sample among the k likeliest tokens (default: all)")
    p.add_argument("--top-p", type=float_in(0.0, 1.0, low_open=True), default=None,
                   help="sample among the likeliest tokens holding this probability, in (0, 1] (default: 1, all)")  # fmt: skip
    p.add_argument("--seed", type=seed, default=0, help="sampling (and the tiny model's weights)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="reuse the K/V of cached prompt prefixes (token granularity, LRU eviction); prints hit figures")  # fmt: skip
    p.add_argument("--host-pages", type=int_in(0), default=0,
                   help="host-memory pages (pinned_host) for swap preemption, or the prefix cache's spill tier; 0: none")  # fmt: skip
    p.add_argument("--dtype", choices=_DTYPES, default=None, help="default: bfloat16 for checkpoints, float32 for tiny")
    p.add_argument("--no-scan-layers", action="store_true",
                   help="run the layers as a Python loop over a list (compile time grows with depth; no per-layer "
                        "weight slice copies) instead of one scan over stacked layers (the default: as "
                        "load_pretrained builds the model here, models.default_scan_layers: a list on a CPU for layers "
                        "of 1 MiB of weights or more)")  # fmt: skip
    p.add_argument("--kv-dtype", choices=_KV_DTYPES, default=None,
                   help="the KV arena's dtype (default: --dtype); int8 / float8_* store 8-bit values + a float32 scale "
                        "per token and KV head, int4 two 4-bit values a byte + a bf16 scale per 32 lanes (the model's "
                        "head_dim a multiple of 32: among the tiny models, tiny-qwen3); quantized on write")  # fmt: skip
    compile_cache.add_flags(p)
    p.add_argument("--mixed-steps", action="store_true",
                   help="feed prompt chunks together with the decoding rows' tokens, one call per step")  # fmt: skip
    p.add_argument("--token-budget", type=positive_int, default=None,
                   help="tokens per mixed step (default --batch + --chunk-size: one chunk); needs --mixed-steps")  # fmt: skip
    p.add_argument("--decode-block", type=int_in(1, MAX_DECODE_BLOCK), default=8,
                   help="decode steps per device call while no request waits (the host's work paid once per block; "
                        "same tokens); 1: one step per call")  # fmt: skip
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cache_dir = compile_cache.folder(args, parser)
    if args.model_dir and args.model != parser.get_default("model"):
        parser.error(f"--model {args.model} has no effect with --model-dir (the checkpoint is the model)")
    if args.token_budget is not None and not args.mixed_steps:
        parser.error(f"--token-budget {args.token_budget} needs --mixed-steps (token_budget is the mixed steps' size: "
                     "give it with mixed_steps=True)")

    import jax.numpy as jnp

    from arena_jax import models
    from arena_jax.models.memory import HOST_BYTES_PER_TOKEN, TooLarge, cache_bytes, check_fits, fmt_bytes, host_memory_limit, weight_bytes

    # Everything is checked before a byte is allocated: config, tokenizer, sizes, memory.
    tokenizer = None
    if args.model_dir:
        dtype = jnp.dtype(args.dtype or "bfloat16")
        try:
            args.model_dir = models.checkpoint_dir(args.model_dir)  # a folder, or a name in the local HF cache
            config = models.LlamaConfig.from_hf(args.model_dir)
            if models.load_tokenizer(args.model_dir) is not None:
                tokenizer = models.TextTokenizer.from_pretrained(args.model_dir)
        except (OSError, ValueError) as exc:
            parser.error(f"--model-dir {args.model_dir}: {exc}")
    else:
        dtype = jnp.dtype(args.dtype or "float32")
        config = models.LlamaConfig.tiny_family(TINY_MODELS[args.model])
    if args.kv_dtype == "int4" and config.head_dim % 32:
        fits = [name for name, t in sorted(TINY_MODELS.items()) if models.LlamaConfig.tiny_family(t).head_dim % 32 == 0]
        which = f"--model-dir {args.model_dir}" if args.model_dir else f"--model {args.model}"
        parser.error(f"--kv-dtype int4 needs head_dim a multiple of 32 (one bf16 scale per 32 lanes); {which} has "
                     f"head_dim {config.head_dim}" + ("" if args.model_dir else f": try --model {' or '.join(fits)}"))
    vocab = config.vocab_size
    if args.top_k is not None and args.top_k > vocab:
        parser.error(f"--top-k {args.top_k} exceeds the model's vocab_size {vocab}")
    if args.temperature == 0:
        given = [f for f, v in (("--top-k", args.top_k), ("--top-p", args.top_p)) if v is not None]
        if given:
            parser.error(f"{' and '.join(given)} {'has' if len(given) == 1 else 'have'} no effect at --temperature 0 "
                         "(greedy): give --temperature > 0 to sample")
    if args.chat:
        if tokenizer is None or tokenizer.chat_template is None:
            where = f"--model-dir {args.model_dir}" if args.model_dir else "the tiny random model (no --model-dir)"
            parser.error(f"--chat needs a checkpoint with a tokenizer and a chat template; {where} has none")
        try:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        except Exception as exc:  # noqa: BLE001 - a template's own raise_exception is a jinja2 TemplateError
            parser.error(f"--chat: the checkpoint's chat template failed: {exc}")
    elif tokenizer is not None:
        prompt = tokenizer.encode(args.prompt)
    else:
        prompt = [b % vocab for b in args.prompt.encode("utf-8")]
    if not prompt:
        parser.error("--prompt is empty")
    num_prompts = args.num_prompts
    total = len(prompt) + args.max_new_tokens
    if args.max_seq_len is not None and args.max_seq_len < total:
        parser.error(f"--max-seq-len {args.max_seq_len} is shorter than prompt + new tokens ({total})")
    # Default rows: a power-of-two bucket of prompt + new tokens (other lengths in it hit the
    # compile cache), or exactly prompt + new tokens when the bucket is refused (memory, limits).
    lengths = [args.max_seq_len] if args.max_seq_len else [models.length_bucket(total, args.page_size), total]
    for i, max_seq_len in enumerate(lengths):
        pages_per_seq = -(-max_seq_len // args.page_size)
        sizes = f"--batch {args.batch}, --page-size {args.page_size}"
        sizes += f", --num-pages {args.num_pages}" if args.num_pages else ""
        sizes += f", --max-seq-len {max_seq_len}" if args.max_seq_len else f", prompt + --max-new-tokens = {total} tokens"
        try:
            layout = config.kv_layout(
                page_size=args.page_size,
                num_pages=args.num_pages or args.batch * pages_per_seq,
                max_seqs=args.batch,
                max_seq_len=max_seq_len,
                dtype=args.kv_dtype or dtype,
            )
            arena = f"KV arena ({layout.num_pages:,} pages x {layout.page_size:,} tokens x {fmt_bytes(layout.bytes_per_token)}/token)"
            check_fits({arena: cache_bytes(layout), f"weights ({dtype.name})": weight_bytes(config, dtype)},
                       hint="lower --batch, --page-size, --num-pages, --max-new-tokens or --max-seq-len")  # fmt: skip
            break
        except ValueError as exc:  # memory.TooLarge included: the bucket failing falls back to the exact length
            if i + 1 == len(lengths):
                parser.error(f"{sizes}: {exc}")
    chunk_size = min(args.chunk_size or models.default_chunk_size(mixed_steps=args.mixed_steps, longest_prompt=len(prompt)), layout.max_seq_len)  # generate's: no sequence is longer
    if args.mixed_steps and args.token_budget is not None and args.token_budget < args.batch + chunk_size:
        parser.error(f"--token-budget {args.token_budget}: token_budget={args.token_budget} must hold the batch's decode "
                     f"tokens (--batch {args.batch}) plus at least one prompt chunk (--chunk-size {chunk_size}): at least "
                     f"{args.batch + chunk_size}")
    if layout.pages_for(total) > layout.num_pages:  # before any compile, in the user's own flags
        parser.error(
            f"--num-pages {layout.num_pages} x --page-size {layout.page_size} = {layout.token_capacity} tokens cannot "
            f"hold one sequence: the prompt's {len(prompt)} tokens + --max-new-tokens {args.max_new_tokens} = {total} "
            f"tokens need {layout.pages_for(total)} pages"
        )
    try:
        check_fits({"prompts and generated tokens": num_prompts * total * HOST_BYTES_PER_TOKEN},
                   limit=host_memory_limit(), hint="lower --num-prompts or --max-new-tokens")  # fmt: skip
    except TooLarge as exc:
        parser.error(f"--num-prompts {num_prompts} x {total} tokens: {exc}")
    if args.host_pages:
        try:
            check_fits({f"host tier ({args.host_pages:,} pages)": args.host_pages * layout.page_bytes},
                       limit=host_memory_limit(), hint="lower --host-pages")  # fmt: skip
        except TooLarge as exc:
            parser.error(f"--host-pages {args.host_pages}: {exc}")

    if args.model_dir:
        try:
            model, _ = models.load_pretrained(args.model_dir, dtype=dtype, scan_layers=False if args.no_scan_layers else None)
        except (OSError, ValueError) as exc:
            parser.error(f"--model-dir {args.model_dir}: {exc}")
    else:
        scan = False if args.no_scan_layers else models.default_scan_layers(config, dtype)  # as load_pretrained's
        model = models.init_random(config, seed=args.seed, dtype=dtype, scan_layers=scan)
    prompts = [prompt] * num_prompts
    if cache_dir is not None:  # only once the arguments and the model are known to be good
        compile_cache.enable(cache_dir, given=args.compile_cache is not None)
    try:
        # The options as generate's objects (models.options), built once from the flags.
        sampling = models.Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                   stop_tokens=() if args.ignore_eos else None)  # None: the checkpoint's eos tokens
        serving = models.Serving(batch_size=args.batch, chunk_size=chunk_size, layout=layout, prefix_cache=args.prefix_cache,
                                 mixed_steps=args.mixed_steps, token_budget=args.token_budget, decode_block=args.decode_block)
        warm_start = time.perf_counter()
        warm_new = min(2, args.max_new_tokens)  # fits wherever the real run fits (checked above)
        first = models.generate(model, prompts[:1], warm_new, sampling=sampling, serving=serving)  # compile first
        if args.prefix_cache:  # a second call hits the first: the prefix ops compile too
            again = dataclasses.replace(serving, layout=None)
            models.generate(model, prompts[:1], warm_new, sampling=sampling, serving=again, cache=first.cache,
                            prefix_cache=first.prefix_cache)  # fmt: skip
        warm = time.perf_counter() - warm_start
        stream = _Stream(tokenizer) if args.stream else None
        result = models.generate(model, prompts, args.max_new_tokens, sampling=sampling, on_token=stream,
                                 serving=dataclasses.replace(serving, host_pages=args.host_pages))  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))

    shown = range(1 if args.stream else 0, min(len(result.tokens), 4))
    if stream is not None:
        stream.finish()
    for i in shown:
        toks = result.tokens[i]
        text = tokenizer.decode(toks, skip_special_tokens=True) if tokenizer is not None else " ".join(map(str, toks))
        print(f"[{i}] {text}")
    if len(result.tokens) > 4:
        print(f"... ({len(result.tokens) - 4} more)")
    stops = "none" if args.ignore_eos or not model.config.eos_token_ids else list(model.config.eos_token_ids)
    print(
        f"{result.num_generated} tokens in {result.seconds:.3f} s, {result.compile_seconds:.3f} s of it compiling: "
        f"{result.tokens_per_second:.1f} tokens/s "
        f"(batch {args.batch}, {result.prefill_calls} prefill + {result.mixed_calls} mixed + {result.decode_calls} decode calls "
        f"of {result.decode_steps} steps, "
        f"{result.preemptions} preemptions; stop tokens {stops}; KV arena {layout.dtype.name}; warm-up {warm:.1f} s)"
    )
    if args.prefix_cache:
        m = aj_health(result)
        print(
            f"prefix cache: {m['prefix_lookups']} lookups, {m['prefix_hit_tokens']} of {m['prefix_lookup_tokens']} prompt "
            f"tokens hit (hit rate {m['prefix_hit_rate']:.1%}); {result.prefill_tokens} tokens computed in prefill; "
            f"{m['cached_pages']} pages ({m['cached_tokens']} tokens) cached; {result.evictions} evictions"
        )
        why = _no_prefix_hits(m["prefix_hit_tokens"], num_prompts, len(prompt), args.batch)
        if why:
            print(f"  no hits: {why}")
    if args.host_pages:
        m = aj_health(result)
        hits = f"; {m['prefix_host_hit_tokens']} hit tokens brought back from it" if args.prefix_cache else ""
        print(
            f"host tier: {args.host_pages} pages ({fmt_bytes(args.host_pages * layout.page_bytes)}); "
            f"{result.swap_outs} of {result.preemptions} preemptions swapped ({result.swapped_tokens} tokens), "
            f"{result.recomputed_tokens} tokens recomputed; {m['pages_to_host']} pages to host, {m['pages_to_device']} "
            f"back ({fmt_bytes(m['bytes_to_host'] + m['bytes_to_device'])}: {result.modelled_transfer_seconds * 1e3:.3f} ms "
            f"at the assumed 25 GB/s){hits}"
        )
    return 0


def _no_prefix_hits(hit_tokens: int, num_prompts: int, prompt_len: int, batch: int) -> str | None:
    """Why --prefix-cache hit nothing in a run of `num_prompts` copies of one prompt (None when it
    hit). The run starts on an empty prefix cache, and a prompt's K/V enter it only as its
    prefill writes them (whole pages as they fill, the rest when it finishes): a copy hits what
    copies admitted before it wrote, never a copy admitted in the same step."""
    if hit_tokens:
        return None
    if prompt_len < 2:
        return "a 1-token prompt has no prefix to look up (a prompt's last token is always computed)"
    if num_prompts == 1:
        return "one prompt, and the run starts on an empty prefix cache: only later prompts can hit what it wrote"
    if num_prompts <= batch:
        return (f"all {num_prompts} copies of the prompt fit the batch (--batch {batch}) and were admitted in the "
                "same step, before any of them had written its K/V; a prompt's K/V enter the prefix cache as its "
                "prefill writes them, so only copies admitted later hit (--num-prompts above --batch)")
    return ("no copy of the prompt found K/V written by an earlier one: a prompt's K/V enter the prefix cache as its "
            "prefill writes them, and may be evicted (--num-pages) before a later copy is admitted")


class _Stream:
    """--stream: prints prompt 0's text (or token ids, without a tokenizer) as the loop keeps its tokens."""

    def __init__(self, tokenizer):
        from arena_jax.models.text import TextStream

        self.text = TextStream(tokenizer) if tokenizer is not None else None
        print("[0] ", end="", flush=True)

    def __call__(self, i: int, token: int) -> None:
        if i == 0:
            piece = self.text.push(token) if self.text is not None else f"{token} "
            print(piece, end="", flush=True)

    def finish(self) -> None:
        print(self.text.finish() if self.text is not None else "", flush=True)


def aj_health(result) -> dict:
    import arena_jax as aj

    return aj.health(result.cache, result.prefix_cache, host=result.host)


if __name__ == "__main__":
    sys.exit(main())
