"""`arena-generate`'s flags refused before any work (issue 37): the compilation cache folder
(and `arena-serve`'s), flags a greedy or non-mixed run would ignore, --model beside
--model-dir. The model is never built (`models.init_random` fails the test if called), so
nothing compiles."""
from __future__ import annotations

import re

import pytest

from arena_jax import models
from arena_jax.models import cli as generate_cli
from arena_jax.models import compile_cache
from arena_jax.server import cli as serve_cli
from arena_jax.server import engine as serve_engine


class _ReachedWork(Exception):
    pass


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(models, "init_random", lambda *a, **k: pytest.fail("the model was built"))
    monkeypatch.setattr(compile_cache, "enable", lambda *args, **kwargs: None)  # never this process's JAX


def _cli_error(prog, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        CLIS[prog].main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{prog}: error:" in err and "Traceback" not in err
    return err


def _generate_error(argv, capsys) -> str:
    return _cli_error("arena-generate", argv, capsys)


# Both command-line tools that compile a model's programs keep them in the same cache
# (`arena_jax.models.compile_cache`), with the same flags and refusals.
CLIS = {"arena-generate": generate_cli, "arena-serve": serve_cli}


@pytest.mark.parametrize("prog", CLIS)
@pytest.mark.parametrize("path", ["/proc/no/cache", "/proc/version", "{tmp}/file", "{tmp}/file/cache"])
def test_refuses_an_unwritable_compile_cache(prog, path, tmp_path, capsys, monkeypatch, no_model):
    """Issue 37: `arena-generate --compile-cache <unwritable>` was ignored without a word (JAX warns at
    most, then compiles every run again). Refused before any work, naming the flag and the way out;
    `arena-serve` the same (issue 39: it had no cache, and compiled every program at every start)."""
    (tmp_path / "file").write_text("")
    path = path.replace("{tmp}", str(tmp_path))
    err = _cli_error(prog, ["--compile-cache", path], capsys)
    assert f"--compile-cache {path!r}: cannot write a compilation cache there" in err and "--no-compile-cache" in err
    monkeypatch.setenv(compile_cache.CACHE_ENV, path)  # the default, from the environment: the same
    assert f"${compile_cache.CACHE_ENV} (the default --compile-cache) {path!r}: cannot write" in _cli_error(prog, [], capsys)


@pytest.mark.parametrize("prog", CLIS)
def test_creates_a_missing_compile_cache_folder(prog, tmp_path, capsys, monkeypatch, no_model):
    """A writable path in missing folders is created and then used, once the arguments are good
    and before the model's programs compile; --no-compile-cache beside --compile-cache
    contradicts it; an empty $ARENA_JAX_COMPILE_CACHE is no cache."""
    folder = tmp_path / "new" / "deeper"
    enabled = []
    monkeypatch.setattr(compile_cache, "enable", lambda *args, **kwargs: enabled.append((args, kwargs)))

    def reached(*args, **kwargs):
        raise _ReachedWork

    monkeypatch.setattr(models, "init_random", lambda *args, **kwargs: object())  # no model built
    monkeypatch.setattr(*{"arena-generate": (models, "generate"), "arena-serve": (serve_engine, "Engine")}[prog], reached)
    with pytest.raises(_ReachedWork):  # reached the first call that compiles
        CLIS[prog].main(["--compile-cache", str(folder)])
    assert folder.is_dir() and list(folder.iterdir()) == []  # the write probe left nothing behind
    assert enabled == [((str(folder),), {"given": True})]
    err = _cli_error(prog, ["--compile-cache", str(folder), "--no-compile-cache"], capsys)
    assert f"--compile-cache {folder} and --no-compile-cache: give one" in err
    monkeypatch.setenv(compile_cache.CACHE_ENV, "")
    assert compile_cache.folder(CLIS[prog].build_parser().parse_args([]), None) is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--top-k", "5"], "--top-k has no effect at --temperature 0 \\(greedy\\)"),
        (["--top-p", "0.9", "--top-k", "3"], "--top-k and --top-p have no effect at --temperature 0"),
        (["--token-budget", "40"], "--token-budget 40 needs --mixed-steps"),
        (["--model-dir", "/nonexistent", "--model", "tiny-gemma2"], "--model tiny-gemma2 has no effect with --model-dir"),
        (["--mixed-steps", "--token-budget", "5", "--batch", "4", "--chunk-size", "8"],
         r"--token-budget 5: .* \(--batch 4\) plus at least one prompt chunk \(--chunk-size 8\): at least 12"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else "",
)  # fmt: skip
def test_refuses_flags_it_would_ignore_before_any_work(argv, message, capsys, no_model):
    err = _generate_error([*argv, "--no-compile-cache"], capsys)
    assert re.search(message, err), err


def test_help_shows_every_default_and_accepted_value(capsys):
    """Issue 40, item 6: `arena-generate --help` names each option's default (or says what it
    defaults to) and lists the values of every option that takes a fixed set."""
    with pytest.raises(SystemExit) as exc:
        generate_cli.main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for action in generate_cli.build_parser()._actions:
        if not action.option_strings or action.help == "show this help message and exit":
            continue
        flag = max(action.option_strings, key=len)
        assert action.help, f"{flag} has no help"
        if action.default is not None and action.default is not False:
            assert f"(default: {action.default})" in text or "default" in action.help, flag
        for value in action.choices or ():
            assert str(value) in text, (flag, value)


def test_runs_on_an_int4_arena(capsys):
    """Issue 40, item 6: `arena-generate --help` offered no int4 (--kv-dtype took float and 8-bit
    arenas only) though `generate` runs int4 arenas. Now --kv-dtype int4 runs, here on the tiny
    model whose head_dim is a multiple of 32 (a prefill and one decode step), and a model whose
    head_dim is not is refused before any work, naming the one that fits."""
    argv = ["--model", "tiny-qwen3", "--kv-dtype", "int4", "--prompt", "Hi", "--max-new-tokens", "2", "--batch", "1",
            "--decode-block", "1", "--no-compile-cache"]  # fmt: skip
    assert generate_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "2 tokens in" in out and "KV arena int4" in out and "1 decode calls" in out, out
    err = _generate_error(["--kv-dtype", "int4", "--no-compile-cache"], capsys)
    assert "--kv-dtype int4 needs head_dim a multiple of 32 (one bf16 scale per 32 lanes); --model tiny has head_dim 16: " \
           "try --model tiny-qwen3" in err, err


def test_prefix_cache_says_why_copies_admitted_together_hit_nothing(capsys):
    """Issue 40, item 6: `--prefix-cache --num-prompts 4 --batch 4` reported a 0% hit rate with no
    word of why: the copies are admitted in one step, before any has written its K/V, and the
    prefix cache holds only K/V already written. The output now says so; a copy admitted later
    (--num-prompts above --batch) hits, and then nothing is said."""
    base = ["--prefix-cache", "--batch", "2", "--num-pages", "8", "--max-new-tokens", "2", "--decode-block", "1",
            "--no-compile-cache"]  # fmt: skip (8 pages: both rows admitted at once)
    assert generate_cli.main([*base, "--num-prompts", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"prefix cache: 2 lookups, 0 of \d+ prompt tokens hit", out), out
    assert "no hits: all 2 copies of the prompt fit the batch (--batch 2) and were admitted in the same step, before " \
           "any of them had written its K/V" in out, out
    assert generate_cli.main([*base, "--num-prompts", "3"]) == 0  # the same shapes: nothing new to compile
    out = capsys.readouterr().out
    assert re.search(r"prefix cache: 3 lookups, [1-9]\d* of \d+ prompt tokens hit", out) and "no hits" not in out, out
    assert generate_cli._no_prefix_hits(0, 1, 27, 4).startswith("one prompt, and the run starts on an empty prefix")
    assert generate_cli._no_prefix_hits(0, 3, 1, 4).startswith("a 1-token prompt has no prefix")
