"""The CPU kernels' native library: built on first use, loaded, its FFI targets registered.

Every `*.cc` file of this folder (with the `*.h` they include) goes into one shared library, built once per source and jaxlib
version with the C++ compiler (`$CXX`, else `g++`, `c++` or `clang++`; C++17, `-O3 -march=native`:
for this machine's CPU, which the build's name hashes with the rest) against the
installed jaxlib's FFI headers (`jax.ffi.include_dir()`), in about 5 s, into
`$ARENA_JAX_NATIVE_DIR` (default `~/.cache/arena_jax/native`); built aside and renamed, so
processes building at once do not clash. Without a compiler, or when the build fails,
`native_problem()` says why and the dispatch keeps XLA's ops.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import numpy as np

__all__ = ["library", "native_problem", "table_attrs", "TARGETS"]

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cc")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
# FFI target name -> the library's handler symbol
TARGETS = {"arena_reserve_pages": "ArenaReservePages", "arena_reserve_pages_copy": "ArenaReservePagesCopy",
           "arena_plan_rows": "ArenaPlanRows", "arena_plan_rows_commit": "ArenaPlanRowsCommit",
           "arena_decode_attention": "ArenaDecodeAttention"}  # fmt: skip
_REGISTERED: dict[str, ctypes.CDLL] = {}  # FFI target -> the library whose handler XLA holds (once a process)


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu() -> str:
    """The CPU the library is built for (`-march=native`): its model and feature flags where Linux
    says, else the machine's name, so a build folder shared by other CPUs builds for each."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return platform.machine() + "|" + "|".join(sorted(set(lines)))


def _build_dir() -> Path:
    return Path(os.environ.get("ARENA_JAX_NATIVE_DIR") or Path.home() / ".cache" / "arena_jax" / "native")


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | str:
    """The loaded library with its FFI targets registered, or why it is not available."""
    import jaxlib

    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler found ($CXX, g++, c++ or clang++)"
    include = jax.ffi.include_dir()
    digest = hashlib.sha256(f"{jaxlib.__version__}|{include}|{compiler}|{_cpu()}".encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    target = _build_dir() / f"arena_native_{digest.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then renamed: atomic
                built = Path(tmp) / target.name
                cmd = [compiler, "-std=c++17", "-O3", "-march=native", "-shared", "-fPIC", "-w", f"-I{include}",
                       *map(str, SOURCES), "-o", str(built)]  # fmt: skip
                run = subprocess.run(cmd, capture_output=True, text=True)
                if run.returncode != 0:
                    return f"building the native kernels failed ({' '.join(cmd)}):\n{run.stderr[-2000:]}"
                os.replace(built, target)
        lib = ctypes.cdll.LoadLibrary(str(target))
    except OSError as e:  # an unwritable cache folder, a library that does not load
        return f"building or loading {target} failed: {e}"
    for name, symbol in TARGETS.items():
        if name not in _REGISTERED:  # XLA takes a target's handler once a process
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            _REGISTERED[name] = lib
    return lib


def native_problem() -> str | None:
    """Why the native kernels cannot run here (no compiler, a failed build), or None."""
    lib = library()
    return lib if isinstance(lib, str) else None


def table_attrs(geometry, offsets, page_size: int, pad_slot: int) -> dict:
    """The packed table's FFI attributes (`table.h`'s ARENA_TABLE_ATTRS), as int64 scalars."""
    names = ("max_seqs", "max_pages", "num_layers", "num_pages", "page_map_at", "slot_words_at", "page_words_at",
             "words_at")  # fmt: skip
    attrs = dict(zip(names, (*geometry, *offsets), strict=True), page_size=page_size, pad_slot=pad_slot)
    return {name: np.int64(int(value)) for name, value in attrs.items()}
