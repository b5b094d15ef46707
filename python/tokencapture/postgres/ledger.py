"""`PostgresCaptureLedger`: the capture ledger on PostgreSQL, with `FileCaptureLedger`'s rows.

Each row is built by the file ledger's own code (`commit_row` and its JSON encoding, NeMo Gym
0.7.0's rows byte for byte), stored whole, and read back through the same functions
(`manifest_from_rows`, the resolution rules). The server decides what the file ledger's core
decides: write once (a commit row is compared with the first row of its call id; equal is a
no-op, different is `CaptureLedgerConflictError` and nothing is written), identical failure
rows are no-ops, a fenced rollout discards writes, and `manifest`/`has_rows` of a fenced
rollout raise `RolloutRetiredError`. Every operation is one function call (sql/003_ledger.sql).
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from tokencapture.fingerprint import FINGERPRINT_VERSION
from tokencapture.ledger_rows import (
    as_commit,
    commit_row,
    conflict_error,
    manifest_from_rows,
    retired_error,
    row_bytes,
    stored_match,
)
from tokencapture.metrics import instrumented
from tokencapture.postgres._client import Client
from tokencapture.protocols import (
    LineageResolution,
    RolloutRemovalPayload,
)
from tokencapture.records import ParentResolutionStatus
from tokencapture.resolution import fingerprint_of, request_copy
from tokencapture.staging_records import CaptureLedgerCommit
from tokencapture.validation import (
    check_failure_args,
    check_resolve_args,
    validate_rollout_id,
    validate_rollout_ids,
)

__all__ = ["PostgresCaptureLedger"]

logger = logging.getLogger(__name__)

_STORED, _DUPLICATE, _CONFLICT, _DISCARDED = 0, 1, 2, 5
_ROOT: Final = LineageResolution(ParentResolutionStatus.ROOT)
_NO_MATCH: Final = LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="no_match")

_RECORD = "SELECT tokencapture.record_ledger_row($1, $2, $3, $4, $5, $6)"
_MANIFEST = "SELECT * FROM tokencapture.ledger_manifest($1)"
_CANDIDATE = "SELECT tokencapture.ledger_candidate($1, $2)"
_RETIRE = "SELECT * FROM tokencapture.ledger_retire($1)"
_DELETE = "SELECT * FROM tokencapture.ledger_delete($1)"

# (rollout id, call id, failure, in manifest, resolvable fingerprint, row bytes)
_Row = tuple[str, str, bool, bool, str | None, bytes]


def _commit_args(commit: object) -> _Row:
    checked = as_commit(commit)
    rollout_id = validate_rollout_id(checked.rollout_id)
    row = commit_row(checked)
    version_ok = row["fingerprint_version"] == FINGERPRINT_VERSION
    fingerprint = row["fingerprint"] if version_ok and isinstance(row["fingerprint"], str) else None
    in_manifest = row.get("staging_key") is not None
    return rollout_id, row["model_call_id"], False, in_manifest, fingerprint, row_bytes(row)


def _failure_args(rollout_id: str, model_call_id: str, reason: str) -> _Row:
    check_failure_args(rollout_id, model_call_id, reason)
    line = row_bytes({"failure_reason": reason, "model_call_id": model_call_id})
    return rollout_id, model_call_id, True, True, None, line


@instrumented(
    "ledger",
    "postgres",
    {
        "record": "record",
        "record_failure": "record_failure",
        "manifest": "manifest",
        "has_rows": "has_rows",
        "resolve": "resolve",
        "retire": "retire",
        "delete": "delete",
    },
)
class PostgresCaptureLedger:
    """A `CaptureLedger` on a PostgreSQL database, shared by every process on every host.

    Connection options as for `PostgresTokenCaptureStore` (pool_size, connect_timeout,
    statement_timeout, synchronous_commit, install_schema, ...).
    """

    def __init__(self, dsn: str, **options: Any) -> None:
        self._client = Client(dsn, **options)

    def __repr__(self) -> str:
        return f"PostgresCaptureLedger({self._client.where!r})"

    def _where(self, rollout_id: str) -> Path:
        return Path(f"{rollout_id}.lineage (PostgreSQL at {self._client.where})")

    # Writes ------------------------------------------------------------------------------

    def record(self, commit: CaptureLedgerCommit | Mapping[str, Any]) -> Coroutine[Any, Any, None]:
        """Publish a completed call; returns once its commit is flushed. Validated when called.

        The same row again is a no-op; a different row for the same model_call_id raises
        `CaptureLedgerConflictError` (nothing written). A retired rollout discards the row.
        """
        return self._record(_commit_args(commit))

    def record_failure(
        self, rollout_id: str, model_call_id: str, reason: str
    ) -> Coroutine[Any, Any, None]:
        """Durably record a call whose capture did not complete (it poisons the manifest)."""
        return self._record(_failure_args(rollout_id, model_call_id, reason))

    async def _record(self, args: _Row) -> None:
        await self._write(args)

    async def _write(self, args: _Row) -> bool:
        """Store a row: True when it is stored (now or already), False when the retired
        rollout discarded it (`FileCaptureLedger`'s answer)."""
        status = await self._client.fetch("val", _RECORD, *args)
        if status == _CONFLICT:
            raise conflict_error(args[0], args[1])
        if status == _DISCARDED:
            logger.debug("ledger row of %r discarded: rollout %r is retired", args[1], args[0])
            return False
        return True

    def record_now(self, commit: CaptureLedgerCommit | Mapping[str, Any]) -> bool:
        """Synchronous `record`; False when the retired rollout discarded the row."""
        return self._client.run_sync(self._write(_commit_args(commit)))

    def record_failure_now(self, rollout_id: str, model_call_id: str, reason: str) -> bool:
        """Synchronous `record_failure`; False when the retired rollout discarded the row."""
        args = _failure_args(rollout_id, model_call_id, reason)
        return self._client.run_sync(self._write(args))

    # Reads -------------------------------------------------------------------------------

    def manifest(self, rollout_id: str) -> Coroutine[Any, Any, dict[str, Any]]:
        """The rollout's token-free ledger as plain wire data (validates as `RolloutManifest`);
        a retired rollout raises `RolloutRetiredError`."""
        return self._manifest(validate_rollout_id(rollout_id))

    async def _manifest(self, rollout_id: str) -> dict[str, Any]:
        row = await self._client.fetch("row", _MANIFEST, rollout_id)
        if row["retired"]:
            raise retired_error(rollout_id)
        rows = list(enumerate(row["lines"]))
        return manifest_from_rows(rollout_id, rows, self._where(rollout_id))

    def has_rows(self, rollout_id: str) -> Coroutine[Any, Any, bool]:
        """Whether any row exists; a retired rollout raises `RolloutRetiredError`."""
        return self._has_rows(validate_rollout_id(rollout_id))

    async def _has_rows(self, rollout_id: str) -> bool:
        row = await self._client.fetch("row", _MANIFEST, rollout_id)
        if row["retired"]:
            raise retired_error(rollout_id)
        return bool(row["row_count"])

    def manifest_now(self, rollout_id: str) -> dict[str, Any]:
        return self._client.run_sync(self.manifest(rollout_id))

    def has_rows_now(self, rollout_id: str) -> bool:
        return self._client.run_sync(self.has_rows(rollout_id))

    def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> Coroutine[Any, Any, LineageResolution]:
        """ROOT, RESOLVED with a token-free `LineageMatch`, or UNRESOLVED ``"no_match"``, by
        `FileCaptureLedger`'s rules (exactly one row of the fingerprint, its context matching).
        The arguments are checked, and the request's fingerprint computed, when this is called:
        content the fingerprint refuses raises then (`ValueError` / `TypeError`).
        """
        # Copied now: the context digest, computed when awaited, reads the request as called.
        items = request_copy(check_resolve_args(rollout_id, request_items))
        return self._resolve(rollout_id, items, fingerprint_of(items))

    async def _resolve(
        self, rollout_id: str, items: list[Any], fingerprint: str
    ) -> LineageResolution:
        if not fingerprint:
            return _ROOT
        line = await self._client.fetch("val", _CANDIDATE, rollout_id, fingerprint)
        if line is None:
            return _NO_MATCH
        # A row it cannot read is corruption; request content the context digest refuses is
        # the request's own error, raised as `conversation_digest` raises it.
        match = stored_match(line, items, self._where(rollout_id), 0)
        if match is None:
            return _NO_MATCH
        return LineageResolution(ParentResolutionStatus.RESOLVED, match=match)

    def resolve_now(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        return self._client.run_sync(self.resolve(rollout_id, request_items))

    def is_process_shared(self) -> bool:
        return True

    # Removal -----------------------------------------------------------------------------

    def retire(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """Fence rollouts and remove their rows, in one transaction. Retiring again is a no-op."""
        return self._batch(_RETIRE, validate_rollout_ids(rollout_ids))

    def delete(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """Remove rollouts' rows and fences in one transaction, so a reused id starts empty."""
        return self._batch(_DELETE, validate_rollout_ids(rollout_ids))

    async def _batch(self, sql: str, ids: list[str]) -> RolloutRemovalPayload:
        if not ids:
            return {"removed": [], "absent": []}
        row = await self._client.fetch("row", sql, ids)
        return {"removed": list(row["removed"]), "absent": list(row["absent"])}

    def retire_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        return self._client.run_sync(self.retire(rollout_ids))

    def delete_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        return self._client.run_sync(self.delete(rollout_ids))

    async def close(self) -> None:
        """Close this ledger's connections (idempotent)."""
        await self._client.close()

    def close_sync(self) -> None:
        self._client.close_sync()
