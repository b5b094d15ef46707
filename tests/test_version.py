"""Packaging facts a user relies on.

The version is written in one place, Cargo.toml: pyproject.toml declares it dynamic (maturin
fills it in from Cargo.toml), and `tokencapture.__version__` is the installed distribution's.
Where the compiled core cannot be loaded, `import tokencapture` raises an ImportError that names
the platform and what is supported, instead of a bare loader error.

`scripts/wheel-smoke.sh` runs this file against an installed wheel, from a copy outside the
source tree: `TOKENCAPTURE_SOURCE_ROOT` then names the checkout whose Cargo.toml to compare with.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import tokencapture

SOURCE_ROOT = Path(
    os.environ.get("TOKENCAPTURE_SOURCE_ROOT") or Path(__file__).resolve().parents[1]
)


def cargo_version() -> str:
    manifest = tomllib.loads((SOURCE_ROOT / "Cargo.toml").read_text(encoding="utf-8"))
    value = manifest["package"]["version"]
    assert isinstance(value, str)
    return value


def test_pyproject_takes_the_version_from_cargo() -> None:
    project = tomllib.loads((SOURCE_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]


def test_installed_version_is_cargos() -> None:
    expected = cargo_version()
    assert version("tokencapture") == expected
    assert tokencapture.__version__ == expected


def import_in_subprocess(
    prelude: str, tmp_path: Path, pythonpath: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.fspath(pythonpath)
    return subprocess.run(
        [sys.executable, "-c", f"{prelude}\nimport tokencapture\n"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def last_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def test_a_core_that_does_not_load_names_the_platform(tmp_path: Path) -> None:
    # A copy of the package whose extension module is not a loadable library: the dynamic
    # loader refuses it, as it refuses a core built for another platform or a newer libc.
    package = Path(tokencapture.__file__).resolve().parent
    copy = tmp_path / "site" / "tokencapture"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    (copy / "_core.abi3.so").write_bytes(b"this is not a shared library\n")

    result = import_in_subprocess("", tmp_path, pythonpath=tmp_path / "site")

    assert result.returncode != 0
    message = last_line(result.stderr)
    assert message.startswith("ImportError: tokencapture's compiled core (tokencapture._core)")
    assert f"{platform.system()} {platform.machine()}" in message
    assert f"CPython {platform.python_version()}" in message
    # The loader's own words are kept, and they are about the copy, not the installed package.
    assert os.fspath(copy / "_core.abi3.so") in message
    assert "manylinux2014" in message
    assert "musllinux_1_2" in message
    assert "--no-binary tokencapture" in message


def test_windows_is_refused_by_name(tmp_path: Path) -> None:
    # No core is ever built for Windows; pretend to be there with the core missing. The standard
    # modules the package imports first are loaded before the pretence (some pick Windows-only
    # modules by sys.platform).
    prelude = (
        "import importlib.metadata, platform, sys\n"
        "sys.modules['tokencapture._core'] = None\n"
        "sys.platform = 'win32'"
    )

    result = import_in_subprocess(prelude, tmp_path)

    assert result.returncode != 0
    message = last_line(result.stderr)
    assert message.startswith("ImportError: tokencapture does not support Windows (")
    assert "flock" in message
    assert "WSL" in message
