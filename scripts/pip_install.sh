#!/usr/bin/env bash
# `pip install "$@"` into the active Python environment (the `python` on PATH), done by uv when it
# can: the same requirements, 10x faster (CI's setup of a line: ~80 s of pip, ~8 s of uv). uv
# reads no pip configuration, so pip's find-links and constraint files are handed to it; if uv
# cannot be had or its install fails, pip does the install. ARENA_PIP=pip: pip only.
set -euo pipefail
python=$(command -v python)
if [[ "${ARENA_PIP:-uv}" != pip ]]; then
    uv="$(dirname "$python")/uv"
    [[ -x "$uv" ]] || "$python" -m pip install -q uv > /dev/null 2>&1 || true
    if [[ -x "$uv" ]]; then
        args=()
        for links in ${PIP_FIND_LINKS:-} $("$python" -m pip config get global.find-links 2> /dev/null || true); do
            args+=(--find-links "$links")
        done
        for file in ${PIP_CONSTRAINT:-} $("$python" -m pip config get global.constraint 2> /dev/null || true); do
            args+=(--constraint "$file")
        done
        if "$uv" pip install --python "$python" "${args[@]}" "$@"; then exit 0; fi
        echo "scripts/pip_install.sh: uv could not install $*; pip installs it" >&2
    fi
fi
exec "$python" -m pip install "$@"
