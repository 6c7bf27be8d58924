"""The persistent compilation cache of the command-line tools (`arena-generate`, `arena-serve`):
their compiled programs are written to a folder, so that only a tool's first run on a machine
pays for compiling them (issue 39: the cache's ops add to every new process's first compile).

`--compile-cache DIR` names the folder; without it `$ARENA_JAX_COMPILE_CACHE` (empty: no cache),
else `~/.cache/arena-jax/xla`; `--no-compile-cache`: none. A folder that cannot be written is
refused before any work (JAX itself only warns, then compiles every run again). A library
caller configures JAX's cache itself (`jax.config.update("jax_compilation_cache_dir", ...)`).
"""
from __future__ import annotations

import argparse
import os
import tempfile

__all__ = ["CACHE_ENV", "DEFAULT_CACHE", "MIN_COMPILE_SECONDS", "add_flags", "folder", "enable"]

CACHE_ENV = "ARENA_JAX_COMPILE_CACHE"
DEFAULT_CACHE = os.path.join("~", ".cache", "arena-jax", "xla")
MIN_COMPILE_SECONDS = 0.5  # programs that compile faster are not written (JAX's threshold)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """`--compile-cache DIR` and `--no-compile-cache`."""
    parser.add_argument(
        "--compile-cache", metavar="DIR",
        help=f"JAX persistent compilation cache folder, so later runs skip compiling; created if missing, refused if it "
             f"cannot be written (default ${CACHE_ENV}, empty: none, or {DEFAULT_CACHE})",
    )  # fmt: skip
    parser.add_argument("--no-compile-cache", action="store_true", help="do not use a persistent compilation cache")


def folder(args, parser) -> str | None:
    """The compilation cache folder to use (None: none): --compile-cache, else $ARENA_JAX_COMPILE_CACHE
    (empty: none), else ~/.cache/arena-jax/xla; created here, refused (`parser.error`) unless a
    file can be written in it."""
    if args.no_compile_cache:
        if args.compile_cache is not None:
            parser.error(f"--compile-cache {args.compile_cache} and --no-compile-cache: give one")
        return None
    if args.compile_cache is not None:
        path, flag = args.compile_cache, "--compile-cache"
        if not path:
            parser.error("--compile-cache '': an empty folder name (--no-compile-cache: no cache)")
    elif CACHE_ENV in os.environ:
        path, flag = os.environ[CACHE_ENV], f"${CACHE_ENV} (the default --compile-cache)"
        if not path:
            return None
    else:
        path, flag = os.path.expanduser(DEFAULT_CACHE), "the default --compile-cache"
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # really written (as root, os.access says yes to read-only mounts)
            pass
    except OSError as exc:
        parser.error(f"{flag} {path!r}: cannot write a compilation cache there ({exc.strerror or exc}); "
                     "--no-compile-cache runs without one")
    return path


def enable(path: str, given: bool = False) -> None:
    """Use `path`; unless `given` (--compile-cache), a folder the user configured JAX with wins."""
    import jax

    if jax.config.jax_compilation_cache_dir and not given:  # the user configured one already
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
