"""`arena-generate`'s flags refused before any work (issue 37): the compilation cache folder,
flags a greedy or non-mixed run would ignore, --model beside --model-dir. The model is never
built (`models.init_random` fails the test if called), so nothing compiles."""
from __future__ import annotations

import re

import pytest

from arena_jax import models
from arena_jax.models import cli as generate_cli


class _ReachedWork(Exception):
    pass


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(models, "init_random", lambda *a, **k: pytest.fail("the model was built"))
    monkeypatch.setattr(generate_cli, "_enable_compile_cache", lambda *args, **kwargs: None)  # never this process's JAX


def _generate_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        generate_cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "arena-generate: error:" in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("path", ["/proc/no/cache", "/proc/version", "{tmp}/file", "{tmp}/file/cache"])
def test_refuses_an_unwritable_compile_cache(path, tmp_path, capsys, monkeypatch, no_model):
    """Issue 37: `arena-generate --compile-cache <unwritable>` was ignored without a word (JAX warns at
    most, then compiles every run again). Refused before any work, naming the flag and the way out."""
    (tmp_path / "file").write_text("")
    path = path.replace("{tmp}", str(tmp_path))
    err = _generate_error(["--compile-cache", path], capsys)
    assert f"--compile-cache {path!r}: cannot write a compilation cache there" in err and "--no-compile-cache" in err
    monkeypatch.setenv(generate_cli.CACHE_ENV, path)  # the default, from the environment: the same
    assert f"${generate_cli.CACHE_ENV} (the default --compile-cache) {path!r}: cannot write" in _generate_error([], capsys)


def test_creates_a_missing_compile_cache_folder(tmp_path, capsys, monkeypatch, no_model):
    """A writable path in missing folders is created (and then used); --no-compile-cache beside
    --compile-cache contradicts it; an empty $ARENA_JAX_COMPILE_CACHE is no cache."""
    folder = tmp_path / "new" / "deeper"

    def reached(*args, **kwargs):
        raise _ReachedWork

    monkeypatch.setattr(models, "init_random", reached)
    with pytest.raises(_ReachedWork):
        generate_cli.main(["--compile-cache", str(folder)])
    assert folder.is_dir() and list(folder.iterdir()) == []  # the write probe left nothing behind
    err = _generate_error(["--compile-cache", str(folder), "--no-compile-cache"], capsys)
    assert f"--compile-cache {folder} and --no-compile-cache: give one" in err
    monkeypatch.setenv(generate_cli.CACHE_ENV, "")
    assert generate_cli._compile_cache(generate_cli.build_parser().parse_args([]), None) is None


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
