"""Exceptions of the staging stores (every backend raises these).

A fetch of a key that is not staged raises `StagingKeyError` (a `KeyError` naming the key);
a key of a retired rollout raises its subclass `StagingKeyRetiredError`. Stages of a retired
rollout and conflicting restages are refused with the token store's own
`TokenCaptureRetiredError` and `TokenCaptureConflictError` words (reported by ``stage`` as
``StageResult(ok=False, error=...)``); damaged stored bytes raise `TokenCaptureCorruptionError`.
"""

from __future__ import annotations

__all__ = ["StagingKeyError", "StagingKeyRetiredError"]


class StagingKeyError(KeyError):
    """A requested staging key is not staged (never, or no longer: deleted)."""

    def __str__(self) -> str:
        # KeyError quotes its argument; the message is a sentence that already names the key.
        return str(self.args[0]) if self.args else ""


class StagingKeyRetiredError(StagingKeyError):
    """A requested staging key belongs to a retired rollout."""
