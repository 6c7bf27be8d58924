#!/usr/bin/env bash
# The whole test suite on both JAX lines, each in its own fresh venv; fails if either fails.
# This is the README's test command and exactly what .ci/run runs.
#
#   py311: Python 3.11 -> JAX 0.10.2 (the newest JAX the registry serves to 3.11), the `test`
#          extra: the Hugging Face reference stack included (torch 2.13.0+cpu, installed first
#          so that pip does not pull a CUDA build), so the parity tests run here.
#   py313: Python 3.13 -> the newest JAX pyproject.toml admits (0.11.2 today), the `test-jax`
#          extra: no torch (3.13 has only the ~6 GB CUDA build); the parity tests skip with
#          that reason (ARENA_HF_REFERENCE=absent), everything else runs.
# Each line runs every test file; the sm_90a and TPU compile grids run in full on one line and a
# covering subset on the other (ARENA_COMPILE_GRID, set in run_line; docs/testing.md, which also
# says where the time goes). tests/conftest.py compiles at XLA's backend optimization level 0
# (the same optimized HLO, 35-40% less compile time). Both get the sm_90a and TPU compile tooling
# (scripts/install_sm90_tools.sh, scripts/install_tpu_tools.sh); the lines' pytest runs start as
# soon as each line's own venv is ready. Installs go through scripts/pip_install.sh: uv, with
# pip's find-links and constraints (the py311 venv in 24 s from an empty cache, pip's 102 s; the
# same packages and versions), pip where uv fails (ARENA_PIP=pip: pip only).
#
# Environment (all optional):
#   ARENA_LINES="py311 py313"    which lines to run (e.g. ARENA_LINES=py313 for one)
#   ARENA_PYTHON_311 / _313      interpreters (default: `pyenv prefix 3.11` / `3.13` + /bin/python)
#   ARENA_TORCH="torch==2.13.0+cpu"   the torch requirement of the py311 line
#   ARENA_SERIAL=1               run the lines' pytest one after the other (default: at the same
#                                time; the lines' logs go to .ci-logs/ and their tails are printed)
#   ARENA_COMPILE_GRID=full      both lines compile every case of the grids (default: per line, below)
#   extra arguments              passed to both pytest runs (e.g. -x, -k ...)
set -euo pipefail
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=cpu  # also lets the CUDA plugin load without a GPU (sm_90a compile checks)
# No .pyc compile at install (modules compile when first imported): 2.5x faster installs.
export PIP_NO_COMPILE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
LINES=${ARENA_LINES:-"py311 py313"}
LOGS=.ci-logs
mkdir -p "$LOGS"

interpreter() {  # $1: 3.11 | 3.13
    local var="ARENA_PYTHON_${1/./}"
    if [[ -n "${!var:-}" ]]; then echo "${!var}"; else echo "$(pyenv prefix "$1")/bin/python"; fi
}

setup_line() {  # $1: line name; a fresh venv .venv-<line> with the line's extra and the sm_90a tools
    local line=$1 venv=".venv-$1"
    local python extra
    case $line in
        py311) python=$(interpreter 3.11) extra="test" ;;
        py313) python=$(interpreter 3.13) extra="test-jax" ;;
        *) echo "unknown line $line (expected py311 or py313)" >&2; return 2 ;;
    esac
    "$python" -m venv --clear "$venv"
    (
        . "$venv/bin/activate"
        if [[ $line == py311 ]]; then bash scripts/pip_install.sh -q "${ARENA_TORCH:-torch==2.13.0+cpu}"; fi
        bash scripts/pip_install.sh -q -e ".[$extra]"
        bash scripts/install_sm90_tools.sh
        bash scripts/install_tpu_tools.sh
        python -c 'import sys, jax, jaxlib; print(f"[{sys.argv[1]}] python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}")' "$line"
    )
}

run_line() {  # $1: line name; pytest in its venv ($2...: extra pytest arguments)
    local line=$1; shift
    local env=() grid
    [[ $line == py313 ]] && env=(ARENA_HF_REFERENCE=absent)
    # The heavy compile grids: each in full on one line, its covering subset (every kernel, option
    # and dtype; tests/compile_grid.py) on the other; the lines' union runs every case.
    case $line in
        py311) grid="sm90=cover tpu=full" ;;
        py313) grid="sm90=full tpu=cover" ;;
    esac
    # Seconds per test file, for scripts/test_changed.sh's estimates (tests/conftest.py writes them).
    env+=(ARENA_COMPILE_GRID="${ARENA_COMPILE_GRID:-$grid}" ARENA_DURATIONS_JSON="$PWD/$LOGS/$line.durations.json")
    # -rfEs: every failure, error and skip (with its reason) in the short summary (-rs alone would
    # drop the failures from it); `time`: the line's CPU time (load-independent), on stderr
    local TIMEFORMAT="[$line] pytest: %R s wall, %U s user + %S s system CPU"
    time env "${env[@]}" ".venv-$line/bin/python" -m pytest -p no:cacheprovider -rfEs "$@"
}

start=$SECONDS
declare -A rcs secs
line_job() {  # $1: line; its setup, then at once its pytest (each line starts when ITS venv is ready)
    local line=$1; shift
    local t0=$SECONDS rc
    set +e  # (errexit stays on inside the subshells: a failing step fails its part)
    (set -e; setup_line "$line") > "$LOGS/$line.setup.log" 2>&1; rc=$?
    echo "[$line] setup rc=$rc in $((SECONDS - t0)) s" >> "$LOGS/$line.setup.log"
    if (( rc )); then echo "[$line] setup FAILED:"; tail -30 "$LOGS/$line.setup.log"; echo "$rc 0" > "$LOGS/$line.rc"; set -e; return; fi
    tail -2 "$LOGS/$line.setup.log"
    t0=$SECONDS
    if [[ -n "${ARENA_SERIAL:-}" ]]; then
        (set -e; run_line "$line" "$@") 2>&1 | tee "$LOGS/$line.log"; rc=${PIPESTATUS[0]}
    else
        (set -e; run_line "$line" "$@") > "$LOGS/$line.log" 2>&1; rc=$?
    fi
    echo "$rc $((SECONDS - t0))" > "$LOGS/$line.rc"
    set -e
}
rm -f "$LOGS"/*.rc "$LOGS"/*.log "$LOGS"/*.durations.json  # nothing from an earlier run is read as this one's
if [[ -n "${ARENA_SERIAL:-}" ]]; then
    for line in $LINES; do line_job "$line" "$@"; done
else
    pids=()
    for line in $LINES; do line_job "$line" "$@" & pids+=($!); done
    for pid in "${pids[@]}"; do wait "$pid" || true; done
    for line in $LINES; do
        [[ -f "$LOGS/$line.log" ]] || continue
        echo "==================== [$line] pytest (tail of $LOGS/$line.log) ===================="
        tail -40 "$LOGS/$line.log"
    done
    # A failure's name and its assertion lines, which the tails' skip reasons can push out of view
    for line in $LINES; do
        [[ -f "$LOGS/$line.log" ]] || continue
        if grep -qE '^(FAILED|ERROR) ' "$LOGS/$line.log"; then
            echo "==================== [$line] failures (from $LOGS/$line.log) ===================="
            grep -E '^(FAILED|ERROR) |^E   |^_{3,} .* _{3,}$' "$LOGS/$line.log" | head -80
        fi
    done
fi
for line in $LINES; do read -r rcs[$line] secs[$line] < "$LOGS/$line.rc"; done
status=0
for line in $LINES; do
    grep -h "^\[$line\] pytest: " "$LOGS/$line.log" || true
    echo "[$line] pytest rc=${rcs[$line]} in ${secs[$line]} s"
    [[ ${rcs[$line]} == 0 ]] || status=1
done
echo "total: $((SECONDS - start)) s"
exit $status
