#!/usr/bin/env bash
# One device call's worth of GPU checks (H100 / H200 image with JAX + CUDA preinstalled; no install
# needed: the repository runs from PYTHONPATH). From the repository root on the device machine:
#   OUT=/some/dir bash scripts/gpu_check.sh [STEP...]     (default: tests kernels decode kernels_int8)
# Each step has its own timeout (T_<STEP> seconds) so one slow step cannot eat the others' time;
# each step's log lands in $OUT/<step>.log, the benchmarks' JSON beside it.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
PY=${PY:-python3}
BENCH="$PY -m arena_jax.benchmarks"
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
         timeout "$limit" "$@" 2>&1 | grep -v "^WARNING: All log\|^I0000\|^W0000" | tee "$OUT/$name.log"; echo "=== $name rc=${PIPESTATUS[0]}"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/device.log"
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1 | tee -a "$OUT/device.log"
for s in ${@:-tests kernels decode kernels_int8}; do case $s in
  tests) step tests ${T_TESTS:-240} $PY -m pytest -p no:cacheprovider --timeout 200 -rfs \
           tests/test_kernels_append.py tests/test_kernels_attention.py tests/test_kernels_quantized.py tests/test_backends.py \
           tests/test_models.py::test_one_row_safe_einsum_on_a_gpu_matches_the_einsum ;;
  kernels) step kernels ${T_KERNELS:-200} $BENCH kernels --no-progress --batches 1,8,64 --contexts 512,4096,32768 --json "$OUT/kernels.json" ;;
  decode) step decode ${T_DECODE:-150} $BENCH decode --no-progress --model llama3-8b --batch 8 --prompt-len 512 --new-tokens 64 --repeats 3 --hf off --json "$OUT/decode.json" ;;
  decode_f32) step decode_f32 ${T_DECODE_F32:-90} $BENCH decode --no-progress --model llama3-8b --num-layers 8 --dtype float32 --batch 8 --prompt-len 512 --new-tokens 64 --repeats 2 --hf off --json "$OUT/decode_f32.json" ;;
  weights) step weights ${T_WEIGHTS:-330} $PY -m arena_jax.benchmarks.studies.gpu_step --json "$OUT/gpu_step.json" ;;
  splits) step splits ${T_SPLITS:-200} $PY -m arena_jax.benchmarks.studies.gpu_step --cases 1:512,8:512,32:512 --capacity 4096 --variants arena,arena-1split,dense --json "$OUT/gpu_step_splits.json" ;;
  plan) step plan ${T_PLAN:-200} $PY -m arena_jax.benchmarks.studies.gpu_step --cases 1:512,8:512,32:512 --variants arena,arena-noplan,dense --json "$OUT/gpu_step_plan.json" ;;
  hf_static) step hf_static ${T_HF_STATIC:-240} $PY -m arena_jax.benchmarks.studies.hf_generate --model llama3-8b --dtype bfloat16 --batch 8 --prompt-len 512 --new-tokens 64 --rounds 2 --peers hf,hf-static --json "$OUT/hf_static.json" ;;
  bound) step bound ${T_BOUND:-120} $PY -m arena_jax.benchmarks.studies.compile_bound --rounds 2 ;;
  presets) step presets ${T_PRESETS:-170} bash -c 'for c in tiny:4:32 tiny:1:128 mid:1:128 mid:8:128 mid:8:1024; do IFS=: read m b p <<< "$c"; echo "--- $m / $b / $p"; '"$BENCH"' decode --no-progress --model $m --batch $b --prompt-len $p --new-tokens 32 --repeats 6 --hf off; done' ;;
  long) step long ${T_LONG:-130} bash -c 'for p in 1024 4096; do echo "--- llama3-8b / 8 / $p"; '"$BENCH"' decode --no-progress --model llama3-8b --batch 8 --prompt-len $p --new-tokens 32 --repeats 3 --hf off; done' ;;
  reserve) step reserve ${T_RESERVE:-300} bash -c "$PY -m pytest -p no:cacheprovider --timeout 200 -rfs tests/test_kernels_allocate.py && $PY -m arena_jax.benchmarks.studies.compile_bound --rounds 2 && $PY -m arena_jax.benchmarks.studies.gpu_step --cases 1:512,8:512,32:512 --variants arena,arena-xla-reserve,dense --json $OUT/gpu_step_reserve.json" ;;
  kernels_int8) step kernels_int8 ${T_INT8:-60} $BENCH kernels --no-progress --dtype int8 --batches 8,64 --contexts 4096 --json "$OUT/kernels_int8.json" ;;
  *) echo "unknown step $s"; exit 2 ;;
esac; done
