#!/usr/bin/env bash
# Install, into the active Python environment, what the TPU compile checks need
# (tests/test_compile_tpu.py, `arena-bench kernels --compile-report --target tpu-v5e`). No TPU needed.
#   libtpu: the TPU compiler and runtime library (XLA:TPU and Mosaic), pinned to the version the
#     installed jax's `tpu` extra names (jax 0.10.2 -> libtpu 0.0.42.*); --no-deps: it needs nothing
#     else (the extra's `requests` serves TPU VM metadata lookups, not compiling). ~213 MB download,
#     ~684 MB installed.
set -euo pipefail
spec="$(python - <<'PY'
import importlib.metadata as md
reqs = [r.split(";")[0].strip() for r in (md.requires("jax") or []) if 'extra == "tpu"' in r and r.startswith("libtpu")]
print(reqs[0] if reqs else "")
PY
)"
if [ -z "$spec" ]; then
  echo "install_tpu_tools.sh: the installed jax names no libtpu in its 'tpu' extra" >&2
  exit 1
fi
bash "$(dirname "$0")/pip_install.sh" -q --no-deps "$spec"
