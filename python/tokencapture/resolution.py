"""Answers of the native lineage matcher, shared by every resolver (a neutral module below them).

The file, in-memory and PostgreSQL resolvers index rows in a `_core` matcher
(`_core.FileLineage` or `_core.MemoryLineage`); `resolve_native` asks it and turns its raw answer
into a `LineageResolution` (`resolution_of`), falling back to `tokencapture.fingerprint` for
request items the native hashes do not cover (`resolve_in_python`). See docs/architecture.md
for the layer map.

An async resolve is prepared when it is called (`prepare`): the request's assistant fingerprint
is computed then, natively where the port covers the items and by `tokencapture.fingerprint`
otherwise, so content the fingerprint refuses raises at the call, with the error awaiting it
raised before. The fingerprint is every resolve's first step, over every item, whatever the
resolver holds, so this refuses exactly what awaiting refused. The conversation digests are
computed only for candidates whose fingerprint matches (as NeMo Gym 0.7.0 computes them), so
what only they refuse (the content of an item the fingerprint does not read: a user turn's,
a tool result's) still depends on the rollout's calls, and is refused when awaited, if at all.

The answer is the request's as it was when called, whichever path computes it: the native job
holds the items copied natively, and items the port does not cover are copied (`request_copy`)
before Python fingerprints them, so a list changed between the call and the await (a message
inserted, a content edited) does not change the answer. Beside a job only the list is copied:
what Python digests after the job (a context digest the port declines, a ledger's candidate)
reads the items' contents as they are then.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple

from tokencapture import _core
from tokencapture.fingerprint import assistant_fingerprint, conversation_digest
from tokencapture.protocols import LineageMatch, LineageResolution
from tokencapture.records import ParentResolutionStatus

__all__ = [
    "DEFAULT_CACHED_ROLLOUTS",
    "DEFAULT_CACHED_TOKENS",
    "ROOT",
    "NativeResolver",
    "Prepared",
    "fingerprint_of",
    "prepare",
    "prepare_in_python",
    "request_copy",
    "resolution_of",
    "resolve_in_python",
    "resolve_native",
    "resolve_prepared",
]

DEFAULT_CACHED_ROLLOUTS: Final[int] = 256
"""Rollouts whose indexes a durable-log resolver (file, PostgreSQL) keeps by default."""
DEFAULT_CACHED_TOKENS: Final[int] = 4_000_000
"""Tokens of verified cumulative sequences a durable-log resolver caches by default."""

ROOT: Final[LineageResolution] = LineageResolution(ParentResolutionStatus.ROOT)
"""The answer for a request with no model-authored turn."""

NativeResolver = _core.FileLineage | _core.MemoryLineage


class Prepared(NamedTuple):
    """A resolve prepared when it was called (`prepare`)."""

    job: _core.LineageJob | None
    """The native job, the items copied natively; None when the items need Python's hashes."""
    fingerprint: str
    """The request's assistant fingerprint ("" for a root)."""
    items: list[Any]
    """The request items for Python's digests, as they were when called: a copy
    (`request_copy`) where Python hashes the request; beside a native job, which holds its
    own copy of the contents, a copy of the list only, for what Python reads after the job
    (a ledger's candidates, a context digest the port declines)."""


def request_copy(items: list[Any]) -> list[Any]:
    """The request items as they are now, for hashes computed later: every plain `dict`,
    `list` and `tuple` copied, recursively. Anything else is kept, not copied: strings and
    numbers cannot change, and an object of another type (a `dict` subclass) is read as it is
    when hashed. An item nested deeper than Python's recursion allows is kept as it is (no
    error at the call: a hash that reads that deep refuses it, a field no hash reads is
    harmless)."""
    copied: list[Any] = []
    for item in items:
        try:
            copied.append(_copy(item))
        except RecursionError:
            copied.append(item)
    return copied


def _copy(value: Any) -> Any:
    kind = type(value)
    if kind is dict:
        return {key: _copy(inner) for key, inner in value.items()}
    if kind is list:
        return [_copy(inner) for inner in value]
    if kind is tuple:
        return tuple(_copy(inner) for inner in value)
    return value


def fingerprint_of(items: list[Any]) -> str:
    """`assistant_fingerprint(items)`, by the native port where it covers the items: the same
    value, or, from `tokencapture.fingerprint`, the same error."""
    fingerprint = _core.request_fingerprint(items)
    return assistant_fingerprint(items) if fingerprint is None else fingerprint


def prepare(native: NativeResolver, rollout_id: str, items: list[Any]) -> Prepared:
    """Prepare a resolve when it is called (the arguments already checked by
    `check_resolve_args`): the items copied and fingerprinted natively (a job), or, for items
    the port does not cover, copied and fingerprinted by `tokencapture.fingerprint`
    (`prepare_in_python`). Raises what the fingerprint raises (`ValueError` / `TypeError`),
    which is what awaiting the resolve raised; the fingerprint is not computed again when the
    resolve runs."""
    job = native.prepare(rollout_id, items)
    if job is not None:
        return Prepared(job, job.fingerprint, list(items))
    return prepare_in_python(items)


def prepare_in_python(items: list[Any]) -> Prepared:
    """`prepare` by `tokencapture.fingerprint` alone: the items copied (`request_copy`), then
    fingerprinted. The pure-Python reference resolver prepares its resolves so."""
    copied = request_copy(items)
    return Prepared(None, assistant_fingerprint(copied), copied)


def resolve_prepared(
    native: _core.MemoryLineage, rollout_id: str, prepared: Prepared
) -> LineageResolution:
    """Resolve a prepared request by an in-process matcher (`resolve_native`'s answer), as
    the request was when prepared (`prepared.items`, never the caller's list again)."""
    job, fingerprint, copied = prepared
    if not fingerprint:
        return ROOT
    if job is not None:
        raw = native.resolve_prepared(job)
        if raw is not None:
            return resolution_of(raw)
    return resolve_in_python(native, rollout_id, copied, fingerprint)


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
    native: NativeResolver, rollout_id: str, items: list[Any], fingerprint: str | None = None
) -> LineageResolution:
    """Items the native hashes do not cover: tokencapture.fingerprint decides (or raises).
    `fingerprint`: the items' fingerprint when it is known already (`prepare`)."""
    if fingerprint is None:
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
