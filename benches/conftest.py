"""Fixtures of the micro benchmarks (`python -m pytest benches --benchmark-only`).

Not collected by the normal test run: the project's pytest `testpaths` is `tests`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parent
if str(BENCHES) not in sys.path:
    sys.path.insert(0, str(BENCHES))

SCRATCH = BENCHES / ".scratch"


@pytest.fixture
def scratch_dir() -> Iterator[Path]:
    """A directory on the real disk (not /tmp, which may be tmpfs and fsync for free)."""
    SCRATCH.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="micro-", dir=SCRATCH))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
