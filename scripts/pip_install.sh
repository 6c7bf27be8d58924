#!/usr/bin/env bash
# `pip install "$@"` into the active Python environment (the `python` on PATH), done by uv when it
# can: the same requirements, 10x faster (CI's setup of a line: ~80 s of pip, ~8 s of uv). uv
# reads no pip configuration, so pip's find-links, constraint files and certificate bundle are
# handed to it; if uv cannot be had or its install fails, pip does the install. ARENA_PIP=pip: pip only.
set -euo pipefail
python=$(command -v python)
if [[ "${ARENA_PIP:-uv}" != pip ]]; then
    uv="$(dirname "$python")/uv"
    [[ -x "$uv" ]] || "$python" -m pip install -q uv > /dev/null 2>&1 || true
    if [[ -x "$uv" ]]; then
        # pip's settings (its config files and PIP_* variables, as `pip config list` shows them)
        config=$("$python" -m pip config list 2> /dev/null || true)
        setting() { sed -n "s/^[^=]*\.$1='\(.*\)'\$/\1/p" <<< "$config" | head -1; }
        args=()
        for links in ${PIP_FIND_LINKS:-} $(setting find-links); do args+=(--find-links "$links"); done
        for file in ${PIP_CONSTRAINT:-} $(setting constraint); do args+=(--constraint "$file"); done
        cert=${PIP_CERT:-$(setting cert)}  # a registry behind a proxy with its own CA: uv's TLS trusts it too
        [[ -z "$cert" || -n "${SSL_CERT_FILE:-}" ]] || export SSL_CERT_FILE="$cert"
        if "$uv" pip install --python "$python" "${args[@]}" "$@"; then exit 0; fi
        echo "scripts/pip_install.sh: uv could not install $*; pip installs it" >&2
    fi
fi
exec "$python" -m pip install "$@"
