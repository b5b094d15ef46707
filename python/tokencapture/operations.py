"""One store operation timed and its failure logged (a neutral module below the backends).

`Operation(metrics, name, rollout_id)` is `metrics.Timed` (a context manager counting the call
and its latency, a raised exception as a failure) plus a log record for the failures an
operator must see; `log_failure` is that record alone, and `Refusals(metrics, name,
rollout_id)` the context of the checks an async write makes when it is called, which counts
and logs what they refuse (a call refused before it started).
Both token stores (file and PostgreSQL) use them, so one failure logs the same way on either.
The records go to the ``tokencapture.store`` logger, the name they have always had.
"""

from __future__ import annotations

import logging
from types import TracebackType

from tokencapture.metrics import Metrics, Timed
from tokencapture.protocols import (
    TokenCaptureConflictError,
    TokenCaptureCorruptionError,
    TokenCaptureFrozenError,
)

__all__ = ["Operation", "Refusals", "log_failure"]

logger = logging.getLogger("tokencapture.store")


def log_failure(name: str, rollout_id: object, exc: BaseException) -> None:
    """Log the failures an operator must see (fenced refusals only at debug level)."""
    if isinstance(exc, TokenCaptureFrozenError):
        logger.debug("%s refused for fenced rollout %r", name, rollout_id)
    elif isinstance(exc, TokenCaptureConflictError):
        logger.warning("%s: %s", name, exc)
    elif isinstance(exc, TokenCaptureCorruptionError):
        logger.error("%s of rollout %r found corruption: %s", name, rollout_id, exc)
    elif isinstance(exc, OSError):
        logger.warning("%s of rollout %r failed: %s", name, rollout_id, exc)


class Operation(Timed):
    """`Timed`, plus a log record for the failures an operator must see."""

    __slots__ = ("rollout_id",)

    def __init__(self, metrics: Metrics, name: str, rollout_id: object) -> None:
        super().__init__(metrics, name)
        self.rollout_id = rollout_id

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        super().__exit__(exc_type, exc, traceback)
        if exc is not None:
            log_failure(self.operation, self.rollout_id, exc)


class Refusals:
    """The checks an async write makes when it is called (`with Refusals(...): validate`):
    whatever they raise is counted as a failed `name` (with no latency) and logged, then
    propagates."""

    __slots__ = ("metrics", "name", "rollout_id")

    def __init__(self, metrics: Metrics, name: str, rollout_id: object) -> None:
        self.metrics = metrics
        self.name = name
        self.rollout_id = rollout_id

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.metrics.observe(self.name, 0.0, failed=True)
            log_failure(self.name, self.rollout_id, exc)
