#!/usr/bin/env bash
# Builds and installs Citus 13.2.2 (test-only: the PostgreSQL backend's distributed tests) into the
# local PostgreSQL 15 from third_party/citus/ (the `git archive v13.2.2` tarball, unchanged, and one
# patch; see third_party/citus/PROVENANCE.md). Debian has no Citus package.
#   bash scripts/build-citus.sh      (as root; ~5 minutes on 2 cores the first time)
# Idempotent: a fast no-op when the installed PostgreSQL 15 already has citus.so of this version.
# Installs the Debian build dependencies (postgresql-server-dev-15, the libraries Citus links) when
# they are missing. Nothing of Citus enters the tokencapture wheel or sdist.
set -euo pipefail
# The body is one function, read whole before it runs (bash reads a script as it goes).
main() {
here="$(cd "$(dirname "$0")/.." && pwd)/third_party/citus"
version=13.2.2
tarball="$here/citus-$version.tar.gz"
patchfile="$here/pg15-have-createdb-privilege.patch"
pg_config="${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}"

installed() {
    # citus.so carries its version string ("Citus 13.2.2 on ..."); the control file names the
    # extension version the SQL scripts install.
    [ -x "$pg_config" ] || return 1
    local so ctl
    so="$("$pg_config" --pkglibdir)/citus.so"
    ctl="$("$pg_config" --sharedir)/extension/citus.control"
    [ -f "$so" ] && [ -f "$ctl" ] && grep -aq "Citus $version on " "$so"
}
if installed; then
    echo "citus: $version already installed in $("$pg_config" --pkglibdir)"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "citus: not installed, and building it needs root (apt-get, make install)" >&2
    exit 1
fi
deps=(postgresql-15 postgresql-server-dev-15 libcurl4-openssl-dev liblz4-dev libzstd-dev libkrb5-dev
    libssl-dev libselinux1-dev libxml2-dev libxslt1-dev libpam0g-dev libreadline-dev zlib1g-dev
    make gcc patch)
missing=()
for d in "${deps[@]}"; do dpkg -s "$d" >/dev/null 2>&1 || missing+=("$d"); done
if [ ${#missing[@]} -gt 0 ]; then
    echo "citus: installing build dependencies: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tar -xzf "$tarball" -C "$work"
cd "$work/citus-$version"
patch -p1 -s < "$patchfile"
echo "citus: building $version against $("$pg_config" --version) (a few minutes)"
./configure -q PG_CONFIG="$pg_config" >/dev/null
# with_llvm=no: no LLVM bitcode for PostgreSQL's JIT (a second compile of every file, which
# the tests never use; it would also need clang).
make -s -j"$(nproc)" with_llvm=no >/dev/null
make -s install with_llvm=no >/dev/null
installed || { echo "citus: installed, but citus.so does not report version $version" >&2; exit 1; }
echo "citus: $version installed into $("$pg_config" --pkglibdir)"
}
main "$@"
