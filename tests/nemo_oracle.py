"""NeMo Gym 0.7.0's own capture modules, as a test oracle.

`scripts/nemo-gym-oracle.sh` unpacks them from the PyPI sdist under `.cache/`; this module puts
that directory (or `$TOKENCAPTURE_NEMO_GYM`) on `sys.path`. `scripts/test.sh` (and so CI) sets
`TOKENCAPTURE_REQUIRE_NEMO_GYM=1`: there a missing oracle fails the run instead of skipping the
interoperability tests.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

ORACLE_DIR = Path(
    os.environ.get("TOKENCAPTURE_NEMO_GYM")
    or Path(__file__).resolve().parents[1] / ".cache" / "nemo-gym-0.7.0" / "shim"
)
if (ORACLE_DIR / "nemo_gym").is_dir() and str(ORACLE_DIR) not in sys.path:
    sys.path.append(str(ORACLE_DIR))

REQUIRED = os.environ.get("TOKENCAPTURE_REQUIRE_NEMO_GYM", "") not in ("", "0")


def import_nemo(name: str) -> ModuleType:
    """Import `nemo_gym.token_id_capture.<name>`, or skip the calling test module (fail when
    the oracle is required)."""
    try:
        return importlib.import_module(f"nemo_gym.token_id_capture.{name}")
    except ImportError as error:
        if REQUIRED:
            raise
        pytest.skip(
            f"NeMo Gym is not importable ({error}): run `bash scripts/nemo-gym-oracle.sh` "
            "to unpack its 0.7.0 sdist as a test oracle",
            allow_module_level=True,
        )
