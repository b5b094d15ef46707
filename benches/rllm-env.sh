#!/usr/bin/env bash
# rLLM's capture gateway (PyPI `rllm-model-gateway`), the peer that benches/bench_gateway.py
# measures beside ours, in a venv of its own: it is not a dependency of tokencapture (its
# FastAPI/pydantic/httpx pins are its own), so it never goes into the project's venv.
# Prints the venv's python on stdout (its only output there; progress goes to stderr):
#
#     python benches/bench_gateway.py --rllm-python "$(bash benches/rllm-env.sh)"
#
# The venv lives in the machine-level cache the engine's venv uses (scripts/cache-dir.sh:
# /var/cache/tokencapture as root), as rllm-model-gateway-<version>.
# Installed once (a few seconds with a warm pip cache), then only checked: the stamp file
# `.installed`, written last, holds the version, so an interrupted install is redone.
set -euo pipefail
umask 022

version="${RLLM_GATEWAY_VERSION:-0.1.0}"

cache="$(bash "$(cd "$(dirname "$0")" && pwd)/../scripts/cache-dir.sh")"
venv="$cache/rllm-model-gateway-$version"
stamp="$venv/.installed"
key="rllm-model-gateway $version"

say() { printf '%s\n' "$*" >&2; }

installed() {
    [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && "$venv/bin/python" -c 'import rllm_model_gateway' 2>/dev/null
}

if installed; then
    printf '%s\n' "$venv/bin/python"
    exit 0
fi
mkdir -p "$cache"
exec 9>"$cache/.rllm-model-gateway-$version.lock"
flock 9
if installed; then
    printf '%s\n' "$venv/bin/python"
    exit 0
fi

python="${TOKENCAPTURE_RLLM_BASE_PYTHON:-$(command -v python3.11 || command -v python3)}"
say "rllm-env: installing rllm-model-gateway $version into $venv"
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "rllm-model-gateway==$version" >&2
"$venv/bin/python" -c 'import rllm_model_gateway' >&2
printf '%s\n' "$key" >"$stamp"
say "rllm-env: installed"
printf '%s\n' "$venv/bin/python"
