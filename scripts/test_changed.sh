#!/usr/bin/env bash
# The fast developer loop: the tests a change touches, on one JAX line, nearest first.
#
#   scripts/test_changed.sh [BASE] [-- pytest args]
#
# BASE: the git revision to compare with (default: the merge-base with origin/main, else main,
# else HEAD); committed, staged, unstaged and untracked files all count as the change. The test
# files are those scripts/affected_tests.py selects (changed test files, and test files that
# import a changed module, transitively: an ast import graph of the tree as it is now),
# ordered nearest first (a changed test file, then the files that import the changed module
# itself, ...), cheapest first at equal distance.
#
# Environment (all optional):
#   ARENA_VENV=/path/to/venv     the line to run on (default: .venv-py313, the CI line without
#                                torch; ARENA_VENV=.venv-py311 for the Hugging Face parity tests)
#   ARENA_BUDGET_S=280           estimated seconds to spend: files past it are listed, not run
#                                (ARENA_BUDGET_S=0: no budget, run every selected file)
#   ARENA_COMPILE_GRID=cover     (default here) the compile grids' covering subsets (docs/testing.md)
#   ARENA_DRY_RUN=1              print the plan and the pytest command, run nothing
# Estimates come from the last CI run's durations (.ci-logs/<line>.durations.json) or
# tests/file_costs.json; a file with neither counts 10 s.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ARENA_VENV:-.venv-py313}
PY="$VENV/bin/python"
[[ -x $PY ]] || { echo "no interpreter at $PY: set ARENA_VENV to a venv with the project installed (scripts/test_all.sh makes .venv-py313)" >&2; exit 2; }
BASE=()
if [[ $# -gt 0 && $1 != -- ]]; then BASE=("$1"); shift; fi
[[ ${1:-} == -- ]] && shift
line=$(basename "$VENV"); line=${line#.venv-}
mapfile -t plan < <("$PY" scripts/affected_tests.py "${BASE[@]}" --line "$line" --budget "${ARENA_BUDGET_S:-280}" --plan)
run=() later=()
for row in "${plan[@]}"; do
    case $row in
        run\ *) run+=("${row#run }") ;;
        later\ *) later+=("${row#later }") ;;
    esac
done
if (( ${#run[@]} == 0 )); then echo "no test file is touched by the change"; exit 0; fi
echo "running ${#run[@]} test file(s) on $VENV: ${run[*]}"
if (( ${#later[@]} )); then
    echo "past the ${ARENA_BUDGET_S:-280} s budget, NOT run (ARENA_BUDGET_S=0 runs them): ${later[*]}"
fi
env_line=()
[[ $line == py313 ]] && env_line=(ARENA_HF_REFERENCE=absent)
if [[ -n ${ARENA_DRY_RUN:-} ]]; then
    echo "would run: JAX_PLATFORMS=cpu PYTHONPATH=$PWD ARENA_COMPILE_GRID=${ARENA_COMPILE_GRID:-cover} ${env_line[*]} $PY -m pytest -p no:cacheprovider -rs ${run[*]} $*"
    exit 0
fi
set +e
env JAX_PLATFORMS=cpu PYTHONPATH="$PWD" ARENA_COMPILE_GRID="${ARENA_COMPILE_GRID:-cover}" "${env_line[@]}" \
    "$PY" -m pytest -p no:cacheprovider -rs "${run[@]}" "$@"
rc=$?
if (( ${#later[@]} )); then echo "(not run, past the budget: ${later[*]})"; fi
exit $rc
