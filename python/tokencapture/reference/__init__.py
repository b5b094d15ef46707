"""A pure-Python `TokenCaptureStore`: same API, semantics and on-disk format as the Rust store.

It is the baseline of the benchmarks and the oracle of the differential tests, never a silent
fallback: import it explicitly (`from tokencapture.reference import TokenCaptureStore`).
"""

from __future__ import annotations

from tokencapture.reference.store import TokenCaptureStore

__all__ = ["TokenCaptureStore"]
