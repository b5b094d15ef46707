"""Answers of the native lineage matcher, shared by every resolver (a neutral module below them).

The file, in-memory and PostgreSQL resolvers index rows in a `_core` matcher
(`_core.FileLineage` or `_core.MemoryLineage`); `resolve_native` asks it and turns its raw answer
into a `LineageResolution` (`resolution_of`), falling back to `tokencapture.fingerprint` for
request items the native hashes do not cover (`resolve_in_python`). See docs/architecture.md
for the layer map.
"""

from __future__ import annotations

from typing import Any, Final

from tokencapture import _core
from tokencapture.fingerprint import assistant_fingerprint, conversation_digest
from tokencapture.protocols import LineageMatch, LineageResolution
from tokencapture.records import ParentResolutionStatus

__all__ = [
    "DEFAULT_CACHED_ROLLOUTS",
    "DEFAULT_CACHED_TOKENS",
    "ROOT",
    "NativeResolver",
    "resolution_of",
    "resolve_in_python",
    "resolve_native",
]

DEFAULT_CACHED_ROLLOUTS: Final[int] = 256
"""Rollouts whose indexes a durable-log resolver (file, PostgreSQL) keeps by default."""
DEFAULT_CACHED_TOKENS: Final[int] = 4_000_000
"""Tokens of verified cumulative sequences a durable-log resolver caches by default."""

ROOT: Final[LineageResolution] = LineageResolution(ParentResolutionStatus.ROOT)
"""The answer for a request with no model-authored turn."""

NativeResolver = _core.FileLineage | _core.MemoryLineage


def resolution_of(
    raw: tuple[str, str | None, tuple[int, ...] | None, str, str],
) -> LineageResolution:
    """The `LineageResolution` of a native answer `(status, call_id, tokens, digest, reason)`."""
    status, call_id, tokens, digest, reason = raw
    if status == "resolved":
        assert call_id is not None and tokens is not None
        return LineageResolution(
            ParentResolutionStatus.RESOLVED, LineageMatch(call_id, tokens, digest)
        )
    if status == "root":
        return ROOT
    return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=reason)


def resolve_native(native: NativeResolver, rollout_id: str, items: list[Any]) -> LineageResolution:
    """Resolve by the native matcher; the arguments are already checked (`check_resolve_args`)."""
    raw = native.resolve(rollout_id, items)
    if raw is not None:
        return resolution_of(raw)
    return resolve_in_python(native, rollout_id, items)


def resolve_in_python(
    native: NativeResolver, rollout_id: str, items: list[Any]
) -> LineageResolution:
    """Items the native hashes do not cover: tokencapture.fingerprint decides (or raises)."""
    fingerprint = assistant_fingerprint(items)
    if not fingerprint:
        return ROOT
    digests: dict[int, str] = {}
    while True:
        step = native.resolve_hashed(rollout_id, fingerprint, len(items), digests)
        if isinstance(step, tuple):
            return resolution_of(step)
        for length in step:
            digests[length] = conversation_digest(items[:length])
