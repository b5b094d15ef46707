"""pytest parameters shared by the reliability tests.

Kept out of `common.py`, which the child-process scripts import without pytest.
"""

from __future__ import annotations

import pytest
from tests.reliability.common import REFERENCE_MISSING_REASON, reference_available

__all__ = ["NEEDS_REFERENCE", "STORES"]

NEEDS_REFERENCE = pytest.mark.skipif(not reference_available(), reason=REFERENCE_MISSING_REASON)

# Every reliability scenario runs against both stores: the same file-level guarantees hold.
STORES = [
    pytest.param("rust", id="rust"),
    pytest.param("reference", id="reference", marks=NEEDS_REFERENCE),
]
