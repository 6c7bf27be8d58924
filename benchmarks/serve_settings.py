"""`arena-bench serve`'s settings (`ServeSettings`, with the checks its flags get before any work):
what may a serve run be asked for?

Below both `arguments` (its flags' defaults) and `serve` (the run): `benchmarks.serve` re-exports
every name here.
"""
from __future__ import annotations

import dataclasses

__all__ = ["ServeSettings", "BLOCK"]

BLOCK = 8  # generate's decode_block (its default offline)


@dataclasses.dataclass
class ServeSettings:
    batch: int = 8
    prompt_len: int = 128
    new_tokens: int = 128
    chunk: int = 16  # bare-loop steps per timed run
    rounds: int = 7
    layers: tuple = (2, 8, 32)
    compile_cache_runs: bool = True
    cold_layers: int = 3  # depth of the model whose cold generate call is counted (3: a structure nothing else compiled)
    seed: int = 0
    arrivals: object = None  # benchmarks.arrivals.ArrivalSettings (None: its defaults; requests=0: skipped)
    arrivals_only: bool = False

    def validate(self) -> None:
        """A ValueError naming the `arena-bench serve` flags of any setting the run cannot serve
        (positions past the model's, decode steps fewer than one timed run, memory), before any work."""
        from arena_jax import models
        from arena_jax.benchmarks.arrivals import ArrivalSettings
        from arena_jax.benchmarks.studies.layer_scaling import WIDTHS
        from arena_jax.models.memory import cache_bytes, check_fits, host_memory_limit, weight_bytes

        a = self.arrivals if self.arrivals is not None else ArrivalSettings(seed=self.seed)
        if self.arrivals_only and not a.requests:
            raise ValueError("--arrivals-only with --arrivals-requests 0 measures nothing")
        device, host = {}, {}

        def sized(name, config, batch, tokens):  # weights and a float32 arena of `batch` rows of `tokens`
            pages = -(-tokens // 16)
            layout = config.kv_layout(page_size=16, num_pages=batch * pages, max_seqs=batch, max_seq_len=pages * 16,
                                      dtype="float32")  # fmt: skip
            device[f"{name}: weights"] = weight_bytes(config, "float32")
            device[f"{name}: arena"] = cache_bytes(layout)

        if not self.arrivals_only:
            b, p, n, tiny = self.batch, self.prompt_len, self.new_tokens, models.LlamaConfig.tiny()
            if p < 3:
                raise ValueError(f"--prompt-len {p}: at least 3 (the compiles-per-call run's third call has prompts "
                                 "of --prompt-len / 3 tokens)")
            if p + n > tiny.max_position_embeddings:
                raise ValueError(f"--prompt-len {p} + --new-tokens {n} = {p + n} tokens exceed the tiny model's "
                                 f"max_position_embeddings {tiny.max_position_embeddings}")
            # One timed run of each bare loop (--chunk steps; whole blocks of BLOCK), and a decode-only iteration
            # of generate's after its first (which runs beside the prefill): else a median of no times.
            steps = max(self.chunk, BLOCK * max(1, self.chunk // BLOCK), BLOCK + 1)
            if n - 1 < steps:
                raise ValueError(f"--new-tokens {n} leaves {n - 1} decode steps, fewer than the {steps} the timing needs "
                                 f"(one timed run of --chunk {self.chunk} steps, whole blocks of {BLOCK}, and a block "
                                 f"after generate's first): --new-tokens at least {steps + 1}, or a smaller --chunk")
            lens, new = _other_call(p, n)
            room = -(-(p + n) // 16) * 16  # models.default_layout's rows, pages of 16
            if max(lens) + new > room:
                raise ValueError(f"--prompt-len {p}, --new-tokens {n}: the compiles-per-call run's third call ({max(lens)} "
                                 f"+ {new} tokens) does not fit its arena's rows of {room} tokens")
            sized("timed model", tiny, b, p + n)
            sized(f"--cold-layers {self.cold_layers}", models.LlamaConfig.tiny(num_layers=self.cold_layers), b, p + n)
            if self.layers:
                deepest = models.LlamaConfig.tiny(num_layers=max(self.layers), max_position_embeddings=8192,
                                                  **WIDTHS["tiny"])  # fmt: skip
                sized(f"--layers {max(self.layers)}", deepest, b, p + 3 + 2)
        if a.requests:
            config = a.config()
            longest = max(a.long_len, a.short_len * 3 // 2)
            if longest + a.new_tokens > config.max_position_embeddings:
                raise ValueError(f"--arrivals-long-len {a.long_len}, --arrivals-short-len {a.short_len} (+50%): prompts "
                                 f"of up to {longest} + {a.new_tokens} new tokens exceed the {a.model} model's "
                                 f"max_position_embeddings {config.max_position_embeddings}")
            if a.long_every > a.requests:
                raise ValueError(f"--arrivals-long-every {a.long_every} > --arrivals-requests {a.requests}: no prompt "
                                 "would be long (--arrivals-long-len would be ignored)")
            sized(f"--arrivals-model {a.model}", config, a.batch, longest + a.new_tokens)
            host[f"--arrivals-requests {a.requests} prompts"] = a.requests * (longest + a.new_tokens) * 64
        check_fits(device, hint="lower --batch, --prompt-len, --new-tokens, --cold-layers, --layers or --arrivals-*")
        check_fits(host, limit=host_memory_limit(), hint="lower --arrivals-requests")


def _other_call(p: int, n: int) -> tuple[list[int], int]:
    """The compiles-per-call run's third call: its prompt lengths and max_new_tokens."""
    return [p // 2 + 3, p // 3, 7], n // 2 + 5
