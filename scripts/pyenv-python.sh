#!/usr/bin/env bash
# Prints the path of a CPython interpreter: for a version such as "3.13", the newest 3.13.x
# under pyenv's root; for a path, the path itself. Fails (exit 1, a reason on stderr) when pyenv
# has no such version.
#
# Usage: bash scripts/pyenv-python.sh VERSION|PATH
set -euo pipefail

want="${1:?usage: bash scripts/pyenv-python.sh VERSION|PATH}"
if [[ "$want" == */* ]]; then
    printf '%s\n' "$want"
    exit 0
fi
pyenv_root="${PYENV_ROOT:-}"
[[ -n "$pyenv_root" ]] || pyenv_root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
found="$(find "$pyenv_root/versions" -maxdepth 1 -name "$want.*" -printf '%f\n' 2>/dev/null |
    grep -E "^${want//./\\.}\.[0-9]+$" | sort -V | tail -n 1 || true)"
if [[ -z "$found" ]]; then
    echo "no CPython $want under $pyenv_root/versions (pyenv install $want)" >&2
    exit 1
fi
printf '%s\n' "$pyenv_root/versions/$found/bin/python"
