#!/usr/bin/env bash
# One device call's worth of GPU checks (H100 / H200 image with JAX + CUDA preinstalled).
# Usage on the device machine, from the repository root:  OUT=/some/dir bash scripts/gpu_check.sh
# Each step has its own timeout so one slow step cannot eat the others' time; logs land in $OUT.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
PY=${PY:-python3}
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
         timeout "$limit" "$@" 2>&1 | grep -v "^WARNING: All log\|^I0000\|^W0000" | tee "$OUT/$name.log"; echo "=== $name rc=${PIPESTATUS[0]}"; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # no install: the image has every dependency
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/device.log"
$PY -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1 | tee -a "$OUT/device.log"
step tests ${T_TESTS:-120} $PY -m pytest -q -x -p no:cacheprovider --timeout 140 tests/test_kernels_append.py tests/test_kernels_attention.py
step kernels ${T_KERNELS:-200} $PY -m benchmarks kernels --no-progress --batches 1,8,64 --contexts 512,4096,32768 --json "$OUT/kernels.json"
step decode ${T_DECODE:-150} $PY -m benchmarks decode --no-progress --model llama3-8b --batch 8 --prompt-len 512 --new-tokens 64 --repeats 3 --hf off --json "$OUT/decode.json"
step kernels_int8 ${T_INT8:-60} $PY -m benchmarks kernels --no-progress --dtype int8 --batches 8,64 --contexts 4096 --json "$OUT/kernels_int8.json"
