#!/usr/bin/env bash
# Install, into the active Python environment, what the sm_90a compile checks need
# (tests/test_compile_sm90.py, `arena-bench kernels --compile-report`). No GPU needed.
#   jax-cuda12-plugin, jax-cuda12-pjrt: the CUDA PJRT plugin (XLA's GPU compiler, Triton), pinned to
#     the installed jax; --no-deps skips cuDNN/cuBLAS/NCCL (~3 GB that compiling never touches).
#   nvidia-cuda-nvcc-cu12: ptxas and libdevice (~95 MB), pinned so register counts are reproducible.
set -euo pipefail
jax_version="$(python -c 'import jax; print(jax.__version__)')"
bash "$(dirname "$0")/pip_install.sh" -q --no-deps "jax-cuda12-plugin==${jax_version}" "jax-cuda12-pjrt==${jax_version}"
bash "$(dirname "$0")/pip_install.sh" -q "nvidia-cuda-nvcc-cu12==12.9.86"
