"""Counters and latency histograms for store operations, readable from Python.

Each `TokenCaptureStore` keeps a `Metrics` (see `TokenCaptureStore.stats()`); `snapshot()`
merges every live store's figures so a server can export them in one call. Latencies are what
the caller experienced (an async put includes waiting for the worker pool).
"""

from __future__ import annotations

import threading
import time
import weakref
from bisect import bisect_left
from types import TracebackType
from typing import Any

__all__ = ["BUCKET_BOUNDS_SECONDS", "Metrics", "Timed", "snapshot"]

# Upper bounds of the histogram buckets: 16 µs doubling up to ~17 s, then +inf.
BUCKET_BOUNDS_SECONDS: tuple[float, ...] = tuple(16e-6 * 2**i for i in range(21))


class _Operation:
    __slots__ = ("buckets", "count", "failures", "max_seconds", "total_seconds")

    def __init__(self) -> None:
        self.count = 0
        self.failures = 0
        self.total_seconds = 0.0
        self.max_seconds = 0.0
        self.buckets = [0] * (len(BUCKET_BOUNDS_SECONDS) + 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "failures": self.failures,
            "total_seconds": self.total_seconds,
            "max_seconds": self.max_seconds,
            "buckets": list(self.buckets),
        }


class Timed:
    """Times a block for `Metrics.observe`; an exception counts as a failure and propagates.

    A plain class rather than a generator-based context manager: it sits on every put.
    """

    __slots__ = ("metrics", "operation", "started")

    def __init__(self, metrics: Metrics, operation: str) -> None:
        self.metrics = metrics
        self.operation = operation
        self.started = 0.0

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        elapsed = time.perf_counter() - self.started
        self.metrics.observe(self.operation, elapsed, failed=exc_type is not None)


class Metrics:
    """Thread-safe per-operation counters (calls, failures) and latency histograms."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._operations: dict[str, _Operation] = {}
        _live.add(self)

    def observe(self, operation: str, seconds: float, *, failed: bool = False) -> None:
        with self._lock:
            stats = self._operations.get(operation)
            if stats is None:
                stats = self._operations[operation] = _Operation()
            stats.count += 1
            stats.failures += failed
            stats.total_seconds += seconds
            if seconds > stats.max_seconds:
                stats.max_seconds = seconds
            stats.buckets[bisect_left(BUCKET_BOUNDS_SECONDS, seconds)] += 1

    def timed(self, operation: str) -> Timed:
        """A context manager timing the block; an exception counts as a failure."""
        return Timed(self, operation)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """`{operation: {count, failures, total_seconds, max_seconds, buckets}}`.

        `buckets[i]` counts calls that took at most `BUCKET_BOUNDS_SECONDS[i]`; the last bucket
        counts the slower ones.
        """
        with self._lock:
            return {name: stats.as_dict() for name, stats in self._operations.items()}


_live: weakref.WeakSet[Metrics] = weakref.WeakSet()


def snapshot() -> dict[str, dict[str, Any]]:
    """Every live store's figures merged, for a process-wide export."""
    merged: dict[str, dict[str, Any]] = {}
    for metrics in list(_live):
        for name, stats in metrics.snapshot().items():
            into = merged.setdefault(
                name,
                {
                    "count": 0,
                    "failures": 0,
                    "total_seconds": 0.0,
                    "max_seconds": 0.0,
                    "buckets": [0] * (len(BUCKET_BOUNDS_SECONDS) + 1),
                },
            )
            into["count"] += stats["count"]
            into["failures"] += stats["failures"]
            into["total_seconds"] += stats["total_seconds"]
            into["max_seconds"] = max(into["max_seconds"], stats["max_seconds"])
            into["buckets"] = [
                a + b for a, b in zip(into["buckets"], stats["buckets"], strict=True)
            ]
    return merged
