"""`arena-bench serve --http`: `arena-serve` against `transformers serve` (transformers' own
OpenAI-compatible server, continuous batching on) over loopback, on the same checkpoint and
machine. How many tokens per second does each serve under a Poisson load, and at what time to
first token and inter-token latency?

Each server runs as its own process on a free port of 127.0.0.1 and is warmed up (a few
requests of the run's shapes) before any timed load. A load is `requests` completions with
Poisson arrivals at `rate` requests/s, prompts of random words, `max_tokens` greedy tokens
(greedy, so both servers must give the same texts: checked and reported), streamed; each
request's time to first token, the gaps between its chunks, and its tokens (the final chunk's
`usage`, else one per chunk) are recorded. Loads are alternated between the servers, `repeats`
times per rate; the table gives medians over repeats of each load's figures.

Without torch and transformers (or with `--peer none`) only arena-serve is measured.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

__all__ = ["HttpSettings", "run_http"]

WORDS = ("the arena holds every page of tokens in fixed blocks and a model reads them back when it "
         "decodes the next word for each request that waits").split()  # fmt: skip


@dataclasses.dataclass(frozen=True)
class HttpSettings:
    model_dir: str | None = None  # None: a demo checkpoint made here (benchmarks.demo_checkpoint)
    rates: tuple[float, ...] = (4.0, 16.0)  # requests per second (Poisson)
    requests: int = 48
    max_tokens: int = 32
    prompt_words: tuple[int, int] = (4, 40)
    repeats: int = 2
    max_seqs: int = 8
    peer: str = "auto"  # "transformers" | "none" | "auto" (transformers where installed)
    seed: int = 0
    timeout: float = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Process:
    """A server process; `stop` ends it. `port`: the one it was told (a free one picked before it
    started), or None: it prints the port it bound (`arena-serve --port 0`: no other process can
    take the port in between)."""

    def __init__(self, name: str, argv: list[str], port: int | None, timeout: float, env: dict | None = None):
        self.name, self.url = name, (f"http://127.0.0.1:{port}" if port else None)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + timeout
        while True:
            self.url = self.url or self._printed_url()
            try:
                if self.url:
                    urllib.request.urlopen(f"{self.url}/health", timeout=5)
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                tail = self._output()[-3000:]
                self.stop()
                raise RuntimeError(f"{name} did not start:\n{tail}")
            time.sleep(0.3)

    def _output(self) -> str:
        # pread: the child writes through the same file offset, which a seek here would move
        return os.pread(self.log.fileno(), 1 << 24, 0).decode(errors="replace")

    def _printed_url(self) -> str | None:
        found = re.search(r"^arena-serve: listening on (http://\S+)$", self._output(), re.M)
        return found.group(1) if found else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _jobs(settings: HttpSettings, rate: float, rng: random.Random) -> list[tuple[float, str]]:
    """(arrival s, prompt) per request: Poisson arrivals at `rate`."""
    t, out = 0.0, []
    for _ in range(settings.requests):
        out.append((t, " ".join(rng.choice(WORDS) for _ in range(rng.randint(*settings.prompt_words)))))
        t += rng.expovariate(rate)
    return out


async def _load(url: str, model: str, jobs, max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    start = time.perf_counter()

    async def one(arrival: float, prompt: str):
        await asyncio.sleep(max(0.0, arrival - (time.perf_counter() - start)))
        sent = time.perf_counter()
        stamps, text, tokens = [], "", None
        try:
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                     stream=True, stream_options={"include_usage": True})  # fmt: skip
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    stamps.append(time.perf_counter())
                    text += chunk.choices[0].text
                if getattr(chunk, "usage", None):
                    tokens = chunk.usage.completion_tokens
        except Exception as exc:  # noqa: BLE001 - counted and shown, the load goes on
            return {"error": f"{type(exc).__name__}: {exc}"[:200]}
        return {"ttft": stamps[0] - sent if stamps else None, "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
                "tokens": tokens if tokens is not None else len(stamps), "text": text, "end": time.perf_counter()}  # fmt: skip

    results = await asyncio.gather(*(one(a, p) for a, p in jobs))
    await client.close()
    ok = [r for r in results if "error" not in r]
    wall = max((r["end"] for r in ok), default=start) - start
    ttft = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    gaps = sorted(g for r in ok for g in r["gaps"])
    tokens = sum(r["tokens"] for r in ok)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
    return {"tokens_per_s": tokens / wall if wall > 0 else float("nan"), "tokens": tokens, "wall_s": wall,
            "ttft_p50_ms": 1e3 * pct(ttft, 0.5), "ttft_p99_ms": 1e3 * pct(ttft, 0.99),
            "itl_p50_ms": 1e3 * pct(gaps, 0.5), "itl_p99_ms": 1e3 * pct(gaps, 0.99),
            "errors": len(results) - len(ok), "texts": [r.get("text") for r in results]}  # fmt: skip


def _peer_available() -> str | None:
    """Why `transformers serve` cannot run here, or None."""
    if shutil.which("transformers") is None and not Path(sys.executable).with_name("transformers").exists():
        return "the `transformers` CLI is not installed"
    try:
        import accelerate  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed"
    return None


def run_http(settings: HttpSettings, progress=None) -> dict:
    """Start the servers, run the alternated loads, stop them; the rows and the notes."""
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = settings.model_dir
        if folder is None:
            from arena_jax.benchmarks.demo_checkpoint import write_checkpoint

            folder = str(write_checkpoint(Path(tmp) / "demo", seed=settings.seed))
            notes.append("checkpoint: a demo one made here (random tiny Llama, head_dim 32, a BPE tokenizer): "
                         "arena_jax.benchmarks.demo_checkpoint")  # fmt: skip
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        longest = 256  # prompt + max_tokens, in tokens: the default prompts are at most ~130
        peer = settings.peer
        why = _peer_available() if peer != "none" else "--peer none"
        if peer == "transformers" and why:  # (before any server starts: none is left running)
            raise RuntimeError(f"--peer transformers: {why}")
        servers = {}
        servers["arena-serve"] = _Process("arena-serve", [
            sys.executable, "-m", "arena_jax.server.cli", "--model-dir", folder, "--served-model-name", "m",
            "--port", "0", "--max-seqs", str(settings.max_seqs), "--max-model-len", str(longest),
            "--dtype", "float32", "--log-level", "warning"], None, settings.timeout, env)  # fmt: skip
        try:
            if why is None:
                port = _free_port()
                exe = shutil.which("transformers") or str(Path(sys.executable).with_name("transformers"))
                servers["transformers serve"] = _Process("transformers serve", [
                    exe, "serve", folder, "--port", str(port), "--device", "cpu", "--dtype", "float32",
                    "--continuous-batching", "--host", "127.0.0.1"], port, settings.timeout, env)  # fmt: skip
            else:
                notes.append(f"transformers serve not measured: {why}")
            names = {"arena-serve": "m", "transformers serve": folder}
            warm = _jobs(dataclasses.replace(settings, requests=min(8, settings.requests)), 100.0, random.Random(1))
            for name, server in servers.items():  # warm-up: compiles, caches, lazy loads
                asyncio.run(_load(server.url, names[name], warm, settings.max_tokens))
            rows, loaded = [], None  # loaded: (the last load's jobs, each server's streamed texts of them)
            advance = progress.add_task("serve --http: loads", total=len(settings.rates) * settings.repeats * len(servers)) if progress else None
            for rate in settings.rates:
                runs = {name: [] for name in servers}
                for rep in range(settings.repeats):
                    jobs = _jobs(settings, rate, random.Random(settings.seed + rep))
                    for name, server in servers.items():  # alternated, the same jobs
                        runs[name].append(asyncio.run(_load(server.url, names[name], jobs, settings.max_tokens)))
                        if advance:
                            advance(1)
                    loaded = (jobs, {name: got[-1]["texts"] for name, got in runs.items()})
                for name, got in runs.items():
                    med = {k: statistics.median(r[k] for r in got) for k in
                           ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "wall_s")}  # fmt: skip
                    rows.append({"server": name, "rate": rate, **{k: round(v, 3) for k, v in med.items()},
                                 "errors": sum(r["errors"] for r in got)})  # fmt: skip
                if len(runs) == 2:
                    a, b = (runs[n] for n in servers)
                    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra["texts"], rb["texts"]))
                    notes.append(f"rate {rate}/s: streamed greedy texts equal in {same} of {len(a) * settings.requests} "
                                 "requests (the two servers'; whose texts move under load: below)")  # fmt: skip
            if loaded is not None:  # each server against itself: the last load's prompts again, one at a time, not streamed
                from openai import OpenAI

                jobs, streamed = loaded
                alone = {name: [OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0).completions.create(
                    model=names[name], prompt=p, max_tokens=settings.max_tokens, temperature=0).choices[0].text
                    for _, p in jobs] for name, server in servers.items()}  # fmt: skip
                for name in servers:
                    notes.append(f"{name}: greedy texts streamed under the last load == one request at a time, not "
                                 f"streamed: {sum(x == y for x, y in zip(streamed[name], alone[name]))} of {len(jobs)}")
                if len(servers) == 2:
                    x, y = alone.values()
                    notes.append(f"greedy texts, one request at a time, not streamed: the two servers equal in "
                                 f"{sum(a == b for a, b in zip(x, y))} of {len(jobs)}")
        finally:
            for server in servers.values():
                server.stop()
    return {"settings": dataclasses.asdict(settings), "rows": rows, "notes": notes}


def http_lines(result: dict) -> list[str]:
    rows = result["rows"]
    head = f"{'server':<20}{'rate/s':>7}{'tok/s':>9}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}{'p99':>9}{'err':>5}"
    out = [head]
    for r in rows:
        out.append(f"{r['server']:<20}{r['rate']:>7g}{r['tokens_per_s']:>9.1f}{r['ttft_p50_ms']:>8.0f}ms"
                   f"{r['ttft_p99_ms']:>7.0f}ms{r['itl_p50_ms']:>7.1f}ms{r['itl_p99_ms']:>7.1f}ms{r['errors']:>5}")  # fmt: skip
    by = {(r["server"], r["rate"]): r for r in rows}
    for rate in result["settings"]["rates"]:
        a, b = by.get(("arena-serve", rate)), by.get(("transformers serve", rate))
        if a and b:
            out.append(f"rate {rate:g}/s: arena-serve / transformers serve throughput {a['tokens_per_s'] / b['tokens_per_s']:.2f}x, "
                       f"ITL p99 {a['itl_p99_ms'] / b['itl_p99_ms']:.2f}x")  # fmt: skip
    return out + [f"  {n}" for n in result["notes"]]


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.http_serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=None)
    p.add_argument("--rates", type=float, nargs="+", default=list(HttpSettings.rates))
    p.add_argument("--requests", type=int, default=HttpSettings.requests)
    p.add_argument("--max-tokens", type=int, default=HttpSettings.max_tokens)
    p.add_argument("--repeats", type=int, default=HttpSettings.repeats)
    p.add_argument("--max-seqs", type=int, default=HttpSettings.max_seqs)
    p.add_argument("--peer", choices=("auto", "transformers", "none"), default="auto")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    settings = HttpSettings(model_dir=args.model_dir, rates=tuple(args.rates), requests=args.requests,
                            max_tokens=args.max_tokens, repeats=args.repeats, max_seqs=args.max_seqs, peer=args.peer)  # fmt: skip
    result = run_http(settings)
    print("\n".join(http_lines(result)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
