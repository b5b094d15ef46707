#!/usr/bin/env bash
# Runs the tests that start no server on another CPython than the main run's, against a built
# wheel (abi3: one build for every CPython from 3.11 on) installed in .cache/venv-VERSION with
# the runtime dependencies and the test and gateway extras from PyPI. The tests import the
# installed package (pytest puts tests/, not python/, on sys.path).
# The tests left out (PostgreSQL, Citus, vLLM and the gateway as a process) drive servers through
# their own processes and ran in the main pytest run; what differs between interpreters is in
# the code this run covers (json, asyncio, pickling, error messages).
#
# Usage: bash scripts/pytest-python.sh VERSION WHEEL [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."

if (($# < 2)) || [[ ! -f "$2" ]]; then
    echo "usage: bash scripts/pytest-python.sh VERSION WHEEL [PYTEST ARGS...]" >&2
    exit 2
fi
version="$1"
wheel="$(realpath "$2")"
shift 2
interpreter="$(bash scripts/pyenv-python.sh "$version")"
venv=".cache/venv-$version"
if [[ ! -x "$venv/bin/python" ]]; then
    "$interpreter" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
"$venv/bin/python" - <<'PY' | xargs -d '\n' "$venv/bin/python" -m pip install --quiet
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
# dev: mypy, which tests/test_staging_store_typing.py runs on a caller of the installed package.
print("\n".join([*project["dependencies"], *extras["test"], *extras["gateway"], *extras["dev"]]))
PY
"$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheel"
"$venv/bin/python" -c 'import tokencapture, tokencapture._core as core; print("tokencapture from", tokencapture.__file__, "core", core.__file__)'

exec "$venv/bin/python" -m pytest -W error -q -p no:cacheprovider \
    --ignore-glob='tests/test_postgres*' --ignore-glob='tests/test_citus*' \
    --ignore-glob='tests/test_*vllm*' --ignore=tests/test_gateway_process.py \
    --ignore=tests/test_gateway_postgres.py --ignore=tests/test_cli_postgres.py "$@"
