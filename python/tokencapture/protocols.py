"""Interfaces for captured training tokens: sinks, sources, lineage resolvers and ledgers.

The serving path awaits `TokenSink.put` before it returns the model response; when `put`
returns, the record is durable and visible to every worker's lineage resolver. Trainers read
through `TokenSource.freeze` and retire what they consumed. Nothing here imports a server stack.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, TypedDict, runtime_checkable

from tokencapture.records import ParentResolutionStatus, TokenEntry, as_status

# Imported at run time (not only for type checking) so that `typing.get_type_hints` resolves
# `CaptureLedger.record`. `tokencapture.staging_records` must therefore never import this
# module.
from tokencapture.staging_records import CaptureLedgerCommit

__all__ = [
    "CaptureLedger",
    "LineageMatch",
    "LineageResolution",
    "LineageResolver",
    "RolloutRemovalPayload",
    "RolloutRetiredError",
    "TokenCaptureConflictError",
    "TokenCaptureCorruptionError",
    "TokenCaptureFrozenError",
    "TokenCaptureRetiredError",
    "TokenCaptureSnapshot",
    "TokenSink",
    "TokenSource",
    "install_lineage_store",
    "install_token_sink",
    "install_token_source",
    "installed_lineage_store",
    "installed_token_sink",
    "installed_token_source",
]


class TokenCaptureFrozenError(RuntimeError):
    """A write arrived after its rollout's capture was frozen.

    Drop the late record; do not mark the rollout incomplete (the freeze already judged it).
    """


class TokenCaptureRetiredError(TokenCaptureFrozenError):
    """A write arrived after its rollout was retired; handle it exactly like a frozen write."""


class RolloutRetiredError(LookupError):
    """The ledger of a retired rollout was read; it is gone, not empty."""


class TokenCaptureConflictError(ValueError):
    """A model_call_id was reused with a different payload. The rollout is now incomplete."""


class TokenCaptureCorruptionError(ValueError):
    """A store file holds bytes that were never a valid acknowledged record.

    The message names the file and the byte offset. Nothing is skipped silently.
    """


class RolloutRemovalPayload(TypedDict):
    """The result of retiring or deleting rollouts, as plain wire data."""

    removed: list[str]
    absent: list[str]


@dataclass(frozen=True, slots=True)
class TokenCaptureSnapshot:
    """An immutable view of one rollout's frozen capture records."""

    rollout_id: str
    entries: tuple[TokenEntry, ...]
    incomplete: bool
    snapshot_id: str
    version: int


@dataclass(frozen=True, slots=True)
class LineageMatch:
    """A uniquely verified parent found in a shared lineage store."""

    model_call_id: str
    cumulative_token_ids: tuple[int, ...]
    digest: str
    staging_chain: tuple[str, ...] = ()
    prev_len: int = 0
    chain_hash: str = ""


_MATCH_FIELDS = tuple(field.name for field in fields(LineageMatch))


def _as_match(match: object) -> object:
    """A foreign `LineageMatch` (NeMo Gym's dataclass, same fields) as ours; anything else as
    given (NeMo Gym does not check the type of a match either)."""
    if isinstance(match, LineageMatch) or match is None:
        return match
    if all(hasattr(match, name) for name in _MATCH_FIELDS):
        values = {name: getattr(match, name) for name in _MATCH_FIELDS}
        for name in ("cumulative_token_ids", "staging_chain"):
            if isinstance(values[name], list):
                values[name] = tuple(values[name])
        return LineageMatch(**values)
    return match


@dataclass(frozen=True, slots=True)
class LineageResolution:
    """One immutable request-time parent decision.

    `status` is compared by value and stored as our `ParentResolutionStatus`: NeMo Gym's
    members and the plain strings `"root"`, `"resolved"`, `"unresolved"` are accepted. A
    `LineageMatch` of NeMo Gym's (same fields) is stored as ours.
    """

    status: ParentResolutionStatus
    match: LineageMatch | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        status = self.status
        if type(status) is not ParentResolutionStatus:
            status = as_status(status)
            object.__setattr__(self, "status", status)
        if self.match is not None and type(self.match) is not LineageMatch:
            object.__setattr__(self, "match", _as_match(self.match))
        if status == ParentResolutionStatus.RESOLVED and self.match is None:
            raise ValueError(
                "resolved lineage requires a match (the verified parent it resolved to)"
            )
        if status != ParentResolutionStatus.RESOLVED and self.match is not None:
            raise ValueError(
                f"{status.value} lineage cannot carry a match; only a resolved decision names "
                "its parent"
            )


@runtime_checkable
class TokenSink(Protocol):
    """Receives captured records: the file store or a framework transport."""

    async def put(self, entry: TokenEntry) -> None: ...

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class TokenSource(Protocol):
    """Where a trajectory builder freezes, reads and retires records."""

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot: ...

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool: ...

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload: ...

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload: ...

    async def close(self) -> None: ...


@runtime_checkable
class LineageResolver(Protocol):
    """Resolves request-time lineage from entries a token sink committed."""

    async def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution: ...

    def is_process_shared(self) -> bool: ...

    async def close(self) -> None: ...


@runtime_checkable
class CaptureLedger(LineageResolver, Protocol):
    """Metadata for calls whose token data a framework stages itself."""

    async def record(self, commit: CaptureLedgerCommit) -> None: ...

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None: ...

    async def manifest(self, rollout_id: str) -> dict[str, Any]: ...

    async def has_rows(self, rollout_id: str) -> bool: ...

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload: ...

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload: ...


_INSTALLED_SINK: TokenSink | None = None
_INSTALLED_SOURCE: TokenSource | None = None
_INSTALLED_LINEAGE_STORE: LineageResolver | None = None


def _require_methods(obj: object, role: str, what: str, names: tuple[str, ...]) -> None:
    """Refuse an object without the methods of `role` (`TypeError`, NeMo Gym's wording)."""
    missing = [name for name in names if not callable(getattr(obj, name, None))]
    if missing:
        raise TypeError(
            f"installed {what} lacks required methods: {', '.join(missing)} "
            f"({type(obj).__name__} is not a {role})"
        )


def install_token_sink(sink: TokenSink | None) -> None:
    """Set (or clear, with None) the process-wide default sink."""
    global _INSTALLED_SINK
    if sink is not None:
        _require_methods(sink, "TokenSink", "token sink", ("put", "mark_incomplete", "close"))
    _INSTALLED_SINK = sink


def installed_token_sink() -> TokenSink | None:
    return _INSTALLED_SINK


def install_token_source(source: TokenSource | None) -> None:
    """Set (or clear) the caller-owned source in this process. It is never closed for you.

    The source needs `freeze`, `drop` and `close` (NeMo Gym 0.7.0's `TokenSource`, so its own
    store installs here too); `retire` and `delete` are needed only by callers that use them.
    """
    global _INSTALLED_SOURCE
    if source is not None:
        _require_methods(source, "TokenSource", "token source", ("freeze", "drop", "close"))
    _INSTALLED_SOURCE = source


def installed_token_source() -> TokenSource | None:
    return _INSTALLED_SOURCE


def install_lineage_store(store: LineageResolver | None) -> None:
    """Set (or clear) the process-wide request-time lineage store."""
    global _INSTALLED_LINEAGE_STORE
    if store is not None:
        _require_methods(
            store, "LineageResolver", "lineage store", ("resolve", "is_process_shared", "close")
        )
    _INSTALLED_LINEAGE_STORE = store


def installed_lineage_store() -> LineageResolver | None:
    return _INSTALLED_LINEAGE_STORE
