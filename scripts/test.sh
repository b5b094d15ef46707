#!/usr/bin/env bash
# The whole test suite: installs what it needs (Rust crates from crates.io, Python packages from
# PyPI), then runs the Rust checks, the Python linters and type checker, and pytest.
# Usage: bash scripts/test.sh            (TOKENCAPTURE_LONG=1 adds the long crash/soak runs)
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

step "install (release build of the Rust extension + test tools)"
python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
python -m pip install --quiet -e ".[test,dev,gateway]"

step "NeMo Gym 0.7.0 as a test oracle (its sdist from PyPI, unpacked under .cache/)"
TOKENCAPTURE_NEMO_GYM="$(bash scripts/nemo-gym-oracle.sh)"
export TOKENCAPTURE_NEMO_GYM TOKENCAPTURE_REQUIRE_NEMO_GYM=1

step "PostgreSQL and PgBouncer for the PostgreSQL backend's tests (Debian's packages when missing)"
missing=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
    else
        echo "missing and this is not root: install the ${missing[*]} package(s)" >&2
    fi
fi
export TOKENCAPTURE_REQUIRE_POSTGRES=1

step "Citus 13.2.2 for the distributed PostgreSQL tests (built from third_party/citus when missing)"
bash scripts/build-citus.sh
export TOKENCAPTURE_REQUIRE_CITUS=1

step "vLLM on CPU for the real-engine tests (its own ~6 GB venv in a machine-level cache: installed once, then a check)"
TOKENCAPTURE_VLLM_PYTHON="$(bash scripts/vllm-env.sh)"
export TOKENCAPTURE_VLLM_PYTHON TOKENCAPTURE_REQUIRE_VLLM=1

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy (core, and core + bindings) -D warnings"
cargo clippy --quiet --all-targets -- -D warnings
cargo clippy --quiet --features python -- -D warnings
step "cargo test (the core, no Python)"
cargo test --quiet
step "cargo doc -D warnings (broken and private intra-doc links)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet

step "ruff"
python -m ruff check python tests benches
python -m ruff format --check python tests benches
step "mypy --strict (package, including the _core.pyi stub)"
python -m mypy
python -m mypy.stubtest tokencapture._core

step "docs: mkdocs build --strict (broken links and unresolved references fail)"
# The docs extra's packages only (pip install -e ".[docs]" would rebuild the extension).
python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))' \
    | xargs python -m pip install --quiet
docs_site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --site-dir "$docs_site"
rm -rf "$docs_site"

step "wheels: sdist + manylinux2014 abi3 wheel (zig), auditwheel; the wheel in fresh CPython 3.11/3.12/3.13 venvs, no Rust on PATH"
wheel="$(bash scripts/build-wheels.sh dist | tail -n 1)"
bash scripts/wheel-smoke.sh "$wheel" 3.11 3.12 3.13

step "pytest"
python -m pytest -W error -q

step "pytest on CPython 3.13 (NeMo Gym's own interpreter: its wheels need >= 3.13), against the wheel: the tests that start no server"
bash scripts/pytest-python.sh 3.13 "$wheel"
