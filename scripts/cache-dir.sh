#!/usr/bin/env bash
# The machine-level cache the test tools' venvs live in (vLLM's, rLLM's gateway): prints
# $TOKENCAPTURE_CACHE_DIR if set, else /var/cache/tokencapture as root, else
# ${XDG_CACHE_HOME:-~/.cache}/tokencapture.
set -euo pipefail
if [ -n "${TOKENCAPTURE_CACHE_DIR:-}" ]; then
    printf '%s\n' "$TOKENCAPTURE_CACHE_DIR"
elif [ "$(id -u)" = 0 ]; then
    printf '%s\n' /var/cache/tokencapture
else
    printf '%s\n' "${XDG_CACHE_HOME:-$HOME/.cache}/tokencapture"
fi
