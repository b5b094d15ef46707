#!/usr/bin/env bash
# Paired measurement of the PostgreSQL client: asyncpg against the `postgres` Rust crate driven
# from a fixed pool of native threads (docs/postgres.md, "Client choice").
#
#   benches/pg_client/run.sh [--repeats 6] [--rollouts 512] [--batch 64 [11]] [--clients ...]
#                            [--json FILE]
#
# Builds this standalone crate (not part of the main build) into a temporary target directory
# at low priority, puts the module where the driver imports it, and runs driver.py, which
# starts a throwaway PostgreSQL server (tests/pg_server.py) on this machine. Needs the
# tokencapture package installed with its postgres extra and PostgreSQL's server binaries.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${TMPDIR:-/tmp}/pg_client_target}"
nice -n 10 cargo build --release -j 2 --manifest-path "$here/Cargo.toml"
module_dir="$CARGO_TARGET_DIR/module"
mkdir -p "$module_dir"
cp "$CARGO_TARGET_DIR/release/libpg_client_bench.so" "$module_dir/pg_client_bench.abi3.so"
exec python "$here/driver.py" --module-dir "$module_dir" "$@"
