#!/usr/bin/env bash
# Lays out NeMo Gym 0.7.0's `nemo_gym.token_id_capture` as an importable test oracle, from its
# source distribution on PyPI (NeMo Gym is not a dependency: its wheels need Python >= 3.13 and a
# server stack; its capture modules need only pydantic and orjson).
#
#   bash scripts/nemo-gym-oracle.sh        -> prints the directory to put on PYTHONPATH
#
# The sdist is unpacked under .cache/ (git-ignored) and used as is; nothing of it is committed.
# The package's own `nemo_gym/__init__.py` (which sets up directories and a server config) is
# replaced by an empty one, so only `nemo_gym.token_id_capture` is importable.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.7.0
cache=".cache/nemo-gym-$version"
shim="$cache/shim"
if [ ! -f "$shim/nemo_gym/token_id_capture/store.py" ]; then
    rm -rf "$cache"
    mkdir -p "$cache/sdist" "$shim/nemo_gym"
    python -m pip download --quiet --no-deps --no-binary :all: --ignore-requires-python \
        "nemo-gym==$version" -d "$cache/sdist" >&2
    tar -xzf "$cache/sdist/nemo_gym-$version.tar.gz" -C "$cache/sdist"
    cp -r "$cache/sdist/nemo_gym-$version/nemo_gym/token_id_capture" "$shim/nemo_gym/"
    : >"$shim/nemo_gym/__init__.py"
fi
cd "$shim" && pwd
